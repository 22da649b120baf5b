"""A small training loop that checkpoints through shmstaged, then restores and resumes.

It prints, per checkpoint, how long training stalled with shmstage versus a synchronous
``torch.save`` of the same state to the same disk, and proves the restore is bit-exact by
resuming training from the checkpoint and matching the original run's next loss.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from shmstage_client import Stager, load


def build(width: int, depth: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
               width: int) -> float:
    generator = torch.Generator().manual_seed(step)  # data depends only on the step
    x = torch.randn(32, width, generator=generator)
    y = torch.randn(32, 1, generator=generator)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def torch_save_stall(state: dict, path: Path) -> float:
    """The naive baseline: training waits for serialize + write + fsync."""
    started = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", default=None, help="shmstaged socket (default: standard)")
    parser.add_argument("--dir", type=Path, required=True, help="checkpoint directory root")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--slots", type=int, default=2)
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)

    model, optimizer = build(args.width, args.depth, seed=0)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f} M parameters; AdamW; checkpoint every {args.every} steps")
    shm_stalls, save_stalls, handles = [], [], []
    losses: dict[int, float] = {}
    with Stager(args.socket, slots=args.slots) as stager:
        for step in range(1, args.steps + 1):
            losses[step] = train_step(model, optimizer, step, args.width)
            if step % args.every:
                continue
            state = state_of(model, optimizer, step)
            started = time.perf_counter()
            handles.append(stager.save(state, args.dir / f"step-{step:06d}",
                                       metadata={"step": step}))
            shm_stalls.append(time.perf_counter() - started)
            save_stalls.append(torch_save_stall(state, args.dir / f"torch-save-{step}.pt"))
            print(f"step {step:4d}  loss {losses[step]:.5f}  stall: shmstage "
                  f"{shm_stalls[-1] * 1e3:8.1f} ms   torch.save {save_stalls[-1] * 1e3:8.1f} ms")
        results = [handle.wait(600) for handle in handles]
    last = results[-1]
    print(f"\nlast checkpoint {last.path}: {last.bytes / 2**20:.1f} MiB, durable after "
          f"{last.persist_seconds:.2f} s in the background")
    first, steady = shm_stalls[0], shm_stalls[1:] or shm_stalls
    print(f"stall per checkpoint (median): shmstage {statistics.median(steady) * 1e3:.1f} ms "
          f"(first save, incl. setup: {first * 1e3:.1f} ms) vs torch.save "
          f"{statistics.median(save_stalls) * 1e3:.1f} ms "
          f"→ {statistics.median(save_stalls) / statistics.median(steady):.1f}x less stall")

    # Restore into a fresh model and optimizer and check the resumed run matches exactly.
    restored = load(last.path)
    fresh_model, fresh_optimizer = build(args.width, args.depth, seed=123)
    fresh_model.load_state_dict(restored["model"])
    fresh_optimizer.load_state_dict(restored["optimizer"])
    resume = restored["step"]
    if resume < args.steps:
        resumed_loss = train_step(fresh_model, fresh_optimizer, resume + 1, args.width)
        same = resumed_loss == losses[resume + 1]
        print(f"restored step {resume}; resumed step {resume + 1} loss {resumed_loss:.6f} "
              f"{'==' if same else '!='} original {losses[resume + 1]:.6f}")
        if not same:
            return 1
    else:
        for key, value in model.state_dict().items():
            if not torch.equal(value, restored["model"][key]):
                print(f"restored tensor {key} differs")
                return 1
        print(f"restored step {resume}: every parameter equals the trained model's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
