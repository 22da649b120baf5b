"""What the state dict may hold, refused before anything is created: a loop catching
SaveError never crashes, and a refused save leaves no directory, slot or segment."""

from __future__ import annotations

import collections
import collections.abc
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from harness import assert_same
from shmstage_client import SaveError, Stager, UnsupportedValue, load
from shmstage_client.statedict import Flattened
from shmstage_client.structure import Structures

from shmstage.protocol import DEFAULT_MAX_FRAME_BYTES

BIG = DEFAULT_MAX_FRAME_BYTES  # one string this long cannot travel in a commit


@pytest.mark.parametrize(
    ("state", "metadata", "message"),
    [
        ({"w": torch.ones(2), "meta": {"seed": 2**64}}, None, r"state_dict\['meta'\]\['seed'\]"),
        ({"w": torch.ones(2), "opt": {-(2**63) - 1: 0}}, None, r"state_dict\['opt'\]\[-9223"),
        ({"w": torch.ones(2), "n": [1, 2, -(2**70)]}, None, r"state_dict\['n'\]\[2\]"),
        ({"w": torch.ones(2)}, {"seed": 2**64}, "metadata holds an integer"),
    ],
)
def test_integers_outside_64_bits_are_refused_naming_the_key_and_the_range(
    daemon, ckpt: Path, state: dict, metadata: dict | None, message: str
) -> None:
    with Stager(daemon.socket) as stager, pytest.raises(UnsupportedValue, match=message) as info:
        stager.save(state, ckpt / "c", metadata=metadata)
    assert "nothing was written" in str(info.value)
    if metadata is None:
        assert "-9223372036854775808 .. 18446744073709551615" in str(info.value)
    assert os.listdir(ckpt) == [] and daemon.segments() == []


@pytest.mark.parametrize(
    ("state", "metadata", "where"),
    [
        ({"w": torch.ones(2), "cfg": {"blob": "x" * BIG}}, None, "state_dict['cfg']['blob']"),
        ({"w": torch.ones(2), "ids": ["y" * 8192] * (BIG // 8192)}, None, "state_dict['ids']"),
        ({"w": torch.ones(2)}, {"notes": "y" * BIG}, "the metadata"),
    ],
)
def test_plain_values_too_large_for_one_commit_are_refused_naming_where(
    daemon, ckpt: Path, state: dict, metadata: dict | None, where: str
) -> None:
    with Stager(daemon.socket) as stager, pytest.raises(UnsupportedValue) as info:
        stager.save(state, ckpt / "c", metadata=metadata)
    message = str(info.value)
    assert "32.0 MiB one commit message may carry" in message, message
    assert f"(most of it {where}" in message, message
    assert os.listdir(ckpt) == [] and daemon.segments() == []


def test_a_loop_catching_save_error_survives_every_refusal(daemon, ckpt: Path) -> None:
    bad = [
        {"w": torch.ones(2), "x": 2**64},
        {"w": torch.ones(2), "x": "z" * BIG},
        {"w": torch.ones(2), "x": {1, 2}},
        {"w": torch.ones(2, dtype=torch.complex128)},
    ]
    with Stager(daemon.socket, slots=1) as stager:
        for step, state in enumerate(bad):
            try:
                stager.save(state, ckpt / f"s{step}")
            except SaveError:
                pass
        stager.save({"w": torch.ones(2), "x": 2**64 - 1}, ckpt / "good").wait(60)
    assert os.listdir(ckpt) == ["good"]
    assert_same(load(ckpt / "good"), {"w": torch.ones(2), "x": 2**64 - 1})




class _Marked(torch.Tensor):
    """A tensor subclass: refused, by key, however many plain tensors come with it."""


def _many(bad: object, at: int = 150) -> dict[str, object]:
    """300 plain tensors of a few dtypes and shapes, with ``bad`` among them."""
    dtypes = (torch.float32, torch.bfloat16, torch.int64)
    state: dict[str, object] = {
        f"t{i}": torch.zeros(i % 5 + 1, 2, dtype=dtypes[i % 3]) for i in range(300)
    }
    state[f"t{at}"] = bad
    return state


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # deprecated, and still a tensor a caller may pass
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda: torch.ones(2).to_sparse(), "tensor 't150' (torch.sparse_coo, cpu) is not a "),
        (lambda: torch.empty(2, device="meta"), "tensor 't150' (torch.strided, meta) is not a "),
        (lambda: torch.ones(2, dtype=torch.complex128), "tensor 't150' has dtype torch.complex1"),
        (_quantized, "tensor 't150' (torch.strided, cpu) is not a dense"),
        (lambda: torch.ones(2).as_subclass(_Marked), "tensor 't150' is a _Marked; plain tensors"),
    ],
    ids=["sparse", "meta", "complex128", "quantized", "subclass"],
)
@pytest.mark.parametrize("another", [False, True], ids=["alone", "another-later"])
def test_a_new_structure_of_many_tensors_is_refused_naming_its_first_unsupported_tensor(
    bad: Callable[[], torch.Tensor], message: str, another: bool
) -> None:
    """The tensors' properties are checked per distinct value, in bulk; what they refuse
    is then found tensor by tensor, and named as a state dict of one tensor would be."""
    state = _many(bad())
    if another:
        state["t200"] = torch.ones(2, dtype=torch.complex128)  # refused too, but later
    flat = Flattened.of(state, None)
    with pytest.raises(UnsupportedValue) as info:
        flat.layout()
    assert str(info.value).startswith(message) and "nothing was written" in str(info.value)


