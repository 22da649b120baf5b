"""The safetensors data file header: what we write, the real library accepts."""

from __future__ import annotations

import json
import struct

import pytest

from shmstage import datafile
from shmstage.layout import Layout, TensorSpec


def test_header_is_aligned_padded_and_parseable() -> None:
    layout = Layout.of([TensorSpec("a", "F32", (3,)), TensorSpec("b", "U8", (5,))])
    header = datafile.build_header(layout, {"format": "pt"})
    assert len(header) % datafile.DATA_ALIGNMENT == 0
    (length,) = struct.unpack("<Q", header[:8])
    assert length == len(header) - 8
    parsed = datafile.parse_header(header, len(header) + layout.nbytes)
    assert parsed.metadata == {"format": "pt"}
    assert parsed.tensors["b"].begin == len(header) + 12
    assert json.loads(header[8:])["a"]["data_offsets"] == [0, 12]


def test_the_header_is_the_json_of_its_entries_whatever_the_keys_hold() -> None:
    """Written entry by entry, the JSON is exactly what ``json.dumps`` makes of the
    header's dict: quotes, backslashes, control characters and non-ASCII keys included."""
    specs = [
        TensorSpec("plain", "F32", (3,)),
        TensorSpec('quo"te', "BF16", (2, 5)),
        TensorSpec("back\\slash", "U8", (0,)),
        TensorSpec("tab\tnew\nline\x01", "I64", ()),
        TensorSpec("ünï-çødé ☃", "F16", (1, 1, 4)),
        TensorSpec("emoji 🤖", "BOOL", (7,)),
    ]
    layout = Layout.of(specs)
    entries, position = {}, 0
    for spec in specs:
        where = [position, position + spec.nbytes]
        entries[spec.key] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": where}
        position += spec.nbytes
    metadata = {"format": "pt", 'wé"ird': "va\\lue"}
    for meta, header in ((metadata, {"__metadata__": metadata} | entries), (None, entries)):
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        assert datafile.build_header(layout, meta)[8:].rstrip(b" ") == text


def test_real_safetensors_reads_our_file(tmp_path) -> None:
    safetensors = pytest.importorskip("safetensors")
    layout = Layout.of([TensorSpec("a", "U8", (3,)), TensorSpec("e", "U8", (0,))])
    path = tmp_path / "x.safetensors"
    path.write_bytes(datafile.build_header(layout) + b"\x01\x02\x03")
    with safetensors.safe_open(str(path), "np" if _has_numpy() else "pt") as f:
        assert sorted(f.keys()) == ["a", "e"]


def _has_numpy() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    ("prefix", "size", "message"),
    [
        (b"\x01", 10, "shorter than"),
        (struct.pack("<Q", 1000), 100, "impossible"),
        (struct.pack("<Q", 4) + b"[1] ", 12, "not a JSON object"),
        (struct.pack("<Q", 4) + b"{{{{", 12, "not valid JSON"),
        (
            struct.pack("<Q", 80)
            + json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})
            .encode()
            .ljust(80),
            300,
            "do not fit",
        ),
        (
            struct.pack("<Q", 80)
            + json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
            .encode()
            .ljust(80),
            90,
            "past the end",
        ),
    ],
)
def test_broken_headers_are_reported(prefix: bytes, size: int, message: str) -> None:
    with pytest.raises(datafile.DataFileError, match=None) as info:
        datafile.parse_header(prefix, size)
    assert message in str(info.value)
