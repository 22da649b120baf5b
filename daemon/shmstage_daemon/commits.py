"""Commits: a filled slot becomes a checkpoint (commit, ready, report).

A commit names the slot it filled and passes the descriptors of the files to write
(checked here, with the client's own rights: ``check_destination``). It is journaled
before it is acknowledged — a daemon killed after "committed" still owes it — and its job
starts on the writer pool. A commit sent while the client's copy still runs ("ready":
false) is *prepared*: journaled pending, the slot out of everyone's reach, until its
"ready" starts the job; without that (cancel, disconnect, ``PREPARED_TIMEOUT_S``) it is
dropped and the slot is the client's again. "report" adds what the save cost the trainer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shmstage import datafile, names
from shmstage.collection import collection_paused
from shmstage.manifest import MANIFEST_NAME
from shmstage.protocol import REPORT_PARTS, ErrorCode, Frame
from shmstage_daemon import __version__, credentials, job, requests, retention
from shmstage_daemon.admission import Peer, may_write_dir
from shmstage_daemon.jobs import Jobs
from shmstage_daemon.owed import Owed
from shmstage_daemon.requests import RequestError
from shmstage_daemon.session import Handler, Session
from shmstage_daemon.settings import Settings
from shmstage_daemon.slot import Slot
from shmstage_daemon.store import StagedLayout, Store, StoreError, Taken
from shmstage_daemon.telemetry import Telemetry

log = logging.getLogger("shmstaged.session")

#: Jobs whose trainer may still report what the save cost it (a client that never
#: reports, an older one, must not make this grow).
MAX_UNREPORTED_JOBS = 64
#: A commit sent ahead of its copy ("prepared") is dropped if its "ready" does not come
#: within this long: it holds a slot, a journal entry and the client's tree meanwhile.
PREPARED_TIMEOUT_S = 300.0


@dataclass
class Prepared:
    """A commit journaled pending while the client's copy still runs."""

    persist: job.PersistJob
    staged: StagedLayout
    slot: Slot
    #: One of the user's ``max_prepared``, given back when it starts or is dropped.
    taken: Taken
    expiry: asyncio.TimerHandle | None = None


