"""The rollout: follows the trainer's channel from another process and loads each new
version into its own model, checking it bit for bit against the fingerprint the trainer
put into the version's metadata.

    python examples/rl_publish/rollout.py

``wait`` wakes as soon as the trainer publishes (the daemon pushes; nothing polls) and
pins the newest version: its memory cannot be refilled while the ``with`` block holds
it, so what is loaded is that one step throughout. A rollout slower than the trainer
skips versions — it always gets the newest — and sees steps in increasing order. It
stops after the version the trainer marked final.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from policy import Policy, fingerprint
from shmstage_client import NoNewVersion, subscribe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channel", default="policy")
    parser.add_argument("--socket", default=None, help="shmstaged's socket (default: the usual)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a version")
    args = parser.parse_args()

    model = Policy(seed=1234)  # its own weights, until the first version replaces them
    seen: list[int] = []
    with subscribe(args.channel, socket=args.socket) as subscriber:
        print(f"rollout: following channel {args.channel!r}", flush=True)
        step = None
        while True:
            try:
                with subscriber.wait(newer_than=step, timeout=args.timeout) as version:
                    started = time.perf_counter()
                    model.load_state_dict(version.state(device="cpu"))
                    took = time.perf_counter() - started
                    step, metadata = version.step, version.metadata
            except NoNewVersion as exc:
                print(f"rollout: {exc}", file=sys.stderr)
                return 1
            held = fingerprint(model.state_dict())
            if held != metadata["sha256"] or int(model.step) != step:
                print(f"rollout: step {step} MISMATCH: holds {held}, model step {int(model.step)}")
                return 1
            seen.append(step)
            print(
                f"rollout: loaded step {step} in {took * 1e3:.1f} ms, checked ({held[:12]})",
                flush=True,
            )
            if metadata["final"]:
                break
    increasing = all(a < b for a, b in itertools.pairwise(seen))
    print(
        f"rollout: checked {len(seen)} versions bit-exact, steps {seen[0]}..{seen[-1]}, "
        f"{'in increasing order' if increasing else 'OUT OF ORDER'}",
        flush=True,
    )
    return 0 if increasing else 1


if __name__ == "__main__":
    sys.exit(main())
