"""A registered layout's slots in the trainer: views built early, handed out once mapped."""

from __future__ import annotations

import concurrent.futures
import mmap
import os

import torch
from harness import mapped_kib
from shmstage_client.connection import DaemonConnection
from shmstage_client.save.layouts import Layouts
from shmstage_client.save.slots import MappedLayout
from shmstage_client.statedict import Flattened
from shmstage_client.structure import Structures

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


def test_a_registration_runs_its_meanwhile_work_on_unmapped_views_and_survives_its_failure(
    daemon,
) -> None:
    """``Layouts.mapped(meanwhile=)`` (the Stager plans its first copy there) gets the first
    slot's views, the tensors' places by device and the layout before the daemon's answer
    is read: the views are not handed out yet, their shapes, strides and dtypes are those
    of the mapped slot to come. Work that fails there costs the registration nothing."""
    state = {f"w{i}": torch.full((i % 7 + 1, 5), float(i)) for i in range(300)}
    flat = Flattened.of(state, None, structures=Structures())
    seen: list[tuple[int, list[tuple[torch.Size, tuple[int, ...], torch.dtype]], bool]] = []

    def meanwhile(views, groups, layout) -> None:
        described = [(view.shape, view.stride(), view.dtype) for view in views]
        grouped = dict(groups) == {torch.device("cpu"): list(range(300))}
        seen.append((len(layout.tensors), described, grouped and layouts.current is None))
        raise RuntimeError("planning failed")

    connection = DaemonConnection(str(daemon.socket))
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        layouts = Layouts(connection, background)
        try:
            mapped = layouts.mapped(flat, slots=1, pin=False, timeout=30, meanwhile=meanwhile)
            [(count, described, grouped)] = seen
            assert count == 300 and grouped
            views = mapped.slots[0]
            assert described == [(view.shape, view.stride(), view.dtype) for view in views]
            torch._foreach_copy_(views, list(state.values()))  # the mapped slot takes a copy
            assert all(torch.equal(v, s) for v, s in zip(views, state.values(), strict=True))
        finally:
            layouts.release()
            layouts.close(landed=True)
            connection.close()
