"""Fixtures for tests that kill and restart daemons: every daemon started is reaped after."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import RunningDaemon, start_daemon

from shmstage import instance, segment


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """``daemons(**start_daemon kwargs)`` starts one on ``tmp_path/d`` (same socket each
    time, so a second call is a restart); all are killed and their leftovers removed."""
    started: list[RunningDaemon] = []

    def start(*extra: str, where: Path | None = None, **kwargs: object) -> RunningDaemon:
        kwargs.setdefault("log_name", f"shmstaged-{len(started)}.log")
        running = start_daemon(where or tmp_path / "d", *extra, **kwargs)  # type: ignore[arg-type]
        started.append(running)
        return running

    yield start
    for running in started:
        if running.proc.poll() is None:
            running.proc.kill()
            running.proc.wait(10)
    for running in started:
        for name in segment.list_names(running.instance):
            segment.unlink(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(instance.lock_path(running.instance))


@pytest.fixture
def world() -> Iterator[Path]:
    """A directory other uids can traverse (pytest's tmp_path lives under a 0700 one)."""
    if os.geteuid() != 0:
        pytest.skip("tests with another uid need root")
    base = Path(tempfile.mkdtemp(prefix="shmstage-world-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    subprocess.run(["chattr", "-R", "-i", str(base)], capture_output=True, timeout=30)
    shutil.rmtree(base, ignore_errors=True)
