"""A registered layout's slots in the trainer: views built early, handed out once mapped."""

from __future__ import annotations

import mmap
import os

import torch
from harness import mapped_kib
from shmstage_client.save.slots import MappedLayout

from shmstage import segment
from shmstage.layout import Layout, TensorSpec


def layout_of(count: int) -> Layout:
    """``count`` small bf16 tensors (packed into shared segments past 256) and one of 2 MiB
    (a segment of its own)."""
    specs = [TensorSpec(f"t{i}", "BF16", (i % 50 + 1, 3)) for i in range(count)]
    specs.append(TensorSpec("big", "BF16", (1 << 20,)))
    return Layout.of(specs)


def test_a_slots_views_are_built_when_it_is_announced_and_handed_out_once_it_is_mapped() -> None:
    """The views of a slot are built when it is announced (``expect``: a registration does
    so while the daemon makes the segments), and handed out only once every one of its
    segments is mapped — before, their memory is reserved address space nobody may touch.
    They then write exactly where the packing puts each tensor."""
    layout = layout_of(600)
    packing = layout.packing()
    assert 1 < len(packing) < len(layout.tensors)
    mapped = MappedLayout.receiving(1, layout, 1)
    assert mapped.slots == []
    assert [len(views) for views in mapped._views] == [len(layout.tensors)]
    fds = []
    for size in packing.sizes:
        fd = os.memfd_create("shmstage-test-mapped")
        os.ftruncate(fd, max(size, 1))
        fds.append(os.dup(fd))  # add_segments closes what it maps; these stay to read back
        mapped.add_segments([fd])
        if len(fds) < len(packing):
            assert mapped.slots == []
    mapped.complete()
    views = mapped.slots[0]
    assert len(views) == len(layout.tensors) and mapped._views == []
    for index, view in enumerate(views):
        view.fill_(float(index % 200 + 1))
    try:
        places = zip(layout.tensors, packing.places, strict=True)
        for index, (spec, (which, offset)) in enumerate(places):
            with mmap.mmap(fds[which], 0, prot=mmap.PROT_READ) as segment:
                raw = segment[offset : offset + spec.nbytes]
            read = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16)
            assert torch.equal(read, torch.full_like(read, float(index % 200 + 1))), spec.key
    finally:
        mapped.close()
        for fd in fds:
            os.close(fd)


def test_an_unpinned_slot_is_mapped_in_before_its_first_copy(instance_id: str) -> None:
    """A slot that is not pinned (a CPU state dict) has its pages mapped into the trainer
    before its first copy (``touch_slot``, which ``make_ready`` calls), by reads that map
    16 of the daemon's written pages a fault — the copy's writes would fault each 4 KiB page
    in. Only read: the bytes stay what they were."""
    layout = layout_of(300)
    refs = [segment.create(instance_id, size) for size in layout.packing().sizes]
    mapped = MappedLayout.receiving(1, layout, 1)
    try:
        fds = [segment.open_fd(ref, writable=True) for ref in refs]
        mapped.add_segments(fds)
        mapped.complete()
        views = mapped.slots[0]
        views[-1][7] = 3.0  # what an earlier checkpoint left there
        region = mapped._regions[0]
        before = mapped_kib(region.address, region.size)
        mapped.touch_slot(0)
        assert mapped_kib(region.address, region.size) >= region.size // 1024 > 2 * before
        assert float(views[-1][7]) == 3.0 and float(views[-1].sum()) == 3.0
    finally:
        mapped.close()
        for ref in refs:
            segment.unlink(ref.name)
