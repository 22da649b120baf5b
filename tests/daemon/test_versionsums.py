"""A published version's checksums as the daemon computes them: real segments in
/dev/shm, read the way a persist job reads them, every tensor's CRC-32C exactly the one
of its bytes — whether it is packed with others, cut into pieces, or empty — and a
segment its publisher truncated is an error, not a fault that kills the daemon.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
from collections.abc import Iterator

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
