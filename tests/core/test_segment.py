"""Segments: private, reserved up front, named so their daemon instance can be told."""

from __future__ import annotations

import mmap
import os
import stat

import pytest
from harness import mapped_kib

from shmstage import segment


def mapped(ref: segment.SegmentRef, fd: int, *, writable: bool) -> segment.Region:
    """One segment in a region of its own."""
    region = segment.Region([ref.size])
    region.map(0, fd, writable=writable)
    return region


def test_create_reserves_and_restricts(instance_id: str) -> None:
    instance = instance_id
    ref = segment.create(instance, 10_000)
    try:
        st = os.stat(segment.SHM_DIR + ref.name)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 10_000
        assert st.st_blocks * 512 >= 10_000  # fallocate really reserved pages
        assert segment.instance_of(ref.name) == instance
        assert segment.list_names(instance) == [ref.name]
        fd = segment.open_fd(ref, writable=True)
        mapping = mapped(ref, fd, writable=True)
        os.close(fd)
        memoryview(mapping.buffer(0)).cast("B")[:3] = b"abc"  # it outlives its descriptor
        assert os.listdir("/proc/self/fd").count(str(fd)) == 0 or True
        mapping.close()
        reread = mapped(ref, fd2 := segment.open_fd(ref, writable=False), writable=False)
        os.close(fd2)
        assert bytes(memoryview(reread.buffer(0)).cast("B")[:3]) == b"abc"
        reread.close()
    finally:
        assert segment.unlink(ref.name)
    assert segment.list_names(instance) == []
    assert not segment.unlink(ref.name)


def test_mappings_hold_no_descriptor(instance_id: str) -> None:
    """20,000 mapped segments must not mean 20,000 open descriptors (RLIMIT_NOFILE)."""
    ref = segment.create(instance_id, 4096)
    try:
        fd = segment.open_fd(ref, writable=True)
        before = len(os.listdir("/proc/self/fd"))
        mappings = [mapped(ref, fd, writable=True) for _ in range(50)]
        assert len(os.listdir("/proc/self/fd")) == before
        os.close(fd)
        for mapping in mappings:
            mapping.close()
    finally:
        segment.unlink(ref.name)


def test_a_new_segment_is_written_so_a_first_touch_only_maps_its_pages(instance_id: str) -> None:
    """Its pages are zeros written at creation, not only reserved: tmpfs then maps a
    touched page's resident neighbours in the same fault (fault-around, 64 KiB by default),
    where reserved pages would each wait for a fault of their own to be zeroed — the
    trainer's prefault before pinning (0.087 s per GiB on the H100 host against 0.009)."""
    ref = segment.create(instance_id, 8 << 20)
    try:
        fd = segment.open_fd(ref, writable=True)
        region = mapped(ref, fd, writable=True)
        os.close(fd)
        view = memoryview(region.buffer(0)).cast("B")
        assert not any(view[:: 64 << 10])  # one byte read per 64 KiB: 128 pages
        resident = mapped_kib(region.address)
        assert resident >= 4 * 128 * 4, f"{resident} KiB resident after 128 one-byte reads"
        assert not any(view)  # zeros, as before
        view.release()
        region.close()
    finally:
        segment.unlink(ref.name)


def test_zero_byte_tensors_get_a_mappable_segment(instance_id: str) -> None:
    ref = segment.create(instance_id, 0)
    try:
        assert ref.size == 1
    finally:
        segment.unlink(ref.name)


def test_a_full_dev_shm_is_an_error_not_a_sigbus() -> None:
    free = os.statvfs(segment.SHM_DIR)
    too_big = (free.f_blocks + 1) * free.f_frsize
    instance = segment.new_instance_id()
    with pytest.raises(segment.SegmentError, match="is full") as info:
        segment.create(instance, too_big)
    assert "free space there" in str(info.value)
    assert segment.list_names(instance) == []  # nothing left behind


def test_foreign_names_are_not_ours() -> None:
    assert segment.instance_of("/psm_1234") is None
    assert segment.instance_of("/shmstage.abc.def") is None


