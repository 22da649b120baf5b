"""The trainer: takes SGD steps on a small policy and publishes its weights after
every step, for rollout processes on this node (``rollout.py``).

    python examples/rl_publish/trainer.py --steps 20

Publishing stages the state dict into shmstaged's memory as a save does, but writes no
file: the copy becomes version ``step`` of channel ``policy``, visible to subscribers at
once and whole. The last version is kept ``--linger`` seconds after the last step (a
channel's versions go with their publisher).
"""

from __future__ import annotations

import argparse
import time

import torch
from policy import Policy, fingerprint
from shmstage_client import Stager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--channel", default="policy")
    parser.add_argument("--socket", default=None, help="shmstaged's socket (default: the usual)")
    parser.add_argument(
        "--linger", type=float, default=5.0, help="seconds to keep the last version"
    )
    args = parser.parse_args()

    model = Policy(seed=0)
    data = torch.Generator().manual_seed(1)
    with Stager(args.socket) as stager:
        for step in range(1, args.steps + 1):
            x = torch.randn(64, 32, generator=data)
            loss = (model(x) - x[:, :8]).pow(2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():  # plain SGD (torch.optim's first use costs seconds)
                for parameter in model.parameters():
                    parameter.sub_(parameter.grad, alpha=1e-2)
                model.step.fill_(step)

            state = model.state_dict()
            final = step == args.steps
            metadata = {"sha256": fingerprint(state), "loss": loss.item(), "final": final}
            published = stager.publish(state, args.channel, step=step, metadata=metadata)
            print(
                f"trainer: published step {step} (loss {loss.item():.4f}, stalled "
                f"{published.timings.stall_seconds * 1e3:.1f} ms, {published.subscribers} "
                "subscriber(s) told)",
                flush=True,
            )
        time.sleep(args.linger)


if __name__ == "__main__":
    main()
