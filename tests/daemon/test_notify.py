"""The systemd protocol as shmstaged speaks it, observed from systemd's side of real sockets.

The test plays the service manager: it binds the AF_UNIX datagram socket that
$NOTIFY_SOCKET names and reads what the daemon sends, or hands the daemon a listening socket
the way socket activation does. Nothing on systemd's side is mocked.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from shmstage_daemon.notify import (
    Notifier,
    listen_fds,
    listen_fds_with_names,
    unix_stream_listener,
)

REPO = Path(__file__).resolve().parents[2]
CHILD_ENV = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'daemon'}", "PATH": os.environ["PATH"]}
WAIT_S = 15.0


class ServiceManager:
    """The receiving end of $NOTIFY_SOCKET, as systemd would bind it."""

    def __init__(self, address: str | bytes, env_value: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.env_value = env_value

    def receive(self, timeout: float = WAIT_S) -> str:
        self.sock.settimeout(timeout)
        return self.sock.recv(4096).decode()

    def receive_until(self, last: str, timeout: float = WAIT_S) -> list[tuple[float, str]]:
        """Every datagram (with arrival time) up to and including the one containing `last`."""
        deadline = time.monotonic() + timeout
        got: list[tuple[float, str]] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no {last!r} within {timeout} s; received {[m for _, m in got]}")
            try:
                message = self.receive(timeout=remaining)
            except TimeoutError:
                continue
            got.append((time.monotonic(), message))
            if last in message.split("\n"):
                return got


@pytest.fixture
def manager() -> Iterator[ServiceManager]:
    # Short directory: AF_UNIX paths are limited to 108 bytes and pytest's tmp_path is long.
    with tempfile.TemporaryDirectory(prefix="sdn-", dir="/tmp") as tmp:
        path = os.path.join(tmp, "notify")
        mgr = ServiceManager(path, path)
        yield mgr
        mgr.sock.close()


def test_without_notify_socket_every_call_is_a_harmless_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.ready("serving") is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False
    assert notifier.watchdog_interval() is None


def test_lifecycle_messages_reach_the_service_manager(manager: ServiceManager) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": manager.env_value})
    assert notifier.enabled

    assert notifier.ready("serving on /run/shmstage/shmstaged.sock")
    assert manager.receive() == "READY=1\nSTATUS=serving on /run/shmstage/shmstaged.sock"

    assert notifier.status("2 clients, 1 job writing")
    assert manager.receive() == "STATUS=2 clients, 1 job writing"

    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    fields = dict(line.split("=", 1) for line in manager.receive().split("\n"))
    assert fields["RELOADING"] == "1"
    # systemd matches the reload by this CLOCK_MONOTONIC timestamp in microseconds.
    assert before <= int(fields["MONOTONIC_USEC"]) <= after

    assert notifier.stopping("draining 1 job")
    assert manager.receive() == "STOPPING=1\nSTATUS=draining 1 job"
    notifier.close()


def test_a_newline_in_a_status_cannot_inject_another_assignment(manager: ServiceManager) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": manager.env_value})
    notifier.status("bad client name\nREADY=1")
    assert manager.receive() == "STATUS=bad client name READY=1"


def test_abstract_namespace_socket_is_addressed_with_a_leading_at() -> None:
    name = f"shmstage-test-{uuid.uuid4().hex}"
    mgr = ServiceManager(b"\0" + name.encode(), "@" + name)
    try:
        Notifier({"NOTIFY_SOCKET": mgr.env_value}).ready()
        assert mgr.receive() == "READY=1"
    finally:
        mgr.sock.close()


def test_a_vanished_service_manager_does_not_raise() -> None:
    notifier = Notifier({"NOTIFY_SOCKET": "/nonexistent/notify"})
    assert notifier.enabled
    assert notifier.ready() is False


def test_watchdog_interval_is_half_the_timeout_and_only_for_the_named_pid() -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000"}
    assert Notifier(env).watchdog_interval() == 15.0
    assert Notifier({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval() == 15.0
    # The variables were inherited by someone else (e.g. a child of the daemon): not ours.
    assert Notifier({**env, "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval() is None
    assert Notifier({**env, "WATCHDOG_USEC": "soon"}).watchdog_interval() is None
    assert Notifier({**env, "WATCHDOG_USEC": "0"}).watchdog_interval() is None
    # No one to ping: no watchdog even if a timeout is set.
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval() is None


def test_unset_environment_keeps_children_from_notifying(manager: ServiceManager) -> None:
    env = {"NOTIFY_SOCKET": manager.env_value, "WATCHDOG_USEC": "1000000", "OTHER": "x"}
    notifier = Notifier(env, unset_environment=True)
    assert env == {"OTHER": "x"}
    # The notifier itself still works from what it captured.
    assert notifier.watchdog_interval() == 0.5
    notifier.watchdog()
    assert manager.receive() == "WATCHDOG=1"


WATCHDOG_PROGRAM = textwrap.dedent(
    """
    import asyncio, time
    from shmstage_daemon.notify import Notifier, watchdog_loop

    async def main():
        notifier = Notifier()
        interval = notifier.watchdog_interval()
        assert interval is not None, "WATCHDOG_USEC not honoured"
        notifier.ready("serving")
        pinger = asyncio.create_task(watchdog_loop(notifier, interval))
        await asyncio.sleep(0.6)
        notifier.status("blocking")
        time.sleep(1.2)  # a bug that blocks the event loop
        notifier.status("unblocked")
        await asyncio.sleep(0.6)
        pinger.cancel()
        notifier.stopping()

    asyncio.run(main())
    """
)


def test_watchdog_pings_stop_while_the_event_loop_is_blocked(manager: ServiceManager) -> None:
    watchdog_usec = 200_000  # WatchdogSec=0.2s: pings every 0.1 s
    proc = subprocess.Popen(
        [sys.executable, "-c", WATCHDOG_PROGRAM],
        env={**CHILD_ENV, "NOTIFY_SOCKET": manager.env_value, "WATCHDOG_USEC": str(watchdog_usec)},
    )
    try:
        got = manager.receive_until("STOPPING=1")
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)

    messages = [m for _, m in got]
    assert messages[0] == "READY=1\nSTATUS=serving"
    assert messages[-1] == "STOPPING=1"
    blocked = messages.index("STATUS=blocking")
    unblocked = messages.index("STATUS=unblocked")
    pings_before = [t for t, m in got[:blocked] if m == "WATCHDOG=1"]
    pings_after = [t for t, m in got[unblocked:] if m == "WATCHDOG=1"]
    assert len(pings_before) >= 2
    assert len(pings_after) >= 2
    # Nothing pinged while the loop was stuck, so systemd would have fired: the silence is
    # far longer than WATCHDOG_USEC.
    assert unblocked == blocked + 1
    silence = pings_after[0] - pings_before[-1]
    assert silence >= 1.0 > watchdog_usec / 1e6
    # While healthy, pings come at about half the watchdog timeout.
    gaps = [b - a for a, b in itertools.pairwise(pings_after)]
    assert statistics.median(gaps) < watchdog_usec / 1e6


ACTIVATED_PROGRAM = textwrap.dedent(
    """
    import fcntl, os, sys
    from shmstage_daemon.notify import listen_fds_with_names, unix_stream_listener

    named = listen_fds_with_names()
    leftover = [k for k in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES") if k in os.environ]
    assert not leftover, f"not unset: {leftover}"
    assert [(name, s.fileno()) for name, s in named] == [("control", 3)], named
    assert fcntl.fcntl(3, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, "FD_CLOEXEC not set"
    listener = unix_stream_listener([s for _, s in named], sys.argv[1])
    assert listener is not None, [s.getsockname() for _, s in named]
    listener.settimeout(15)
    conn, _ = listener.accept()
    conn.sendall(b"served by the activated daemon")
    conn.close()
    """
)


def _connect_and_read(path: str, proc: subprocess.Popen[bytes]) -> bytes:
    deadline = time.monotonic() + WAIT_S
    while True:
        assert proc.poll() in (None, 0), f"activated program failed: rc={proc.returncode}"
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(WAIT_S)
        try:
            client.connect(path)
            return client.recv(1024)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            client.close()


def test_socket_activation_with_systemd_socket_activate() -> None:
    tool = shutil.which("systemd-socket-activate")
    if tool is None:
        pytest.skip("systemd-socket-activate not installed (apt-get install systemd)")
    with tempfile.TemporaryDirectory(prefix="sda-", dir="/tmp") as tmp:
        path = os.path.join(tmp, "ctl.sock")
        env_flags = [f"-E{k}={v}" for k, v in CHILD_ENV.items()]
        proc = subprocess.Popen(
            [tool, "-l", path, "--fdname=control", *env_flags,
             sys.executable, "-c", ACTIVATED_PROGRAM, path],
        )
        _expect_activated_service(path, proc)


def _expect_activated_service(path: str, proc: subprocess.Popen[bytes]) -> None:
    """The activated child serves one connection through the socket it was handed."""
    try:
        assert _connect_and_read(path, proc) == b"served by the activated daemon"
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)


def test_socket_activation_protocol_by_hand() -> None:
    """The same contract without systemd's tool: fd 3, LISTEN_PID of the child itself."""
    launcher = textwrap.dedent(
        """
        import os, sys
        fd = int(sys.argv[1])
        if fd != 3:
            os.dup2(fd, 3)
            os.close(fd)
        os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES="control")
        program = sys.argv[2]
        sys.argv = [sys.argv[0], *sys.argv[3:]]
        exec(program, {"__name__": "__main__"})
        """
    )
    with tempfile.TemporaryDirectory(prefix="sda-", dir="/tmp") as tmp:
        path = os.path.join(tmp, "ctl.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen()
        proc = subprocess.Popen(
            [sys.executable, "-c", launcher, str(listener.fileno()), ACTIVATED_PROGRAM, path],
            pass_fds=[listener.fileno()],
            env=CHILD_ENV,
        )
        listener.close()
        _expect_activated_service(path, proc)


def test_listen_fds_ignores_variables_meant_for_another_process() -> None:
    env = {"LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDNAMES": "control"}
    assert listen_fds(env) == []
    # Still unset, so they cannot confuse anything we start later.
    assert env == {}


def test_listen_fds_without_activation_returns_nothing() -> None:
    assert listen_fds({}) == []
    assert listen_fds_with_names({"LISTEN_PID": str(os.getpid())}) == []


def test_unix_stream_listener_picks_the_control_socket_by_path() -> None:
    with tempfile.TemporaryDirectory(prefix="sdl-", dir="/tmp") as tmp:
        control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            control.bind(os.path.join(tmp, "ctl.sock"))
            other.bind(os.path.join(tmp, "other.sock"))
            dgram.bind(os.path.join(tmp, "dgram.sock"))
            socks = [dgram, other, control]
            assert unix_stream_listener(socks, os.path.join(tmp, "ctl.sock")) is control
            assert unix_stream_listener(socks) is other
            assert unix_stream_listener([dgram]) is None
        finally:
            for s in (control, other, dgram):
                s.close()
