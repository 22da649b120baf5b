"""Reads that checksum as they go: the same CRC-32C as the ``crc32c`` library, span by span,
across the helper's 1 MiB blocks, from a descriptor or a mapping; errors name the source."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import random
from pathlib import Path

import crc32c
import posix_ipc
import pytest

from shmstage import readsum

needs_helper = pytest.mark.skipif(
    not readsum.available(), reason="shmstage._readsum is not built or not usable here"
)

MIB = 1 << 20


def _buffer(nbytes: int) -> tuple[ctypes.Array[ctypes.c_char], int]:
    buffer = ctypes.create_string_buffer(max(nbytes, 1))
    return buffer, ctypes.addressof(buffer)


def test_the_helper_is_built_wherever_a_compiler_and_the_instruction_are() -> None:
    """The bootstrap builds it (gcc is on these machines); a build that silently failed
    would leave every restore on the slower two-pass path."""
    if platform.machine() != "x86_64" or not readsum.ENABLED:
        pytest.skip("built and used on x86-64 only, unless SHMSTAGE_NATIVE_READSUM=0")
    assert readsum.available()


@needs_helper
def test_crc32c_matches_the_library_at_every_length_alignment_and_start_value() -> None:
    """Spans of every length the lanes and the word loop meet, at odd addresses."""
    rng = random.Random(7)
    data = rng.randbytes(3 * MIB + 77)
    source = ctypes.create_string_buffer(data, len(data))
    _, address = _buffer(len(data))
    lengths = [0, 1, 7, 8, 9, 4095, 3 * 4096 - 1, 3 * 4096, 3 * 4096 + 5, MIB + 13, 3 * MIB]
    for length in lengths:
        for skew in (0, 1, 5):
            for start in (0, 0xDEADBEEF):
                values = [start]
                span = [(skew, skew + length)]
                readsum.copy(ctypes.addressof(source), address, len(data), span, values, "x")
                assert values == [crc32c.crc32c(data[skew : skew + length], start)], (length, skew)


@needs_helper
def test_a_read_checksums_each_span_across_blocks_and_continues_earlier_values(
    tmp_path: Path,
) -> None:
    data = random.Random(1).randbytes(3 * MIB + 4321)
    path = tmp_path / "data"
    path.write_bytes(b"x" * 512 + data)
    spans = [(0, 10), (10, 10), (100, MIB + 5), (2 * MIB, 3 * MIB + 4321)]  # gaps unread
    values = [0, 0, crc32c.crc32c(b"earlier"), 0]
    buffer, address = _buffer(len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        readsum.read(fd, 512, address, len(data), spans, values, str(path))
    finally:
        os.close(fd)
    assert buffer.raw[: len(data)] == data
    assert values == [
        crc32c.crc32c(data[0:10]),
        0,
        crc32c.crc32c(data[100 : MIB + 5], crc32c.crc32c(b"earlier")),
        crc32c.crc32c(data[2 * MIB :]),
    ]


@needs_helper
def test_a_copy_out_of_a_shared_memory_mapping_checksums_the_same() -> None:
    data = random.Random(2).randbytes(2 * MIB + 3)
    shm = posix_ipc.SharedMemory(None, posix_ipc.O_CREX, size=len(data))
    try:
        with mmap.mmap(shm.fd, len(data)) as mapping:
            mapping[:] = data
            source = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
            buffer, address = _buffer(len(data) - 3)
            values = [0]
            readsum.copy(source + 3, address, len(data) - 3, [(0, len(data) - 3)], values, "shm")
            assert buffer.raw[: len(data) - 3] == data[3:]
            assert values == [crc32c.crc32c(data[3:])]
            del source
    finally:
        shm.close_fd()
        shm.unlink()


@needs_helper
def test_a_file_that_ends_early_is_named_and_its_spans_keep_what_was_read(
    tmp_path: Path,
) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"abc" * 1000)
    _, address = _buffer(4000)
    values = [0]
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match=rf"{path}: the file ended before 4000 bytes"):
            readsum.read(fd, 0, address, 4000, [(0, 4000)], values, str(path))
    finally:
        os.close(fd)
    assert values == [crc32c.crc32c(b"abc" * 1000)]


@needs_helper
def test_a_closed_descriptor_raises_its_error() -> None:
    _, address = _buffer(10)
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError, match="somewhere: Bad file descriptor"):
        readsum.read(fd, 0, address, 10, [], [], "somewhere")


@needs_helper
@pytest.mark.parametrize("spans", [[(0, 11)], [(5, 8), (6, 9)], [(5, 8), (1, 2)], [(3, 2)]])
def test_spans_outside_the_read_out_of_order_or_overlapping_are_refused(
    spans: list[tuple[int, int]],
) -> None:
    _, address = _buffer(10)
    with pytest.raises(ValueError, match="is not within the 10 bytes read"):
        readsum.read(0, 0, address, 10, spans, [0] * len(spans), "x")
