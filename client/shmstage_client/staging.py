"""The trainer's side of a layout: its slots mapped into this process, and the copy into them.

The client maps every segment once per layout and keeps typed tensor views over the
mappings. Each save copies from the tensors passed to *that* save — never from cached
source pointers — into the slot the daemon granted.

CPU tensors are copied with ``Tensor.copy_`` (a memcpy for contiguous sources; strided
sources are gathered). CUDA tensors are copied on a side stream that first waits on the
caller's current stream, then one event wait — never a device-wide synchronize, so work
queued on other streams cannot delay the save.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shmstage import segment
from shmstage.layout import Layout
from shmstage_client.dtypes import FROM_SAFETENSORS
from shmstage_client.pinning import PinnedRanges, try_pin


@dataclass
class MappedLayout:
    """A registered layout as this process sees it: one list of tensor views per slot."""

    id: int
    layout: Layout
    structure_key: str
    slots: list[list[torch.Tensor]] = field(default_factory=list)
    pinned: PinnedRanges | None = None
    _maps: list[mmap.mmap] = field(default_factory=list)

    @classmethod
    def from_fds(
        cls,
        layout_id: int,
        layout: Layout,
        slot_count: int,
        fds: Sequence[int],
        *,
        pin: bool = False,
    ) -> MappedLayout:
        """Map segment descriptors (slot-major order) and close them: mappings outlive fds.

        With ``pin``, every mapping is also registered with CUDA (once, here), so later
        device-to-host copies into it run at pinned bandwidth.
        """
        mapped = cls(layout_id, layout, layout.structure_key)
        expected = slot_count * len(layout.tensors)
        if len(fds) != expected:
            raise ValueError(f"daemon sent {len(fds)} segments, expected {expected}")
        views: list[torch.Tensor] = []
        try:
            for index, fd in enumerate(fds):
                spec = layout.tensors[index % len(layout.tensors)]
                mapping = segment.map_fd(fd, segment.mapping_size(spec.nbytes), writable=True)
                mapped._maps.append(mapping)
                views.append(_typed_view(mapping, spec.nbytes, spec.dtype, spec.shape))
            if pin:
                mapped.pinned = try_pin([_raw(view) for view in views])
        except BaseException:
            views.clear()
            mapped.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        per_slot = len(layout.tensors)
        mapped.slots = [views[i * per_slot : (i + 1) * per_slot] for i in range(slot_count)]
        return mapped

    def close(self) -> None:
        """Unpin, then unmap. Views handed out earlier must be gone, or GC unmaps later."""
        if self.pinned is not None:
            self.pinned.release()  # CUDA must forget a range before it is unmapped
            self.pinned = None
        self.slots.clear()
        for mapping in self._maps:
            with contextlib.suppress(BufferError):
                mapping.close()
        self._maps.clear()


def _typed_view(
    mapping: mmap.mmap, nbytes: int, dtype: str, shape: tuple[int, ...]
) -> torch.Tensor:
    torch_dtype = FROM_SAFETENSORS[dtype]
    if nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    return raw.view(torch_dtype).view(shape)


def _raw(view: torch.Tensor) -> torch.Tensor:
    """The bytes behind a typed slot view (empty for zero-size tensors)."""
    return view.reshape(-1).view(torch.uint8)


class CopyEngine:
    """Copies sources into slot views, keeping one side stream per CUDA device."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        """Copy every source into its slot view; returns when every byte has landed."""
        cuda_pairs: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in zip(destinations, sources, strict=True):
            if src.device.type == "cuda":
                cuda_pairs.setdefault(src.device, []).append((dst, src))
            else:
                dst.copy_(src.detach())
        events = [self._copy_from_cuda(device, pairs) for device, pairs in cuda_pairs.items()]
        for event in events:
            event.synchronize()  # one event per device, never torch.cuda.synchronize()

    def _copy_from_cuda(
        self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.cuda.Event:
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # caller's pending writes first
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src.detach(), non_blocking=True)
        return side.record_event()
