"""The trainer's side of a layout: its slots mapped into this process, and the copy into them.

The client maps every segment once per layout and keeps typed tensor views over the
mappings. Each save copies from the tensors passed to *that* save — never from cached
source pointers — into the slot the daemon granted.

CPU tensors are copied with ``Tensor.copy_`` (a memcpy for contiguous sources; strided
sources are gathered). CUDA tensors are copied on a side stream that first waits on the
caller's current stream, then one event wait — never a device-wide synchronize, so work
queued on other streams cannot delay the save.

A non-blocking save defers the copy of the tensors a guard covers (``CopyEngine.start``):
CUDA ones stay queued on the side stream, CPU ones go to a copy thread, and the caller gets
a ``DeferredCopy`` to wait on (``deferred_copy``).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import logging
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from shmstage import segment
from shmstage.layout import Layout
from shmstage_client.dtypes import FROM_SAFETENSORS
from shmstage_client.pinning import PIN_FAILURES, PinnedRanges, prefault, try_pin
from shmstage_client.save.deferred_copy import CopyGroup, DeferredCopy, StreamCopy, ThreadCopy
from shmstage_client.save.gather import Gatherer, gather_bytes_from_env, pick

if TYPE_CHECKING:
    from shmstage_client.statedict import Signature

log = logging.getLogger("shmstage.client")


@dataclass
class MappedLayout:
    """A registered layout as this process sees it: one list of tensor views per slot.

    Slots may arrive later than the layout (``expect``, for ``add_slots``), and each is
    pinned on its own, just before its first copy (``pin_slot``): a first save sets up the
    one slot it fills, not all of them.
    """

    id: int
    layout: Layout
    #: The tensor properties this layout was last matched against, and where those
    #: tensors live (``device_groups``); both set by the Stager.
    signature: Signature | None = None
    groups: dict[torch.device, list[int]] = field(default_factory=dict)
    #: The slots whose every segment is mapped, in order.
    slots: list[list[torch.Tensor]] = field(default_factory=list)
    #: How many of ``slots`` a copy may fill: a slot added in the background is mapped
    #: before it is faulted in, and the prefault's read-modify-write of a byte per page
    #: would put back what it read over a copy made meanwhile (``mark_ready``).
    ready: int = 0
    #: Whether slots are registered with CUDA before their first copy.
    pin: bool = False
    #: Registered ranges, by slot.
    pinned: dict[int, PinnedRanges] = field(default_factory=dict)
    #: How many slots the client wants in all, and the background request bringing the
    #: ones the registration did not (see ``Stager``); None once there is none to wait for.
    target_slots: int = 1
    growth: concurrent.futures.Future[None] | None = None
    #: False once adding slots failed halfway: the daemon may hold slots this process
    #: never mapped, so the next save registers the layout again.
    whole: bool = True
    #: One address range per slot, its segments back to back (see ``segment.Region``).
    _regions: list[segment.Region] = field(default_factory=list)
    #: Segments of the slot still being received mapped so far.
    _mapped: int = 0
    #: The typed views of the slots announced but not yet whole, built when they were
    #: announced (``expect``), over address space reserved and not yet mapped.
    _views: list[list[torch.Tensor]] = field(default_factory=list)
    _unpinnable: bool = False
    #: Slots whose pages this process has mapped in (``touch_slot``, ``prefault_slot``).
    _touched: set[int] = field(default_factory=set)
    #: Held while segments are mapped or faulted in, and to close: the background request
    #: adding slots must never touch a region after it is unmapped.
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: Signalled as slots become ready, and when the background request ends.
    _ready_changed: threading.Condition = field(default_factory=threading.Condition)
    _closed: bool = False

    @classmethod
    def receiving(cls, layout_id: int, layout: Layout, slot_count: int) -> MappedLayout:
        """An empty layout that maps segments batch by batch as the daemon sends them.

        Descriptors are closed as soon as each batch is mapped: with 10,000 tensors and two
        slots, holding all 20,000 at once would exceed a typical RLIMIT_NOFILE.
        """
        mapped = cls(layout_id, layout)
        mapped.expect(slot_count)
        return mapped

    @classmethod
    def of_regions(
        cls,
        layout_id: int,
        layout: Layout,
        regions: Sequence[segment.Region],
        pinned: Mapping[int, PinnedRanges],
    ) -> MappedLayout:
        """A layout whose slots this process mapped already, one region each (a restore's
        adoption, ``handoff``), every slot ready and those in ``pinned`` registered."""
        mapped = cls(layout_id, layout, pin=bool(pinned), pinned=dict(pinned))
        mapped._regions = list(regions)
        mapped.slots = [mapped._typed_views(region) for region in mapped._regions]
        mapped.ready = len(mapped.slots)
        return mapped

    def expect(self, slot_count: int) -> None:
        """Reserve address space for ``slot_count`` more slots, whose segments come next,
        and build their typed views over it now: a registration does this while the daemon
        makes the segments (``Layouts._register``), so that the views (tens of ms at
        10,000 tensors) cost the first save nothing. A view is handed out only once its
        slot's every segment is mapped (``_map``): before, its memory is no-access."""
        sizes = self.layout.packing().sizes
        made: list[segment.Region] = []
        try:
            for _ in range(slot_count):
                made.append(segment.Region(sizes))
            views = [self._typed_views(region) for region in made]
            with self._lock:
                if self._closed:
                    raise ValueError(f"layout {self.id} was closed before its new slots came")
                self._regions.extend(made)
                if sizes:
                    self._views.extend(views)
                else:
                    self.slots.extend(views)
        except BaseException:
            for region in made:
                region.close()
            raise

    def announced_views(self, index: int) -> list[torch.Tensor]:
        """Slot ``index``'s typed views, whether or not its segments are mapped yet: until
        they are, for their shapes, strides and dtypes only (``Layouts._register``)."""
        if index < len(self.slots):
            return self.slots[index]
        return self._views[index - len(self.slots)]

    @property
    def slot_count(self) -> int:
        """Slots announced so far, whether or not all their segments arrived yet."""
        return len(self._regions)

    @property
    def expected_segments(self) -> int:
        return self.slot_count * len(self.layout.packing())

    @property
    def received_segments(self) -> int:
        return len(self.slots) * len(self.layout.packing()) + self._mapped

    def add_segments(self, fds: Sequence[int]) -> None:
        """Map the next batch (slot-major order); always closes every descriptor given."""
        try:
            with self._lock:
                self._map(fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _map(self, fds: Sequence[int]) -> None:
        if self._closed:
            raise ValueError(f"layout {self.id} was closed while its segments arrived")
        if self.received_segments + len(fds) > self.expected_segments:
            raise ValueError(
                f"daemon sent more than the {self.expected_segments} segments announced"
            )
        packing = self.layout.packing()
        for fd in fds:
            region = self._regions[len(self.slots)]
            region.map(self._mapped, fd, writable=True)
            self._mapped += 1
            if self._mapped == len(packing):
                self.slots.append(self._views.pop(0))
                self._mapped = 0

    def _typed_views(self, region: segment.Region) -> list[torch.Tensor]:
        """Every tensor's view in a slot's mapped range: the range viewed once per dtype,
        then one ``as_strided`` per tensor at its segment's place plus its place in a pack
        (aligned for any dtype). 10,000 frombuffers cost 0.1 s; 10,000 slices, each viewed
        as its dtype and then its shape, 71 ms on the build host; this, 22 ms. The strides
        of each shape are worked out once (a state dict repeats its shapes): at 100,000
        tensors, a fifth of the time besides the ``as_strided`` calls."""
        whole = _bytes(region.buffer(), region.size)  # a whole number of pages
        bases: dict[torch.dtype, torch.Tensor] = {}
        strides: dict[tuple[int, ...], tuple[int, ...]] = {}
        starts = region.offsets
        views = []
        layout = self.layout
        for spec, nbytes, (which, offset) in zip(
            layout.tensors, layout.sizes, layout.packing().places, strict=True
        ):
            dtype = FROM_SAFETENSORS[spec.dtype]
            shape = spec.shape
            if not nbytes:
                views.append(torch.empty(shape, dtype=dtype))
                continue
            base = bases.get(dtype)
            if base is None:
                base = bases[dtype] = whole.view(dtype)
            step = strides.get(shape)
            if step is None:
                step = strides[shape] = _contiguous_strides(shape)
            views.append(base.as_strided(shape, step, (starts[which] + offset) // dtype.itemsize))
        return views

    def grow(
        self,
        executor: concurrent.futures.Executor,
        add_slots: Callable[[MappedLayout], None],
    ) -> None:
        """Run ``add_slots(self)`` on ``executor`` as this layout's ``growth``; it marks the
        slots it adds ready as each is faulted in (``mark_ready``), and once it ended every
        slot it mapped is (which also wakes a save waiting for a slot it never brought)."""
        self.growth = executor.submit(add_slots, self)
        self.growth.add_done_callback(lambda _: self.mark_ready())

    def mark_ready(self, count: int | None = None) -> None:
        """The first ``count`` slots (None: every slot mapped so far) may be filled: nothing
        else writes to them any more."""
        with self._ready_changed:
            self.ready = len(self.slots) if count is None else min(count, len(self.slots))
            self._ready_changed.notify_all()

    def wait_ready(self, index: int, timeout: float | None) -> bool:
        """Wait (bounded) until slot ``index`` may be filled, or no request is adding slots
        any more; whether it may be."""

        def settled() -> bool:
            return self.ready > index or self.growth is None or self.growth.done()

        with self._ready_changed:
            self._ready_changed.wait_for(settled, timeout)
            return self.ready > index

    def complete(self) -> MappedLayout:
        """Check every segment announced arrived."""
        if self.received_segments != self.expected_segments:
            raise ValueError(
                f"daemon sent {self.received_segments} segments, expected {self.expected_segments}"
            )
        return self

    def prefault_slot(self, index: int, threads: int) -> None:
        """Fault a slot's pages in ahead of its first use (on a background thread, few
        threads: it competes with training for memory bandwidth, not for the GPU). The
        slot must not be ``ready`` yet: this writes back the bytes it read."""
        with self._lock:
            if self._closed:
                return
            pieces = _pieces(self._regions[index])
            segment.in_parallel(
                [piece.numel() for piece in pieces], lambda i: prefault(pieces[i]), threads
            )
            self._touched.add(index)

    def touch_slot(self, index: int) -> None:
        """Before the first copy into an unpinned slot (a CPU state dict), map its pages in
        by reading a byte of each, on the setup threads: the daemon wrote them when it made
        the segments, so each fault maps 16 resident pages (fault-around), where the copy's
        writes would fault once per 4 KiB page. Reads only, so it may run on any slot that
        nothing writes meanwhile; a slot pinned or touched already costs nothing."""
        if index in self._touched:
            return
        with self._lock:
            if self._closed:
                return
            pieces = _pieces(self._regions[index])
            segment.in_parallel(
                [piece.numel() for piece in pieces], lambda i: _read_pages(pieces[i])
            )
            self._touched.add(index)

    def pin_slot(self, index: int) -> None:
        """Register slot ``index`` with CUDA (with ``pin``, once, before its first copy), so
        that device-to-host copies into it run at pinned bandwidth: its range in a few large
        pieces, registered in parallel, or segment by segment where the driver refuses a
        range that spans several mappings. Registering blocks the process's other CUDA
        calls meanwhile, which is why it happens here, inside a save's measured stall,
        rather than on a background thread behind the trainer's back."""
        if not self.pin or self._unpinnable or index in self.pinned:
            return
        ranges = PinnedRanges()
        try:
            ranges.register(_pieces(self._regions[index]))
        except PIN_FAILURES as exc:
            log.info("pinning whole slot %d failed (%s); pinning segment by segment", index, exc)
            fallback = try_pin(_segments(self._regions[index], self.layout.packing().sizes))
            if fallback is None:
                self._unpinnable = True  # warned once; copies run unpinned from now on
                return
            ranges = fallback
        self.pinned[index] = ranges

    def settle(self, timeout: float | None) -> None:
        """Wait (bounded) for the background request adding slots, whatever its outcome:
        nothing may unmap a region while it maps segments into it."""
        growth = self.growth
        if growth is not None:
            concurrent.futures.wait([growth], timeout)

    def retire(self) -> None:
        """Map and fault in nothing more (waiting for what is under way): the layout is
        about to be released, and the daemon frees a released layout's pages at once, so
        a slot still being faulted in would fault. ``close`` follows."""
        with self._lock:
            self._closed = True

    def close(self) -> None:
        """Unpin, then unmap. Views handed out earlier must be gone: they would fault."""
        with self._lock:
            self._closed = True
            for ranges in self.pinned.values():
                ranges.release()  # CUDA must forget a range before it is unmapped
            self.pinned.clear()
            self.slots.clear()
            self._views.clear()
            for region in self._regions:
                region.close()
            self._regions.clear()


def _pieces(region: segment.Region) -> list[torch.Tensor]:
    """A slot's whole range in pieces of about equal bytes, one per setup thread.

    Cuts fall on segment boundaries: a device-to-host copy whose destination spans two
    registrations fails with cudaErrorInvalidValue.
    """
    whole = _bytes(region.buffer(), region.size)
    count = max(1, min(segment.MAX_SETUP_THREADS, region.size // segment.PARALLEL_MIN_BYTES))
    cuts = [0]
    for offset in region.offsets[1:]:
        if offset >= len(cuts) * region.size / count:
            cuts.append(offset)
    cuts.append(region.size)
    return [whole[start:end] for start, end in itertools.pairwise(cuts)]


def _read_pages(buffer: torch.Tensor) -> None:
    """Read a byte of every page of ``buffer`` (``touch_slot``)."""
    if buffer.numel():
        buffer[:: mmap.PAGESIZE].max()


def _segments(region: segment.Region, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Each segment's bytes in a slot's range (empty ones empty: nothing to pin)."""
    whole = _bytes(region.buffer(), region.size)
    return [whole[start : start + size] for start, size in zip(region.offsets, sizes, strict=True)]


def _bytes(buffer: ctypes.Array[ctypes.c_char], nbytes: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns that the buffer is writable
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def device_groups(devices: Sequence[torch.device]) -> dict[torch.device, list[int]]:
    """The positions of the tensors on each device, in order."""
    if len(set(devices)) == 1:  # the usual case, without a Python step per tensor
        return {devices[0]: list(range(len(devices)))}
    groups: dict[torch.device, list[int]] = {}
    for index, device in enumerate(devices):
        groups.setdefault(device, []).append(index)
    return groups


class CopyEngine:
    """Copies sources into slot views, keeping one side stream per CUDA device and, for CPU
    copies that a non-blocking save defers, one copy thread."""

    def __init__(self, gather_bytes: int | None = None) -> None:
        """``gather_bytes``: the bound on each device's scratch for gathering small tensors
        (``gather``; None: ``SHMSTAGE_GATHER_BYTES``, default 64 MiB; 0: never gather)."""
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        if gather_bytes is None:
            gather_bytes = gather_bytes_from_env()
        elif gather_bytes < 0:
            raise ValueError(f"gather_bytes={gather_bytes}: use a bound in bytes, or 0 for none")
        self._gatherer = Gatherer(gather_bytes)

    def copy(
        self,
        destinations: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        groups: Mapping[torch.device, Sequence[int]] | None = None,
        layout: Layout | None = None,
    ) -> None:
        """Copy every source into its slot view; returns when every byte has landed.

        Each device's tensors are one ``_foreach_copy_`` call: at 10,000 tensors a Python
        loop of ``copy_`` costs more than the bytes do. ``groups`` (``device_groups`` of
        the sources, which the Stager keeps per layout) saves looking at every device again.
        ``layout``: the slot's, where the views lie in it; with it, a CUDA device's small
        tensors are gathered on the device and reach the host a range at a time (``gather``).
        """
        self.start(destinations, sources, groups, None, layout)

    def start(
        self,
        destinations: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        groups: Mapping[torch.device, Sequence[int]] | None,
        deferred: Sequence[bool] | None,
        layout: Layout | None = None,
    ) -> DeferredCopy | None:
        """Copy every source into its slot view: those not ``deferred`` before returning, the
        others in the background — CUDA ones on the side stream, CPU ones on the copy thread.

        Returns the deferred copy (None when nothing is deferred). Every copy is ordered
        after the work already queued on the caller's stream, so it reads the tensors as
        they are at this call. Eager CUDA copies go first on the side stream, so that the
        host waits for them alone.
        """
        if len(destinations) != len(sources):
            raise ValueError(f"{len(sources)} sources for {len(destinations)} slot views")
        if groups is None:
            groups = device_groups([src.device for src in sources])
        eager: list[torch.cuda.Event] = []
        parts: list[DeferredCopy] = []
        try:
            with torch.no_grad():  # the views must not join the caller's autograd graph
                for device, indices in groups.items():
                    now, later = _split(indices, deferred)
                    if device.type == "cuda":
                        copy = _CudaCopy(device, layout, destinations, sources)
                        self._from_cuda(copy, now, later, eager, parts)
                        continue
                    if later:
                        parts.append(self._on_copy_thread(destinations, sources, later))
                    if now:
                        torch._foreach_copy_(*pick(destinations, sources, now))
            for event in eager:
                event.synchronize()  # one event per device, never torch.cuda.synchronize()
        except BaseException:
            for part in parts:  # nothing may still write into the slot once it is handed back
                part.wait_host(None)
            raise
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else CopyGroup(parts)

    def prepare(
        self,
        destinations: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        groups: Mapping[torch.device, Sequence[int]],
        deferred: Sequence[bool] | None,
        layout: Layout,
    ) -> None:
        """Plan, now, how a save of these sources with this ``deferred`` mask gathers them,
        allocate the scratch and launch the gathers' kernels once (``Gatherer.prepare``),
        copying nothing to the host (``Stager.reserve``): a first save of 100,000 tensors
        otherwise spends a few tenths of a second on it."""
        with torch.no_grad():
            for device, indices in groups.items():
                if device.type != "cuda":
                    continue
                side = self._side(device)
                side.wait_stream(torch.cuda.current_stream(device))  # the caller's writes
                with torch.cuda.stream(side):  # where the scratch is used
                    for part, what in zip(_split(indices, deferred), ("now", "later"), strict=True):
                        if part:
                            self._gatherer.prepare(
                                device, layout, destinations, sources, part, what
                            )

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        """The device's side stream (made on first use)."""
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        return side

    def _from_cuda(
        self,
        copy: _CudaCopy,
        now: Sequence[int],
        later: Sequence[int],
        eager: list[torch.cuda.Event],
        parts: list[DeferredCopy],
    ) -> None:
        device = copy.device
        side = self._side(device)
        side.wait_stream(torch.cuda.current_stream(device))  # caller's pending writes first
        with torch.cuda.stream(side):
            # The scratch is allocated, filled and read on this stream alone: the next
            # gather into it waits for the last copy out of it by stream order.
            if now:
                self._gatherer.copy(*copy, now, "now")
                eager.append(side.record_event())
            if later:
                nbytes = self._gatherer.copy(*copy, later, "later")
                event = torch.cuda.Event(blocking=True)  # its host wait sleeps, not spins
                side.record_event(event)
                # The sources are kept alive until the copy has read them: all of them where
                # the plan knows the bytes (a list's copy costs less than picking them).
                if nbytes is not None:
                    held = list(copy.sources)
                else:
                    held = [copy.sources[i] for i in later]
                parts.append(StreamCopy(device, event, held, nbytes))

    def _on_copy_thread(
        self,
        destinations: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        indices: Sequence[int],
    ) -> ThreadCopy:
        dsts, srcs = pick(destinations, sources, indices)
        nbytes = sum(t.numel() * t.element_size() for t in srcs)
        return ThreadCopy(self.copy_thread().submit(_copy_on_host, dsts, srcs), nbytes)

    def copy_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread deferred CPU copies run on, in order (started on first use)."""
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="shmstage-copy"
            )
        return self._thread

    def close(self, *, wait: bool = True) -> None:
        """Stop the copy thread once the copies queued on it are done (``wait``), or let
        it finish them on its own; drop the gathering scratch."""
        if self._thread is not None:
            self._thread.shutdown(wait=wait)
            self._thread = None
        self._gatherer.close()


class _CudaCopy(NamedTuple):
    """What one device's copies of a save need (``Gatherer.copy``'s first arguments)."""

    device: torch.device
    layout: Layout | None
    destinations: Sequence[torch.Tensor]
    sources: Sequence[torch.Tensor]


def _split(
    indices: Sequence[int], deferred: Sequence[bool] | None
) -> tuple[Sequence[int], list[int]]:
    """``indices`` cut into those copied now and those deferred."""
    if deferred is None:
        return indices, []
    return [i for i in indices if not deferred[i]], [i for i in indices if deferred[i]]


def _copy_on_host(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    with torch.no_grad():  # grad mode is per thread
        torch._foreach_copy_(dsts, srcs)