class Commits:
    """The commit ops of one session, and the prepared commits it holds."""

    def __init__(
        self,
        session: Session,
        store: Store,
        retention: retention.Retention,
        telemetry: Telemetry,
        settings: Settings,
        owed: Owed,
        jobs: Jobs,
        *,
        run_io: Callable[..., Awaitable[Any]],
        track: Callable[[asyncio.Future[Any]], None],
    ) -> None:
        self._session = session
        self._store = store
        self._retention = retention
        self._telemetry = telemetry
        self._settings = settings
        #: The journal's side: a commit is journaled before it is acknowledged.
        self._owed = owed
        self._jobs = jobs
        #: Runs blocking work (destination checks, discarding files) in an I/O thread.
        self._run_io = run_io
        #: Background work the daemon's shutdown waits for.
        self._track = track
        #: Commits sent while the client's copy still ran ("ready": false), by job id,
        #: until its "ready" starts them (or a cancel or disconnect drops them).
        self._prepared: dict[int, Prepared] = {}
        #: Jobs started for this client whose "report" may still come, oldest first.
        self._unreported: collections.OrderedDict[int, job.PersistJob] = collections.OrderedDict()

    def ops(self) -> dict[str, Handler]:
        return {"commit": self.commit, "ready": self.ready, "report": self.report}

    async def commit(self, frame: Frame) -> None:
        # From here the Destination owns the descriptors; every path closes it exactly once.
        destination = requests.destination(frame)
        body = frame.body
        session, store = self._session, self._store
        try:
            staged = store.get(session.id, body["layout"])
            store.slot(staged, body["slot"])
            # In an I/O thread, with the user's own filesystem rights: the names live in a
            # directory that may be the user's alone, and on NFS or Lustre each stat is a
            # server round trip the event loop must not wait for.
            await self._run_io(check_destination_as, session.peer, destination)
            staged = store.get(session.id, body["layout"])  # still there after the wait
            slot = store.slot(staged, body["slot"])
            file_metadata, metadata = requests.commit_contents(body)
            with collection_paused():  # a new structure's tree and header: a burst
                packed_tree, tree = requests.commit_tree(body["tree"], staged.layout, staged.tree)
                staged.tree = (packed_tree, tree)
                header = staged.header(file_metadata)
            ready = body.get("ready", True)
            prepared = None
            if not ready:
                limit = store.limits.max_user_prepared
                prepared = store.take(session.id, "prepared", 1, limit, "max_prepared")
            try:
                job_id = store.begin_job(session.id, staged, slot)
            except BaseException:
                if prepared is not None:
                    prepared.release()
                raise
        except BaseException:
            destination.close()
            raise
        persist = job.PersistJob(
            id=job_id,
            layout=staged.layout,
            segments=slot.segments,
            header=header,
            destination=destination,
            tree=tree,
            packed_tree=packed_tree,
            metadata=metadata,
            save_info={
                "client": session.client_name,
                "pid": session.peer.pid,
                "uid": session.peer.uid,
                "daemon": f"shmstaged {__version__}",
                "layout": staged.id,
                "slot": slot.index,
            },
            fsync=self._settings.fsync,
            peer=session.peer,
            entries=staged.entries.get(destination.data_file),
        )
        with collection_paused():  # a slot's first journal record: a burst
            wire = staged.wire(slot)
        try:
            # The entry will hold about this frame and the slot's record: charged to the
            # user (max_journal_bytes) until the entry goes, so that nobody fills the
            # journal's filesystem (a container's 64 MiB /dev/shm) for everyone.
            self._owed.charge(
                job_id, session.id, frame.size + sum(len(part) for part in wire.packed.values())
            )
            # Durable before acknowledged: a daemon killed after "committed" still owes it.
            await self._owed.commit(persist, wire, session.peer, owed=ready)
        except (OSError, StoreError) as exc:
            if prepared is not None:
                prepared.release()
            self._abandon(job_id, persist, staged, slot)
            if isinstance(exc, StoreError):
                raise
            raise self._journal_failed(exc) from None
        reply = {"layout": staged.id, "slot": slot.index, "job": job_id}
        if prepared is None:
            self._start(persist, staged, slot, body)
            await session.send("committed", frame.id, reply)
            return
        # Prepared: the client is still copying. The slot stays out of everyone's reach
        # and the job waits for "ready"; without it (cancel, disconnect, the deadline) it
        # is dropped.
        self._prepared[job_id] = Prepared(persist, staged, slot, prepared)
        self._prepared[job_id].expiry = asyncio.get_running_loop().call_later(
            PREPARED_TIMEOUT_S, self._expire_prepared, job_id
        )
        if not session.open:  # the client left while the entry was being written
            self._drop_prepared(job_id)
            return
        await session.send("prepared", frame.id, reply)

    async def report(self, frame: Frame) -> None:
        """What a save cost the trainer, known only after its save() returned: for the
        metrics, and for the job's log line if it is still being written. Never answered;
        a report of a job this client did not commit (or reported already) is ignored."""
        body = frame.body
        persist = self._unreported.pop(body["job"], None)
        if persist is None:
            log.debug("%s reported unknown job %s; ignored", self._session.describe(), body["job"])
            return
        timings = {
            name: value
            for name in ("stall_seconds", *REPORT_PARTS)
            if (value := requests.finite(body.get(name))) is not None and value >= 0
        }
        persist.client_timings = timings
        self._telemetry.reported(timings)

    async def ready(self, frame: Frame) -> None:
        """The client's copy into a prepared commit's slot is complete: start the job."""
        body = frame.body
        job_id, layout_id, slot_index = body["job"], body["layout"], body["slot"]
        prepared = self._prepared.get(job_id)
        where = None if prepared is None else (prepared.staged.id, prepared.slot.index)
        if prepared is None or where != (layout_id, slot_index):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"no prepared commit {job_id} of slot {slot_index} of layout {layout_id}",
            )
        del self._prepared[job_id]
        persist, staged, slot = prepared.persist, prepared.staged, prepared.slot
        _unprepare(prepared)
        try:
            await self._owed.publish(job_id)
        except OSError as exc:
            self._abandon(job_id, persist, staged, slot)
            raise self._journal_failed(exc) from None
        self._start(persist, staged, slot, body)
        await self._session.send(
            "committed", frame.id, {"layout": staged.id, "slot": slot.index, "job": job_id}
        )

    def _start(
        self, persist: job.PersistJob, staged: StagedLayout, slot: Slot, timings: dict[str, Any]
    ) -> None:
        """Start the job; ``timings``: what a client older than the "report" op sent."""
        self._telemetry.staged(
            staged.layout.nbytes,
            requests.finite(timings.get("stage_seconds")),
            requests.finite(timings.get("slot_wait_seconds")),
        )
        self._unreported[persist.id] = persist
        while len(self._unreported) > MAX_UNREPORTED_JOBS:
            self._unreported.popitem(last=False)
        try:  # acknowledged: the slot's bytes are this checkpoint now, until refilled
            self._retention.remember(staged, slot, retention.held_of(persist, self._session.peer))
        except OSError as exc:
            log.debug("job %d: not restorable from memory: %s", persist.id, exc)
        self._jobs.start(self._session, staged, slot, persist)

    def drop_prepared(self, staged: StagedLayout, slot: Slot) -> None:
        """The slot is cancelled: its prepared commits go (it is FILLING again)."""
        for job_id, prepared in list(self._prepared.items()):
            if prepared.staged is staged and prepared.slot is slot:
                self._drop_prepared(job_id)

    def close(self) -> None:
        """The session ends: every prepared commit of it goes."""
        for job_id in list(self._prepared):
            self._drop_prepared(job_id)

    def _drop_prepared(self, job_id: int) -> None:
        """A prepared commit that will not happen (cancel, disconnect, deadline)."""
        prepared = self._prepared.pop(job_id)
        _unprepare(prepared)
        self._abandon(job_id, prepared.persist, prepared.staged, prepared.slot)

    def _expire_prepared(self, job_id: int) -> None:
        if job_id not in self._prepared:
            return
        log.warning(
            "%s: commit %d waited %g s for its ready; dropped (the slot is the client's again)",
            self._session.describe(),
            job_id,
            PREPARED_TIMEOUT_S,
        )
        self._drop_prepared(job_id)

    def _abandon(
        self, job_id: int, persist: job.PersistJob, staged: StagedLayout, slot: Slot
    ) -> None:
        """A commit never acknowledged: a pending journal entry goes, the slot is the
        client's again (FILLING). Nothing was written; the temporary files (and pending
        directory) the client made for it are removed — a trainer killed during its copy
        cannot — only while they are still the very ones (same inode), in an I/O thread."""
        self._owed.discard(job_id)
        self._jobs.abandon(self._session.id, staged, slot, job_id)
        discarding = self._run_io(job.discard, persist.destination, self._session.peer)
        self._track(asyncio.ensure_future(discarding))

    def _journal_failed(self, exc: OSError) -> RequestError:
        return RequestError(
            ErrorCode.STORAGE,
            f"cannot journal the checkpoint ({exc.strerror or exc}) in "
            f"{self._owed.journal.directory}; nothing was written — check that filesystem",
        )


