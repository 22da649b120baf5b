"""Chunk writers on real files: direct I/O where the filesystem takes it, else the page
cache kept in check; either way the file holds exactly the bytes given, at their offsets.

``tmp_path`` is on ext4 here, which takes ``O_DIRECT``; refusals by a whole filesystem
(ramfs) are tested end to end with a real daemon in tests/faults/test_storage_faults.py.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import subprocess
from pathlib import Path

import pytest
from harness import resident_pages
from shmstage_daemon.chunkwriter import (
    BLOCK,
    BufferedChunkWriter,
    DirectChunkWriter,
    RefusalLog,
    open_writer,
)

CHUNK = 256 * 1024


def payload(nbytes: int, seed: int = 1) -> bytes:
    return (bytes(range(seed % 251, 256)) * (nbytes // 200 + 2))[:nbytes]


def write_file(path: Path, data: bytes, *, flags: int = 0, direct: bool = True) -> type:
    """Write ``data`` in CHUNK pieces from an aligned buffer, last chunk first (order must not
    matter); returns the writer class that ended up writing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
    buffer = mmap.mmap(-1, CHUNK)
    view = memoryview(buffer)
    try:
        refused = RefusalLog()
        writer = open_writer(fd, chunk_bytes=CHUNK, refused=refused, where="d", direct=direct)
        for offset in reversed(range(0, len(data), CHUNK)):
            piece = data[offset : offset + CHUNK]
            view[: len(piece)] = piece
            writer.write(view, offset, len(piece))
        writer.finish(len(data))
        return type(writer)
    finally:
        view.release()
        buffer.close()
        os.close(fd)


@pytest.mark.parametrize("size", [1, BLOCK - 1, BLOCK, CHUNK + 1, 3 * CHUNK - 7])
def test_direct_writes_leave_exactly_the_bytes_and_the_size(tmp_path: Path, size: int) -> None:
    data = payload(size)
    assert write_file(tmp_path / "f", data) is DirectChunkWriter
    assert (tmp_path / "f").read_bytes() == data  # the last block's padding was cut off


def test_a_descriptor_opened_for_appending_still_writes_at_offsets(tmp_path: Path) -> None:
    """With O_APPEND every pwrite would land at the end, whatever its offset: the writer
    clears the flag (the file would otherwise publish with its chunks out of order)."""
    data = payload(3 * CHUNK + 5)
    for direct in (True, False):
        path = tmp_path / f"appending-{direct}"
        write_file(path, data, flags=os.O_APPEND, direct=direct)
        assert path.read_bytes() == data


def test_an_append_only_file_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "sealed"
    path.touch()
    if subprocess.run(["chattr", "+a", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +a is not available here (needs root and ext4)")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            with pytest.raises(OSError, match="append-only") as info:
                open_writer(fd, chunk_bytes=CHUNK, refused=RefusalLog(), where="d")
        finally:
            os.close(fd)
    finally:
        subprocess.run(["chattr", "-a", str(path)], check=True)
    assert info.value.errno == 1  # EPERM: the storage message says "does not permit it"


def test_a_direct_write_the_kernel_refuses_falls_back_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A filesystem that takes the flag but refuses the write answers EINVAL; here the real
    kernel answers EINVAL to a buffer one byte off alignment, which takes the same path:
    the writer clears O_DIRECT and writes through the page cache, losing nothing, and the
    log says so once per filesystem however many files hit it."""
    refused = RefusalLog()
    buffer = mmap.mmap(-1, 2 * BLOCK)
    view = memoryview(buffer)
    data = payload(BLOCK)
    view[1 : 1 + BLOCK] = data
    try:
        with caplog.at_level(logging.WARNING, logger="shmstaged"):
            for name in ("one", "two"):
                fd = os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    writer = open_writer(fd, chunk_bytes=CHUNK, refused=refused, where="dir")
                    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
                    writer.write(view[1:], 0, BLOCK)
                    writer.finish(BLOCK)
                    assert not writer.direct
                    assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
                finally:
                    os.close(fd)
                assert (tmp_path / name).read_bytes() == data
    finally:
        view.release()
        buffer.close()
    said = [r.getMessage() for r in caplog.records if "refuses direct I/O" in r.getMessage()]
    assert len(said) == 1, said
    assert "the filesystem of dir" in said[0] and "EINVAL at the first write" in said[0]


def test_the_buffered_writer_leaves_no_pages_of_the_file_cached(tmp_path: Path) -> None:
    """Through the page cache, each chunk is pushed out as it is written and dropped a few
    chunks later; after ``finish`` none of the 32 MiB is cached."""
    data = payload(128 * CHUNK)
    assert write_file(tmp_path / "f", data, direct=False) is BufferedChunkWriter
    assert resident_pages(tmp_path / "f") == 0
    assert (tmp_path / "f").read_bytes() == data
