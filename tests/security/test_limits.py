"""Per-user limits, hostile values, privacy of status, reloads and recovery: one user cannot
take what another needs, learn what another does, or make the daemon misbehave for them."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

from harness import start_daemon, wait_for
from sec_helpers import GROUP, Actor, User, run_as

from shmstage import checkpoint

REGISTER = """
        def session(path):
            s = socket.socket(socket.AF_UNIX); s.settimeout(30); s.connect(path)
            conn = Connection(Role.CLIENT)
            s.sendall(conn.send("hello", 1, {"version": 2, "client": "x", "pid": 1}))
            return s, conn
        def frame(s, conn):
            while (f := conn.next_frame()) is None:
                data, fds, _, _ = socket.recv_fds(s, 1 << 20, 253)
                conn.receive_data(data, fds)
            for fd in f.fds:
                os.close(fd)
            return f
"""


def save_as(user: User, sock: Path, path: Path, numel: int = 1 << 16) -> str:
    return run_as(
        user,
        f"""
        with Stager("{sock}") as stager:
            stager.save({{"w": torch.full(({numel},), 7.0)}}, "{path}").wait(60)
        say("SAVED")
        """,
    )


def test_one_user_cannot_take_the_budget_with_many_connections(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """max_bytes holds for the user across 12 connections, charged in whole pages."""
    daemon = shared_daemon("--max-bytes", "16MiB")
    out = run_as(
        attacker,
        f"""
        held, refused = [], 0
        for i in range(12):
            stager = Stager("{daemon.socket}", slots=1)
            try:
                stager.save({{"w": torch.ones(1 << 20)}}, "{arena}/{attacker.name}/c" + str(i))
                held.append(stager)
            except StagingLimitExceeded as exc:
                refused += 1
                last = str(exc)
        say("HELD", len(held), "REFUSED", refused)
        say("WHY", last)
        # 1-byte tensors are charged a page each: 5,000 of them are ~20 MiB, not 5 KB.
        tiny = {{f"t{{i}}": torch.ones(1, dtype=torch.uint8) for i in range(5000)}}
        try:
            Stager("{daemon.socket}", slots=1).save(tiny, "{arena}/{attacker.name}/tiny")
            say("TINY ACCEPTED")
        except StagingLimitExceeded:
            say("TINY REFUSED")
        """,
    )
    assert "HELD 4 REFUSED 8" in out, out  # 4 MiB each, in 16 MiB
    assert "for all its connections together" in out and "TINY REFUSED" in out
    assert "SAVED" in save_as(victim, daemon.socket, arena / victim.name / "c", 1 << 20)


def test_prepared_commits_cannot_fill_the_journal(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """Commits sent ahead of a copy that never comes: at most max_prepared per user, each
    charged to its journal bytes, each dropped after its deadline; the victim commits."""
    daemon = shared_daemon("--max-prepared", "2")
    out = run_as(
        attacker,
        REGISTER
        + f"""
        from shmstage_client.save.destination import open_target
        stager = Stager("{daemon.socket}", slots=4)
        stager.save({{"w": torch.ones(4)}}, "{arena}/{attacker.name}/first").wait(60)
        mapped = stager._layouts.current
        answers = []
        for i in range(4):  # prepared, and never "ready"
            slot = stager._connection.call(
                "acquire", {{"layout": mapped.id, "wait": False, "timeout": None}}, timeout=30
            ).body["slot"]
            target = open_target("{arena}/{attacker.name}/p" + str(i), "model.safetensors")
            body = {{"layout": mapped.id, "slot": slot, "data_file": "model.safetensors",
                    "file_metadata": {{}}, "metadata": {{}}, "tree": {{"T": "w"}},
                    "ready": False, **target.wire()}}
            try:
                reply = stager._connection.call("commit", body, target.fds(), timeout=30)
                answers.append(reply.op)
            except SaveError as exc:
                answers.append(str(exc))
        say("ANSWERS", json.dumps(answers))
        """,
    )
    answers = json.loads(out.split("ANSWERS ", 1)[1])
    assert answers[:2] == ["prepared", "prepared"], answers
    assert all("max_prepared" in a for a in answers[2:]), answers
    assert "SAVED" in save_as(victim, daemon.socket, arena / victim.name / "c")


def test_hostile_values_are_refused_escaped_or_bounded(
    shared_daemon, attacker: User, victim: User, arena: Path
) -> None:
    """A float tag that overflows, a client name that forges log lines, a stall of 1e308
    seconds, a 30 MiB dtype echoed into the errors everybody's status carries."""
    daemon = shared_daemon()
    out = run_as(
        attacker,
        REGISTER
        + f"""
        evil = socket.socket(socket.AF_UNIX); evil.connect("{daemon.socket}")
        greeting = Connection(Role.CLIENT)
        evil.sendall(greeting.send("hello", 1, {{"version": 2, "pid": 1,
                     "client": "evil\\n2026-01-01 INFO shmstaged: forged line"}}))
        frame(evil, greeting)
        """
        + f"""
        s, conn = session("{daemon.socket}")
        frame(s, conn)
        s.sendall(conn.send("register", 2, {{"tensors": [["w", "D" * (30 << 20), [1], None]]}}))
        say("DTYPE", frame(s, conn).body["code"])
        stager = Stager("{daemon.socket}", slots=1)
        stager.save({{"w": torch.ones(4)}}, "{arena}/{attacker.name}/c").wait(60)
        layout = stager._layouts.current.id
        r = stager._connection.call("acquire", {{"layout": layout, "wait": False,
                                     "timeout": None}}, timeout=30)
        try:
            stager._connection.call("commit", {{"layout": layout, "slot": r.body["slot"],
                "data_file": "model.safetensors", "data_tmp": "x", "manifest_tmp": "y",
                "tree": {{"f": "0x1p99999"}}, "metadata": {{}}, "file_metadata": {{}},
                "stage_seconds": 1e308}}, [], timeout=30)
        except SaveError as exc:
            say("COMMIT", exc.code)
        """,
    )
    assert "DTYPE bad_request" in out and "COMMIT bad_request" in out, out
    log = daemon.log()
    assert "evil\\n2026-01-01 INFO shmstaged: forged line" in log, log[-2000:]
    assert "\n2026-01-01 INFO shmstaged: forged line" not in log
    assert "internal" not in log
    status = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "status", "--json", "--socket", str(daemon.socket)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0 and len(status.stdout) < 64 << 10
    metrics = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "metrics", "--socket", str(daemon.socket)],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    sums = [line for line in metrics.splitlines() if "_sum" in line and not line.startswith("#")]
    assert sums and all(math.isfinite(float(line.split()[-1])) for line in sums), sums


