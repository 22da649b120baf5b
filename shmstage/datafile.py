"""The safetensors data file: an 8-byte little-endian header length, a JSON header, raw data.

The header is padded with spaces so tensor data starts on a 4096-byte boundary (readers may
then map or O_DIRECT-read it aligned). Offsets are contiguous with no gaps, which the real
safetensors library requires.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from shmstage.layout import DTYPE_SIZES, RESERVED_KEY, Layout

SUFFIX: Final = ".safetensors"
DATA_ALIGNMENT: Final = 4096
#: safetensors itself refuses headers over 100 MB; so do we, before allocating.
MAX_HEADER_BYTES: Final = 100_000_000
_U64 = struct.Struct("<Q")


class DataFileError(ValueError):
    """A data file is not what its manifest or the safetensors format says it should be."""


def build_header(layout: Layout, metadata: Mapping[str, str] | None = None) -> bytes:
    """The complete header prefix (length + padded JSON) for a layout's data file.

    The JSON is what ``json.dumps`` makes of the header's dict with compact separators and
    ``ensure_ascii=False``, written tensor by tensor: building 10,000 entries' dicts for it
    was most of the 30 ms a first commit of a 10,000-tensor layout spent on its header, on
    the daemon's event loop."""
    parts = []
    if metadata:
        strings = {str(k): str(v) for k, v in metadata.items()}
        parts.append(_string(RESERVED_KEY) + ":" + json.dumps(strings, **_COMPACT))
    for spec, (begin, end) in zip(layout.tensors, layout.data_offsets(), strict=True):
        shape = ",".join(map(str, spec.shape))
        parts.append(
            f'{_string(spec.key)}:{{"dtype":"{spec.dtype}","shape":[{shape}],'
            f'"data_offsets":[{begin},{end}]}}'
        )
    text = ("{" + ",".join(parts) + "}").encode("utf-8")
    padded = -(-(len(text) + _U64.size) // DATA_ALIGNMENT) * DATA_ALIGNMENT - _U64.size
    return _U64.pack(padded) + text + b" " * (padded - len(text))


_COMPACT: Final[dict[str, Any]] = {"separators": (",", ":"), "ensure_ascii": False}
#: A JSON string literal, as ``json.dumps(..., ensure_ascii=False)`` writes one.
_string: Final = json.encoder.encode_basestring


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


@dataclass(frozen=True, slots=True)
class Header:
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]


def parse_header(prefix: bytes, file_size: int) -> Header:
    """Parse and bounds-check a header; ``prefix`` must hold at least the header bytes."""
    if len(prefix) < _U64.size:
        raise DataFileError("file is shorter than the 8-byte safetensors header length")
    (length,) = _U64.unpack_from(prefix)
    if length > MAX_HEADER_BYTES or _U64.size + length > file_size:
        raise DataFileError(f"header length {length} is impossible for a {file_size}-byte file")
    if len(prefix) < _U64.size + length:
        raise DataFileError("header is truncated")
    try:
        raw = json.loads(prefix[_U64.size : _U64.size + length].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataFileError(f"header is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise DataFileError("header is not a JSON object")
    data_start = _U64.size + length
    metadata = raw.pop(RESERVED_KEY, None) or {}
    tensors: dict[str, TensorEntry] = {}
    for key, info in raw.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise DataFileError(f"tensor {key!r}: malformed header entry") from exc
        if dtype not in DTYPE_SIZES:
            raise DataFileError(f"tensor {key!r}: unknown dtype {dtype!r}")
        expected = DTYPE_SIZES[dtype]
        for dim in shape:
            expected *= dim
        if not 0 <= begin <= end or end - begin != expected:
            raise DataFileError(f"tensor {key!r}: data_offsets {[begin, end]} do not fit its shape")
        if data_start + end > file_size:
            raise DataFileError(f"tensor {key!r}: data runs past the end of the file")
        tensors[key] = TensorEntry(dtype, shape, data_start + begin, data_start + end)
    return Header(data_start, metadata, tensors)


def header_length(first_eight: bytes) -> int:
    """Bytes to read to hold the whole header, from the file's first eight bytes."""
    if len(first_eight) < _U64.size:
        raise DataFileError("file is shorter than the 8-byte safetensors header length")
    (length,) = _U64.unpack_from(first_eight)
    if length > MAX_HEADER_BYTES:
        raise DataFileError(f"header length {length} exceeds {MAX_HEADER_BYTES}")
    return _U64.size + length
