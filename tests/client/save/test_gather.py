"""Gathering small tensors before their copy to the host: the plan (which tensors, which
byte ranges, where in the scratch) on made-up sizes and places, and the gather itself run on
the CPU into a slot mapped exactly as a save maps one (memfd segments in a ``Region``), so
that every offset, view and range is the production one; only the device differs."""

from __future__ import annotations

import os

import pytest
import torch
from shmstage_client.dtypes import TO_SAFETENSORS
from shmstage_client.save import gather
from shmstage_client.save.gather import MAX_GAP, Gatherer, Run, gather_bytes_from_env, plan
from shmstage_client.save.slots import CopyEngine, MappedLayout

from shmstage.layout import Layout, TensorSpec
from shmstage.packing import Packing

CPU = torch.device("cpu")


def packed(sizes: list[int]) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    return sizes, Packing.of(sizes).places


# -- the plan -------------------------------------------------------------------------


def test_small_neighbours_in_one_segment_are_one_run_covering_their_padding() -> None:
    sizes, places = packed([100] * 300)
    made = plan(range(300), sizes, places, [True] * 300, 1 << 20)
    assert made.direct == ()
    [batch] = made.batches
    [run] = batch.runs
    assert run.members == tuple(range(300))
    assert run.offsets == tuple(128 * i for i in range(300))  # 100 bytes, padded to 128
    assert run.nbytes == 128 * 299 + 100


def test_a_run_never_covers_the_bytes_of_a_tensor_outside_the_pass() -> None:
    sizes, places = packed([100] * 300)
    indices = [i for i in range(300) if i != 150]  # 150: the other pass, device or the host
    made = plan(indices, sizes, places, [True] * 300, 1 << 20)
    runs = [run for batch in made.batches for run in batch.runs]
    assert [(run.members[0], run.members[-1]) for run in runs] == [(0, 149), (151, 299)]


def test_a_tensor_with_bytes_between_two_others_keeps_them_apart_however_close() -> None:
    sizes = [100, 10, 100]
    places = [(0, 0), (0, 100), (0, 110)]  # not packing's spacing: nothing but order tells
    made = plan([0, 2], sizes, places, [True] * 3, 1 << 20)
    assert made.batches == () and made.direct == (0, 2)


def test_empty_tensors_between_neighbours_neither_break_a_run_nor_are_copied() -> None:
    sizes, places = packed([100, 0, 0, 100] + [8] * 300)
    made = plan(range(len(sizes)), sizes, places, [s > 0 for s in sizes], 1 << 20)
    [run] = made.batches[0].runs
    assert run.members[:2] == (0, 3)
    assert 1 not in made.direct and 2 not in made.direct


def test_large_tensors_go_direct_without_parting_the_small_ones_around_them() -> None:
    sizes, places = packed([100] * 150 + [2 << 20] + [100] + [4 << 20] + [100] * 150)
    able = [s < gather.GATHER_BELOW for s in sizes]
    made = plan(range(len(sizes)), sizes, places, able, 1 << 20)
    # The large ones have a segment each: in the small ones' segment nothing lies between
    # 149, 151 and 153, so they are neighbours there.
    assert made.direct == (150, 152)
    [run] = [run for batch in made.batches for run in batch.runs]
    assert run.members == (*range(150), 151, *range(153, 303))


def test_an_ungatherable_tensor_parts_its_neighbours_and_goes_direct() -> None:
    sizes, places = packed([100] * 300)
    able = [i != 100 for i in range(300)]  # a complex tensor, say
    made = plan(range(300), sizes, places, able, 1 << 20)
    assert made.direct == (100,)
    runs = [run.members for batch in made.batches for run in batch.runs]
    assert runs == [tuple(range(100)), tuple(range(101, 300))]


