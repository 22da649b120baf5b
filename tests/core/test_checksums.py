"""CRC-32C of many buffers, in pieces on threads: always the checksum of the whole buffer."""

from __future__ import annotations

import concurrent.futures
import mmap
import os

import crc32c
import pytest

from shmstage.checksums import checksums, combine


@pytest.mark.parametrize(("len_a", "len_b"), [(0, 0), (1, 0), (0, 1), (1000, 777), (5, 1 << 20)])
def test_combining_two_checksums_gives_the_checksum_of_the_concatenation(
    len_a: int, len_b: int
) -> None:
    a, b = os.urandom(len_a), os.urandom(len_b)
    assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_combining_over_512_mib_or_more_is_exact() -> None:
    """Parts that large occur where the writer's regions cut a large tensor; a shortcut
    taken from CRC-32 (whose powers of x repeat every 32 squarings) gave wrong checksums
    for them. B is all zeros: an anonymous mapping reads as zeros without taking memory."""
    a, len_b = os.urandom(100), (1 << 29) + 4097
    with mmap.mmap(-1, len_b) as b:
        crc_b = crc32c.crc32c(b)
        assert combine(crc32c.crc32c(a), crc_b, len_b) == crc32c.crc32c(b, crc32c.crc32c(a))


SIZES = [0, 1, 5, 100, 4096, 1 << 20, (3 << 20) + 7]


@pytest.mark.parametrize("piece", [1, 1000, 1 << 19, 32 << 20])
def test_buffers_cut_into_pieces_on_threads_checksum_as_a_whole(piece: int) -> None:
    buffers = [os.urandom(n) for n in SIZES]
    expected = [crc32c.crc32c(b) for b in buffers]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        views = [memoryview(b) for b in buffers]
        assert checksums(views, pool, piece=max(piece, 64)) == expected
    assert checksums([memoryview(b) for b in buffers], piece=max(piece, 64)) == expected


def test_a_flipped_byte_changes_the_checksum_of_its_buffer_only() -> None:
    buffers = [bytearray(os.urandom(n)) for n in (10, 1 << 20, 77)]
    before = checksums([memoryview(b) for b in buffers], piece=4096)
    buffers[1][123_456] ^= 0x01
    after = checksums([memoryview(b) for b in buffers], piece=4096)
    assert [b != a for b, a in zip(before, after, strict=True)] == [False, True, False]
