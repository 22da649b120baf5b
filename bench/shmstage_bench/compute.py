"""A fixed stand-in for a training step, to see what a checkpoint write costs the trainer.

The daemon writes from another process, but it shares the node: its gathering and checksums
take CPU time and memory bandwidth, its writes take the page cache. Timing the same fixed
work with nothing in flight and while shmstaged persists shows that cost as a ratio. On
CUDA the step is a run of bf16 matmuls (what a trainer's GPU does, plus the launch thread
it needs on the host); on CPU it is a small matmul plus a sweep over a buffer larger than
the caches, which is what the writer's memory traffic slows down.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class ComputeLoop:
    """``step()`` runs the fixed work once and returns its seconds (device synchronised)."""

    def __init__(self, device: torch.device, *, size: int | None = None, repeat: int = 8) -> None:
        self.device = device
        self.repeat = repeat
        if device.type == "cuda":
            n = size or 8192
            self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            self.sweep = None
        else:
            n = size or 256
            self.a = torch.randn(n, n)
            self.b = torch.randn(n, n)
            self.sweep = torch.ones(8 << 20)  # 32 MiB: beyond the last-level cache
        self.step()  # warm up kernels and allocations, untimed

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> float:
        self._sync()
        t0 = time.perf_counter()
        for _ in range(self.repeat):
            torch.mm(self.a, self.b)
        if self.sweep is not None:
            self.sweep.mul_(1.0000001)
        self._sync()
        return time.perf_counter() - t0

    def steps_for(self, seconds: float, *, at_least: int = 3) -> list[float]:
        """Steps for about ``seconds`` (at least ``at_least``): the idle baseline."""
        out: list[float] = []
        end = time.perf_counter() + seconds
        while len(out) < at_least or time.perf_counter() < end:
            out.append(self.step())
        return out

    def steps_while(self, busy: Callable[[], bool], *, limit: float = 600.0) -> list[float]:
        """Steps while ``busy()`` stays true (checked before each step), at most ``limit`` s."""
        out: list[float] = []
        end = time.perf_counter() + limit
        while busy() and time.perf_counter() < end:
            out.append(self.step())
        return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
