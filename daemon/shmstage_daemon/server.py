"""The daemon: the composition root — builds the services, runs them, stops them in order.

The event loop owns all state. Blocking work — creating and unlinking segments, streaming a
slot to disk — runs in thread pools and comes back as a result the loop applies.

Where things are: the listening socket and who is admitted (``listener``); one connection
(``session``) and the handlers of its ops (``registration``, ``commits``, ``restores``,
``status``), each built here for its session with the services it uses; jobs on the writer
pool (``jobs``); the journal's side and what dead predecessors owe (``owed``); segments
made, given back and kept at their size (``segments``); what status and metrics show
(``status``). What stays here: start (claim an instance, adopt a predecessor's journal,
reap), a layout's release, a reload, and an orderly shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

from shmstage import descriptors, instance, segment
from shmstage.protocol import ErrorCode
from shmstage_daemon import __version__, faults, inflight, journal, retention, scheduler
from shmstage_daemon.admission import Peer
from shmstage_daemon.channels import Channels, Dropped
from shmstage_daemon.commits import Commits
from shmstage_daemon.fairness import FairExecutor
from shmstage_daemon.jobs import Jobs
from shmstage_daemon.listener import Listener, StartupError
from shmstage_daemon.owed import Owed
from shmstage_daemon.publishing import MAX_PIN_HOLD_S, Publishing
from shmstage_daemon.registration import Registration
from shmstage_daemon.restores import Restores
from shmstage_daemon.segments import Segments, check_capacity
from shmstage_daemon.session import Session
from shmstage_daemon.settings import Settings
from shmstage_daemon.slot import Slot
from shmstage_daemon.status import Asking, Status
from shmstage_daemon.store import StagedLayout, Store
from shmstage_daemon.telemetry import Telemetry
from shmstage_daemon.transport import Transport
from shmstage_daemon.versionsums import VersionSums

__all__ = ["Daemon", "Settings", "StartupError"]

log = logging.getLogger("shmstaged")
T = TypeVar("T")

#: After ``shutdown_timeout``, how long writers get to notice the stop request. A writer
#: stops at its next chunk (tens of milliseconds) or after an fsync in progress; one stuck
#: in the kernel for longer is left behind (the process exits without it, see ``main``).
STOP_GRACE_S = 15.0


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings.limits)
        self.sessions: dict[int, Session] = {}
        self.stopping = False
        self.started = time.time()
        self.stats = {"saves": 0, "failed": 0, "bytes": 0}
        self.telemetry = Telemetry()
        #: Segment descriptors sent and not read yet, per user, and the closed sessions'
        #: sockets that still hold some (``inflight``).
        self.inflight = inflight.InFlight()
        self.segments = Segments(
            self.store,
            lambda: self.instance,
            lambda: self.stopping,
            self.track,
            lambda: self.settings.size_check_interval,
        )
        self.retention = retention.Retention(
            self.store,
            settings.retention,
            self.telemetry,
            self.segments.unlink_later,
            self._lease_ended,
        )
        self.channels = Channels(
            self.store,
            lambda: self.retention.policy,
            lambda: self.settings.publish_gids,
            self._lease_ended,
            on_dropped=_log_dropped,
        )
        self.versionsums = VersionSums(self.channels)
        self.listener = Listener(settings, self._open_session, self.track)
        self._session_ids = itertools.count(1)
        self._lock: instance.InstanceLock | None = None
        # A job holds its thread from its first chunk to its last fsync; queued jobs start
        # in turns between users. Their data goes through one fair pool of I/O threads,
        # which every job in this process uses (also those finished after a restart).
        self._writers = FairExecutor(settings.writer_threads, "shmstage-writer")
        self._disk = scheduler.WriteScheduler(
            io_threads=settings.io_threads,
            chunk_bytes=settings.write_chunk,
            memory_bytes=settings.write_buffers,
            direct=settings.direct_io,
        )
        scheduler.install(self._disk)
        self._io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="shmstage-io")
        self._stop = asyncio.Event()
        self._pending_unlinks: set[asyncio.Future[Any]] = set()
        #: The journal's side: this instance's entries and its dead predecessors'.
        self.owed = Owed(
            self.store,
            settings.journal_root,
            lambda: self.settings.fsync,
            self.track,
            self.run_io,
            self.stats,
        )
        self.journal_kind = "?"
        #: Set when the stop can wait no longer: every job stops at its next write, leaving
        #: its files, segments and journal entry for the next start.
        self._stop_writers = threading.Event()
        self.jobs = Jobs(
            self.store,
            self.retention,
            self.owed,
            self.telemetry,
            self._writers,
            self._stop_writers,
            self._collect,
            self.stats,
        )
        self.status = Status(
            settings,
            self.store,
            self.retention,
            self.telemetry,
            self.sessions,
            self.jobs,
            self.stats,
            self._identity,
            self.started,
            self.channels,
        )
        #: Writers still running when the daemon had to go (storage hung): ``main`` exits
        #: without joining them.
        self.abandoned_writers = False

    @property
    def instance(self) -> str:
        return self.owed.instance

    @property
    def journal(self) -> journal.Journal:
        return self.owed.journal

    # -- lifecycle ---------------------------------------------------------------

    def start(self, listener: socket.socket | None = None) -> None:
        """Claim an instance, reap dead instances' segments, bind the socket.

        ``listener``: a socket systemd passed (socket activation); served as it is, and
        left in place at exit because systemd keeps listening on it across restarts.

        Jobs a killed predecessor on the same socket acknowledged but did not finish are
        loaded from the journal before reaping, so their segments survive the reap; they
        are finished as soon as the loop runs (:meth:`serve`).
        """
        try:
            armed = faults.load()
        except faults.FaultSpecError as exc:
            raise StartupError(str(exc)) from None
        if armed:
            log.warning("TEST-ONLY fault hooks armed (%s): %s", faults.ENV, ", ".join(armed))
        _raise_fd_limit()
        if listener is not None:
            self.settings.socket_path = Path(listener.getsockname())
        root = self.settings.journal_root
        try:
            self.journal_kind = journal.check_memory_backed(
                root, allow_disk=self.settings.allow_disk_journal
            )
        except (OSError, journal.JournalError) as exc:
            raise StartupError(f"cannot keep the journal in {root}: {exc}") from None
        self._lock = instance.InstanceLock.claim(
            journal_root=str(root), socket=str(self.settings.socket_path)
        )
        self.owed.claim(root, self._lock.instance)
        try:
            self._take_over(listener)
        except BaseException:
            self._give_back_instance()
            raise
        log.info(
            "shmstaged %s listening on %s%s (instance %s, journal %s on %s, admitting %s)",
            __version__,
            self.settings.socket_path,
            " (socket activation)" if self.listener.activated else "",
            self.instance,
            self.journal.directory,
            self.journal_kind,
            self.settings.allowlist.describe(),
        )
        faults.pause("started")

    def _take_over(self, listener: socket.socket | None) -> None:
        """Bind (or take) the socket, then adopt what dead predecessors on it still owe and
        reap the rest of dead instances' segments."""
        self.listener.listen(listener)
        # Only now, serving this socket alone, may we take over its predecessors' journals.
        try:
            self.journal.prepare()
        except (OSError, journal.JournalError) as exc:
            raise StartupError(f"cannot use the journal {self.journal.directory}: {exc}") from None
        owed = self.owed.adopt_predecessors(self.settings.socket_path)
        keep = {name for entry in owed for name, _ in entry.segments}
        reaped = instance.reap_dead(keep=keep, own_journals=self.owed.own_journals())
        if reaped:
            log.info("reaped %d segment(s) left by dead shmstaged instances", reaped)
        if owed:
            log.warning(
                "%d checkpoint(s) acknowledged by a previous instance are not durable yet; "
                "finishing them now",
                len(owed),
            )

    def _give_back_instance(self) -> None:
        """Start-up failed after the instance was claimed (the socket taken by another
        daemon, say): leave nothing of it in /dev/shm, the lock file included, unless its
        journal already holds what it adopted from a predecessor — then the lock stays
        and names that journal, as at a stop that leaves jobs owed."""
        self.listener.close()
        if self._lock is None:
            return
        if self.journal.remove_if_empty() or not self.journal.directory.exists():
            self._lock.release()
            self._lock = None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.listener.sock is not None
        for entry in list(self.owed.entries.values()):
            self.track(loop.create_task(self.owed.finish(entry, self._writers, self._stop_writers)))
        accept = loop.create_task(self.listener.accept_loop())
        sweep = loop.create_task(self._sweep_retained())
        sizes = loop.create_task(self.segments.keep_sizes())
        await self._stop.wait()
        accept.cancel()
        sweep.cancel()
        sizes.cancel()
        await self._shutdown()

    async def _sweep_retained(self) -> None:
        """Retained layouts past their TTL, over the budget or under memory pressure go."""
        while True:
            await asyncio.sleep(retention.SWEEP_INTERVAL_S)
            try:
                self.retention.sweep()
            except Exception:  # a bug here must not end the sweeping (nor the daemon)
                log.exception("sweeping retained layouts failed")

    def request_stop(self) -> None:
        if not self._stop.is_set():
            log.info("stopping: no new connections; finishing in-flight checkpoints")
        self.stopping = True
        self._stop.set()

    async def _shutdown(self) -> None:
        """Stop serving, let checkpoints being written finish, and leave nothing behind —
        except what the journal still vouches for.

        Past ``shutdown_timeout`` the writers are asked to stop (``job.JobInterrupted``):
        each leaves its temporary files, and the daemon leaves the staged segments, the
        journal entry and its lock file (which names the journal to reapers), so the next
        start on this socket finishes the checkpoint. A stop must never turn an
        acknowledged checkpoint into a failed one.
        """
        self.listener.close()
        pending = [record.future for record in self.jobs]
        pending += list(self.owed.recovering.values())
        if pending:
            log.info(
                "waiting up to %s for %d checkpoint(s) being written",
                format_seconds(self.settings.shutdown_timeout),
                len(pending),
            )
            _done, not_done = await asyncio.wait(pending, timeout=self.settings.shutdown_timeout)
            if not_done:
                log.error(
                    "%d checkpoint(s) did not finish within %s; stopping their writers — "
                    "their files, staged segments and journal entries stay, and the next "
                    "start on %s finishes them (journal %s)",
                    len(not_done),
                    format_seconds(self.settings.shutdown_timeout),
                    self.settings.socket_path,
                    self.journal.directory,
                )
                self._stop_writers.set()
                _done, stuck = await asyncio.wait(not_done, timeout=STOP_GRACE_S)
                if stuck:
                    self.abandoned_writers = True
                    for record in self.jobs:
                        if record.future in stuck:
                            self.owed.keep(record.persist)
                    log.error(
                        "%d writer(s) did not stop within %s (storage not answering?); "
                        "exiting without them — the journal still owes their checkpoints",
                        len(stuck),
                        format_seconds(STOP_GRACE_S),
                    )
        await self._flush_sessions()
        for session in list(self.sessions.values()):
            session.close()
        self.inflight.close()
        if self._pending_unlinks:
            await asyncio.wait(self._pending_unlinks, timeout=10)
        owed = self.owed.at_exit
        leftover = set(self.store.all_segment_names() + segment.list_names(self.instance))
        leftover -= owed
        for name in leftover:
            segment.unlink(name)
        self._writers.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        self.versionsums.shutdown()
        self.segments.shutdown()
        self.owed.shutdown()
        if self._lock is not None:
            if owed:
                # The lock file stays: it names the journal, so reapers leave the owed
                # segments alone; the flock goes with this process.
                owes = len(self.owed.jobs())
                log.info("instance lock file kept: the journal owes %d job(s)", owes)
            else:
                self.journal.remove_if_empty()
                self._lock.release()
        log.info("stopped; %d segment(s) unlinked at exit", len(leftover))

    async def _flush_sessions(self, timeout: float = 5.0) -> None:
        """Let job results that just finished reach their clients before the sockets close.

        A trainer whose checkpoint completed during shutdown then hears "durable", not
        "connection lost"; a client that stopped reading cannot hold this up past ``timeout``.
        """
        tasks = [task for s in self.sessions.values() for task in s.pending_tasks()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    # -- configuration -----------------------------------------------------------

    def reconfigure(self, new: Settings) -> list[str]:
        """Apply a reloaded configuration without touching sessions, layouts or jobs.

        New limits apply to the next registration, commit or acquire; what clients already
        hold stays theirs. Returns the settings that changed but need a restart to apply.
        """
        old = self.settings
        self.store.limits = new.limits
        self.retention.policy = new.retention
        for name in Settings.RELOADABLE:
            setattr(old, name, getattr(new, name))
        self._end_refused_sessions()
        needs_restart = []
        for name in ("writer_threads", "io_threads", "write_chunk", "write_buffers", "direct_io"):
            if getattr(new, name) != getattr(old, name):
                needs_restart.append(name)
        if new.socket_path != old.socket_path and not self.listener.activated:
            needs_restart.append("socket_path")
        return needs_restart

    def _end_refused_sessions(self) -> None:
        """After a reload, a user no longer allowed is not served any more: its sessions
        end (told why). Checkpoints it already committed are acknowledged and still
        written; what it had merely prepared is dropped with the session."""
        allowlist = self.settings.allowlist
        for session in list(self.sessions.values()):
            if allowlist.admits(session.peer):
                continue
            log.warning("reload: %s is no longer allowed; ending its session", session.describe())
            message = (
                f"uid {session.peer.uid} is no longer allowed to use shmstaged (the "
                "configuration was reloaded); checkpoints already committed are still written"
            )
            self.track(asyncio.ensure_future(session.end(ErrorCode.NOT_ALLOWED, message)))

    # -- layouts released, work off the loop --------------------------------------

    async def run_io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def release(self, staged: StagedLayout) -> None:
        self.store.mark_released(staged)
        self._collect(staged)

    def _collect(self, staged: StagedLayout) -> None:
        names = self.store.collect(staged)
        if names:
            self.retention.forget(staged)
            self.segments.unlink_later(names)

    def _lease_ended(self, staged: StagedLayout, slot: Slot) -> None:
        """The last lease or pin on a slot ended: a waiting fill may take it, a released
        layout only the lease kept may go."""
        self.store.hand_over(staged, slot)
        self._collect(staged)

    def track(self, future: asyncio.Future[Any]) -> None:
        """Background work that shutdown waits for (unlinks, journal removals, recovery)."""
        self._pending_unlinks.add(future)
        future.add_done_callback(self._pending_unlinks.discard)

    # -- sessions --------------------------------------------------------------------

    def _open_session(self, transport: Transport, peer: Peer) -> None:
        """Serve an admitted peer: a session, and its op handlers built with what each
        uses. Raises StoreError for a user already at its connection limit."""
        sid = next(self._session_ids)
        self.store.open_session(sid, peer.uid)
        session = Session(
            sid,
            transport,
            peer,
            max_frame_bytes=self.settings.max_frame_bytes,
            store=self.store,
            telemetry=self.telemetry,
            inflight=self.inflight,
            welcome=self._welcome,
            closed=self.session_closed,
        )
        commits = Commits(
            session,
            self.store,
            self.retention,
            self.telemetry,
            self.settings,
            self.owed,
            self.jobs,
            run_io=self.run_io,
            track=self.track,
        )
        registration = Registration(
            session,
            self.store,
            self.retention,
            self.telemetry,
            self.settings,
            stopping=lambda: self.stopping,
            check_capacity=check_capacity,
            create_segments=functools.partial(self.run_io, self.segments.create),
            release=self.release,
            unlink_later=self.segments.unlink_later,
            drop_prepared=commits.drop_prepared,
        )
        restores = Restores(session, self.retention, self.telemetry, run_io=self.run_io)
        session.serve(registration.ops())
        session.serve(commits.ops(), on_close=commits.close)
        session.serve(restores.ops())
        publishing = Publishing(session, self.store, self.channels, self.versionsums.start)
        session.serve(publishing.ops(), on_close=publishing.close)
        session.serve(Asking(self.status, session).ops())
        self.sessions[session.id] = session
        asyncio.get_running_loop().create_task(session.run())

    def _welcome(self) -> dict[str, Any]:
        """The daemon's part of a session's "welcome"."""
        return {
            "instance": self.instance,
            # the longest held "pin" (``publishing``): a client pins so only when told
            "limits": {**self.store.limits.to_wire(), "max_pin_hold_seconds": MAX_PIN_HOLD_S},
            "default_slots": self.settings.default_slots,
        }

    def _identity(self) -> dict[str, Any]:
        """The daemon's own part of ``status``: which daemon, where, since when."""
        return {
            "version": __version__,
            "instance": self.instance,
            "pid": os.getpid(),
            "uptime_seconds": time.time() - self.started,
            "socket": str(self.settings.socket_path),
            "journal": str(self.journal.directory),
            "journal_filesystem": self.journal_kind,
            "activated": self.listener.activated,
            "config": str(self.settings.config_source or ""),
            "stopping": self.stopping,
        }

    def session_closed(self, session: Session) -> None:
        """A client went away. Its leases end; a layout it did not release is retained for
        a restart when it holds an acknowledged checkpoint (``retention``), else released."""
        self.sessions.pop(session.id, None)
        self.retention.end_session(session.id)
        for staged in self.store.layouts_of(session.id):
            if self.stopping or not self.retention.keep(staged):
                self.release(staged)
        if session.transport.lingering:  # still one of its user's connections until read
            self.inflight.linger(
                session.transport, functools.partial(self.store.forget_client, session.id)
            )
        else:
            self.store.forget_client(session.id)


def format_seconds(seconds: float) -> str:
    """A duration for log lines: 0.5 s stays 0.5 s (not "0 s"), 60 s stays 60 s."""
    return f"{seconds:g} s"


#: Descriptor table entries reserved at start: several clients' segment batches in flight
#: (``MAX_PENDING_FDS`` each) and the jobs' open segments (64 KiB of kernel memory).
RESERVED_FDS: Final = 8192


def _raise_fd_limit() -> None:
    """Use the hard descriptor limit: every client, slot segment in flight and job holds fds,
    and a soft limit of 1024 would turn a busy node into EMFILE for everyone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # Grown now, while no thread shares the table: growing it later, under load, makes
    # every thread that opens a descriptor wait out an RCU grace period (``descriptors``).
    descriptors.reserve(RESERVED_FDS)


def _log_dropped(dropped: Dropped) -> None:
    log.warning(
        "uid %d: step %d of sharded channel %r dropped with parts %s of %d: %s; "
        "its slots are handed back (a checkpoint's once its file is written)",
        dropped.uid,
        dropped.step,
        dropped.channel,
        ", ".join(map(str, dropped.arrived)) or "none",
        dropped.count,
        dropped.why,
    )
