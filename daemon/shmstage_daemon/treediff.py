"""A commit's tree read against the layout's previous one: only what changed is decoded
and checked.

A training loop commits one structure again and again; between two saves only plain
values change (a learning rate, a step count), a few bytes of a tree whose encoding is
megabytes at 100,000 tensors. Decoding and checking all of it on every commit (``requests.
check_tree``) cost the event loop more than the client's copy of small tensors. Here both
encodings are read side by side, container by container: a child whose bytes equal the
previous one's is the previous, already checked, child (msgpack is self-delimiting: equal
bytes are the same object); a changed child is descended into when it is a container
with the same tag and count, else decoded alone and checked (``tree.tensor_keys``, its
tensors among the layout's). What the result shares with the previous tree is never
mutated: containers on the way to a change are copied.

Anything else — another shape, a malformed encoding, the decoding budget reached — gives
None, and the caller decodes and checks the whole tree, which raises what it should.
"""

from __future__ import annotations

from typing import Any

import msgpack

from shmstage import tree
from shmstage.protocol import packed_unpacker

_CONTAINER_TAGS = ("d", "l", "t")


class _Different(Exception):
    """Not the previous tree's shape (or not well formed): decode and check it whole."""


def patched(old: bytes, old_tree: Any, new: bytes, keys: frozenset[str]) -> Any | None:
    """``new`` decoded and checked against tensor ``keys``, reusing ``old_tree`` (the
    decoding of ``old``, checked) wherever the bytes are the same; None if that cannot be
    done (see the module's docstring)."""
    before = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(old), 1))
    before.feed(old)
    after = packed_unpacker(new)
    try:
        result = _node(old, before, old_tree, new, after, keys)
        if before.tell() != len(old) or after.tell() != len(new):
            return None
    except Exception:  # malformed, over budget, another shape: the whole check decides
        return None
    return result


def _node(
    old: bytes,
    before: msgpack.Unpacker | _Offset,
    old_node: Any,
    new: bytes,
    after: msgpack.Unpacker,
    keys: frozenset[str],
) -> Any:
    """The node at ``after``'s position, where ``before`` is at ``old_node``'s."""
    start = before.tell()
    if _same_bytes(old, before, new, after):
        return old_node
    tag = _container_tag(old_node)
    if tag is None:  # a leaf, a tensor or a float changed: decoded alone and checked
        node = after.unpack()
        _check(node, keys)
        return node
    # A container changed: the same tag and count, or it is another shape.
    inner = old_node[tag]
    before = _at(old, start)
    for side in (before, after):
        if side.read_map_header() != 1 or side.unpack() != tag:
            raise _Different
        if side.read_array_header() != len(inner):
            raise _Different
    children = list(inner)
    for i, child in enumerate(inner):
        if tag == "d":
            children[i] = _pair(old, before, child, new, after, keys)
        else:
            children[i] = _node(old, before, child, new, after, keys)
    if any(a is not b for a, b in zip(children, inner, strict=True)):
        return {tag: children}
    return old_node


def _pair(
    old: bytes,
    before: msgpack.Unpacker | _Offset,
    old_pair: list[Any],
    new: bytes,
    after: msgpack.Unpacker,
    keys: frozenset[str],
) -> list[Any]:
    """A dict's entry, ``[key, node]``: the key must be the same (of the same type)."""
    start = before.tell()
    if _same_bytes(old, before, new, after):
        return old_pair
    before = _at(old, start)
    if before.read_array_header() != 2 or after.read_array_header() != 2:
        raise _Different
    old_key, new_key = before.unpack(), after.unpack()
    if type(old_key) is not type(new_key) or old_key != new_key:
        raise _Different
    node = _node(old, before, old_pair[1], new, after, keys)
    return old_pair if node is old_pair[1] else [new_key, node]


def _same_bytes(
    old: bytes, before: msgpack.Unpacker | _Offset, new: bytes, after: msgpack.Unpacker
) -> bool:
    """Whether the next object encodes to the same bytes on both sides; if so both move
    past it, else only ``before`` did (the caller goes back to where it started). Equal
    bytes are the same value of the same types, so it need not be decoded nor checked."""
    start = before.tell()
    before.skip()
    end = before.tell()
    here = after.tell()
    if new[here : here + end - start] != old[start:end]:
        return False
    after.read_bytes(end - start)
    return True


def _at(data: bytes, offset: int) -> _Offset:
    return _Offset(data, offset)


class _Offset:
    """``msgpack.Unpacker`` over ``data[offset:]`` whose ``tell()`` is an offset in ``data``."""

    def __init__(self, data: bytes, offset: int) -> None:
        self._offset = offset
        self._unpacker = msgpack.Unpacker(
            raw=False, strict_map_key=False, max_buffer_size=max(len(data) - offset, 1)
        )
        self._unpacker.feed(memoryview(data)[offset:])

    def tell(self) -> int:
        return self._offset + self._unpacker.tell()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._unpacker, name)


def _container_tag(node: Any) -> str | None:
    if isinstance(node, dict) and len(node) == 1:
        ((tag, value),) = node.items()
        if tag in _CONTAINER_TAGS and isinstance(value, list):
            return tag
    return None


def _check(node: Any, keys: frozenset[str]) -> None:
    """A decoded node is well formed and names only the layout's tensors."""
    if not set(tree.tensor_keys(node)) <= keys:
        raise _Different
