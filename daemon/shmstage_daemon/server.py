"""The daemon: listener, sessions, writer threads, and an orderly shutdown.

The event loop owns all state. Blocking work — creating and unlinking segments, streaming a
slot to disk — runs in thread pools and comes back as a result the loop applies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import itertools
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from shmstage import segment
from shmstage.layout import Layout
from shmstage.protocol import DEFAULT_MAX_FRAME_BYTES, Connection, ErrorCode, Role
from shmstage.segment import SegmentRef
from shmstage_daemon import __version__, instance, job
from shmstage_daemon.admission import Allowlist, peer_of
from shmstage_daemon.session import Session
from shmstage_daemon.slot import Slot
from shmstage_daemon.store import Limits, StagedLayout, Store
from shmstage_daemon.transport import Transport

log = logging.getLogger("shmstaged")
T = TypeVar("T")


class StartupError(Exception):
    """The daemon cannot serve; the message says what to fix."""


@dataclass
class Settings:
    socket_path: Path
    limits: Limits
    allowlist: Allowlist = field(default_factory=Allowlist.default)
    writer_threads: int = 4
    fsync: bool = True
    shutdown_timeout: float = 60.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES


@dataclass
class JobRecord:
    persist: job.PersistJob
    session: Session
    staged: StagedLayout
    slot: Slot
    started: float
    future: asyncio.Future[job.JobResult]


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
        self._session_ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._lock: instance.InstanceLock | None = None
        self._writers = concurrent.futures.ThreadPoolExecutor(
            settings.writer_threads, thread_name_prefix="shmstage-writer"
        )
        self._io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="shmstage-io")
        self._stop = asyncio.Event()
        self._pending_unlinks: set[asyncio.Future[Any]] = set()

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Claim an instance, reap dead instances' segments, bind the socket."""
        self._lock = instance.InstanceLock.claim()
        self.instance = self._lock.instance
        reaped = instance.reap_dead()
        if reaped:
            log.info("reaped %d segment(s) left by dead shmstaged instances", reaped)
        self._listener = bind(self.settings.socket_path)
        log.info(
            "shmstaged %s listening on %s (instance %s, admitting %s)",
            __version__,
            self.settings.socket_path,
            self.instance,
            self.settings.allowlist.describe(),
        )

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        accept = loop.create_task(self._accept_loop(self._listener))
        await self._stop.wait()
        accept.cancel()
        await self._shutdown()

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
                raise
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        try:
            peer = peer_of(sock)
        except OSError as exc:
            log.warning("cannot identify a peer: %s", exc)
            sock.close()
            return
        transport = Transport(sock)
        if not self.settings.allowlist.admits(peer):
            log.warning("refused %s: not in the allowlist", peer.describe())
            refusal = Connection(Role.DAEMON).error_frame(
                ErrorCode.NOT_ALLOWED,
                f"uid {peer.uid} is not allowed to use shmstaged (allowed: "
                f"{self.settings.allowlist.describe()}); add the user or one of its groups "
                "to shmstaged's allowed users",
                fatal=True,
            )
            with contextlib.suppress(OSError):
                sock.send(refusal)
            transport.close()
            return
        session = Session(self, next(self._session_ids), transport, peer)
        self.sessions[session.id] = session
        asyncio.get_running_loop().create_task(session.run())

    async def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.settings.socket_path.unlink()
        pending = [record.future for record in self.jobs.values()]
        if pending:
            log.info(
                "waiting up to %.0f s for %d checkpoint(s) being written",
                self.settings.shutdown_timeout,
                len(pending),
            )
            _done, not_done = await asyncio.wait(pending, timeout=self.settings.shutdown_timeout)
            if not_done:
                log.error(
                    "%d checkpoint(s) did not finish within %.0f s; abandoning them "
                    "(their temporary files are removed, no manifest is written)",
                    len(not_done),
                    self.settings.shutdown_timeout,
                )
        for session in list(self.sessions.values()):
            session.close()
        if self._pending_unlinks:
            await asyncio.wait(self._pending_unlinks, timeout=10)
        leftover = self.store.all_segment_names() + segment.list_names(self.instance)
        for name in set(leftover):
            segment.unlink(name)
        self._writers.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._lock is not None:
            self._lock.release()
        log.info("stopped; %d segment(s) unlinked at exit", len(set(leftover)))

    # -- helpers for sessions ----------------------------------------------------

    async def run_io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def create_segments(self, layout: Layout, slots: int) -> list[list[SegmentRef]]:
        """Runs in an I/O thread; all or nothing."""
        made: list[SegmentRef] = []
        try:
            result = []
            for _ in range(slots):
                refs = []
                for spec in layout.tensors:
                    ref = segment.create(self.instance, spec.nbytes)
                    made.append(ref)
                    refs.append(ref)
                result.append(refs)
            return result
        except BaseException:
            for ref in made:
                segment.unlink(ref.name)
            raise

    def release(self, staged: StagedLayout) -> None:
        self.store.mark_released(staged)
        self._collect(staged)

    def _collect(self, staged: StagedLayout) -> None:
        names = self.store.collect(staged)
        if names:
            future = asyncio.ensure_future(self.run_io(_unlink_all, names))
            self._pending_unlinks.add(future)
            future.add_done_callback(self._pending_unlinks.discard)

    def session_closed(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        for staged in self.store.layouts_of(session.id):
            self.release(staged)
        self.store.forget_client(session.id)

    def start_job(
        self, session: Session, staged: StagedLayout, slot: Slot, persist: job.PersistJob
    ) -> None:
        loop = asyncio.get_running_loop()
        future = asyncio.wrap_future(self._writers.submit(job.run, persist), loop=loop)
        record = JobRecord(persist, session, staged, slot, time.perf_counter(), future)
        self.jobs[persist.id] = record
        future.add_done_callback(lambda f: self._job_done(record, f))

    def _job_done(self, record: JobRecord, future: asyncio.Future[job.JobResult]) -> None:
        self.jobs.pop(record.persist.id, None)
        if future.cancelled():
            result = job.JobResult(
                record.persist.id,
                False,
                code=str(ErrorCode.SHUTTING_DOWN),
                message="shmstaged stopped before the checkpoint was written",
            )
            record.persist.destination.close()
        else:
            result = future.result()
        self.store.end_job(record.session.id, record.staged, record.slot, record.persist.id)
        if result.ok:
            self.stats["saves"] += 1
            self.stats["bytes"] += result.bytes
            log.info(
                "job %d: %s written, %d bytes in %.3f s",
                result.job,
                record.persist.destination.data_file,
                result.bytes,
                result.seconds,
            )
        else:
            self.stats["failed"] += 1
            log.error("job %d failed: %s", result.job, result.message)
        self._collect(record.staged)
        if record.session.open:
            record.session.spawn(record.session.job_finished(record.persist, result))

    def status(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "instance": self.instance,
            "pid": os.getpid(),
            "uptime_seconds": time.time() - self.started,
            "shm_reserved_bytes": self.store.reserved_bytes,
            "shm_budget_bytes": self.store.limits.shm_budget_bytes,
            "clients": [
                {
                    "id": s.id,
                    "name": s.client_name,
                    "pid": s.peer.pid,
                    "uid": s.peer.uid,
                    "layouts": len(self.store.layouts_of(s.id)),
                    "segments": sum(x.segment_count for x in self.store.layouts_of(s.id)),
                    "bytes": sum(x.bytes_reserved for x in self.store.layouts_of(s.id)),
                }
                for s in self.sessions.values()
            ],
            "jobs": [
                {
                    "job": jid,
                    "client": r.session.id,
                    "bytes": r.persist.layout.nbytes,
                    "running_seconds": time.perf_counter() - r.started,
                }
                for jid, r in self.jobs.items()
            ],
            "totals": dict(self.stats),
        }


def _unlink_all(names: list[str]) -> None:
    for name in names:
        segment.unlink(name)


def bind(path: Path) -> socket.socket:
    """Bind the listening socket (mode 0660), refusing to steal one a live daemon serves."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
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
