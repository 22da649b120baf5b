"""Soak: 8 concurrent trainer processes saving through one daemon, structures changing now
and then, tensors overwritten right after each save returns.

Every checkpoint must verify and equal its source (each worker checks its own), and after
a warm-up round has brought the daemon to its working size, a full round must leave its
RSS within 10 % of what it was, and its descriptor and segment counts exactly where they
were.

CI runs ``SHMSTAGE_SOAK_SAVES`` saves per client (default 20, well under two minutes).
The full size, 8 clients x 200 saves:

    SHMSTAGE_SOAK_SAVES=200 .venv/bin/python -m pytest tests/soak -s
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import (
    FORK_PRELOAD,
    ForkedScript,
    RunningDaemon,
    own_fork_server,
    start_daemon,
    wait_for,
)
from soak_worker import CHANGE_EVERY, STRUCTURES

from shmstage import segment

CLIENTS = 8
SAVES = int(os.environ.get("SHMSTAGE_SOAK_SAVES", "20"))
#: Every structure the workers cycle through once: the daemon's working size includes
#: each one's layouts.
WARMUP_SAVES = STRUCTURES * CHANGE_EVERY
WORKER = Path(__file__).with_name("soak_worker.py")


@pytest.fixture(autouse=True)
def fork_server() -> Iterator[None]:
    """The server the trainers are forked from (``ForkedScript``), importing torch once."""
    with own_fork_server(FORK_PRELOAD):
        yield


def round_of(daemon: RunningDaemon, root: Path, saves: int) -> float:
    """Run CLIENTS workers to completion (each a process of its own, forked from a server
    that imported torch once: see ``ForkedScript``); returns the wall time."""
    root.mkdir()
    started = time.monotonic()
    output = root.with_name(f"{root.name}-output")
    workers = [
        ForkedScript(WORKER, str(daemon.socket), str(root), str(c), str(saves), workdir=output)
        for c in range(CLIENTS)
    ]
    for worker in workers:
        out, err = worker.communicate(timeout=1800)
        assert worker.returncode == 0 and out.strip() == f"DONE {saves}", err[-3000:]
    assert os.listdir(root) == [], "every checkpoint was verified and removed"
    return time.monotonic() - started


def settled(daemon: RunningDaemon, fds: int | None = None) -> None:
    wait_for(lambda: daemon.segments() == [], 30, "the daemon's segments to go")
    wait_for(lambda: segment.list_names(daemon.instance) == [], 30, "no segment in /dev/shm")
    if fds is not None:
        wait_for(lambda: daemon.fd_count() == fds, 30, f"{fds} daemon descriptors")


def test_soak(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "d")
    try:
        fresh_rss, fresh_fds = daemon.rss_bytes(), daemon.fd_count()
        round_of(daemon, tmp_path / "warmup", WARMUP_SAVES)
        settled(daemon, fresh_fds)
        baseline_rss = daemon.rss_bytes()
        elapsed = round_of(daemon, tmp_path / "soak", SAVES)
        settled(daemon, fresh_fds)
        rss = daemon.rss_bytes()
        growth = (rss - baseline_rss) / baseline_rss
        report = (
            f"soak: {CLIENTS} clients x {SAVES} saves in {elapsed:.1f} s "
            f"({CLIENTS * SAVES / elapsed:.1f} saves/s); daemon RSS fresh {fresh_rss >> 20} "
            f"MiB, after warm-up {baseline_rss / 2**20:.1f} MiB, after soak {rss / 2**20:.1f} "
            f"MiB ({growth:+.1%}); fds {fresh_fds} -> {daemon.fd_count()}; segments 0 -> "
            f"{len(daemon.segments())}"
        )
        print("\n" + report)
        (tmp_path.parent / "soak-report.txt").write_text(report + "\n")
        assert growth < 0.10, report
        assert "Traceback" not in daemon.log()
        assert not re.search(r"job \d+ failed", daemon.log()), "a save failed"
    finally:
        assert daemon.stop() == 0
