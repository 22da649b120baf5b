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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

MAX_DEPTH: Final = 64


class TreeError(ValueError):
    """A value that cannot be part of a checkpoint; the message names where it sits."""


def flatten(obj: Any, is_tensor: Callable[[Any], bool]) -> tuple[Any, list[tuple[str, Any]]]:
    """Encode ``obj`` and list its tensors as ``(flat_key, tensor)`` in traversal order."""
    flattener = _Flattener(is_tensor)
    encoded = flattener.walk(obj, "")
    tensors = flattener.tensors
    if len({key for key, _ in tensors}) != len(tensors):
        # A flat key twice: walked again noting where each key came from, which raises at
        # the second one naming both (never noted on the way: a tuple per tensor).
        _Flattener(is_tensor, owners={}).walk(obj, "")
    return encoded, tensors


class _Flattener:
    """One traversal's state; a class rather than a recursive closure, whose reference
    cycle would keep every per-save object (and the tensors) alive until a collection.

    This runs inside every save, so each flat key is built once from its parent's, a
    container's tensors are taken where the container is walked (most leaves of a state
    dict are tensors), and the path exists only as one shared stack, for error messages.
    ``owners``: where each flat key came from, noted only to say where a duplicate is.
    """

    def __init__(
        self, is_tensor: Callable[[Any], bool], owners: dict[str, tuple[Any, ...]] | None = None
    ) -> None:
        self.is_tensor = is_tensor
        self.tensors: list[tuple[str, Any]] = []
        self.owners = owners
        self.path: list[Any] = []

    def walk(self, node: Any, key: str) -> Any:
        path = self.path
        if len(path) > MAX_DEPTH:
            raise TreeError(f"{_show(path)}: nesting deeper than {MAX_DEPTH} levels")
        if type(node) is dict:  # the usual node: a plain dict is nothing else below
            return self._mapping(node, key)
        if self.is_tensor(node):
            return self._tensor(key or "tensor", node)
        if node is None or isinstance(node, bool | str):
            return node
        if isinstance(node, int):
            return int(node)
        if isinstance(node, float):
            return {"f": float(node).hex()}
        if isinstance(node, Mapping):
            return self._mapping(node, key)
        if isinstance(node, list | tuple):
            encoded = [self._child(i, value, key) for i, value in enumerate(node)]
            return {"l" if isinstance(node, list) else "t": encoded}
        raise TreeError(
            f"{_show(path)}: value of type {type(node).__module__}.{type(node).__qualname__} "
            "cannot be checkpointed (supported: tensors, dict, list, tuple, int, float, str, "
            "bool, None)"
        )

    def _mapping(self, node: Mapping[Any, Any], key: str) -> Any:
        items = []
        for child, value in node.items():
            kind = type(child)
            if kind is not str and kind is not int and (
                not isinstance(child, str | int) or isinstance(child, bool)
            ):
                raise TreeError(
                    f"{_show(self.path)}: dict key {child!r} of type {kind.__name__} is "
                    "not supported (use str or int keys)"
                )
            items.append([child, self._child(child, value, key)])
        return {"d": items}

    def _child(self, part: str | int, value: Any, parent: str) -> Any:
        """Encode one child; its flat key is the parent's plus ``.part``."""
        path = self.path
        if self.owners is None and self.is_tensor(value) and len(path) < MAX_DEPTH:
            key = parent + "." + str(part) if path else str(part)
            self.tensors.append((key, value))
            return {"T": key}
        path.append(part)
        encoded = self.walk(value, parent + "." + str(part) if len(path) > 1 else str(part))
        path.pop()
        return encoded

    def _tensor(self, key: str, tensor: Any) -> dict[str, str]:
        owners = self.owners
        if owners is not None:
            if key in owners:
                raise TreeError(
                    f"{_show(self.path)} and {_show(owners[key])} both flatten to key "
                    f"{key!r}; rename one of them"
                )
            owners[key] = tuple(self.path)
        self.tensors.append((key, tensor))
        return {"T": key}


