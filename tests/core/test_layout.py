"""Layouts: validation of untrusted specs, and what decides segment reuse."""

from __future__ import annotations

import pytest

from shmstage.layout import Layout, LayoutError, TensorSpec


def spec(
    key: str = "w",
    dtype: str = "BF16",
    shape: tuple[int, ...] = (4, 8),
    offsets: tuple[int, ...] | None = None,
) -> TensorSpec:
    return TensorSpec(key, dtype, shape, offsets)


def test_equality_decides_reuse_and_covers_key_dtype_shape_offsets_and_order() -> None:
    base = Layout.of([spec(), spec("b", "F32", (3,))])
    same = Layout.of([spec(), spec("b", "F32", (3,))])
    assert base == same and base.nbytes == same.nbytes == 4 * 8 * 2 + 3 * 4
    variants = [
        [spec("w2"), spec("b", "F32", (3,))],
        [spec(dtype="F16"), spec("b", "F32", (3,))],
        [spec(shape=(8, 4)), spec("b", "F32", (3,))],
        [spec(offsets=(0, 0)), spec("b", "F32", (3,))],
        [spec(offsets=(4, 0)), spec("b", "F32", (3,))],
        [spec("b", "F32", (3,)), spec()],
        [spec()],
    ]
    layouts = [Layout.of(v) for v in variants]
    assert all(layout != base for layout in layouts)
    assert all(a != b for i, a in enumerate(layouts) for b in layouts[i + 1 :])


def test_wire_round_trip_and_data_offsets_are_contiguous() -> None:
    layout = Layout.of([spec(), spec("z", "BOOL", (0,)), spec("i", "I64", (2,), (6,))])
    assert Layout.from_wire(layout.to_wire(), max_tensors=10) == layout
    assert layout.data_offsets() == [(0, 64), (64, 64), (64, 80)]
    assert layout.nbytes == 80


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (["w", "F4", [2], None], "cannot be stored in safetensors"),
        (["", "F32", [2], None], "non-empty"),
        (["__metadata__", "F32", [2], None], "reserved"),
        (["w", "F32", [-1], None], "non-negative"),
        (["w", "F32", [2], [0, 0]], "do not match shape"),
        (["w", "F32", [True], None], "non-negative ints"),
        (["w", "F32"], "not [key, dtype, shape, offsets]"),
        ("w", "not [key, dtype, shape, offsets]"),
        (["w", "F32", [1 << 30, 1 << 30], None], "over the limit"),
        (["k" * 1025, "F32", [2], None], "over 1024 bytes"),
        (["ü" * 513, "F32", [2], None], "over 1024 bytes"),  # 513 characters, 1026 bytes
    ],
)
def test_bad_specs_are_refused_naming_the_tensor(item: object, message: str) -> None:
    with pytest.raises(LayoutError, match=None) as info:
        Layout.from_wire([item], max_tensors=10)
    assert message in str(info.value)


def test_duplicate_keys_and_too_many_tensors_are_refused() -> None:
    with pytest.raises(LayoutError, match="twice"):
        Layout.of([spec(), spec()])
    with pytest.raises(LayoutError, match="'b' appears twice"):
        Layout.from_wire(
            [spec().to_wire(), spec("b").to_wire(), spec("b").to_wire()], max_tensors=10
        )
    with pytest.raises(LayoutError, match="limit of 1"):
        Layout.from_wire([spec().to_wire(), spec("b").to_wire()], max_tensors=1)


def test_a_layout_digest_names_its_structure_and_nothing_else() -> None:
    specs = [TensorSpec("w", "F32", (2, 3)), TensorSpec("b", "BF16", (3,), (6,))]
    same = Layout.of(specs).digest()
    assert Layout.from_wire(Layout.of(specs).to_wire(), max_tensors=10).digest() == same
    changed = [
        [TensorSpec("w", "F32", (3, 2)), specs[1]],
        [specs[0], TensorSpec("b", "BF16", (3,), (9,))],  # another shard of the same tensor
        [specs[0], TensorSpec("b", "F16", (3,), (6,))],
        list(reversed(specs)),
    ]
    assert len({Layout.of(c).digest() for c in changed} | {same}) == len(changed) + 1