def test_small_layouts_are_set_up_on_one_thread_large_ones_balanced_by_bytes() -> None:
    small = [128 << 10] * 10_000  # 1.2 GiB, but each segment's cost is its name: one thread
    assert segment.setup_groups([4096] * 10_000) == [list(range(10_000))]
    assert segment.setup_groups([]) == []
    sizes = [256 << 20, 4096, 1 << 30, 64 << 20, 512 << 20, 12, 0, 300 << 20]
    groups = segment.setup_groups(sizes, max_threads=3)
    assert 1 <= len(groups) <= min(3, os.cpu_count() or 1)
    assert sorted(i for group in groups for i in group) == list(range(len(sizes)))
    assert all(group == sorted(group) for group in groups)
    if len(groups) > 1:  # greedy by size: no group carries more than the largest + its share
        loads = [sum(sizes[i] for i in group) for group in groups]
        assert max(loads) <= max(sizes) + sum(sizes) // len(groups)
    assert len(segment.setup_groups(small, max_threads=1)) == 1
    assert segment.setup_groups(small, max_threads=4) == [list(range(10_000))]
    # Large segments are spread; the small ones of the same layout share one thread.
    mixed = segment.setup_groups([*small, 1 << 30, 1 << 30], max_threads=3)
    if len(mixed) > 1:
        assert mixed[0] == list(range(10_000))
        assert sorted(i for group in mixed[1:] for i in group) == [10_000, 10_001]


def test_a_slot_of_64_mib_packs_is_made_on_a_thread_per_pack_up_to_the_cores() -> None:
    """The daemon makes a 1 GiB slot of 64 MiB packs on up to 16 threads (``create``'s
    bound), one pack each where the cores allow, the small last pack with one of them: a
    first save waits for the slowest thread."""
    sizes = [64 << 20] * 16 + [1 << 20]
    groups = segment.setup_groups(sizes, segment.MAX_CREATE_THREADS, segment.CREATE_MIN_BYTES)
    assert len(groups) == min(16, os.cpu_count() or 1)
    assert sorted(i for group in groups for i in group) == list(range(17))
    loads = [sum(sizes[i] for i in group) for group in groups]
    assert max(loads) - min(loads) <= 1 << 20
    assert len(segment.setup_groups(sizes)) <= 8  # pinning keeps its own bound


def test_parallel_setup_does_everything_once_or_stops_and_raises() -> None:
    done: list[int] = []
    segment.in_parallel([], done.append)
    assert done == []
    sizes = [segment.PARALLEL_MIN_BYTES] * 16
    segment.in_parallel(sizes, done.append)
    assert sorted(done) == list(range(16))

    done.clear()

    def fail_on_three(index: int) -> None:
        if index == 3:
            raise OSError(28, "no space")
        done.append(index)

    with pytest.raises(OSError, match="no space"):
        segment.in_parallel(sizes, fail_on_three)
    assert 3 not in done and len(set(done)) == len(done)


def test_a_region_maps_segments_back_to_back_at_page_boundaries(instance_id: str) -> None:
    instance = instance_id
    sizes = [10, 0, 3 * mmap.PAGESIZE + 1, mmap.PAGESIZE]
    refs = [segment.create(instance, n) for n in sizes]
    region = segment.Region(sizes)
    try:
        for index, ref in enumerate(refs):
            fd = segment.open_fd(ref, writable=True)
            region.map(index, fd, writable=True)
            os.close(fd)  # the region holds no descriptor
        assert region.offsets == [0, mmap.PAGESIZE, 2 * mmap.PAGESIZE, 6 * mmap.PAGESIZE]
        assert region.size == 7 * mmap.PAGESIZE
        memoryview(region.buffer(2)).cast("B")[-1:] = b"z"
        whole = memoryview(region.buffer()).cast("B")  # one contiguous, accessible range
        assert len(whole) == region.size and whole[2 * mmap.PAGESIZE + sizes[2] - 1] == ord("z")
        whole.release()
        fd = segment.open_fd(refs[2], writable=False)  # the bytes are the segment's own
        assert os.pread(fd, 1, sizes[2] - 1) == b"z"
        os.close(fd)
        short = segment.create(instance, 5)
        fd = segment.open_fd(short, writable=True)
        with pytest.raises(segment.SegmentError, match="5 bytes but 10 were expected"):
            region.map(0, fd, writable=True)
        os.close(fd)
    finally:
        region.close()
        for name in segment.list_names(instance):
            segment.unlink(name)
