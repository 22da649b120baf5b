"""A state dict flattened and checked, before anything touches the daemon or the disk.

Both wings use it: a save stages the flattened tensors (``Flattened``), and ``latest(like=)``
asks the daemon for a checkpoint of the same structure (``Flattened.layout().digest()``).

Everything that can make a save impossible because of what the state dict holds is found
here, first: unsupported values, tensors safetensors cannot store, plain values the wire
cannot carry. A refused state dict costs no directory, no slot, no copy.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import torch

from shmstage import tree
from shmstage.layout import Layout, LayoutError, TensorSpec
from shmstage.protocol import DEFAULT_MAX_FRAME_BYTES
from shmstage.units import format_size
from shmstage_client.dtypes import safetensors_name, supported
from shmstage_client.errors import UnsupportedValue
from shmstage_client.structure import UNSET, Structures

#: msgpack, which carries the structure to the daemon, holds integers in this range.
WIRE_INT_MIN: Final = -(2**63)
WIRE_INT_MAX: Final = 2**64 - 1
#: What a commit frame needs besides the structure and the metadata (names, timings...).
COMMIT_OVERHEAD_BYTES: Final = 64 * 1024


@dataclass(frozen=True)
class Signature:
    """Every tensor property the layout and the copy plan depend on, read straight from
    the tensors in bulk: the flat keys, each tensor's exact type, (dtype, shape, layout,
    device), and the shard offsets. Equal signatures mean an equal (already validated)
    layout and the same copy plan.

    Nothing here is an address: a tensor replaced by another one with the same properties
    needs nothing else to change, because every copy reads the tensors passed to *that*
    save through their own strides and storage offsets (``slots.CopyEngine``), so strides,
    storage offsets and storage sharing are no part of the plan.
    """

    keys: list[str]
    types: list[type]
    properties: list[tuple[Any, ...]]
    shards: dict[str, tuple[int, ...]]

    @classmethod
    def of(
        cls, keys: list[str], tensors: list[torch.Tensor], shards: dict[str, tuple[int, ...]]
    ) -> Signature:
        return cls(keys, list(map(type, tensors)), list(map(_PROPERTIES, tensors)), shards)


#: What ``Signature`` reads from each tensor, in one C call per tensor.
_PROPERTIES: Final = operator.attrgetter("dtype", "shape", "layout", "device")


@dataclass
class Flattened:
    """A state dict flattened: its structure packed once (for the commit), its tensors in
    order with their flat keys, and their ``Signature``.

    ``Flattened.of(..., structures=)`` finds the tensors of a state dict whose structure
    is the one ``structures`` last saw in bulk (``Structure.match``) instead of flattening
    and encoding it again.
    """

    packed_tree: bytes
    keys: list[str]
    tensors: list[torch.Tensor]
    offsets: dict[str, tuple[int, ...]]
    signature: Signature
    #: The encoded tree, or ``UNSET`` where it was not built (``encoded`` decodes it).
    encoded_or_unset: Any = UNSET
    _layout: Layout | None = None
    _matched: Signature | None = None

    @classmethod
    def of(
        cls,
        state_dict: Any,
        offsets: Mapping[str, Sequence[int]] | None,
        *,
        structures: Structures | None = None,
    ) -> Flattened:
        """Flatten and check ``state_dict``. With ``structures``: reuse its last structure
        when ``state_dict`` has it (every container's type and keys, every value's type),
        else flatten it in full and remember its structure there."""
        shards = {key: tuple(shard) for key, shard in (offsets or {}).items()}
        matched = structures.match(state_dict) if structures is not None else None
        if matched is not None:
            structure, tensors, packed = matched
            keys, encoded = structure.keys, structure.encoded_if(packed)
            key_set = structure.key_set
        else:
            encoded, items = _flatten(state_dict)
            packed = _pack_tree(encoded)
            keys = [key for key, _ in items]
            tensors = [tensor for _, tensor in items]
            key_set = set(keys) if shards else frozenset()
            if structures is not None:
                structures.remember(state_dict, encoded, packed, keys)
        unknown = shards.keys() - key_set if shards else ()
        if unknown:
            raise UnsupportedValue(
                f"offsets given for keys not in the state dict: {sorted(unknown)}"
            )
        signature = Signature.of(keys, tensors, shards)
        return cls(packed, keys, tensors, shards, signature, encoded)

    @property
    def items(self) -> list[tuple[str, torch.Tensor]]:
        """``(flat key, tensor)`` in order."""
        return list(zip(self.keys, self.tensors, strict=True))

    @property
    def encoded(self) -> Any:
        """The encoded structure (``shmstage.tree``); decoded from ``packed_tree`` when it
        was reused, which only a refusal's message needs."""
        if self.encoded_or_unset is UNSET:
            self.encoded_or_unset = _unpack_tree(self.packed_tree)
        return self.encoded_or_unset

    def layout(self) -> Layout:
        """The validated layout (only needed when the signature is new)."""
        if self._layout is None:
            self._layout = _layout_of(self.keys, self.tensors, self.signature, self.offsets)
        return self._layout

    def check(self, current_signature: Signature | None) -> None:
        """Raise UnsupportedValue now unless the tensors match the current layout's."""
        if not self.matches(current_signature):
            self.layout()

    def matches(self, signature: Signature | None) -> bool:
        """Whether ``signature`` equals this one's (compared once: 20 ms at 100,000
        tensors, and a save asks twice)."""
        if signature is None:
            return False
        if signature is self._matched or signature is self.signature:
            return True
        if signature == self.signature:
            self._matched = signature
            return True
        return False



