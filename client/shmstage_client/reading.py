"""Bytes to tensors on a device: large pieces, several threads, verified as they pass.

Restoring a checkpoint moves its bytes from host memory — the daemon's segments, read
through their descriptors or mapped read-only, or a data file's pages — to a device, and
checks every tensor against the CRC-32C its manifest recorded. Tensor by tensor, on one
thread, that runs at the speed of one core and of one small copy at a time (a 4 GiB
``load()`` reached 4 GB/s to an H200).

Here the source is cut into chunks of 16 MiB. Several threads each take the next chunk
and, on the CPU, read it straight into the destination; for a device, through a pinned
piece of its own (``_Relay``): read the chunk into it (for a file or the segments'
descriptors, a read; for a mapping, a memcpy) and checksum it in the same pass, a MiB at a
time while it is in the core's cache (``shmstage.readsum``; where that is not built, in a
second pass while the device copies), queue its copy to the device on one stream, and
wait for that copy only when the piece is next refilled (the other readers' pieces keep
the device busy meanwhile). The pieces
are few and reused at once, so they stay in the processor's cache and the host reads
memory once per byte, mostly: a restarted trainer's restore of 8 GiB from the daemon's
memory went from 2.49-2.67x the raw copy to 2.08-2.33x on an H200 VM and from 2.51x to
2.34x on an H100 VM (alternating; docs/performance.md), where 16 MiB chunks through 18
buffers had written and reread 288 MiB. The tensors come
back as views of one destination buffer at their offsets (a tensor that is not aligned
for its dtype there gets its own copy). A tensor's checksum is continued across a
chunk's pieces and combined across chunks (``shmstage.checksums.combine``), in whatever
order threads finished. Asked to (``DEVICE_CHECKSUMS``), a process that has restored to
a GPU twice checks there instead (``device_checksums``, ``_DeviceCheck``): the readers
then only read and queue.

Copying the daemon's segments through the pinned buffers beat registering them with CUDA
in place (``cudaHostRegister(..., cudaHostRegisterReadOnly)``) on the H100 host: 8 GiB in
0.29-0.32 s against 0.51-0.56 s on 16 threads, both verified; pinning a fresh mapping costs
per 4 KiB page, a memcpy does not. The staging outlives a transfer (``_Spares``): a
restore starts making it before it asks the daemon (``prepare``), and the process's next
restore finds it registered.
"""

from __future__ import annotations

import abc
import bisect
import concurrent.futures
import contextlib
import ctypes
import functools
import itertools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final

import crc32c
import torch

from shmstage import hostmemory, readsum
from shmstage.checkpoint import ChecksumError
from shmstage.checksums import combine, expect_combines
from shmstage_client import cudart, device_checksums
from shmstage_client.pinning import (
    HOST_REGISTER_PORTABLE,
    PIN_FAILURES,
    register_range,
    unregister,
)

log = logging.getLogger("shmstage.client")

