"""One user floods the daemon — descriptors, memory, connections, requests it never reads —
while a victim saves: the victim's acknowledged checkpoint publishes bit-exact, its new
saves succeed, the event loop stays responsive and the watchdog is never missed.

Bounds asserted while the attacker does its worst: the victim's slowest ``status`` answer
(the loop's availability) under 1 s, the daemon's RSS under 400 MiB, watchdog pings (every
1 s, WatchdogSec 2 s) never more than 2 s apart.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sec_helpers import Actor, User, run_as, save_as, status_latency

from shmstage import checkpoint

#: Pings every 1 s; a gap past 2 s is a miss. Tight enough to catch the loop held for a
#: second, loose enough that a 2-core machine under a CPU hog, shared with the attackers,
#: measures the daemon and not the scheduler (1 s gave gaps of 1.1 s there).
WATCHDOG_USEC = 2_000_000


class Watchdog:
    """systemd's end of $NOTIFY_SOCKET: records when each WATCHDOG=1 arrives."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.pings: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                message = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            if "WATCHDOG=1" in message.split("\n"):
                self.pings.append(time.monotonic())

    def worst_gap(self, since: float) -> float:
        times = [since, *[t for t in self.pings if t >= since], time.monotonic()]
        return max(b - a for a, b in itertools.pairwise(times))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def watched(shared_daemon, arena: Path) -> Iterator[tuple]:
    """A daemon with a systemd watchdog (2 s), a low descriptor limit, a checkpoint hold."""
    watchdog = Watchdog(arena / "notify.sock")
    daemon = shared_daemon(
        "--max-buffered-bytes", "64MiB",
        env={
            "NOTIFY_SOCKET": str(arena / "notify.sock"),
            "WATCHDOG_USEC": str(WATCHDOG_USEC),
            "SHMSTAGE_FAULT": "pause-mid-stream:4@1",  # the victim's first job, mid-stream
        },
    )  # fmt: skip
    try:
        yield daemon, watchdog
    finally:
        watchdog.close()


def test_descriptor_floods_cannot_fail_an_acknowledged_checkpoint(
    watched, victim: User, attacker: User, arena: Path
) -> None:
    """Each connection sends a length byte carrying 253 descriptors, 80 connections at once:
    the daemon takes at most 8 descriptors per receive (the kernel drops the rest), ends
    those sessions, and admits at most 64 connections of the user."""
    daemon, watchdog = watched
    held = Actor(
        victim,
        f"""
        state = {{"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(7)}}
        with Stager("{daemon.socket}", slots=2) as stager:
            held = stager.save(state, "{arena}/{victim.name}/held")
            say("COMMITTED")
            held.wait(120)
            say("DURABLE")
            stager.save({{"w": torch.full((1000,), 3.0)}}, "{arena}/{victim.name}/after").wait(120)
            say("AFTER")
        """,
    )
    held.wait_line("COMMITTED")
    daemon.wait_log("fault: pausing at mid-stream")
    started = time.monotonic()
    latency = status_latency(daemon.socket, victim, 4)
    out = run_as(
        attacker,
        f"""
        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(253)]
        conns, refused = [], 0
        for _ in range(80):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            try:
                s.connect("{daemon.socket}")
                socket.send_fds(s, [b"\\x00"], fds)
                conns.append(s)
            except OSError:
                refused += 1
        time.sleep(1)
        closed = 0
        for s in conns:
            try:
                closed += s.recv(65536) == b"" or 0
            except OSError:
                closed += 1
        say("SENT", len(conns), "REFUSED", refused)
        """,
    )
    assert "SENT" in out
    held.wait_line("DURABLE", 120)
    held.wait_line("AFTER", 120)
    assert checkpoint.verify(arena / victim.name / "held") == []
    assert checkpoint.verify(arena / victim.name / "after") == []
    worst = float(latency.wait_line("WORST", 60).split()[1])
    assert worst < 1.0, f"the loop was unavailable for {worst:.2f} s"
    assert watchdog.worst_gap(started) <= WATCHDOG_USEC / 1e6
    log = daemon.log()
    assert "more than 8 descriptors at once" in log
    assert "internal error" not in log


