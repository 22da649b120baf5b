"""Does setting up a slot on another thread slow a training step? Why pinning is not.

A trainer's step (bf16 matmuls, a pinned host-to-device copy, a ``.item()``-style sync) is
timed idle, then while another thread sets up one slot the way daemon and client do
(``registration_bench``'s steps, one at a time): create + fallocate, fault in, pin with
``cudaHostRegister`` in pieces of at least 16 MiB to 1 GiB on 1 to 8 threads, unpin.
Prints, per step, how long it took and the steps' median and longest time against idle.

On the H100 host (measured with the experiment this script was cleaned up from, same
steps), 8 GiB in 500 tensors: creating and faulting in slowed the step by up to
1.14x (median); pinning held the step's CUDA calls up for its whole 0.2-0.4 s whatever the
piece size or thread count, and so did unpinning — which is why the Stager pins a slot
inside the save that first fills it, never in the background.

    python3 scripts/background_setup_bench.py --size 8GiB --tensors 500
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch
from registration_bench import map_into
from shmstage_client import pinning
from shmstage_client.staging import _bytes

from shmstage import instance, segment
from shmstage.units import parse_size


class Trainer:
    """A fixed training-like step on the GPU, timed on this thread."""

    def __init__(self) -> None:
        device = torch.device("cuda")
        self.a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        self.host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
        self.batch = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        for _ in range(10):
            self.step()

    def step(self) -> float:
        started = time.perf_counter()
        c = self.a
        for _ in range(12):
            c = (c @ self.b) * 1e-4
        self.batch.copy_(self.host, non_blocking=True)
        float(c[0, 0])
        return time.perf_counter() - started

    def during(self, work: Callable[[], object]) -> tuple[float, list[float]]:
        """Step until ``work`` (on another thread) is done; its seconds and the steps'."""
        done = threading.Event()
        took = [0.0]

        def run() -> None:
            started = time.perf_counter()
            try:
                work()
            finally:
                took[0] = time.perf_counter() - started
                done.set()

        thread = threading.Thread(target=run)
        thread.start()
        steps = []
        while not done.is_set():
            steps.append(self.step())
        thread.join()
        return took[0], steps


def pieces_of(region: segment.Region, at_least: int) -> list[torch.Tensor]:
    """The slot's range cut at tensor boundaries into pieces of at least ``at_least``."""
    whole = _bytes(region.buffer(), region.size)
    cuts = [0]
    for offset in region.offsets[1:]:
        if offset - cuts[-1] >= at_least:
            cuts.append(offset)
    cuts.append(region.size)
    return [whole[start:end] for start, end in itertools.pairwise(cuts)]


def trial(trainer: Trainer, sizes: list[int], piece: int, threads: int, idle: float) -> None:
    lock = instance.InstanceLock.claim()  # no daemon reaps these segments meanwhile
    refs: list[segment.SegmentRef | None] = [None] * len(sizes)
    region = segment.Region(sizes)
    pinned = pinning.PinnedRanges()

    def show(what: str, took: float, steps: list[float]) -> None:
        median = statistics.median(steps) if steps else float("nan")
        longest = max(steps) if steps else float("nan")
        print(
            f"  {what:<36}{took:7.3f} s   step median {median * 1e3:7.1f} ms "
            f"({median / idle:4.2f}x idle), longest {longest * 1e3:7.1f} ms, {len(steps)} steps"
        )

    try:

        def create() -> None:
            def make(index: int) -> None:
                refs[index] = segment.create(lock.instance, sizes[index])

            segment.in_parallel(sizes, make, threads)

        show("create + fallocate", *trainer.during(create))
        map_into(region, refs)
        pieces = pieces_of(region, piece)
        lengths = [p.numel() for p in pieces]

        def prefault() -> None:
            segment.in_parallel(lengths, lambda i: pinning.prefault(pieces[i]), threads)

        def register() -> None:
            def pin(i: int) -> None:
                address, length = pieces[i].data_ptr(), pieces[i].numel()
                flags = pinning.HOST_REGISTER_PORTABLE
                pinning.register_range(address, length, flags, pinned._bases)

            segment.in_parallel(lengths, pin, threads)

        show("fault in", *trainer.during(prefault))
        show(f"cudaHostRegister, {len(pieces)} pieces", *trainer.during(register))
        show("cudaHostUnregister", *trainer.during(pinned.release))
    finally:
        pinned.release()
        region.close()
        for ref in refs:
            if ref is not None:
                segment.unlink(ref.name)
        lock.release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="8GiB", help="bytes of the slot")
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    total = parse_size(args.size)
    rng = random.Random(args.seed)
    weights = [rng.random() ** 3 for _ in range(args.tensors)]
    sizes = [max(4096, int(total * w / sum(weights))) for w in weights]
    sizes[-1] += total - sum(sizes)
    trainer = Trainer()
    idle = statistics.median(trainer.step() for _ in range(40))
    print(f"idle step {idle * 1e3:.1f} ms; a slot of {args.size} in {args.tensors} tensors")
    for piece, threads in ((1 << 30, 8), (64 << 20, 8), (16 << 20, 2), (64 << 20, 1)):
        print(f"pieces of >= {piece >> 20} MiB, {threads} thread(s):")
        trial(trainer, sizes, piece, threads, idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