#: Bytes per chunk: what a reader takes at a time, and the parts the checksums are
#: combined from.
CHUNK: Final = 16 << 20
#: On its way to a device a chunk passes through its reader's own pinned buffer, cut in
#: ``PIECES`` pieces of ``PIECE`` bytes that take turns. Reused at once, 16 readers'
#: 256 MiB stay largely in the processor's cache (300 MiB on the GPU VMs), so the device
#: and the checksums mostly read them there, not from memory. Each piece costs a read, a
#: queued copy, an event and a wait that the 16 readers' threads serialise on: one piece
#: of a whole chunk, 512 copies for 8 GiB, beat two of 8 MiB each on an H200 VM (warm
#: files 0.316-0.347 s against 0.436-0.468, from memory 0.291-0.311 against 0.366-0.454,
#: a restart 0.346-0.385 against 0.384-0.393), and pieces of 4 MiB lost by 0.1 s
#: (docs/performance.md, "Restores").
PIECE: Final = 16 << 20
PIECES: Final = 1
#: Threads reading and checksumming (8 GiB: 0.46 s on 8 threads, 0.29 s on 16).
MAX_THREADS: Final = 16
#: Staging buffers kept for this process's next restores (each a transfer's, one share
#: per reader), and for how long when no restore takes them.
MAX_SPARES: Final = 2
KEEP_STAGING_S: Final = 60.0
#: Staging buffers in transparent huge pages where the kernel has them free (a module
#: setting so that a bench can compare; see ``shmstage.hostmemory``).
HUGE_STAGING = True
#: With ``SHMSTAGE_DEVICE_CHECKSUMS=1``, verify a transfer to a CUDA device on the device
#: (``device_checksums``) rather than on the host, where the device has the memory for it:
#: ~1.3 fewer host core-seconds per 8 GiB, the same time within the VMs' noise (-8% to
#: +15% on three VMs, docs/performance.md), so not the default.
DEVICE_CHECKSUMS = os.environ.get("SHMSTAGE_DEVICE_CHECKSUMS", "0") == "1"
#: Device memory left free beside the restored bytes and the check's working memory.
DEVICE_HEADROOM: Final = 256 << 20


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
    """``size`` bytes somewhere, read into host memory a piece at a time."""

    size: int
    #: Where the bytes are, for messages.
    where: str

    @abc.abstractmethod
    def read_into(self, start: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes from ``start`` on; called from several threads."""

    #: Whether this kind of source can read and checksum in one pass (``_read_once``).
    one_pass: ClassVar[bool] = False

    @property
    def summing(self) -> bool:
        """Whether ``read_summed`` checksums the bytes in the pass that reads them
        (``shmstage.readsum``, where it is built), rather than in a second pass."""
        return self.one_pass and readsum.available()

    def read_summed(
        self, start: int, buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]
    ) -> None:
        """``read_into``, continuing the CRC-32C in ``values`` of each span of ``buffer``
        (``(lo, hi)`` offsets into it, ascending, not overlapping; 0 to start)."""
        if self.summing:
            self._read_once(start, buffer, spans, values)
        else:
            self.read_into(start, buffer)
            _sum(buffer, spans, values)

    def _read_once(
        self, start: int, buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]
    ) -> None:
        """``read_summed`` in one pass, for a source with ``one_pass``."""
        raise NotImplementedError


def _sum(buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]) -> None:
    """The second pass: continue each span's CRC-32C over the bytes already read."""
    for index, (lo, hi) in enumerate(spans):
        values[index] = crc32c.crc32c(buffer[lo:hi], values[index])


def _address(buffer: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class MappedSource(Source):
    """Bytes mapped into this process (the daemon's segments, read-only)."""

    def __init__(self, address: int, size: int, where: str) -> None:
        self.address, self.size, self.where = address, size, where

    def view(self, start: int, end: int) -> memoryview:
        """The mapped bytes in [start, end), read in place (the DCP reader's items)."""
        return memoryview((ctypes.c_char * (end - start)).from_address(self.address + start))

    def read_into(self, start: int, buffer: memoryview) -> None:
        ctypes.memmove(_address(buffer), self.address + start, len(buffer))  # GIL released

    one_pass = True

    def _read_once(
        self, start: int, buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]
    ) -> None:
        readsum.copy(self.address + start, _address(buffer), len(buffer), spans, values, self.where)


class FileSource(Source):
    """``size`` bytes of an open file from ``offset`` on (a data file's tensor data)."""

    def __init__(self, fd: int, offset: int, size: int, where: str) -> None:
        self.fd, self.offset, self.size, self.where = fd, offset, size, where

    def read_into(self, start: int, buffer: memoryview) -> None:
        _pread_exactly(self.fd, buffer, self.offset + start, self.where)

    one_pass = True

    def _read_once(
        self, start: int, buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]
    ) -> None:
        where, address = self.where, _address(buffer)
        readsum.read(self.fd, self.offset + start, address, len(buffer), spans, values, where)


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

    one_pass = True

    def _read_once(
        self, start: int, buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]
    ) -> None:
        """Segment by segment, each span's part in a segment checksummed as it is read."""
        end, address, first = start + len(buffer), _address(buffer), 0
        index = max(0, bisect.bisect_right(self.offsets, start) - 1)
        while index < len(self.offsets) and self.offsets[index] < end:
            base = self.offsets[index]
            lo, hi = max(start, base) - start, min(end, base + self.sizes[index]) - start
            if hi > lo:
                while first < len(spans) and spans[first][1] <= lo:
                    first += 1
                last = first
                while last < len(spans) and spans[last][0] < hi:
                    last += 1
                inside = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in spans[first:last]]
                sums = values[first:last]
                fd, offset = self.fds[index], start + lo - base
                readsum.read(fd, offset, address + lo, hi - lo, inside, sums, self.where)
                values[first:last] = sums
            index += 1