def test_status_shows_a_user_only_its_own(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    daemon = shared_daemon()
    holder = Actor(
        victim,
        f"""
        with Stager("{daemon.socket}") as stager:
            stager.save({{"w": torch.ones(4)}}, "{arena}/{victim.name}/secret-run").wait(60)
            say("CONNECTED"); time.sleep(30)
        """,
    )
    try:
        holder.wait_line("CONNECTED")
        seen = json.loads(
            run_as(attacker, f'say(json.dumps(ControlClient("{daemon.socket}").status()))')
        )
        assert seen["restricted_to_uid"] == attacker.uid
        assert all(c["uid"] == attacker.uid for c in seen["clients"])
        assert "secret-run" not in json.dumps(seen)
        everything = json.loads(
            subprocess.run(
                [sys.executable, "-m", "shmstage.cli", "status", "--json", "--socket",
                 str(daemon.socket)],
                capture_output=True, text=True, timeout=60,
            ).stdout
        )  # fmt: skip
        assert any(c["uid"] == victim.uid for c in everything["clients"])  # root sees all
    finally:
        holder.kill()


def test_a_reload_that_removes_a_user_ends_its_sessions(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    daemon = shared_daemon()
    config = daemon.socket.parent / "shmstaged.toml"
    lingering = Actor(
        attacker,
        REGISTER
        + f"""
        s, conn = session("{daemon.socket}")
        frame(s, conn)
        say("CONNECTED")
        try:
            f = frame(s, conn)
            say("TOLD", f.body.get("code"), f.body.get("message"))
        except Exception as exc:
            say("TOLD", type(exc).__name__)
        """,
    )
    lingering.wait_line("CONNECTED")
    config.write_text(f'[server]\nallowed_users = ["{victim.name}"]\n')
    daemon.proc.send_signal(signal.SIGHUP)
    told = lingering.wait_line("TOLD", 30)
    assert "not_allowed" in told and "no longer allowed" in told, told
    try:
        assert "SAVED" in save_as(victim, daemon.socket, arena / victim.name / "c")
    except AssertionError:
        raise AssertionError(daemon.log()[-4000:]) from None
    config.write_text(f'[server]\nallowed_groups = ["{GROUP}"]\n')


def test_a_fifo_planted_under_a_journaled_name_does_not_block_recovery(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """Both users' checkpoints are acknowledged and held mid-stream when the daemon is
    killed; the attacker swaps its own temporary data file for a FIFO. The restarted daemon
    serves, finishes the victim's checkpoint bit-exact, and gives up only the attacker's."""
    daemon = shared_daemon(env={"SHMSTAGE_FAULT": "pause-mid-stream:60"})
    savers = [
        Actor(
            user,
            f"""
            with Stager("{daemon.socket}") as stager:
                stager.save({{"w": torch.full((1 << 16,), 5.0), "b": torch.ones(3)}},
                            "{arena}/{user.name}/c")
                say("COMMITTED"); time.sleep(60)
            """,
        )
        for user in (victim, attacker)
    ]
    for saver in savers:
        saver.wait_line("COMMITTED")
    wait_for(lambda: daemon.log().count("fault: pausing at mid-stream") == 2, 30, "both held")
    daemon.kill()
    for saver in savers:
        saver.kill()
    run_as(
        attacker,
        f"""
        root = "{arena}/{attacker.name}"
        for pending in os.listdir(root):  # the job's, and the spare made after the save
            for name in os.listdir(f"{{root}}/{{pending}}"):
                if name.startswith(".model.safetensors."):
                    os.unlink(f"{{root}}/{{pending}}/{{name}}")
                    os.mkfifo(f"{{root}}/{{pending}}/{{name}}")
        say("PLANTED")
        """,
    )
    where = daemon.socket.parent
    successor = start_daemon(
        where, "--config", str(where / "shmstaged.toml"), log_name="successor.log"
    )
    successor.socket.chmod(0o666)
    try:
        try:
            wait_for(lambda: checkpoint.is_complete(arena / victim.name / "c"), 60, "the victim's")
        except TimeoutError:
            raise AssertionError(successor.log()[-3000:]) from None
        assert checkpoint.verify(arena / victim.name / "c") == []
        try:
            wait_for(lambda: "could not finish" in successor.log(), 60, "the attacker's")
        except TimeoutError:
            raise AssertionError(successor.log()[-3000:]) from None
        assert "is gone" in successor.log()  # the FIFO is not the file the attacker made
        assert "SAVED" in save_as(victim, successor.socket, arena / victim.name / "after")
    finally:
        successor.proc.kill()
        successor.proc.wait(10)
    assert os.path.exists(arena)


#: A raw client of the daemon that keeps the segments' descriptors it is sent (the client
#: library maps and closes them), writable, as any client may.
KEEPING = """
        from shmstage_client.connection import DaemonConnection  # (Stager's plumbing)
        from shmstage_client.save.destination import open_target
        conn = DaemonConnection("{sock}")
        def register(tensors):
            handle = conn.start("register", {{"tensors": tensors, "slots": 1, "max_fds": 64}})
            reply = handle.next(30)
            fds = []
            while len(fds) < reply.body["segments"]:
                fds += handle.next(30).fds
            handle.finish()
            return reply.body["layout"], fds
        def sizes(fds):
            return [(os.fstat(fd).st_size, os.fstat(fd).st_blocks * 512) for fd in fds]
        def commit_filled(layout, fds, directory, **extra):
            os.pwrite(fds[0], b"\\x01" * 4096, 0)
            slot = conn.call("acquire", {{"layout": layout, "wait": False, "timeout": None}},
                             timeout=30).body["slot"]
            target = open_target(directory, "model.safetensors")
            body = {{"layout": layout, "slot": slot, "data_file": "model.safetensors",
                    "file_metadata": {{}}, "metadata": {{}}, "tree": {{"T": "w"}},
                    **extra, **target.wire()}}
            return slot, conn.call("commit", body, target.fds(), timeout=30).body["job"]
"""


def test_a_released_layouts_memory_is_freed_though_its_client_kept_the_descriptors(
    shared_daemon, attacker: User
) -> None:
    """Unlinking alone frees nothing while descriptors remain: the daemon truncates the
    segments it gives back, so 32 MiB stays charged to nobody for no time at all."""
    daemon = shared_daemon()
    out = run_as(
        attacker,
        KEEPING.format(sock=daemon.socket)
        + """
        layout, fds = register([["w", "F32", [8 << 20], None]])
        say("HELD", sizes(fds))
        conn.call("release", {"layout": layout}, timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(blocks for _, blocks in sizes(fds)):
            time.sleep(0.05)
        say("KEPT", sizes(fds))
        """,
    )
    assert f"HELD [({32 << 20}, {32 << 20})]" in out, out
    assert "KEPT [(0, 0)]" in out, out


def test_a_segment_its_client_truncates_fails_only_that_checkpoint_with_a_clear_error(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """The attacker commits a slot and truncates one of its segments before the write
    starts: that job fails saying so (not "an I/O error of the storage device"); the
    daemon and the victim's saves carry on."""
    daemon = shared_daemon()
    out = run_as(
        attacker,
        KEEPING.format(sock=daemon.socket)
        + f"""
        layout, fds = register([["w", "F32", [1024], None]])
        slot, job = commit_filled(layout, fds, "{arena}/{attacker.name}/cut", ready=False)
        os.ftruncate(fds[0], 100)  # while the job waits for "ready": its slot is persisting
        conn.call("ready", {{"layout": layout, "slot": slot, "job": job}}, timeout=30)
        done = conn.job_future(job).result(60)
        say("DONE", done["ok"], done["result"]["code"], done["result"]["message"])
        """,
    )
    assert "DONE False bad_request" in out, out
    assert "was resized by a process holding its descriptor (expected 4096 bytes, found 100)" in (
        out
    )
    assert "I/O error" not in out
    assert "SAVED" in save_as(victim, daemon.socket, arena / victim.name / "c")
    assert "internal" not in daemon.log()


#: The daemon's periodic size check every second (default 10 s): the tests that wait for
#: it wait a second, not ten.
SIZE_CHECKS = ("--size-check-interval", "1")


def test_a_segment_its_client_grows_is_put_back_to_its_size(
    shared_daemon, attacker: User
) -> None:
    """A writable descriptor can grow its segment and fill the growth: memory no limit
    counts. The daemon's periodic check truncates it back to the size it made."""
    daemon = shared_daemon(*SIZE_CHECKS)
    out = run_as(
        attacker,
        KEEPING.format(sock=daemon.socket)
        + """
        layout, fds = register([["w", "F32", [1024], None]])
        os.ftruncate(fds[0], 64 << 20)
        os.posix_fallocate(fds[0], 0, 64 << 20)
        say("GROWN", sizes(fds))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sizes(fds)[0] != (4096, 4096):
            time.sleep(0.02)
        say("NOW", sizes(fds))
        """,
    )
    assert f"GROWN [({64 << 20}, {64 << 20})]" in out, out
    assert "NOW [(4096, 4096)]" in out, out
    assert "was resized by a process holding its descriptor" in daemon.log()


def test_a_checkpoint_whose_segment_its_owner_truncated_is_not_leased_from_memory(
    shared_daemon, attacker: User, arena: Path
) -> None:
    """A reader maps the segments it leases: one its owner truncated would fault past the
    new end. The daemon refuses to lease it (not_retained: read the files) and, once it has
    grown it back with zeros, holds no checkpoint in it any more."""
    daemon = shared_daemon(*SIZE_CHECKS)
    out = run_as(
        attacker,
        KEEPING.format(sock=daemon.socket)
        + f"""
        from shmstage_client.errors import DaemonRefused
        layout, fds = register([["w", "F32", [1024], None]])
        _, probe = register([["p", "F32", [1024], None]])
        slot, job = commit_filled(layout, fds, "{arena}/{attacker.name}/held")
        say("DONE", conn.job_future(job).result(60)["ok"])
        # Truncated just after a size check (seen putting back a grown probe), so that the
        # lease below comes a second before the next check, not racing it.
        os.ftruncate(probe[0], 8192)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sizes(probe)[0][0] != 4096:
            time.sleep(0.01)
        os.ftruncate(fds[0], 100)
        for when in ("now", "later"):
            reader = DaemonConnection("{daemon.socket}")
            handle = reader.start("latest", {{"max_fds": 64}})
            try:
                while (frame := handle.next(30)).op != "lease_fds":  # "leased" first
                    pass
                say("LEASED", when)
            except DaemonRefused as exc:
                say("REFUSED", when, exc.code, exc.message)
            handle.finish()
            reader.close()
            # The daemon's size check (every second here) puts it back: wait for that.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and sizes(fds)[0] != (4096, 4096):
                time.sleep(0.02)
            time.sleep(0.5)  # the loop drops the held checkpoint just after the size is back
        say("SIZE", sizes(fds))
        """,
    )
    assert "DONE True" in out, out
    assert "REFUSED now not_retained" in out and "resized it" in out, out
    assert "REFUSED later not_retained" in out, out
    assert "SIZE [(4096, 4096)]" in out, out
