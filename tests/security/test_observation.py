"""What one user learns of another through the daemon, and what a client's word is worth
(issue 32, item 10): ``status`` shows an ordinary user its own figures only, a lease of a
checkpoint the caller may not read is refused exactly as one the daemon does not hold, and
a client cannot inflate ``shmstage_restores_total`` by reporting restores it never made.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from sec_helpers import Actor, User, run_as

from shmstage.control import ControlClient

STATUS = 'say(json.dumps(ControlClient("{socket}").status()))'


def test_status_shows_an_ordinary_user_no_node_wide_figures(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """Reserved and retained bytes, leases and save totals are the node's sums over every
    user: watching them change told the attacker the size of the victim's layout and the
    moment its trainer died."""
    daemon = shared_daemon()
    holder = Actor(
        victim,
        f"""
        with Stager("{daemon.socket}") as stager:
            stager.save({{"w": torch.ones(1 << 16)}}, "{arena}/{victim.name}/run").wait(60)
            say("CONNECTED"); time.sleep(30)
        """,
    )
    try:
        holder.wait_line("CONNECTED")
        live = json.loads(run_as(attacker, STATUS.format(socket=daemon.socket)))
        everyone = ControlClient(daemon.socket).status()
        assert everyone["shm_reserved_bytes"] > 0 and everyone["totals"]["saves"] == 1
    finally:
        holder.kill()
    with ControlClient(daemon.socket) as control:  # the victim's layout is retained now
        for _ in range(100):
            if control.status()["memory"]["retained_bytes"]:
                break
            __import__("time").sleep(0.1)
        assert control.status()["memory"]["retained_bytes"] > 0
    dead = json.loads(run_as(attacker, STATUS.format(socket=daemon.socket)))
    for seen in (live, dead):
        assert seen["restricted_to_uid"] == attacker.uid
        assert seen["shm_reserved_bytes"] == 0, seen
        memory = seen["memory"]
        assert (memory["retained_bytes"], memory["retained_layouts"], memory["leases"]) == (
            0, 0, 0
        ), memory
        assert seen["totals"] == {"saves": 0, "failed": 0, "bytes": 0}, seen["totals"]
    metrics = run_as(
        attacker,
        f"""
        try:
            ControlClient("{daemon.socket}").metrics()
        except Exception as exc:
            say("REFUSED", exc)
        """,
    )
    assert "REFUSED" in metrics and "operator_groups" in metrics, metrics  # node-wide sums
    # the command line says whose figures they are
    text = run_as(
        attacker,
        f"""
        from shmstage.cli import format_status
        say(format_status(ControlClient("{daemon.socket}").status()))
        """,
    )
    assert f"uid {attacker.uid}" in text, text


def test_a_lease_of_another_users_checkpoint_is_refused_as_one_not_in_memory(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """The victim's checkpoint is world-readable on disk, so the attacker may read its files,
    but not its memory (no restore group): the refusal must not say that the daemon holds
    it, nor whose it is — it reads like the refusal of a copy the daemon never saw."""
    daemon = shared_daemon()
    shared = arena / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)
    run_as(
        victim,
        f"""
        stager = Stager("{daemon.socket}")
        stager.save({{"w": torch.ones(64)}}, "{shared}/victims").wait(60)
        os.chmod("{shared}/victims", 0o755)
        for name in os.listdir("{shared}/victims"):
            os.chmod("{shared}/victims/" + name, 0o644)
        say("SAVED")
        os._exit(0)  # a trainer that dies: its checkpoint stays in memory for a restart
        """,
    )
    with ControlClient(daemon.socket) as control:
        checkpoints = control.status()["memory"]["checkpoints"]
        assert [c["directory"] for c in checkpoints] == [f"{shared}/victims"], checkpoints
    out = run_as(
        attacker,
        f"""
        shutil.copytree("{shared}/victims", "{shared}/copy")
        for path in ("{shared}/victims", "{shared}/copy"):
            try:
                load(path, source="memory", socket="{daemon.socket}")
                say("LOADED", path)
            except CheckpointError as exc:
                say("REFUSED", str(exc).replace(path, "PATH"))
        """,
    )
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 2, out
    assert refused[0] == refused[1], out
    assert str(victim.uid) not in refused[0], out


def test_restore_reports_count_only_restores_a_session_could_have_made(
    shared_daemon, attacker: User
) -> None:
    """``restored`` is a one-way report: a client that sends a thousand of them, claiming
    memory, without ever holding a lease, adds nothing to the memory count and at most a
    few to the files count."""
    daemon = shared_daemon()
    run_as(
        attacker,
        f"""
        from shmstage import protocol
        s = socket.socket(socket.AF_UNIX); s.settimeout(30); s.connect("{daemon.socket}")
        conn = Connection(Role.CLIENT)
        s.sendall(conn.send("hello", 1, {{"version": protocol.PROTOCOL_VERSION,
                                          "client": "x", "pid": os.getpid()}}))
        for i in range(1000):
            for source in ("memory", "files"):
                s.sendall(conn.send("restored", 0, {{"source": source, "seconds": 0.1,
                                                    "bytes": 1}}))
        s.sendall(conn.send("status", 2, {{}}))
        while (f := conn.next_frame()) is None or f.op != "status":
            if f is None:
                conn.receive_data(s.recv(1 << 20), [])
        """,
    )
    metrics = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "metrics", "--socket", str(daemon.socket)],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    counts = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^shmstage_restores_total\{source="(\w+)"\} (\S+)$', metrics, re.M)
    }
    assert counts["memory"] == 0, metrics
    assert 0 < counts["files"] <= 4, metrics
