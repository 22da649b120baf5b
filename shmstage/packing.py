"""Packing: which segment holds each tensor of a layout, and where in it.

A segment per tensor costs per segment wherever segments go: creating its name in
/dev/shm, passing its descriptor, mapping it, opening it to gather. At 10,000 tensors
those costs made a first save 0.6-1.0 s per GiB on the H100 host and a tenth of that per
segment in every gather. So in a layout of more than ``PACK_FROM_TENSORS`` tensors, the
ones under ``PACK_BELOW`` bytes share segments of up to ``PACK_BYTES``, in layout order,
each at a ``PACK_ALIGN``-byte boundary (aligned for any dtype, and for the copies); larger
tensors keep a segment each. Small layouts keep one segment per tensor.

Both sides compute it from the tensors' sizes alone, in layout order (the daemon from the
registered layout, a reader from the checkpoint's manifest, a recovering daemon from its
journal), so no offset ever travels. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

#: Layouts of more tensors than this pack their small ones.
PACK_FROM_TENSORS: Final = 256
#: Tensors under this size are packed...
PACK_BELOW: Final = 1 << 20
#: ...into segments of at most this size...
PACK_BYTES: Final = 64 << 20
#: ...each starting at a multiple of this.
PACK_ALIGN: Final = 64


@dataclass(frozen=True, slots=True)
class Packing:
    """Per segment its size in bytes; per tensor its segment and offset there."""

    sizes: tuple[int, ...]
    places: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return len(self.sizes)

    @classmethod
    def of(cls, nbytes: Sequence[int]) -> Packing:
        """The packing of tensors of these sizes, in order."""
        if len(nbytes) <= PACK_FROM_TENSORS:
            return cls.one_each(nbytes)
        sizes: list[int] = []
        places: list[tuple[int, int]] = []
        pack = -1  # the segment small tensors go to now, and its end
        end = 0
        for size in nbytes:
            if size >= PACK_BELOW:
                places.append((len(sizes), 0))
                sizes.append(size)
                continue
            start = -(-end // PACK_ALIGN) * PACK_ALIGN
            if pack < 0 or start + size > PACK_BYTES:
                pack, start = len(sizes), 0
                sizes.append(0)
            places.append((pack, start))
            end = start + size
            sizes[pack] = end
        return cls(tuple(sizes), tuple(places))

    @classmethod
    def one_each(cls, nbytes: Sequence[int]) -> Packing:
        """A segment per tensor (small layouts; segments a daemon staged that way)."""
        return cls(tuple(nbytes), tuple((index, 0) for index in range(len(nbytes))))

    @classmethod
    def of_segments(
        cls, nbytes: Sequence[int], count: int, packed: Packing | None = None
    ) -> Packing:
        """The packing of tensors of these sizes into ``count`` segments: one each, or
        packed (``packed``: ``of(nbytes)``, where the caller has it already); raises
        ValueError when neither has that many."""
        if count == len(nbytes):
            return cls.one_each(nbytes)
        packed = cls.of(nbytes) if packed is None else packed
        if len(packed) != count:
            raise ValueError(
                f"{count} segments hold neither one tensor each nor the {len(packed)} packs "
                f"of these {len(nbytes)} tensors"
            )
        return packed