def unflatten(encoded: Any, tensor: Callable[[str], Any]) -> Any:
    """Rebuild the original object, fetching each tensor by its flat key."""
    return _decode(encoded, tensor, rebuild=True)


def tensor_keys(encoded: Any) -> list[str]:
    """Flat keys referenced by an encoded tree, in order, checking every node as
    ``unflatten`` would but building nothing (the daemon runs this on every commit)."""
    keys: list[str] = []
    _decode(encoded, keys.append, rebuild=False)
    return keys


def _decode(node: Any, tensor: Callable[[str], Any], rebuild: bool, depth: int = 0) -> Any:
    """``unflatten`` when ``rebuild``, else only the checks and the ``tensor`` calls.

    Plain loops, not generators: the daemon checks a 10,000-tensor tree on every commit."""
    if depth > MAX_DEPTH + 1:
        raise TreeError("structure nested deeper than the format allows")
    if node is None or isinstance(node, bool | int | str):
        return node
    if isinstance(node, dict) and len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "T" and isinstance(value, str):
            return tensor(value)
        if tag == "f" and isinstance(value, str):
            return _float(value)
        if tag == "d" and isinstance(value, list):
            depth += 1
            entries = {}
            shallow = depth <= MAX_DEPTH + 1
            for pair in value:
                if type(pair) is list and len(pair) == 2 and type(pair[0]) in _KEY_TYPES:
                    node = pair[1]
                else:
                    node = _pair(pair)
                if shallow and type(node) is dict and len(node) == 1 and type(node.get("T")) is str:
                    child = tensor(node["T"])  # the usual entry, as the call below decodes it
                else:
                    child = _decode(node, tensor, rebuild, depth)
                if rebuild:
                    entries[pair[0]] = child
            return entries if rebuild else None
        if tag in ("l", "t") and isinstance(value, list):
            depth += 1
            items = [_decode(item, tensor, rebuild, depth) for item in value]
            if not rebuild:
                return None
            return items if tag == "l" else tuple(items)
    raise TreeError(f"malformed structure node {node!r:.80}")


def parts(node: Any) -> list[tuple[str | int, Any]]:
    """The children of an encoded container with their dict key or list index; [] for a
    leaf (a plain value, a tensor reference or a float)."""
    if isinstance(node, dict) and len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "d" and isinstance(value, list):
            return [(pair[0], pair[1]) for pair in value]
        if tag in ("l", "t") and isinstance(value, list):
            return list(enumerate(value))
    return []


def find(encoded: Any, predicate: Callable[[Any], bool]) -> list[str | int] | None:
    """The path to a plain value or dict key of an encoded tree that ``predicate`` accepts
    (for error messages: ``show(path)``), or None when there is none."""
    stack: list[tuple[list[str | int], Any]] = [([], encoded)]
    while stack:
        path, node = stack.pop()
        children = parts(node)
        if not children:
            if predicate(node):
                return path
            continue
        tag = next(iter(node))
        for part, child in reversed(children):
            if tag == "d" and predicate(part):
                return [*path, part]
            stack.append(([*path, part], child))
    return None


def show(path: Sequence[Any]) -> str:
    """Where a value sits, as the caller would index it: ``state_dict['optim'][0]``."""
    return _show(path)


def _float(text: str) -> float:
    """A float tag's value; a malformed or out-of-range one is a TreeError like any bad node."""
    try:
        return float.fromhex(text)
    except (ValueError, OverflowError) as exc:
        raise TreeError(f"malformed float tag {text!r:.40}: {exc}") from None


#: Dict keys ``_pair`` accepts, by exact type (a bool is an int, and is refused).
_KEY_TYPES: Final = (str, int)


def _pair(pair: Any) -> Any:
    """A dict entry's value, once the entry is a [str or int key, value] pair."""
    if (
        not isinstance(pair, list)
        or len(pair) != 2
        or not isinstance(pair[0], str | int)
        or isinstance(pair[0], bool)
    ):
        raise TreeError(f"malformed dict entry {pair!r:.80}")
    return pair[1]


def _show(path: Sequence[Any]) -> str:
    return "state_dict" + "".join(f"[{part!r}]" for part in path)
