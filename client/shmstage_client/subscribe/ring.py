"""The ring: a publisher's slots mapped read-only into this process, once each, and kept.

Every version of a channel lives in a slot of its publisher's layout, a fixed set that
the daemon reuses; so a subscriber maps each slot the first time a version lands in it
and keeps it for every later version there. For a CUDA device it also registers each
slot's mapping with CUDA once (``cudaHostRegister`` with ``cudaHostRegisterReadOnly``:
a read-only mapping cannot be registered without it), which costs ~0.04 s/GiB and makes
every later copy to the device run at pinned speed (55 GB/s against ~9 GB/s from an
unregistered mapping on an H100/H200 host). A publisher that changes its structure
registers a new layout: a new ring, and this one is retired once no open version uses it.

A slot's first version does not wait for its registration: it is copied through the
process's pinned staging (``restore.transfer``: 16 threads memcpy the mapping into pinned
pieces, each queued to the device as it fills, checksummed in the same pass when the
version's checksums are there), and the slot's registration starts once that copy is done,
in the background, for the versions after it. Copying a fresh mapping through staging
beats registering it in place (8 GiB: 0.29-0.32 s against 0.51-0.56 s on an H100 host, the
restore's measurement; pinning costs per 4 KiB page, a memcpy does not), and a registered
slot beats staging from then on (the copy engine reads it directly: one pass over host
memory). A copy goes straight from the registration only once every piece of it is
registered (``direct``); until then, and for good once CUDA refused a registration (one
warning per ring), through staging.

A slot is registered a piece at a time (``PIECE_BYTES``), on a thread of its own.
Registration goes no faster on more threads (the driver serialises it; four and eight
were slower), but twice as fast on pages already in the page table (0.041 s/GiB against
0.077), so another thread reads the pieces in ahead of it (``pinning.prefault_read``,
~0.005 s/GiB). Every later version copies the same pieces: a copy whose host memory spans
two registrations fails, so no copy ever does.

A subscriber that prepares (``Subscriber.prepare``) maps every slot of the ring before its
first version and registers them all in the background (``prepare``), one after another
on one pair of threads: its first version is then copied as every later one is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Final

import torch

from shmstage import segment
from shmstage.layout import Layout
from shmstage_client import pinning
from shmstage_client.errors import SaveTimeout

log = logging.getLogger("shmstage.client")

#: ``cudaHostRegisterReadOnly``: the device only reads the range (required for PROT_READ).
HOST_REGISTER_READ_ONLY: Final = 0x08
#: Bytes of a slot registered in one call, and so copied in one: ~10 ms of registration,
#: ~5 ms of copy at pinned speed (the first copy waits for one piece, the last for one).
PIECE_BYTES: Final = 256 << 20
#: The longest a copy waits for one piece's registration (~10 ms normally).
PIECE_TIMEOUT_S: Final = 60.0


class _Registration:
    """One slot's registration with CUDA, piece by piece, running on threads of its own:
    each piece's future says whether it was registered (False: CUDA refused, copy it at
    pageable speed)."""

    def __init__(self, pieces: list[tuple[int, int]], done: list[Future[bool]]) -> None:
        self.pieces = pieces
        self.done = done
        #: Registered bases (``list.append`` is atomic: the threads share it).
        self.bases: list[int] = []

    def settle(self) -> None:
        """Wait for every piece (those not started yet run too: few, ~10 ms each)."""
        for future in self.done:
            try:
                future.result(timeout=PIECE_TIMEOUT_S)
            except Exception:  # a piece that raised registered nothing
                continue


class Ring:
    """One publisher layout's slots, by the daemon's slot key, mapped ``PROT_READ``."""

    def __init__(self, ring_id: int, layout: Layout, sizes: Sequence[int]) -> None:
        if list(layout.packing().sizes) != list(sizes):
            raise ValueError("shmstaged sent a ring whose segment sizes do not match its tensors")
        self.id = ring_id
        self.layout = layout
        self.sizes = list(sizes)
        self._regions: dict[int, segment.Region] = {}
        #: Each slot's registration with CUDA, started by its first copy to a device.
        self._registrations: dict[int, _Registration] = {}
        #: CUDA refused a registration: later pieces and slots are not tried again.
        self._unpinnable = False
        self._refusal = ""
        self._warned = False
        #: Open versions reading from this ring, and whether it was retired meanwhile.
        self._users = 0
        self._retired = False
        self._lock = threading.Lock()

    @property
    def slots(self) -> int:
        """How many of the ring's slots are mapped here."""
        return len(self._regions)

    def has(self, slot: int) -> bool:
        return slot in self._regions

    def region(self, slot: int) -> segment.Region:
        return self._regions[slot]

    def map(self, slot: int, first: int, fds: Sequence[int]) -> None:
        """Map the next segments of ``slot`` (from segment ``first``); always closes ``fds``."""
        try:
            region = self._regions.get(slot)
            if region is None:
                if first != 0:
                    raise ValueError(f"segments of slot {slot} arrived from {first}, not 0")
                region = self._regions[slot] = segment.Region(self.sizes)
            if first + len(fds) > len(self.sizes):
                raise ValueError("shmstaged sent more segments than the ring's slot holds")
            for index, fd in enumerate(fds, first):
                region.map(index, fd, writable=False)
        finally:
            for fd in fds:
                os.close(fd)

    def drop(self, slot: int) -> None:
        """Forget a slot whose segments did not all arrive (mapped again next time)."""
        with self._lock:
            registration = self._registrations.pop(slot, None)
        if registration is not None:  # never unmap a registered range (error 712 later)
            registration.settle()
            pinning.unregister(registration.bases)
        region = self._regions.pop(slot, None)
        if region is not None:
            region.close()

    def direct(self, slot: int) -> bool:
        """Whether copies from ``slot`` go straight from its registration with CUDA: every
        piece of it registered. False while nothing started it, while it runs, and once
        CUDA refused any registration of this ring (then with one warning per ring): copy
        through pinned staging, and ``register_soon`` after the copy."""
        with self._lock:
            registration = self._registrations.get(slot)
            unpinnable = self._unpinnable
        if unpinnable:
            self._warn_once()
            return False
        if registration is None:
            return False
        return all(
            done.done() and done.exception() is None and done.result()
            for done in registration.done
        )

    def register_soon(self, slot: int, device: torch.device) -> None:
        """Start registering ``slot`` for ``device`` in the background unless something
        already did (its first version was just copied through staging): the versions
        after it are copied straight from it. Not on a retired ring (it closes once its
        last version does, and would wait for the registration)."""
        with self._lock:
            if self._retired:
                return
        self._registration(slot, device)

    def pieces(
        self, slot: int, device: torch.device, start: int, end: int
    ) -> Iterator[tuple[int, int, bool]]:
        """Bytes ``start:end`` of ``slot``'s mapping cut where its registrations are cut,
        as (start, end, registered), each yielded once its piece is registered with CUDA
        for ``device`` (started by this call if nothing started it; kept while the ring
        lives). ``registered`` False: CUDA refused, copy that piece at pageable speed (one
        warning per ring). A copy asks only once ``direct`` says every piece is there."""
        registration = self._registration(slot, device)
        return self._ready(registration, start, end)

    def _ready(
        self, registration: _Registration, start: int, end: int
    ) -> Iterator[tuple[int, int, bool]]:
        for (first, last), done in zip(registration.pieces, registration.done, strict=True):
            if last <= start or first >= end:
                continue
            try:
                registered = done.result(timeout=PIECE_TIMEOUT_S)
            except FutureTimeout:
                raise SaveTimeout(
                    f"registering {last - first} bytes of a published slot with CUDA took "
                    f"over {PIECE_TIMEOUT_S:.0f} s; is the driver stuck? (nvidia-smi)"
                ) from None
            if not registered:
                self._warn_once()
            yield max(first, start), min(last, end), registered

    def _registration(self, slot: int, device: torch.device) -> _Registration:
        """``slot``'s registration, started on its first call (on threads of its own, in
        ``device``'s context: a new thread's current device is device 0, and a reader of
        another GPU would get a context there)."""
        with self._lock:
            registration = self._registrations.get(slot)
            if registration is not None:
                return registration
            region = self._regions[slot]
            if self._unpinnable:
                refused: Future[bool] = Future()
                refused.set_result(False)
                registration = _Registration([(0, region.size)], [refused])
            else:
                registration = self._start(region, device)
            self._registrations[slot] = registration
            return registration

    def prepare(self, device: torch.device) -> None:
        """Register every slot mapped now for ``device``, in the background, one slot after
        another (the driver serialises registrations: slots side by side would each finish
        last), so that the first version in any of them is copied at pinned speed."""
        reader = ThreadPoolExecutor(1, thread_name_prefix="shmstage-pin-read")
        registrar = ThreadPoolExecutor(1, thread_name_prefix="shmstage-pin")
        try:
            with self._lock:
                for slot, region in self._regions.items():
                    if slot not in self._registrations and not self._unpinnable:
                        started = self._start(region, device, reader, registrar)
                        self._registrations[slot] = started
        finally:
            reader.shutdown(wait=False)  # their threads end once the pieces are done
            registrar.shutdown(wait=False)

    def registered(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every registration started; whether all
        ended (a piece CUDA refused ended too: it is copied at pageable speed)."""
        with self._lock:
            done = [future for r in self._registrations.values() for future in r.done]
        _finished, pending = wait_futures(done, timeout=timeout)
        return not pending

    def _start(
        self,
        region: segment.Region,
        device: torch.device,
        reader: ThreadPoolExecutor | None = None,
        registrar: ThreadPoolExecutor | None = None,
    ) -> _Registration:
        """Read the pieces in on one thread and register them, in order, on another (the
        given ones, shared by the slots ``prepare`` registers; otherwise this slot's)."""
        pieces = pinning.page_pieces(region.size, PIECE_BYTES)
        own = reader is None or registrar is None
        if own:
            reader = ThreadPoolExecutor(1, thread_name_prefix="shmstage-pin-read")
            registrar = ThreadPoolExecutor(1, thread_name_prefix="shmstage-pin")
        registration = _Registration(pieces, [])
        for first, last in pieces:
            read = reader.submit(pinning.prefault_read, region.address + first, last - first)
            task = self._register_piece
            done = registrar.submit(task, registration, region, first, last, device, read)
            registration.done.append(done)
        if own:
            reader.shutdown(wait=False)  # their threads end once the pieces are done
            registrar.shutdown(wait=False)
        return registration

    def _register_piece(
        self,
        registration: _Registration,
        region: segment.Region,
        start: int,
        end: int,
        device: torch.device,
        read: Future[None],
    ) -> bool:
        """Register the piece read-only once ``read`` has read its pages in; False when
        CUDA refuses (or refused an earlier piece): the piece is copied at pageable speed."""
        with contextlib.suppress(Exception):  # unread pages only register slower
            read.result(timeout=PIECE_TIMEOUT_S)
        if self._unpinnable:
            return False
        address = region.address + start
        bases: list[int] = []
        flags = pinning.HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY
        try:
            with torch.cuda.device(device):
                pinning.register_range(address, end - start, flags, bases)
        except pinning.PIN_FAILURES as exc:
            pinning.unregister(bases)
            with self._lock:
                if not self._unpinnable:
                    self._unpinnable = True
                    self._refusal = str(exc)
            return False
        registration.bases.extend(bases)
        return True

    def _warn_once(self) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
            why = self._refusal
        warnings.warn(
            f"shmstage: could not register the published slots with CUDA ({why}); "
            "versions will be copied to the device through pinned staging (about twice "
            "the time of a copy from registered slots)",
            RuntimeWarning,
            stacklevel=5,
        )

    def use(self) -> None:
        with self._lock:
            self._users += 1

    def done(self) -> None:
        with self._lock:
            self._users -= 1
            close = self._retired and not self._users
        if close:
            self._close()

    def retire(self) -> None:
        """No new version will come from this ring: close it once no version reads it."""
        with self._lock:
            self._retired = True
            close = not self._users
        if close:
            self._close()

    def _close(self) -> None:
        """Unregister every range before unmapping it (a range unmapped while registered
        makes later registrations fail with error 712)."""
        for registration in self._registrations.values():
            registration.settle()  # a piece still registering would outlive its mapping
            failures = pinning.unregister(registration.bases)
            if failures:
                log.warning("cudaHostUnregister failed for a published slot: %s", failures[0])
        self._registrations.clear()
        for region in self._regions.values():
            region.close()
        self._regions.clear()
