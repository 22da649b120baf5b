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


@dataclass
class MappedLayout:
    """A registered layout as this process sees it: one list of tensor views per slot."""

    id: int
    layout: Layout
    structure_key: str
    slots: list[list[torch.Tensor]] = field(default_factory=list)
    _maps: list[mmap.mmap] = field(default_factory=list)

    @classmethod
    def from_fds(
        cls, layout_id: int, layout: Layout, slot_count: int, fds: Sequence[int]
    ) -> MappedLayout:
        """Map segment descriptors (slot-major order) and close them: mappings outlive fds."""
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
        """Unmap. Views handed out earlier must be gone, or the unmap is deferred to GC."""
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


def copy_into(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy every source into its slot view; returns when every byte has landed."""
    cuda_pairs: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in zip(destinations, sources, strict=True):
        if src.device.type == "cuda":
            cuda_pairs.setdefault(src.device, []).append((dst, src))
        else:
            dst.copy_(src.detach())
    for device, pairs in cuda_pairs.items():
        _copy_from_cuda(device, pairs)


def _copy_from_cuda(device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    caller = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(caller)  # the caller's pending writes to these tensors come first
    with torch.cuda.stream(side):
        for dst, src in pairs:
            dst.copy_(src.detach(), non_blocking=True)
    done = side.record_event()
    done.synchronize()  # one event, not torch.cuda.synchronize(): other streams may run on