def test_runs_stop_at_segment_ends_and_at_gaps_wider_than_padding() -> None:
    sizes = [100] * 6
    places = [(0, 0), (0, 128), (1, 0), (1, 128), (1, 128 + 100 + MAX_GAP), (1, 1000)]
    made = plan(range(6), sizes, places, [True] * 6, 1 << 20)
    runs = [run.members for batch in made.batches for run in batch.runs]
    assert runs == [(0, 1), (2, 3)]  # 4 starts MAX_GAP past 3's end: not padding
    assert made.direct == (4, 5)


def test_runs_and_batches_stay_within_the_scratch_bound_and_keep_alignment() -> None:
    sizes, places = packed([1000 + 24 * (i % 7) for i in range(3000)])
    limit = 64 << 10
    made = plan(range(3000), sizes, places, [True] * 3000, limit)
    assert made.direct == ()
    assert made.scratch_bytes <= limit
    covered = []
    for batch in made.batches:
        assert batch.nbytes <= limit
        previous_end = 0
        for run, at in zip(batch.runs, batch.at, strict=True):
            assert at >= previous_end and at % 64 == run.start % 64
            previous_end = at + run.nbytes
            covered.extend(run.members)
    assert covered == list(range(3000))
    assert len(made.batches) > 40  # ~3.1 MB through 64 KiB


def test_a_tensor_larger_than_the_bound_goes_direct() -> None:
    sizes, places = packed([4096] * 300)
    made = plan(range(300), sizes, places, [True] * 300, 2048)
    assert made.batches == () and made.direct == tuple(range(300))


def test_the_scratch_bound_comes_from_the_environment() -> None:
    assert gather_bytes_from_env({}) == 64 << 20  # one packed segment
    assert gather_bytes_from_env({"SHMSTAGE_GATHER_BYTES": "0"}) == 0
    assert gather_bytes_from_env({"SHMSTAGE_GATHER_BYTES": " 1048576 "}) == 1 << 20
    for bad in ("-1", "64MiB"):
        with pytest.raises(ValueError, match="SHMSTAGE_GATHER_BYTES"):
            gather_bytes_from_env({"SHMSTAGE_GATHER_BYTES": bad})

    with pytest.raises(ValueError, match="gather_bytes=-1"):
        CopyEngine(-1)


# -- the gather, on the CPU, into a slot mapped as a save maps it ---------------------


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16, torch.bool]


def state(count: int, seed: int = 0) -> list[torch.Tensor]:
    """Mixed dtypes and sizes (1 B to 2 KiB, a few large, an empty one), some sources
    strided (a transposed matrix, a sliced row), as a trainer's would be."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        if i == 7:
            shape: tuple[int, ...] = (0, 5)
        elif i % 97 == 0:
            shape = (300, 1000)  # over GATHER_BELOW for every dtype here but uint8/bool
        else:
            shape = (int(torch.randint(1, 40, (), generator=generator)), 3)
        raw = torch.randint(0, 255, shape, dtype=torch.uint8, generator=generator)
        tensor = raw.to(dtype) if dtype != torch.bool else raw > 127
        if i % 11 == 3 and tensor.dim() == 2 and tensor.numel():
            tensor = tensor.t().contiguous().t()  # same shape, column-major strides
        elif i % 13 == 5 and tensor.numel():
            wide = torch.zeros((tensor.shape[0], tensor.shape[1] * 2), dtype=dtype)
            wide[:, ::2] = tensor
            tensor = wide[:, ::2]  # every other column of a wider one
        tensors.append(tensor)
    return tensors


def slot_of(tensors: list[torch.Tensor]) -> tuple[MappedLayout, list[torch.Tensor]]:
    """A slot mapped from real memfd segments, laid out by the layout's packing."""
    layout = Layout.of(
        TensorSpec(f"t{i}", TO_SAFETENSORS[t.dtype], tuple(t.shape)) for i, t in enumerate(tensors)
    )
    mapped = MappedLayout.receiving(1, layout, 1)
    fds = []
    for size in layout.packing().sizes:
        fd = os.memfd_create("shmstage-test-gather")
        os.ftruncate(fd, max(size, 1))
        fds.append(fd)
    mapped.add_segments(fds)
    return mapped.complete(), mapped.slots[0]


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def fill(views: list[torch.Tensor], byte: int) -> None:
    for view in views:
        if view.numel():
            view.view(torch.uint8).fill_(byte)


