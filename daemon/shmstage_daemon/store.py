"""The daemon's shared state: every client's layouts, their slots, and the budget.

Limits are per *user* (uid), not per connection: one user opening twelve connections gets
no more than one does, so a node's users cannot crowd each other out. Shared memory is
charged in whole pages, as tmpfs allocates it (a 1-byte tensor reserves 4 KiB), and a
user's retained layouts (kept for its restart, see ``retention``) stay charged to it:
``max_bytes`` holds for its live and retained layouts together.

Only the event loop touches a Store. Segment creation and unlinking are blocking calls, so
the session runs them in the thread pool and reports back here; writer threads never see a
Store at all, they get a self-contained job and return a result.
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from shmstage import datafile
from shmstage.layout import Layout
from shmstage.manifest import TensorEntries
from shmstage.protocol import ErrorCode
from shmstage.segment import SegmentRef
from shmstage_daemon.slot import Slot, SlotError, SlotState


class StoreError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


PAGE: Final = mmap.PAGESIZE


def pages(nbytes: int) -> int:
    """What a segment of ``nbytes`` really takes in /dev/shm: whole pages, at least one."""
    return max(1, -(-nbytes // PAGE)) * PAGE


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-user and daemon-wide ceilings; every refusal names the limit that applied."""

    shm_budget_bytes: int
    max_user_bytes: int = 1 << 62
    max_user_segments: int = 1 << 20
    max_user_layouts: int = 64
    max_user_jobs: int = 32
    #: Connections one user may hold open (each is a descriptor and buffers in the daemon).
    max_user_connections: int = 64
    #: Commits one user may have sent ahead of their copy ("prepared"), each journaled.
    max_user_prepared: int = 32
    #: Journal bytes one user's entries may take (the journal lives in /dev/shm).
    max_user_journal_bytes: int = 64 << 20
    #: Bytes of incomplete frames one user's connections may have the daemon buffer.
    max_user_buffered_bytes: int = 256 << 20
    max_tensors_per_layout: int = 200_000
    max_slots: int = 8

    def to_wire(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True)
class SlotWire:
    """A slot as the journal records it: the layout's tensors and the slot's segments,
    with their msgpack encoding. The same for every save of the slot, so it is built once:
    at 10,000 tensors encoding it on each commit would add milliseconds to the stall."""

    tensors: list[Any]
    segments: list[tuple[str, int]]
    packed: dict[str, bytes]

    @classmethod
    def of(
        cls, layout: Layout, refs: Sequence[SegmentRef], like: SlotWire | None = None
    ) -> SlotWire:
        """``like``: another slot's record of the same layout, whose tensors are these (at
        100,000 tensors encoding them took a quarter of a second of a commit's answer)."""
        packer = msgpack.Packer(use_bin_type=True)
        if like is None:
            tensors = layout.to_wire()
            packed_tensors = packer.pack(tensors)
        else:
            tensors, packed_tensors = like.tensors, like.packed["tensors"]
        segments = [(ref.name, ref.size) for ref in refs]
        return cls(
            tensors, segments, {"tensors": packed_tensors, "segments": packer.pack(segments)}
        )


