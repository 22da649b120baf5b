"""A trainer process for the fault tests, to be SIGKILLed at a chosen moment.

    trainer.py SOCKET ROOT MODE SEED

It first saves ``ROOT/base`` (one tensor, waited for: the "earlier checkpoint" that must
survive), then ``ROOT/victim`` from ``make_state(SEED)`` and stops at MODE's moment, printing
a marker line the test waits for before it kills this process:

- ``copy``: inside the copy into shared memory, after the first tensor (``COPYING``);
- ``steps``: as training does, ``ROOT/step-1`` of the same structure first (waited for,
  ``STEP-1``), then as ``copy``;
- ``commit``: right after ``save()`` returned, tensors already overwritten (``COMMITTED``);
- ``commit-grown``: as ``commit``, once the victim's layout also has its second slot (a
  trainer that has been saving a while has all its slots; a first save sets up one);
- ``wait``: blocked in ``handle.wait()`` (``WAITING``);
- ``slot-wait``: with one slot, blocked acquiring it for ``ROOT/victim2`` while ``victim``
  still persists (``ACQUIRING``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fault_helpers import make_state, single_tensor_state
from shmstage_client import Stager


def say(marker: str) -> None:
    print(marker, flush=True)


def main() -> None:
    sock, root, mode, seed = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    stager = Stager(sock, slots=1 if mode == "slot-wait" else 2)
    stager.save(single_tensor_state(seed), root / "base").wait(60)
    stager._spares.ready(60)  # the victim takes the spare: no other pending directory is left
    say("BASE")
    state = make_state(seed)
    if mode == "steps":
        stager.save(make_state(seed + 1), root / "step-1").wait(60)
        say("STEP-1")
        mode = "copy"
    if mode == "copy":
        copier = stager._copier  # the test hook: stall inside the copy, half done
        copy = copier.copy

        def half_then_stall(destinations, sources, *rest):  # type: ignore[no-untyped-def]
            copy(destinations[:1], sources[:1])
            say("COPYING")
            time.sleep(300)

        copier.copy = half_then_stall
        stager.save(state, root / "victim")
        raise SystemExit("the copy was meant to stall")
    handle = stager.save(state, root / "victim")
    for tensor in state["layers"]:  # the daemon owns the staged bytes now
        tensor.fill_(-1.0)
    if mode == "commit-grown":
        stager._layouts.current.growth.result(60)
        mode = "commit"
    if mode == "commit":
        say(f"COMMITTED {handle.job}")
        time.sleep(300)
    elif mode == "wait":
        say("WAITING")
        handle.wait(300)
    elif mode == "slot-wait":
        say("ACQUIRING")
        stager.save(make_state(seed + 1), root / "victim2")
    raise SystemExit(f"mode {mode} was meant to be killed before this")


if __name__ == "__main__":
    main()
