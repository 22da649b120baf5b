"""Fixtures of the security suite; what they build is described in sec_helpers."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import RunningDaemon, start_daemon
from sec_helpers import ATTACKER, GROUP, VICTIM, User, ensure_accounts


@pytest.fixture(scope="session")
def accounts() -> dict[str, User]:
    return ensure_accounts()


@pytest.fixture
def victim(accounts: dict[str, User]) -> User:
    return accounts[VICTIM]


@pytest.fixture
def attacker(accounts: dict[str, User]) -> User:
    return accounts[ATTACKER]


@pytest.fixture
def arena(victim: User, attacker: User) -> Iterator[Path]:
    """A world-traversable base with each user's own private checkpoint root (0700)."""
    base = Path(tempfile.mkdtemp(prefix="shmstage-sec-", dir="/tmp"))
    base.chmod(0o755)
    for user in (victim, attacker):
        home = base / user.name
        home.mkdir(mode=0o700)
        os.chown(home, user.uid, user.gid)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def shared_daemon(
    arena: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., RunningDaemon]]:
    """``shared_daemon(*flags, toml="...")``: a root daemon admitting the trainers' group,
    its socket where both users can reach it. Killed and cleaned after the test."""
    started: list[RunningDaemon] = []

    def start(*extra: str, toml: str = "", env: dict | None = None) -> RunningDaemon:
        where = arena / f"d{len(started)}"
        where.mkdir()
        where.chmod(0o755)
        config = where / "shmstaged.toml"
        config.write_text(f'[server]\nallowed_groups = ["{GROUP}"]\n{toml}')
        daemon = start_daemon(where, "--config", str(config), *extra, env=env)
        daemon.socket.chmod(0o666)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.discard()
