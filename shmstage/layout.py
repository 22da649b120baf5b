"""Layouts: the flattened structure of a state dict, the unit of staging-buffer reuse.

A layout is the ordered list of tensors a save carries — key, dtype, shape and shard
offsets. Two saves with equal layouts may reuse the same shared-memory segments; anything
else (including a changed shard offset) must not. Source addresses are deliberately absent:
caching on them, or ignoring offsets, is how earlier systems silently re-saved stale data.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from shmstage.packing import Packing

#: safetensors dtype name -> bytes per element. Sub-byte types (F4, F6_*) are absent on
#: purpose: they do not map to whole-byte tensors one can stage and checksum per key.
DTYPE_SIZES: Final[dict[str, int]] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
MAX_KEY_BYTES: Final = 1024
MAX_NDIM: Final = 64
#: Past this a single tensor is certainly a bug; it also keeps sizes well inside 2**63.
MAX_TENSOR_BYTES: Final = 1 << 46
RESERVED_KEY: Final = "__metadata__"


class LayoutError(ValueError):
    """A layout that cannot be staged; the message names the tensor and what is wrong."""


@dataclass(frozen=True, slots=True, init=False)
class TensorSpec:
    key: str
    dtype: str
    shape: tuple[int, ...]
    #: Where this shard starts in the global tensor (DCP/DTensor), or None for a whole tensor.
    offsets: tuple[int, ...] | None = None

    def __init__(
        self, key: str, dtype: str, shape: tuple[int, ...], offsets: tuple[int, ...] | None = None
    ) -> None:
        """The dataclass's own ``__init__``, without its per-field frozen-attribute checks
        (4 us a spec on the build host, against 1.2 this way): a first save of 10,000 tensors
        builds its specs, and the daemon reads them, while the trainer waits."""
        set_key, set_dtype, set_shape, set_offsets = _SET_FIELDS
        set_key(self, key)
        set_dtype(self, dtype)
        set_shape(self, shape)
        set_offsets(self, offsets)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def to_wire(self) -> list[Any]:
        return [
            self.key,
            self.dtype,
            list(self.shape),
            None if self.offsets is None else list(self.offsets),
        ]

    @classmethod
    def from_wire(cls, item: object) -> TensorSpec:
        """Validate one untrusted entry; every failure names the offending tensor."""
        if not isinstance(item, list) or len(item) != 4:
            raise LayoutError(f"tensor entry {item!r:.80} is not [key, dtype, shape, offsets]")
        key, dtype, shape, offsets = item
        spec = cls(
            key,
            dtype,
            _int_tuple(key, "shape", shape),
            None if offsets is None else _int_tuple(key, "offsets", offsets),
        )
        spec.validate()
        return spec

    def validate(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise LayoutError(f"tensor key {self.key!r:.80} must be a non-empty string")
        if len(self.key) * 4 > MAX_KEY_BYTES and (
            len(self.key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES
        ):
            raise LayoutError(f"tensor key {self.key[:60]!r}… is over {MAX_KEY_BYTES} bytes")
        if self.key == RESERVED_KEY:
            raise LayoutError(f"{RESERVED_KEY!r} is reserved by safetensors; rename the key")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise LayoutError(
                f"tensor {self.key!r}: dtype {self.dtype!r:.40} cannot be stored in safetensors "
                f"(supported: {', '.join(DTYPE_SIZES)})"
            )
        if len(self.shape) > MAX_NDIM:
            raise LayoutError(f"tensor {self.key!r}: {len(self.shape)} dimensions is too many")
        if self.offsets is not None and len(self.offsets) != len(self.shape):
            raise LayoutError(
                f"tensor {self.key!r}: offsets {list(self.offsets)} do not match shape "
                f"{list(self.shape)}"
            )
        nbytes = self.nbytes
        if nbytes > MAX_TENSOR_BYTES:
            raise LayoutError(f"tensor {self.key!r}: {nbytes} bytes is over the limit")
        if not nbytes and math.prod(d for d in self.shape if d) >= _INT_LIMIT:
            # empty, yet more elements than torch counts (numel overflows): a crafted shape
            raise LayoutError(f"tensor {self.key!r}: shape {list(self.shape)} is too large")


#: The slots' own setters, which ``TensorSpec.__init__`` calls (the class is frozen).
_SET_FIELDS: Final = tuple(
    TensorSpec.__dict__[name].__set__ for name in ("key", "dtype", "shape", "offsets")
)


def _int_tuple(key: object, what: str, value: object) -> tuple[int, ...]:
    if type(value) is list:
        for v in value:  # a loop, not all(generator): a 10,000-tensor layout's hot path
            if type(v) is not int or not 0 <= v < _INT_LIMIT:
                break
        else:
            return tuple(value)
    raise LayoutError(f"tensor {key!r:.80}: {what} must be a list of non-negative ints")


_INT_LIMIT: Final = 1 << 62
#: Keys of at most this many characters are within MAX_KEY_BYTES in any encoding.
_SHORT_KEY: Final = MAX_KEY_BYTES // 4


def _plain_size(
    key: object, dtype: object, shape: Sequence[object], offsets: Sequence[object] | None
) -> int:
    """The bytes of a tensor spec that certainly passes every check of
    ``TensorSpec.from_wire`` and ``validate`` (a key of plain length, a known dtype, ints
    in range, offsets matching the shape, a size in range), found in one pass; 0 when it
    may not — the caller then runs those checks, which say what is wrong. A layout of
    100,000 tensors is checked this way on both sides of its registration."""
    itemsize = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if (
        itemsize is None
        or type(key) is not str
        or not 0 < len(key) <= _SHORT_KEY
        or key == RESERVED_KEY
        or len(shape) > MAX_NDIM
    ):
        return 0
    for v in shape:  # a loop, not all(generator): the hot path
        if type(v) is not int or not 0 <= v < _INT_LIMIT:
            return 0
    if offsets is not None:
        if len(offsets) != len(shape):
            return 0
        for v in offsets:
            if type(v) is not int or not 0 <= v < _INT_LIMIT:
                return 0
    nbytes = math.prod(shape) * itemsize  # type: ignore[arg-type]
    return nbytes if nbytes <= MAX_TENSOR_BYTES else 0


@dataclass(frozen=True, slots=True)
class Layout:
    """An ordered, validated set of tensor specs; equal layouts may share segments."""

    tensors: tuple[TensorSpec, ...]
    #: Derived once (the daemon asks for them on every commit and in every gather): each
    #: tensor's bytes, their total, the key set.
    sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)
    key_set: frozenset[str] = field(init=False, repr=False, compare=False)
    _packing: Packing | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._derive(tuple(spec.nbytes for spec in self.tensors))

    @classmethod
    def _sized(cls, specs: tuple[TensorSpec, ...], sizes: tuple[int, ...]) -> Layout:
        """A layout of ``specs`` whose sizes were found validating them (not again)."""
        layout = object.__new__(cls)
        object.__setattr__(layout, "tensors", specs)
        object.__setattr__(layout, "_packing", None)
        layout._derive(sizes)
        return layout

    def _derive(self, sizes: tuple[int, ...]) -> None:
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "nbytes", sum(sizes))
        object.__setattr__(self, "key_set", frozenset(spec.key for spec in self.tensors))

    @classmethod
    def of(cls, specs: Iterable[TensorSpec]) -> Layout:
        checked = tuple(specs)
        sizes = []
        for spec in checked:
            shape, offsets = spec.shape, spec.offsets
            nbytes = (
                _plain_size(spec.key, spec.dtype, shape, offsets)
                if type(shape) is tuple and (offsets is None or type(offsets) is tuple)
                else 0
            )
            if not nbytes:
                spec.validate()
                nbytes = spec.nbytes
            sizes.append(nbytes)
        return cls._unique(checked, tuple(sizes))

    @classmethod
    def _unique(
        cls, specs: tuple[TensorSpec, ...], sizes: tuple[int, ...] | None = None
    ) -> Layout:
        """The layout of specs already validated one by one (``sizes``: their bytes, as
        the validation found them), if no key appears twice."""
        layout = cls(specs) if sizes is None else cls._sized(specs, sizes)
        if len(layout.key_set) != len(specs):
            seen: set[str] = set()
            for spec in specs:
                if spec.key in seen:
                    raise LayoutError(f"tensor key {spec.key!r} appears twice")
                seen.add(spec.key)
        return layout

    @classmethod
    def from_wire(cls, items: object, *, max_tensors: int) -> Layout:
        if not isinstance(items, list):
            raise LayoutError("tensors must be a list")
        if len(items) > max_tensors:
            raise LayoutError(
                f"{len(items)} tensors in one layout exceeds this daemon's limit of {max_tensors}"
            )
        specs = []
        sizes = []
        for item in items:
            # One pass over each entry: the ones every check accepts (nearly all) are
            # recognised at once; any other is read again by ``TensorSpec.from_wire``,
            # whose checks say what is wrong.
            nbytes = 0
            if type(item) is list and len(item) == 4:
                key, dtype, shape, offsets = item
                if type(shape) is list and (offsets is None or type(offsets) is list):
                    nbytes = _plain_size(key, dtype, shape, offsets)
            if nbytes:
                spec = TensorSpec(
                    key, dtype, tuple(shape), None if offsets is None else tuple(offsets)
                )
            else:
                spec = TensorSpec.from_wire(item)
                nbytes = spec.nbytes
            specs.append(spec)
            sizes.append(nbytes)
        return cls._unique(tuple(specs), tuple(sizes))

    def to_wire(self) -> list[list[Any]]:
        return [spec.to_wire() for spec in self.tensors]

    def data_offsets(self) -> list[tuple[int, int]]:
        """Byte ranges of each tensor in a data file: contiguous, in layout order."""
        ranges = []
        position = 0
        for size in self.sizes:
            ranges.append((position, position + size))
            position += size
        return ranges

    def packing(self) -> Packing:
        """Which segment holds each tensor (see ``packing``); computed once."""
        if self._packing is None:
            object.__setattr__(self, "_packing", Packing.of(self.sizes))
        assert self._packing is not None
        return self._packing

    def packing_for(self, segments: int) -> Packing:
        """How ``segments`` staged segments hold this layout's tensors: packed, as the
        daemon stages them, or one each, as a daemon before packing did (a journal may
        still owe such a job); raises ValueError when neither."""
        return Packing.of_segments(self.sizes, segments, self.packing())

    def keys(self) -> Sequence[str]:
        return [spec.key for spec in self.tensors]

    def digest(self) -> str:
        """A name for the structure: equal layouts, and only they, have equal digests.

        How a restarted trainer asks the daemon for the newest checkpoint *of its own
        structure* without sending it (``latest``): both sides hash the same wire form.
        """
        text = json.dumps(self.to_wire(), separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
