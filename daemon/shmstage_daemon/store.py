"""The daemon's shared state: every client's layouts, their slots, and the budget.

Only the event loop touches a Store. Segment creation and unlinking are blocking calls, so
the session runs them in the thread pool and reports back here; writer threads never see a
Store at all, they get a self-contained job and return a result.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shmstage import datafile
from shmstage.layout import Layout
from shmstage.protocol import ErrorCode
from shmstage.segment import SegmentRef
from shmstage_daemon.slot import Slot, SlotError, SlotState


class StoreError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-client and daemon-wide ceilings; every refusal names the limit that applied."""

    shm_budget_bytes: int
    max_client_bytes: int = 1 << 62
    max_client_segments: int = 1 << 20
    max_client_layouts: int = 8
    max_client_jobs: int = 16
    max_tensors_per_layout: int = 200_000
    max_slots: int = 8

    def to_wire(self) -> dict[str, int]:
        return {
            "shm_budget_bytes": self.shm_budget_bytes,
            "max_client_bytes": self.max_client_bytes,
            "max_client_segments": self.max_client_segments,
            "max_client_layouts": self.max_client_layouts,
            "max_client_jobs": self.max_client_jobs,
            "max_tensors_per_layout": self.max_tensors_per_layout,
            "max_slots": self.max_slots,
        }


@dataclass(frozen=True)
class SlotWire:
    """A slot as the journal records it: the layout's tensors and the slot's segments,
    with their msgpack encoding. The same for every save of the slot, so it is built once:
    at 10,000 tensors encoding it on each commit would add milliseconds to the stall."""

    tensors: list[Any]
    segments: list[tuple[str, int]]
    packed: dict[str, bytes]

    @classmethod
    def of(cls, layout: Layout, refs: Sequence[SegmentRef]) -> SlotWire:
        tensors = layout.to_wire()
        segments = [(ref.name, ref.size) for ref in refs]
        packer = msgpack.Packer(use_bin_type=True)
        return cls(
            tensors, segments, {"tensors": packer.pack(tensors), "segments": packer.pack(segments)}
        )


@dataclass
class StagedLayout:
    id: int
    owner: int
    layout: Layout
    slots: list[Slot]
    bytes_reserved: int
    released: bool = False
    waiters: deque[asyncio.Future[Slot]] = field(default_factory=deque)
    #: The registering client's uid: whose checkpoints the slots hold.
    uid: int = -1
    #: When its client went away and the daemon kept it for a restart (monotonic), or None
    #: while a client owns it (``retention``).
    retained: float | None = None
    #: safetensors headers already built for this layout, by file metadata: with 10,000
    #: tensors building one costs tens of milliseconds that every commit would repeat.
    headers: dict[tuple[tuple[str, str], ...], bytes] = field(default_factory=dict)
    wires: dict[int, SlotWire] = field(default_factory=dict, repr=False)

    def wire(self, slot: Slot) -> SlotWire:
        """The journal's record of ``slot``, built on its first commit."""
        cached = self.wires.get(slot.index)
        if cached is None:
            cached = self.wires[slot.index] = SlotWire.of(self.layout, slot.segments)
        return cached

    def header(self, file_metadata: dict[str, str]) -> bytes:
        key = tuple(sorted(file_metadata.items()))
        cached = self.headers.get(key)
        if cached is None:
            if len(self.headers) >= 4:  # metadata that changes every save: do not hoard
                self.headers.clear()
            cached = self.headers[key] = datafile.build_header(self.layout, file_metadata)
        return cached

    @property
    def segment_count(self) -> int:
        return sum(len(slot.segments) for slot in self.slots)

    def idle(self) -> bool:
        return all(slot.state is SlotState.FREE for slot in self.slots)

    def segment_names(self) -> list[str]:
        return [ref.name for slot in self.slots for ref in slot.segments]

    @property
    def slot_bytes(self) -> int:
        return self.bytes_reserved // max(len(self.slots), 1)

    def newest(self) -> Slot | None:
        """The slot holding the newest acknowledged checkpoint, if any holds one."""
        holding = [slot for slot in self.slots if slot.held is not None]
        return max(holding, key=lambda slot: slot.age, default=None)

    def leased(self) -> bool:
        return any(slot.leased for slot in self.slots)

    def renumber(self) -> None:
        """Slot numbers are positions: after slots were dropped or added, renumber them
        (leases and jobs refer to the slot objects, never to numbers)."""
        for index, slot in enumerate(self.slots):
            slot.index = index
        self.wires.clear()


