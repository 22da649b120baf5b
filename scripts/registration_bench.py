"""Where a first save's registration time goes: create + fallocate, map, prefault, pin.

A first save (a new structure) registers its layout: the daemon creates and reserves its
segments per slot (one per tensor; small tensors of large layouts packed together,
``shmstage.packing``), the client maps them back to back, faults them in and pins
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
from collections.abc import Callable

import torch
from shmstage_client import pinning
from shmstage_client.staging import _pieces

from shmstage import instance, segment
from shmstage.packing import Packing
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
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="set up and tear down this many times in one process (on a VM whose memory "
        "grows on first use, later rounds show what a host with its memory present pays)",
    )
    parser.add_argument(
        "--no-prefault",
        action="store_true",
        help="register without faulting the pages in first (the driver faults them)",
    )
    args = parser.parse_args(argv)
    total = parse_size(args.size)
    tensors = [total // args.tensors] * args.tensors
    tensors[-1] += total - sum(tensors)
    sizes = list(Packing.of(tensors).sizes)
    gib = total / 2**30
    print(
        f"{format_size(total)} x {args.slots} slot(s) in {args.tensors} tensors "
        f"({len(sizes)} segments per slot), up to {args.threads} setup thread(s)"
        f"{', no prefault' if args.no_prefault else ''}"
    )
    for round_ in range(args.rounds):
        steps = one_round(sizes, args.slots, args.threads, not args.no_prefault)
        for name, seconds in steps.items():
            print(
                f"  round {round_ + 1}: {name:<32}{seconds:>8.3f} s "
                f"{seconds / gib:>8.3f} s/GiB of state"
            )
    return 0


def map_into(region: segment.Region, refs: list[segment.SegmentRef | None]) -> None:
    """Map every segment at its place in ``region``, as the client does (writable)."""
    for index, ref in enumerate(refs):
        assert ref is not None
        fd = segment.open_fd(ref, writable=True)
        try:
            region.map(index, fd, writable=True)
        finally:
            os.close(fd)


def one_round(sizes: list[int], slots: int, threads: int, touch: bool) -> dict[str, float]:
    """Create, map, prefault and pin ``slots`` copies of ``sizes`` the way daemon and client
    do (the client's pieces: ``staging._pieces``), then undo it all; seconds per step."""
    every = sizes * slots
    lock = instance.InstanceLock.claim()  # no daemon reaps these segments meanwhile
    refs: list[segment.SegmentRef | None] = [None] * len(every)
    regions: list[segment.Region] = []
    steps: dict[str, float] = {}
    pinned = pinning.PinnedRanges()
    try:

        def create() -> None:
            def make(index: int) -> None:
                refs[index] = segment.create(lock.instance, every[index])

            segment.in_parallel(every, make, threads)

        def map_all() -> None:
            for slot in range(slots):
                region = segment.Region(sizes)
                regions.append(region)
                map_into(region, refs[slot * len(sizes) : (slot + 1) * len(sizes)])

        pieces = []

        def prefault() -> None:
            pieces.extend(piece for region in regions for piece in _pieces(region))
            if touch:
                segment.in_parallel(
                    [piece.numel() for piece in pieces],
                    lambda i: pinning.prefault(pieces[i]),
                    threads,
                )

        def register() -> None:
            def pin(index: int) -> None:
                piece = pieces[index]
                pinning.register_range(
                    piece.data_ptr(),
                    piece.numel(),
                    pinning.HOST_REGISTER_PORTABLE,
                    pinned._bases,
                )

            segment.in_parallel([piece.numel() for piece in pieces], pin, threads)

        timed(steps, "create + fallocate (daemon)", create)
        timed(steps, "map (client)", map_all)
        timed(steps, "prefault (client)" if touch else "pieces (client)", prefault)
        if torch.cuda.is_available():
            timed(steps, "cudaHostRegister (client)", register)
        steps["total"] = sum(steps.values())
    finally:
        pinned.release()
        for region in regions:
            region.close()
        for ref in refs:
            if ref is not None:
                segment.unlink(ref.name)
        lock.release()
    return steps


if __name__ == "__main__":
    sys.exit(main())
