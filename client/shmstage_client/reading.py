"""Bytes to tensors on a device: large pieces, several threads, verified as they pass.

Restoring a checkpoint moves its bytes from host memory — a read-only mapping of the
daemon's segments, or a data file's pages — to a device, and checks every tensor against the
CRC-32C its manifest recorded. Tensor by tensor, on one thread, that runs at the speed of
one core and of one small copy at a time (a 4 GiB ``load()`` reached 4 GB/s to an H200).

Here the source is cut into chunks of a few tens of MiB. Several threads each take the
next chunk, bring its bytes into host memory the device can read at full speed — for a
file, a read into one of a few pinned buffers (into the destination itself on the CPU); for
the daemon's memory, registering the mapped range with CUDA as read-only
(``cudaHostRegister(..., cudaHostRegisterReadOnly)``, unregistered before the mapping goes)
— checksum the parts of tensors the chunk holds, and queue its copy on one stream. The
tensors come back as views of one destination buffer at their offsets (a tensor that is
not aligned for its dtype there gets its own copy). A tensor's checksum is combined from
those of its parts (``shmstage.checksums.combine``), in whatever order threads finished.
"""

from __future__ import annotations

import abc
import bisect
import concurrent.futures
import ctypes
import logging
import os
import queue
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import crc32c
import torch

from shmstage.checkpoint import ChecksumError
from shmstage.checksums import combine
from shmstage_client import pinning

log = logging.getLogger("shmstage.client")

#: Bytes per chunk from a mapping (one registration and one copy each), and per read from
#: a file (the size of each pinned staging buffer).
MAPPED_CHUNK: Final = 64 << 20
FILE_CHUNK: Final = 16 << 20
MAX_THREADS: Final = 8


