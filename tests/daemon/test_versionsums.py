"""A published version's checksums as the daemon computes them: real segments in
/dev/shm, read the way a persist job reads them, every tensor's CRC-32C exactly the one
of its bytes — whether it is packed with others, cut into pieces, or empty — and a
segment its publisher truncated is an error, not a fault that kills the daemon.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import mmap
import os
import time
from collections.abc import Iterator
from types import SimpleNamespace

import crc32c
import pytest
from shmstage_daemon import versionsums
from shmstage_daemon.gather import SegmentResized

from shmstage import segment
from shmstage.layout import Layout, TensorSpec
from shmstage.segment import SegmentRef


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(versionsums.PIECE_THREADS) as executor:
        yield executor


def staged(layout: Layout, instance: str) -> tuple[list[SegmentRef], list[bytes]]:
    """The layout's segments, each tensor's bytes written where the daemon stages it. Made
    under ``instance``, a live instance's id (conftest's ``instance_id``): under an id no
    daemon holds, another test's daemon starting meanwhile reaps them as a dead daemon's."""
    packing = layout.packing()
    refs = [segment.create(instance, size) for size in packing.sizes]
    contents = []
    places = zip(packing.places, layout.sizes, strict=True)
    for index, ((which, offset), nbytes) in enumerate(places):
        data = bytes((index * 7 + at) % 251 for at in range(min(nbytes, 4096)))
        data = (data * (nbytes // max(len(data), 1) + 1))[:nbytes]
        fd = segment.open_fd(refs[which], writable=True)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        contents.append(data)
    return refs, contents


def test_every_tensors_checksum_is_its_bytes_packed_cut_into_pieces_or_empty(
    pool: concurrent.futures.ThreadPoolExecutor, read_passes: str, instance_id: str
) -> None:
    big = (versionsums.PIECE_BYTES * 2 + 1000) // 4  # three pieces, the last one short
    specs = [TensorSpec("big", "F32", (big,)), TensorSpec("empty", "F32", (0,))]
    specs += [TensorSpec(f"small.{i}", "F32", (i + 1,)) for i in range(300)]  # packed
    layout = Layout(tuple(specs))
    refs, contents = staged(layout, instance_id)
    try:
        assert len(layout.packing().sizes) < len(specs), "the small ones share a segment"
        assert versionsums.compute(layout, refs, pool) == [crc32c.crc32c(c) for c in contents]
    finally:
        for ref in refs:
            segment.unlink(ref.name)


def test_a_segment_truncated_by_its_publisher_is_an_error_not_a_fault(
    pool: concurrent.futures.ThreadPoolExecutor, read_passes: str, instance_id: str
) -> None:
    layout = Layout((TensorSpec("w", "F32", (1 << 20,)),))
    refs, _contents = staged(layout, instance_id)
    try:
        fd = segment.open_fd(refs[0], writable=True)
        os.ftruncate(fd, mmap.PAGESIZE)  # what a publisher holding it writable may do
        os.close(fd)
        with pytest.raises((OSError, SegmentResized), match=refs[0].name):
            versionsums.compute(layout, refs, pool)
    finally:
        segment.unlink(refs[0].name)


def test_a_slots_first_version_is_checksummed_after_its_readers_register_it_later_ones_at_once(
    instance_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first version in a slot waits (its readers register the slot with CUDA then,
    and a checksum pass over the same pages slowed that by half); the next in that slot
    does not. Real segments; the channel bookkeeping is a stand-in that records what the
    daemon's ``Channels.checksummed`` would be told, and when."""
    layout = Layout((TensorSpec("w", "F32", (1024,)),))
    monkeypatch.setattr(versionsums, "FIRST_LAP_S_PER_GIB", 1.0 * (1 << 30) / layout.nbytes)
    refs, contents = staged(layout, instance_id)
    heard: list[tuple[int, list[int] | None, float]] = []

    class Told:
        def checksummed(self, version: SimpleNamespace, sums: list[int] | None) -> None:
            heard.append((version.step, sums, time.monotonic()))

    slot = SimpleNamespace(serial=1, segments=refs, version=None)
    staged_layout = SimpleNamespace(layout=layout)

    async def publish_twice() -> list[float]:
        sums = versionsums.VersionSums(Told())  # type: ignore[arg-type]
        started = []
        try:
            for step in (1, 2):
                slot.version = SimpleNamespace(staged=staged_layout, slot=slot, step=step)
                started.append(time.monotonic())
                sums.start(slot.version, 0)  # type: ignore[arg-type]
                while len(heard) < step:
                    await asyncio.sleep(0.005)
        finally:
            sums.shutdown()
        return started

    try:
        started = asyncio.run(asyncio.wait_for(publish_twice(), 30))
    finally:
        segment.unlink(refs[0].name)
    want = [crc32c.crc32c(contents[0])]
    assert [(step, sums) for step, sums, _ in heard] == [(1, want), (2, want)]
    assert heard[0][2] - started[0] >= 0.95  # waited for its readers
    assert heard[1][2] - started[1] < 0.95  # the next lap did not
