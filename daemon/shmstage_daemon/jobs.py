"""Persist jobs on the writer pool: start one, apply its end, or abandon one never started.

A job is started once its commit is journaled and acknowledged (``start``); it runs in a
writer thread (``job.run``), queued in turns between users, and its end comes back here on
the event loop (``_done``): the journal owes it no more, the slot is free to refill, its
client hears how it went. A job stopped with the daemon leaves everything for the next
start, which the journal names (``owed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shmstage_daemon import job
from shmstage_daemon.fairness import FairExecutor
from shmstage_daemon.owed import Owed, never_started
from shmstage_daemon.retention import Retention
from shmstage_daemon.session import Session
from shmstage_daemon.slot import Slot
from shmstage_daemon.store import StagedLayout, Store
from shmstage_daemon.telemetry import FinishedJob, Telemetry, describe_stall

log = logging.getLogger("shmstaged")


@dataclass
class JobRecord:
    persist: job.PersistJob
    session: Session
    staged: StagedLayout
    slot: Slot
    started: float
    future: asyncio.Future[job.JobResult]
    directory: str = "?"


class Jobs:
    """The jobs this instance is writing, by job id."""

    def __init__(
        self,
        store: Store,
        retention: Retention,
        owed: Owed,
        telemetry: Telemetry,
        writers: FairExecutor,
        stop: threading.Event,
        collect: Callable[[StagedLayout], None],
        stats: dict[str, int],
    ) -> None:
        self._store = store
        self._retention = retention
        self._owed = owed
        self._telemetry = telemetry
        self._writers = writers
        self._stop = stop
        self._collect = collect
        self._stats = stats
        self.records: dict[int, JobRecord] = {}

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[JobRecord]:
        return iter(list(self.records.values()))

    def start(
        self, session: Session, staged: StagedLayout, slot: Slot, persist: job.PersistJob
    ) -> None:
        loop = asyncio.get_running_loop()
        directory = "?"
        with contextlib.suppress(OSError):  # for status displays only; never used to write
            located = os.readlink(f"/proc/self/fd/{persist.destination.dir_fd}")
            directory = persist.destination.shown(located)
        persist.stop = self._stop
        owner = persist.peer.uid if persist.peer is not None else session.peer.uid
        future = asyncio.wrap_future(self._writers.submit_for(owner, job.run, persist), loop=loop)
        record = JobRecord(persist, session, staged, slot, time.perf_counter(), future, directory)
        self.records[persist.id] = record
        future.add_done_callback(lambda f: self._done(record, f))

    def abandon(self, session_id: int, staged: StagedLayout, slot: Slot, job_id: int) -> None:
        """Undo ``begin_job`` for a commit that could not be journaled (never acknowledged)."""
        self._store.abort_job(session_id, staged, slot, job_id)
        self._collect(staged)

    def _done(self, record: JobRecord, future: asyncio.Future[job.JobResult]) -> None:
        self.records.pop(record.persist.id, None)
        if future.cancelled():
            record.persist.destination.close()
            result = never_started(record.persist.id)
        else:
            result = future.result()
        if result.interrupted:
            # Stopped with the daemon: the journal entry, the files and the segments stay
            # for the next start. The slot stays PERSISTING, so its layout is never
            # collected (and its segments never unlinked) by this process.
            self._owed.keep(record.persist)
            if self._owed.journaled(record.persist.id):
                log.warning("job %d: %s", result.job, result.message)
            else:
                log.error(
                    "job %d: shmstaged stopped before it was written, and it could not be "
                    "journaled (directory not reachable by path): this checkpoint is lost",
                    result.job,
                )
            return
        self._owed.done(record.persist.id)  # ran to an end: nothing is owed any more
        self._retention.job_ended(record.slot, result)  # before the slot can be refilled
        self._store.end_job(record.session.id, record.staged, record.slot, record.persist.id)
        if result.ok:
            record.staged.keep_entries(result.entries)
            self._stats["saves"] += 1
            self._stats["bytes"] += result.bytes
            log.info(
                "job %d: %s written, %d bytes in %.3f s%s%s",
                result.job,
                record.persist.destination.data_file,
                result.bytes,
                result.seconds,
                f" ({result.phases.describe()})" if result.phases is not None else "",
                describe_stall(record.persist.client_timings),
            )
        else:
            self._stats["failed"] += 1
            log.error("job %d failed: %s", result.job, result.message)
        self._telemetry.job_finished(
            FinishedJob(
                result.job,
                record.session.describe(),
                time.time(),
                result.ok,
                result.bytes,
                result.seconds,
                record.directory,
                record.session.peer.uid,
            ),
            result.code,
            result.message,
        )
        self._collect(record.staged)
        session = record.session
        if session.open:  # spawned: a client gone meanwhile ends it quietly
            body = {"job": record.persist.id, "ok": result.ok, "result": result.to_wire()}
            session.spawn(session.send("job_done", 0, body))
