"""Each measured part of the bench runs in its own process, so nothing it does outlives it.

Peers misbehave at scale: at 10,000 tensors DCP's shared-memory stager and
nvidia-resiliency-ext leaked descriptors into the bench's process, an nvrx worker hung, and
the bench then died with EMFILE while drawing its chart — one peer took the whole report
down. So the parent process only starts children, waits for them with a deadline and draws
the report; a child that raises, crashes, hangs or leaks becomes one error row.

Children are forked from a ``forkserver`` that imported torch and the bench once and never
ran anything (``--start-method spawn`` starts each from a new interpreter instead: the same
isolation, ~2 s more per child). Each child starts its own session, so killing its process
group also ends whatever it started (nvrx's workers); its stdout and stderr go to a log file
that the parent forwards while it waits and quotes in error rows.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

#: Imported once by the fork server, so that children start in milliseconds.
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "shmstage_client",
    "shmstage_bench.peers",
    "shmstage_bench.overlapped",
    "shmstage_bench.training",
    "shmstage_bench.restore",
]

_to_parent: multiprocessing.connection.Connection | None = None


def tell_parent(message: Any) -> None:
    """From inside a child: hand ``message`` to the parent now (e.g. "checkpoint durable")."""
    if _to_parent is None:
        raise RuntimeError("tell_parent() called outside an isolated child")
    _to_parent.send(("message", message))


def raise_fd_limit() -> tuple[int, int]:
    """Soft descriptor limit up to the hard one, as a user running a big job would set it.

    Peers that pass one descriptor per tensor exhaust the default 1024 at 10,000 tensors.
    Returns the (soft, hard) limits now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def open_fds() -> int | None:
    """Descriptors this process holds, to show what a method leaked; -1 when none is left
    to count them with (EMFILE), None when they cannot be counted here."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError as exc:
        return -1 if exc.errno == errno.EMFILE else None


def _child_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: multiprocessing.connection.Connection,
    log_path: str,
) -> None:
    global _to_parent
    os.setsid()  # own process group: the parent can end us and everything we start
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    _to_parent = conn
    raise_fd_limit()
    try:
        outcome: tuple[Any, ...] = ("result", fn(*args))
    except BaseException as exc:  # everything becomes a row, never a lost report
        outcome = ("error", describe_exception(exc), traceback.format_exc(limit=-10))
    try:
        conn.send(outcome)
    except Exception as exc:  # e.g. an unpicklable result: still say what happened
        conn.send(("error", f"cannot hand back the result: {describe_exception(exc)}", ""))
    sys.stdout.flush()
    sys.stderr.flush()
    # Never run peers' exit hooks or join their stuck threads: that is how a bench hangs.
    os._exit(0)


def describe_exception(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)
    return text if len(text) <= 600 else text[:600] + "…"


@dataclass
class Outcome:
    """How a child ended: ``value`` if it returned, else ``error`` (and its log's tail)."""

    value: Any = None
    error: str = ""
    traceback: str = ""
    log_tail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error


class _LogFollower:
    """Forwards what a child writes to its log, and keeps the tail for error rows."""

    def __init__(self, path: Path, sink: TextIO | None, prefix: str) -> None:
        self.path, self.sink, self.prefix = path, sink, prefix
        self.offset = 0
        self.tail = b""
        self.partial = b""

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        self.tail = (self.tail + data)[-4000:]
        if self.sink is None or not data:
            return
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            self.sink.write(f"  {self.prefix}| {line.decode(errors='replace')}\n")
        self.sink.flush()

    def text(self) -> str:
        return self.tail.decode(errors="replace")


class Child:
    """One isolated child: started at once; ``next_message``/``result`` wait with deadlines."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        workdir: Path,
        start_method: str = "forkserver",
        sink: TextIO | None = None,
    ) -> None:
        ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(PRELOAD)
        self.name = name
        self.started = time.monotonic()
        log_path = workdir / f"{name}.{os.getpid()}.{int(self.started * 1e3)}.log"
        log_path.touch()
        self.follower = _LogFollower(log_path, sink, name)
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_child_main, args=(fn, args, child_conn, str(log_path)), name=name
        )
        self.proc.start()
        child_conn.close()
        self.log_path = log_path

    def _receive(self, deadline: float) -> tuple[Any, ...] | None:
        """The child's next frame; None when it exited without one or the deadline passed."""
        while True:
            if self._conn.poll():
                try:
                    return self._conn.recv()
                except (EOFError, OSError):
                    return None
            if not self.proc.is_alive() and not self._conn.poll():
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            multiprocessing.connection.wait(
                [self._conn, self.proc.sentinel], timeout=min(0.25, remaining)
            )
            self.follower.pump()

    def next_message(self, timeout: float) -> Any:
        """Wait for the child's next ``tell_parent`` message; raise if it ends or stalls."""
        frame = self._receive(time.monotonic() + timeout)
        self.follower.pump()
        if frame is not None and frame[0] == "message":
            return frame[1]
        if frame is not None and frame[0] == "error":
            raise RuntimeError(f"{self.name}: {frame[1]}")
        raise RuntimeError(f"{self.name}: {self._why_no_answer(timeout)}")

    def _why_no_answer(self, timeout: float) -> str:
        self.proc.join(2.0)  # its pipe closes a moment before it can be reaped
        code = self.proc.exitcode
        if code is None:
            return f"no answer after {timeout:.0f} s: hung (killed)"
        if code < 0:
            return f"process died with signal {signal.Signals(-code).name} (crashed)"
        return f"process exited with status {code} without a result"

    def result(self, timeout: float) -> Outcome:
        """Wait (bounded) for the child's result, then end its process group."""
        deadline = time.monotonic() + timeout
        frame = self._receive(deadline)
        while frame is not None and frame[0] == "message":  # late messages: not a result
            frame = self._receive(deadline)
        outcome = Outcome()
        if frame is None:
            outcome.error = self._why_no_answer(timeout)  # before kill() makes it a SIGKILL
            self.kill()
        elif frame[0] == "result":
            outcome.value = frame[1]
        else:
            outcome.error, outcome.traceback = frame[1], frame[2]
        self.kill(grace=10.0)
        self.follower.pump()
        outcome.log_tail = self.follower.text()
        outcome.seconds = time.monotonic() - self.started
        return outcome

    def kill(self, grace: float = 0.0) -> None:
        """SIGKILL the child's whole process group (after ``grace`` s for a clean exit)."""
        if grace:
            self.proc.join(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: see _child_main
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.follower.pump()

    def close(self) -> None:
        self._conn.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()


def run_isolated(
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    timeout: float,
    workdir: Path,
    start_method: str = "forkserver",
    sink: TextIO | None = None,
) -> Outcome:
    """Run ``fn(*args)`` in a child and return how it ended; never raises for the child."""
    try:
        child = Child(name, fn, args, workdir=workdir, start_method=start_method, sink=sink)
    except Exception as exc:  # e.g. the fork server could not start
        return Outcome(error=f"could not start its process: {describe_exception(exc)}")
    try:
        return child.result(timeout)
    finally:
        child.close()
