"""Where a first save's registration time goes: create + fallocate, map, prefault, pin.

A first save (a new structure) registers its layout: the daemon creates and reserves one
segment per tensor and slot, the client maps them back to back, faults them in and pins
them with cudaHostRegister. This times each step in one process, the way daemon and client
do them (same functions), for a synthetic layout, so the steps can be compared and tuned
(``--threads`` caps the setup threads; 1 is the serial baseline). Without CUDA the pin step
is skipped. Prints seconds and seconds per GiB of state (slots x bytes are set up).

    .venv/bin/python scripts/registration_bench.py --size 8GiB --tensors 500 --slots 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable

import torch
from shmstage_client import pinning

from shmstage import instance, segment
from shmstage.units import format_size, parse_size


def timed(steps: dict[str, float], name: str, work: Callable[[], object]) -> None:
    started = time.perf_counter()
    work()
    steps[name] = time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="bytes of state (per slot)")
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--threads", type=int, default=segment.MAX_SETUP_THREADS)
    args = parser.parse_args(argv)
    total = parse_size(args.size)
    sizes = [total // args.tensors] * args.tensors
    sizes[-1] += total - sum(sizes)
    every = sizes * args.slots
    lock = instance.InstanceLock.claim()  # no daemon reaps these segments meanwhile
    refs: list[segment.SegmentRef | None] = [None] * len(every)
    regions: list[segment.Region] = []
    steps: dict[str, float] = {}
    pinned = pinning.PinnedRanges()
    try:

        def create() -> None:
            def make(index: int) -> None:
                refs[index] = segment.create(lock.instance, every[index])

            segment.in_parallel(every, make, args.threads)

        def map_all() -> None:
            for slot in range(args.slots):
                region = segment.Region(sizes)
                regions.append(region)
                for index in range(len(sizes)):
                    ref = refs[slot * len(sizes) + index]
                    assert ref is not None
                    fd = segment.open_fd(ref, writable=True)
                    try:
                        region.map(index, fd, writable=True)
                    finally:
                        os.close(fd)

        pieces: list[torch.Tensor] = []

        def prefault() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for region in regions:
                    whole = torch.frombuffer(region.buffer(), dtype=torch.uint8, count=region.size)
                    pieces.append(whole)
            segment.in_parallel(
                [piece.numel() for piece in pieces],
                lambda i: pinning.prefault(pieces[i]),
                args.threads,
            )

        timed(steps, "create + fallocate (daemon)", create)
        timed(steps, "map (client)", map_all)
        timed(steps, "prefault (client)", prefault)
        if torch.cuda.is_available():
            timed(steps, "prefault + cudaHostRegister (client)", lambda: pinned.register(pieces))
    finally:
        pinned.release()
        for region in regions:
            region.close()
        for ref in refs:
            if ref is not None:
                segment.unlink(ref.name)
        lock.release()
    gib = total / 2**30
    print(
        f"{format_size(total)} x {args.slots} slot(s) in {args.tensors} tensors, up to "
        f"{args.threads} setup thread(s)"
    )
    for name, seconds in steps.items():
        print(f"  {name:<40}{seconds:>8.3f} s {seconds / gib:>8.3f} s/GiB of state")
    return 0


if __name__ == "__main__":
    sys.exit(main())
