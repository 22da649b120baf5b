"""World-writable places (/dev/shm, /tmp): what another user plants there must neither stop
the daemon nor capture a victim's tensors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness import wait_for
from sec_helpers import Actor, User, run_as, save_as

from shmstage import segment


def test_a_planted_fifo_lock_neither_stops_the_daemon_nor_gc(
    shared_daemon, attacker: User, victim: User, arena: Path
) -> None:
    """Opening a FIFO O_RDONLY blocks until a writer comes: the lock reader must not."""
    fake = segment.new_instance_id()
    run_as(attacker, f'os.mkfifo("/dev/shm/shmstage.{fake}.lock"); say("PLANTED")')
    try:
        daemon = shared_daemon()  # starting at all is the point: it used to hang here
        gc = subprocess.run(
            [sys.executable, "-m", "shmstage.cli", "gc", "--dry-run"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert gc.returncode == 0, gc.stderr
        out = save_as(victim, daemon.socket, f"{arena}/{victim.name}/c")
        assert "SAVED" in out
        assert os.path.exists(f"/dev/shm/shmstage.{fake}.lock")  # another user's: left alone
    finally:
        os.unlink(f"/dev/shm/shmstage.{fake}.lock")


def test_a_squatted_fallback_socket_is_refused_by_client_and_daemon(
    attacker: User, victim: User, arena: Path
) -> None:
    """The attacker creates the victim's per-user fallback directory first and serves a
    daemon of its own there: the victim's unmodified Stager() refuses to talk to it, and
    the victim's own daemon refuses to bind inside the attacker's directory."""
    squatted = Path(f"/tmp/shmstage-{victim.uid}")
    assert not squatted.exists(), f"{squatted} exists before the test; remove it"
    impostor = Actor(
        attacker,
        f"""
        main = shmstage_daemon.main.main
        os.makedirs("{squatted}", mode=0o755)
        sys.exit(main(["--socket", "{squatted}/shmstaged.sock", "--journal-dir", "/dev/shm"]))
        """,
    )
    try:
        wait_for(lambda: (squatted / "shmstaged.sock").exists(), 30, "the impostor's socket")
        # All welcome: the mode the attacker would give its socket. Set from here (root),
        # not from a process of the attacker's that takes seconds to import torch: the
        # socket stays the attacker's either way, which is what the victim must refuse.
        os.chmod(squatted / "shmstaged.sock", 0o666)
        out = run_as(
            victim,
            """
            try:
                Stager().save({"w": torch.ones(4)}, "/nonexistent-never-written")
                say("SENT")
            except DaemonUnavailable as exc:
                say("REFUSED", exc)
            """,
            env={"SHMSTAGE_SOCKET": ""},
        )
        assert "REFUSED" in out and f"runs as uid {attacker.uid}" in out, out
        # The victim's own daemon will not serve from the attacker's directory either.
        own = Actor(
            victim,
            f"""
            main = shmstage_daemon.main.main
            sys.exit(main(["--socket", "{squatted}/mine.sock"]))
            """,
        )
        assert own.proc.wait(60) == 2
        assert f"belongs to uid {attacker.uid}" in own.stderr()
    finally:
        impostor.stop()  # a daemon: let it remove its lock file and journal
        shutil.rmtree(squatted, ignore_errors=True)  # as root: cleanup, nothing to prove
    assert arena.exists()


def test_a_socket_of_another_user_is_refused_even_when_named_explicitly(
    attacker: User, victim: User, arena: Path
) -> None:
    """$SHMSTAGE_SOCKET pointing at another user's daemon: refused before anything is sent."""
    where = arena / attacker.name
    impostor = Actor(
        attacker,
        f"""
        main = shmstage_daemon.main.main
        os.chmod("{where}", 0o755)
        sys.exit(main(["--socket", "{where}/s.sock"]))
        """,
    )
    try:
        wait_for(lambda: (where / "s.sock").exists(), 30, "the other user's socket")
        os.chmod(where / "s.sock", 0o666)
        out = run_as(
            victim,
            f"""
            try:
                Stager("{where}/s.sock")
                say("CONNECTED")
            except DaemonUnavailable as exc:
                say("REFUSED", exc)
            """,
        )
        assert "REFUSED" in out and "neither root, this user nor the shmstaged service user" in out
    finally:
        impostor.stop()  # a daemon: let it remove its lock file and journal


def test_a_daemon_starts_despite_a_squatted_journal_name(shared_daemon, attacker: User) -> None:
    """Journal directories have unguessable per-instance names: planting one for a future
    instance is impossible, and planting look-alikes changes nothing."""
    fake = segment.new_instance_id()
    run_as(attacker, f'os.mkdir("/dev/shm/shmstage.{fake}.journal"); say("PLANTED")')
    try:
        daemon = shared_daemon()
        assert daemon.journal != Path(f"/dev/shm/shmstage.{fake}.journal")
    finally:
        os.rmdir(f"/dev/shm/shmstage.{fake}.journal")
