"""CRC-32C computed with matrix products on the tensor's own device equals the ``crc32c``
library's, for every length, alignment and gap, however the bytes arrive.

On the build host these run on the CPU (the same code as on a GPU); where CUDA is present
they run on the GPU too.
"""

from __future__ import annotations

import random

import crc32c
import pytest
import torch
from shmstage_client.restore.device_checks import BLOCK, DeviceChecksums

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def expected(buffer: torch.Tensor, ranges: list[tuple[int, int]]) -> list[int]:
    host = buffer.cpu().numpy().tobytes()
    return [crc32c.crc32c(host[offset : offset + length]) for offset, length in ranges]


def layout(rng: random.Random, lengths: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Ranges of ``lengths`` after the slack, with gaps of 0 to a block between them, in a
    buffer of random bytes."""
    offset, ranges = BLOCK + rng.randint(0, 99), []
    for length in lengths:
        ranges.append((offset, length))
        offset += length + rng.choice([0, 0, 1, 7, 64, BLOCK])
    generator = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    size = offset + rng.randint(0, 9)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator), ranges


def stream_for(device: str) -> torch.cuda.Stream | None:
    return torch.cuda.Stream() if device == "cuda" else None


@pytest.mark.parametrize("device", DEVICES)
def test_every_length_around_the_block_size_and_every_gap_matches_crc32c(device: str) -> None:
    rng = random.Random(7)
    edges = [0, 1, 3, 4, 5, 100, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK - 5]
    for _ in range(4):
        buffer, ranges = layout(rng, [*rng.sample(edges, len(edges)), 70_001, 300_000])
        buffer = buffer.to(device)
        sums = DeviceChecksums(buffer, ranges, stream_for(device))
        assert sums.finish() == expected(buffer, ranges)


@pytest.mark.parametrize("device", DEVICES)
def test_a_range_of_many_blocks_carries_each_block_by_its_distance(device: str) -> None:
    """5 MiB and 3 bytes: 1,281 blocks, distances with eleven binary digits."""
    buffer, ranges = layout(random.Random(3), [(5 << 20) + 3])
    buffer = buffer.to(device)
    assert DeviceChecksums(buffer, ranges, stream_for(device)).finish() == expected(buffer, ranges)


@pytest.mark.parametrize("device", DEVICES)
def test_checking_as_the_bytes_arrive_equals_checking_them_at_the_end(device: str) -> None:
    """Bytes arrive in chunks that cut ranges and blocks anywhere; each ``advance`` checks
    only blocks wholly below what arrived, so the bytes after may still change."""
    rng = random.Random(11)
    final, ranges = layout(rng, [rng.randint(0, 40_000) for _ in range(40)])
    final = final.to(device)
    arriving = torch.zeros_like(final)
    sums = DeviceChecksums(arriving, ranges, stream_for(device))
    ready = 0
    while ready < final.numel():
        end = min(final.numel(), ready + rng.randint(1, 30_000))
        arriving[ready:end] = final[ready:end]
        if sums._stream is not None:
            sums._stream.wait_stream(torch.cuda.current_stream())
        sums.advance(end)
        ready = end
    assert sums.finish() == expected(final, ranges)


@pytest.mark.parametrize("device", DEVICES)
def test_one_flipped_bit_anywhere_changes_that_range_s_checksum_only(device: str) -> None:
    rng = random.Random(5)
    buffer, ranges = layout(rng, [BLOCK * 3 + 17, 50, BLOCK])
    buffer = buffer.to(device)
    good = DeviceChecksums(buffer, ranges, stream_for(device)).finish()
    for which, (offset, length) in enumerate(ranges):
        for position in (0, length // 2, length - 1):
            for bit in (0, 7):
                flipped = buffer.clone()
                flipped[offset + position] ^= 1 << bit
                got = DeviceChecksums(flipped, ranges, stream_for(device)).finish()
                assert [g != w for g, w in zip(got, good, strict=True)] == [
                    i == which for i in range(len(ranges))
                ]


def test_ranges_inside_the_slack_or_overlapping_are_refused() -> None:
    buffer = torch.zeros(4 * BLOCK, dtype=torch.uint8)
    with pytest.raises(ValueError, match="slack"):
        DeviceChecksums(buffer, [(10, 5)])
    with pytest.raises(ValueError, match="overlaps"):
        DeviceChecksums(buffer, [(BLOCK, 100), (BLOCK + 50, 10)])


def test_no_ranges_and_empty_ranges() -> None:
    buffer = torch.zeros(2 * BLOCK, dtype=torch.uint8)
    assert DeviceChecksums(buffer, []).finish() == []
    assert DeviceChecksums(buffer, [(BLOCK, 0), (BLOCK, 0)]).finish() == [0, 0]
