"""Gathering small CUDA tensors on their device, then one device-to-host copy per range.

A copy from a CUDA tensor into a slot view is one ``cudaMemcpyAsync`` — about 5 µs to
launch whatever its size — so 100,000 tensors of 1-64 KiB cost 0.5 s of launches for
1 GiB that the link moves in 20 ms. The slot already lays small tensors out back to back:
a packed segment holds them in layout order, each at a 64-byte boundary (``shmstage.
packing``). So the tensors of such a run are first copied device-to-device into a scratch
buffer laid out exactly like their host bytes — views of the scratch at the host offsets,
one ``_foreach_copy_`` per dtype, which ``multi_tensor_apply`` runs as a few kernels of
dozens of tensors each — and then the run's whole byte range goes to the host in one copy.

Planning (``plan``) is pure and cached per layout, device and pass; it decides which
tensors, which ranges and where in the scratch, from the layout's sizes and places alone.
It caches nothing of the sources but whether each was contiguous when the plan was made,
which only picks between ``_foreach_copy_``'s batched kernel and its per-tensor fallback:
both copy a source through its own strides, so a source whose strides changed since is
still copied exactly — in its batch's slower path (see ``Gatherer``).

On by default with a 64 MiB bound (one packed segment; ``SHMSTAGE_GATHER_BYTES`` or
``Stager(gather_bytes=)`` change it, 0 turns it off). Its first GPU run found the batched
kernel rewriting NaN payloads of 16-bit floats (``as_bits``); since then 100,000 tensors of
nine dtypes, strided ones among them, have landed bit-exact on an H100 through two saves
(``tests/client/test_gpu.py``, ``scripts/experiments/gather_check.py``).

Bounds and order: the scratch of a device is at most ``gather_bytes`` (0: never gather),
allocated on first need on the side stream, sized to the largest batch, and kept: all of a
device's gathers and the copies out of its scratch run on the one side stream, so stream
order alone keeps a batch from overwriting the scratch before the previous batch's copy to
the host has read it. One buffer by default, not two on two streams: device memory moves a
batch ~40× faster than the link, so the gather should be a few per cent of the copy it
precedes, which is all a second buffer could hide, and the host queues the next batch's
kernels while the link still copies the last one anyway (``Gatherer(buffers=2)`` is the
experiment that measures it; not yet run). Kept, not freed after each save: the next save
needs it again, and freeing returns it to the caching allocator, which keeps the memory
reserved all the same; ``Stager.close`` drops it.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Final

import torch

from shmstage.layout import Layout
from shmstage.packing import PACK_ALIGN, PACK_BELOW

log = logging.getLogger("shmstage.client")

#: The environment variable that bounds the scratch per device, in bytes (0: no gathering).
GATHER_BYTES_ENV: Final = "SHMSTAGE_GATHER_BYTES"
#: The default bound: one packed segment (see above).
DEFAULT_GATHER_BYTES: Final = 64 << 20
#: Tensors under this size are gathered: only they share segments with others, and under it
#: a copy's launch costs as much as its bytes or more. Larger ones keep their direct copy.
GATHER_BELOW: Final = PACK_BELOW
#: Two neighbours in a run are at most this far apart: the padding packing leaves, no more.
MAX_GAP: Final = PACK_ALIGN
#: Runs sit in the scratch at this alignment (plus their host offset's remainder), so that
#: each view there has its host view's alignment, at least that of any dtype.
SCRATCH_ALIGN: Final = PACK_ALIGN
#: Scratch sizes are rounded up to this, so that a slightly larger plan reuses the scratch.
SCRATCH_GRAIN: Final = 1 << 20
#: Plans kept per engine (each holds a view of the scratch per gathered tensor).
MAX_PLANS: Final = 8
#: Dtypes never gathered: a lazily conjugated complex source must be resolved by ``copy_``,
#: which the batched kernel would not do.
_NEVER_GATHERED: Final = frozenset({torch.complex64, torch.complex128, torch.complex32})
#: The integers floats narrower than 32 bits are gathered as. ``_foreach_copy_``'s batched
#: CUDA kernel moves 16-bit and 8-bit floats through float32 (its ``opmath``), which
#: rewrites NaN payloads: on an H100, 9,707 of 11,111 bf16 tensors of random bytes came out
#: with a few bytes changed (``scripts/experiments/gather_check.py``). A checkpoint keeps
#: every bit, so those are copied as int16 / uint8, which the kernel moves unchanged;
#: float32 and float64 came out exact and are copied as themselves.
_BITS_OF_SIZE: Final = {1: torch.uint8, 2: torch.int16}
_BIT_DTYPES: Final = frozenset(_BITS_OF_SIZE.values())


def as_bits(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gathered tensor of ``dtype`` is copied as (see ``_BITS_OF_SIZE``)."""
    if dtype.is_floating_point and dtype.itemsize in _BITS_OF_SIZE:
        return _BITS_OF_SIZE[dtype.itemsize]
    return dtype