def test_a_new_structure_of_many_tensors_has_the_layout_its_tensors_describe() -> None:
    state = _many(torch.nn.Parameter(torch.ones(3, 4)), at=7)
    offsets = {"t7": (6, 0), "t8": (0, 4)}
    layout = Flattened.of(state, offsets).layout()
    assert len(layout.tensors) == 300
    for spec, (key, tensor) in zip(layout.tensors, state.items(), strict=True):
        assert (spec.key, tuple(spec.shape)) == (key, tuple(tensor.shape))
        assert spec.dtype == {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}[
            tensor.dtype
        ]
        assert spec.offsets == offsets.get(key)
    assert layout.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    with pytest.raises(UnsupportedValue, match=r"offsets .* do not match shape"):
        Flattened.of(state, {"t9": (0,)}).layout()


# -- a structure saved again: found in bulk, never by address ----------------------------


def _state(lr: float = 1e-3) -> dict:
    """A model's and an optimizer's state dicts, as a training loop saves them."""
    weights = {f"layer{i}.weight": torch.full((3, 2), float(i)) for i in range(6)}
    state = {
        i: {"step": torch.tensor(float(i)), "exp_avg": torch.ones(3, 2) * i, "exp_avg_sq": w}
        for i, w in enumerate(weights.values())
    }
    group = {"lr": lr, "betas": (0.9, 0.999), "weight_decay": 0.0, "foreach": None, "name": "g"}
    optimizer = {"state": state, "param_groups": [{**group, "params": list(range(6))}]}
    return {"model": weights, "optimizer": optimizer, "step": 7}