def _unprepare(prepared: Prepared) -> None:
    """A prepared commit leaves the table: its deadline and its count go."""
    if prepared.expiry is not None:
        prepared.expiry.cancel()
    prepared.taken.release()


def check_destination_as(peer: Peer, destination: job.Destination) -> None:
    """``check_destination`` with ``peer``'s filesystem rights (in an I/O thread)."""
    with credentials.acting_as(peer):
        check_destination(destination, peer)


def check_destination(destination: job.Destination, peer: Peer) -> None:
    """Check the client's descriptors really are what the names say, and writable by it."""
    try:
        data_file = names.check_plain_name(destination.data_file, what="data file")
        if not data_file.endswith(datafile.SUFFIX):
            raise names.NameError_(f"data file {data_file!r} must end in {datafile.SUFFIX}")
        names.check_temp_name(destination.data_tmp, data_file)
        names.check_temp_name(destination.manifest_tmp, MANIFEST_NAME)
        if destination.pending:
            _check_pending(destination, peer)
        dir_fd = destination.dir_fd
        _check_writable_dir(
            os.fstat(dir_fd),
            peer,
            "the checkpoint directory itself, so shmstaged will not write there",
        )
        data = requests.check_file_fd(destination.data_tmp, destination.data_fd, dir_fd)
        manifest = requests.check_file_fd(destination.manifest_tmp, destination.manifest_fd, dir_fd)
        if (data.st_dev, data.st_ino) == (manifest.st_dev, manifest.st_ino):
            raise RequestError(
                ErrorCode.BAD_REQUEST, "the data and manifest descriptors are the same file"
            )
    except names.NameError_ as exc:
        raise RequestError(ErrorCode.BAD_REQUEST, str(exc)) from None
    except OSError as exc:
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"bad destination descriptor: {exc}"
        ) from None


def _check_writable_dir(st: os.stat_result, peer: Peer, refused: str) -> None:
    """The first descriptor is a directory ``peer`` may write (``refused``: what it may
    not write, and what shmstaged then will not do on its behalf)."""
    if not stat.S_ISDIR(st.st_mode):
        raise RequestError(ErrorCode.BAD_REQUEST, "first descriptor is not a directory")
    if not may_write_dir(st, peer):
        raise RequestError(
            ErrorCode.NOT_ALLOWED, f"uid {peer.uid} cannot write {refused} on its behalf"
        )


def _check_pending(destination: job.Destination, peer: Peer) -> None:
    """A new directory: the parent is one the client may write, the pending directory is
    the very one named there, and the final name is free.

    In a sticky parent (/tmp) a user may rename only what it owns, and so may the
    daemon on its behalf: a pending directory of someone else's is refused there.
    """
    names.check_pending_dir_name(destination.pending_dir)
    names.check_final_dir_name(destination.final_dir)
    parent = os.fstat(destination.parent_fd)
    _check_writable_dir(
        parent,
        peer,
        f"the directory that would hold {destination.final_dir}, so shmstaged will not "
        "create it there",
    )
    pending = os.fstat(destination.dir_fd)
    try:
        named = os.stat(
            destination.pending_dir, dir_fd=destination.parent_fd, follow_symlinks=False
        )
    except FileNotFoundError:
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"{destination.pending_dir} does not exist in the parent"
        ) from None
    if (named.st_dev, named.st_ino) != (pending.st_dev, pending.st_ino):
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"{destination.pending_dir} is not the directory whose descriptor came",
        )
    if parent.st_mode & stat.S_ISVTX and peer.uid not in (0, pending.st_uid):
        raise RequestError(
            ErrorCode.NOT_ALLOWED,
            f"{destination.pending_dir} belongs to uid {pending.st_uid}, not {peer.uid}",
        )
    try:
        os.stat(destination.final_dir, dir_fd=destination.parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    raise RequestError(
        ErrorCode.EXISTS,
        f"{destination.final_dir} already exists; shmstage never overwrites a checkpoint — "
        "save to a new directory",
    )
