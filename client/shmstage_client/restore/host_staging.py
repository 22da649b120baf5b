"""The pinned host memory a restore's bytes pass through on their way to a device.

A device copies at full speed only from page-locked memory, and locking fresh memory is a
good part of a restarted trainer's restore. So the staging is made once and kept: a
transfer takes one buffer (``Staging``), a share per reader, and leaves it for the
process's next restore (``_Spares``), which finds it registered; unused for
``KEEP_STAGING_S``, it is freed. A restore starts making it before it asks the daemon
(``prepare``), whose answer then hides part of registering it in a new process; a restart
script does so before it builds its model (``prepare_restore``); ``release`` gives it back
at once when there turns out to be nothing to restore.

The staging's shape is the transfer's: each of at most ``MAX_THREADS`` readers takes
``CHUNK`` bytes at a time through its share, ``PIECES`` pieces of ``PIECE`` bytes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Final

import torch

from shmstage import hostmemory
from shmstage_client.pinning import (
    HOST_REGISTER_PORTABLE,
    PIN_FAILURES,
    register_range,
    unregister,
)
from shmstage_client.restore import device_checks

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


def prepare(device: torch.device, nbytes: int | None = None, *, keep: float | None = None) -> None:
    """Start making the staging buffers of a transfer of ``nbytes`` (None: unknown yet) to
    ``device`` now, on a thread of its own, kept for a restore for ``keep`` seconds (None:
    ``KEEP_STAGING_S``): a restore calls this before it asks the daemon, whose answer then
    hides part of registering them in a new process; a restart script calls it before it
    builds its model (``restoring.prepare_restore``)."""
    if device.type == "cuda" and torch.cuda.is_available():  # else the transfer says why
        readers = MAX_THREADS if nbytes is None else min(MAX_THREADS, -(-nbytes // CHUNK))
        _SPARES.prepare(max(1, readers) * PIECES * PIECE, registering(device), keep)


def registering(device: torch.device) -> torch.device | None:
    """The device whose context registers memory made ahead (the staging, a prepared
    restore's slots): ``device`` with its index,
    never device 0 by default (a new thread's), which would give each rank of a
    multi-GPU node a context there. A bare "cuda" is the current device once this process
    initialised CUDA, else its only device; None while that is unknown (several devices,
    none chosen yet): the transfer's first reader registers the buffer then."""
    if device.index is not None:
        return device
    if torch.cuda.is_initialized():
        return device_checks.device_key(device)
    return torch.device("cuda", 0) if torch.cuda.device_count() == 1 else None


def release() -> None:
    """Give back this process's staging now rather than after its countdown: a restart
    that found nothing to restore will not take what ``prepare`` made for it."""
    _SPARES.release()



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


class Staging:
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
        reader to register, see ``registering``)."""
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

