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


#: Entries near every edge of the checks: accepted ones the one-pass reading may leave to
#: the full checks (a long key, an empty tensor), and refused ones of every kind.
EDGE_ENTRIES: list[object] = [
    ["k" * 256, "F32", [2], None],
    ["k" * 257, "F32", [2], None],
    ["ü" * 300, "F32", [2], None],
    ["ü" * 513, "F32", [2], None],
    ["empty", "F32", [0, 3], None],
    ["crafted", "F32", [0, 1 << 61, 1 << 61], None],
    ["scalar", "I64", [], None],
    ["deep", "U8", [1] * 64, None],
    ["deeper", "U8", [1] * 65, None],
    ["big", "U8", [1 << 46], None],
    ["bigger", "U8", [(1 << 46) + 1], None],
    ["huge", "U8", [1 << 62], None],
    ["sharded", "F32", [2, 2], [4, 0]],
    ["offsets", "F32", [2], [-1]],
    ["offsets", "F32", [2], [True]],
    ["offsets", "F32", [2], (0,)],
    ["offsets", "F32", [2], [0, 0]],
    ["shape", "F32", (2,), None],
    ["shape", "F32", [2.0], None],
    ["shape", "F32", [False], None],
    [5, "F32", [2], None],
    [None, "F32", [2], None],
    ["", "F32", [2], None],
    ["__metadata__", "F32", [2], None],
    ["dtype", ["F32"], [2], None],
    ["dtype", "f32", [2], None],
    ["dtype", None, [2], None],
    ("tuple", "F32", [2], None),
    ["short", "F32", [2]],
    {"key": "w"},
]


def per_entry(item: object) -> object:
    """What the entry-by-entry reading makes of ``item``: its spec and bytes, or the
    message that refuses it."""
    try:
        spec = TensorSpec.from_wire(item)
    except LayoutError as exc:
        return str(exc)
    return spec, spec.nbytes


@pytest.mark.parametrize("item", EDGE_ENTRIES, ids=repr)
def test_a_large_layout_accepts_and_refuses_each_entry_as_its_own_checks_do(
    item: object,
) -> None:
    good = [[f"t{i}", "BF16", [i % 7 + 1, 3], None] for i in range(300)]
    expected = per_entry(item)
    try:
        layout = Layout.from_wire([*good, item], max_tensors=1000)
    except LayoutError as exc:
        assert str(exc) == expected
        return
    assert isinstance(expected, tuple), expected
    assert layout.tensors[-1] == expected[0] and layout.sizes[-1] == expected[1]
    assert layout == Layout.of(TensorSpec.from_wire(entry) for entry in [*good, item])
    assert layout.nbytes == sum(layout.sizes) == sum(s.nbytes for s in layout.tensors)


def test_layout_of_specs_refuses_what_their_validation_refuses() -> None:
    for spec_ in (
        TensorSpec("", "F32", (2,)),
        TensorSpec("w", "F4", (2,)),
        TensorSpec("w", "F32", (2,), (0, 0)),
        TensorSpec("w", "U8", (1 << 47,)),
        TensorSpec("__metadata__", "F32", (2,)),
    ):
        with pytest.raises(LayoutError) as info:
            spec_.validate()
        with pytest.raises(LayoutError) as again:
            Layout.of([spec(f"t{i}") for i in range(300)] + [spec_])
        assert str(again.value) == str(info.value)
    odd = Layout.of([TensorSpec("w", "F32", (2,), (-1,)), TensorSpec("e", "F32", (0,))])
    assert odd.sizes == (8, 0) and odd.nbytes == 8
