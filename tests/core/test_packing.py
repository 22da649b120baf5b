"""Packing: a layout of many tensors shares segments among its small ones; a small layout
keeps one segment per tensor; both sides derive it from the sizes alone."""

from __future__ import annotations

import itertools
import random

import pytest

from shmstage.layout import Layout, TensorSpec
from shmstage.packing import PACK_ALIGN, PACK_BELOW, PACK_BYTES, PACK_FROM_TENSORS, Packing


def test_a_small_layout_keeps_a_segment_per_tensor() -> None:
    sizes = [0, 1, 4096, 5 << 20] * (PACK_FROM_TENSORS // 4)
    packing = Packing.of(sizes)
    assert packing == Packing.one_each(sizes)
    assert packing.sizes == tuple(sizes) and len(packing) == len(sizes)


@pytest.mark.parametrize("seed", range(5))
def test_small_tensors_share_aligned_places_and_large_ones_keep_their_own(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [
        rng.choice(
            [
                0,
                rng.randrange(1, 4096),
                rng.randrange(1, PACK_BELOW),
                PACK_BELOW,
                rng.randrange(PACK_BELOW, 3 * PACK_BELOW),
            ]
        )
        for _ in range(3000)
    ]
    packing = Packing.of(sizes)
    assert len(packing) < len(sizes)
    used: dict[int, list[tuple[int, int]]] = {}
    for size, (which, offset) in zip(sizes, packing.places, strict=True):
        assert offset % PACK_ALIGN == 0  # aligned for every dtype
        assert offset + size <= packing.sizes[which]  # inside its segment
        if size >= PACK_BELOW:
            assert offset == 0 and packing.sizes[which] == size  # alone
        else:
            assert packing.sizes[which] <= PACK_BYTES
        used.setdefault(which, []).append((offset, offset + size))
    for ranges in used.values():  # no two tensors share a byte
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))
    # small tensors follow each other in layout order within a pack
    small = [place for size, place in zip(sizes, packing.places, strict=True) if size < PACK_BELOW]
    assert small == sorted(small)
    assert Packing.of(sizes) == packing  # a function of the sizes alone


def test_10000_small_tensors_take_a_few_dozen_segments() -> None:
    sizes = [100_000] * 10_000
    packing = Packing.of(sizes)
    assert len(packing) == -(-10_000 // (PACK_BYTES // 100_032))  # 100,000 aligned to 64


def test_segments_staged_either_way_are_told_apart_by_their_count() -> None:
    sizes = [1000] * (PACK_FROM_TENSORS + 1)
    assert Packing.of_segments(sizes, len(sizes)) == Packing.one_each(sizes)
    assert Packing.of_segments(sizes, 1) == Packing.of(sizes)
    with pytest.raises(ValueError, match="neither one tensor each nor"):
        Packing.of_segments(sizes, 2)


def test_a_layout_computes_its_packing_once() -> None:
    layout = Layout.of([TensorSpec(f"t{i}", "F32", (10,)) for i in range(PACK_FROM_TENSORS + 1)])
    assert layout.packing() is layout.packing()
    assert len(layout.packing()) == 1
    assert layout == Layout.of(list(layout.tensors))  # not part of equality or hashing
