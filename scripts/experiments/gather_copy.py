"""The save's copy alone, without a daemon: N small CUDA tensors into a slot mapped and pinned
as a save maps one (memfd segments in one region, laid out by the layout's packing),
through ``CopyEngine`` with gathering at several scratch bounds (0: off, one copy per
tensor) beside ``torch._foreach_copy_`` into the same pinned views (the bench's raw copy)
and one copy of as many bytes from one device buffer (the link's limit).
Prints the median wall time per copy, the device memory the copies added, and, with
``--profile``, where a steady gathered copy spends its host time.

    PYTHONPATH=.:daemon:client:bench python3 scripts/experiments/gather_copy.py \
        --tensors 100000 --min-bytes 1KiB --max-bytes 64KiB --bounds 0,8MiB,64MiB,64MiB/2
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from shmstage_bench.synthetic import parse_size
from shmstage_client.dtypes import TO_SAFETENSORS
from shmstage_client.save.gather import Gatherer
from shmstage_client.save.slots import CopyEngine, MappedLayout, device_groups

from shmstage.layout import Layout, TensorSpec


def state(count: int, low: int, high: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [
        torch.empty(max(1, n // dtype.itemsize), dtype=dtype, device="cuda").normal_()
        for n in sizes
    ]


def slot(tensors: list[torch.Tensor]) -> MappedLayout:
    layout = Layout.of(
        TensorSpec(f"t{i}", TO_SAFETENSORS[t.dtype], tuple(t.shape)) for i, t in enumerate(tensors)
    )
    mapped = MappedLayout.receiving(1, layout, 1)
    mapped.pin = True
    fds = []
    for size in layout.packing().sizes:
        fd = os.memfd_create("shmstage-gather-copy")
        os.ftruncate(fd, max(size, 1))
        fds.append(fd)
    mapped.add_segments(fds)
    mapped.complete()
    mapped.prefault_slot(0, 4)
    mapped.mark_ready()
    mapped.pin_slot(0)
    assert 0 in mapped.pinned, "the slot could not be pinned"
    return mapped


def timed(copy: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        torch.cuda.synchronize()  # CopyEngine.copy returns when its bytes landed: no-op then
        times.append(time.perf_counter() - start)
    return times


def whole_copy(total: int, repeats: int) -> list[float]:
    """Seconds of one device-to-host copy of ``total`` bytes into pinned memory, repeated."""
    device_bytes = torch.empty(total, dtype=torch.uint8, device="cuda")
    host_bytes = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    return timed(partial(host_bytes.copy_, device_bytes, non_blocking=True), repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=100_000)
    p.add_argument("--min-bytes", type=parse_size, default=parse_size("1KiB"))
    p.add_argument("--max-bytes", type=parse_size, default=parse_size("64KiB"))
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument(
        "--bounds",
        default="0,8MiB,64MiB,64MiB/2",
        help="scratch bounds to time; BOUND/2: in two buffers, gathers on their own stream",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    sources = state(args.tensors, args.min_bytes, args.max_bytes, dtype, 0)
    total = sum(t.numel() * t.itemsize for t in sources)
    mapped = slot(sources)
    views = mapped.slots[0]
    groups = device_groups([t.device for t in sources])
    segments = len(mapped.layout.packing())
    print(f"{args.tensors} tensors, {total / 2**30:.3f} GiB, {segments} segments")

    def raw() -> None:
        torch._foreach_copy_(views, sources, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    times = whole_copy(total, args.repeats + 1)[1:]
    print(f"bytes limit, one D2H of them all: median {statistics.median(times):.4f} s")
    times = timed(raw, args.repeats + 1)[1:]
    raw_median = statistics.median(times)
    print(f"raw _foreach_copy_: median {raw_median:.4f} s  {[f'{t:.4f}' for t in times]}")
    for text in args.bounds.split(","):
        size, _, buffers = text.partition("/")
        bound = parse_size(size)
        engine = CopyEngine(bound)
        if buffers:  # the gathers on a stream of their own, into alternating buffers
            engine._gatherer = Gatherer(bound, int(buffers))
        torch._foreach_add_(sources, 1.0)  # new bytes: the check below sees this copy's
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        engine.copy(views, sources, groups, mapped.layout)
        first = time.perf_counter() - start
        times = timed(partial(engine.copy, views, sources, groups, mapped.layout), args.repeats)
        peak = torch.cuda.max_memory_allocated() - before
        step = max(1, len(views) // 1000)
        for got, want in zip(views[::step], sources[::step], strict=True):
            assert torch.equal(got.view(torch.uint8), want.cpu().view(torch.uint8))
        median = statistics.median(times)
        print(
            f"gather bound {text:>6}: first {first:.4f} s, steady median {median:.4f} s "
            f"({median / raw_median:.2f}x raw), device memory +{peak / 2**20:.1f} MiB  "
            f"{[f'{t:.4f}' for t in times]}"
        )
        if args.profile and bound:
            profile = cProfile.Profile()
            profile.enable()
            engine.copy(views, sources, groups, mapped.layout)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)
        engine.close()
    mapped.close()


if __name__ == "__main__":
    main()
