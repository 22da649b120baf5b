"""The deployment's permission model, with the daemon as a system user holding only
CAP_SETUID and CAP_SETGID (as the unit grants), and trainers as two ordinary users.

Checkpoints live in directories only their owner can write (0700, the usual umask 022):
the daemon still publishes atomically there, because its writer threads act with the
owner's filesystem rights; the other trainer can neither read nor delete them; and after a
crash the next daemon reopens the owner's 0644 temporary files with the owner's rights and
finishes the acknowledged checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import RunningDaemon, wait_for
from sec_helpers import DAEMON_USER, GROUP, User, run_as, start_daemon_as

from shmstage import checkpoint


@pytest.fixture
def system_daemon(accounts: dict[str, User], arena: Path) -> Iterator:
    started: list[RunningDaemon] = []
    daemon_user = accounts[DAEMON_USER]

    def start(env: dict | None = None) -> RunningDaemon:
        where = arena / "run"
        where.mkdir(exist_ok=True)
        config = arena / "shmstaged.toml"
        config.write_text(f'[server]\nallowed_groups = ["{GROUP}"]\n')
        daemon = start_daemon_as(daemon_user, where, "--config", str(config), env=env)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.discard()


TRUST = {"SHMSTAGE_DAEMON_USER": DAEMON_USER}


def test_private_directories_are_written_with_their_owners_rights(
    system_daemon, victim: User, attacker: User, arena: Path
) -> None:
    daemon = system_daemon()
    home = arena / victim.name  # 0700, the victim's; the daemon's user may not even look in
    out = run_as(
        victim,
        f"""
        with Stager("{daemon.socket}") as stager:
            stager.save({{"w": torch.arange(1000.0)}}, "{home}/run7/step-1").wait(60)
        st = os.stat("{home}/run7/step-1/model.safetensors")
        say("OWNER", st.st_uid, oct(st.st_mode & 0o777))
        """,
        env=TRUST,
    )
    assert f"OWNER {victim.uid} 0o644" in out, out
    assert checkpoint.verify(home / "run7" / "step-1") == []
    assert "hard link" not in daemon.log() and "EPERM" not in daemon.log()
    gone = run_as(
        attacker,
        f"""
        for what in ("{home}/run7/step-1", "{home}/run7/step-1/model.safetensors"):
            try:
                os.stat(what); say("SEEN", what)
            except PermissionError:
                say("DENIED")
        """,
    )
    assert "SEEN" not in gone and gone.count("DENIED") == 2


def test_a_crashed_daemon_finishes_a_private_checkpoint_with_its_owners_rights(
    system_daemon, victim: User, arena: Path
) -> None:
    """Before the model, recovery opened the owner's 0644 temporary file for writing as the
    daemon's user, got EACCES, called the file "gone" — and lost the checkpoint."""
    daemon = system_daemon(env={"SHMSTAGE_FAULT": "pause-mid-stream:60"})
    home = arena / victim.name
    out = run_as(
        victim,
        f"""
        with Stager("{daemon.socket}") as stager:
            stager.save({{"w": torch.arange(1 << 16, dtype=torch.float32),
                         "b": torch.ones(5)}}, "{home}/held")
            say("COMMITTED")
            stager.close(timeout=0.1)
        """,
        env=TRUST,
    )
    assert "COMMITTED" in out
    wait_for(lambda: "fault: pausing at mid-stream" in daemon.log(), 30, "the held job")
    daemon.kill()
    successor = system_daemon()
    wait_for(lambda: checkpoint.is_complete(home / "held"), 60, "the checkpoint")
    assert checkpoint.verify(home / "held") == []
    # the line comes after the rename that made the checkpoint complete
    wait_for(lambda: "finished job" in successor.log(), 30, "the successor's finished job")
    assert os.stat(home / "held").st_uid == victim.uid
