"""The client's connection to shmstaged: requests out, frames and descriptors back.

A reader thread owns the receiving side. It routes each frame to the request that is
waiting for it (by request id) or, for ``job_done``, to the save handle's future. When the
daemon goes away the reader fails every waiter at once with DaemonLost, so no caller ever
blocks on a dead daemon; every wait also has its own timeout for a daemon that hangs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import logging
import os
import queue
import resource
import socket
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shmstage import descriptors
from shmstage.paths import (
    UntrustedDaemon,
    check_daemon,
    connect_problem,
    default_socket_path,
)
from shmstage.protocol import (
    MAX_FDS_PER_FRAME,
    PROTOCOL_VERSION,
    Connection,
    Frame,
    ProtocolError,
    Role,
)
from shmstage_client.errors import (
    DaemonLost,
    DaemonRefused,
    DaemonUnavailable,
    SaveError,
    SaveTimeout,
    SlotUnavailable,
    StagingLimitExceeded,
)

log = logging.getLogger("shmstage.client")
_RECV_BYTES = 256 * 1024
#: Socket timeout: bounds a send to a daemon that stopped reading; the reader just retries.
_IO_TIMEOUT = 30.0
_FD_POLL_SECONDS = 0.5


def refusal(code: str, message: str) -> DaemonRefused:
    if code == "no_free_slot":
        return SlotUnavailable(code, message)
    if code in ("shm_exhausted", "limit_exceeded"):
        return StagingLimitExceeded(code, message)
    return DaemonRefused(code, message)


#: Descriptors kept free for everything else the process opens while segments arrive
#: (files, sockets, CUDA, the commit's own four).
FD_HEADROOM = 32
#: Below this many descriptors per message a large layout arrives too slowly to be useful.
MIN_FDS_PER_MESSAGE = 8


def descriptor_room() -> tuple[int, int]:
    """(RLIMIT_NOFILE soft limit, descriptors open now) of this process."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd")) - 1  # listdir's own descriptor
    except OSError:
        in_use = 0
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return soft, in_use


def receivable_fds() -> int:
    """How many descriptors one message from the daemon may carry without running this
    process out of them; raises SaveError naming the limit to raise.

    Two messages' worth may be open at once: the reader receives the next batch while the
    caller maps and closes the one before (``DaemonConnection._untaken_fds``). The
    descriptor table is grown to hold them now, in one step (``descriptors``).
    """
    soft, in_use = descriptor_room()
    free = (soft - in_use - FD_HEADROOM) // 2
    if free < MIN_FDS_PER_MESSAGE:
        raise SaveError(
            f"this process has {in_use} file descriptors open and RLIMIT_NOFILE is {soft}, "
            f"too few left to receive shared-memory segments from shmstaged: raise the limit "
            f"to at least {in_use + FD_HEADROOM + 2 * MAX_FDS_PER_FRAME} (ulimit -n, or "
            "LimitNOFILE= in a systemd unit), or close descriptors this process leaks"
        )
    batch = min(MAX_FDS_PER_FRAME, free)
    descriptors.reserve(in_use + FD_HEADROOM + 2 * batch)
    return batch


def expect_fds(count: int) -> int:
    """Grow the descriptor table for ``count`` descriptors that will be kept (a lease's
    segments) and the batches they arrive in, in one step: call it before a lease, so that
    ``receivable_fds`` and ``room_for_fds`` find the room made. Growing the table of a
    multi-threaded process waits for an RCU grace period, and blocks every descriptor the
    process opens meanwhile, so one growth instead of two is what there is to win.
    Returns the table's size (unchanged where the limit leaves no room for them)."""
    soft, in_use = descriptor_room()
    if count > (soft - in_use - FD_HEADROOM) // 2 - MAX_FDS_PER_FRAME:
        return descriptors.table_size()
    return descriptors.reserve(in_use + count + FD_HEADROOM + 2 * MAX_FDS_PER_FRAME)


def room_for_fds(count: int) -> bool:
    """Whether this process can keep ``count`` more descriptors open for a while and still
    receive the daemon's batches and open files freely (at most half of what is left);
    if so, the descriptor table is grown for them now, in one step."""
    soft, in_use = descriptor_room()
    if count > (soft - in_use - FD_HEADROOM) // 2 - MAX_FDS_PER_FRAME:
        return False
    descriptors.reserve(in_use + count + FD_HEADROOM + 2 * MAX_FDS_PER_FRAME)
    return True


