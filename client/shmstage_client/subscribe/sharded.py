"""A version published by a sharded trainer: one part per rank of the node, read as one.

A sharded publisher's ranks (``shmstage_client.dcp.ShmStagePublisher``) each publish their
local shards — every tensor with its offsets in the global tensor and the global shape —
as one *part* of the version; the daemon shows the version only once every part of that
step arrived and pins all parts together. A ``ShardedVersion`` reads them:

- ``state(device)`` and ``tensors(device)`` give **full tensors**, reassembled from the
  parts' shards bit for bit (a shard several ranks hold — a replicated tensor — is read
  from the lowest part); the nesting and plain values are the lowest part's (parts with
  keys of their own, pipeline stages, add theirs). A tensor whose shards do not cover it
  (its other shards are on ranks of another node) raises ``IncompleteTensor`` naming it
  and what is missing.
- ``part(i)`` is rank ``i``'s part as it published it — its own shards, nested as on that
  rank — for a reader sharded the same way (a tensor-parallel inference engine), with the
  calls of a one-part ``Version``; ``sharding(i)`` says where each of its shards lies.

Part ``i`` is the node's ``i``-th publishing rank in the process group's order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shmstage import tree
from shmstage.layout import Layout
from shmstage_client.errors import SaveError
from shmstage_client.subscribe.version import BUCKET_BYTES, TensorSpec, Verify, Version


class IncompleteTensor(SaveError):
    """A tensor of a sharded version is not covered by the shards of this node's parts."""


@dataclass(frozen=True)
class Shard:
    """Where a part's tensor lies in its global tensor."""

    part: int
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.offsets, self.shape