@dataclass
class StagedLayout:
    id: int
    owner: int
    layout: Layout
    slots: list[Slot]
    bytes_reserved: int
    #: The registering client's uid: whose limits it counts against, whose checkpoints
    #: its slots hold.
    uid: int = -1
    released: bool = False
    #: When its client went away and the daemon kept it for a restart (monotonic), or None
    #: while a client owns it (``retention``).
    retained: float | None = None
    waiters: deque[asyncio.Future[Slot]] = field(default_factory=deque)
    #: safetensors headers already built for this layout, by file metadata: with 10,000
    #: tensors building one costs tens of milliseconds that every commit would repeat.
    headers: dict[tuple[tuple[str, str], ...], bytes] = field(default_factory=dict)
    #: Manifest entries rendered by its jobs, by data file name (``manifest.TensorEntries``:
    #: tens of milliseconds per save at 10,000 tensors); kept by the event loop.
    entries: dict[str, TensorEntries] = field(default_factory=dict, repr=False)
    wires: dict[int, SlotWire] = field(default_factory=dict, repr=False)
    #: Its last commit's tree as it came and decoded, checked against the layout: the
    #: next commit of the same tree decodes and checks nothing (``requests.commit_tree``).
    tree: tuple[bytes, Any] | None = field(default=None, repr=False)

    def wire(self, slot: Slot) -> SlotWire:
        """The journal's record of ``slot``, built on its first commit."""
        cached = self.wires.get(slot.index)
        if cached is None:
            like = next(iter(self.wires.values()), None)
            cached = self.wires[slot.index] = SlotWire.of(self.layout, slot.segments, like)
        return cached

    def header(self, file_metadata: dict[str, str]) -> bytes:
        key = tuple(sorted(file_metadata.items()))
        cached = self.headers.get(key)
        if cached is None:
            if len(self.headers) >= 4:  # metadata that changes every save: do not hoard
                self.headers.clear()
            cached = self.headers[key] = datafile.build_header(self.layout, file_metadata)
        return cached

    def keep_entries(self, entries: TensorEntries | None) -> None:
        """Keep what a finished job rendered for this layout's next save to that file."""
        if entries is None or entries.layout is not self.layout:
            return
        if entries.data_file not in self.entries and len(self.entries) >= 4:
            self.entries.clear()  # a file name that changes every save: do not hoard
        self.entries[entries.data_file] = entries

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
class UserUsage:
    """What one uid holds across all its connections; every limit is checked against it."""

    bytes: int = 0
    segments: int = 0
    layouts: int = 0
    jobs: int = 0
    connections: int = 0
    prepared: int = 0
    journal_bytes: int = 0
    buffered_bytes: int = 0
    #: Bytes of its layouts the daemon keeps for its restart (``retention``); they count
    #: toward ``max_bytes`` with ``bytes``, the layouts it owns now.
    retained_bytes: int = 0

    def idle(self) -> bool:
        return not any(vars(self).values())


