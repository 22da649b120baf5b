"""The transfer to a device (``restore.transfer``) on real files and mappings, with chunks
smaller than the tensors, so that every checksum is combined from parts computed on
several threads.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch
from harness import assert_same
from shmstage_client import ChecksumError
from shmstage_client.restore import host_staging
from shmstage_client.restore import transfer as transfer_module
from shmstage_client.restore.sources import FileSource, MappedSource
from shmstage_client.restore.transfer import Placement, transfer

from shmstage import checksums


def _packed(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[Placement]]:
    """The tensors back to back, no padding (as in a data file), and where each is."""
    import crc32c

    blobs, placements, offset = [], [], 0
    for key, tensor in tensors.items():
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        placements.append(
            Placement(key, tensor.dtype, tuple(tensor.shape), offset, len(raw), crc32c.crc32c(raw))
        )
        blobs.append(raw)
        offset += len(raw)
    return b"".join(blobs), placements


CASES = {
    "flags": torch.tensor([True, False, True]),  # 3 bytes: the next tensors are unaligned
    "w": torch.randn(5000, generator=torch.Generator().manual_seed(0)),
    "empty": torch.zeros(0, 4, dtype=torch.float64),
    "i": torch.arange(1000, dtype=torch.int64),
    "c": torch.randn(77, dtype=torch.complex64),
}


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_file_read_in_small_chunks_on_threads_is_bit_exact_and_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int, read_passes: str
) -> None:
    monkeypatch.setattr(host_staging, "CHUNK", 4096)  # tensors span chunks and threads
    data, placements = _packed(CASES)
    path = tmp_path / "data"
    path.write_bytes(b"H" * 100 + data)
    fd = os.open(path, os.O_RDONLY)
    try:
        source = FileSource(fd, 100, len(data), str(path))
        got = transfer(source, placements, torch.device("cpu"), threads=threads)
        assert_same(got, CASES, key_order=False)
        raw = bytearray(path.read_bytes())
        raw[100 + placements[1].offset + 4097] ^= 0x10  # a byte in "w"'s second chunk
        path.write_bytes(bytes(raw))
        with pytest.raises(ChecksumError, match=r"tensor 'w' in .*data: checksum mismatch"):
            transfer(source, placements, torch.device("cpu"), threads=threads)
        unchecked = transfer(source, placements, torch.device("cpu"), verify=False)
        assert not torch.equal(unchecked["w"], CASES["w"])
    finally:
        os.close(fd)


def test_the_combining_a_check_needs_is_worked_out_while_the_readers_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every length the end of a restore combines over was expected before (so the
    arithmetic for it was done while the bytes were still coming)."""
    monkeypatch.setattr(host_staging, "CHUNK", 4096)  # "w" spans 5 chunks, "i" 2 or 3
    data, placements = _packed(CASES)
    expected: set[int] = set()
    combined: list[int] = []

    def expect(lengths: set[int]) -> None:
        expected.update(lengths)

    def combine(crc_a: int, crc_b: int, len_b: int) -> int:
        combined.append(len_b)
        return checksums.combine(crc_a, crc_b, len_b)

    monkeypatch.setattr(transfer_module, "expect_combines", expect)
    monkeypatch.setattr(transfer_module, "combine", combine)
    buffer = ctypes.create_string_buffer(data, len(data))
    source = MappedSource(ctypes.addressof(buffer), len(data), "a test buffer")
    got = transfer(source, placements, torch.device("cpu"), threads=3)
    assert_same(got, CASES, key_order=False)
    assert len(combined) >= 5 and set(combined) <= expected
    assert 4096 in expected  # "w"'s whole chunks


def test_mapped_bytes_copy_to_their_own_buffer_and_verify_in_chunks(
    monkeypatch: pytest.MonkeyPatch, read_passes: str
) -> None:
    monkeypatch.setattr(host_staging, "CHUNK", 8192)
    data, placements = _packed(CASES)
    buffer = ctypes.create_string_buffer(data, len(data))
    source = MappedSource(ctypes.addressof(buffer), len(data), "a test buffer")
    got = transfer(source, placements, torch.device("cpu"), threads=2)
    assert_same(got, CASES, key_order=False)
    buffer[0] = b"\x00"  # the source changes afterwards: the result is a copy of its own
    assert_same(got, CASES, key_order=False)
    buffer[0] = data[:1]
    buffer[placements[1].offset + 8193] = bytes([buffer[placements[1].offset + 8193][0] ^ 1])
    with pytest.raises(ChecksumError, match=r"tensor 'w' in a test buffer: checksum mismatch"):
        transfer(source, placements, torch.device("cpu"), threads=2)


def test_mapped_bytes_are_read_into_a_staging_buffer_exactly() -> None:
    """What a device restore does with each chunk of the daemon's mapped segments."""
    mapped = ctypes.create_string_buffer(b"0123456789")
    source = MappedSource(ctypes.addressof(mapped), 10, "b")
    staging = bytearray(b"..........")
    source.read_into(3, memoryview(staging)[2:6])
    assert staging == b"..3456...."

