"""Is the first device-to-host copy into freshly registered shared memory slower than the
next ones, and does reading it to the device once first take that away?

The training scenario's first save after ``reserve()`` copied 7.29 GiB in 0.166 s against
0.146-0.147 s for every later save into the same (already pinned) slots. This times, for
fresh shared-memory regions prefaulted and registered with CUDA as ``reserve()`` leaves
them: three device-to-host copies in a row (a); the same after one host-to-device read of
the region (b); and a cudaHostAlloc buffer for reference (raw). Each case on a region of
its own, in alternating rounds.

    python3 scripts/experiments/first_copy_gpu.py --gib 4 --rounds 3

H100 VM, 2026-11-27 00:10 UTC, 4 GiB, 3 rounds: every copy 0.078 s, the first into a fresh
region as fast as the third and as the cudaHostAlloc buffer; a read first changed nothing.
So a fresh registration is not why the training scenario's first save copied slower.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time

import torch

REGISTER_PORTABLE = 0x01


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def _fresh(size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A shared mapping written once (as the daemon's segments are) and registered."""
    region = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
    host = torch.frombuffer(region, dtype=torch.uint8)
    host.zero_()
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    err = torch.cuda.cudart().cudaHostRegister(address, size, REGISTER_PORTABLE)
    assert int(err) == 0, err
    return region, host


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    size = int(args.gib * (1 << 30))
    source = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    scratch = torch.empty(size, dtype=torch.uint8, device="cuda")
    raw = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    results: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        results.setdefault("raw", []).append(_timed(lambda: raw.copy_(source, non_blocking=True)))
        for case in ("a", "b"):
            _case(case, size, source, scratch, results)
    for name, values in results.items():
        rounded = [round(value, 4) for value in values]
        print(f"{name:14} median {statistics.median(values):.4f} s  {rounded}")


def _case(
    case: str,
    size: int,
    source: torch.Tensor,
    scratch: torch.Tensor,
    results: dict[str, list[float]],
) -> None:
    """One fresh region: (b only) one read to the device, then three copies into it."""
    region, host = _fresh(size)
    if case == "b":
        read = _timed(lambda: scratch.copy_(host, non_blocking=True))
        results.setdefault("b read first", []).append(read)
    for n in (1, 2, 3):
        copy = _timed(lambda: host.copy_(source, non_blocking=True))
        results.setdefault(f"{case} copy {n}", []).append(copy)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    torch.cuda.cudart().cudaHostUnregister(address)


if __name__ == "__main__":
    main()