def gather_bytes_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The scratch bound ``SHMSTAGE_GATHER_BYTES`` sets (default 64 MiB; 0: off)."""
    env = os.environ if environ is None else environ
    text = env.get(GATHER_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_GATHER_BYTES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{GATHER_BYTES_ENV}={text!r}: give the scratch bound per device in bytes "
            f"(0 turns gathering off; the default is {DEFAULT_GATHER_BYTES})"
        )
    return value


@dataclass(frozen=True, slots=True)
class Run:
    """Tensors whose host bytes follow each other in one segment, padding apart."""

    #: Layout positions, in order.
    members: tuple[int, ...]
    #: Each member's byte offset from the run's start (the first is 0).
    offsets: tuple[int, ...]
    #: From the first member's first byte to the last member's last.
    nbytes: int
    #: The first member's byte offset in its segment (for the scratch's alignment).
    start: int


@dataclass(frozen=True, slots=True)
class Batch:
    """Runs gathered into the scratch together, each at ``at`` there."""

    runs: tuple[Run, ...]
    at: tuple[int, ...]
    #: Scratch bytes this batch uses (from 0).
    nbytes: int


@dataclass(frozen=True, slots=True)
class Plan:
    """How one pass copies its tensors: ``batches`` gathered, ``direct`` one copy each."""

    batches: tuple[Batch, ...]
    direct: tuple[int, ...]

    @property
    def scratch_bytes(self) -> int:
        return max((batch.nbytes for batch in self.batches), default=0)


def plan(
    indices: Sequence[int],
    sizes: Sequence[int],
    places: Sequence[tuple[int, int]],
    gatherable: Sequence[bool],
    limit: int,
) -> Plan:
    """Which of the tensors at ``indices`` (layout positions, in order) are gathered, in
    which runs and batches; the others are ``direct``, and empty ones are left out.

    Two tensors share a run only if they are in the same segment with no tensor of that
    segment between them (a run's copy to the host covers its padding, so it must cover
    no other tensor's bytes: that tensor may be on another device, on the host, or in the
    other pass; a large tensor between them in the layout has a segment of its own, so
    it does not part them), at most ``MAX_GAP`` apart, and the run fits in ``limit``
    bytes of scratch. A run of one tensor gains nothing: it goes direct.
    """
    # rank[k]: the tensors with bytes before position k in its segment; i and j > i of
    # one segment are neighbours there exactly when rank[j] == rank[i] + 1.
    rank = _ranks(sizes, places)
    runs: list[Run] = []
    direct: list[int] = []
    members: list[int] = []
    offsets: list[int] = []
    segment = start = end = 0

    def close() -> None:
        if len(members) > 1:
            runs.append(Run(tuple(members), tuple(offsets), end - start, start))
        else:
            direct.extend(members)
        members.clear()
        offsets.clear()

    for index in indices:
        size = sizes[index]
        if not size:
            continue
        which, offset = places[index]
        if not gatherable[index] or offset % SCRATCH_ALIGN + size > limit:
            direct.append(index)  # which parts a run if it lies in the run's segment (rank)
            continue
        if (
            members
            and which == segment
            and rank[index] == rank[members[-1]] + 1
            and end <= offset < end + MAX_GAP
            and offset + size - start + start % SCRATCH_ALIGN <= limit
        ):
            members.append(index)
            offsets.append(offset - start)
            end = offset + size
            continue
        close()
        members.append(index)
        offsets.append(0)
        segment, start, end = which, offset, offset + size
    close()
    return Plan(_batches(runs, limit), tuple(sorted(direct)))


def _ranks(sizes: Sequence[int], places: Sequence[tuple[int, int]]) -> list[int]:
    """Per position, how many tensors with bytes come before it in its segment."""
    counts: dict[int, int] = {}
    ranks = []
    for size, (which, _) in zip(sizes, places, strict=True):
        count = counts.get(which, 0)
        ranks.append(count)
        if size:
            counts[which] = count + 1
    return ranks


def _batches(runs: Sequence[Run], limit: int) -> tuple[Batch, ...]:
    """Runs in order, as many in each batch as fit in ``limit`` bytes of scratch."""
    batches: list[Batch] = []
    current: list[Run] = []
    at: list[int] = []
    used = 0
    for run in runs:
        place = _align(used, run.start)
        if current and place + run.nbytes > limit:
            batches.append(Batch(tuple(current), tuple(at), used))
            current, at, used = [], [], 0
            place = _align(0, run.start)
        current.append(run)
        at.append(place)
        used = place + run.nbytes
    if current:
        batches.append(Batch(tuple(current), tuple(at), used))
    return tuple(batches)


def _align(position: int, start: int) -> int:
    """The first place at or after ``position`` with ``start``'s remainder modulo
    ``SCRATCH_ALIGN``: a view there is aligned as its host view is."""
    base = -(-position // SCRATCH_ALIGN) * SCRATCH_ALIGN
    return base + start % SCRATCH_ALIGN


def gatherable(layout: Layout, dtypes: Sequence[torch.dtype]) -> list[bool]:
    """Per layout position: small enough to gather, and of a dtype the batched kernel copies
    exactly as ``copy_`` does."""
    return [
        0 < size < GATHER_BELOW and dtype not in _NEVER_GATHERED
        for size, dtype in zip(layout.sizes, dtypes, strict=True)
    ]


def pick(
    destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], indices: Sequence[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The destinations and sources at ``indices``, as ``_foreach_copy_`` takes them."""
    if len(indices) == len(sources):  # the common case: one device, nothing deferred
        return list(destinations), list(sources)
    return [destinations[i] for i in indices], [sources[i] for i in indices]


