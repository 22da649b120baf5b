"""Synthetic state dicts for the benchmark.

Real checkpoints mix a few huge tensors (embeddings, MLP weights) with thousands of tiny
ones (norms, biases); per-tensor overheads dominate the small ones and bandwidth the big
ones, so a bench with equal-sized tensors would flatter whichever method has the largest
per-tensor cost. Sizes are therefore drawn log-uniformly between a minimum and a maximum
and then scaled so that the state dict holds exactly the requested total, which lets every
method in one run move the very same bytes.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import torch

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}

# Offsets and sizes are kept multiples of this so that views of a flat host buffer are
# aligned for every dtype and the copies are not penalised by misalignment.
ALIGN = 64


def parse_size(text: str | int) -> int:
    """Parse ``8GiB``, ``4MiB``, ``1.5GB`` or a plain byte count into bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    unit = m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit in {text!r}")
    value = float(m.group(1)) * _UNITS[unit]
    return int(value)


def format_bytes(n: float) -> str:
    """Human-readable binary size, for table headers and log lines."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def resolve_dtype(name: str) -> torch.dtype:
    """Map a CLI dtype name to a torch dtype."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}") from None


def resolve_device(name: str) -> torch.device:
    """``auto`` means CUDA when present: the interesting number is the GPU→host stall."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but torch.cuda.is_available() is False")
    return torch.device(name)


def tensor_sizes(
    total_bytes: int, count: int, min_bytes: int, max_bytes: int, seed: int, align: int = ALIGN
) -> list[int]:
    """Log-uniform byte sizes in ``[min_bytes, max_bytes]`` scaled to sum to ``total_bytes``.

    Each size is a multiple of ``align``; the rounding remainder goes to the largest tensor
    so the sum is exact (the same bytes for every method, and GB/s figures that add up).
    """
    if count < 1:
        raise ValueError("need at least one tensor")
    if total_bytes < count * align:
        raise ValueError(f"total {total_bytes} B is too small for {count} tensors")
    min_bytes = max(min_bytes, align)
    max_bytes = max(max_bytes, min_bytes)
    rng = random.Random(seed)
    lo, hi = math.log(min_bytes), math.log(max_bytes)
    raw = [math.exp(rng.uniform(lo, hi)) for _ in range(count)]
    scale = total_bytes / sum(raw)
    sizes = [max(align, int(r * scale) // align * align) for r in raw]
    biggest = max(range(count), key=sizes.__getitem__)
    sizes[biggest] += total_bytes - sum(sizes)
    if sizes[biggest] < align:
        raise ValueError("could not distribute the total over the tensors; use fewer tensors")
    return sizes


@dataclass(frozen=True)
class SyntheticSpec:
    """What to build: every process that builds it gets the very same bytes."""

    total_bytes: int
    tensors: int
    min_tensor_bytes: int
    max_tensor_bytes: int
    dtype: str
    device: str
    seed: int

    def build(self) -> dict[str, torch.Tensor]:
        return build_state_dict(
            self.total_bytes,
            self.tensors,
            self.min_tensor_bytes,
            self.max_tensor_bytes,
            dtype=resolve_dtype(self.dtype),
            device=self.device,
            seed=self.seed,
        )

    def sizes(self) -> list[int]:
        """The tensors' byte sizes, without building anything."""
        itemsize = torch.empty((), dtype=resolve_dtype(self.dtype)).element_size()
        return tensor_sizes(
            self.total_bytes,
            self.tensors,
            self.min_tensor_bytes,
            self.max_tensor_bytes,
            self.seed,
            align=max(ALIGN, itemsize),
        )


def build_state_dict(
    total_bytes: int,
    count: int,
    min_bytes: int,
    max_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A deterministic state dict of ``count`` tensors holding exactly ``total_bytes``.

    Values are random rather than zeros so that no layer of the stack (a filesystem with
    compression, a sparse-aware copy) can take a shortcut that a real checkpoint would not.
    Tensors are 2-D ``[rows, 1024]`` where the size allows it, as weight matrices are.
    """
    device = torch.device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    align = max(ALIGN, itemsize)
    if total_bytes % itemsize:
        raise ValueError(f"total {total_bytes} B is not a multiple of the {itemsize}-byte dtype")
    sizes = tensor_sizes(total_bytes, count, min_bytes, max_bytes, seed, align=align)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    width = len(str(count - 1))
    for i, nbytes in enumerate(sizes):
        numel = nbytes // itemsize
        shape = (numel // 1024, 1024) if numel % 1024 == 0 and numel >= 1024 else (numel,)
        if dtype.is_floating_point:
            t = torch.randn(shape, dtype=torch.float32, device=device, generator=gen).to(dtype)
        else:
            info = torch.iinfo(dtype)
            t = torch.randint(
                max(info.min, -128),
                min(info.max, 127) + 1,
                shape,
                dtype=dtype,
                device=device,
                generator=gen,
            )
        out[f"layers.{i:0{width}d}.weight"] = t
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def state_dict_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    """Total payload bytes of a flat tensor state dict."""
    return sum(t.numel() * t.element_size() for t in state_dict.values())