def check_fits(
    encoded: Any,
    packed_tree: bytes,
    packed_metadata: bytes,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> None:
    """Refuse plain values and metadata too large for one commit message, naming where
    most of the bytes are (``encoded`` may be ``UNSET``: it is decoded only then)."""
    total = len(packed_tree) + len(packed_metadata) + COMMIT_OVERHEAD_BYTES
    if total <= max_frame_bytes:
        return
    if encoded is UNSET:
        encoded = _unpack_tree(packed_tree)
    where = "the metadata" if len(packed_metadata) > len(packed_tree) else _heaviest(encoded)
    raise UnsupportedValue(
        f"the state dict's plain values and the metadata take {format_size(total)} encoded "
        f"(most of it {where}), more than the {format_size(max_frame_bytes)} one commit "
        "message may carry; store large data as tensors — nothing was written"
    )


def _flatten(state_dict: Any) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    try:
        return tree.flatten(state_dict, lambda value: isinstance(value, torch.Tensor))
    except tree.TreeError as exc:
        raise UnsupportedValue(f"{exc}; nothing was written") from None


def _pack_tree(encoded: Any) -> bytes:
    try:
        return msgpack.packb(encoded, use_bin_type=True)
    except OverflowError:
        path = tree.find(encoded, _outside_wire_ints)
        where = tree.show(path) if path is not None else "the state dict"
        raise UnsupportedValue(
            f"{where} holds an integer outside the range shmstage can store "
            f"({WIRE_INT_MIN} .. {WIRE_INT_MAX}, 64 bits); store it as a str or a tensor — "
            "nothing was written"
        ) from None


def _unpack_tree(packed: bytes) -> Any:
    return msgpack.unpackb(packed, raw=False, strict_map_key=False)


def _outside_wire_ints(value: Any) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and not WIRE_INT_MIN <= value <= WIRE_INT_MAX
    )


def _heaviest(encoded: Any) -> str:
    """Where most of an encoded tree's bytes are: the deepest node holding over half."""
    path: list[str | int] = []
    node = encoded
    size = len(msgpack.packb(node, use_bin_type=True))
    while children := tree.parts(node):
        weights = [
            (len(msgpack.packb(child, use_bin_type=True)), part, child) for part, child in children
        ]
        heaviest, part, child = max(weights, key=lambda weight: weight[0])
        if heaviest * 2 < size:
            break
        path.append(part)
        node, size = child, heaviest
    return f"{tree.show(path)}, {format_size(size)}"


def _layout_of(
    keys: list[str],
    tensors: list[torch.Tensor],
    signature: Signature,
    offsets: Mapping[str, tuple[int, ...]],
) -> Layout:
    """The layout of a structure not seen before: its specs, checked as ``Layout.of``
    checks them. The tensors' own properties are checked per distinct value (types,
    layouts, devices, dtypes: a handful among 100,000 tensors) from the signature read in
    bulk; should any of them be refused, every tensor is looked at again in turn
    (``_tensor_specs``), and the first refused one is named."""
    properties = signature.properties
    names = {dtype: safetensors_name(dtype) for dtype, _, _, _ in set(properties)}
    if (
        all(
            kind is torch.Tensor or issubclass(kind, torch.nn.Parameter)
            for kind in set(signature.types)
        )
        and {layout for _, _, layout, _ in properties} <= {torch.strided}
        and all(device.type != "meta" for device in {p[3] for p in properties})
        and None not in names.values()
        and not any(map(_QUANTIZED, tensors))
    ):
        specs = [
            TensorSpec(key, names[dtype], tuple(shape), offsets.get(key))  # type: ignore[arg-type]
            for key, (dtype, shape, _, _) in zip(keys, properties, strict=True)
        ]
    else:
        specs = _tensor_specs(zip(keys, tensors, strict=True), offsets)
    try:
        return Layout.of(specs)
    except LayoutError as exc:
        raise UnsupportedValue(f"{exc}; nothing was written") from None


#: Whether a tensor is quantized, read in one C call per tensor.
_QUANTIZED: Final = operator.attrgetter("is_quantized")


def _tensor_specs(
    items: Iterable[tuple[str, torch.Tensor]], offsets: Mapping[str, tuple[int, ...]]
) -> list[TensorSpec]:
    """The specs of tensors looked at one by one; raises UnsupportedValue naming the first
    one that cannot be staged."""
    specs = []
    for key, tensor in items:
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            raise UnsupportedValue(
                f"tensor {key!r} is a {type(tensor).__name__}; plain tensors only (for DTensor "
                "use shmstage_client.dcp); nothing was written"
            )
        if (
            tensor.layout is not torch.strided
            or tensor.is_quantized
            or tensor.device.type == "meta"
        ):
            raise UnsupportedValue(
                f"tensor {key!r} ({tensor.layout}, {tensor.device}) is not a dense tensor with "
                "data; nothing was written"
            )
        dtype = safetensors_name(tensor.dtype)
        if dtype is None:
            raise UnsupportedValue(
                f"tensor {key!r} has dtype {tensor.dtype}, which safetensors cannot store "
                f"(supported: {supported()}); convert it first — nothing was written"
            )
        shard = offsets.get(key)
        specs.append(TensorSpec(key, dtype, tuple(tensor.shape), shard))
    return specs