#: Picks the tensors at some positions out of a list (a tuple, in one C call).
Picker = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


def picker(positions: Sequence[int]) -> Picker:
    if len(positions) == 1:
        only = positions[0]
        return lambda tensors: (tensors[only],)
    return operator.itemgetter(*positions)


@dataclass
class _Group:
    """One ``_foreach_copy_`` of a batch: scratch views and where their sources are."""

    views: list[torch.Tensor]
    sources: Picker
    #: The integer dtype the sources are read as (``as_bits``), or None: as they are.
    bits: torch.dtype | None = None

    def read(self, sources: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        picked = self.sources(sources)
        if self.bits is None:
            return picked
        return list(map(torch.Tensor.view, picked, repeat(self.bits)))


@dataclass
class _Prepared:
    """A plan with its scratch views, for one layout, device and pass."""

    layout: Layout
    indices: list[int]
    plan: Plan
    scratch: torch.Tensor | None
    #: Per batch: its copies into the scratch.
    groups: list[list[_Group]]
    direct: Picker | None
    #: The bytes of the tensors at ``indices``.
    nbytes: int
    #: Per batch: where its buffer starts in the scratch.
    bases: list[int]


class Gatherer:
    """Copies a device's tensors into slot views, gathering small ones through a bounded
    scratch on that device (see the module docstring). Call ``copy`` with the side stream
    current: every operation here is queued on it — with ``buffers`` > 1 (an experiment,
    ``scripts/experiments/gather_copy.py``), the gathers go to a stream of their own that
    fills one buffer while the side stream copies another to the host, each waiting for
    the other by events, and the side stream's last copy still ends the whole."""

    def __init__(self, limit: int, buffers: int = 1) -> None:
        if buffers < 1:
            raise ValueError(f"buffers={buffers}: gathering needs at least one")
        self.buffers = buffers
        self.limit = limit - limit % SCRATCH_ALIGN  # a whole number of any dtype's elements
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._gather_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._failed: set[torch.device] = set()
        self._warned = False
        self._prepared: dict[tuple[int, torch.device, str, int], _Prepared] = {}

    def copy(
        self,
        device: torch.device,
        layout: Layout | None,
        destinations: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        indices: Sequence[int],
        what: str,
    ) -> int | None:
        """Queue the copy of ``sources[i]`` into ``destinations[i]`` for each ``i`` in
        ``indices`` (all on ``device``). ``layout`` says where each destination lies in its
        slot (None: copy each directly); ``what`` names the pass (its plan is kept apart).
        Returns the bytes it copies where a kept plan knows them."""
        prepared = None
        if layout is not None and self.limit > 0 and device not in self._failed:
            prepared = self._prepare(device, layout, destinations, sources, indices, what)
        if prepared is None:
            torch._foreach_copy_(*pick(destinations, sources, indices), non_blocking=True)
            return None
        scratch = prepared.scratch
        batches = prepared.plan.batches
        overlap = self.buffers > 1 and device.type == "cuda" and len(batches) > 1
        if overlap:
            side = torch.cuda.current_stream(device)
            filler = self._gather_streams[device]
            filler.wait_stream(side)  # the caller's writes, and every earlier copy out
            freed: list[torch.cuda.Event | None] = [None] * self.buffers
        for k, (batch, groups, base) in enumerate(
            zip(batches, prepared.groups, prepared.bases, strict=True)
        ):
            assert scratch is not None
            if overlap:
                with torch.cuda.stream(filler):
                    event = freed[k % self.buffers]
                    if event is not None:
                        filler.wait_event(event)  # its buffer's last copy to the host
                    _fill(scratch, base, batch, groups, sources)
                    ready = filler.record_event()
                side.wait_event(ready)
            else:
                _fill(scratch, base, batch, groups, sources)
            for run, at in zip(batch.runs, batch.at, strict=True):
                host = host_range(destinations, run)
                host.copy_(scratch[base + at : base + at + run.nbytes], non_blocking=True)
            if overlap:
                freed[k % self.buffers] = side.record_event()
        if prepared.direct is not None:
            dsts = prepared.direct(destinations)
            torch._foreach_copy_(dsts, prepared.direct(sources), non_blocking=True)
        return prepared.nbytes

    def prepare(
        self,
        device: torch.device,
        layout: Layout,
        destinations: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        indices: Sequence[int],
        what: str,
    ) -> None:
        """Make and keep the plan ``copy`` would, with its scratch, and gather once into
        the scratch, never to the host. Why gather now: CUDA loads a kernel's module on its
        first launch in the process (lazy loading, PyTorch's default), and the gathers'
        kernels — a uint8 fill, ``_foreach_copy_`` of the bit views — are ones a training
        step never launched, so the first save paid for loading them inside its copy. Run
        on the stream the copies use (the caller makes it current, after its own queued
        work): the next gather into the scratch is ordered after this one."""
        if self.limit <= 0 or device in self._failed:
            return
        prepared = self._prepare(device, layout, destinations, sources, indices, what)
        if prepared is None or prepared.scratch is None or device.type != "cuda":
            return
        for batch, groups, base in zip(
            prepared.plan.batches, prepared.groups, prepared.bases, strict=True
        ):
            _fill(prepared.scratch, base, batch, groups, sources)

    def _prepare(
        self,
        device: torch.device,
        layout: Layout,
        destinations: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        indices: Sequence[int],
        what: str,
    ) -> _Prepared | None:
        """The kept plan for this layout, device and pass, or a new one (None: gathering
        failed to get its scratch, so copy directly). A pass of a blocking save and the
        pass of the same name of a non-blocking one (fewer tensors) keep a plan each."""
        key = (id(layout), device, what, len(indices))
        kept = self._prepared.get(key)
        if (
            kept is not None
            and kept.layout is layout
            and (kept.indices is indices or kept.indices == indices)
            and (kept.scratch is None or kept.scratch is self._scratch.get(device))
        ):
            return kept
        self._prepared.pop(key, None)
        dtypes = [t.dtype for t in destinations]
        each = self.limit // self.buffers
        each -= each % SCRATCH_ALIGN
        made = plan(
            indices, layout.sizes, layout.packing().places, gatherable(layout, dtypes), each
        )
        buffer = -(-made.scratch_bytes // SCRATCH_ALIGN) * SCRATCH_ALIGN
        bases = [(k % self.buffers) * buffer for k in range(len(made.batches))]
        scratch = None
        if made.batches:
            scratch = self._scratch_for(device, max(bases) + buffer)
            if scratch is None:
                return None
        prepared = _Prepared(
            layout,
            list(indices),
            made,
            scratch,
            [] if scratch is None else _groups(made, bases, scratch, destinations, sources),
            picker(made.direct) if made.direct else None,
            sum(layout.sizes[i] for i in indices),
            bases,
        )
        while len(self._prepared) >= MAX_PLANS:
            del self._prepared[next(iter(self._prepared))]
        self._prepared[key] = prepared
        return prepared

    def _scratch_for(self, device: torch.device, nbytes: int) -> torch.Tensor | None:
        """This device's scratch, at least ``nbytes`` (and at most ``limit``), or None once
        allocating it failed: gathering is then off for the device, with one warning — a
        retry at every save would run the caching allocator out of its cached blocks."""
        have = self._scratch.get(device)
        if have is not None and have.numel() >= nbytes:
            return have
        size = min(self.limit, -(-nbytes // SCRATCH_GRAIN) * SCRATCH_GRAIN)
        # The smaller scratch goes first (with the plans viewing it): never both at once.
        self._scratch.pop(device, None)
        for key in [key for key in self._prepared if key[1] == device]:
            del self._prepared[key]
        del have
        try:
            made = torch.empty(size, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:
            self._failed.add(device)
            if not self._warned:
                self._warned = True
                log.warning(
                    "cannot allocate %d bytes on %s to gather small tensors (%s); copying "
                    "each directly from now on (lower %s to fit, or 0 to turn gathering off)",
                    size,
                    device,
                    str(exc).splitlines()[0],
                    GATHER_BYTES_ENV,
                )
            return None
        if self.buffers > 1 and device.type == "cuda":
            filler = self._gather_streams.get(device)
            if filler is None:
                filler = self._gather_streams[device] = torch.cuda.Stream(device)
            made.record_stream(filler)  # freed later: the allocator waits for its gathers too
        self._scratch[device] = made
        return made

    def close(self) -> None:
        """Drop the scratch buffers and plans (queued copies keep what they use alive)."""
        self._prepared.clear()
        self._scratch.clear()


def _fill(
    scratch: torch.Tensor,
    base: int,
    batch: Batch,
    groups: Sequence[_Group],
    sources: Sequence[torch.Tensor],
) -> None:
    """Gather one batch into its buffer (at ``base``), padding zeroed: the host gets zeros
    between tensors, never bytes a previous batch left there."""
    scratch[base : base + batch.nbytes].zero_()
    for group in groups:
        torch._foreach_copy_(group.views, group.read(sources), non_blocking=True)


def _groups(
    made: Plan,
    bases: Sequence[int],
    scratch: torch.Tensor,
    destinations: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
) -> list[list[_Group]]:
    """Per batch, one copy per dtype and contiguity: ``_foreach_copy_`` batches a list only
    when every source has one dtype and its view's strides, else it copies tensor by
    tensor, so one strided source must not cost a whole batch its kernels. Floats that
    the kernel would convert are grouped as their bits (``as_bits``). (Views are
    made a group at a time through ``map``: at 100,000 tensors, this is the plan's cost.)"""
    typed: dict[torch.dtype, torch.Tensor] = {}
    result = []
    for batch, base in zip(made.batches, bases, strict=True):
        members = [m for run in batch.runs for m in run.members]
        places = [
            base + at + o for run, at in zip(batch.runs, batch.at, strict=True) for o in run.offsets
        ]
        dsts = [destinations[m] for m in members]
        contiguous = map(torch.Tensor.is_contiguous, [sources[m] for m in members])
        lists: dict[tuple[torch.dtype, bool], tuple[list[int], list[torch.Tensor], list[int]]]
        lists = {}
        for member, dst, place, flat in zip(members, dsts, places, contiguous, strict=True):
            dtype = as_bits(dst.dtype)
            positions, views, starts = lists.setdefault((dtype, flat), ([], [], []))
            positions.append(member)
            views.append(dst)
            starts.append(place)
        groups = []
        for (dtype, _), (positions, views, starts) in lists.items():
            base = typed.get(dtype)
            if base is None:
                base = typed[dtype] = scratch.view(dtype)
            size = dtype.itemsize
            shapes = map(torch.Tensor.size, views)
            strides = map(torch.Tensor.stride, views)
            offsets = [start // size for start in starts]
            views = list(map(base.as_strided, shapes, strides, offsets))
            bits = dtype if dtype in _BIT_DTYPES else None
            groups.append(_Group(views, picker(positions), bits))
        result.append(groups)
    return result


def host_range(destinations: Sequence[torch.Tensor], run: Run) -> torch.Tensor:
    """The bytes of ``run`` in the slot, from its first member's view to its last's end.

    Checked against the last member's address: the plan came from the layout's packing,
    and a slot laid out otherwise must fail here rather than receive bytes out of place.
    """
    first, last = destinations[run.members[0]], destinations[run.members[-1]]
    if last.data_ptr() - first.data_ptr() != run.offsets[-1]:
        raise ValueError(
            f"slot views of tensors {run.members[0]}..{run.members[-1]} are not laid out as "
            "the layout's packing places them; this is a bug in shmstage, please report it"
        )
    offset = first.storage_offset() * first.itemsize
    whole = torch.empty(0, dtype=torch.uint8)
    return whole.set_(first.untyped_storage(), offset, (run.nbytes,), (1,))
