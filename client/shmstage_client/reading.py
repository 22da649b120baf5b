"""Bytes to tensors on a device: large pieces, several threads, verified as they pass.

Restoring a checkpoint moves its bytes from host memory — the daemon's segments, read
through their descriptors or mapped read-only, or a data file's pages — to a device, and
checks every tensor against the CRC-32C its manifest recorded. Tensor by tensor, on one
thread, that runs at the speed of one core and of one small copy at a time (a 4 GiB
``load()`` reached 4 GB/s to an H200).

Here the source is cut into chunks of a few tens of MiB. Several threads each take the
next chunk, copy it into one of a few pinned buffers (for a file or the segments'
descriptors, a read; for a mapping, a memcpy; on the CPU, straight into the destination),
checksum the parts of tensors it holds, and queue its copy to the device on one stream.
The tensors come back as views of one destination buffer at their offsets (a tensor that
is not aligned for its dtype there gets its own copy). A tensor's checksum is combined
from those of its parts (``shmstage.checksums.combine``), in whatever order threads
finished.

Copying the daemon's segments through the pinned buffers beat registering them with CUDA
in place (``cudaHostRegister(..., cudaHostRegisterReadOnly)``) on the H100 host: 8 GiB in
0.29-0.32 s against 0.51-0.56 s on 16 threads, both verified; pinning a fresh mapping costs
per 4 KiB page, a memcpy does not.
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

log = logging.getLogger("shmstage.client")

#: Bytes per chunk: the size of each pinned staging buffer, one device copy each (8 GiB
#: from the daemon's memory on the H100 host: 16 MiB 0.37 s, 32 MiB 0.29 s, 64 MiB 0.44 s).
CHUNK: Final = 32 << 20
#: Threads reading and checksumming (same: 0.46 s on 8 threads, 0.29 s on 16).
MAX_THREADS: Final = 16


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

    def read_into(self, start: int, buffer: memoryview) -> None:
        target = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        ctypes.memmove(target, self.address + start, len(buffer))  # releases the GIL


class FileSource(Source):
    """``size`` bytes of an open file from ``offset`` on (a data file's tensor data)."""

    def __init__(self, fd: int, offset: int, size: int, where: str) -> None:
        self.fd, self.offset, self.size, self.where = fd, offset, size, where

    def read_into(self, start: int, buffer: memoryview) -> None:
        _pread_exactly(self.fd, buffer, self.offset + start, self.where)


class SegmentSource(Source):
    """Shared-memory segments read through their descriptors, laid out at ``offsets``
    (page-aligned, as ``segment.Region`` would map them; the gaps are never read).

    ``preadv`` copies a segment's pages straight out of the page cache: no page tables to
    fill while reading, none to tear down after (unmapping an 8 GiB mapping read end to
    end took 0.1-0.5 s on the H100 host, and blocks the process's page faults meanwhile).
    """

    def __init__(
        self, fds: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], where: str
    ) -> None:
        self.fds, self.offsets, self.sizes = list(fds), list(offsets), list(sizes)
        self.where = where
        self.size = (self.offsets[-1] + self.sizes[-1]) if self.offsets else 0

    def read_into(self, start: int, buffer: memoryview) -> None:
        end = start + len(buffer)
        index = max(0, bisect.bisect_right(self.offsets, start) - 1)
        while index < len(self.offsets) and self.offsets[index] < end:
            base = self.offsets[index]
            lo, hi = max(start, base), min(end, base + self.sizes[index])
            if hi > lo:
                piece = buffer[lo - start : hi - start]
                _pread_exactly(self.fds[index], piece, lo - base, self.where)
            index += 1


def _pread_exactly(fd: int, buffer: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise OSError(f"{where}: the file ended {len(buffer) - done} bytes early")
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
    """Pinned buffers chunks pass through on their way to a device: taken by a reader,
    given back with the event after which the device is done with it.

    Up to ``count`` buffers, each allocated by the reader that first finds none free: a
    fresh process pins new memory (~0.5 s/GiB on a VM host), and this way the readers do
    it side by side while others already read, not one after another up front.
    """

    def __init__(self, count: int, size: int) -> None:
        self._free: queue.Queue[tuple[torch.Tensor, torch.cuda.Event | None]] = queue.Queue()
        self._size = size
        self._unmade = count
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        try:
            buffer, event = self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                make = self._unmade > 0
                self._unmade -= make
            if make:
                return torch.empty(self._size, dtype=torch.uint8, pin_memory=True)
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
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._staging: _Staging | None = None

    def run(self) -> dict[str, torch.Tensor]:
        size = self.source.size
        self.destination = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._host = None if self.cuda else _host_buffer(self.destination)
        spans = [(start, min(start + CHUNK, size)) for start in range(0, size, CHUNK)]
        if self.cuda:
            # one buffer per thread and two spare, so a reader rarely waits for a copy;
            # no more: a restarted process pins fresh memory at ~0.5 s/GiB on a VM host
            self._staging = _Staging(min(len(spans), self.threads + 2) or 1, CHUNK)
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
        if self.verify:
            self._check()
        return {p.key: self._tensor(p) for p in self.placements}

    def _chunk(self, span: tuple[int, int]) -> None:
        start, end = span
        source = self.source
        if not self.cuda:
            assert self._host is not None
            host = self._host[start:end]
            if source.mapped:
                self.destination[start:end].copy_(_as_tensor(source.view(start, end)))
            else:
                source.read_into(start, host)
            self._checksum(start, end, host)
            return
        assert self._staging is not None and self._stream is not None
        staging = self._staging.take()
        host = _host_buffer(staging)[: end - start]
        source.read_into(start, host)
        with torch.cuda.stream(self._stream):
            self.destination[start:end].copy_(_as_tensor(host), non_blocking=True)
            event = self._stream.record_event()
        self._checksum(start, end, host)
        self._staging.give(staging, event)

    def _checksum(self, start: int, end: int, host: memoryview) -> None:
        """Checksum the part of every tensor that lies in [start, end) (with ``verify``)."""
        if not self.verify:
            return
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