@pytest.mark.parametrize("buffers", [1, 2])
def test_gathered_and_direct_copies_land_bit_exact_with_zeros_in_the_padding(buffers: int) -> None:
    sources = state(2000)
    mapped, slot = slot_of(sources)
    fill(slot, 0xAB)
    gatherer = Gatherer(64 << 10, buffers)
    gatherer.copy(CPU, mapped.layout, slot, sources, list(range(len(sources))), "now")
    gatherer._scratch[CPU].fill_(0xCD)  # as another layout's gather would leave it
    fill(slot, 0xAB)
    gatherer.copy(CPU, mapped.layout, slot, sources, list(range(len(sources))), "now")
    for i, (dst, src) in enumerate(zip(slot, sources, strict=True)):
        assert as_bytes(dst) == as_bytes(src), f"tensor {i}"
    prepared = gatherer._prepared[(id(mapped.layout), CPU, "now", len(sources))]
    gathered = {m for batch in prepared.plan.batches for run in batch.runs for m in run.members}
    assert len(gathered) > 1500
    large = {i for i in range(2000) if i % 97 == 0 and sources[i].dtype != torch.uint8}
    assert large & gathered == set()
    # Within a run, the bytes between members are the scratch's zeros, not stale bytes.
    run = prepared.plan.batches[0].runs[0]
    host = gather.host_range(slot, run)
    ends = [o + mapped.layout.sizes[m] for o, m in zip(run.offsets, run.members, strict=True)]
    for end, start in zip(ends, run.offsets[1:], strict=False):
        assert host[end:start].eq(0).all()
    assert gatherer._scratch[CPU].numel() <= 64 << 10
    assert len(set(prepared.bases)) == buffers  # batches alternate between the buffers
    # Strided sources go in copies of their own: one would cost a CUDA batch its kernels.
    for groups in prepared.groups:
        for group in groups:
            assert len({t.is_contiguous() for t in group.sources(sources)}) == 1
    assert any(not t.is_contiguous() for t in sources)
    mapped.close()


def test_half_and_eight_bit_floats_are_gathered_as_their_bits_nan_payloads_kept() -> None:
    """The batched CUDA copy moves bf16, f16 and float8 through float32, which rewrites NaN
    payloads (an H100 changed a few bytes of most random-byte bf16 tensors): such sources
    are read as integers of their size, so every bit arrives. float32 is copied as itself."""
    generator = torch.Generator().manual_seed(3)
    dtypes = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32]
    sources = [
        torch.randint(0, 256, (4 * 64,), dtype=torch.uint8, generator=generator)
        .view(dtypes[i % 4]).view(-1, 2)[:, :1 if i % 5 == 0 else 2]  # some strided
        for i in range(400)
    ]  # fmt: skip
    assert any(torch.isnan(t.float()).any() for t in sources)
    mapped, slot = slot_of(sources)
    gatherer = Gatherer(1 << 20)
    gatherer.copy(CPU, mapped.layout, slot, sources, list(range(len(sources))), "now")
    for i, (dst, src) in enumerate(zip(slot, sources, strict=True)):
        assert as_bytes(dst) == as_bytes(src), f"tensor {i}"
    [prepared] = gatherer._prepared.values()
    kinds = {(g.views[0].dtype, g.bits) for groups in prepared.groups for g in groups}
    assert kinds == {(torch.int16, torch.int16), (torch.uint8, torch.uint8),
                     (torch.float32, None)}  # fmt: skip
    for groups in prepared.groups:
        for group in groups:
            read = group.read(sources)
            assert {t.dtype for t in read} == {group.views[0].dtype}
            assert [t.data_ptr() for t in read] == [t.data_ptr() for t in group.sources(sources)]
    mapped.close()


