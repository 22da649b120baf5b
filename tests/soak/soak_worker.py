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
STRUCTURES = 3


def state_for(client: int, step: int) -> dict:
    structure = (step // CHANGE_EVERY) % STRUCTURES
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


def difference(got: object, expected: object, client: int, step: int) -> str:
    """Which leaves differ, and what they hold instead: the trainer's overwrite (-7), another
    step's values, or something else, so that a failure says where to look."""
    got_leaves, want_leaves = tensors(got), tensors(expected)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} tensors, expected {len(want_leaves)}; got {got!r:.300}"
    parts = []
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        if same(a, b):
            continue
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        wrong = (flat_a != flat_b).nonzero().reshape(-1) if a.shape == b.shape else None
        where = "shape" if wrong is None else f"{wrong.numel()}/{flat_b.numel()} elements"
        first = "" if wrong is None or not wrong.numel() else f" from #{int(wrong[0])}"
        overwrite = bool(wrong is not None and wrong.numel() and (flat_a[wrong] == -7).all())
        others = [
            s
            for s in range(max(0, step - 3), step + 4)
            if s != step and any(same(a, t) for t in tensors(state_for(client, s)))
        ]
        parts.append(
            f"leaf {i} ({b.dtype}{list(b.shape)}): {where} differ{first}"
            + (", all -7 (the trainer's overwrite)" if overwrite else "")
            + (f", equal to step {others}" if others else "")
        )
    return "; ".join(parts) or f"non-tensor values differ: {got!r:.300} vs {expected!r:.300}"


def main() -> None:
    sock, root, client, saves = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    in_flight: deque = deque()

    def settle() -> None:
        handle, path, step = in_flight.popleft()
        handle.wait(300)
        restored = load(path, with_info=True)  # load() verifies every checksum
        expected = state_for(client, step)
        if not same(restored.state, expected):
            raise SystemExit(
                f"client {client}: checkpoint {path} (read from {restored.source}) differs "
                f"from its source: {difference(restored.state, expected, client, step)}"
            )
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