def test_memory_floods_are_bounded(watched, victim: User, attacker: User, arena: Path) -> None:
    """Frames parked almost complete on 20 connections, 31 MiB hellos, a frame of tiny maps
    that decodes 30x: the daemon refuses each at its bound, and its RSS stays bounded."""
    daemon, watchdog = watched
    baseline = daemon.rss_bytes()
    started = time.monotonic()
    latency = status_latency(daemon.socket, victim, 6)
    attack = Actor(
        attacker,
        f"""
        def connect():
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect("{daemon.socket}")
            conn = Connection(Role.CLIENT)
            s.sendall(conn.send("hello", 1, {{"version": 2, "client": "x", "pid": 1}}))
            return s
        parked = []
        head = msgpack.packb({{"op": "commit", "id": 2, "nfds": 0}})
        for _ in range(20):  # 31 MiB frames, all but the last byte sent
            s = connect()
            try:
                rest = b"\\x00" * ((31 << 20) - len(head) - 1)
                s.sendall(struct.pack(">I", 31 << 20) + head + rest)
                parked.append(s)
            except OSError:
                pass
        for _ in range(4):  # 31 MiB hellos
            s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect("{daemon.socket}")
            try:
                s.sendall(struct.pack(">I", 31 << 20) + msgpack.packb({{"op": "hello", "id": 1}}))
                s.sendall(b"\\x00" * (1 << 20))
            except OSError:
                pass
        tiny = b"\\x80" * (2 << 20)  # two million empty maps in a register
        body = b"\\x84" + msgpack.packb({{"op": "register", "id": 3, "nfds": 0}})[1:]
        body += msgpack.packb("tensors") + b"\\xdd" + struct.pack(">I", 2 << 20) + tiny
        s = connect()
        try:
            s.sendall(struct.pack(">I", len(body)) + body)
        except OSError:
            pass
        say("FLOODED", len(parked))
        time.sleep(3)
        """,
    )
    attack.wait_line("FLOODED", 120)
    peak = daemon.rss_bytes()
    saved = save_as(victim, daemon.socket, f"{arena}/{victim.name}/c", numel=1 << 20)
    assert "SAVED" in saved
    attack.finish(60)
    worst = float(latency.wait_line("WORST", 60).split()[1])
    assert worst < 1.0, f"the loop was unavailable for {worst:.2f} s"
    assert watchdog.worst_gap(started) <= WATCHDOG_USEC / 1e6
    assert peak - baseline < 400 << 20, f"RSS grew by {(peak - baseline) >> 20} MiB"
    log = daemon.log()
    assert "max_buffered_bytes" in log
    assert "only commit, publish, register may exceed" in log
    assert "decodes to more than" in log
    assert "internal error" not in log


def test_connections_are_limited_per_user_and_idle_ones_dropped(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """80 connections of one user: 64 admitted, the rest told which limit; one that never
    says hello is dropped within 10 s; the victim connects and saves meanwhile."""
    daemon = shared_daemon()
    flood = Actor(
        attacker,
        f"""
        held, refusals = [], []
        for _ in range(80):
            s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect("{daemon.socket}")
            held.append(s)
        for s in held:
            s.setblocking(False)

        def take_refusals():
            for s in held:
                if s in refusals:
                    continue
                try:
                    if b"max_connections" in s.recv(65536):
                        refusals.append(s)
                except BlockingIOError:
                    pass

        deadline = time.monotonic() + 20  # a loaded daemon answers the last ones late
        while True:
            take_refusals()
            if len(refusals) >= 16 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        time.sleep(0.5)  # any refusal beyond the 16 expected would show by now
        take_refusals()
        say("REFUSED", len(refusals))
        idle = held[0]
        idle.setblocking(True); idle.settimeout(30)
        t = time.monotonic()
        while idle.recv(65536):
            pass
        say("IDLE_DROPPED_AFTER", time.monotonic() - t)
        """,
    )
    try:
        refused = int(flood.wait_line("REFUSED", 60).split()[1])
        assert refused == 80 - 64, flood.lines
        saved = save_as(victim, daemon.socket, f"{arena}/{victim.name}/c")  # while they linger
        assert "SAVED" in saved
        out = flood.finish(60)
    finally:
        flood.kill()
    assert "IDLE_DROPPED_AFTER " in out, f"{out!r}; pipe still open: {flood.reading}"
    dropped = float(out.split("IDLE_DROPPED_AFTER ")[1].split()[0])
    assert dropped < 15, out
    assert "no hello within 10 s" in daemon.log()
