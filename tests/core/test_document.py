"""Versioned JSON documents: exact, readable, and refused when they are not ours."""

from __future__ import annotations

import json

import pytest

from shmstage.document import parse, render


class NotOurs(Exception):
    pass


def test_render_is_exact_json_with_one_line_per_entry_of_a_top_level_object() -> None:
    document = {
        "format": "shmstage-test",
        "version": 1,
        "tensors": {f"layer.{i}": {"shape": [i, 3], "crc32c": 2**32 - i} for i in range(3)},
        "tree": {"d": [["α", {"T": "layer.0"}], [7, None]]},
        "metadata": {},
        "int_keys": {1: "one"},  # JSON makes them strings, as json.dumps does
        "big": 2**70,
        "float": 0.1,
    }
    data = render(document)
    assert json.loads(data) == json.loads(json.dumps(document))
    lines = data.decode().splitlines()
    assert sum(line.startswith('  "layer.') for line in lines) == 3
    assert "α" in data.decode()  # UTF-8, not \\u escapes
    assert parse(
        data, fmt="shmstage-test", version=1, where="x", kind="test document", error=NotOurs
    ) == json.loads(data)


def test_nan_is_refused_rather_than_written_as_a_non_standard_token() -> None:
    with pytest.raises(ValueError):
        render({"format": "f", "version": 1, "metadata": {"loss": float("nan")}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"format": "other"}', "is not a test document"),
        (b'{"format": "f", "version": 2}', "upgrade shmstage"),
        (b"{", "not valid JSON"),
    ],
)
def test_other_formats_and_versions_are_refused_naming_the_fix(data: bytes, message: str) -> None:
    with pytest.raises(NotOurs, match=message):
        parse(data, fmt="f", version=1, where="x", kind="test document", error=NotOurs)
