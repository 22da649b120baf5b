"""Registration: a client's layouts and their slots (register, add_slots, acquire,
cancel, release).

A layout is registered with the slots the save that stalls training needs, and the rest
are added while that save persists (``add_slots``); each slot's segments go to the client
writable. ``acquire`` hands the client a free slot to fill (waiting for one, bounded);
``cancel`` gives a filling slot back, ``release`` the whole layout. A registration like
one the same user's earlier trainer left retained takes that layout over (``_adopt``):
its segments, and the checkpoint its newest slot holds, are the new client's; with
``adopt_only`` (a restart's ``prepare_restore``) nothing else is registered.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shmstage import segment
from shmstage.collection import collection_paused
from shmstage.layout import Layout
from shmstage.protocol import ErrorCode, Frame
from shmstage.segment import SegmentRef
from shmstage_daemon import requests
from shmstage_daemon.requests import RequestError
from shmstage_daemon.retention import Retention
from shmstage_daemon.segments import BACKGROUND_CREATE_THREADS
from shmstage_daemon.session import Handler, Session
from shmstage_daemon.settings import Settings
from shmstage_daemon.slot import Slot, SlotState
from shmstage_daemon.store import StagedLayout, Store, StoreError
from shmstage_daemon.telemetry import Telemetry

log = logging.getLogger("shmstaged.session")

#: Acquires of one layout that may wait at once; more is a client loop gone wrong.
MAX_WAITERS_PER_LAYOUT = 64


class Registration:
    """The layout and slot ops of one session."""

    def __init__(
        self,
        session: Session,
        store: Store,
        retention: Retention,
        telemetry: Telemetry,
        settings: Settings,
        *,
        stopping: Callable[[], bool],
        check_capacity: Callable[[int], None],
        create_segments: Callable[[Layout, int, int], Awaitable[list[list[SegmentRef]]]],
        release: Callable[[StagedLayout], None],
        unlink_later: Callable[[list[str]], Any],
        drop_prepared: Callable[[StagedLayout, Slot], None],
    ) -> None:
        self._session = session
        self._store = store
        self._retention = retention
        self._telemetry = telemetry
        self._settings = settings
        #: True once the daemon stops: no new registrations.
        self._stopping = stopping
        #: Refuses what /dev/shm or the node's memory cannot back now (SHM_EXHAUSTED).
        self._check_capacity = check_capacity
        #: Makes a layout's segments for some slots, in an I/O thread, on up to so many
        #: setup threads; all or nothing.
        self._create_segments = create_segments
        #: Releases a layout (its segments go once no job or lease holds them).
        self._release = release
        self._unlink_later = unlink_later
        #: Drops the prepared commits of a slot being cancelled (``commits``).
        self._drop_prepared = drop_prepared

    def ops(self) -> dict[str, Handler]:
        return {
            "register": self.register,
            "add_slots": self.add_slots,
            "acquire": self.acquire,
            "cancel": self.cancel,
            "release": self.release,
        }

    async def register(self, frame: Frame) -> None:
        if self._stopping():
            raise RequestError(ErrorCode.SHUTTING_DOWN, "shmstaged is shutting down")
        began = time.perf_counter()
        with collection_paused():  # a burst of specs: no full collections in it
            layout = Layout.from_wire(
                frame.body["tensors"], max_tensors=self._store.limits.max_tensors_per_layout
            )
            layout.packing()  # where each tensor goes, computed once: the burst's other part
        slots = frame.body.get("slots", self._settings.default_slots)
        planned = frame.body.get("planned_slots", slots)
        self._store.check_slots(planned)
        batch = requests.fds_per_message(frame)
        adopted = await self._adopt(layout, slots, planned)
        if adopted is not None:
            if self._session.open:
                await self._registered(frame, *adopted, batch=batch, began=began)
            return
        if frame.body.get("adopt_only"):  # a restore's adoption: never fresh segments
            raise RequestError(
                ErrorCode.NOT_RETAINED,
                f"shmstaged retains no layout of uid {self._session.peer.uid} of this "
                "structure that may be adopted (none, or a reader leases one of its slots); "
                "register without adopt_only to get fresh segments",
            )
        # room for every planned slot: the limits are checked for all of them now
        await self._retention.make_room(
            self._store.registration_bytes(layout, max(slots, planned)), self._session.peer.uid
        )
        nbytes = self._store.reserve(self._session.id, layout, slots, planned)
        making = time.perf_counter()
        try:
            refs = await self._make_slots(layout, slots, nbytes)
        except BaseException:
            self._store.unreserve(self._session.peer.uid, nbytes, len(layout.packing()) * slots)
            raise
        staged = self._store.add(self._session.id, layout, refs, nbytes, uid=self._session.peer.uid)
        self._telemetry.registered(created=staged.segment_count)
        if not self._session.open:  # the client left while segments were being made
            self._release(staged)
            return
        made = time.perf_counter() - making
        await self._registered(frame, staged, batch=batch, began=began, made=made)

    async def _registered(
        self,
        frame: Frame,
        staged: StagedLayout,
        adopted: int = 0,
        *,
        batch: int,
        began: float,
        made: float | None = None,
    ) -> None:
        """Answer a registration: the layout, then every slot's segments, writable. The log
        line says how long the client waited for the answer, and (``made``) what of that was
        making segments (the rest: reading and checking the layout, making room)."""
        log.info(
            "%s registered layout %d: %d tensors x %d slot(s) in %d segments, %d bytes, "
            "in %.3f s%s%s",
            self._session.describe(),
            staged.id,
            len(staged.layout.tensors),
            len(staged.slots),
            staged.segment_count,
            staged.bytes_reserved,
            time.perf_counter() - began,
            "" if made is None else f" (making segments {made:.3f} s)",
            f" ({adopted} segments adopted from a retained layout)" if adopted else "",
        )
        flat = [ref for slot in staged.slots for ref in slot.segments]
        reply = {"layout": staged.id, "slots": len(staged.slots), "segments": len(flat)}
        await self._session.send("registered", frame.id, {**reply, "adopted": adopted})
        await self._session.send_segments(
            frame.id, "segment_fds", {"layout": staged.id}, flat, batch, writable=True
        )

    async def _adopt(
        self, layout: Layout, slots: int, keep: int
    ) -> tuple[StagedLayout, int] | None:
        """Take over a retained layout of this user and structure, if there is one: its
        segments (and the checkpoint its newest slot holds) become this client's, up to
        ``keep`` slots of them, and only the slots it lacks of ``slots`` are created.

        Never one with a leased slot (``retention.adoptable``): between that check and
        ``store.adopt`` nothing awaits, so no lease can come in between."""
        retention = self._retention
        staged = retention.adoptable(self._session.peer.uid, layout, max(slots, keep))
        if staged is None:
            return None
        # Room first for what adopting adds to this user's bytes (its other retained
        # layouts count toward max_bytes); then look again, as a lease may have come.
        lacking = staged.slot_bytes * max(slots - len(staged.slots), 0)
        await retention.make_room(lacking, self._session.peer.uid, adopting=staged)
        if not self._session.open:  # its layouts were released or retained meanwhile
            raise ConnectionError("the client left while its registration waited for room")
        staged = retention.adoptable(self._session.peer.uid, layout, max(slots, keep))
        if staged is None:
            return None
        kept = len(staged.slots)
        slots = max(slots, kept)
        adopted = staged.segment_count
        nbytes = self._store.adopt(self._session.id, staged, slots)
        if kept < slots:
            try:
                await retention.make_room(nbytes, self._session.peer.uid)
                refs = await self._make_slots(layout, slots - kept, nbytes)
            except BaseException:
                self._disown(staged, nbytes)
                raise
            if self._store.layouts.get(staged.id) is not staged:  # collected: client gone
                self._unlink_later([ref.name for slot_refs in refs for ref in slot_refs])
                return staged, adopted
            self._store.extend(staged, refs)
        self._telemetry.registered(created=staged.segment_count - adopted, adopted=adopted)
        return staged, adopted

    async def _make_slots(
        self,
        layout: Layout,
        slots: int,
        nbytes: int,
        threads: int = segment.MAX_CREATE_THREADS,
    ) -> list[list[SegmentRef]]:
        """Create ``slots`` slots' segments (``nbytes``, already charged), in an I/O thread
        on up to ``threads`` setup threads; a full /dev/shm is the client's SHM_EXHAUSTED,
        and the caller undoes the charge."""
        self._check_capacity(nbytes)
        try:
            return await self._create_segments(layout, slots, threads)
        except segment.SegmentError as exc:
            raise RequestError(ErrorCode.SHM_EXHAUSTED, str(exc)) from None

    async def add_slots(self, frame: Frame) -> None:
        """Bring a layout of this client's to ``slots`` slots: the ones it lacks are
        created and sent, writable, like a registration's. A client registers one slot for
        the save that stalls training and asks for the rest while that save persists."""
        staged = self._store.get(self._session.id, frame.body["layout"])
        batch = requests.fds_per_message(frame)
        wanted = frame.body["slots"]
        extra = max(wanted - len(staged.slots), 0)
        if extra:
            await self._retention.make_room(
                self._store.registration_bytes(staged.layout, extra), self._session.peer.uid
            )
        staged = self._store.get(self._session.id, staged.id)  # still this client's after the wait
        nbytes = self._store.reserve_slots(self._session.id, staged, wanted)
        refs: list[list[SegmentRef]] = []
        if nbytes:
            nsegments = len(staged.layout.packing()) * extra
            try:
                refs = await self._make_slots(
                    staged.layout, extra, nbytes, BACKGROUND_CREATE_THREADS
                )
            except BaseException:
                self._store.unreserve(staged.uid, nbytes, nsegments, layouts=0)
                raise
            if staged.released or self._store.layouts.get(staged.id) is not staged:
                self._store.unreserve(staged.uid, nbytes, nsegments, layouts=0)
                self._unlink_later([ref.name for slot in refs for ref in slot])
                raise RequestError(
                    ErrorCode.UNKNOWN_LAYOUT, f"layout {staged.id} was released meanwhile"
                )
            self._store.add_slots(staged, refs, nbytes)
            self._telemetry.registered(created=nsegments, registration=False)
            log.info(
                "%s added %d slot(s) to layout %d: %d slot(s), %d bytes",
                self._session.describe(),
                extra,
                staged.id,
                len(staged.slots),
                staged.bytes_reserved,
            )
        flat = [ref for slot in refs for ref in slot]
        reply = {"layout": staged.id, "slots": len(staged.slots), "segments": len(flat)}
        await self._session.send("slots_added", frame.id, reply)
        await self._session.send_segments(
            frame.id, "segment_fds", {"layout": staged.id}, flat, batch, writable=True
        )

    def _disown(self, staged: StagedLayout, nbytes: int) -> None:
        if staged.owner == self._session.id and staged.retained is None:
            self._store.disown(staged, nbytes, time.monotonic())

    async def acquire(self, frame: Frame) -> None:
        staged = self._store.get(self._session.id, frame.body["layout"])
        slot = self._store.try_acquire(self._session.id, staged)
        if slot is not None:
            await self._session.send(
                "acquired", frame.id, {"layout": staged.id, "slot": slot.index, "waited": 0.0}
            )
            return
        leased = [s.index for s in staged.slots if s.leased and s.state is SlotState.FREE]
        if not frame.body["wait"]:
            raise RequestError(
                ErrorCode.NO_FREE_SLOT,
                f"all {len(staged.slots)} slot(s) of layout {staged.id} are busy with earlier "
                "checkpoints"
                + (f" or leased by readers restoring from them (slots {leased})" if leased else "")
                + "; wait for a slot, or register the layout with more slots",
            )
        timeout = frame.body["timeout"]
        # NaN would poison the loop's timer heap; a negative or infinite one is a client bug.
        if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"acquire.timeout {timeout!r} must be a finite number of seconds >= 0, or null "
                "to wait as long as it takes",
            )
        staged.waiters = collections.deque(w for w in staged.waiters if not w.done())
        if len(staged.waiters) >= MAX_WAITERS_PER_LAYOUT:
            raise RequestError(
                ErrorCode.NO_FREE_SLOT,
                f"{len(staged.waiters)} acquires already wait for layout {staged.id}; wait for "
                "one to be answered before asking again",
            )
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        staged.waiters.append(waiter)
        if leased:
            log.warning(
                "%s: a save waits for slot(s) %s of layout %d, leased by readers restoring "
                "from them (a lease ends within %g s)",
                self._session.describe(),
                leased,
                staged.id,
                self._retention.policy.max_lease_seconds,
            )
        self._session.spawn(self._await_slot(frame, staged, waiter, timeout, bool(leased)))

    async def _await_slot(
        self,
        frame: Frame,
        staged: StagedLayout,
        waiter: asyncio.Future[Any],
        timeout: float | None,
        leased: bool = False,
    ) -> None:
        started = time.perf_counter()
        try:
            slot = await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            await self._session.send_error(
                frame.id,
                ErrorCode.NO_FREE_SLOT,
                f"no slot of layout {staged.id} became free within {timeout} s; earlier "
                "checkpoints are still being written",
            )
            return
        except StoreError as exc:
            await self._session.send_error(frame.id, exc.code, exc.message)
            return
        await self._session.send(
            "acquired",
            frame.id,
            {
                "layout": staged.id,
                "slot": slot.index,
                "waited": time.perf_counter() - started,
                "leased": leased,
            },
        )

    async def cancel(self, frame: Frame) -> None:
        staged = self._store.get(self._session.id, frame.body["layout"])
        slot = self._store.slot(staged, frame.body["slot"])
        self._drop_prepared(staged, slot)  # back to FILLING, then released below
        self._store.release_slot(self._session.id, staged, slot)
        await self._session.send("cancelled", frame.id, {"layout": staged.id, "slot": slot.index})

    async def release(self, frame: Frame) -> None:
        staged = self._store.get(self._session.id, frame.body["layout"])
        self._release(staged)
        await self._session.send("released", frame.id, {"layout": staged.id})
