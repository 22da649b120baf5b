"""The security suite's shared node: real users, a victim and an attacker, both allowed to
use the daemon (fixtures in conftest.py).

The tests run as root (as the suite does here) and create three real accounts once per run:
``shmsecvictim`` and ``shmsecattacker`` (members of the group ``shmsectrain``, which the
daemon admits) and ``shmsecdaemon``, a system user to run the daemon as in the permission
tests. Where accounts cannot be created (not root, no useradd), every test here is skipped
with that reason.

Code runs as one of them the way ``tests/faults`` does it: the interpreter (under /root)
imports everything as root, then drops to the user's uid, gid and groups for good, so
SO_PEERCRED and every permission check see only that user.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import shmstage_client
import user_forks

GROUP = "shmsectrain"
VICTIM, ATTACKER, DAEMON_USER = "shmsecvictim", "shmsecattacker", "shmsecdaemon"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def ensure_accounts() -> dict[str, User]:
    if os.geteuid() != 0:
        pytest.skip("the security suite creates real users: it needs root")
    if shutil.which("useradd") is None or shutil.which("groupadd") is None:
        pytest.skip("the security suite needs useradd and groupadd to create real users")
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", GROUP], check=True, capture_output=True, timeout=60)
    made = {}
    for name, extra in ((VICTIM, ["-G", GROUP]), (ATTACKER, ["-G", GROUP]), (DAEMON_USER, [])):
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                 *extra, name],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
        entry = pwd.getpwnam(name)
        groups = tuple(sorted({entry.pw_gid, *os.getgrouplist(name, entry.pw_gid)}))
        made[name] = User(name, entry.pw_uid, entry.pw_gid, groups)
    return made


PRELUDE = """
import os, sys, json, socket, struct, time, signal, shutil, threading, fcntl, mmap
import msgpack
{client}from shmstage import protocol, segment
from shmstage.control import ControlClient
from shmstage.protocol import Connection, Role
import shmstage_daemon.main  # everything is imported while still root (see above)
os.environ.pop("XDG_RUNTIME_DIR", None)
os.setgroups({groups}); os.setgid({gid}); os.setuid({uid})
os.umask(0o022)
def say(*words):
    print(*words, flush=True)
