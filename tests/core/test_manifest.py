"""The manifest: what ``build`` makes is what a reader parses back, and the entries the
daemon keeps per layout render exactly the same bytes, whatever the tensors and values."""

from __future__ import annotations

from unittest import mock

import pytest

from shmstage import manifest
from shmstage.layout import Layout, TensorSpec


def layout_of(count: int) -> Layout:
    return Layout.of(
        TensorSpec(f'layers.{i}.wé"ight', "BF16", (i + 1, 3), None if i % 2 else (0, i))
        for i in range(count)
    )


@pytest.mark.parametrize("count", [0, 1, 7])
@pytest.mark.parametrize(
    "tree, metadata",
    [({"model": {"a": 1}, "steps": [1, 2]}, {"run": "x"}), ({}, {}), (None, {"ü": [1.5]})],
    ids=["nested", "empty", "plain"],
)
def test_kept_entries_render_exactly_what_build_writes(
    count: int, tree: object, metadata: dict
) -> None:
    layout = layout_of(count)
    crcs = [i * 7919 + (1 << 31) for i in range(count)]
    entries = manifest.TensorEntries(layout, "model.safetensors")
    with mock.patch("time.time", return_value=1234.5):
        built = manifest.build(layout, "model.safetensors", 99, crcs, tree, metadata, {"pid": 1})
        assert entries.render(99, crcs, tree, metadata, {"pid": 1}) == built.to_bytes()
    parsed = manifest.Manifest.from_bytes(built.to_bytes())
    assert parsed == built
    assert [r.crc32c for r in parsed.tensors.values()] == crcs


def test_kept_entries_refuse_checksums_that_do_not_match_the_layout() -> None:
    entries = manifest.TensorEntries(layout_of(3), "model.safetensors")
    with pytest.raises(ValueError):
        entries.render(99, [1, 2], None, {}, {})
