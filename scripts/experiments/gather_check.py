"""Which gathered tensors land wrong, and how: the GPU test's 100,000 mixed tensors (nine
dtypes, strided ones, an empty one) copied through ``CopyEngine`` with gathering into a slot
mapped as a save maps one, each view then compared with its source byte for byte.

For every variant (scratch bound, dtype mix, strided or not, one save or two) it prints the
tensors that differ, grouped by dtype and by where the plan put them (direct, or batch /
run / position in the run), and for the first few how: all zeros, the bytes of another
tensor, or which byte first differs. Without a daemon: the slot is memfd segments.

    PYTHONPATH=.:daemon:client:bench:tests:tests/client \
        python3 scripts/experiments/gather_check.py --tensors 100000
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / p) for p in ("tests", "tests/client")]
from gather_copy import slot  # noqa: E402  (scripts/experiments, beside this file)
from shmstage_client.save.slots import CopyEngine, device_groups  # noqa: E402
from test_gpu import _GATHER_DTYPES, _many_small, _rewrite  # noqa: E402


def where(plan: object, index: int) -> str:
    for b, batch in enumerate(plan.batches):
        for r, run in enumerate(batch.runs):
            if index in run.members:
                k = run.members.index(index)
                return f"batch {b} run {r} member {k}/{len(run.members)}"
    return "direct" if index in plan.direct else "nowhere"


def check(name: str, sources: list[torch.Tensor], bound: int, passes: int) -> None:
    mapped = slot(sources)
    views = mapped.slots[0]
    engine = CopyEngine(bound)
    groups = device_groups([t.device for t in sources])
    wanted = []
    for p in range(passes):
        if p:
            _rewrite(sources, seed=8 + p)
        torch.cuda.synchronize()
        engine.copy(views, sources, groups, mapped.layout)
        wanted = [t.detach().cpu() for t in sources]
    prepared = list(engine._gatherer._prepared.values())
    plan = prepared[0].plan if prepared else None
    bad = []
    for i, (got, want) in enumerate(zip(views, wanted, strict=True)):
        g = got.reshape(-1).view(torch.uint8) if got.numel() else got
        w = want.contiguous().reshape(-1).view(torch.uint8) if want.numel() else want
        if got.numel() and not torch.equal(g, w):
            bad.append((i, g, w))
    gathered = sum(len(r.members) for b in plan.batches for r in b.runs) if plan else 0
    print(f"== {name}: bound {bound >> 20} MiB, passes {passes}: "
          f"{len(bad)} of {len(sources)} differ ({gathered} gathered, "
          f"{len(plan.batches) if plan else 0} batches)")
    by_dtype = collections.Counter(str(sources[i].dtype) for i, _, _ in bad)
    by_kind = collections.Counter(
        "contig" if sources[i].is_contiguous() else "strided" for i, _, _ in bad)
    by_place = collections.Counter(where(plan, i).split(" member")[0].split(" run")[0]
                                   if plan else "-" for i, _, _ in bad)
    if bad:
        print("   by dtype", dict(by_dtype), "by kind", dict(by_kind))
        print("   by batch", dict(list(by_place.items())[:12]))
    for i, g, w in bad[:8]:
        diff = (g != w).nonzero()
        first = int(diff[0]) if len(diff) else -1
        zeros = bool((g == 0).all())
        print(f"   t{i}: {sources[i].dtype} {tuple(sources[i].shape)} "
              f"stride {sources[i].stride()} {where(plan, i) if plan else ''}: "
              f"{len(diff)}/{g.numel()} bytes differ, first at {first}, all zeros {zeros}, "
              f"view at {views[i].data_ptr() - views[0].data_ptr()}")
    engine.close()
    mapped.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=100_000)
    p.add_argument("--all", action="store_true", help="also each dtype alone")
    args = p.parse_args()
    mix = list(_many_small(args.tensors, seed=7).values())
    contiguous = [t.contiguous() for t in mix]
    bf16 = [t for t in contiguous if t.dtype == torch.bfloat16]
    f32 = [t for t in contiguous if t.dtype == torch.float32]
    print("dtypes:", [str(d) for d in _GATHER_DTYPES])
    check("bf16 only, contiguous", bf16, 8 << 20, 1)
    check("the test's mix", mix, 8 << 20, 1)
    check("the test's mix, two saves", mix, 64 << 20, 2)
    if args.all:
        check("f32 only, contiguous", f32, 8 << 20, 1)
        check("all dtypes, contiguous", contiguous, 8 << 20, 1)
        for d in _GATHER_DTYPES:
            check(f"{d} only", [t for t in contiguous if t.dtype == d], 8 << 20, 1)

if __name__ == "__main__":
    main()
