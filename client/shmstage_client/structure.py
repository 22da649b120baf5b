"""A state dict's structure, remembered so that the next save of the same structure finds
its tensors in bulk instead of flattening and encoding it again.

Flattening (``shmstage.tree``) visits every node in Python and encodes it: microseconds a
tensor, more than the copy of a small tensor costs. A training loop saves one structure
again and again, in new dicts (``state_dict()`` builds them anew) holding new tensor
objects (``detach()``), so nothing can be recognised by identity or address — and nothing
here tries. What is compared, with a few C calls per container rather than Python per
value, is each container's exact type, its length, its keys in order and their types, and
the exact type of every value. When all of them equal the remembered ones, the flat keys
are the remembered ones, the tensors are taken in the same order, and the encoded tree
differs from the remembered one only where a plain value (a learning rate, a step count)
changed: its packed bytes are the remembered ones with those values packed again
(``Structure.parts``: msgpack containers carry counts, not sizes, so the encoding of a
tree is the concatenation of fixed pieces and of its plain values' encodings).

What the tensors are (dtype, shape, device...) is no part of the structure: the caller
compares that in bulk as well (``statedict.Signature``), and a state dict whose structure
is not the remembered one is flattened in full.
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import torch

#: Containers with fewer values than this are matched value by value, not in bulk.
_UNIFORM_MIN: Final = 4
#: An encoded tree not built (it is decoded from the packed one when needed).
UNSET: Final = object()
#: The msgpack extension code of the markers that cut a packed tree into ``parts``.
_MARK: Final = 5


@dataclass(eq=False)
class _Container:
    """What a container was: its exact type, keys (a dict's, in order) and each value's
    exact type; which values are tensors, plain values or containers (``children``)."""

    kind: type
    keys: list[Any] | None
    key_types: list[type] | None
    length: int
    types: list[type]
    #: Per value: its plan if it is a container, else None; and whether it is a tensor.
    children: list[_Container | None]
    tensor: list[bool]
    #: Only leaves (tensors and plain values): taken in bulk with these.
    leaves: bool
    take_tensors: Callable[[Sequence[Any]], Sequence[Any]] | None
    take_plains: Callable[[Sequence[Any]], Sequence[Any]] | None
    #: Every value a container of leaves with one and the same plan: matched in bulk.
    uniform: _Uniform | None = None


@dataclass(eq=False)
class _Uniform:
    """``count`` containers of one plan (``child``), as their concatenations look."""

    child: _Container
    lengths: list[int]
    keys: list[Any] | None
    key_types: list[type] | None
    types: list[type]
    take_tensors: Callable[[Sequence[Any]], Sequence[Any]] | None
    take_plains: Callable[[Sequence[Any]], Sequence[Any]] | None


class Structure:
    """One state dict's structure: its root container's plan, its flat keys, its plain
    values (in traversal order) and its packed tree, in ``parts`` around those values."""

    def __init__(
        self,
        root: _Container,
        keys: list[str],
        plains: list[Any],
        encoded: Any,
        packed: bytes,
        parts: list[bytes],
    ) -> None:
        self.root = root
        self.keys = keys
        self.key_set = frozenset(keys)
        self.plains = plains
        self._floats = [i for i, value in enumerate(plains) if type(value) is float]
        self._float_hex = [plains[i].hex() for i in self._floats]
        self.encoded = encoded
        self.packed = packed
        self.parts = parts

    def match(self, state_dict: Any) -> tuple[list[torch.Tensor], bytes] | None:
        """``state_dict``'s tensors in order and its packed tree, if it has this
        structure; else None."""
        tensors: list[torch.Tensor] = []
        plains: list[Any] = []
        if not _match(state_dict, self.root, tensors, plains):
            return None
        if len(tensors) != len(self.keys) or len(plains) != len(self.plains):
            return None  # cannot happen with equal plans; never trust it blindly
        if plains == self.plains and self._same_floats(plains):
            return tensors, self.packed
        packed = self._repack(plains)
        return None if packed is None else (tensors, packed)

    def encoded_if(self, packed: bytes) -> Any:
        """The encoded tree, if ``packed`` is the one it was packed into (else ``UNSET``)."""
        return self.encoded if packed is self.packed else UNSET

    def _same_floats(self, plains: list[Any]) -> bool:
        """Floats equal as encoded (``==`` holds for 0.0 and -0.0, not their encodings)."""
        if not self._floats:
            return True
        return [plains[i].hex() for i in self._floats] == self._float_hex

    def _repack(self, plains: list[Any]) -> bytes | None:
        """The packed tree with the plain values that changed packed again (None: one
        cannot be packed; a full flatten then says which and why)."""
        parts = list(self.parts)
        old = self.plains
        changed = _differing(plains, old, 0, len(plains), [])
        changed += [i for i in self._floats if plains[i].hex() != old[i].hex()]  # -0.0
        for i in sorted(set(changed)):
            new = plains[i]
            try:
                parts[2 * i + 1] = msgpack.packb(_encode_plain(new), use_bin_type=True)
            except (OverflowError, TypeError, ValueError):
                return None
        packed = b"".join(parts)
        self.plains, self.parts, self.packed, self.encoded = plains, parts, packed, UNSET
        self._float_hex = [plains[i].hex() for i in self._floats]
        return packed


class Structures:
    """The structure of the state dict a Stager saved last (``remember``), for the next
    save to ``match``."""

    def __init__(self) -> None:
        self.current: Structure | None = None
        self._first = True

    def match(self, state_dict: Any) -> tuple[Structure, list[torch.Tensor], bytes] | None:
        structure = self.current
        if structure is None:
            return None
        found = structure.match(state_dict)
        if found is None:
            return None
        return structure, found[0], found[1]

    def expect_repeats(self) -> None:
        """The next structure flattened will be saved again (``Stager.reserve``, before the
        loop): remember it even if it is the first, so that the loop's first save finds it
        instead of flattening and remembering it inside its stall."""
        self._first = False

    def remember(self, state_dict: Any, encoded: Any, packed: bytes, keys: list[str]) -> None:
        """Remember the structure of ``state_dict``, just flattened (``encoded``, packed
        into ``packed``, its tensors under ``keys``); a state dict that is not a container,
        or whose packed tree cannot be cut around its plain values, is not remembered."""
        self.current = None
        if self._first:
            # Remembering costs about a flatten again (0.15 s instead of 0.08 for 10,000
            # tensors): not in a Stager's first save, which sets the layout up, but in the
            # next one, which finds the same structure again in most training loops.
            self._first = False
            return
        if not isinstance(state_dict, Mapping | list | tuple):
            return
        root = _plan(state_dict)
        plains: list[Any] = []
        encoded_plains: list[Any] = []
        token = os.urandom(8)
        marked = _marked(encoded, encoded_plains, token)
        _collect_plains(state_dict, plains)
        if [_encode_plain(value) for value in plains] != encoded_plains:
            return  # cannot happen: both are in traversal order
        parts = _cut(msgpack.packb(marked, use_bin_type=True), token, len(plains))
        if parts is None:
            return
        for i, value in enumerate(encoded_plains):
            parts[2 * i + 1] = msgpack.packb(value, use_bin_type=True)
        if b"".join(parts) != packed:  # a marker's bytes in a string: not cut, not kept
            return
        self.current = Structure(root, keys, plains, encoded, packed, parts)


def _is_container(value: Any) -> bool:
    return isinstance(value, Mapping | list | tuple) and not isinstance(value, str)


def _kind(value: Any) -> str:
    """As ``statedict`` flattens it: a tensor, a container, or a plain value."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if value is None or isinstance(value, bool | str | int | float):
        return "plain"
    return "container"


def _taker(positions: list[int], count: int) -> Callable[[Sequence[Any]], Sequence[Any]] | None:
    """A C-speed pick of ``positions`` out of ``count`` values (None: all of them)."""
    if len(positions) == count:
        return None
    if not positions:
        return lambda values: ()
    if len(positions) == 1:
        only = positions[0]
        return lambda values: (values[only],)
    return operator.itemgetter(*positions)


def _plan(node: Any) -> _Container:
    """The plan of a container the full flatten just accepted."""
    if isinstance(node, Mapping):
        keys: list[Any] | None = list(node)
        key_types = list(map(type, keys))
        values = list(node.values())
    else:
        keys = key_types = None
        values = list(node)
    kinds = [_kind(value) for value in values]
    children = [_plan(v) if k == "container" else None for v, k in zip(values, kinds, strict=True)]
    tensor = [k == "tensor" for k in kinds]
    leaves = "container" not in kinds
    count = len(values)
    container = _Container(
        kind=type(node),
        keys=keys,
        key_types=key_types,
        length=count,
        types=list(map(type, values)),
        children=children,
        tensor=tensor,
        leaves=leaves,
        take_tensors=_taker([i for i, t in enumerate(tensor) if t], count) if leaves else None,
        take_plains=_taker([i for i, t in enumerate(tensor) if not t], count) if leaves else None,
    )
    container.uniform = _uniform(children)
    return container


def _uniform(children: list[_Container | None]) -> _Uniform | None:
    """The bulk plan of containers whose values are all containers of leaves with one
    plan (an optimizer's per-parameter state), else None."""
    if len(children) < _UNIFORM_MIN or children[0] is None:
        return None
    first = children[0]
    if not first.leaves:
        return None
    for child in children:
        if (
            child is None
            or child.kind is not first.kind
            or child.keys != first.keys
            or child.key_types != first.key_types
            or child.types != first.types
        ):
            return None
    count = len(children)
    tensor = first.tensor * count
    positions = [i for i, t in enumerate(tensor) if t]
    others = [i for i, t in enumerate(tensor) if not t]
    return _Uniform(
        child=first,
        lengths=[first.length] * count,
        keys=None if first.keys is None else first.keys * count,
        key_types=None if first.key_types is None else first.key_types * count,
        types=first.types * count,
        take_tensors=_taker(positions, len(tensor)),
        take_plains=_taker(others, len(tensor)),
    )


def _match(node: Any, plan: _Container, tensors: list[Any], plains: list[Any]) -> bool:
    """Whether ``node`` has ``plan``'s structure; appends its tensors and plain values, in
    traversal order, as it goes."""
    if type(node) is not plan.kind or len(node) != plan.length:
        return False
    if plan.keys is not None:
        keys = list(node)
        if keys != plan.keys or list(map(type, keys)) != plan.key_types:
            return False
        values = list(node.values())
    else:
        values = node
    if list(map(type, values)) != plan.types:
        return False
    if plan.leaves:
        _take(values, plan.take_tensors, plan.take_plains, tensors, plains)
        return True
    if plan.uniform is not None:
        return _match_uniform(values, plan.uniform, tensors, plains)
    for value, child, tensor in zip(values, plan.children, plan.tensor, strict=True):
        if child is not None:
            if not _match(value, child, tensors, plains):
                return False
        elif tensor:
            tensors.append(value)
        else:
            plains.append(value)
    return True


def _match_uniform(
    values: Sequence[Any], uniform: _Uniform, tensors: list[Any], plains: list[Any]
) -> bool:
    """``_match`` of every value against one plan of leaves, a few C calls in all: their
    lengths, their keys and values concatenated, and the types of both."""
    if list(map(len, values)) != uniform.lengths:
        return False
    if uniform.keys is not None:
        keys = list(itertools.chain.from_iterable(values))  # a mapping iterates its keys
        if keys != uniform.keys or list(map(type, keys)) != uniform.key_types:
            return False
        flat = list(itertools.chain.from_iterable(map(uniform.child.kind.values, values)))
    else:
        flat = list(itertools.chain.from_iterable(values))
    if list(map(type, flat)) != uniform.types:
        return False
    _take(flat, uniform.take_tensors, uniform.take_plains, tensors, plains)
    return True


def _take(
    values: Sequence[Any],
    take_tensors: Callable[[Sequence[Any]], Sequence[Any]] | None,
    take_plains: Callable[[Sequence[Any]], Sequence[Any]] | None,
    tensors: list[Any],
    plains: list[Any],
) -> None:
    tensors.extend(values if take_tensors is None else take_tensors(values))
    plains.extend(values if take_plains is None else take_plains(values))


def _collect_plains(node: Any, plains: list[Any]) -> None:
    """The plain values under ``node`` in traversal order, as ``_match`` finds them."""
    values = node.values() if isinstance(node, Mapping) else node
    for value in values:
        kind = _kind(value)
        if kind == "plain":
            plains.append(value)
        elif kind == "container":
            _collect_plains(value, plains)


def _differing(new: list[Any], old: list[Any], start: int, end: int, out: list[int]) -> list[int]:
    """Where ``new[start:end]`` differs from ``old``'s (``==``), found by halving: a few
    slice comparisons in C when one learning rate changed among 100,000 plain values."""
    if new[start:end] == old[start:end]:
        return out
    if end - start <= 8:
        out.extend(i for i in range(start, end) if new[i] != old[i])
        return out
    middle = (start + end) // 2
    _differing(new, old, start, middle, out)
    return _differing(new, old, middle, end, out)


def _encode_plain(value: Any) -> Any:
    """A plain value as ``shmstage.tree`` encodes it."""
    if isinstance(value, float):
        return {"f": float(value).hex()}
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return value


def _marked(node: Any, plains: list[Any], token: bytes) -> Any:
    """A copy of an encoded tree with each plain value replaced by a marker numbered in
    traversal order (the encoded values go to ``plains``)."""
    if isinstance(node, dict) and len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "d":
            return {"d": [[key, _marked(child, plains, token)] for key, child in value]}
        if tag in ("l", "t"):
            return {tag: [_marked(child, plains, token) for child in value]}
        if tag == "T":
            return node
    plains.append(node)  # None, bool, int, str, or {"f": hex}
    return msgpack.ExtType(_MARK, token + (len(plains) - 1).to_bytes(8, "big"))


def _cut(packed: bytes, token: bytes, count: int) -> list[bytes] | None:
    """``packed`` cut around its ``count`` markers: fixed pieces at even places, a slot for
    each plain value's encoding at odd ones (None: a marker is not where it should be)."""
    parts: list[bytes] = []
    start = 0
    for i in range(count):
        marker = b"\xd8" + bytes([_MARK]) + token + i.to_bytes(8, "big")  # fixext 16
        at = packed.find(marker, start)
        if at < 0:
            return None
        parts += [packed[start:at], b""]
        start = at + len(marker)
    parts.append(packed[start:])
    return parts