def _pread_exactly(fd: int, buffer: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise OSError(f"{where}: the file ended {len(buffer) - done} bytes early")
        done += got


def prepare(device: torch.device, nbytes: int | None = None, *, keep: float | None = None) -> None:
    """Start making the staging buffers of a transfer of ``nbytes`` (None: unknown yet) to
    ``device`` now, on a thread of its own, kept for a restore for ``keep`` seconds (None:
    ``KEEP_STAGING_S``): a restore calls this before it asks the daemon, whose answer then
    hides part of registering them in a new process; a restart script calls it before it
    builds its model (``restoring.prepare_restore``)."""
    if device.type == "cuda" and torch.cuda.is_available():  # else the transfer says why
        readers = MAX_THREADS if nbytes is None else min(MAX_THREADS, -(-nbytes // CHUNK))
        _SPARES.prepare(max(1, readers) * PIECES * PIECE, _registering(device), keep)


def _registering(device: torch.device) -> torch.device | None:
    """The device whose context registers staging made ahead: ``device`` with its index,
    never device 0 by default (a new thread's), which would give each rank of a
    multi-GPU node a context there. A bare "cuda" is the current device once this process
    initialised CUDA, else its only device; None while that is unknown (several devices,
    none chosen yet): the transfer's first reader registers the buffer then."""
    if device.index is not None:
        return device
    if torch.cuda.is_initialized():
        return device_checksums.device_key(device)
    return torch.device("cuda", 0) if torch.cuda.device_count() == 1 else None


def release_staging() -> None:
    """Give back this process's staging now rather than after its countdown: a restart
    that found nothing to restore will not take what ``prepare`` made for it."""
    _SPARES.release()


#: Restores per device checked on the host, and how many before the device's checks are
#: warmed up for the next ones.
_HOST_CHECKED: dict[torch.device, int] = {}
WARM_CHECKS_AFTER: Final = 2


def _count_host_checked(device: torch.device) -> None:
    """Warm the device's checks up once a process restores to it again and again.

    A process's first use of the checks loads a dozen CUDA kernels, each on the thread
    that launches it while holding the GIL: 0.18-0.32 s on an H200 VM, more than checking
    on the host costs a new process's restore (8 GiB: 0.03-0.05 s over unverified). A
    restarted trainer restores once and never pays it; a process that loads the newest
    weights over and over (an RL rollout worker, an evaluator) pays it once, in the
    background after its second restore, and checks on the device from then on.
    """
    device = device_checksums.device_key(device)  # "cuda" and "cuda:0" count as one
    count = _HOST_CHECKED.get(device, 0) + 1
    _HOST_CHECKED[device] = count
    if count == WARM_CHECKS_AFTER:
        device_checksums.warm_up_later(device)


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


def _disjoint(spans: Sequence[tuple[int, int]]) -> bool:
    """Whether no two spans overlap (tensors that share bytes overlap: a second pass)."""
    return all(before[1] <= after[0] for before, after in itertools.pairwise(spans))


def _extend(
    start: int,
    spans: Sequence[tuple[int, int]],
    values: Sequence[int],
    owners: Sequence[int],
    parts: dict[int, list[int]],
) -> None:
    """Continue ``parts`` (see ``_Transfer._tensor_spans``) with a piece's checksummed spans."""
    for (lo, hi), value, index in zip(spans, values, owners, strict=True):
        part = parts.get(index)
        if part is None:
            parts[index] = [start + lo, value, hi - lo]
        else:
            part[1] = value
            part[2] += hi - lo


def _as_tensor(view: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only mapping: only ever read from
        return torch.frombuffer(view, dtype=torch.uint8)


class _HostBuffer:
    """``size`` bytes of host memory a device copies from at full speed.

    Anonymous memory faulted in up front (``shmstage.hostmemory``: in transparent huge
    pages while the kernel has them free, never compacting memory for them) and then
    registered with CUDA, rather than ``cudaHostAlloc``'s (torch's ``pin_memory``): on the
    H100 host a fresh process paid ~0.5 s/GiB for the latter, which made the staging
    buffers' pinning the largest part of a restarted trainer's restore. Where registering
    fails, torch's pinned memory instead.
    """

    def __init__(self, size: int, device: torch.device | None = None, *, pin: bool = True) -> None:
        self.size = size
        self.huge = HUGE_STAGING and hostmemory.huge_pages_to_spare(size)
        self._bases: list[int] = []
        self._tensor: torch.Tensor | None = None
        self.pinned = False
        try:  # faulted in first: that needs no CUDA context, so a new process's can come
            self._mapped = hostmemory.map_populated(size, huge=self.huge)  # GIL free
        except OSError as exc:
            log.debug("staging in torch's pinned memory: %s", exc)
            self._mapped = 0
        self.address = self._mapped
        if pin:
            self.pin(device)

    def pin(self, device: torch.device | None = None) -> None:
        """Register the memory with CUDA, in ``device``'s context (None: the calling
        thread's current device), once; where that fails, torch's pinned memory instead."""
        if self.pinned:
            return
        with contextlib.nullcontext() if device is None else torch.cuda.device(device):
            if self._mapped:
                try:
                    # portable: a spare serves the process's next restore to any device
                    register_range(self._mapped, self.size, HOST_REGISTER_PORTABLE, self._bases)
                    self.pinned = True
                    return
                except PIN_FAILURES:
                    self._free_map()
            self._tensor = torch.empty(self.size, dtype=torch.uint8, pin_memory=True)
            self.address = self._tensor.data_ptr()
            self.pinned = True

    def free(self) -> None:
        """Give the memory back, once the device is done with it."""
        unregister(self._bases)  # before unmapping, or the range's next use fails
        self._free_map()
        self._tensor = None

    def _free_map(self) -> None:
        if self._mapped:
            hostmemory.unmap(self._mapped, self.size)
            self._mapped = 0


class _Staging:
    """The pinned memory of one transfer's readers, ``PIECES`` pieces each: one buffer,
    taken from the process's spare (made ahead by ``prepare``, or left by its last
    transfer) or made by the first reader. One mapping registered in one call: with
    sixteen readers registering a buffer each, a new process's restore was 40-50 ms
    slower (pieces.txt, now in the history of docs/perf/), as the driver serialises
    registrations and holds up the copies meanwhile."""

    def __init__(self, readers: int) -> None:
        self._size = readers * PIECES * PIECE
        self._buffer: _HostBuffer | None = None
        self._taken = 0
        self._lock = threading.Lock()

    def take(self) -> tuple[int, int]:
        """A reader's share: its address and size."""
        with self._lock:  # the others wait for the first to make the buffer
            if self._buffer is None:
                self._buffer = _SPARES.take(self._size) or _HostBuffer(self._size)
                self._buffer.pin()  # made ahead before this process had chosen a device
            share, self._taken = self._taken, self._taken + 1
            return self._buffer.address + share * PIECES * PIECE, PIECES * PIECE

    def close(self) -> None:
        """Leave the buffer for the next transfer (the device is done with it: the caller
        synchronized its stream)."""
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            _SPARES.keep(buffer)


class _Relay:
    """One reader's share of the staging, cut in ``PIECES`` pieces that take turns: the
    reader waits only for the copy out of the piece it is about to refill (with one
    piece, for its own last copy, while the other readers' copies keep the device busy).

    The copies are queued through ``cudart`` rather than ``Tensor.copy_``: at hundreds
    of pieces per restore from 16 threads, each microsecond a copy holds the GIL counts.
    Where torch's CUDA runtime is not a library ctypes can load (a build linking it
    statically), through ``Tensor.copy_`` after all.
    """

    def __init__(
        self, share: tuple[int, int], stream: torch.cuda.Stream, runtime: cudart.Runtime | None
    ) -> None:
        address, size = share
        self.size = size // PIECES
        self._addresses = [address + index * self.size for index in range(PIECES)]
        self._events: list[torch.cuda.Event | None] = [None] * PIECES
        self._turn = 0
        self._stream = stream
        self._runtime = runtime

    def send(
        self, fill: Callable[[memoryview], None], nbytes: int, target: torch.Tensor
    ) -> memoryview:
        """Fill the next piece's first ``nbytes`` (``fill`` reads them in) and queue their
        copy into ``target`` (as many bytes, on the device); returns the piece's bytes,
        which stay valid until the reader's next send (a second pass of checksums reads
        them while the device copies)."""
        turn = self._turn
        self._turn = (turn + 1) % PIECES
        event = self._events[turn]
        if event is None:
            event = self._events[turn] = torch.cuda.Event()
        else:
            event.synchronize()  # the device is done with this piece's previous bytes
        address = self._addresses[turn]
        piece = memoryview((ctypes.c_char * nbytes).from_address(address))
        fill(piece)
        if self._runtime is not None:
            stream = self._stream.cuda_stream
            self._runtime.copy_to_device(target.data_ptr(), address, nbytes, stream)
        else:
            with torch.cuda.stream(self._stream):
                target.copy_(_as_tensor(piece), non_blocking=True)
        event.record(self._stream)
        return piece


def _copy_runtime() -> cudart.Runtime | None:
    """The CUDA runtime the pieces' copies are queued through; None: through torch."""
    try:
        return cudart.runtime()
    except cudart.UNAVAILABLE as exc:
        log.debug("queuing restore copies through torch: %s", exc)
        return None


class _Spares:
    """Staging for this process's next transfer: left by a finished one — a co-located
    reader loads the newest weights again and again, and registering fresh memory is a
    good part of a restore — or made ahead of one (``prepare``); freed once none was
    taken for ``KEEP_STAGING_S``. At most ``MAX_SPARES`` buffers, the largest kept."""

    def __init__(self) -> None:
        self._buffers: list[_HostBuffer] = []
        self._cond = threading.Condition()
        #: The size of the buffer ``prepare``'s thread is making, 0 when none.
        self._coming = 0
        #: ``release`` came while a buffer was being made: free it once made.
        self._released = False
        self._timer: threading.Timer | None = None

    def take(self, size: int) -> _HostBuffer | None:
        """The smallest buffer of at least ``size`` bytes, waiting for one being made;
        None when none is coming."""
        with self._cond:
            while True:
                fits = [buffer for buffer in self._buffers if buffer.size >= size]
                if fits:
                    buffer = min(fits, key=lambda fit: fit.size)
                    self._buffers.remove(buffer)
                    return buffer
                if self._coming < size:
                    return None
                self._cond.wait(1.0)  # the maker always ends by waking us

    def prepare(
        self, size: int, device: torch.device | None = None, keep: float | None = None
    ) -> None:
        """Make a buffer of ``size`` bytes on a thread of its own, unless one that large
        is kept or coming, and keep it ``keep`` seconds for a restore to take: faulted in
        first, then registered in ``device``'s context (None: left for the transfer's
        reader to register, see ``_registering``)."""
        with self._cond:
            if self._coming or any(buffer.size >= size for buffer in self._buffers):
                return
            self._coming = size
        threading.Thread(
            target=self._make, args=(size, device, keep), name="shmstage-staging", daemon=True
        ).start()

    def _make(self, size: int, device: torch.device | None, keep: float | None) -> None:
        unwanted: list[_HostBuffer] = []
        try:
            buffer = _HostBuffer(size, device, pin=device is not None)
            with self._cond:
                if self._released:
                    unwanted.append(buffer)
                else:
                    self._buffers.append(buffer)
        except Exception as exc:  # the transfer makes its own, and says so if it must
            log.debug("could not make staging ahead of a restore: %s", exc)
        finally:
            _free_soon(unwanted)
            with self._cond:
                self._coming = 0
                self._released = False
                self._cond.notify_all()
                self._expire_later(keep)

    def keep(self, buffer: _HostBuffer) -> None:
        with self._cond:
            self._buffers.append(buffer)
            self._buffers.sort(key=lambda kept: kept.size, reverse=True)
            excess = self._buffers[MAX_SPARES:]
            del self._buffers[MAX_SPARES:]
            self._expire_later()
        _free_soon(excess)

    def _expire_later(self, seconds: float | None = None) -> None:
        """(Re)start the countdown after which the buffers go (under the lock)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(KEEP_STAGING_S if seconds is None else seconds, self.free)
        self._timer.daemon = True
        self._timer.start()

    def free(self) -> None:
        with self._cond:
            buffers, self._buffers = self._buffers, []
        for buffer in buffers:
            buffer.free()

    def release(self) -> None:
        """Free the buffers now, on a thread, and the one being made once it is made."""
        with self._cond:
            buffers, self._buffers = self._buffers, []
            self._released = self._coming > 0
        _free_soon(buffers)


def _free_soon(buffers: list[_HostBuffer]) -> None:
    """Unregister and unmap on a thread of its own: that takes time nobody waits for."""
    if buffers:
        threading.Thread(
            target=lambda: [buffer.free() for buffer in buffers],
            name="shmstage-staging-free",
            daemon=True,
        ).start()


_SPARES: Final = _Spares()


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
        self._checks: _DeviceCheck | None = None
        self._spans: Iterator[tuple[int, int]] = iter(())
        self._runtime: cudart.Runtime | None = None
        self._lock = threading.Lock()
        self._failed = False
        #: Bytes before the restored ones in ``destination``: a device check's slack.
        self._lead = 0

    def run(self) -> dict[str, torch.Tensor]:
        size = self.source.size
        checked = [p for p in self.placements if p.crc32c is not None and p.nbytes]
        on_device = self.cuda and self.verify and bool(checked) and self._device_can_check(size)
        self._lead = device_checksums.BLOCK if on_device else 0
        self.destination = torch.empty(size + self._lead, dtype=torch.uint8, device=self.device)
        self._host = None if self.cuda else _host_buffer(self.destination)
        if on_device:
            try:
                self._checks = _DeviceCheck(
                    self.destination, checked, self._lead, self._stream, self.source.where
                )
            except ValueError:  # tensors sharing bytes: each is checked on the host
                self._checks = None
        spans = [(start, min(start + CHUNK, size)) for start in range(0, size, CHUNK)]
        self._spans = iter(spans)
        readers = max(1, min(self.threads, len(spans)))
        on_host = self.verify and self._checks is None  # checked here, not on the device
        if self.cuda:
            self._staging = _Staging(readers)
            self._runtime = _copy_runtime()
        try:
            if readers == 1:
                self._read()
            else:
                with concurrent.futures.ThreadPoolExecutor(
                    readers, thread_name_prefix="shmstage-restore"
                ) as pool:
                    running = [pool.submit(self._read) for _ in range(readers)]
                    if on_host:
                        expect_combines(self._combined_lengths())  # meanwhile
                    for done in running:
                        done.result()
            if on_host:
                self._check()  # while the device copies the last pieces
        finally:
            if self._checks is not None:
                self._checks.close()
            if self._stream is not None:
                self._stream.synchronize()
            if self._staging is not None:
                self._staging.close()
        if self._checks is not None:
            for placement, actual in self._checks.results():
                self._compare(placement, actual)
        elif self.verify and self.cuda and DEVICE_CHECKSUMS:
            _count_host_checked(self.device)
        return {p.key: self._tensor(p) for p in self.placements}

    def _device_can_check(self, size: int) -> bool:
        """Whether the device checks this transfer: where the process has the checks'
        kernels loaded already (see ``_count_host_checked``) and the device has the memory."""
        if not DEVICE_CHECKSUMS or not device_checksums.ready(self.device):
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        return free >= size + device_checksums.reserve(size) + DEVICE_HEADROOM

    def _read(self) -> None:
        """One reader: the next chunk, until none is left or another reader failed."""
        try:
            if not self.cuda:
                while (span := self._next_span()) is not None:
                    self._to_host(*span)
                return
            assert self._staging is not None and self._stream is not None
            with torch.cuda.device(self.device):  # the runtime's calls are for this device
                relay = _Relay(self._staging.take(), self._stream, self._runtime)
                while (span := self._next_span()) is not None:
                    self._to_device(*span, relay)
        except BaseException:
            with self._lock:
                self._failed = True
            raise

    def _next_span(self) -> tuple[int, int] | None:
        with self._lock:
            return None if self._failed else next(self._spans, None)

    def _to_host(self, start: int, end: int) -> None:
        """On the CPU: straight into the destination."""
        assert self._host is not None
        host = self._host[start:end]
        parts: dict[int, list[int]] = {}
        if self.verify:
            spans, values, owners = self._tensor_spans(start, end, parts)
            if _disjoint(spans):
                self.source.read_summed(start, host, spans, values)
            else:
                self.source.read_into(start, host)
                _sum(host, spans, values)
            _extend(start, spans, values, owners, parts)
        else:
            self.source.read_into(start, host)
        self._keep(parts)

    def _to_device(self, start: int, end: int, relay: _Relay) -> None:
        parts: dict[int, list[int]] = {}
        for piece in range(start, end, relay.size):
            upto = min(piece + relay.size, end)
            target = self.destination[self._lead + piece : self._lead + upto]
            read = functools.partial(self.source.read_into, piece)
            if self._checks is not None or not self.verify:
                relay.send(read, upto - piece, target)
                continue
            spans, values, owners = self._tensor_spans(piece, upto, parts)
            if self.source.summing and _disjoint(spans):  # checksummed as it is read
                summed = functools.partial(
                    self.source.read_summed, piece, spans=spans, values=values
                )
                relay.send(summed, upto - piece, target)
            else:  # checksummed while the device copies
                _sum(relay.send(read, upto - piece, target), spans, values)
            _extend(piece, spans, values, owners, parts)
        if self._checks is not None:
            self._checks.arrived(start, end)
        else:
            self._keep(parts)

    def _tensor_spans(
        self, start: int, end: int, parts: dict[int, list[int]]
    ) -> tuple[list[tuple[int, int]], list[int], list[int]]:
        """The part of every tensor that lies in [start, end): its span of those bytes
        (offsets from ``start``), its checksum so far and its placement's index. ``parts``
        holds per placement the [start, checksum, length] of its bytes in the chunk so far,
        which the chunk's next piece continues (``_extend``).

        A piece is read and checksummed in one pass where ``shmstage.readsum`` runs (1 MiB
        at a time, in C); in Python, checksumming in cache-sized bits as they were read was
        slower than a second pass over the piece (0.40 against 0.35 s for 8 GiB on the H100
        host), as the many more calls contend for the GIL.
        """
        spans: list[tuple[int, int]] = []
        values: list[int] = []
        owners: list[int] = []
        index = bisect.bisect_right(self._ends, start)
        while index < len(self.placements):
            placement = self.placements[index]
            if placement.offset >= end:
                break
            lo, hi = max(start, placement.offset), min(end, placement.offset + placement.nbytes)
            if hi > lo:
                part = parts.get(index)
                spans.append((lo - start, hi - start))
                values.append(0 if part is None else part[1])
                owners.append(index)
            index += 1
        return spans, values, owners

    def _keep(self, parts: dict[int, list[int]]) -> None:
        """A chunk's parts, for ``_check`` (``list.append`` is atomic: readers share them)."""
        for index, (start, value, length) in parts.items():
            self._parts[index].append((start, value, length))

    def _combined_lengths(self) -> set[int]:
        """The lengths ``_check`` combines over: each checked tensor's bytes in every chunk
        after its first (a chunk's length, and what its last chunk holds of it).

        Worked out while the readers read: in a new process, where none was seen before,
        the combining took 12-14 ms after the last byte of 8 GiB had arrived."""
        lengths = set()
        for placement in self.placements:
            end = placement.offset + placement.nbytes
            first_end = (placement.offset // CHUNK + 1) * CHUNK
            if placement.crc32c is None or end <= first_end:
                continue
            if end - first_end > CHUNK:
                lengths.add(CHUNK)
            lengths.add(end - (end - 1) // CHUNK * CHUNK)
        return lengths

    def _check(self) -> None:
        for placement, parts in zip(self.placements, self._parts, strict=True):
            if placement.crc32c is None:
                continue
            actual = 0
            for i, (_, value, length) in enumerate(sorted(parts)):
                actual = value if i == 0 else combine(actual, value, length)
            self._compare(placement, actual)

    def _compare(self, placement: Placement, actual: int) -> None:
        if actual != placement.crc32c:
            raise ChecksumError(
                f"tensor {placement.key!r} in {self.source.where}: checksum mismatch "
                f"(crc32c {actual:#010x}, manifest {placement.crc32c:#010x})"
            )

    def _tensor(self, placement: Placement) -> torch.Tensor:
        if placement.nbytes == 0:
            return torch.empty(placement.shape, dtype=placement.dtype, device=self.device)
        start = self._lead + placement.offset
        raw = self.destination[start : start + placement.nbytes]
        if placement.offset % placement.dtype.itemsize:
            raw = raw.clone()  # not aligned for its dtype here: a copy of its own
        return raw.view(placement.dtype).view(placement.shape)


class _DeviceCheck:
    """The device checks the tensors as their bytes land, on a stream of its own.

    Readers report each chunk they queued (``arrived``); once the chunks from the start
    form a longer unbroken run, an event recorded on the copy stream marks it, and a
    thread of its own queues the check of the blocks in that run behind the event, so the
    checks overlap the copies still to come and no reader waits for them.
    """

    def __init__(
        self,
        destination: torch.Tensor,
        placements: Sequence[Placement],
        lead: int,
        copies: torch.cuda.Stream | None,
        where: str,
    ) -> None:
        self._placements = list(placements)
        self._where = where
        self._copies = copies
        self._stream = torch.cuda.Stream(destination.device)
        self._lead = lead
        ranges = [(lead + p.offset, p.nbytes) for p in self._placements]
        self._sums = device_checksums.DeviceChecksums(destination, ranges, self._stream)
        self._arrived: dict[int, int] = {}  # start -> end of chunks queued past the run
        self._ready = 0  # the run of queued bytes from the start
        self._marked: tuple[int, torch.cuda.Event] | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="shmstage-check", daemon=True)
        self._thread.start()

    def arrived(self, start: int, end: int) -> None:
        """Bytes [start, end) were queued for copying (on the copy stream)."""
        with self._cond:
            self._arrived[start] = end
            ready = self._ready
            while ready in self._arrived:
                ready = self._arrived.pop(ready)
            if ready == self._ready:
                return
            self._ready = ready
            event = torch.cuda.Event()
            event.record(self._copies)  # after every chunk of the run: all were queued
            self._marked = (ready, event)
            self._cond.notify()

    def _work(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._marked is None and not self._closed:
                        self._cond.wait()
                    marked, self._marked = self._marked, None
                    if marked is None:
                        return
                ready, event = marked
                self._sums.advance(self._lead + ready, event)
        except BaseException as exc:  # handed to the restoring thread, in results()
            self._failure = exc

    def close(self) -> None:
        """No more chunks: let the thread finish what it was given."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def results(self) -> list[tuple[Placement, int]]:
        """Each placement with the CRC-32C its bytes have on the device."""
        try:
            if self._failure is not None:
                raise self._failure
            if self._copies is not None:
                self._stream.wait_stream(self._copies)
            values = self._sums.finish()
        except torch.OutOfMemoryError as exc:  # another process took the memory meanwhile
            raise ChecksumError(
                f"{self._where}: the device ran out of memory while checking the restored "
                f"tensors, so they are not verified ({exc})"
            ) from exc
        return list(zip(self._placements, values, strict=True))