def _truncated_fds_message(received: int) -> str:
    """The kernel drops descriptors it cannot install: say so, not 'protocol error'."""
    soft, in_use = descriptor_room()
    return (
        f"this process ran out of file descriptors while receiving shared-memory segments "
        f"from shmstaged (got {received}; {in_use} open, RLIMIT_NOFILE {soft}): something "
        f"opened descriptors while they arrived — raise the limit (ulimit -n) to at least "
        f"{in_use + FD_HEADROOM + 2 * MAX_FDS_PER_FRAME} or find what leaks descriptors"
    )


class DaemonConnection:
    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        connect_timeout: float = 10.0,
        client_name: str = "shmstage-client",
    ) -> None:
        self.path = Path(socket_path) if socket_path is not None else default_socket_path()
        self._sock = self._connect(connect_timeout)
        self._conn = Connection(Role.CLIENT)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _waiting, _jobs, _lost, and sending
        # Descriptors handed to a waiter but not yet taken by it. The reader receives no
        # more while any are outstanding, so a layout of 20,000 segments never has more
        # than two batches of 253 open in this process (the rest wait in the socket).
        self._untaken_fds = 0
        self._fds_taken = threading.Condition(threading.Lock())
        self._waiting: dict[int, queue.Queue[Frame | BaseException]] = {}
        self._jobs: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}
        self._lost: BaseException | None = None
        self._closing = False
        self._reader = threading.Thread(target=self._read_loop, name="shmstage-reader", daemon=True)
        self._reader.start()
        welcome = self.call(
            "hello",
            {"version": PROTOCOL_VERSION, "client": client_name, "pid": os.getpid()},
            timeout=connect_timeout,
        )
        self.welcome = welcome.body

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(self.path))
            check_daemon(sock, self.path)  # before a single byte goes out
        except UntrustedDaemon as exc:
            sock.close()
            raise DaemonUnavailable(str(exc)) from None
        except OSError as exc:
            sock.close()
            raise DaemonUnavailable(connect_problem(self.path, exc)) from None
        sock.settimeout(_IO_TIMEOUT)
        return sock

    # -- receiving -------------------------------------------------------------

    def _read_loop(self) -> None:
        error: BaseException
        try:
            while True:
                self._wait_until_fds_taken()
                try:
                    data, fds, flags, _addr = socket.recv_fds(
                        self._sock, _RECV_BYTES, 253, socket.MSG_CMSG_CLOEXEC
                    )
                except TimeoutError:
                    continue
                if flags & socket.MSG_CTRUNC:
                    for fd in fds:
                        os.close(fd)
                    error = DaemonLost(_truncated_fds_message(len(fds)))
                    break
                self._conn.receive_data(data, fds)
                try:
                    while (frame := self._conn.next_frame()) is not None:
                        self._route(frame)
                except EOFError:
                    error = DaemonLost(
                        "connection closed by this client"
                        if self._closing
                        else f"shmstaged at {self.path} closed the connection (daemon stopped or "
                        "restarted)"
                    )
                    break
        except ProtocolError as exc:
            error = DaemonLost(f"shmstaged sent an invalid frame: {exc}")
        except OSError as exc:
            error = DaemonLost(
                f"connection to shmstaged at {self.path} failed: {exc.strerror or exc}"
                if not self._closing
                else "connection closed by this client"
            )
        except BaseException as exc:  # never die silently: waiters must hear about it
            error = DaemonLost(f"shmstage reader thread crashed: {exc!r}")
        self._fail_all(error)

    def _route(self, frame: Frame) -> None:
        if frame.op == "error" and frame.body.get("fatal"):
            raise_later = refusal(frame.body["code"], frame.body["message"])
            with self._lock:
                self._lost = raise_later
            self._deliver(frame)
            return
        if frame.op == "job_done":
            future = self._job_future(frame.body["job"])
            if not future.done():
                future.set_result(frame.body)
            return
        if frame.op == "committed":
            self._job_future(frame.body["job"])  # exists before the caller can wait on it
        self._deliver(frame)

    def _deliver(self, frame: Frame) -> None:
        with self._lock:
            waiter = self._waiting.get(frame.id)
        if waiter is None:
            for fd in frame.fds:
                os.close(fd)
            if frame.op == "error":
                log.warning("shmstaged: %s", frame.body.get("message"))
            return
        if frame.fds:
            with self._fds_taken:
                self._untaken_fds += len(frame.fds)
        waiter.put(frame)

    def _wait_until_fds_taken(self) -> None:
        with self._fds_taken:
            while self._untaken_fds and not self._closing:
                self._fds_taken.wait(_FD_POLL_SECONDS)

    def fds_taken(self, count: int) -> None:
        if count:
            with self._fds_taken:
                self._untaken_fds -= count
                self._fds_taken.notify_all()

    def _job_future(self, job: int) -> concurrent.futures.Future[dict[str, Any]]:
        with self._lock:
            future = self._jobs.get(job)
            if future is None:
                future = self._jobs[job] = concurrent.futures.Future()
            return future

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            if isinstance(self._lost, DaemonRefused):
                # The daemon said why it hung up (not admitted, protocol error): that reason,
                # not "connection closed", is what every waiter must hear.
                error = self._lost
            elif self._lost is None:
                self._lost = error
            waiters = list(self._waiting.values())
            jobs = list(self._jobs.values())
        for waiter in waiters:
            waiter.put(error)
        for future in jobs:
            if not future.done():
                future.set_exception(error)
        self._conn.close()

    # -- sending ---------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._lost is None and self._reader.is_alive()

    def start(
        self,
        op: str,
        body: dict[str, Any],
        fds: Sequence[int] = (),
        *,
        prepacked: Mapping[str, bytes] | None = None,
    ) -> RequestHandle:
        """Send a request; the handle yields the frames answering it. ``prepacked``: fields
        already encoded (see ``protocol.encode_frame``)."""
        waiter: queue.Queue[Frame | BaseException] = queue.Queue()
        request_id = self._send(op, body, fds, prepacked, waiter)
        return RequestHandle(self, request_id, op, waiter)

    def post(self, op: str, body: dict[str, Any]) -> None:
        """Send a message nobody answers (``report``); an error reply to it is only logged."""
        self._send(op, body, (), None, None)

    def _send(
        self,
        op: str,
        body: dict[str, Any],
        fds: Sequence[int],
        prepacked: Mapping[str, bytes] | None,
        waiter: queue.Queue[Frame | BaseException] | None,
    ) -> int:
        request_id = next(self._ids)
        with self._lock:
            if self._lost is not None:
                # A refusal the daemon sent (not admitted, ...) may arrive before our first
                # request goes out: it, not a generic "lost", is what the caller must see.
                raise (
                    self._lost
                    if isinstance(self._lost, DaemonLost | DaemonRefused)
                    else DaemonLost(str(self._lost))
                )
            if waiter is not None:
                self._waiting[request_id] = waiter
            try:
                data = self._conn.send(op, request_id, body, len(fds), prepacked=prepacked)
                if fds:
                    sent = socket.send_fds(self._sock, [data], list(fds))
                    if sent < len(data):
                        self._sock.sendall(data[sent:])
                else:
                    self._sock.sendall(data)
            except OSError as exc:
                self._waiting.pop(request_id, None)
                if isinstance(self._lost, DaemonRefused):
                    raise self._lost from None
                if exc.errno in (errno.EPIPE, errno.ECONNRESET) or isinstance(exc, TimeoutError):
                    raise DaemonLost(f"sending {op} to shmstaged failed: {exc}") from None
                raise
        return request_id

    def call(
        self, op: str, body: dict[str, Any], fds: Sequence[int] = (), *, timeout: float | None
    ) -> Frame:
        handle = self.start(op, body, fds)
        try:
            return handle.next(timeout)
        finally:
            handle.finish()

    def job_future(self, job: int) -> concurrent.futures.Future[dict[str, Any]]:
        return self._job_future(job)

    def forget_job(self, job: int) -> None:
        with self._lock:
            self._jobs.pop(job, None)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(timeout=5)
        self._sock.close()


class RequestHandle:
    def __init__(
        self,
        connection: DaemonConnection,
        request_id: int,
        op: str,
        waiter: queue.Queue[Frame | BaseException],
    ) -> None:
        self.connection = connection
        self.id = request_id
        self.op = op
        self._waiter = waiter

    def next(self, timeout: float | None) -> Frame:
        """The next frame answering this request; error frames raise."""
        try:
            item = self._waiter.get(timeout=timeout)
        except queue.Empty:
            raise SaveTimeout(
                f"shmstaged did not answer {self.op} within {timeout} s (daemon overloaded or "
                "hung: check `journalctl -u shmstaged`)"
            ) from None
        if isinstance(item, BaseException):
            raise item
        self.connection.fds_taken(len(item.fds))
        if item.op == "error":
            raise refusal(item.body["code"], item.body["message"])
        return item

    def finish(self) -> None:
        with self.connection._lock:
            self.connection._waiting.pop(self.id, None)
        while True:  # descriptors that arrived for nobody must not leak
            try:
                item = self._waiter.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Frame):
                for fd in item.fds:
                    os.close(fd)
                self.connection.fds_taken(len(item.fds))