@dataclass
class ClientUsage:
    bytes: int = 0
    segments: int = 0
    layouts: int = 0
    jobs: int = 0


class Store:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.layouts: dict[int, StagedLayout] = {}
        self.usage: dict[int, ClientUsage] = {}
        self.reserved_bytes = 0
        #: Layouts whose client went away, kept for a restart (see ``retention``), by id.
        self.retained: dict[int, StagedLayout] = {}
        self._layout_ids = itertools.count(1)
        self._job_ids = itertools.count(1)

    # -- registration ------------------------------------------------------------

    def reserve(self, session: int, layout: Layout, slots: int) -> int:
        """Charge a registration against the limits before any segment exists."""
        self.check_slots(slots)
        nbytes = self.registration_bytes(layout, slots)
        nsegments = len(layout.tensors) * slots
        self._charge(session, nbytes, nsegments, nbytes, slots, layout.nbytes)
        return nbytes

    @staticmethod
    def registration_bytes(layout: Layout, slots: int) -> int:
        """What registering ``layout`` with ``slots`` slots takes from the budget."""
        return sum(max(spec.nbytes, 1) for spec in layout.tensors) * slots

    def check_slots(self, slots: int) -> None:
        if not 1 <= slots <= self.limits.max_slots:
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"slots={slots}: this daemon allows 1..{self.limits.max_slots}",
            )

    def _charge(
        self, session: int, nbytes: int, nsegments: int, new_bytes: int, slots: int, size: int
    ) -> None:
        """Charge a layout of ``nbytes`` to a client, of which ``new_bytes`` are not in
        shared memory yet (an adopted layout's are), refusing what a limit forbids."""
        lim = self.limits
        usage = self.usage.setdefault(session, ClientUsage())
        checks = [
            (
                usage.layouts + 1 > lim.max_client_layouts,
                "layouts",
                usage.layouts + 1,
                lim.max_client_layouts,
            ),
            (
                usage.bytes + nbytes > lim.max_client_bytes,
                "bytes",
                usage.bytes + nbytes,
                lim.max_client_bytes,
            ),
            (
                usage.segments + nsegments > lim.max_client_segments,
                "segments",
                usage.segments + nsegments,
                lim.max_client_segments,
            ),
        ]
        for exceeded, what, wanted, limit in checks:
            if exceeded:
                raise StoreError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"this registration would bring the client to {wanted} {what}, over its "
                    f"limit of {limit}; release layouts first or raise the limit in "
                    "shmstaged's configuration",
                )
        if self.reserved_bytes + new_bytes > lim.shm_budget_bytes:
            raise StoreError(
                ErrorCode.SHM_EXHAUSTED,
                f"staging {new_bytes} bytes ({slots} slot(s) of {size}) would exceed "
                f"shmstaged's shared-memory budget ({self.reserved_bytes} of "
                f"{lim.shm_budget_bytes} bytes in use); use fewer slots, release other "
                "layouts, or raise the budget",
            )
        self.reserved_bytes += new_bytes
        usage.bytes += nbytes
        usage.segments += nsegments
        usage.layouts += 1

    def unreserve(self, session: int, nbytes: int, nsegments: int) -> None:
        self.reserved_bytes -= nbytes
        usage = self.usage.get(session)
        if usage is not None:
            usage.bytes -= nbytes
            usage.segments -= nsegments
            usage.layouts -= 1

    def add(
        self,
        session: int,
        layout: Layout,
        slots: list[list[SegmentRef]],
        nbytes: int,
        *,
        uid: int = -1,
    ) -> StagedLayout:
        staged = StagedLayout(
            id=next(self._layout_ids),
            owner=session,
            layout=layout,
            slots=[Slot(i, refs) for i, refs in enumerate(slots)],
            bytes_reserved=nbytes,
            uid=uid,
        )
        self.layouts[staged.id] = staged
        return staged

    def get(self, session: int, layout_id: int) -> StagedLayout:
        staged = self.layouts.get(layout_id)
        if staged is None or staged.owner != session or staged.released:
            raise StoreError(
                ErrorCode.UNKNOWN_LAYOUT,
                f"layout {layout_id} is not registered by this client (released, or never "
                "registered); register the state dict's structure again",
            )
        return staged

    # -- slots -------------------------------------------------------------------

    def try_acquire(self, session: int, staged: StagedLayout) -> Slot | None:
        """A free slot for a new fill: the one holding the oldest checkpoint, so that the
        newest stays in memory (for a restart) as long as the layout lives. Leased slots
        are being read and never refilled."""
        slot = _oldest_free(staged)
        if slot is not None:
            slot.acquire(session)
        return slot

    def slot(self, staged: StagedLayout, index: int) -> Slot:
        if not 0 <= index < len(staged.slots):
            raise StoreError(ErrorCode.BAD_REQUEST, f"layout {staged.id} has no slot {index}")
        return staged.slots[index]

    def begin_job(self, session: int, staged: StagedLayout, slot: Slot) -> int:
        usage = self.usage.setdefault(session, ClientUsage())
        if usage.jobs >= self.limits.max_client_jobs:
            raise StoreError(
                ErrorCode.LIMIT_EXCEEDED,
                f"this client already has {usage.jobs} checkpoints being written (limit "
                f"{self.limits.max_client_jobs}); wait for one to finish",
            )
        job = next(self._job_ids)
        try:
            slot.commit(session, job)
        except SlotError as exc:
            raise StoreError(ErrorCode.SLOT_NOT_OWNED, str(exc)) from None
        usage.jobs += 1
        return job

    def abort_job(self, session: int, staged: StagedLayout, slot: Slot, job: int) -> None:
        """Undo ``begin_job`` for a commit that was refused after all (never acknowledged).

        Like any refused commit, the slot goes back to the client that filled it, which may
        cancel it or commit again — unless its layout was released meanwhile.
        """
        slot.finish(job)
        usage = self.usage.get(session)
        if usage is not None:
            usage.jobs -= 1
        if staged.released:
            return
        slot.acquire(session)

    def end_job(self, session: int, staged: StagedLayout, slot: Slot, job: int) -> None:
        slot.finish(job)
        usage = self.usage.get(session)
        if usage is not None:
            usage.jobs -= 1
        self.hand_over(staged, slot)

    def release_slot(self, session: int, staged: StagedLayout, slot: Slot) -> None:
        try:
            slot.cancel(session)
        except SlotError as exc:
            raise StoreError(ErrorCode.SLOT_NOT_OWNED, str(exc)) from None
        self.hand_over(staged, slot)

    def hand_over(self, staged: StagedLayout, slot: Slot) -> None:
        """A slot just became free: the longest waiter gets it, in the loop, atomically."""
        while staged.waiters and not staged.released and staged.retained is None:
            free = _oldest_free(staged)
            if free is None:
                return
            waiter = staged.waiters.popleft()
            if not waiter.done():
                free.acquire(staged.owner)
                waiter.set_result(free)

    # -- release -----------------------------------------------------------------

    def mark_released(self, staged: StagedLayout) -> None:
        staged.released = True
        for waiter in staged.waiters:
            if not waiter.done():
                waiter.set_exception(
                    StoreError(ErrorCode.UNKNOWN_LAYOUT, f"layout {staged.id} was released")
                )
        staged.waiters.clear()
        for slot in staged.slots:
            if slot.state is SlotState.FILLING:
                slot.state, slot.holder = SlotState.FREE, None

    def collect(self, staged: StagedLayout) -> list[str] | None:
        """If a released layout is idle, forget it and return its segments to unlink."""
        if not staged.released or not staged.idle() or staged.id not in self.layouts:
            return None
        if staged.leased():  # readers still map it; collected when the last lease ends
            return None
        del self.layouts[staged.id]
        self.unreserve(staged.owner, staged.bytes_reserved, staged.segment_count)
        return staged.segment_names()

    # -- retention (see ``retention``) --------------------------------------------------

    @property
    def retained_bytes(self) -> int:
        return sum(staged.bytes_reserved for staged in self.retained.values())

    def retain(self, staged: StagedLayout, now: float) -> None:
        """The client went away: keep the layout, owned by nobody, for a restart. Its
        bytes stay in the budget; the client's usage is given back."""
        self.mark_released(staged)
        staged.released = False
        staged.retained = now
        usage = self.usage.get(staged.owner)
        if usage is not None:
            usage.bytes -= staged.bytes_reserved
            usage.segments -= staged.segment_count
            usage.layouts -= 1
        staged.owner = 0
        self.retained[staged.id] = staged

    def adopt(self, session: int, staged: StagedLayout, slots: int) -> int:
        """A client registers the structure of a retained layout of its own: it becomes
        the client's, charged as a registration of ``slots`` slots would be, of which only
        the slots it lacks are new to shared memory. Returns the bytes those need."""
        self.check_slots(slots)
        per_slot = staged.slot_bytes
        extra = max(slots - len(staged.slots), 0)
        nbytes = per_slot * (len(staged.slots) + extra)
        nsegments = len(staged.layout.tensors) * (len(staged.slots) + extra)
        self._charge(session, nbytes, nsegments, per_slot * extra, slots, staged.layout.nbytes)
        del self.retained[staged.id]
        staged.owner, staged.retained = session, None
        staged.bytes_reserved += per_slot * extra
        return per_slot * extra

    def disown(self, staged: StagedLayout, nbytes: int, now: float) -> None:
        """Undo ``adopt`` (the slots it lacked could not be made): retained again."""
        staged.bytes_reserved -= nbytes
        self.reserved_bytes -= nbytes
        self.retain(staged, now)

    def extend(self, staged: StagedLayout, refs: list[list[SegmentRef]]) -> None:
        """New slots for an adopted layout (their bytes were charged by ``adopt``)."""
        staged.slots.extend(Slot(0, slot_refs) for slot_refs in refs)
        staged.renumber()

    def drop_slot(self, staged: StagedLayout, slot: Slot) -> list[str]:
        """Give up one slot of a retained layout; returns its segments to unlink."""
        nbytes = staged.slot_bytes
        staged.slots.remove(slot)
        staged.bytes_reserved -= nbytes
        self.reserved_bytes -= nbytes
        staged.renumber()
        return [ref.name for ref in slot.segments]

    def evict(self, staged: StagedLayout) -> list[str]:
        """Forget a retained layout; returns its segments to unlink."""
        del self.retained[staged.id]
        del self.layouts[staged.id]
        self.reserved_bytes -= staged.bytes_reserved
        return staged.segment_names()

    def layouts_of(self, session: int) -> list[StagedLayout]:
        return [staged for staged in self.layouts.values() if staged.owner == session]

    def forget_client(self, session: int) -> None:
        if not self.layouts_of(session):
            self.usage.pop(session, None)

    def all_segment_names(self) -> list[str]:
        return [name for staged in self.layouts.values() for name in staged.segment_names()]


def _oldest_free(staged: StagedLayout) -> Slot | None:
    free = [slot for slot in staged.slots if slot.state is SlotState.FREE and not slot.leased]
    return min(free, key=lambda slot: slot.age, default=None)