@dataclass(frozen=True)
class Placement:
    """One tensor: where its bytes are in the source (and the destination), what it is."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    #: What the checksum must be; None when nothing recorded one (a checkpoint still being
    #: written has no manifest yet).
    crc32c: int | None = None


class Source(abc.ABC):
    """``size`` bytes somewhere, brought to host memory a chunk at a time."""

    size: int
    #: Where the bytes are, for messages.
    where: str

    @property
    def mapped(self) -> bool:
        """True when the bytes already are in this process's memory (``view``), False
        when they must be read into a buffer (``read_into``)."""
        return False

    def view(self, start: int, end: int) -> memoryview:
        raise NotImplementedError

    def read_into(self, start: int, buffer: memoryview) -> None:
        raise NotImplementedError


class MappedSource(Source):
    """Bytes mapped into this process (the daemon's segments, read-only)."""

    def __init__(self, address: int, size: int, where: str) -> None:
        self.address, self.size, self.where = address, size, where

    @property
    def mapped(self) -> bool:
        return True

    def view(self, start: int, end: int) -> memoryview:
        return memoryview((ctypes.c_char * (end - start)).from_address(self.address + start))


class FileSource(Source):
    """``size`` bytes of an open file from ``offset`` on (a data file's tensor data)."""

    def __init__(self, fd: int, offset: int, size: int, where: str) -> None:
        self.fd, self.offset, self.size, self.where = fd, offset, size, where

    def read_into(self, start: int, buffer: memoryview) -> None:
        done = 0
        while done < len(buffer):
            got = os.preadv(self.fd, [buffer[done:]], self.offset + start + done)
            if got == 0:
                raise OSError(f"{self.where}: the file ended {len(buffer) - done} bytes early")
            done += got


def transfer(
    source: Source,
    placements: Sequence[Placement],
    device: torch.device,
    *,
    verify: bool = True,
    threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Every placement's tensor on ``device``, its checksum verified (with ``verify`` and
    a recorded one); raises ChecksumError naming the first tensor that does not match."""
    return _Transfer(source, placements, device, verify, threads).run()


def _host_buffer(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU uint8 tensor, writable (``preadv`` reads into them)."""
    return memoryview((ctypes.c_char * tensor.numel()).from_address(tensor.data_ptr()))


def _as_tensor(view: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only mapping: only ever read from
        return torch.frombuffer(view, dtype=torch.uint8)


class _Staging:
    """Pinned buffers a file's chunks pass through on their way to a device: taken by a
    reader, given back with the event after which the device is done with it."""

    def __init__(self, count: int, size: int) -> None:
        self._free: queue.Queue[tuple[torch.Tensor, torch.cuda.Event | None]] = queue.Queue()
        for _ in range(count):
            self._free.put((torch.empty(size, dtype=torch.uint8, pin_memory=True), None))

    def take(self) -> torch.Tensor:
        buffer, event = self._free.get()
        if event is not None:
            event.synchronize()
        return buffer

    def give(self, buffer: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self._free.put((buffer, event))


class _Transfer:
    def __init__(
        self,
        source: Source,
        placements: Sequence[Placement],
        device: torch.device,
        verify: bool,
        threads: int | None,
    ) -> None:
        self.source = source
        self.placements = sorted(placements, key=lambda p: p.offset)
        self.device = device
        self.verify = verify
        self.threads = threads or max(1, min(MAX_THREADS, os.cpu_count() or 1))
        self.cuda = device.type == "cuda"
        self._ends = [p.offset + p.nbytes for p in self.placements]
        #: Per tensor, its parts' (start, checksum, length), appended by the threads.
        self._parts: list[list[tuple[int, int, int]]] = [[] for _ in self.placements]
        self._bases: list[int] = []  # ranges registered with CUDA
        self._pin = self.cuda and source.mapped
        self._pin_lock = threading.Lock()
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._staging: _Staging | None = None

    def run(self) -> dict[str, torch.Tensor]:
        size = self.source.size
        self.destination = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._host = None if self.cuda else _host_buffer(self.destination)
        chunk = MAPPED_CHUNK if self.source.mapped else FILE_CHUNK
        spans = [(start, min(start + chunk, size)) for start in range(0, size, chunk)]
        if self.cuda and not self.source.mapped:
            self._staging = _Staging(2 * min(self.threads, len(spans)) or 1, chunk)
        try:
            if len(spans) <= 1 or self.threads == 1:
                for span in spans:
                    self._chunk(span)
            else:
                with concurrent.futures.ThreadPoolExecutor(
                    self.threads, thread_name_prefix="shmstage-restore"
                ) as pool:
                    for done in [pool.submit(self._chunk, span) for span in spans]:
                        done.result()
            if self._stream is not None:
                self._stream.synchronize()
        finally:
            if self._bases:
                if self._stream is not None:
                    self._stream.synchronize()  # never unregister under a running copy
                failures = pinning.unregister(self._bases)
                if failures:
                    log.warning("cudaHostUnregister failed: %s", failures[0])
        if self.verify:
            self._check()
        return {p.key: self._tensor(p) for p in self.placements}

    def _chunk(self, span: tuple[int, int]) -> None:
        start, end = span
        source = self.source
        staging = None
        if not self.cuda:
            assert self._host is not None
            if source.mapped:
                host = source.view(start, end)
                self.destination[start:end].copy_(_as_tensor(host))
            else:
                host = self._host[start:end]
                source.read_into(start, host)
        elif source.mapped:
            host = source.view(start, end)
            self._register(start, end)
        else:
            assert self._staging is not None
            staging = self._staging.take()
            host = _host_buffer(staging)[: end - start]
            source.read_into(start, host)
        event = None
        if self.cuda:
            assert self._stream is not None
            with torch.cuda.stream(self._stream):
                self.destination[start:end].copy_(_as_tensor(host), non_blocking=True)
                event = self._stream.record_event()
        if self.verify:
            self._checksum(start, end, host)
        if staging is not None:
            self._staging.give(staging, event)  # type: ignore[union-attr]

    def _register(self, start: int, end: int) -> None:
        """Page-lock a mapped chunk for the device (read-only); on failure copy it
        pageable, at a third of the speed, and stop trying."""
        if not self._pin:
            return
        address = self.source.address + start  # type: ignore[attr-defined]
        try:
            pinning.prefault_read(address, end - start)
            pinning.register_range(
                address,
                end - start,
                pinning.HOST_REGISTER_READ_ONLY | pinning.HOST_REGISTER_PORTABLE,
                self._bases,
            )
        except pinning.PIN_FAILURES as exc:
            with self._pin_lock:
                if self._pin:
                    log.warning("restoring unpinned (slower): %s", exc)
                self._pin = False

    def _checksum(self, start: int, end: int, host: memoryview) -> None:
        """Checksum the part of every tensor that lies in [start, end)."""
        index = bisect.bisect_right(self._ends, start)
        while index < len(self.placements):
            placement = self.placements[index]
            if placement.offset >= end:
                break
            lo, hi = max(start, placement.offset), min(end, placement.offset + placement.nbytes)
            if hi > lo:
                value = crc32c.crc32c(host[lo - start : hi - start])
                self._parts[index].append((lo, value, hi - lo))
            index += 1

    def _check(self) -> None:
        for placement, parts in zip(self.placements, self._parts, strict=True):
            if placement.crc32c is None:
                continue
            actual = 0
            for i, (_, value, length) in enumerate(sorted(parts)):
                actual = value if i == 0 else combine(actual, value, length)
            if actual != placement.crc32c:
                raise ChecksumError(
                    f"tensor {placement.key!r} in {self.source.where}: checksum mismatch "
                    f"(crc32c {actual:#010x}, manifest {placement.crc32c:#010x})"
                )

    def _tensor(self, placement: Placement) -> torch.Tensor:
        if placement.nbytes == 0:
            return torch.empty(placement.shape, dtype=placement.dtype, device=self.device)
        raw = self.destination[placement.offset : placement.offset + placement.nbytes]
        if placement.offset % placement.dtype.itemsize:
            raw = raw.clone()  # not aligned for its dtype here: a copy of its own
        return raw.view(placement.dtype).view(placement.shape)
