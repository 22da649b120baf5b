"""The example of issue 35 runs as its README says: a trainer publishing every step and a
separate rollout process loading each version into its own model and checking it bit for
bit — both real processes, on a real daemon."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from harness import RunningDaemon

EXAMPLE = Path(__file__).parents[2] / "examples" / "rl_publish"
STEPS = 8


def test_the_rollout_loads_and_checks_the_trainers_versions_in_increasing_order(
    daemon: RunningDaemon,
) -> None:
    socket = ["--socket", str(daemon.socket)]
    # Both start at once: a rollout that subscribes first waits for the first version,
    # one that subscribes later starts from the newest.
    rollout = subprocess.Popen(
        [sys.executable, str(EXAMPLE / "rollout.py"), *socket, "--timeout", "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        trainer = subprocess.run(
            [sys.executable, str(EXAMPLE / "trainer.py"), *socket, "--steps", str(STEPS),
             "--linger", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        told, _ = rollout.communicate(timeout=60)
    finally:
        rollout.kill()
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert trainer.stdout.count("trainer: published step") == STEPS
    assert rollout.returncode == 0, told
    assert "MISMATCH" not in told
    summary = re.search(r"checked (\d+) versions bit-exact, steps (\d+)\.\.(\d+), (.*)", told)
    assert summary, told
    assert int(summary[3]) == STEPS  # the final version reached it
    assert summary[4] == "in increasing order"
    loaded = [int(s) for s in re.findall(r"loaded step (\d+) ", told)]
    assert loaded == sorted(set(loaded)) and len(loaded) == int(summary[1])