def test_a_pass_leaves_the_other_pass_s_bytes_alone_and_keeps_its_plan() -> None:
    sources = state(1200, seed=1)
    mapped, slot = slot_of(sources)
    fill(slot, 0xAB)
    now = [i for i in range(1200) if (i // 50) % 2 == 0]
    later = [i for i in range(1200) if (i // 50) % 2 == 1]
    gatherer = Gatherer(1 << 20)
    gatherer.copy(CPU, mapped.layout, slot, sources, now, "now")
    for i in later:
        if slot[i].numel():
            assert slot[i].view(torch.uint8).eq(0xAB).all(), f"tensor {i} was written"
    key = (id(mapped.layout), CPU, "now", len(now))
    kept = gatherer._prepared[key]
    changed = [t.clone() + 1 if t.dtype != torch.bool else ~t for t in sources]
    gatherer.copy(CPU, mapped.layout, slot, changed, now, "now")
    assert gatherer._prepared[key] is kept
    gatherer.copy(CPU, mapped.layout, slot, changed, later, "later")
    for i, (dst, src) in enumerate(zip(slot, changed, strict=True)):
        assert as_bytes(dst) == as_bytes(src), f"tensor {i}"
    mapped.close()


def test_a_plan_made_ahead_is_the_one_saves_use_blocking_or_not() -> None:
    """What ``Stager.reserve`` makes (``prepare``) is what the saves then copy by: the
    blocking save's pass and the non-blocking save's two passes each keep their plan."""
    sources = state(900, seed=5)
    mapped, slot = slot_of(sources)
    everything = list(range(900))
    now, later = everything[:450], everything[450:]
    gatherer = Gatherer(1 << 20)
    for part, what in ((everything, "now"), (now, "now"), (later, "later")):
        gatherer.prepare(CPU, mapped.layout, slot, sources, part, what)
    made = dict(gatherer._prepared)
    assert len(made) == 3 and gatherer._scratch
    for _ in range(2):  # a blocking save, then a non-blocking one, twice
        gatherer.copy(CPU, mapped.layout, slot, sources, everything, "now")
        gatherer.copy(CPU, mapped.layout, slot, sources, now, "now")
        gatherer.copy(CPU, mapped.layout, slot, sources, later, "later")
        assert gatherer._prepared.keys() == made.keys()
        assert all(gatherer._prepared[key] is plan for key, plan in made.items())
    for dst, src in zip(slot, sources, strict=True):
        assert as_bytes(dst) == as_bytes(src)
    mapped.close()


def test_a_source_whose_strides_changed_since_the_plan_is_still_copied_exactly() -> None:
    sources = state(600, seed=2)
    mapped, slot = slot_of(sources)
    gatherer = Gatherer(1 << 20)
    gatherer.copy(CPU, mapped.layout, slot, sources, list(range(600)), "now")
    flipped = [
        t.t().contiguous().t() if t.dim() == 2 and t.is_contiguous() and t.numel() else t.clone()
        for t in sources
    ]
    gatherer.copy(CPU, mapped.layout, slot, flipped, list(range(600)), "now")
    for i, (dst, src) in enumerate(zip(slot, flipped, strict=True)):
        assert as_bytes(dst) == as_bytes(src), f"tensor {i}"
    mapped.close()


def test_no_bound_means_every_tensor_is_copied_directly_without_a_scratch() -> None:
    sources = state(400, seed=3)
    mapped, slot = slot_of(sources)
    gatherer = Gatherer(0)
    gatherer.copy(CPU, mapped.layout, slot, sources, list(range(400)), "now")
    assert gatherer._scratch == {} and gatherer._prepared == {}
    for dst, src in zip(slot, sources, strict=True):
        assert as_bytes(dst) == as_bytes(src)
    mapped.close()


def test_a_slot_not_laid_out_as_the_plan_says_is_refused() -> None:
    sources = state(300, seed=4)
    mapped, slot = slot_of(sources)
    run = Run(members=(1, 2), offsets=(0, 4096), nbytes=4200, start=0)
    with pytest.raises(ValueError, match="not laid out as the layout's packing"):
        gather.host_range(slot, run)
    mapped.close()