class ShardedVersion:
    """A pinned version of several parts (see the module). Leaving the block unpins it."""

    def __init__(
        self,
        parts: Sequence[Version],
        *,
        layouts: Sequence[Layout],
        trees: Sequence[Any],
        shapes: Sequence[Mapping[str, Sequence[int]]],
        pin: int,
        unpin: Callable[[int], bool],
    ) -> None:
        self._parts = list(parts)
        self.step = parts[0].step
        self.metadata = parts[0].metadata
        self._trees = list(trees)
        self._pin = pin
        self._unpin = unpin
        self._closed = False
        self.verified = False
        self._shards = [
            _shards_of(index, part.specs, layout, part_shapes)
            for index, (part, layout, part_shapes) in enumerate(
                zip(parts, layouts, shapes, strict=True)
            )
        ]
        #: Full tensor key -> its shards, in the order ``tensors()`` yields them.
        self._plan: dict[str, list[Shard]] = {}
        for part_shards in self._shards:
            for shard in part_shards.values():
                self._plan.setdefault(shard.key, []).append(shard)

    def __enter__(self) -> ShardedVersion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "pinned"
        return f"ShardedVersion(step={self.step}, parts={self.parts}, {state})"

    @property
    def parts(self) -> int:
        """How many ranks' parts make the version."""
        return len(self._parts)

    def part(self, index: int) -> Version:
        """Rank ``index``'s part as it was published (its own shards, nested as on that
        rank), with the calls of a one-part Version; pinned while this version is."""
        return self._parts[index]

    def sharding(self, index: int) -> dict[str, Shard]:
        """Where each tensor of part ``index`` lies in its global tensor, by flat key."""
        return dict(self._shards[index])

    @property
    def pinned(self) -> bool:
        return not self._closed and self._parts[0].pinned

    @property
    def nbytes(self) -> int:
        """The bytes of every part (a replicated tensor counts once per part holding it)."""
        return sum(part.nbytes for part in self._parts)

    @property
    def specs(self) -> list[TensorSpec]:
        """Every full tensor's (flat key, dtype, global shape, bytes), in ``tensors()``
        order."""
        return [
            TensorSpec(
                key,
                shards[0].dtype,
                shards[0].global_shape,
                math.prod(shards[0].global_shape) * shards[0].dtype.itemsize,
            )
            for key, shards in self._plan.items()
        ]

    def close(self) -> bool:
        """Unpin every part; True when the pin held until now. Once; later calls False."""
        if self._closed:
            return False
        self._closed = True
        try:
            return self._unpin(self._pin)
        finally:
            for part in self._parts:
                part.close()

    def state(self, device: str | torch.device = "cpu", *, verify: Verify = "if-ready") -> Any:
        """The full state dict on ``device``: each tensor reassembled from the parts'
        shards (bit-exact), nested as published, plain values included. Each part is copied
        once onto the device, then every full tensor built from it. ``verify`` as for
        ``Version.state``, part by part. Raises IncompleteTensor for a tensor the parts do
        not cover."""
        self._check_open()
        self._check_covered()
        local = [
            dict(part.tensors(device, bucket_bytes=max(part.nbytes, 1), verify=verify))
            for part in self._parts
        ]
        full = {
            key: _assemble(key, shards, lambda shard: local[shard.part][shard.key])
            for key, shards in self._plan.items()
        }
        self.verified = all(part.verified for part in self._parts)
        return self._nest(full)

    def tensors(
        self,
        device: str | torch.device = "cpu",
        *,
        bucket_bytes: int = BUCKET_BYTES,
        verify: Verify = "if-ready",
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each full tensor as (flat key, tensor on ``device``), in ``specs`` order, each
        reassembled from the shards that each part streams a bucket at a time
        (``Version.tensors``); the device holds a bucket per part beside the tensor being
        built (more when ranks' shards lie in different orders). ``verify`` as for
        ``state``. Raises IncompleteTensor before the first tensor if any is uncovered."""
        self._check_open()
        self._check_covered()
        self.verified = False
        streams = [
            part.tensors(device, bucket_bytes=bucket_bytes, verify=verify)
            for part in self._parts
        ]
        arrived: list[dict[str, torch.Tensor]] = [{} for _ in self._parts]

        def take(shard: Shard) -> torch.Tensor:
            waiting = arrived[shard.part]
            while shard.key not in waiting:
                try:
                    key, tensor = next(streams[shard.part])
                except StopIteration:
                    raise SaveError(
                        f"part {shard.part} of version {self.step} ended without "
                        f"{shard.key!r}"
                    ) from None
                waiting[key] = tensor
            return waiting.pop(shard.key)

        for key, shards in self._plan.items():
            yield key, _assemble(key, shards, take)
        for stream in streams:  # each sets its part's ``verified`` once it ends
            for _ in stream:
                pass
        self.verified = all(part.verified for part in self._parts)

    # -- reassembling --------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SaveError(f"version {self.step} was closed (unpinned); wait for another")

    def _check_covered(self) -> None:
        for key, shards in self._plan.items():
            _coverage(key, shards)

    def _nest(self, full: Mapping[str, torch.Tensor]) -> Any:
        """The lowest part's nesting and plain values, with what other parts have that it
        has not (keys of their own)."""
        nested = tree.unflatten(self._trees[0], full.__getitem__)
        seen = set(self._shards[0])
        for index in range(1, len(self._parts)):
            if not self._shards[index].keys() <= seen:
                other = tree.unflatten(self._trees[index], full.__getitem__)
                nested = _merge(nested, other)
                seen |= self._shards[index].keys()
        return nested


def _shards_of(
    index: int, specs: Sequence[TensorSpec], layout: Layout, shapes: Mapping[str, Sequence[int]]
) -> dict[str, Shard]:
    """Part ``index``'s tensors (``specs``: in the order its ``tensors()`` yields them)."""
    offsets = {spec.key: spec.offsets for spec in layout.tensors}
    shards = {}
    for spec in specs:
        at = offsets[spec.key]
        whole = shapes.get(spec.key, spec.shape) if at is not None else spec.shape
        shards[spec.key] = Shard(
            index,
            spec.key,
            tuple(at) if at is not None else (0,) * len(spec.shape),
            tuple(spec.shape),
            tuple(whole),
            spec.dtype,
        )
    return shards


def _coverage(key: str, shards: Sequence[Shard]) -> list[Shard]:
    """The distinct shards that build tensor ``key`` (a box several parts hold: the lowest
    part's); raises IncompleteTensor unless they tile it exactly."""
    first = shards[0]
    for shard in shards[1:]:
        if (shard.global_shape, shard.dtype) != (first.global_shape, first.dtype):
            raise IncompleteTensor(
                f"tensor {key!r} is {list(first.global_shape)} {first.dtype} in part "
                f"{first.part} but {list(shard.global_shape)} {shard.dtype} in part "
                f"{shard.part}: the ranks published different tensors under one key"
            )
    distinct: dict[Any, Shard] = {}
    for shard in shards:
        distinct.setdefault(shard.box, shard)
    boxes = list(distinct.values())
    for n, one in enumerate(boxes):
        for other in boxes[n + 1 :]:
            if _overlap(one, other):
                raise IncompleteTensor(
                    f"tensor {key!r}: the shards of parts {one.part} and {other.part} overlap "
                    f"({list(one.offsets)}+{list(one.shape)} and "
                    f"{list(other.offsets)}+{list(other.shape)}) without being the same"
                )
    total = math.prod(first.global_shape)
    covered = sum(math.prod(shard.shape) for shard in boxes)
    if covered != total:
        raise IncompleteTensor(
            f"tensor {key!r} of shape {list(first.global_shape)}: this version's parts "
            f"hold {covered} of its {total} elements ({_missing(first.global_shape, boxes)}); "
            "the rest is on ranks publishing to another node's shmstaged (or was not "
            "published). Read this node's ranks' own shards with version.part(i)"
        )
    return boxes


def _missing(shape: tuple[int, ...], boxes: Sequence[Shard]) -> str:
    """What is missing, in words: index ranges along the one dimension the shards split,
    else how many shards there are."""
    split = [d for d in range(len(shape)) if any(s.shape[d] != shape[d] for s in boxes)]
    if len(split) != 1:
        return f"{len(boxes)} shard(s)"
    dim, at, gaps = split[0], 0, []
    for shard in sorted(boxes, key=lambda shard: shard.offsets[split[0]]):
        start = shard.offsets[dim]
        if start > at:
            gaps.append(f"{at}:{start}")
        at = max(at, start + shard.shape[dim])
    if at < shape[dim]:
        gaps.append(f"{at}:{shape[dim]}")
    return f"missing {', '.join(gaps)} of dimension {dim}"


def _overlap(one: Shard, other: Shard) -> bool:
    return all(
        max(a, b) < min(a + m, b + n)
        for a, m, b, n in zip(one.offsets, one.shape, other.offsets, other.shape, strict=True)
    )


def _assemble(
    key: str, shards: Sequence[Shard], tensor_of: Callable[[Shard], torch.Tensor]
) -> torch.Tensor:
    """The full tensor ``key`` from its shards (each fetched, duplicates too, so that a
    streaming caller moves past them)."""
    boxes = _coverage(key, shards)
    tensors = {}
    for shard in shards:
        tensor = tensor_of(shard)
        tensors.setdefault(shard.box, tensor)
    first = boxes[0]
    if len(boxes) == 1:  # whole in one part (replicated, or a plain tensor)
        return tensors[first.box]
    sample = tensors[first.box]
    full = torch.empty(first.global_shape, dtype=first.dtype, device=sample.device)
    for shard in boxes:
        where = tuple(
            slice(at, at + n) for at, n in zip(shard.offsets, shard.shape, strict=True)
        )
        full[where].copy_(tensors[shard.box])
    return full


def _merge(into: Any, other: Any) -> Any:
    """``into`` with the dict entries of ``other`` it lacks, at any depth."""
    if isinstance(into, dict) and isinstance(other, dict):
        for key, value in other.items():
            into[key] = _merge(into[key], value) if key in into else value
    return into

