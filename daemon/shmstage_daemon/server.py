"""The daemon: listener, sessions, writer threads, and an orderly shutdown.

The event loop owns all state. Blocking work — creating and unlinking segments, streaming a
slot to disk — runs in thread pools and comes back as a result the loop applies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import itertools
import logging
import os
import resource
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from shmstage import descriptors, instance, segment
from shmstage.layout import Layout
from shmstage.protocol import (
    DAEMON_MAX_PENDING_FDS,
    DEFAULT_MAX_FRAME_BYTES,
    Connection,
    ErrorCode,
    Role,
)
from shmstage.segment import SegmentRef
from shmstage.units import format_size
from shmstage_daemon import (
    __version__,
    credentials,
    faults,
    inflight,
    job,
    journal,
    retention,
    scheduler,
)
from shmstage_daemon.admission import Allowlist, Peer, peer_of
from shmstage_daemon.config import measure_shm
from shmstage_daemon.fairness import FairExecutor
from shmstage_daemon.session import Session
from shmstage_daemon.slot import Slot, SlotState
from shmstage_daemon.store import (
    Limits,
    SlotWire,
    StagedLayout,
    Store,
    StoreError,
    UserUsage,
)
from shmstage_daemon.telemetry import FinishedJob, Telemetry, describe_stall
from shmstage_daemon.transport import Transport

log = logging.getLogger("shmstaged")
T = TypeVar("T")

#: How often staged segments are checked for a size a client changed (``segment.fix_size``).
SIZE_CHECK_INTERVAL_S = 10.0
#: How long a refused peer gets to read why, and how many may be reading at once.
REFUSAL_LINGER_S = 2.0
MAX_LINGERING_REFUSALS = 64
#: After ``shutdown_timeout``, how long writers get to notice the stop request. A writer
#: stops at its next chunk (tens of milliseconds) or after an fsync in progress; one stuck
#: in the kernel for longer is left behind (the process exits without it, see ``main``).
STOP_GRACE_S = 15.0


class StartupError(Exception):
    """The daemon cannot serve; the message says what to fix."""


@dataclass
class Settings:
    socket_path: Path
    limits: Limits
    allowlist: Allowlist = field(default_factory=Allowlist.default)
    writer_threads: int = 16
    #: The shared data writers (see ``scheduler``); all need a restart to change.
    io_threads: int = scheduler.DEFAULT_IO_THREADS
    write_chunk: int = scheduler.DEFAULT_CHUNK_BYTES
    write_buffers: int = scheduler.DEFAULT_MEMORY_BYTES
    direct_io: bool = True
    fsync: bool = True
    shutdown_timeout: float = 60.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    default_slots: int = 2
    config_source: Path | None = None
    #: Groups whose members see every user's clients and jobs in ``shmstage status``.
    operator_gids: frozenset[int] = frozenset()
    #: Where instances' journal directories live; memory-backed unless allow_disk_journal.
    journal_root: Path = Path("/dev/shm")
    allow_disk_journal: bool = False
    #: Checkpoints kept in memory for a restarted trainer, and leases on them.
    retention: retention.RetentionPolicy = field(default_factory=retention.RetentionPolicy)

    #: What a SIGHUP reload can change in a running daemon; the rest needs a restart.
    RELOADABLE = (
        "limits",
        "allowlist",
        "fsync",
        "shutdown_timeout",
        "default_slots",
        "operator_gids",
        "retention",
    )


@dataclass
class JobRecord:
    persist: job.PersistJob
    session: Session
    staged: StagedLayout
    slot: Slot
    started: float
    future: asyncio.Future[job.JobResult]
    directory: str = "?"


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings.limits)
        self.instance = ""
        self.max_frame_bytes = settings.max_frame_bytes
        self.fsync = settings.fsync
        self.sessions: dict[int, Session] = {}
        self.jobs: dict[int, JobRecord] = {}
        self.stopping = False
        self.started = time.time()
        self.stats = {"saves": 0, "failed": 0, "bytes": 0}
        self.telemetry = Telemetry()
        #: Segment descriptors sent and not read yet, per user, and the closed sessions'
        #: sockets that still hold some (``inflight``).
        self.inflight = inflight.InFlight()
        self.retention = retention.Retention(
            self.store, settings.retention, self.telemetry, self.unlink_later, self._lease_ended
        )
        #: True when systemd passed the listening socket: it is systemd's, never unlinked.
        self.activated = False
        self._session_ids = itertools.count(1)
        self._listener: socket.socket | None = None
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
        # One thread gives segments back and puts resized ones back to their size: a size
        # put back while the segment was being given back would reserve its memory again.
        self._segment_io = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="shmstage-segments"
        )
        # One thread: journal writes stay in order and never queue behind segment creation.
        self._journal_io = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="shmstage-journal"
        )
        self._stop = asyncio.Event()
        self._pending_unlinks: set[asyncio.Future[Any]] = set()
        self._refusing = 0
        #: This instance's journal (its directory is named after the instance: see start).
        self.journal = journal.Journal(settings.journal_root / "shmstage.unstarted.journal")
        self.journal_kind = "?"
        #: Journal directories of this socket's dead predecessors, by path.
        self._adopted: dict[str, journal.Journal] = {}
        #: job id -> journal entry name, for jobs acknowledged by this instance.
        self._journaled: dict[int, str] = {}
        #: job id -> (uid, bytes) charged for its journal entry (max_journal_bytes).
        self._journal_charges: dict[int, tuple[int, int]] = {}
        #: job id -> journal entry name, for commits journaled pending (see journal_commit).
        self._pending_entries: dict[int, str] = {}
        #: Journal entries of dead instances' jobs not finished yet, by entry name.
        self._owed: dict[str, journal.Entry] = {}
        #: ...and the journal each of them lives in.
        self._entry_journal: dict[str, journal.Journal] = {}
        #: journal entry name -> the writer's future, while an owed job is being finished.
        self.recovering: dict[str, asyncio.Future[job.JobResult]] = {}
        #: Set when the stop can wait no longer: every job stops at its next write, leaving
        #: its files, segments and journal entry for the next start.
        self._stop_writers = threading.Event()
        #: Segments of jobs this instance stopped (or never started) before they were
        #: durable: the journal still owes them, so they outlive this process.
        self._owed_at_exit: set[str] = set()
        #: Writers still running when the daemon had to go (storage hung): ``main`` exits
        #: without joining them.
        self.abandoned_writers = False

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
        self.instance = self._lock.instance
        self.journal = journal.Journal(Path(instance.journal_dir(str(root), self.instance)))
        try:
            self._take_over(listener)
        except BaseException:
            self._give_back_instance()
            raise
        log.info(
            "shmstaged %s listening on %s%s (instance %s, journal %s on %s, admitting %s)",
            __version__,
            self.settings.socket_path,
            " (socket activation)" if self.activated else "",
            self.instance,
            self.journal.directory,
            self.journal_kind,
            self.settings.allowlist.describe(),
        )
        faults.pause("started")

    def _take_over(self, listener: socket.socket | None) -> None:
        """Bind (or take) the socket, then adopt what dead predecessors on it still owe and
        reap the rest of dead instances' segments."""
        if listener is not None:
            self.activated = True
            self._listener = listener
        else:
            self._listener = bind(self.settings.socket_path)
        # Only now, serving this socket alone, may we take over its predecessors' journals.
        try:
            self.journal.prepare()
        except (OSError, journal.JournalError) as exc:
            raise StartupError(f"cannot use the journal {self.journal.directory}: {exc}") from None
        owed = self._adopt_predecessors()
        self._owed = {entry.name: entry for entry in owed}
        keep = {name for entry in owed for name, _ in entry.segments}
        reaped = instance.reap_dead(keep=keep, own_journals=self._own_journals())
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
        self._close_listener()
        if self._lock is None:
            return
        if self.journal.remove_if_empty() or not self.journal.directory.exists():
            self._lock.release()
            self._lock = None

    def _close_listener(self) -> None:
        """Stop listening; remove the socket file unless systemd passed the socket (it
        keeps listening on it across restarts)."""
        if self._listener is None:
            return
        self._listener.close()
        self._listener = None
        if not self.activated:
            with contextlib.suppress(FileNotFoundError):
                self.settings.socket_path.unlink()

    def _adopt_predecessors(self) -> list[journal.Entry]:
        """Load what dead daemons on this socket still owe, from their own journals.

        Found through their lock files (which only this uid can have written), plus the
        directory next to the socket where daemons before 0.2 kept it. A journal that
        cannot be read is logged and left alone: its lock keeps its segments.
        """
        socket = self.settings.socket_path
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
        return owed

    def _own_journals(self) -> set[str]:
        return {str(self.journal.directory), *self._adopted}

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        for entry in list(self._owed.values()):
            self.track(loop.create_task(self._finish_owed(entry)))
        accept = loop.create_task(self._accept_loop(self._listener))
        sweep = loop.create_task(self._sweep_retained())
        sizes = loop.create_task(self._keep_segment_sizes())
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

    async def _keep_segment_sizes(self) -> None:
        """Every SIZE_CHECK_INTERVAL_S, segments a descriptor's holder resized go back to
        their size: grown ones would hold memory nobody is charged for, shrunk ones make
        readers mapping them fault. A stat per segment, off the loop (~11 us each on a
        loaded 2-core host: 0.2 s for 20,000 segments)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SIZE_CHECK_INTERVAL_S)
            owners: dict[SegmentRef, tuple[StagedLayout, Slot, Any]] = {}
            reading: set[SegmentRef] = set()  # a job's: short ones fail it (``gather``)
            for staged in self.store.layouts.values():
                for slot in staged.slots:
                    owners.update((ref, (staged, slot, slot.held)) for ref in slot.segments)
                    if slot.state is SlotState.PERSISTING:
                        reading.update(slot.segments)
            try:
                fixed = await loop.run_in_executor(
                    self._segment_io, _fix_sizes, list(owners), reading
                )
            except Exception:  # a bug here must not end the checks (nor the daemon)
                log.exception("checking the segments' sizes failed")
                continue
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

    def request_stop(self) -> None:
        if not self._stop.is_set():
            log.info("stopping: no new connections; finishing in-flight checkpoints")
        self.stopping = True
        self._stop.set()

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    log.error("out of file descriptors; not accepting for 1 s")
                    await asyncio.sleep(1)
                    continue
                # ECONNABORTED, ENOBUFS, EPROTO...: one failed accept must not end accepting.
                log.warning("accept failed: %s; continuing", exc)
                await asyncio.sleep(0.05)
                continue
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        try:
            peer = peer_of(sock)
        except OSError as exc:
            log.warning("cannot identify a peer: %s", exc)
            sock.close()
            return
        transport = Transport(sock, max_fds=DAEMON_MAX_PENDING_FDS)
        if not self.settings.allowlist.admits(peer):
            log.warning("refused %s: not in the allowlist", peer.describe())
            self._turn_away(
                transport,
                ErrorCode.NOT_ALLOWED,
                f"uid {peer.uid} is not allowed to use shmstaged (allowed: "
                f"{self.settings.allowlist.describe()}); add the user or one of its groups "
                "to shmstaged's allowed users",
            )
            return
        sid = next(self._session_ids)
        try:
            self.store.open_session(sid, peer.uid)
        except StoreError as exc:
            log.warning("refused %s: %s", peer.describe(), exc.message)
            self._turn_away(transport, exc.code, exc.message)
            return
        session = Session(self, sid, transport, peer)
        self.sessions[session.id] = session
        asyncio.get_running_loop().create_task(session.run())

    def _turn_away(self, transport: Transport, code: ErrorCode, message: str) -> None:
        """Tell a refused peer why (briefly: at most MAX_LINGERING_REFUSALS at once)."""
        refusal = Connection(Role.DAEMON).error_frame(code, message, fatal=True)
        if self._refusing >= MAX_LINGERING_REFUSALS:  # a flood: no courtesy, just close
            transport.close()
            return
        self.track(asyncio.get_running_loop().create_task(self._refuse(transport, refusal)))

    async def _refuse(self, transport: Transport, refusal: bytes) -> None:
        """Send the reason, then let the peer read it before closing.

        Closing at once would make the client's first send (its hello) fail with EPIPE
        before it ever reads why, leaving it with "broken pipe" instead of the fix.
        """
        self._refusing += 1
        try:
            async with asyncio.timeout(REFUSAL_LINGER_S):
                await transport.send(refusal)
                transport.sock.shutdown(socket.SHUT_WR)
                while True:
                    data, fds = await transport.recv()
                    for fd in fds:
                        os.close(fd)
                    if not data:
                        break
        except (TimeoutError, OSError):
            pass
        finally:
            self._refusing -= 1
            transport.close()

    async def _shutdown(self) -> None:
        """Stop serving, let checkpoints being written finish, and leave nothing behind —
        except what the journal still vouches for.

        Past ``shutdown_timeout`` the writers are asked to stop (``job.JobInterrupted``):
        each leaves its temporary files, and the daemon leaves the staged segments, the
        journal entry and its lock file (which names the journal to reapers), so the next
        start on this socket finishes the checkpoint. A stop must never turn an
        acknowledged checkpoint into a failed one.
        """
        self._close_listener()
        pending = [record.future for record in self.jobs.values()]
        pending += list(self.recovering.values())
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
                    for record in self.jobs.values():
                        if record.future in stuck:
                            self._keep_for_journal(record)
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
        owed = self._owed_at_exit
        leftover = set(self.store.all_segment_names() + segment.list_names(self.instance))
        leftover -= owed
        for name in leftover:
            segment.unlink(name)
        self._writers.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._segment_io.shutdown(wait=False, cancel_futures=True)
        self._journal_io.shutdown(wait=False, cancel_futures=True)
        if self._lock is not None:
            if owed:
                # The lock file stays: it names the journal, so reapers leave the owed
                # segments alone; the flock goes with this process.
                owes = len(self._owed_jobs())
                log.info("instance lock file kept: the journal owes %d job(s)", owes)
            else:
                self.journal.remove_if_empty()
                self._lock.release()
        log.info("stopped; %d segment(s) unlinked at exit", len(leftover))

    def _keep_for_journal(self, record: JobRecord) -> None:
        """A job that will not finish in this process: its segments outlive it."""
        self._owed_at_exit.update(ref.name for ref in record.persist.segments)

    def _owed_jobs(self) -> list[str]:
        return list(self._journaled.values()) + list(self._owed)

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
        self.fsync = new.fsync
        self._end_refused_sessions()
        needs_restart = []
        for name in ("writer_threads", "io_threads", "write_chunk", "write_buffers", "direct_io"):
            if getattr(new, name) != getattr(old, name):
                needs_restart.append(name)
        if new.socket_path != old.socket_path and not self.activated:
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

    def check_capacity(self, nbytes: int) -> None:
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

    # -- helpers for sessions ----------------------------------------------------

    async def run_io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def create_segments(self, layout: Layout, slots: int) -> list[list[SegmentRef]]:
        """Runs in an I/O thread, fanning large layouts out to setup threads; all or nothing."""
        sizes = list(layout.packing().sizes) * slots
        refs: list[SegmentRef | None] = [None] * len(sizes)

        def make(index: int) -> None:
            refs[index] = segment.create(self.instance, sizes[index])

        try:
            if sizes:
                make(0)
                faults.pause("register")
            segment.in_parallel(sizes[1:], lambda index: make(index + 1))
        except BaseException:
            for ref in refs:
                if ref is not None:
                    segment.unlink(ref.name)
            raise
        per_slot = len(layout.packing())
        made = [ref for ref in refs if ref is not None]
        return [made[i * per_slot : (i + 1) * per_slot] for i in range(slots)]

    def release(self, staged: StagedLayout) -> None:
        self.store.mark_released(staged)
        self._collect(staged)

    def _collect(self, staged: StagedLayout) -> None:
        names = self.store.collect(staged)
        if names:
            self.retention.forget(staged)
            self.unlink_later(names)

    def unlink_later(self, names: list[str]) -> asyncio.Future[Any]:
        """Give segments back in an I/O thread (shutdown waits for it): their memory is
        freed at once, though a client kept descriptors on them (``segment.give_back``).
        Not while stopping (unlinked then, as before): a trainer still copying into its
        slot must hear that the daemon is gone, not fault."""
        loop = asyncio.get_running_loop()
        unlink = _unlink_all if self.stopping else _give_back_all
        future = loop.run_in_executor(self._segment_io, unlink, names)
        self.track(future)
        return future

    def _lease_ended(self, staged: StagedLayout, slot: Slot) -> None:
        """The last lease on a slot ended: a waiting fill may take it, a released layout
        only the lease kept may go."""
        self.store.hand_over(staged, slot)
        self._collect(staged)

    def track(self, future: asyncio.Future[Any]) -> None:
        """Background work that shutdown waits for (unlinks, journal removals, recovery)."""
        self._pending_unlinks.add(future)
        future.add_done_callback(self._pending_unlinks.discard)

    # -- the journal -------------------------------------------------------------

    @property
    def default_slots(self) -> int:
        return self.settings.default_slots

    @property
    def journal_path(self) -> Path:
        return self.journal.directory

    def charge_journal(self, job_id: int, session_id: int, nbytes: int) -> None:
        """Charge a job's journal entry to its user before it is written; refuses over
        ``max_journal_bytes``. Released with the entry (``release_journal``)."""
        limit = self.store.limits.max_user_journal_bytes
        self.store.charge(session_id, "journal_bytes", nbytes, limit, "max_journal_bytes")
        self._journal_charges[job_id] = (self.store.uids.get(session_id, -1), nbytes)

    def release_journal(self, job_id: int) -> None:
        uid, nbytes = self._journal_charges.pop(job_id, (None, 0))
        usage = self.store.usage.get(uid) if uid is not None else None
        if usage is not None:
            usage.journal_bytes -= nbytes

    async def journal_commit(
        self, persist: job.PersistJob, wire: SlotWire, peer: Peer, *, owed: bool = True
    ) -> None:
        """Journal a job before it is acknowledged; raises OSError if the journal fails.

        ``owed=False`` writes the entry pending (a commit sent while the client's copy
        still runs): ``journal_publish`` makes it owed, ``journal_discard`` drops it.
        """
        loop = asyncio.get_running_loop()
        directory = await loop.run_in_executor(
            self._journal_io, self._journal_sync, persist, wire, peer, self.fsync, owed
        )
        if directory is None:
            self.release_journal(persist.id)
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

    async def journal_publish(self, job_id: int) -> None:
        """Make a pending entry owed (a no-op for a job that could not be journaled)."""
        name = self._pending_entries.pop(job_id, None)
        if name is None:
            return
        await asyncio.get_running_loop().run_in_executor(
            self._journal_io, functools.partial(self.journal.publish, name, fsync=self.fsync)
        )
        self._journaled[job_id] = name

    def journal_discard(self, job_id: int) -> None:
        """Drop a pending entry whose commit will not happen."""
        self.release_journal(job_id)
        name = self._pending_entries.pop(job_id, None)
        if name is not None:
            loop = asyncio.get_running_loop()
            self.track(loop.run_in_executor(self._journal_io, self.journal.discard, name))

    def _journal_sync(
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
        if owed:
            self.journal.record(entry, fsync=fsync, prepacked=wire.packed)
        else:
            self.journal.write_pending(entry, fsync=fsync, prepacked=wire.packed)
        return directory

    def _unjournal(self, job_id: int) -> None:
        self.release_journal(job_id)
        name = self._journaled.pop(job_id, None)
        if name is not None:
            self._remove_entry(name)

    def _remove_entry(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        self.track(
            loop.run_in_executor(
                self._journal_io, functools.partial(self.journal.remove, name, fsync=self.fsync)
            )
        )

    def abandon_job(self, session_id: int, staged: StagedLayout, slot: Slot, job_id: int) -> None:
        """Undo ``begin_job`` for a commit that could not be journaled (never acknowledged)."""
        self.store.abort_job(session_id, staged, slot, job_id)
        self._collect(staged)

    async def _finish_owed(self, entry: journal.Entry) -> None:
        """Finish one job a previous instance acknowledged, then free what it held.

        An instance that is still alive (a stopping daemon whose writer outlived its loop)
        is finishing the job itself: wait for it to exit rather than write alongside it.
        """
        while entry.instance in instance.live_instances():
            await asyncio.sleep(1.0)
        loop = asyncio.get_running_loop()
        future = asyncio.wrap_future(
            self._writers.submit(journal.recover, entry, self._stop_writers), loop=loop
        )
        self.recovering[entry.name] = future
        try:
            result = await future
        except asyncio.CancelledError:  # never started: the daemon is stopping
            result = _never_started(entry.job)
        finally:
            self.recovering.pop(entry.name, None)
        if result.interrupted:
            log.warning("%s: stopped with the daemon; owed to the next start", entry.describe())
            return
        if result.ok:
            self.stats["saves"] += 1
            self.stats["bytes"] += result.bytes
            log.warning("finished %s after a restart: %d bytes", entry.describe(), result.bytes)
        else:
            self.stats["failed"] += 1
            log.error("could not finish %s: %s", entry.describe(), result.message)
        await self.run_io(_unlink_all, [name for name, _ in entry.segments])
        source = self._entry_journal.pop(entry.name)
        await asyncio.get_running_loop().run_in_executor(
            self._journal_io, functools.partial(source.remove, entry.name, fsync=self.fsync)
        )
        del self._owed[entry.name]
        if source not in self._entry_journal.values() and source.remove_if_empty():
            log.info("previous journal %s is finished and removed", source.directory)
        # Whatever else the predecessor left (its lock file) goes now, except the segments
        # of jobs still owed.
        keep = {name for owed in self._owed.values() for name, _ in owed.segments}
        reap = functools.partial(instance.reap_dead, keep=keep, own_journals=self._own_journals())
        self.track(asyncio.ensure_future(self.run_io(reap)))

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

    def start_job(
        self, session: Session, staged: StagedLayout, slot: Slot, persist: job.PersistJob
    ) -> None:
        loop = asyncio.get_running_loop()
        directory = "?"
        with contextlib.suppress(OSError):  # for status displays only; never used to write
            located = os.readlink(f"/proc/self/fd/{persist.destination.dir_fd}")
            directory = persist.destination.shown(located)
        persist.stop = self._stop_writers
        owner = persist.peer.uid if persist.peer is not None else session.peer.uid
        future = asyncio.wrap_future(self._writers.submit_for(owner, job.run, persist), loop=loop)
        record = JobRecord(persist, session, staged, slot, time.perf_counter(), future, directory)
        self.jobs[persist.id] = record
        future.add_done_callback(lambda f: self._job_done(record, f))

    def _job_done(self, record: JobRecord, future: asyncio.Future[job.JobResult]) -> None:
        self.jobs.pop(record.persist.id, None)
        if future.cancelled():
            record.persist.destination.close()
            result = _never_started(record.persist.id)
        else:
            result = future.result()
        if result.interrupted:
            # Stopped with the daemon: the journal entry, the files and the segments stay
            # for the next start. The slot stays PERSISTING, so its layout is never
            # collected (and its segments never unlinked) by this process.
            self._keep_for_journal(record)
            if record.persist.id in self._journaled:
                log.warning("job %d: %s", result.job, result.message)
            else:
                log.error(
                    "job %d: shmstaged stopped before it was written, and it could not be "
                    "journaled (directory not reachable by path): this checkpoint is lost",
                    result.job,
                )
            return
        self._unjournal(record.persist.id)  # ran to an end: nothing is owed any more
        self.retention.job_ended(record.slot, result)  # before the slot can be refilled
        self.store.end_job(record.session.id, record.staged, record.slot, record.persist.id)
        if result.ok:
            record.staged.keep_entries(result.entries)
            self.stats["saves"] += 1
            self.stats["bytes"] += result.bytes
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
            self.stats["failed"] += 1
            log.error("job %d failed: %s", result.job, result.message)
        self.telemetry.job_finished(
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
        if record.session.open:
            record.session.spawn(record.session.job_finished(record.persist, result))

    def sees_everyone(self, peer: Peer) -> bool:
        """Root, the daemon's own user and the operator groups see every user's clients,
        jobs and errors; anyone else only their own (uids, pids and checkpoint paths of
        other users are theirs)."""
        return peer.uid in (0, os.geteuid()) or bool(peer.groups & self.settings.operator_gids)

    def status(self, viewer: Peer | None = None) -> dict[str, Any]:
        """Everything ``shmstage status`` shows (to ``viewer``); plain data (it travels as
        msgpack). Costs what the viewer may see: the sessions and jobs of its uid."""
        now = time.perf_counter()
        cap = measure_shm()
        limits = self.store.limits
        only = None if viewer is None or self.sees_everyone(viewer) else viewer.uid
        own = self.store.usage.get(only, UserUsage()) if only is not None else UserUsage()
        sessions = [s for s in self.sessions.values() if only is None or s.peer.uid == only]
        jobs = {
            jid: r for jid, r in self.jobs.items() if only is None or r.session.peer.uid == only
        }
        memory = self.retention.status(
            x for x in self.store.layouts.values() if only is None or x.uid == only
        )
        if only is not None:
            memory.update(self._own_retention(only))
        return {
            "version": __version__,
            "instance": self.instance,
            "pid": os.getpid(),
            "uptime_seconds": time.time() - self.started,
            "socket": str(self.settings.socket_path),
            "journal": str(self.journal.directory),
            "journal_filesystem": self.journal_kind,
            "activated": self.activated,
            "config": str(self.settings.config_source or ""),
            "stopping": self.stopping,
            # An ordinary user's own figures only: the node's sums changed when another
            # user's trainer registered or died, which told its layout's size and when.
            "shm_reserved_bytes": self.store.reserved_bytes if only is None else own.bytes,
            "shm_budget_bytes": limits.shm_budget_bytes,
            "shm": {
                "total_bytes": cap.shm_total,
                "free_bytes": cap.shm_free,
                "memory_available_bytes": cap.mem_available,
            },
            "limits": {**limits.to_wire(), "default_slots": self.settings.default_slots},
            "clients": [self._client_status(s, jobs) for s in sessions],
            "memory": memory,
            "jobs": [
                {
                    "job": jid,
                    "client": r.session.id,
                    "client_pid": r.session.peer.pid,
                    "directory": r.directory,
                    "data_file": r.persist.destination.data_file,
                    "bytes": r.persist.layout.nbytes,
                    "bytes_written": r.persist.progress.written,
                    "phase": r.persist.progress.phase,
                    "running_seconds": now - r.started,
                }
                for jid, r in jobs.items()
            ],
            "recent": self.telemetry.recent(uid=only),
            "errors": self.telemetry.recent_errors(uid=only),
            "totals": dict(self.stats) if only is None else self.telemetry.totals(only),
            "restricted_to_uid": only,
        }

    def _own_retention(self, uid: int) -> dict[str, int]:
        """Retention's node-wide figures, as far as they are ``uid``'s own."""
        retained = [x for x in self.store.retained.values() if x.uid == uid]
        return {
            "retained_bytes": sum(x.bytes_reserved for x in retained),
            "retained_layouts": len(retained),
            "leases": sum(1 for lease in self.retention.leases.values() if lease.uid == uid),
        }

    def _client_status(self, session: Session, jobs: dict[int, JobRecord]) -> dict[str, Any]:
        layouts = self.store.layouts_of(session.id)
        usage = self.store.usage.get(session.peer.uid)
        return {
            "id": session.id,
            "name": session.client_name,
            "pid": session.peer.pid,
            "uid": session.peer.uid,
            "connected_seconds": time.time() - session.started,
            "layouts": len(layouts),
            "segments": sum(x.segment_count for x in layouts),
            "bytes": sum(x.bytes_reserved for x in layouts),
            "jobs": sum(1 for r in jobs.values() if r.session is session),
            "user_jobs": usage.jobs if usage is not None else 0,
        }

    def metrics(self) -> dict[str, Any]:
        """A snapshot of the metrics registry, with the gauges read now."""
        return self.telemetry.snapshot(
            {
                "clients": len(self.sessions),
                "jobs_in_flight": len(self.jobs),
                "shm_reserved_bytes": self.store.reserved_bytes,
                "shm_budget_bytes": self.store.limits.shm_budget_bytes,
                "segments": sum(x.segment_count for x in self.store.layouts.values()),
                "retained_bytes": self.store.retained_bytes,
                "retained_layouts": len(self.store.retained),
                "leases": len(self.retention.leases),
                "uptime_seconds": time.time() - self.started,
            }
        )

    def status_line(self) -> str:
        """The one line ``systemctl status`` shows (systemd's STATUS=)."""
        writing = len(self.jobs)
        return (
            f"{len(self.sessions)} client(s), {format_size(self.store.reserved_bytes)} staged "
            f"of {format_size(self.store.limits.shm_budget_bytes)}, {writing} job(s) writing, "
            f"{self.stats['saves']} saved, {self.stats['failed']} failed"
        )


def _never_started(job_id: int) -> job.JobResult:
    """A job the stopping daemon cancelled in the writers' queue: owed, like an interrupted one."""
    return job.JobResult(
        job_id,
        False,
        code=str(ErrorCode.SHUTTING_DOWN),
        message="shmstaged stopped before the checkpoint was written; the next start writes it",
        interrupted=True,
    )


def format_seconds(seconds: float) -> str:
    """A duration for log lines: 0.5 s stays 0.5 s (not "0 s"), 60 s stays 60 s."""
    return f"{seconds:g} s"


def _unlink_all(names: list[str]) -> None:
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


def bind(path: Path) -> socket.socket:
    """Bind the listening socket (mode 0660), refusing to steal one a live daemon serves."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    check_socket_directory(path.parent)
    try:
        st = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(f"{path} exists and is not a socket; remove it or pick --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink()  # left by a daemon that died
        except OSError as exc:
            raise StartupError(f"cannot check existing socket {path}: {exc}") from exc
        else:
            raise StartupError(f"another shmstaged is already serving {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o117)  # created 0660: never a moment of wider access
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot bind {path}: {exc.strerror}") from exc
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o660)
    sock.listen(128)
    return sock


def check_socket_directory(directory: Path) -> None:
    """Serve only from a directory no other user controls.

    Whoever may write the socket's directory may delete the socket and bind their own in
    its place, and trainers would then stage their tensors into segments that user owns.
    So the directory must be this daemon's own (or root's), not a symlink, and writable by
    nobody else — or sticky (like /tmp), where others cannot remove what is ours.
    """
    try:
        st = directory.lstat()
    except OSError as exc:
        raise StartupError(f"cannot use socket directory {directory}: {exc.strerror}") from None
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory (a symlink?)"
    elif st.st_uid not in (os.geteuid(), 0):
        problem = f"belongs to uid {st.st_uid}, not to this daemon's uid {os.geteuid()}"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        problem = "is writable by other users"
    if problem is not None:
        raise StartupError(
            f"socket directory {directory} {problem}: another user could replace the socket "
            "with their own; use a directory only this user (or root) can write, e.g. the "
            "default, or remove it and let shmstaged create it"
        )


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
