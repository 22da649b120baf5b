"""One soak client: many saves through one Stager, checking every checkpoint it made.

    soak_worker.py SOCKET ROOT CLIENT SAVES

The structure changes every ``CHANGE_EVERY`` saves (new keys, shapes and dtypes: a new
layout registers, the old one is released), two saves are in flight at a time (two slots),
and the tensors are overwritten right after each ``save()`` returns — so a checkpoint equal
to its source proves the daemon wrote what was staged, not what the trainer did next.
Each verified checkpoint is deleted to keep the disk bounded. Prints ``DONE <n>``.
"""

from __future__ import annotations

import shutil
import sys
from collections import deque
from pathlib import Path

import torch
from shmstage_client import Stager, load

CHANGE_EVERY = 7


def state_for(client: int, step: int) -> dict:
    structure = (step // CHANGE_EVERY) % 3
    gen = torch.Generator().manual_seed(client * 100_003 + step)
    if structure == 0:
        return {"w": torch.randn(1024, 512, generator=gen), "step": step}  # 2 MiB
    if structure == 1:
        return {
            "model": {
                "a": torch.randn(1000, generator=gen),
                "b": torch.randn(64, 64, generator=gen),
            },
            "optim": [torch.randint(0, 100, (4096,), generator=gen), {"lr": 0.1 * step}],
        }
    return {f"layer{i}": torch.randn(512, generator=gen).to(torch.bfloat16) for i in range(12)}


def tensors(state: object) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in tensors(v)]
    return []


def same(a: object, b: object) -> bool:
    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        )
    if isinstance(b, dict):
        return isinstance(a, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in b)
    if isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def main() -> None:
    sock, root, client, saves = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    in_flight: deque = deque()

    def settle() -> None:
        handle, path, step = in_flight.popleft()
        handle.wait(300)
        if not same(load(path), state_for(client, step)):  # load() verifies every checksum
            raise SystemExit(f"client {client}: checkpoint {path} differs from its source")
        shutil.rmtree(path)

    with Stager(sock, slots=2) as stager:
        for step in range(saves):
            state = state_for(client, step)
            path = root / f"c{client}-{step}"
            in_flight.append((stager.save(state, path, metadata={"step": step}), path, step))
            for tensor in tensors(state):  # the trainer moves on at once
                tensor.fill_(-7)
            if len(in_flight) == 2:
                settle()
        while in_flight:
            settle()
    print(f"DONE {saves}", flush=True)


if __name__ == "__main__":
    main()
