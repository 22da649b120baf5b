"""Checkpoints kept in memory for a restart, and the leases of the readers restoring them.

A trainer that dies (an OOM, a NCCL abort, a preempted job step) leaves the node and this
daemon running, and the newest checkpoint it acknowledged is still in a slot's segments.
So when a client goes away without releasing its layout, the daemon keeps the layout —
*retained*, owned by nobody — instead of unlinking it, for ``ttl`` seconds and within a
byte ``budget``; a restarted trainer of the same uid then reads the checkpoint back at
memory speed (a *lease*), and registering the same structure again *adopts* the segments
(no segment is created for its first save).

Retained memory is its user's, and never in a live trainer's way. Giving memory back
takes, within one uid, the slots not holding a layout's newest checkpoint first (oldest
first), then whole layouts (oldest checkpoint first); across uids:

- *Charged to its user.* A uid's retained layouts count toward its ``[limits] max_bytes``
  together with its live ones, and may hold at most ``[retention] user_budget`` (its share
  of the budget). A retention or registration over either gives back that uid's own
  retained memory, never another uid's.
- *The node's budget.* While all retained memory exceeds ``[retention] budget``, or
  /dev/shm or the node's memory is short of ``min_free``, memory is given back from the
  uid retaining the most, then again from whichever uid retains the most: a uid never
  loses retained memory to another uid's retention while it retains less than that uid.
- *Live trainers first.* A registration (or the slots a layout adds, or those an adoption
  lacks) that needs room for the budget, /dev/shm or its own ``max_bytes`` takes it from
  retained memory: its own uid's first, then the others', the largest holder first.
- *Leases hold nothing that is due.* When the ``ttl``, the budget, memory pressure or a
  registration needs a leased layout, each lease on it ends ``revoke_grace`` seconds later
  at the latest (its reader's ``unlease`` answers ``held: false`` and it reads the files)
  and the layout goes then; a registration waits that long at most. And a uid's leases on
  one retained checkpoint hold it for ``max_lease_seconds`` in all, however they are
  chained (a lease on a live trainer's checkpoint, its owner's, lives at most that long).

A retained layout dies with its daemon: the next start reaps its segments like any
orphan's (unless the journal still owes the job writing it, which is finished first).

A leased slot is written by nobody:

- The daemon never fills it (it is unacquirable), never hands out writable descriptors to
  it (a registration never adopts a layout with a leased slot: it gets fresh segments),
  and never gives it back before its leases end or are revoked.
- Another uid (a member of a ``restore_groups`` group) leases a checkpoint only once its
  layout is retained (no session of its trainer is left) and the kernel counts no writer
  of any of the slot's segments: a read lease (``F_SETLEASE``) is refused while any
  process holds one open for writing, a writable mapping included, even one whose
  descriptor was closed or passed on. Segments are the daemon's own (0600): from then
  until the lease ends nobody can gain write access.
- The owner may lease its own checkpoints whenever it likes, its live trainer's too.

So ``verified`` (each tensor's CRC-32C, as the daemon computed it writing the files) means
the bytes were not torn or corrupted; it is no defence against a deliberate change by the
checkpoint's owner, who could write its memory before the lease (keeping the CRC: CRC is
affine) as it can rewrite its files. A reader of another user's checkpoint trusts that user.

Leases die with the reader's connection, are counted per uid, and a reader other than the
owner may never hold the last slot of a layout that has several: the owner's next save
always has another slot, or waits at most until a lease ends (and is told so).

Only the event loop calls into this module (``writers`` runs in an I/O thread); every
decision is O(the retained layouts or the caller's own checkpoints).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from shmstage import segment
from shmstage.protocol import ErrorCode
from shmstage.segment import SegmentRef
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
    #: Bytes one uid's retained layouts may hold (its share of the budget).
    user_budget_bytes: int = 1 << 62
    #: Retained memory is given back while less than this is free in /dev/shm (or
    #: available to the daemon's memory cgroup).
    min_free_bytes: int = 0
    #: A lease's time when the reader does not ask for one, and the most any lease lives.
    lease_seconds: float = 60.0
    max_lease_seconds: float = 600.0
    #: Leases one uid may hold at once.
    max_leases: int = 64
    #: Seconds a lease lives on once the memory it holds is due (ttl, budget, pressure, a
    #: registration): time for a reader mid-copy to finish.
    revoke_grace: float = 10.0
    #: Groups whose members may lease other users' checkpoints (the owner always may).
    restore_groups: frozenset[int] = frozenset()

    @property
    def enabled(self) -> bool:
        return self.ttl > 0 and self.budget_bytes > 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "ttl_seconds": self.ttl,
            "budget_bytes": self.budget_bytes,
            "user_budget_bytes": self.user_budget_bytes,
            "min_free_bytes": self.min_free_bytes,
            "lease_seconds": self.lease_seconds,
            "max_lease_seconds": self.max_lease_seconds,
            "max_leases": self.max_leases,
            "revoke_grace_seconds": self.revoke_grace,
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
    #: The checkpoint it reads (its leases' time is counted per uid and job).
    job: int = -1
    #: Why its memory is due (it ends within ``revoke_grace``), once it is.
    revoked: str | None = None


_Entry = tuple[StagedLayout, Slot, Held]
#: One step of giving memory back: a spare slot of a layout, or (None) the whole layout.
_Step = tuple[StagedLayout, Slot | None]


def writers(refs: Sequence[SegmentRef]) -> str | None:
    """The first segment some process holds open for writing, if any (an I/O thread).

    The kernel refuses a read lease (``F_SETLEASE``) on a file anyone has open for
    writing — a writable mapping keeps its file open, whatever became of the descriptor —
    so taking one and dropping it at once asks the kernel's count of writers. The daemon
    owns its segments, which a lease needs. When the kernel cannot answer (leases
    disabled), the segment counts as written: a reader is then sent to the files.
    """
    for ref in refs:
        fd = segment.open_fd(ref, writable=False)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EBUSY):
                log.warning("cannot ask the kernel who writes %s: %s", ref.name, exc)
            return ref.name
        finally:
            os.close(fd)
    return None


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
        #: Seconds each uid's ended leases held each checkpoint, by (uid, job).
        self._lease_time: dict[tuple[int, int], float] = {}
        #: Resolved when a lease ends: a registration waiting for revoked leases re-plans.
        self._lease_ended: asyncio.Future[None] | None = None

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
        if peer.uid != held.uid and staged.retained is None:
            self.telemetry.leased("refused")
            raise StoreError(
                ErrorCode.NOT_RETAINED,
                f"uid {held.uid}'s trainer still holds this checkpoint's memory and may "
                f"write it: uid {peer.uid} may lease it only once that trainer is gone; "
                "read it from its files",
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
        now = time.monotonic()
        left = self.policy.max_lease_seconds
        if staged.retained is not None:  # chained leases never keep it past that in all
            left -= self._leased_for(peer.uid, held.job, now)
        if left <= 0:
            self.telemetry.leased("refused")
            raise StoreError(
                ErrorCode.LIMIT_EXCEEDED,
                f"uid {peer.uid}'s leases have held job {held.job}'s memory for "
                f"{self.policy.max_lease_seconds:g} s, the most they may in all "
                "([retention] max_lease_seconds); read it from its files",
            )
        granted = min(self._seconds(seconds, "lease"), left)
        lease = Lease(
            next(self._lease_ids),
            session,
            peer.uid,
            staged,
            slot,
            now,
            now + granted,
            now + left,
            job=held.job,
        )
        self.leases[lease.id] = lease
        slot.leases.add(lease.id)
        self._schedule(lease)
        self.telemetry.leased("granted")
        return lease

    def _leased_for(self, uid: int, job_id: int, now: float) -> float:
        """Seconds ``uid``'s leases have held this checkpoint: ended ones and live ones."""
        held = self._lease_time.get((uid, job_id), 0.0)
        return held + sum(
            now - lease.granted
            for lease in self.leases.values()
            if lease.uid == uid and lease.job == job_id
        )

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
            "lease %d of uid %d on a checkpoint of uid %d %s after %.1f s; its slot may "
            "be refilled",
            lease.id,
            lease.uid,
            lease.staged.uid,
            "expired" if lease.revoked is None else f"revoked ({lease.revoked})",
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
        key = (lease.uid, lease.job)
        self._lease_time[key] = self._lease_time.get(key, 0.0) + time.monotonic() - lease.granted
        lease.slot.leases.discard(lease.id)
        if not lease.slot.leased:
            self._on_free(lease.staged, lease.slot)
        if self._lease_ended is not None and not self._lease_ended.done():
            self._lease_ended.set_result(None)
        self._lease_ended = None

    def _revoke(self, staged: StagedLayout, reason: str) -> None:
        """Its memory is due: every lease on the layout ends within ``revoke_grace``."""
        cutoff = time.monotonic() + self.policy.revoke_grace
        for slot in staged.slots:
            for lease_id in slot.leases:
                lease = self.leases[lease_id]
                if lease.revoked is None:
                    lease.revoked = reason
                    self.telemetry.leased("revoked")
                    log.warning(
                        "lease %d of uid %d on layout %d of uid %d revoked (%s): it ends "
                        "within %g s",
                        lease.id,
                        lease.uid,
                        staged.id,
                        staged.uid,
                        reason,
                        self.policy.revoke_grace,
                    )
                if lease.expires > cutoff:
                    lease.expires = lease.deadline = cutoff
                    self._schedule(lease)

    # -- keeping and giving back -------------------------------------------------

    def keep(self, staged: StagedLayout) -> bool:
        """Whether a layout whose client went away (without releasing it) is retained;
        then its uid's share and the node's budget are enforced (see the module's rules)."""
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
        share = self.store.retained_of(staged.uid) - self.policy.user_budget_bytes
        self.give_back(share, "share", first=staged.uid, others=False)
        return True

    def adoptable(self, uid: int, layout: Any, slots: int) -> StagedLayout | None:
        """A retained layout of this uid and structure for a new registration of ``slots``
        slots, trimmed to at most that many (keeping the newest checkpoint). One with a
        leased slot is never adopted: its new owner would get writable descriptors to
        what a reader is copying (the registration makes fresh segments instead)."""
        mine = [
            s
            for s in self.store.retained.values()
            if s.uid == uid and s.layout == layout and not s.leased()
        ]
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
        """Give back what outlived the TTL, exceeds the budget, or memory needs; forget
        the lease time of checkpoints no slot holds any more."""
        now = time.monotonic()
        for staged in list(self.store.retained.values()):
            expired = staged.retained is not None and now - staged.retained >= self.policy.ttl
            if expired and _evictable(staged):
                self._evict(staged, "ttl")
            elif expired and staged.leased():
                self._revoke(staged, "ttl")
        self.give_back(self.store.retained_bytes - self.policy.budget_bytes, "budget")
        for uid, usage in list(self.store.usage.items()):  # a reload may lower the share
            over = usage.retained_bytes - self.policy.user_budget_bytes
            self.give_back(over, "share", first=uid, others=False)
        if self.store.retained:
            capacity = measure_shm()
            self.give_back(self.policy.min_free_bytes - capacity.usable, "pressure")
        if self._lease_time:
            held = {entry[2].job for entry in self._by_file.values() if self._current(entry)}
            self._lease_time = {
                key: seconds for key, seconds in self._lease_time.items() if key[1] in held
            }

    async def make_room(
        self, nbytes: int, uid: int, adopting: StagedLayout | None = None
    ) -> None:
        """Before a registration of ``nbytes`` by ``uid``: give back the retained memory it
        needs — for ``uid``'s own ``max_bytes`` its own, for the budget and /dev/shm its own
        first, then the largest holders' — waiting at most ``revoke_grace`` for leases on
        it to end. ``adopting``: the layout being adopted, never given back for it."""
        deadline = time.monotonic() + self.policy.revoke_grace + SWEEP_INTERVAL_S
        while self.store.retained:
            usage = self.store.usage.get(uid)
            mine = 0 if usage is None else usage.bytes + usage.retained_bytes
            own = mine + nbytes - self.store.limits.max_user_bytes
            unlinks, pending = self._give_back(own, "registration", uid, False, adopting)
            over = self.store.reserved_bytes + nbytes - self.store.limits.shm_budget_bytes
            short = nbytes - measure_shm().usable - sum(n for _, n in unlinks)
            more, waiting = self._give_back(max(over, short), "registration", uid, True, adopting)
            unlinks += more
            if unlinks:
                await asyncio.gather(*(u for u, _ in unlinks), return_exceptions=True)
            if not (pending or waiting) or time.monotonic() >= deadline:
                return
            if self._lease_ended is None:
                self._lease_ended = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - time.monotonic()):
                    await asyncio.shield(self._lease_ended)

    def give_back(
        self, nbytes: int, reason: str, *, first: int | None = None, others: bool = True
    ) -> list[asyncio.Future[Any]]:
        """Free at least ``nbytes`` of retained memory where possible (see the module's
        rules: ``first``'s own first, then — with ``others`` — the largest holders');
        leased layouts it needs are revoked and go when their leases end. Returns the
        unlinks under way."""
        unlinks, _ = self._give_back(nbytes, reason, first, others)
        return [unlink for unlink, _ in unlinks]

    def _give_back(
        self,
        nbytes: int,
        reason: str,
        first: int | None,
        others: bool,
        adopting: StagedLayout | None = None,
    ) -> tuple[list[tuple[asyncio.Future[Any], int]], int]:
        """``give_back``'s work: the unlinks under way with their bytes, and the bytes that
        go once revoked leases end (or a job still writing from them finishes)."""
        unlinks: list[tuple[asyncio.Future[Any], int]] = []
        if nbytes <= 0 or not self.store.retained:
            return unlinks, 0
        steps = self._steps(first, others, adopting)
        freed = pending = 0
        while freed + pending < nbytes:
            step = next(steps, None)
            if step is None:
                break
            staged, slot = step
            if slot is not None:
                size = staged.slot_bytes
                freed += size
                unlinks.append((self._drop(staged, slot, reason), size))
            elif _evictable(staged):
                size = staged.bytes_reserved
                freed += size
                unlinks.append((self._evict(staged, reason), size))
            elif staged.leased():
                pending += staged.bytes_reserved
                self._revoke(staged, reason)
            # else a job still writes from it: the sweep gives it back once written
        return unlinks, pending

    def _steps(
        self, first: int | None, others: bool, adopting: StagedLayout | None
    ) -> Iterable[_Step]:
        """Retained memory in the order it is given back: ``first``'s own, then (with
        ``others``) always from the uid that still retains the most. Each step is taken
        before the next is chosen (spare slots are looked up again)."""
        layouts: dict[int, list[StagedLayout]] = {}
        for staged in sorted(self.store.retained.values(), key=_age):
            if staged is not adopting:
                layouts.setdefault(staged.uid, []).append(staged)
        left = {uid: sum(s.bytes_reserved for s in mine) for uid, mine in layouts.items()}

        def of(uid: int) -> Iterable[_Step]:
            mine = layouts.pop(uid, [])
            for staged in mine:
                for slot in self._spares(staged):
                    left[uid] -= staged.slot_bytes
                    yield staged, slot
            for staged in mine:
                left[uid] -= staged.bytes_reserved
                yield staged, None

        if first is not None:
            yield from of(first)
        if not others:
            return
        queues = {uid: iter(of(uid)) for uid in list(layouts)}
        while queues:
            uid = max(queues, key=lambda u: (left[u], -u))
            step = next(queues[uid], None)
            if step is None:
                del queues[uid]
                continue
            yield step

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
        self.forget(staged)
        return self._unlink(self.store.evict(staged))

    def forget(self, staged: StagedLayout) -> None:
        """A layout was collected (released and idle) or given back: nothing of it stays
        here, not even the index entries of the checkpoints its slots held, which keep its
        layout, trees and manifests alive (0.3 GiB for 100,000 tensors) until a later
        pruning that a daemon with no more saves never reaches."""
        self._structures.pop(staged.id, None)
        self._by_file = {key: e for key, e in self._by_file.items() if e[0] is not staged}
        self._files_kept = min(self._files_kept, len(self._by_file))
        for uid, entries in list(self._by_uid.items()):
            kept = [e for e in entries if e[0] is not staged]
            if kept:
                self._by_uid[uid] = kept
            else:
                del self._by_uid[uid]


def _age(staged: StagedLayout) -> int:
    newest = staged.newest()
    return newest.age if newest is not None else -1


def _evictable(staged: StagedLayout) -> bool:
    """No reader leases it and no job still writes from it."""
    return not staged.leased() and all(slot.state is SlotState.FREE for slot in staged.slots)
