"""Nested structure encoding: everything a state dict holds comes back exactly."""

from __future__ import annotations

import gc
import json
import math

import pytest

from shmstage import tree


class Leaf:
    """Stands in for a tensor: the core never imports torch."""

    def __init__(self, name: str) -> None:
        self.name = name


def is_leaf(value: object) -> bool:
    return isinstance(value, Leaf)


def test_round_trip_keeps_types_keys_and_order() -> None:
    a, b = Leaf("a"), Leaf("b")
    original = {
        "model": {"w": a},
        "optim": {
            "state": {0: {"step": 3, "exp_avg": b}},
            "param_groups": [
                {
                    "lr": 0.1,
                    "betas": (0.9, 0.999),
                    "params": [0, 1],
                    "foreach": None,
                    "amsgrad": False,
                }
            ],
        },
        "name": "run-1",
        "nan": float("nan"),
        "inf": -math.inf,
        "big": 2**70,
    }
    encoded, tensors = tree.flatten(original, is_leaf)
    assert [key for key, _ in tensors] == ["model.w", "optim.state.0.exp_avg"]
    encoded = json.loads(json.dumps(encoded))  # must survive JSON, as in the manifest
    by_key = dict(tensors)
    restored = tree.unflatten(encoded, lambda key: by_key[key])
    assert restored["optim"]["state"][0]["exp_avg"] is b
    assert list(restored["optim"]["state"]) == [0]  # int key stays int
    assert restored["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuple stays tuple
    assert math.isnan(restored["nan"]) and restored["inf"] == -math.inf
    assert restored["big"] == 2**70
    assert list(restored) == list(original)
    assert tree.tensor_keys(encoded) == ["model.w", "optim.state.0.exp_avg"]


def test_floats_are_bit_exact() -> None:
    values = [0.1, -0.0, 5e-324, 1.7976931348623157e308]
    encoded, _ = tree.flatten(values, is_leaf)
    restored = tree.unflatten(json.loads(json.dumps(encoded)), lambda k: None)
    assert [v.hex() for v in restored] == [v.hex() for v in values]


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({"x": {1, 2}}, "state_dict['x']: value of type builtins.set"),
        ({"x": [object()]}, "state_dict['x'][0]"),
        ({(1, 2): 3}, "dict key (1, 2)"),
        ({"x": b"bytes"}, "builtins.bytes"),
    ],
)
def test_unsupported_values_are_named_by_path(value: object, fragment: str) -> None:
    with pytest.raises(tree.TreeError, match=None) as info:
        tree.flatten(value, is_leaf)
    assert fragment in str(info.value)


def test_colliding_flat_keys_are_refused() -> None:
    with pytest.raises(tree.TreeError, match=r"both flatten to key 'a\.b'"):
        tree.flatten({"a": {"b": Leaf("1")}, "a.b": Leaf("2")}, is_leaf)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            {"x": [Leaf("1"), Leaf("2")], "x.1": Leaf("3")},
            "state_dict['x.1'] and state_dict['x'][1] both flatten to key 'x.1'",
        ),
        (
            {"p": {"q": {"0": Leaf("a")}}, "p.q": [Leaf("b")]},
            "state_dict['p.q'][0] and state_dict['p']['q']['0'] both flatten to key 'p.q.0'",
        ),
    ],
)
def test_colliding_flat_keys_name_both_paths_however_deep(value: object, message: str) -> None:
    """Where each key came from is found only once a collision is known (a second walk)."""
    with pytest.raises(tree.TreeError) as info:
        tree.flatten(value, is_leaf)
    assert str(info.value) == message + "; rename one of them"


def _nested(levels: int, leaf: object) -> object:
    for i in range(levels):
        leaf = {f"k{i}": leaf}
    return leaf


def test_a_tensor_at_the_depth_limit_is_kept_and_one_level_deeper_is_refused() -> None:
    _, [(key, _)] = tree.flatten(_nested(tree.MAX_DEPTH, Leaf("t")), is_leaf)
    assert key == ".".join(f"k{i}" for i in reversed(range(tree.MAX_DEPTH)))
    for deeper in (_nested(tree.MAX_DEPTH + 1, Leaf("t")), _nested(tree.MAX_DEPTH, [Leaf("t")])):
        with pytest.raises(tree.TreeError, match="nesting deeper than 64 levels"):
            tree.flatten(deeper, is_leaf)


