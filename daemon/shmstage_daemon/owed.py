"""The event loop's side of the journal: what this daemon owes, and what a dead one did.

A commit is journaled before it is acknowledged (``commit``), so a daemon killed after
"committed" still owes the checkpoint; a prepared commit's entry is written pending and
made owed by its "ready" (``publish``) or dropped (``discard``); a job that ran to an end
owes nothing any more (``done``). Each entry is charged to its user (``max_journal_bytes``)
while it exists. At start the journals of dead predecessors on the same socket are read
(``adopt_predecessors``) and their jobs finished on the writer pool (``finish``).

The journal's files are written in one thread of their own, in order; only the loop
touches the tables here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from shmstage import instance
from shmstage.protocol import ErrorCode
from shmstage_daemon import credentials, job, journal
from shmstage_daemon.admission import Peer
from shmstage_daemon.fairness import FairExecutor
from shmstage_daemon.segments import unlink_all
from shmstage_daemon.store import SlotWire, Store, Taken

log = logging.getLogger("shmstaged")


class Owed:
    """This instance's journal and the entries of dead instances it took over."""

    def __init__(
        self,
        store: Store,
        journal_root: Path,
        fsync: Callable[[], bool],
        track: Callable[[asyncio.Future[Any]], None],
        run_io: Callable[..., Awaitable[Any]],
        stats: dict[str, int],
    ) -> None:
        self._store = store
        self._fsync = fsync
        self._track = track
        self._run_io = run_io
        self._stats = stats
        self.instance = ""
        #: This instance's journal (its directory is named after the instance: see claim).
        self.journal = journal.Journal(journal_root / "shmstage.unstarted.journal")
        # One thread: journal writes stay in order and never queue behind segment creation.
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shmstage-journal")
        #: Journal directories of this socket's dead predecessors, by path.
        self._adopted: dict[str, journal.Journal] = {}
        #: job id -> journal entry name, for jobs acknowledged by this instance.
        self._journaled: dict[int, str] = {}
        #: job id -> what its journal entry is charged to its user (max_journal_bytes).
        self._charges: dict[int, Taken] = {}
        #: job id -> journal entry name, for commits journaled pending (see commit).
        self._pending_entries: dict[int, str] = {}
        #: Journal entries of dead instances' jobs not finished yet, by entry name.
        self.entries: dict[str, journal.Entry] = {}
        #: ...and the journal each of them lives in.
        self._entry_journal: dict[str, journal.Journal] = {}
        #: journal entry name -> the writer's future, while an owed job is being finished.
        self.recovering: dict[str, asyncio.Future[job.JobResult]] = {}
        #: Segments of jobs this instance stopped (or never started) before they were
        #: durable: the journal still owes them, so they outlive this process.
        self.at_exit: set[str] = set()

    def claim(self, root: Path, instance_name: str) -> None:
        """Use the journal directory named after this instance."""
        self.instance = instance_name
        self.journal = journal.Journal(Path(instance.journal_dir(str(root), instance_name)))

    def shutdown(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)

    # -- this instance's jobs ------------------------------------------------------------

    def charge(self, job_id: int, session_id: int, nbytes: int) -> None:
        """Charge a job's journal entry to its user before it is written; refuses over
        ``max_journal_bytes``. Released with the entry (``release``)."""
        limit = self._store.limits.max_user_journal_bytes
        taken = self._store.take(session_id, "journal_bytes", nbytes, limit, "max_journal_bytes")
        self._charges[job_id] = taken

    def release(self, job_id: int) -> None:
        taken = self._charges.pop(job_id, None)
        if taken is not None:
            taken.release()

    async def commit(
        self, persist: job.PersistJob, wire: SlotWire, peer: Peer, *, owed: bool = True
    ) -> None:
        """Journal a job before it is acknowledged; raises OSError if the journal fails.

        ``owed=False`` writes the entry pending (a commit sent while the client's copy
        still runs): ``publish`` makes it owed, ``discard`` drops it.
        """
        loop = asyncio.get_running_loop()
        directory = await loop.run_in_executor(
            self._io, self._write, persist, wire, peer, self._fsync(), owed
        )
        if directory is None:
            self.release(persist.id)
            log.warning(
                "job %d: shmstaged cannot reach the checkpoint directory by path (another "
                "mount namespace?), so it is not journaled: a daemon restart before it is "
                "durable would lose it",
                persist.id,
            )
            return
        persist.destination.path = directory
        name = f"{self.instance}.{persist.id}{instance.JOURNAL_SUFFIX}"
        (self._journaled if owed else self._pending_entries)[persist.id] = name

    async def publish(self, job_id: int) -> None:
        """Make a pending entry owed (a no-op for a job that could not be journaled)."""
        name = self._pending_entries.pop(job_id, None)
        if name is None:
            return
        await asyncio.get_running_loop().run_in_executor(
            self._io, functools.partial(self.journal.publish, name, fsync=self._fsync())
        )
        self._journaled[job_id] = name

    def discard(self, job_id: int) -> None:
        """Drop a pending entry whose commit will not happen."""
        self.release(job_id)
        name = self._pending_entries.pop(job_id, None)
        if name is not None:
            loop = asyncio.get_running_loop()
            self._track(loop.run_in_executor(self._io, self.journal.discard, name))

    def _write(
        self, persist: job.PersistJob, wire: SlotWire, peer: Peer, fsync: bool, owed: bool
    ) -> str | None:
        """Runs in the journal thread: locate the directory (walking the path with the
        user's filesystem rights: it may be reachable by that user alone), then write the
        entry (with the daemon's own, in its journal)."""
        dir_fd = persist.destination.dir_fd
        with credentials.acting_as(peer):
            directory = journal.locate(dir_fd)
        if directory is None:
            return None
        st = os.fstat(dir_fd)
        entry = journal.entry_for(
            persist, wire, self.instance, peer, directory, (st.st_dev, st.st_ino)
        )
        prepacked = dict(wire.packed)
        if persist.packed_tree is not None:  # 0.45 MiB to pack again at 10,000 tensors
            prepacked["tree"] = persist.packed_tree
        if owed:
            self.journal.record(entry, fsync=fsync, prepacked=prepacked)
        else:
            self.journal.write_pending(entry, fsync=fsync, prepacked=prepacked)
        return directory

    def journaled(self, job_id: int) -> bool:
        return job_id in self._journaled

    def done(self, job_id: int) -> None:
        """The job ran to an end: its entry goes, and its charge with it."""
        self.release(job_id)
        name = self._journaled.pop(job_id, None)
        if name is not None:
            loop = asyncio.get_running_loop()
            self._track(
                loop.run_in_executor(
                    self._io, functools.partial(self.journal.remove, name, fsync=self._fsync())
                )
            )

    def keep(self, persist: job.PersistJob) -> None:
        """A job that will not finish in this process: its segments outlive it."""
        self.at_exit.update(ref.name for ref in persist.segments)

    def jobs(self) -> list[str]:
        """The entries still owed: this instance's unfinished jobs and its predecessors'."""
        return list(self._journaled.values()) + list(self.entries)

    # -- what dead predecessors owe --------------------------------------------------------

    def adopt_predecessors(self, socket: Path) -> list[journal.Entry]:
        """Load what dead daemons on this socket still owe, from their own journals.

        Found through their lock files (which only this uid can have written), plus the
        directory next to the socket where daemons before 0.2 kept it. A journal that
        cannot be read is logged and left alone: its lock keeps its segments.
        """
        directories = [Path(d) for _, d in instance.predecessors(str(socket), os.geteuid())]
        legacy = journal.legacy_journal_dir(socket)
        if legacy.is_dir() and not legacy.is_symlink():
            directories.append(legacy)
        owed = []
        for directory in directories:
            adopted = journal.Journal(directory)
            try:
                adopted.check()
                entries = adopted.load()
            except FileNotFoundError:
                continue
            except (OSError, journal.JournalError) as exc:
                log.error("cannot read the journal %s of a previous instance: %s", directory, exc)
                continue
            self._adopted[str(directory)] = adopted
            for entry in entries:
                self._entry_journal[entry.name] = adopted
            owed += entries
        self.entries = {entry.name: entry for entry in owed}
        return owed

    def own_journals(self) -> set[str]:
        return {str(self.journal.directory), *self._adopted}

    async def finish(
        self, entry: journal.Entry, writers: FairExecutor, stop: threading.Event
    ) -> None:
        """Finish one job a previous instance acknowledged, then free what it held.

        An instance that is still alive (a stopping daemon whose writer outlived its loop)
        is finishing the job itself: wait for it to exit rather than write alongside it.
        """
        while entry.instance in instance.live_instances():
            await asyncio.sleep(1.0)
        loop = asyncio.get_running_loop()
        future = asyncio.wrap_future(writers.submit(journal.recover, entry, stop), loop=loop)
        self.recovering[entry.name] = future
        try:
            result = await future
        except asyncio.CancelledError:  # never started: the daemon is stopping
            result = never_started(entry.job)
        finally:
            self.recovering.pop(entry.name, None)
        if result.interrupted:
            log.warning("%s: stopped with the daemon; owed to the next start", entry.describe())
            return
        if result.ok:
            self._stats["saves"] += 1
            self._stats["bytes"] += result.bytes
            log.warning("finished %s after a restart: %d bytes", entry.describe(), result.bytes)
        else:
            self._stats["failed"] += 1
            log.error("could not finish %s: %s", entry.describe(), result.message)
        await self._run_io(unlink_all, [name for name, _ in entry.segments])
        source = self._entry_journal.pop(entry.name)
        await asyncio.get_running_loop().run_in_executor(
            self._io, functools.partial(source.remove, entry.name, fsync=self._fsync())
        )
        del self.entries[entry.name]
        if source not in self._entry_journal.values() and source.remove_if_empty():
            log.info("previous journal %s is finished and removed", source.directory)
        # Whatever else the predecessor left (its lock file) goes now, except the segments
        # of jobs still owed.
        keep = {name for owed in self.entries.values() for name, _ in owed.segments}
        reap = functools.partial(instance.reap_dead, keep=keep, own_journals=self.own_journals())
        self._track(asyncio.ensure_future(self._run_io(reap)))


def never_started(job_id: int) -> job.JobResult:
    """A job the stopping daemon cancelled in the writers' queue: owed, like an interrupted one."""
    return job.JobResult(
        job_id,
        False,
        code=str(ErrorCode.SHUTTING_DOWN),
        message="shmstaged stopped before the checkpoint was written; the next start writes it",
        interrupted=True,
    )
