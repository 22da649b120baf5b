"""What pinning does before it calls CUDA, on CPU: the pages of a slot are in the page table
(registering them then costs a tenth of registering untouched ones), and not one byte of
the staged data changed on the way."""

from __future__ import annotations

import mmap
import os
import struct
import warnings

import torch
from shmstage_client.pinning import prefault

from shmstage import segment


def present_pages(address: int, size: int) -> int:
    """Pages of [address, address + size) in this process's page table (/proc/self/pagemap,
    bit 63 of each page's entry)."""
    first, count = address // mmap.PAGESIZE, -(-size // mmap.PAGESIZE)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = struct.unpack(f"<{count}Q", pagemap.read(count * 8))
    return sum(entry >> 63 for entry in entries)


def test_prefault_puts_every_page_in_the_page_table_without_writing(instance_id: str) -> None:
    size = 8 << 20
    ref = segment.create(instance_id, size)
    data = os.urandom(1 << 20) * 8
    fd = segment.open_fd(ref, writable=True)
    region = segment.Region([size])
    try:
        os.pwrite(fd, data, 0)  # written through the file: no page of the region mapped
        region.map(0, fd, writable=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer: the buffer is writable
            whole = torch.frombuffer(region.buffer(0), dtype=torch.uint8, count=size)
        piece = whole[4096 : size - 4096]  # a setup thread's piece: cut at page boundaries
        assert present_pages(region.address, size) == 0
        prefault(piece)
        assert present_pages(region.address + 4096, size - 8192) == (size - 8192) // 4096
        assert bytes(region.buffer(0)) == data
    finally:
        os.close(fd)
        region.close()
