"""The segments' life on the loop: made for a registration, given back, kept at size.

Segments are made in an I/O thread, all of a registration's or none (``create``); they are
given back in one thread of their own (``unlink_later``), which also puts back to its size
a segment a client resized through its descriptor (``keep_sizes``, every
``size_check_interval`` seconds of the settings): one thread, since a size put back while
the segment was being given back would reserve its memory again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from shmstage import segment
from shmstage.layout import Layout
from shmstage.protocol import ErrorCode
from shmstage.segment import SegmentRef
from shmstage.units import format_size
from shmstage_daemon import faults, heap
from shmstage_daemon.config import measure_shm
from shmstage_daemon.slot import Slot, SlotState
from shmstage_daemon.store import StagedLayout, Store, StoreError

log = logging.getLogger("shmstaged")

#: Threads that make the slots a client adds behind its first save (``add_slots``): they
#: write zeros over the new memory while the trainer computes, so as few as the client's
#: own background setup (on an H100 host, 8 threads of page work slowed a training step
#: ~1.1x while they ran).
BACKGROUND_CREATE_THREADS = 4
#: How long after segments are given back the daemon's heap is trimmed (``heap.trim``):
#: by then what described their layout has been freed too.
TRIM_DELAY_S = 1.0


class Segments:
    """Makes segments, gives them back, and keeps them at the size they were made."""

    def __init__(
        self,
        store: Store,
        instance: Callable[[], str],
        stopping: Callable[[], bool],
        track: Callable[[asyncio.Future[Any]], None],
        interval: Callable[[], float],
    ) -> None:
        self._store = store
        #: Seconds between size checks, read at each (a reload may change it).
        self._interval = interval
        #: The instance whose names new segments bear (known once it is claimed).
        self._instance = instance
        self._stopping = stopping
        self._track = track
        # One thread gives segments back and puts resized ones back to their size: a size
        # put back while the segment was being given back would reserve its memory again.
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shmstage-segments")
        self._trim: asyncio.TimerHandle | None = None

    def shutdown(self) -> None:
        if self._trim is not None:
            self._trim.cancel()
        self._io.shutdown(wait=False, cancel_futures=True)

    def create(
        self, layout: Layout, slots: int, threads: int = segment.MAX_CREATE_THREADS
    ) -> list[list[SegmentRef]]:
        """Runs in an I/O thread, fanning large layouts out to up to ``threads`` setup
        threads (a registration: a first save waits for them; slots added behind it take
        ``BACKGROUND_CREATE_THREADS``); all or nothing. A test's ``register`` fault hook
        holds it after the first segment."""
        sizes = list(layout.packing().sizes) * slots
        refs: list[SegmentRef | None] = [None] * len(sizes)

        def make(index: int) -> None:
            refs[index] = segment.create(self._instance(), sizes[index])

        try:
            first = 0
            if sizes and faults.armed("register"):
                make(0)
                faults.pause("register")
                first = 1
            segment.in_parallel(
                sizes[first:],
                lambda index: make(index + first),
                threads,
                segment.CREATE_MIN_BYTES,
            )
        except BaseException:
            for ref in refs:
                if ref is not None:
                    segment.unlink(ref.name)
            raise
        per_slot = len(layout.packing())
        made = [ref for ref in refs if ref is not None]
        return [made[i * per_slot : (i + 1) * per_slot] for i in range(slots)]

    def unlink_later(self, names: list[str]) -> asyncio.Future[Any]:
        """Give segments back in an I/O thread (shutdown waits for it): their memory is
        freed at once, though a client kept descriptors on them (``segment.give_back``).
        Not while stopping (unlinked then, as before): a trainer still copying into its
        slot must hear that the daemon is gone, not fault."""
        loop = asyncio.get_running_loop()
        unlink = unlink_all if self._stopping() else _give_back_all
        future = loop.run_in_executor(self._io, unlink, names)
        self._track(future)
        if self._trim is None:  # one trim after a burst of releases
            self._trim = loop.call_later(TRIM_DELAY_S, self._trim_heap)
        return future

    def _trim_heap(self) -> None:
        """Give the heap back after a release (in the segments' thread, off the loop): a
        client of 100,000 tensors left ~35 MiB in malloc's arenas, which a daemon serving
        a node for months would otherwise keep at the high-water mark of its largest client."""
        self._trim = None
        if not self._stopping():
            self._track(asyncio.get_running_loop().run_in_executor(self._io, heap.trim))

    async def keep_sizes(self) -> None:
        """Every ``size_check_interval`` seconds, segments a descriptor's holder resized go back to
        their size: grown ones would hold memory nobody is charged for, shrunk ones make
        readers mapping them fault. A stat per segment, off the loop (~11 us each on a
        loaded 2-core host: 0.2 s for 20,000 segments)."""
        while True:
            await asyncio.sleep(self._interval())
            # In a call of its own: what one round saw (every layout's segments) must not
            # stay alive through the next sleep, holding a layout released meanwhile.
            await self._keep_sizes_once()

    async def _keep_sizes_once(self) -> None:
        loop = asyncio.get_running_loop()
        owners: dict[SegmentRef, tuple[StagedLayout, Slot, Any]] = {}
        reading: set[SegmentRef] = set()  # a job's: short ones fail it (``gather``)
        for staged in self._store.layouts.values():
            for slot in staged.slots:
                owners.update((ref, (staged, slot, slot.held)) for ref in slot.segments)
                if slot.state is SlotState.PERSISTING:
                    reading.update(slot.segments)
        try:
            fixed = await loop.run_in_executor(
                self._io, _fix_sizes, list(owners), reading
            )
        except Exception:  # a bug here must not end the checks (nor the daemon)
            log.exception("checking the segments' sizes failed")
            return
        for ref, (size, allocated) in fixed:
            staged, slot, held = owners[ref]
            if size < ref.size and held is not None and slot.held is held:
                slot.held = None  # grown back with zeros: not that checkpoint any more
            log.warning(
                "segment %s of layout %d (uid %d) was resized by a process holding its "
                "descriptor (%d bytes, %d allocated; shmstaged made it %d): put back to "
                "its size",
                ref.name,
                staged.id,
                staged.uid,
                size,
                allocated,
                ref.size,
            )


def check_capacity(nbytes: int) -> None:
    """Refuse a registration that /dev/shm or the node's memory cannot back right now.

    The budget is a ceiling set at start; free tmpfs space and available memory move
    with what trainers do, so each registration is checked against them as well.
    """
    cap = measure_shm()
    if nbytes > cap.usable:
        tight = (
            "free space in /dev/shm"
            if cap.shm_free <= cap.mem_available
            else "memory available to shmstaged (the node's, or its cgroup's MemoryMax=)"
        )
        raise StoreError(
            ErrorCode.SHM_EXHAUSTED,
            f"staging {nbytes} bytes ({format_size(nbytes)}) needs more than the "
            f"{tight} ({format_size(cap.shm_free)} free in /dev/shm, "
            f"{format_size(cap.mem_available)} memory available); free memory or "
            "/dev/shm space, use fewer slots, or stage a smaller state dict",
        )


def unlink_all(names: list[str]) -> None:
    for name in names:
        segment.unlink(name)


def _give_back_all(names: list[str]) -> None:
    for name in names:
        segment.give_back(name)


def _fix_sizes(
    refs: list[SegmentRef], reading: set[SegmentRef]
) -> list[tuple[SegmentRef, tuple[int, int]]]:
    """Runs in a thread: the segments that were resized, each put back (``fix_size``)."""
    return [
        (ref, found)
        for ref in refs
        if (found := segment.fix_size(ref, grow=ref not in reading)) is not None
    ]