def test_flat_keys_are_the_path_joined_by_dots_even_with_empty_parts() -> None:
    _, tensors = tree.flatten({"": {"a": Leaf("1")}, "b": [Leaf("2"), {"": Leaf("3")}]}, is_leaf)
    assert [key for key, _ in tensors] == [".a", "b.0", "b.1."]
    _, (only,) = tree.flatten(Leaf("root"), is_leaf)
    assert only[0] == "tensor"


def test_flattening_leaves_nothing_for_the_cycle_collector() -> None:
    """Every save flattens its state dict: a reference cycle there would keep the whole
    per-save structure (and the caller's tensors) alive until Python's next collection."""
    state = {"model": {f"w{i}": Leaf(str(i)) for i in range(100)}, "step": 3}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        encoded, tensors = tree.flatten(state, is_leaf)
        assert tree.tensor_keys(encoded) == [key for key, _ in tensors]
        del encoded, tensors
        assert gc.collect() == 0
    finally:
        if was_enabled:
            gc.enable()


def test_nesting_is_bounded() -> None:
    deep: object = Leaf("x")
    for _ in range(tree.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(tree.TreeError, match="deeper"):
        tree.flatten(deep, is_leaf)


def test_malformed_encodings_are_rejected() -> None:
    for bad in [{"x": 1}, {"d": [[1]]}, {"T": 5}, {"l": 3}, [1, 2]]:
        with pytest.raises(tree.TreeError):
            tree.unflatten(bad, lambda k: None)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ([True, {"T": "k"}], "malformed dict entry [True,"),
        ([1.5, {"T": "k"}], "malformed dict entry [1.5,"),
        (("k", {"T": "k"}), "malformed dict entry ('k',"),
        (["k"], "malformed dict entry ['k']"),
        (["k", {"T": 5}], "malformed structure node {'T': 5}"),
        (["k", {"T": None}], "malformed structure node {'T': None}"),
        (["k", {"T": "k", "x": 1}], "malformed structure node {'T': 'k', 'x': 1}"),
    ],
)
def test_a_malformed_entry_among_tensor_entries_is_refused_by_every_decoder(
    entry: object, message: str
) -> None:
    """The daemon checks each commit's tree (``tensor_keys``): the usual entries, a key and
    a tensor reference, are recognised in one step, and anything else decoded in full."""
    good = [[f"g{i}", {"T": f"g{i}"}] for i in range(5)]
    for decode in (tree.tensor_keys, lambda node: tree.unflatten(node, lambda k: k)):
        with pytest.raises(tree.TreeError) as info:
            decode({"d": [*good, entry]})
        assert str(info.value).startswith(message)
    mixed = {"d": [*good, [7, {"T": "seven"}], ["f", {"f": "0x1p+0"}], ["n", None]]}
    assert tree.tensor_keys(mixed) == [*(f"g{i}" for i in range(5)), "seven"]
    assert tree.unflatten(mixed, str.upper) == {
        **{f"g{i}": f"G{i}" for i in range(5)}, 7: "SEVEN", "f": 1.0, "n": None
    }


def test_a_tensor_entry_past_the_depth_limit_is_refused_by_every_decoder() -> None:
    def nested(levels: int) -> object:
        node: object = {"T": "deep"}
        for i in range(levels):
            node = {"d": [[f"k{i}", node]]}
        return node

    for decode in (tree.tensor_keys, lambda node: tree.unflatten(node, lambda k: k)):
        decode(nested(tree.MAX_DEPTH + 1))
        with pytest.raises(tree.TreeError, match="nested deeper than the format allows"):
            decode(nested(tree.MAX_DEPTH + 2))


def test_the_tree_points_at_the_value_a_predicate_picks() -> None:
    encoded, _ = tree.flatten({"a": [1, {"b": 2, 3: "c"}], "d": None}, lambda v: False)
    assert tree.find(encoded, lambda v: v == "c") == ["a", 1, 3]
    assert tree.find(encoded, lambda v: v == 3) == ["a", 1, 3]  # an int dict key
    assert tree.find(encoded, lambda v: v == "nowhere") is None
    assert tree.show(["a", 1, 3]) == "state_dict['a'][1][3]"