class Store:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.layouts: dict[int, StagedLayout] = {}
        #: session id -> its layouts, so that per-client questions cost that client's size.
        self.by_session: dict[int, dict[int, StagedLayout]] = {}
        #: session id -> uid, and what each uid holds.
        self.uids: dict[int, int] = {}
        self.usage: dict[int, UserUsage] = {}
        self.reserved_bytes = 0
        #: Layouts whose client went away, kept for a restart (see ``retention``), by id.
        self.retained: dict[int, StagedLayout] = {}
        self._layout_ids = itertools.count(1)
        self._job_ids = itertools.count(1)

    # -- users -------------------------------------------------------------------

    def user(self, session: int) -> UserUsage:
        return self.usage.setdefault(self.uids.get(session, -1), UserUsage())

    def open_session(self, session: int, uid: int) -> None:
        """Count a new connection of ``uid``; refuses one over the user's limit."""
        usage = self.usage.setdefault(uid, UserUsage())
        if usage.connections >= self.limits.max_user_connections:
            raise StoreError(
                ErrorCode.LIMIT_EXCEEDED,
                f"uid {uid} already has {usage.connections} connections to shmstaged (limit "
                f"{self.limits.max_user_connections}, max_connections); close some first",
            )
        usage.connections += 1
        self.uids[session] = uid
        self.by_session[session] = {}

    def take(self, session: int, what: str, amount: int, limit: int, setting: str) -> Taken:
        """Add ``amount`` to one of the user's counters, or refuse naming the limit; what
        is taken goes back by ``release`` on the answer, exactly once (a second release
        gives nothing back), so no caller pairs a charge with a charge of minus as much."""
        taken = Taken(self, self.uids.get(session, -1), what, setting, self.uids.get(session))
        taken.resize(amount, limit)
        return taken

    # -- registration ------------------------------------------------------------

    def reserve(self, session: int, layout: Layout, slots: int, planned: int = 0) -> int:
        """Charge a registration against the limits before any segment exists.

        ``planned``: the slots the layout will have once its client adds the others
        (``reserve_slots``); the limits must allow that many now, so that a layout they
        could never hold is refused at once, though only ``slots`` are charged.
        """
        self.check_slots(slots)
        if planned > slots:
            self.check_slots(planned)
            nbytes = self.registration_bytes(layout, planned)
            nsegments = len(layout.packing()) * planned
            self._charge(session, nbytes, nsegments, nbytes, planned, layout.nbytes, apply=False)
        nbytes = self.registration_bytes(layout, slots)
        nsegments = len(layout.packing()) * slots
        self._charge(session, nbytes, nsegments, nbytes, slots, layout.nbytes)
        return nbytes

    @staticmethod
    def registration_bytes(layout: Layout, slots: int) -> int:
        """What registering ``layout`` with ``slots`` slots takes: its segments in whole
        pages, as tmpfs takes them (a layout without tensors still costs a page)."""
        return max(sum(pages(size) for size in layout.packing().sizes), PAGE) * slots

    def check_slots(self, slots: int) -> None:
        if not 1 <= slots <= self.limits.max_slots:
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"slots={slots}: this daemon allows 1..{self.limits.max_slots}",
            )

    def _charge(
        self,
        session: int,
        nbytes: int,
        nsegments: int,
        new_bytes: int,
        slots: int,
        size: int,
        *,
        layouts: int = 1,
        apply: bool = True,
    ) -> None:
        """Charge a layout of ``nbytes`` to a client's user, of which ``new_bytes`` are not
        in shared memory yet (an adopted layout's are), refusing what a limit forbids;
        ``layouts=0`` for slots added to a layout already charged (``reserve_slots``),
        ``apply=False`` to check only."""
        lim = self.limits
        usage = self.user(session)
        checks = [
            ("layouts", usage.layouts + layouts, lim.max_user_layouts, "max_layouts"),
            ("bytes", usage.bytes + usage.retained_bytes + nbytes, lim.max_user_bytes, "max_bytes"),
            ("segments", usage.segments + nsegments, lim.max_user_segments, "max_segments"),
        ]
        for what, wanted, limit, setting in checks:
            if wanted > limit:
                retained = (
                    f" ({usage.retained_bytes} of them its retained checkpoints, which leases "
                    "still hold)"
                    if what == "bytes" and usage.retained_bytes
                    else ""
                )
                raise StoreError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"this registration would bring uid {self.uids.get(session)} to {wanted} "
                    f"{what}{retained}, over its limit of {limit} ({setting}, for all its "
                    "connections together); release layouts first or raise the limit in "
                    "shmstaged's configuration",
                )
        if self.reserved_bytes + new_bytes > lim.shm_budget_bytes:
            raise StoreError(
                ErrorCode.SHM_EXHAUSTED,
                f"staging {new_bytes} bytes ({slots} slot(s) of {size}, in whole pages) would "
                f"exceed shmstaged's shared-memory budget ({self.reserved_bytes} of "
                f"{lim.shm_budget_bytes} bytes in use); use fewer slots, release other "
                "layouts, or raise the budget",
            )
        if not apply:
            return
        self.reserved_bytes += new_bytes
        usage.bytes += nbytes
        usage.segments += nsegments
        usage.layouts += layouts

    def unreserve(self, uid: int, nbytes: int, nsegments: int, *, layouts: int = 1) -> None:
        self.reserved_bytes -= nbytes
        usage = self.usage.get(uid)
        if usage is not None:
            usage.bytes -= nbytes
            usage.segments -= nsegments
            usage.layouts -= layouts
            self._forget_if_idle(uid)

    def reserve_slots(self, session: int, staged: StagedLayout, slots: int) -> int:
        """Charge the slots that bring a client's layout to ``slots`` (``add_slots``),
        before any of their segments exists; returns their bytes (0: nothing to add).

        A client registers one slot for its first save and asks for the others once that
        save is on its way, so that the save that stalls training sets up one slot, not all.
        """
        self.check_slots(slots)
        extra = slots - len(staged.slots)
        if extra <= 0:
            return 0
        nbytes = self.registration_bytes(staged.layout, extra)
        nsegments = len(staged.layout.packing()) * extra
        self._charge(session, nbytes, nsegments, nbytes, slots, staged.layout.nbytes, layouts=0)
        return nbytes

    def add_slots(self, staged: StagedLayout, refs: list[list[SegmentRef]], nbytes: int) -> None:
        """The slots ``reserve_slots`` charged, made: a waiting acquire may take one now."""
        staged.bytes_reserved += nbytes
        self.extend(staged, refs)
        if refs:
            self.hand_over(staged, staged.slots[-1])

    def _forget_if_idle(self, uid: int) -> None:
        usage = self.usage.get(uid)
        if usage is not None and usage.idle():
            del self.usage[uid]

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
            uid=self.uids.get(session, uid),
        )
        self.layouts[staged.id] = staged
        self.by_session.setdefault(session, {})[staged.id] = staged
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

    def next_id(self) -> int:
        """A new job or version id: one counter, so that a slot's age orders both."""
        return next(self._job_ids)

    def begin_job(self, session: int, staged: StagedLayout, slot: Slot) -> int:
        usage = self.user(session)
        if usage.jobs >= self.limits.max_user_jobs:
            raise StoreError(
                ErrorCode.LIMIT_EXCEEDED,
                f"uid {staged.uid} already has {usage.jobs} checkpoints being written (limit "
                f"{self.limits.max_user_jobs}, max_jobs); wait for one to finish",
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
        self._job_ended(staged)
        if staged.released:
            return
        slot.acquire(session)

    def end_job(self, session: int, staged: StagedLayout, slot: Slot, job: int) -> None:
        slot.finish(job)
        self._job_ended(staged)
        self.hand_over(staged, slot)

    def _job_ended(self, staged: StagedLayout) -> None:
        usage = self.usage.get(staged.uid)
        if usage is not None:
            usage.jobs -= 1

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
        self._unindex(staged)
        self.unreserve(staged.uid, staged.bytes_reserved, staged.segment_count)
        return staged.segment_names()

    # -- retention (see ``retention``) --------------------------------------------------

    @property
    def retained_bytes(self) -> int:
        return sum(staged.bytes_reserved for staged in self.retained.values())

    def retained_of(self, uid: int) -> int:
        usage = self.usage.get(uid)
        return usage.retained_bytes if usage is not None else 0

    def _retained_charge(self, uid: int, nbytes: int) -> None:
        """Move ``nbytes`` of ``uid`` into (positive) or out of (negative) its retained."""
        usage = self.usage.setdefault(uid, UserUsage())
        usage.retained_bytes += nbytes
        self._forget_if_idle(uid)

    def retain(self, staged: StagedLayout, now: float) -> None:
        """The client went away: keep the layout, owned by nobody, for a restart. Its
        bytes stay in the budget and charged to its user (as retained); its segments and
        the layout no longer count toward the user's limits."""
        self.mark_released(staged)
        staged.released = False
        staged.retained = now
        usage = self.usage.get(staged.uid)
        if usage is not None:
            usage.bytes -= staged.bytes_reserved
            usage.segments -= staged.segment_count
            usage.layouts -= 1
        self._retained_charge(staged.uid, staged.bytes_reserved)
        self._unindex(staged)
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
        nsegments = len(staged.layout.packing()) * (len(staged.slots) + extra)
        self._retained_charge(staged.uid, -staged.bytes_reserved)
        try:
            self._charge(session, nbytes, nsegments, per_slot * extra, slots, staged.layout.nbytes)
        except StoreError:
            self._retained_charge(staged.uid, staged.bytes_reserved)
            raise
        del self.retained[staged.id]
        staged.owner, staged.retained = session, None
        self.by_session.setdefault(session, {})[staged.id] = staged
        staged.bytes_reserved += per_slot * extra
        return per_slot * extra

    def disown(self, staged: StagedLayout, nbytes: int, now: float) -> None:
        """Undo ``adopt`` (the slots it lacked could not be made): retained again."""
        staged.bytes_reserved -= nbytes
        self.reserved_bytes -= nbytes
        usage = self.usage.get(staged.uid)
        if usage is not None and nbytes:  # ``adopt`` charged the slots it lacked too
            usage.bytes -= nbytes
            usage.segments -= len(staged.layout.packing()) * (nbytes // staged.slot_bytes)
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
        self._retained_charge(staged.uid, -nbytes)
        staged.renumber()
        return [ref.name for ref in slot.segments]

    def evict(self, staged: StagedLayout) -> list[str]:
        """Forget a retained layout; returns its segments to unlink."""
        del self.retained[staged.id]
        del self.layouts[staged.id]
        self.reserved_bytes -= staged.bytes_reserved
        self._retained_charge(staged.uid, -staged.bytes_reserved)
        return staged.segment_names()

    def _unindex(self, staged: StagedLayout) -> None:
        own = self.by_session.get(staged.owner)
        if own is not None:
            own.pop(staged.id, None)
            if not own and staged.owner not in self.uids:  # its connection is gone too
                del self.by_session[staged.owner]

    def layouts_of(self, session: int) -> list[StagedLayout]:
        return list(self.by_session.get(session, {}).values())

    def forget_client(self, session: int) -> None:
        """The connection ended: one connection fewer for its user."""
        uid = self.uids.pop(session, -1)
        if not self.by_session.get(session):
            self.by_session.pop(session, None)
        usage = self.usage.get(uid)
        if usage is not None:
            usage.connections -= 1
            self._forget_if_idle(uid)

    def all_segment_names(self) -> list[str]:
        return [name for staged in self.layouts.values() for name in staged.segment_names()]


class Taken:
    """Part of one user's counter (``UserUsage.<what>``), held until ``release``.

    It stays the user's it was taken for, whichever connection asked and whether or not
    that connection is still open when it goes back. ``resize`` suits a counter that
    follows something growing and shrinking (the bytes of a frame still arriving): only
    growing is checked against the limit.
    """

    def __init__(self, store: Store, uid: int, what: str, setting: str, shown: Any) -> None:
        self._store = store
        self.uid = uid
        self._shown = shown  # the uid as refusals name it
        self.what = what
        self._setting = setting
        self.amount = 0
        self.released = False

    def resize(self, amount: int, limit: int) -> None:
        """Hold ``amount`` from now on, or refuse (holding what was held) naming the limit."""
        if self.released:
            raise RuntimeError(f"{self.what} of uid {self.uid} was released already")
        usage = self._store.usage.setdefault(self.uid, UserUsage())
        held = getattr(usage, self.what)
        delta = amount - self.amount
        if delta > 0 and held + delta > limit:
            raise StoreError(
                ErrorCode.LIMIT_EXCEEDED,
                f"uid {self._shown} would hold {held + delta} {self.what.replace('_', ' ')} "
                f"(limit {limit}, {self._setting}); wait for earlier work to finish or raise "
                "the limit in shmstaged's configuration",
            )
        setattr(usage, self.what, held + delta)
        self.amount = amount

    def release(self) -> None:
        """Give it all back; once (the user may be gone from the books by then: nothing)."""
        if self.released:
            return
        self.released = True
        usage = self._store.usage.get(self.uid)
        if usage is not None:
            setattr(usage, self.what, getattr(usage, self.what) - self.amount)
        self.amount = 0


def _oldest_free(staged: StagedLayout) -> Slot | None:
    free = [slot for slot in staged.slots if slot.state is SlotState.FREE and not slot.leased]
    return min(free, key=lambda slot: slot.age, default=None)
