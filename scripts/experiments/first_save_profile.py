#!/usr/bin/env python3
"""A first save of many small tensors, part by part: the client's phases
(``SaveTimings``), the daemon's registration line (reading the layout, making segments),
and optionally cProfile of either side.

Each round starts its own shmstaged (``--daemon-profile``: under cProfile, dumped when it
stops), builds the state ``save_overhead.py`` builds, and saves it once with a new Stager;
rounds alternate between the ``--tensors`` counts. CPU only; figures are printed, never
asserted.

    .venv/bin/python scripts/experiments/first_save_profile.py --tensors 10000 --rounds 3
    .venv/bin/python scripts/experiments/first_save_profile.py --tensors 100000 \\
        --client-profile /tmp/c.prof --daemon-profile /tmp/d.prof
"""

from __future__ import annotations

import argparse
import cProfile
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from save_overhead import make_state, new_step
from shmstage_client import Stager

PARTS = ("prepare", "setup", "slot_wait", "commit", "copy")


def start_daemon(root: Path, profile: str | None) -> tuple[subprocess.Popen[bytes], str, Path]:
    socket = str(root / "shmstaged.sock")
    log_path = root / "shmstaged.log"
    log = log_path.open("wb")
    prefix = [sys.executable]
    if profile:
        prefix += ["-m", "cProfile", "-o", profile]
    command = [*prefix, "-m", "shmstage_daemon.main", "--socket", socket, "--no-fsync"]
    daemon = subprocess.Popen([*command, "--max-segments", "1000000"], stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while "ready: serving" not in log_path.read_text(errors="replace"):
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log_path.read_text(errors="replace"))
        time.sleep(0.05)
    return daemon, socket, log_path


def one(count: int, args: argparse.Namespace, round_: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="shmstage-first-"))
    daemon_profile = f"{args.daemon_profile}.{count}" if args.daemon_profile else None
    daemon, socket, log_path = start_daemon(root, daemon_profile)
    try:
        state = new_step(make_state(count, args.elements, "cpu"), 0)
        profiler = cProfile.Profile() if args.client_profile else None
        with Stager(socket, slots=2) as stager:
            if profiler is not None:
                profiler.enable()
            started = time.perf_counter()
            handle = stager.save(state, root / "ckpt")
            stall = time.perf_counter() - started
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(f"{args.client_profile}.{count}")
            handle.wait(600)
        row = {"stall": stall}
        for part in PARTS:
            row[part] = getattr(handle.timings, f"{part}_seconds")
        text = log_path.read_text(errors="replace")
        found = re.search(
            r"registered layout .* in ([0-9.]+) s \(making segments ([0-9.]+) s", text
        )
        if found:
            row["daemon_answer"] = float(found.group(1))
            row["daemon_making"] = float(found.group(2))
        return row
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(120)
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[10_000])
    parser.add_argument("--elements", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--client-profile", default=None)
    parser.add_argument("--daemon-profile", default=None)
    args = parser.parse_args()
    rows: dict[int, list[dict[str, float]]] = {count: [] for count in args.tensors}
    for round_ in range(args.rounds):
        for count in args.tensors:
            row = one(count, args, round_)
            rows[count].append(row)
            print(f"{count:>7}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row.items()))
    for count, found in rows.items():
        keys = found[0].keys()
        medians = {k: statistics.median(r[k] for r in found if k in r) for k in keys}
        print(f"{count:>7} median ms of {len(found)}: "
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