"""


def run_as(user: User, code: str, *, timeout: float = 120, env: dict | None = None) -> str:
    """Run ``code`` as ``user``, in a process of its own; its stdout. Fails the test if it
    fails."""
    forked = None if env else user_forks.start(_program(user, code, True), _env(None))
    if forked is None:
        done = subprocess.run(
            [sys.executable, "-c", _program(user, code)],
            capture_output=True, text=True, timeout=timeout, env=_env(env),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    out, err = forked.communicate(timeout)
    assert forked.returncode == 0, err[-3000:]
    return out


def save_as(user: User, socket: object, path: str, numel: int = 8) -> str:
    """``user`` saves one tensor of ``numel`` floats through the daemon at ``socket`` to
    ``path`` and waits until it is durable; its stdout says SAVED when it was."""
    return run_as(
        user,
        f"""
        with Stager("{socket}") as stager:
            stager.save({{"w": torch.ones({numel})}}, "{path}").wait(60)
        say("SAVED")
        """,
    )


class Actor:
    """A long-running process of ``user``; its printed lines, read as they come."""

    def __init__(self, user: User, code: str, env: dict | None = None) -> None:
        forked = None if env else user_forks.start(_program(user, code, True), _env(None))
        self.proc: subprocess.Popen[str] | user_forks.Forked = forked or subprocess.Popen(
            [sys.executable, "-c", _program(user, code)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env),
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        #: What ended the reading before the pipe's end, if anything did: a test told only
        #: that a line never came would not know whether it was never printed.
        self.read_error: BaseException | None = None
        self.reading = True
        assert self.proc.stdout is not None and self.proc.stderr is not None
        #: Its stderr, drained as it comes. Never ``communicate()``: that reads stdout too,
        #: beside this actor's reader, and kept whatever lines it got (a Popen actor's last
        #: lines went missing that way, in a test process whose environment had changed).
        self._stderr = (
            self.proc.stderr
            if isinstance(self.proc, user_forks.Forked)
            else user_forks.Drained(self.proc.stderr)
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
        except BaseException as exc:
            self.read_error = exc
            raise

    def stderr(self, timeout: float = 10) -> str:
        """What it wrote to stderr, once it ended (read as it came)."""
        return self._stderr.read(timeout)

    def wait_line(self, prefix: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if line.startswith(prefix):
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        stderr = self.stderr() if self.proc.poll() is not None else ""
        raise AssertionError(f"no {prefix!r} from {self.lines[-5:]}; stderr {stderr[-2000:]}")

    def finish(self, timeout: float = 60) -> str:
        self.proc.wait(timeout)
        err = self.stderr()
        self._reader.join(30)  # to the pipe's end: at once when it ended (its last lines)
        self.reading = self._reader.is_alive()  # a process it started still holds the pipe
        assert self.proc.returncode == 0, err[-3000:]
        assert self.read_error is None, f"its output was not read to the end: {self.read_error!r}"
        return "\n".join(self.lines)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        self.proc.wait(10)

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM first, so that a daemon this actor runs removes its socket, lock file
        and journal directory as it exits; SIGKILL if it does not within ``timeout``."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


#: What code using torch, the client library or the daemon (whose lazy imports, after the
#: uid is dropped, need these loaded) gets imported first; the rest is spared importing
#: torch (~2.7 s a process here). Code that needs a name this leaves out fails with a
#: NameError or an ImportError, never passes by it.
_CLIENT_IMPORTS = "import torch\nfrom shmstage_client import *\n"
_CLIENT_NAMES = re.compile(
    r"\b(torch|shmstage_daemon|" + "|".join(map(re.escape, shmstage_client.__all__)) + r")\b"
)


def _program(user: User, code: str, everything: bool = False) -> str:
    """``everything``: import the client whatever the code names (``user_forks``' server
    has imported it already)."""
    client = _CLIENT_IMPORTS if everything or _CLIENT_NAMES.search(code) else ""
    prelude = PRELUDE.format(groups=list(user.groups), gid=user.gid, uid=user.uid, client=client)
    return prelude + textwrap.dedent(code)


def _env(extra: dict | None) -> dict:
    return user_forks.environment(extra)


def status_latency(sock: Path, user: User, seconds: float) -> Actor:
    """A process of ``user`` asking for ``status`` back to back for ``seconds``, printing the
    slowest answer: how long the event loop was unavailable to a victim."""
    return Actor(
        user,
        f"""
        worst = 0.0
        end = time.monotonic() + {seconds}
        with ControlClient("{sock}", timeout=30) as control:
            while time.monotonic() < end:
                t = time.monotonic(); control.status(); worst = max(worst, time.monotonic() - t)
                time.sleep(0.05)
        say("WORST", worst)
        """,
    )


def raw_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


DAEMON_AS = """
import ctypes, os, sys
import shmstage_daemon.main
# Modules the standard library imports lazily, while this user could still read them.
import concurrent.futures.thread, concurrent.futures.process, asyncio.unix_events
import asyncio.selector_events, selectors, multiprocessing, encodings.idna, ctypes.util
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS: keep the permitted set across setuid
{nofile}os.setgroups([]); os.setgid({gid}); os.setuid({uid})
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
header, data = Header(0x20080522, 0), (Data * 2)()
data[0].effective = data[0].permitted = {caps}  # what the unit grants, nothing else
assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
sys.exit(shmstage_daemon.main.main({argv!r}))
"""
CAP_SETUID_SETGID = (1 << 6) | (1 << 7)


def start_daemon_as(
    user: User,
    where: Path,
    *flags: str,
    caps: int = CAP_SETUID_SETGID,
    env: dict | None = None,
    nofile: int | None = None,
):
    """shmstaged as ``user`` holding only ``caps`` (the packaged unit's CAP_SETUID and
    CAP_SETGID by default), serving ``where/shmstaged.sock``; a harness RunningDaemon.
    ``nofile``: its RLIMIT_NOFILE, soft and hard (as a unit's LimitNOFILE= would set it)."""
    from harness import STARTED, RunningDaemon

    where.mkdir(parents=True, exist_ok=True)
    os.chown(where, user.uid, user.gid)
    where.chmod(0o755)
    sock = where / "shmstaged.sock"
    log_path = where.parent / f"{where.name}.log"
    argv = ["--socket", str(sock), "--log-level", "debug", *flags]
    limit = f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))\n"
    code = DAEMON_AS.format(
        uid=user.uid, gid=user.gid, caps=caps, argv=argv, nofile=limit if nofile else ""
    )
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, env=_env(env)
        )
    daemon = RunningDaemon(sock, proc, log_path)
    STARTED.append(daemon)  # discarded at the session's end whatever the test does
    offset = len(daemon.log())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = daemon.log()[offset:]
        if proc.poll() is not None:
            raise RuntimeError(f"shmstaged exited with {proc.returncode}:\n{text}")
        if "listening on" in text and "ready: serving " in text:
            daemon.instance = text.split("(instance ", 1)[1][:16]
            daemon.journal = Path(text.split(", journal ", 1)[1].split(" on ", 1)[0])
            sock.chmod(0o666)  # trainers reach it (the unit: group shmstage)
            return daemon
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"shmstaged did not start:\n{daemon.log()}")
