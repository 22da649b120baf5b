"""torch dtypes and the safetensors names they are stored under.

Only whole-byte types with a safetensors name are accepted; anything else (complex128,
float8 *fnuz variants, packed fp4, quantized types) is refused by key before any byte moves.
"""

from __future__ import annotations

import torch

_NAMES: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "complex64": "C64",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
}
TO_SAFETENSORS: dict[torch.dtype, str] = {
    getattr(torch, name): st for name, st in _NAMES.items() if hasattr(torch, name)
}
FROM_SAFETENSORS: dict[str, torch.dtype] = {st: dt for dt, st in TO_SAFETENSORS.items()}


def safetensors_name(dtype: torch.dtype) -> str | None:
    return TO_SAFETENSORS.get(dtype)


def supported() -> str:
    return ", ".join(str(dt).removeprefix("torch.") for dt in TO_SAFETENSORS)
