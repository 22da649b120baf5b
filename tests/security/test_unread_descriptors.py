"""Descriptors the daemon passes (SCM_RIGHTS) that a peer never reads: they stay charged to
the daemon's user by the kernel (``unix_inflight``, bounded by its RLIMIT_NOFILE) until
read or until the peer's socket is gone, whatever the daemon does with its own end. One
user leaving descriptors unread — or another process of the daemon's user holding many in
flight — must never turn another user's save or restore into an error.

The daemon runs as the packaged unit runs it (a system user holding only CAP_SETUID and
CAP_SETGID, so no CAP_SYS_RESOURCE exempts it), its RLIMIT_NOFILE lowered to 1024 so that
a few connections reach the kernel's bound.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import RunningDaemon, wait_for
from sec_helpers import DAEMON_USER, GROUP, Actor, User, run_as, start_daemon_as

#: The kernel counts descriptors in flight per uid, node-wide: every packaged daemon of the
#: tests' service user (another test on another worker) adds to the count these tests
#: drive to its bound, so they run with the node-wide tests, alone (`make test`).
pytestmark = pytest.mark.node_wide

#: The daemon's descriptor limit in these tests: the kernel refuses every send of
#: descriptors once its user has more than this many unread.
NOFILE = 1024
TRUST = {"SHMSTAGE_DAEMON_USER": DAEMON_USER}

#: A raw client: frames read exactly, never a byte further (a descriptors' frame that
#: follows stays unread, its descriptors in flight).
RAW = """
import collections, termios
def exactly(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise EOFError("the daemon closed the connection")
        data += chunk
    return data
def frame(s):
    (n,) = struct.unpack(">I", exactly(s, 4))
    return msgpack.unpackb(exactly(s, n))
def connect(path):
    s = socket.socket(socket.AF_UNIX); s.settimeout(60); s.connect(path)
    conn = Connection(Role.CLIENT)
    s.sendall(conn.send("hello", 1, {"version": 2, "client": "raw", "pid": os.getpid()}))
    return s, conn
def queued(s):
    return struct.unpack("i", fcntl.ioctl(s, termios.FIONREAD, b"\\0" * 4))[0]
"""


def leave_unread(sock: Path, connections: int, hold: float = 120) -> str:
    """Open ``connections`` one after another, ask each for the user's newest checkpoint in
    memory, read only the reply frame, wait (a second at most) for the descriptors' frame
    to arrive, then send a length prefix no frame may have: the daemon ends the session
    while the segments' descriptors sit unread in the socket, which stays open."""
    return RAW + textwrap.dedent(
        f"""
        conns, answers = [], collections.Counter()
        for _ in range({connections}):
            s, conn = connect("{sock}")
            frame(s)  # welcome
            s.sendall(conn.send("latest", 2, {{"max_fds": 253}}))
            f = frame(s)
            answers[f["op"] if f["op"] != "error" else f["code"]] += 1
            deadline = time.monotonic() + 1
            while time.monotonic() < deadline and not queued(s):
                time.sleep(0.01)
            conns.append((s, conn))
        for s, conn in conns:
            try:
                s.sendall(b"\\xff\\xff\\xff\\xff")
            except OSError:  # the daemon ended this session already
                pass
        say("ANSWERS", json.dumps(answers))
        time.sleep({hold})
        """
    )


#: The attacker's checkpoint: ``count`` tensors, one segment each, held in memory.
CHECKPOINT = """
        state = {{f"t{{i}}": torch.full((16,), float(i)) for i in range({count})}}
        stager = Stager("{sock}", slots=1)
        stager.save(state, "{path}").wait(60)
        stager.close(retain=True)  # as a trainer that dies: the daemon keeps it in memory
        say("HELD")
"""

#: The victim saves (a registration: segments passed writable), restores from memory
#: (a lease: segments passed read-only) and compares every bit.
SAVE_AND_RESTORE = """
        state = {{"w": torch.randn(1 << 16, generator=torch.Generator().manual_seed(7)),
                  "b": torch.arange(7, dtype=torch.int64)}}
        with Stager("{sock}") as stager:
            for step in range(3):
                stager.save(state, "{path}-" + str(step)).wait(60)
            restored = latest(socket="{sock}")
        same = all(torch.equal(restored.state[k], state[k]) for k in state)
        say("RESTORED", restored.source, same)
"""


@pytest.fixture
def packaged(accounts: dict[str, User], arena: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """The packaged daemon, started with RLIMIT_NOFILE ``NOFILE``."""
    started: list[RunningDaemon] = []

    def start(toml: str = "") -> RunningDaemon:
        where = arena / f"run{len(started)}"
        config = arena / f"shmstaged{len(started)}.toml"
        config.write_text(f'[server]\nallowed_groups = ["{GROUP}"]\n{toml}')
        daemon = start_daemon_as(
            accounts[DAEMON_USER], where, "--config", str(config), nofile=NOFILE
        )
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.discard()


def test_descriptors_a_user_leaves_unread_cannot_fail_another_users_saves_and_restores(
    packaged, victim: User, attacker: User, arena: Path
) -> None:
    """Eight connections of the attacker each leave a lease's 253 descriptors unread (twice
    the daemon's limit of 1024 in all) and break the framing: its sessions end, their
    sockets linger, charged. The attacker is held to its share and told limit_exceeded;
    the victim saves and restores from memory bit-exact meanwhile."""
    daemon = packaged()
    out = run_as(
        attacker,
        CHECKPOINT.format(sock=daemon.socket, path=arena / attacker.name / "big", count=253),
        env=TRUST,
    )
    assert "HELD" in out
    attack = Actor(attacker, leave_unread(daemon.socket, 8), env=TRUST)
    try:
        answers = json.loads(attack.wait_line("ANSWERS", 90).split(" ", 1)[1])
        assert answers == {"leased": 8}, answers
        out = run_as(
            victim,
            SAVE_AND_RESTORE.format(sock=daemon.socket, path=arena / victim.name / "c"),
            env=TRUST,
        )
        assert "RESTORED memory True" in out, out
        try:
            wait_for(lambda: "segments not sent" in daemon.log(), 30, "the attacker refused")
        except TimeoutError:
            raise AssertionError(daemon.log()[-6000:]) from None
        log = daemon.log()
        assert f"uid {attacker.uid} already has" in log, log[-3000:]
        assert "internal" not in log and "Too many references" not in log, log[-3000:]
    finally:
        attack.kill()


def test_a_session_ended_with_descriptors_unread_still_counts_as_a_connection(
    packaged, attacker: User, arena: Path
) -> None:
    """Four connections allowed: four sessions ended with their lease's 16 descriptors
    unread still hold the four, so a fifth is refused (max_connections) until one socket
    closes."""
    daemon = packaged("[limits]\nmax_connections = 4\n")
    run_as(
        attacker,
        CHECKPOINT.format(sock=daemon.socket, path=arena / attacker.name / "small", count=16),
        env=TRUST,
    )
    out = run_as(
        attacker,
        leave_unread(daemon.socket, 4, hold=0)
        + textwrap.dedent(
            f"""
            wait_for_end = time.monotonic() + 30
            while open("{daemon.log_path}").read().count("broke the protocol") < 4:
                assert time.monotonic() < wait_for_end, "the sessions did not end"
                time.sleep(0.05)
            time.sleep(0.5)
            s, conn = connect("{daemon.socket}")
            refusal = frame(s)
            say("FIFTH", refusal.get("code"), refusal.get("message"))
            conns[0][0].close()  # the others stay open, nothing read
            time.sleep(0.5)
            s, conn = connect("{daemon.socket}")
            say("AFTER_CLOSE", frame(s)["op"])
            """
        ),
        env=TRUST,
    )
    assert "FIFTH limit_exceeded" in out and "max_connections" in out, out
    assert "AFTER_CLOSE welcome" in out, out


def test_descriptors_the_daemons_user_holds_elsewhere_are_a_clear_retryable_refusal(
    packaged, accounts: dict[str, User], victim: User, arena: Path
) -> None:
    """Another process of the daemon's user keeps 1500 descriptors in flight (over the
    daemon's 1024): the kernel refuses the daemon's sends with ETOOMANYREFS. The victim's
    save hears limit_exceeded with the cause, never "internal daemon error", and saves once
    that process is gone."""
    daemon = packaged()
    hog = Actor(
        accounts[DAEMON_USER],
        """
        import resource
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # its own bound, not ours
        a, b = socket.socketpair()
        null = os.open("/dev/null", os.O_RDONLY)
        for _ in range(6):
            socket.send_fds(a, [b"x"], [null] * 250)
        say("HOGGING")
        time.sleep(120)
        """,
    )
    try:
        hog.wait_line("HOGGING")
        out = run_as(
            victim,
            f"""
            try:
                with Stager("{daemon.socket}") as stager:
                    stager.save({{"w": torch.ones(8)}}, "{arena}/{victim.name}/c").wait(60)
                say("SAVED")
            except StagingLimitExceeded as exc:
                say("REFUSED", exc)
            """,
            env=TRUST,
        )
        assert "REFUSED" in out and "Too many references" in out and "retry" in out, out
    finally:
        hog.kill()
    log = daemon.log()
    assert "internal" not in log, log[-3000:]
    out = run_as(
        victim,
        SAVE_AND_RESTORE.format(sock=daemon.socket, path=arena / victim.name / "after"),
        env=TRUST,
    )
    assert "RESTORED memory True" in out, out
