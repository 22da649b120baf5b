"""The nested structure of a state dict, encoded so that it round-trips exactly.

A model's plus an optimizer's ``state_dict()`` is a tree of dicts (with int keys as well as
str keys), lists and tuples, whose leaves are tensors or plain values. JSON alone would turn
int keys into strings, tuples into lists and NaN into an error, so every container and
float is tagged:

    {"d": [[key, node], ...]}   dict (keys: str or int, order kept)
    {"l": [node, ...]}          list
    {"t": [node, ...]}          tuple
    {"f": "0x1.8p+1"}           float, as float.hex() (exact, NaN and inf included)
    {"T": "flat.key"}           tensor, stored under its flattened key
    null / true / 1 / "s"       None, bool, int, str as themselves

The core does not know what a tensor is: callers pass ``is_tensor``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

MAX_DEPTH: Final = 64


class TreeError(ValueError):
    """A value that cannot be part of a checkpoint; the message names where it sits."""


def flatten(obj: Any, is_tensor: Callable[[Any], bool]) -> tuple[Any, list[tuple[str, Any]]]:
    """Encode ``obj`` and list its tensors as ``(flat_key, tensor)`` in traversal order."""
    tensors: list[tuple[str, Any]] = []
    owners: dict[str, tuple[Any, ...]] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> Any:
        if len(path) > MAX_DEPTH:
            raise TreeError(f"{_show(path)}: nesting deeper than {MAX_DEPTH} levels")
        if is_tensor(node):
            key = ".".join(map(str, path)) if path else "tensor"
            if key in owners:
                raise TreeError(
                    f"{_show(path)} and {_show(owners[key])} both flatten to key {key!r}; "
                    "rename one of them"
                )
            owners[key] = path
            tensors.append((key, node))
            return {"T": key}
        if node is None or isinstance(node, bool | str):
            return node
        if isinstance(node, int):
            return int(node)
        if isinstance(node, float):
            return {"f": float(node).hex()}
        if isinstance(node, Mapping):
            items = []
            for key, value in node.items():
                if not isinstance(key, str | int) or isinstance(key, bool):
                    raise TreeError(
                        f"{_show(path)}: dict key {key!r} of type {type(key).__name__} is "
                        "not supported (use str or int keys)"
                    )
                items.append([key, walk(value, (*path, key))])
            return {"d": items}
        if isinstance(node, list | tuple):
            tag = "l" if isinstance(node, list) else "t"
            return {tag: [walk(value, (*path, i)) for i, value in enumerate(node)]}
        raise TreeError(
            f"{_show(path)}: value of type {type(node).__module__}.{type(node).__qualname__} "
            "cannot be checkpointed (supported: tensors, dict, list, tuple, int, float, str, "
            "bool, None)"
        )

    return walk(obj, ()), tensors


def unflatten(encoded: Any, tensor: Callable[[str], Any]) -> Any:
    """Rebuild the original object, fetching each tensor by its flat key."""

    def build(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH + 1:
            raise TreeError("structure nested deeper than the format allows")
        if node is None or isinstance(node, bool | int | str):
            return node
        if isinstance(node, dict) and len(node) == 1:
            ((tag, value),) = node.items()
            if tag == "T" and isinstance(value, str):
                return tensor(value)
            if tag == "f" and isinstance(value, str):
                return float.fromhex(value)
            if tag == "d" and isinstance(value, list):
                return {_key(pair): build(pair[1], depth + 1) for pair in value}
            if tag == "l" and isinstance(value, list):
                return [build(item, depth + 1) for item in value]
            if tag == "t" and isinstance(value, list):
                return tuple(build(item, depth + 1) for item in value)
        raise TreeError(f"malformed structure node {node!r:.80}")

    return build(encoded, 0)


def tensor_keys(encoded: Any) -> list[str]:
    """Flat keys referenced by an encoded tree, for consistency checks without rebuilding."""
    keys: list[str] = []
    unflatten(encoded, lambda key: keys.append(key))
    return keys


def _key(pair: Any) -> str | int:
    if (
        not isinstance(pair, list)
        or len(pair) != 2
        or not isinstance(pair[0], str | int)
        or isinstance(pair[0], bool)
    ):
        raise TreeError(f"malformed dict entry {pair!r:.80}")
    return pair[0]


def _show(path: tuple[Any, ...]) -> str:
    return "state_dict" + "".join(f"[{part!r}]" for part in path)
