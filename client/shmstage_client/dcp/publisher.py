"""``ShmStagePublisher``: a sharded trainer's weights, published as one version per step.

Each rank of an FSDP2 / tensor-parallel trainer holds a shard of most tensors. Every rank
keeps one publisher (its own Stager, connection and layout, reused step after step as
``ShmStageWriter`` reuses its layout) and calls ``publish(state_dict, step=...)`` each step;
the node's shmstaged shows version ``step`` of the channel only once every rank of the
node published its part of that step (``shmstage_client.save.publish``, the daemon's
``channels``). Readers get full tensors reassembled from the parts, or one rank's own
shards (``shmstage_client.subscribe``).

What a rank publishes is DCP's own flattening of its state (``writer.plan_local``, the
planner ``ShmStageWriter`` stages with): each DTensor's local shard with its offsets and
the global shape, each plain tensor whole (as a shard at offset 0 of its own shape);
plain values stay where they are in the nesting. A tensor several ranks hold whole
(replicated) is published by each of them; readers take the lowest part's copy. DCP plans
a structure once (~0.1 ms a tensor); later publishes of it reuse the plan while each
tensor's key, type, shape, dtype, placements and mesh stay, and take each DTensor's local
shard from the tensor passed to that publish.

Which ranks make one version: those whose daemon is this rank's — agreed once, over
``process_group``, by each rank's daemon instance id. On several nodes each node's daemon
holds a version of its own ranks' parts: their shards, not the whole model, unless the
node's ranks hold every shard (tensor parallel within the node).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shmstage import tree
from shmstage_client.dcp.writer import _Collected, node_part, plan_local
from shmstage_client.errors import UnsupportedValue
from shmstage_client.save.guard import Guard
from shmstage_client.save.publish import Part, Published, publish_flat
from shmstage_client.save.stager import ReserveInfo, Stager
from shmstage_client.statedict import Flattened, Signature
from shmstage_client.structure import Structures

#: How long a step's first part waits in the daemon for the other ranks' parts.
PART_WAIT_S: Final = 60.0


class ShmStagePublisher:
    """Publish this rank's part of channel ``name`` at every step (see the module).

    ``process_group``: the ranks that publish together (default: the default group; a gloo
    group, as for DCP, keeps the one exchange at set-up off the training group).
    ``share``: groups whose members may subscribe (as ``Stager.publish``). ``within``:
    seconds a step's first part waits in the daemon for the others before that step is
    dropped. ``socket``, ``slots``, ``pin``, ``wait_for_slot``, ``slot_timeout``,
    ``request_timeout``: as for ``Stager``. Connects on first use. Not thread-safe: one per
    rank, kept for the run.
    """

    def __init__(
        self,
        name: str,
        *,
        process_group: dist.ProcessGroup | None = None,
        share: Sequence[int | str] = (),
        within: float = PART_WAIT_S,
        socket: str | os.PathLike[str] | None = None,
        slots: int | None = None,
        pin: bool | str = "auto",
        wait_for_slot: bool = True,
        slot_timeout: float | None = None,
        request_timeout: float = 600.0,
    ) -> None:
        self.name = name
        self.share = tuple(share)
        self.within = within
        self._group = process_group
        self._stager_options: dict[str, Any] = {
            "slots": slots,
            "pin": pin,
            "wait_for_slot": wait_for_slot,
            "slot_timeout": slot_timeout,
            "request_timeout": request_timeout,
        }
        self._socket = socket
        self._stager: Stager | None = None
        #: This rank's part number and the node's part count, agreed at first use.
        self.part: int | None = None
        self.parts: int | None = None
        #: The last structure's shards as DCP planned them (planning costs ~0.1 ms a tensor),
        #: and its nesting (flattening it again costs ~0.1 s at 10,000 tensors).
        self._planned: _Planned | None = None
        self._structures = Structures()

    def __enter__(self) -> ShmStagePublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(
        self,
        state_dict: Mapping[str, Any],
        *,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        block: bool = True,
    ) -> Published:
        """Stage this rank's part of version ``step`` (local shards, their offsets and
        global shapes) and hand it to the daemon; returns once copied and handed over.
        ``Published.complete`` is True on the rank whose part made the version visible.
        Every rank of the node must call it for each step, with the same ``step``;
        ``metadata`` is taken from the node's first rank (part 0).

        ``block=False``: as ``Stager.publish``'s — the shards of optimizers passed to
        ``guard()`` are copied behind the next step, the others before returning. When some
        are, the part is handed over once its copy landed: ``complete`` is None at return,
        and ``Published.visible()`` waits for the hand-over and says whether this part
        completed the version. The next publish waits for this one's copy."""
        stager = self._connect()
        shapes: dict[str, list[int]] = {}

        def flatten() -> Flattened:
            local, planned = self._local_part(state_dict)
            shapes.update(planned.shapes)
            return local

        part = Part(self.part or 0, self.parts or 1, shapes, self.within)
        return publish_flat(
            stager, flatten, self.name, step=step, metadata=metadata, share=self.share,
            block=block, part=part,
        )  # fmt: skip

    def guard(self, *optimizers: torch.optim.Optimizer) -> Guard:
        """``Stager.guard`` for this publisher's Stager: let ``publish(..., block=False)``
        copy these optimizers' parameters and state behind the next step."""
        return self._connect().guard(*optimizers)

    def reserve(self, state_dict: Mapping[str, Any]) -> ReserveInfo:
        """Set up every slot for this structure now (``Stager.reserve``), so that no
        publish in the loop pays for it; ``changed`` is False when the layout in use
        already has it."""
        local, planned = self._local_part(state_dict)
        tensors = dict(local.items)
        nested = tree.unflatten(local.encoded, tensors.__getitem__)
        return self._connect().reserve(nested, offsets=planned.offsets)

    def close(self) -> None:
        """Disconnect: a step of which this rank's part still waits is dropped."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()

    def _local_part(self, state_dict: Mapping[str, Any]) -> tuple[Flattened, _Planned]:
        """The state dict flattened with every tensor replaced by this rank's shard of it
        (nesting and plain values kept, shard offsets set), and the shards' global shapes:
        planned by DCP for a new structure, the last plan's for the same one (the same
        keys, and each tensor's type, shape, dtype, placements and mesh)."""
        flat = Flattened.of(state_dict, None, structures=self._structures)
        signature = [_signature(key, value) for key, value in flat.items]
        planned = self._planned
        if planned is not None and planned.signature == signature:
            local = [_local(value) for value in flat.tensors]
        else:
            planner, plan = plan_local(dict(flat.items))
            collected = _Collected(plan.items, planner.resolve_data)
            missing = [key for key in flat.keys if key not in collected.tensors]
            if missing:
                raise UnsupportedValue(
                    f"DCP planned no local shard for {missing[:5]} on this rank; publish "
                    "DTensor (FSDP2, tensor parallel) and plain tensors — nothing was published"
                )
            local = [collected.tensors[key] for key in flat.keys]
            offsets = {key: tuple(at) for key, at in collected.offsets.items()}
            planned = self._planned = _Planned(signature, offsets, collected.shapes)
        shards = Signature.of(flat.keys, local, planned.offsets)
        sharded = Flattened(flat.packed_tree, flat.keys, local, planned.offsets, shards)
        sharded.encoded_or_unset = flat.encoded_or_unset
        return sharded, planned

    def _connect(self) -> Stager:
        if self._stager is None:
            stager = Stager(self._socket, **self._stager_options)
            try:
                self.part, self.parts = node_part(stager, self._group)
            except BaseException:
                stager.close()
                raise
            self._stager = stager
        return self._stager


@dataclass(frozen=True)
class _Planned:
    """One structure's shards as DCP planned them, reused while the structure stays."""

    signature: list[tuple[Any, ...]]
    offsets: dict[str, tuple[int, ...]]
    shapes: dict[str, list[int]]


def _signature(key: str, value: torch.Tensor) -> tuple[Any, ...]:
    """What decides where a tensor's local shard lies (a new mesh object counts as new)."""
    if isinstance(value, DTensor):
        return key, DTensor, value.shape, value.dtype, value.placements, id(value.device_mesh)
    return key, type(value), value.shape, value.dtype


def _local(value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor, as DCP's planner resolves it."""
    return value.to_local() if isinstance(value, DTensor) else value.detach()