def _variants() -> list[tuple[str, dict]]:
    """State dicts that each differ from ``_state()`` in one way a remembered structure
    must notice (or, for plain values and tensor objects, carry over exactly)."""
    variants: list[tuple[str, dict]] = []

    def variant(name: str, change: Callable[[dict], object]) -> None:
        state = _state()
        change(state)
        variants.append((name, state))

    opt = "optimizer"
    variant("same structure, new objects", lambda s: None)
    variant("a new learning rate", lambda s: s[opt]["param_groups"][0].update(lr=3e-4))
    variant("0.0 becomes -0.0", lambda s: s[opt]["param_groups"][0].update(weight_decay=-0.0))
    variant("a NaN", lambda s: s[opt]["param_groups"][0].update(lr=float("nan")))
    variant("an int becomes a bool", lambda s: s.update(step=True))
    variant("an int becomes a float", lambda s: s.update(step=7.0))
    variant("a plain value becomes a tensor", lambda s: s.update(step=torch.tensor(7)))
    variant("a tensor becomes a plain value", lambda s: s[opt]["state"][2].update(step=2.0))
    variant("a tensor becomes a Parameter", lambda s: s["model"].update(
        {"layer1.weight": torch.nn.Parameter(torch.zeros(3, 2))}
    ))  # fmt: skip
    variant("an int key becomes a str key", lambda s: s[opt]["state"].update(
        {"3": s[opt]["state"].pop(3)}
    ))  # fmt: skip
    variant("keys in another order", lambda s: s[opt]["state"].update(
        {0: s[opt]["state"].pop(0)}
    ))  # fmt: skip
    variant("one entry's keys in another order", lambda s: s[opt]["state"].update(
        {4: dict(reversed(s[opt]["state"][4].items()))}
    ))  # fmt: skip
    variant("one more entry", lambda s: s[opt]["state"][5].update(extra=torch.ones(1)))
    variant("a tuple becomes a list", lambda s: s[opt]["param_groups"][0].update(betas=[0.9, 0.9]))
    variant("a dict becomes an OrderedDict", lambda s: s.update(
        model=collections.OrderedDict(s["model"])
    ))  # fmt: skip
    variant("a list grows", lambda s: s[opt]["param_groups"][0]["params"].append(6))
    variant("a list becomes empty", lambda s: s[opt]["param_groups"][0].update(params=[]))
    variant("another dtype", lambda s: s["model"].update(
        {"layer2.weight": torch.full((3, 2), 2.0, dtype=torch.bfloat16)}
    ))  # fmt: skip
    variant("another shape, same numel", lambda s: s["model"].update(
        {"layer2.weight": torch.arange(6.0).reshape(2, 3)}
    ))  # fmt: skip
    variant("a transposed (non-contiguous) tensor", lambda s: s["model"].update(
        {"layer3.weight": torch.arange(6.0).reshape(2, 3).t()}
    ))  # fmt: skip
    variant("an expanded (stride 0) tensor", lambda s: s["model"].update(
        {"layer3.weight": torch.tensor([5.0, 6.0]).expand(3, 2)}
    ))  # fmt: skip
    shared = torch.arange(12.0)
    variant("two tensors sharing one storage, at offsets", lambda s: s["model"].update(
        {"layer0.weight": shared[:6].view(3, 2), "layer5.weight": shared[6:].view(3, 2)}
    ))  # fmt: skip
    return variants


def _as_loaded(node: object) -> object:
    """``node`` as a load gives it back: every mapping a dict."""
    if isinstance(node, collections.abc.Mapping):
        return {key: _as_loaded(value) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return type(node)(_as_loaded(value) for value in node)
    return node


#: The variants whose structure is the remembered one (their tensors' properties or plain
#: values differ): found in bulk; every other one is flattened in full.
SAME_STRUCTURE = {
    "same structure, new objects",
    "a new learning rate",
    "0.0 becomes -0.0",
    "a NaN",
    "another dtype",
    "another shape, same numel",
    "a transposed (non-contiguous) tensor",
    "an expanded (stride 0) tensor",
    "two tensors sharing one storage, at offsets",
}


@pytest.mark.parametrize(("name", "state"), _variants(), ids=[n for n, _ in _variants()])
def test_a_remembered_structure_gives_what_a_full_flatten_gives(name: str, state: dict) -> None:
    structures = Structures()
    Flattened.of(_state(), None, structures=structures)  # a first save: not remembered
    Flattened.of(_state(), None, structures=structures)  # remembered
    reused = structures.match(state) is not None
    again = Flattened.of(state, None, structures=structures)
    full = Flattened.of(state, None)
    assert reused == (name in SAME_STRUCTURE), name
    assert again.packed_tree == full.packed_tree, name
    assert again.keys == full.keys, name
    assert all(a is b for a, b in zip(again.tensors, full.tensors, strict=True)), name
    assert again.signature == full.signature, name
    assert again.encoded == full.encoded, name


def test_a_structure_saved_again_with_other_tensors_is_saved_bit_exact(
    daemon, ckpt: Path
) -> None:
    """The stale-plan bug of the systems shmstage replaces: a plan cached by tensor
    address, reused after the tensors changed. Every variant is saved after the same
    structure and loaded back bit for bit (the sign of a zero included)."""
    with Stager(daemon.socket, slots=1) as stager:
        for step, (name, state) in enumerate(_variants()):
            stager.save(_state(), ckpt / f"before{step}").wait(60)
            stager.save(state, ckpt / f"s{step}").wait(60)
            loaded = load(ckpt / f"s{step}")
            assert_same(loaded, _as_loaded(state), name)
            for plain in ("lr", "weight_decay"):
                value = state["optimizer"]["param_groups"][0][plain]
                if value == value:  # NaN aside, the exact float (0.0 is not -0.0)
                    assert loaded["optimizer"]["param_groups"][0][plain].hex() == value.hex()
