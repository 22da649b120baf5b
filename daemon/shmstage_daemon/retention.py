"""Checkpoints kept in memory for a restart, and the leases of the readers restoring them.

A trainer that dies (an OOM, a NCCL abort, a preempted job step) leaves the node and this
daemon running, and the newest checkpoint it acknowledged is still in a slot's segments.
So when a client goes away without releasing its layout, the daemon keeps the layout —
*retained*, owned by nobody — instead of unlinking it, for ``ttl`` seconds and within a
byte ``budget``; a restarted trainer of the same uid then reads the checkpoint back at
memory speed (a *lease*), and registering the same structure again *adopts* the segments
(no segment is created for its first save).

Retention never costs a live trainer anything: retained memory is given back oldest first
— first the slots not holding the newest checkpoint, then whole layouts — whenever the
budget is exceeded, /dev/shm or the node's memory runs short of ``min_free``, a
registration needs the room, or the ``ttl`` runs out. A retained layout dies with its
daemon: the next start reaps its segments like any orphan's (unless the journal still owes
the job writing it, which is finished first).

A lease makes a slot unacquirable, so nothing refills what a reader is copying. Leases are
bounded in time (renewals never past ``max_lease_seconds`` from the grant), die with the
reader's connection, are counted per uid, and a reader other than the owner may never hold
the last slot of a layout that has several: the owner's next save always has another slot,
or waits at most until a lease ends (and is told so).

Only the event loop calls into this module; every decision is O(the retained layouts or
the caller's own checkpoints).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shmstage.protocol import ErrorCode
from shmstage_daemon import job
from shmstage_daemon.admission import Peer
from shmstage_daemon.config import measure_shm
from shmstage_daemon.slot import FileId, Held, Slot, SlotState
from shmstage_daemon.store import StagedLayout, Store, StoreError
from shmstage_daemon.telemetry import Telemetry

log = logging.getLogger("shmstaged.retention")

#: How often retained layouts are checked against the TTL, the budget and memory pressure.
SWEEP_INTERVAL_S = 1.0


@dataclass(frozen=True)
class RetentionPolicy:
    #: Seconds a layout is kept after its client went away; 0 keeps nothing.
    ttl: float = 1800.0
    #: Bytes all retained layouts may hold together; 0 keeps nothing.
    budget_bytes: int = 0
    #: Retained memory is given back while less than this is free in /dev/shm (or
    #: available to the daemon's memory cgroup).
    min_free_bytes: int = 0
    #: A lease's time when the reader does not ask for one, and the most any lease lives.
    lease_seconds: float = 60.0
    max_lease_seconds: float = 600.0
    #: Leases one uid may hold at once.
    max_leases: int = 64
    #: Groups whose members may lease other users' checkpoints (the owner always may).
    restore_groups: frozenset[int] = frozenset()

    @property
    def enabled(self) -> bool:
        return self.ttl > 0 and self.budget_bytes > 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "ttl_seconds": self.ttl,
            "budget_bytes": self.budget_bytes,
            "min_free_bytes": self.min_free_bytes,
            "lease_seconds": self.lease_seconds,
            "max_lease_seconds": self.max_lease_seconds,
            "max_leases": self.max_leases,
            "restore_groups": sorted(self.restore_groups),
        }


@dataclass
class Lease:
    id: int
    session: int
    uid: int
    staged: StagedLayout
    slot: Slot
    #: monotonic times: when it was granted, when it ends, and past what no renewal goes.
    granted: float
    expires: float
    deadline: float
    timer: asyncio.TimerHandle | None = None


_Entry = tuple[StagedLayout, Slot, Held]


def held_of(persist: job.PersistJob, peer: Peer) -> Held:
    """What a slot will hold once this job's commit is acknowledged (fstat only).

    The directory's parent is where ``latest(under=...)`` looks: the directory the client
    made the new checkpoint directory in, or for files written into an existing directory,
    that directory's ``..`` (looked up from its descriptor, never from a path).
    """
    dest = persist.destination
    data, directory = os.fstat(dest.data_fd), os.fstat(dest.dir_fd)
    parent_id: FileId | None = None
    with contextlib.suppress(OSError):
        if dest.pending:
            parent = os.fstat(dest.parent_fd)
        else:
            fd = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dest.dir_fd)
            try:
                parent = os.fstat(fd)
            finally:
                os.close(fd)
        parent_id = (parent.st_dev, parent.st_ino)
    located = None
    with contextlib.suppress(OSError):  # for status and latest() only; never opened
        located = os.readlink(f"/proc/self/fd/{dest.dir_fd}")
    return Held(
        job=persist.id,
        uid=peer.uid,
        nbytes=persist.layout.nbytes,
        acknowledged_unix=time.time(),
        data_id=(data.st_dev, data.st_ino),
        directory_id=(directory.st_dev, directory.st_ino),
        parent_id=parent_id,
        directory=dest.shown(None if os.path.isabs(dest.path) else located),
        data_file=dest.data_file,
        tree=persist.tree,
        metadata=persist.metadata,
    )


class Retention:
    """Retained layouts, the checkpoints slots hold, and leases on them."""

    def __init__(
        self,
        store: Store,
        policy: RetentionPolicy,
        telemetry: Telemetry,
        unlink: Callable[[list[str]], asyncio.Future[Any]],
        on_free: Callable[[StagedLayout, Slot], None],
    ) -> None:
        self.store = store
        self.policy = policy
        self.telemetry = telemetry
        self._unlink = unlink
        #: A lease ended on this slot: the daemon hands it to a waiting fill, or collects
        #: a released layout that only the lease kept.
        self._on_free = on_free
        self.leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._by_file: dict[FileId, _Entry] = {}
        #: Entries ``_by_file`` kept at its last pruning (see ``remember``).
        self._files_kept = 0
        self._by_uid: dict[int, list[_Entry]] = {}
        self._structures: dict[int, str] = {}

    # -- what slots hold ---------------------------------------------------------

    def remember(self, staged: StagedLayout, slot: Slot, held: Held) -> None:
        """A commit was acknowledged: the slot's bytes are that checkpoint now."""
        slot.held = held
        entry = (staged, slot, held)
        self._by_file[held.data_id] = entry
        mine = [e for e in self._by_uid.get(held.uid, []) if self._current(e)]
        self._by_uid[held.uid] = [*mine, entry]
        if len(self._by_file) > 2 * self._files_kept + 64:
            self._prune_files()

    def _prune_files(self) -> None:
        """Forget the files of checkpoints no slot holds any more (refilled, given back,
        released). Every commit adds one, with its tree and metadata: without this a
        daemon that runs for months grows by each save it ever acknowledged. Pruned
        when the index has doubled since last time, so each commit pays O(1) on average."""
        self._by_file = {key: e for key, e in self._by_file.items() if self._current(e)}
        self._files_kept = len(self._by_file)

    def job_ended(self, slot: Slot, result: job.JobResult) -> None:
        """The job writing the slot's checkpoint ended: durable, or no checkpoint at all."""
        held = slot.held
        if held is None or held.job != result.job:
            return
        if result.ok:
            held.durable_unix = time.time()
            held.digest = result.digest
            held.checksums = result.checksums
        else:
            slot.held = None
            self._by_file.pop(held.data_id, None)

    def _current(self, entry: _Entry) -> bool:
        staged, slot, held = entry
        return (
            slot.held is held
            and not staged.released
            and self.store.layouts.get(staged.id) is staged
            and slot in staged.slots
        )

    def structure(self, staged: StagedLayout) -> str:
        digest = self._structures.get(staged.id)
        if digest is None:
            digest = self._structures[staged.id] = staged.layout.digest()
        return digest

    def find(self, data_id: FileId, digest: str) -> _Entry | None:
        """The slot holding exactly this durable checkpoint, if one does."""
        entry = self._by_file.get(data_id)
        if entry is None or not self._current(entry):
            return None
        held = entry[2]
        return entry if held.durable and held.digest == digest else None

    def newest_of(
        self, uid: int, structure: str | None = None, parent_id: FileId | None = None
    ) -> _Entry | None:
        """A uid's newest acknowledged checkpoint in memory (durable or being written)."""
        mine = [e for e in self._by_uid.get(uid, []) if self._current(e)]
        self._by_uid[uid] = mine
        fits = [
            entry
            for entry in mine
            if (structure is None or self.structure(entry[0]) == structure)
            and (parent_id is None or entry[2].parent_id == parent_id)
        ]
        return max(fits, key=lambda entry: entry[2].job, default=None)

    # -- leases ------------------------------------------------------------------

    def may_read(self, peer: Peer, held: Held) -> bool:
        return peer.uid == held.uid or bool(peer.groups & self.policy.restore_groups)

    def grant(
        self, session: int, peer: Peer, entry: _Entry, seconds: float | None
    ) -> Lease:
        staged, slot, held = entry
        if not self.may_read(peer, held):
            self.telemetry.leased("refused")
            raise StoreError(
                ErrorCode.NOT_ALLOWED,
                f"the checkpoint in memory belongs to uid {held.uid}; uid {peer.uid} may "
                "restore it only from its files, or as a member of a group in shmstaged's "
                "[server] restore_groups",
            )
        mine = sum(1 for lease in self.leases.values() if lease.uid == peer.uid)
        if mine >= self.policy.max_leases:
            self.telemetry.leased("refused")
            raise StoreError(
                ErrorCode.LIMIT_EXCEEDED,
                f"uid {peer.uid} already holds {mine} leases (limit "
                f"{self.policy.max_leases}, [retention] max_leases); end one first",
            )
        others = [other for other in staged.slots if other is not slot]
        if peer.uid != held.uid and others and not slot.leased and all(
            other.leased for other in others
        ):
            self.telemetry.leased("refused")
            raise StoreError(
                ErrorCode.LIMIT_EXCEEDED,
                f"every other slot of this layout is leased: uid {peer.uid} may not lease "
                f"the last one of uid {held.uid}'s layout (its next save needs a slot); "
                "retry once a lease ended",
            )
        granted = self._seconds(seconds, "lease")
        now = time.monotonic()
        lease = Lease(
            next(self._lease_ids),
            session,
            peer.uid,
            staged,
            slot,
            now,
            now + granted,
            now + self.policy.max_lease_seconds,
        )
        self.leases[lease.id] = lease
        slot.leases.add(lease.id)
        self._schedule(lease)
        self.telemetry.leased("granted")
        return lease

    def _seconds(self, seconds: float | None, what: str) -> float:
        if seconds is None:
            return min(self.policy.lease_seconds, self.policy.max_lease_seconds)
        if not (math.isfinite(seconds) and seconds > 0):
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"{what}.seconds {seconds!r} must be a finite number of seconds > 0",
            )
        return min(seconds, self.policy.max_lease_seconds)

    def _schedule(self, lease: Lease) -> None:
        if lease.timer is not None:
            lease.timer.cancel()
        delay = max(lease.expires - time.monotonic(), 0.0)
        lease.timer = asyncio.get_running_loop().call_later(delay, self._expire, lease.id)

    def _expire(self, lease_id: int) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        log.warning(
            "lease %d of uid %d on a checkpoint of uid %d expired after %.1f s; its slot may "
            "be refilled",
            lease.id,
            lease.uid,
            lease.staged.uid,
            time.monotonic() - lease.granted,
        )
        self.telemetry.leased("expired")
        self._end(lease)

    def lease_of(self, session: int, lease_id: int) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None or lease.session != session:
            raise StoreError(
                ErrorCode.NOT_RETAINED,
                f"lease {lease_id} is not this client's (it expired, ended, or never was)",
            )
        return lease

    def renew(self, lease: Lease, seconds: float | None) -> float:
        """Extend a lease, never past ``max_lease_seconds`` from its grant; the seconds left."""
        now = time.monotonic()
        lease.expires = min(now + self._seconds(seconds, "renew"), lease.deadline)
        self._schedule(lease)
        return lease.expires - now

    def end(self, lease: Lease) -> None:
        self._end(lease)

    def end_session(self, session: int) -> None:
        for lease in [lease for lease in self.leases.values() if lease.session == session]:
            self._end(lease)

    def _end(self, lease: Lease) -> None:
        del self.leases[lease.id]
        if lease.timer is not None:
            lease.timer.cancel()
        lease.slot.leases.discard(lease.id)
        if not lease.slot.leased:
            self._on_free(lease.staged, lease.slot)

    # -- keeping and giving back -------------------------------------------------

    def keep(self, staged: StagedLayout) -> bool:
        """Whether a layout whose client went away (without releasing it) is retained."""
        if not self.policy.enabled or staged.newest() is None:
            return False
        self.store.retain(staged, time.monotonic())
        self.telemetry.retained()
        held = staged.newest().held  # type: ignore[union-attr]
        log.info(
            "retained layout %d of uid %d (%d bytes, %d slot(s)): job %d, %s, for %g s",
            staged.id,
            staged.uid,
            staged.bytes_reserved,
            len(staged.slots),
            held.job,  # type: ignore[union-attr]
            held.directory,  # type: ignore[union-attr]
            self.policy.ttl,
        )
        self.give_back(self.store.retained_bytes - self.policy.budget_bytes, "budget")
        return True

    def adoptable(self, uid: int, layout: Any, slots: int) -> StagedLayout | None:
        """A retained layout of this uid and structure for a new registration of ``slots``
        slots, trimmed to at most that many (keeping the newest checkpoint)."""
        mine = [s for s in self.store.retained.values() if s.uid == uid and s.layout == layout]
        if not mine:
            return None
        staged = max(mine, key=_age)
        while len(staged.slots) > slots:
            spare = self._spares(staged)
            if not spare:
                return None
            self._drop(staged, spare[0], "adoption")
        return staged

    def sweep(self) -> None:
        """Give back what outlived the TTL, exceeds the budget, or memory needs."""
        now = time.monotonic()
        for staged in list(self.store.retained.values()):
            expired = staged.retained is not None and now - staged.retained >= self.policy.ttl
            if expired and _evictable(staged):
                self._evict(staged, "ttl")
        self.give_back(self.store.retained_bytes - self.policy.budget_bytes, "budget")
        if self.store.retained:
            capacity = measure_shm()
            self.give_back(self.policy.min_free_bytes - capacity.usable, "pressure")

    async def make_room(self, nbytes: int) -> None:
        """Before a registration of ``nbytes``: give back retained memory it needs."""
        if not self.store.retained:
            return
        over_budget = self.store.reserved_bytes + nbytes - self.store.limits.shm_budget_bytes
        short = nbytes - measure_shm().usable
        unlinks = self.give_back(max(over_budget, short), "registration")
        if unlinks:
            await asyncio.gather(*unlinks, return_exceptions=True)

    def give_back(self, nbytes: int, reason: str) -> list[asyncio.Future[Any]]:
        """Free at least ``nbytes`` of retained memory where possible, spare slots first,
        oldest checkpoints first; returns the unlinks under way."""
        unlinks: list[asyncio.Future[Any]] = []
        if nbytes <= 0:
            return unlinks
        layouts = sorted(self.store.retained.values(), key=_age)
        steps: list[tuple[StagedLayout, Slot | None]] = [
            (staged, slot) for staged in layouts for slot in self._spares(staged)
        ]
        steps += [(staged, None) for staged in layouts if _evictable(staged)]
        freed = 0
        for staged, slot in steps:
            if freed >= nbytes:
                break
            if slot is None:
                freed += staged.bytes_reserved
                unlinks.append(self._evict(staged, reason))
            else:
                freed += staged.slot_bytes
                unlinks.append(self._drop(staged, slot, reason))
        return unlinks

    def _spares(self, staged: StagedLayout) -> list[Slot]:
        """Slots of a retained layout a restart can do without: free, unleased, not
        holding its newest checkpoint; oldest first."""
        newest = staged.newest()
        spare = [
            slot
            for slot in staged.slots
            if slot is not newest and slot.state is SlotState.FREE and not slot.leased
        ]
        return sorted(spare, key=lambda slot: slot.age)

    def _drop(self, staged: StagedLayout, slot: Slot, reason: str) -> asyncio.Future[Any]:
        log.info("retained layout %d: slot %d given back (%s)", staged.id, slot.index, reason)
        self.telemetry.evicted(reason, "slot")
        return self._unlink(self.store.drop_slot(staged, slot))

    def _evict(self, staged: StagedLayout, reason: str) -> asyncio.Future[Any]:
        newest = staged.newest()
        log.info(
            "retained layout %d of uid %d given back (%s): %d bytes%s",
            staged.id,
            staged.uid,
            reason,
            staged.bytes_reserved,
            f", job {newest.held.job}" if newest is not None and newest.held else "",
        )
        self.telemetry.evicted(reason, "layout")
        self._structures.pop(staged.id, None)
        return self._unlink(self.store.evict(staged))

    def forget(self, staged: StagedLayout) -> None:
        """A layout was collected (released and idle)."""
        self._structures.pop(staged.id, None)

    # -- reporting ---------------------------------------------------------------

    def status(self, layouts: Iterable[StagedLayout]) -> dict[str, Any]:
        """The checkpoints in memory (each layout's newest) and the policy, for status."""
        now_mono, now = time.monotonic(), time.time()
        checkpoints = []
        for staged in layouts:
            slot = staged.newest()
            if slot is None or slot.held is None or staged.released:
                continue
            held = slot.held
            expires = None
            if staged.retained is not None:
                expires = max(self.policy.ttl - (now_mono - staged.retained), 0.0)
            checkpoints.append(
                {
                    "uid": held.uid,
                    "layout": staged.id,
                    "job": held.job,
                    "directory": held.directory,
                    "data_file": held.data_file,
                    "bytes": held.nbytes,
                    "memory_bytes": staged.bytes_reserved,
                    "age_seconds": now - held.acknowledged_unix,
                    "durable": held.durable,
                    "retained": staged.retained is not None,
                    "expires_seconds": expires,
                    "leases": sum(len(s.leases) for s in staged.slots),
                }
            )
        return {
            **self.policy.to_wire(),
            "retained_bytes": self.store.retained_bytes,
            "retained_layouts": len(self.store.retained),
            "leases": len(self.leases),
            "checkpoints": checkpoints,
        }


def _age(staged: StagedLayout) -> int:
    newest = staged.newest()
    return newest.age if newest is not None else -1


def _evictable(staged: StagedLayout) -> bool:
    """No reader leases it and no job still writes from it."""
    return not staged.leased() and all(slot.state is SlotState.FREE for slot in staged.slots)
