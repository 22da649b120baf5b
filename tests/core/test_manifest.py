"""The manifest: what ``build`` makes is what a reader parses back, and the entries the
daemon keeps per layout render exactly the same bytes, whatever the tensors and values."""

from __future__ import annotations

import json
import tracemalloc
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


#: JSON whose decoding costs the most per byte, each pattern repeated to a few hundred KiB
#: (what decoding costs per byte is the same at 1 MiB, and traced it takes 3 times longer).
EXPENSIVE = {
    "empty-maps": lambda n: "[" + "{}," * n + "0]",
    "empty-lists": lambda n: "[" + "[]," * n + "0]",
    "one-entry-maps": lambda n: "[" + '{"a":0},' * n + "0]",
    "maps-of-empty-lists": lambda n: "[" + '{"a":[]},' * n + "0]",
    "one-item-lists": lambda n: "[" + "[0]," * n + "0]",
    "a-map-of-distinct-keys": lambda n: "{" + ",".join(f'"a{i}":0' for i in range(n)) + "}",
    "short-strings": lambda n: "[" + '"ab",' * n + "0]",
    "floats": lambda n: "[" + "1.0," * n + "0]",
    "ints": lambda n: "[" + "1000," * n + "0]",
    "astral-text": lambda n: "[" + ('"\U0001f600' + "a" * 30 + '",') * (n // 10) + "0]",
    "tree-entries": lambda n: "[" + '["k",{"T":"k"}],' * (n // 4) + "0]",
}


@pytest.mark.parametrize("pattern", sorted(EXPENSIVE))
def test_decode_cost_is_at_least_what_decoding_takes(pattern: str) -> None:
    data = EXPENSIVE[pattern](100_000).encode()
    tracemalloc.start()
    try:
        decoded = json.loads(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del decoded
    assert manifest.decode_cost(data) >= peak, f"{peak / len(data):.1f}x its size"


def test_a_manifest_of_tiny_objects_is_refused_naming_what_it_would_cost() -> None:
    document = json.loads(build_of(layout_of(3)).to_bytes())
    document["metadata"] = {"x": [{} for _ in range(1_000_000)]}
    with pytest.raises(manifest.ManifestError, match="over 16x their size"):
        manifest.Manifest.from_bytes(json.dumps(document).encode())


@pytest.mark.parametrize("keys", ["short", "long"])
def test_big_manifests_shmstage_writes_are_within_the_decoding_bound(keys: str) -> None:
    """An optimizer-like structure, tensors named "0", "1", ... (the densest JSON a save
    writes) or as a transformer's parameters are."""
    name = str if keys == "short" else (lambda i: f"model.layers.{i // 10}.mlp.proj{i % 10}")
    state = {name(i): i for i in range(30_000)}
    encoded = {"d": [[key, {"T": key}] for key in state]}
    layout = Layout.of(TensorSpec(key, "F32", (4,)) for key in state)
    opt = [{"lr": {"f": "0x1.999999999999ap-4"}, "params": list(range(1000))}] * 10
    built = manifest.build(
        layout, "model.safetensors", 1, [1 << 31] * 30_000, {"m": encoded, "o": opt}, {}, {}
    )
    data = built.to_bytes()
    assert len(data) > 1 << 20
    assert manifest.decode_cost(data) < 0.8 * manifest.MAX_EXPANSION * len(data)
    assert manifest.Manifest.from_bytes(data) == built


def build_of(layout: Layout) -> manifest.Manifest:
    crcs = list(range(len(layout.tensors)))
    return manifest.build(layout, "model.safetensors", 99, crcs, None, {}, {})
