"""How fast a restarted trainer can bring the daemon's retained segments to the GPU.

A restore from memory reads a slot's segments (retained by the daemon: their pages exist)
through read-only descriptors — or, where the process cannot hold that many, a read-only
mapping — into pinned staging buffers and on to the device, verifying every tensor's
CRC-32C (``transfer.transfer``). This times both against the raw pinned host-to-device copy
of the same bytes, measured in the same run, on a synthetic layout held in real POSIX
segments (each run opens or maps them afresh, as a restarted process does), with the
thread count and verification varied around the defaults.

    python3 scripts/experiments/memory_read_bench.py --size 8GiB --tensors 500
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator

import crc32c
import torch
from shmstage_client.restore import host_staging, sources, transfer

from shmstage import instance, segment
from shmstage.units import format_size, parse_size


def sizes_of(total: int, count: int, seed: int) -> list[int]:
    """``count`` sizes (multiples of 64 bytes, log-uniform weights) summing to ``total``."""
    rng = random.Random(seed)
    weights = [2 ** rng.uniform(0, 16) for _ in range(count)]
    scale = total / sum(weights)
    sizes = [max(64, int(w * scale) // 64 * 64) for w in weights]
    sizes[-1] += total - sum(sizes)
    return sizes


def mapped(refs: list[segment.SegmentRef], sizes: list[int], *, writable: bool) -> segment.Region:
    """Every segment mapped back to back, as a client maps a layout or a lease."""
    region = segment.Region(sizes)
    for index, ref in enumerate(refs):
        fd = segment.open_fd(ref, writable=writable)
        try:
            region.map(index, fd, writable=writable)
        finally:
            os.close(fd)
    return region


@contextlib.contextmanager
def staged(
    sizes: list[int], seed: int
) -> Iterator[tuple[list[segment.SegmentRef], list[int], list[int]]]:
    """Segments of ``sizes``, under an instance of their own, filled with seeded random
    bytes: their refs, their offsets as a client maps them back to back, and their
    CRC-32Cs. Unlinked on leaving, whatever happened."""
    lock = instance.InstanceLock.claim()
    refs: list[segment.SegmentRef] = []
    try:
        for size in sizes:
            refs.append(segment.create(lock.instance, size))
        layout = mapped(refs, sizes, writable=True)
        crcs = []
        generator = torch.Generator().manual_seed(seed)
        for index in range(len(refs)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                view = torch.frombuffer(layout.buffer(index), dtype=torch.uint8, count=sizes[index])
            view.copy_(
                torch.randint(
                    0, 256, (min(sizes[index], 1 << 20),), dtype=torch.uint8, generator=generator
                ).repeat(-(-sizes[index] // (1 << 20)))[: sizes[index]]
            )
            crcs.append(crc32c.crc32c(memoryview(layout.buffer(index))[: sizes[index]]))
        offsets = layout.offsets
        layout.close()
        yield refs, offsets, crcs
    finally:
        for ref in refs:
            segment.unlink(ref.name)
        lock.release()


def h2d(total: int, device: torch.device) -> float:
    """Seconds of the raw pinned host-to-device copy of ``total`` bytes (the limit)."""
    chunk = min(total, 1 << 30)
    pinned = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(chunk, dtype=torch.uint8, device=device)
    target.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    begun = time.perf_counter()
    for _ in range(-(-total // chunk)):
        target.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - begun


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    device = torch.device("cuda")
    total = parse_size(args.size)
    sizes = sizes_of(total, args.tensors, args.seed)
    results: dict[str, list[float]] = {}
    started = time.perf_counter()
    with staged(sizes, args.seed) as (refs, offsets, crcs):
        created = time.perf_counter() - started
        print(f"{format_size(total)} in {len(sizes)} segments (created in {created:.2f} s)")
        placements = [
            transfer.Placement(f"t{i}", torch.uint8, (sizes[i],), offset, sizes[i], crcs[i])
            for i, offset in enumerate(offsets)
        ]

        def through_fds(threads: int, verify: bool = True) -> Callable[[], float]:
            def run() -> float:
                begun = time.perf_counter()
                fds = [segment.open_fd(ref, writable=False) for ref in refs]
                try:
                    source = sources.SegmentSource(fds, offsets, sizes, "bench")
                    transfer.transfer(source, placements, device, verify=verify, threads=threads)
                    torch.cuda.synchronize()
                    return time.perf_counter() - begun
                finally:
                    for fd in fds:
                        os.close(fd)

            return run

        def restore(threads: int, verify: bool = True) -> Callable[[], float]:
            def run() -> float:
                begun = time.perf_counter()
                region = mapped(refs, sizes, writable=False)
                try:
                    source = sources.MappedSource(region.address, region.size, "bench")
                    transfer.transfer(source, placements, device, verify=verify, threads=threads)
                    torch.cuda.synchronize()
                    return time.perf_counter() - begun
                finally:
                    region.close()

            return run

        default = host_staging.MAX_THREADS
        variants: dict[str, Callable[[], float]] = {
            "raw pinned H2D (limit)": lambda: h2d(total, device),
            f"descriptors, {default} threads (default)": through_fds(default),
            f"descriptors, {default} threads, verify=False": through_fds(default, verify=False),
            f"mapped, {default} threads": restore(default),
            "descriptors, 8 threads": through_fds(8),
        }
        for name, run in variants.items():
            try:
                results[name] = [run() for _ in range(args.repeats)]
            except Exception as exc:  # a failed variant is a row, not the end of the run
                print(f"  {name}: failed: {exc!r}")
        limit = statistics.median(results["raw pinned H2D (limit)"])
        for name, samples in results.items():
            median = statistics.median(samples)
            print(
                f"  {name:<44}{median:>8.3f} s {total / median / 1e9:>7.2f} GB/s "
                f"{median / limit:>6.2f}x limit  (samples "
                + ", ".join(f"{s:.3f}" for s in samples)
                + ")"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
