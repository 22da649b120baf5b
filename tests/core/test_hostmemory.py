"""Host memory for staging buffers: faulted in, in huge pages only when the kernel has them free."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest

from shmstage import hostmemory

BUDDYINFO = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone    DMA32      1      1      4      2      5      4      3      3      4      2    752
Node 0, zone   Normal   4622   4227   1109    309     33     23      3      7      2      3      7
"""


def test_free_huge_pages_counts_free_blocks_of_a_huge_page_or_more() -> None:
    # order 9 is one huge page, order 10 two: (1 + 2*3) + (2 + 2*752) + (3 + 2*7)
    assert hostmemory.free_huge_pages(BUDDYINFO) == 7 + 1506 + 17
    assert hostmemory.free_huge_pages("") == 0
    assert hostmemory.free_huge_pages("Node 0, zone   Normal   12   3") == 0


def test_huge_pages_allowed_follows_the_kernels_setting() -> None:
    assert hostmemory.huge_pages_allowed("always [madvise] never\n")
    assert hostmemory.huge_pages_allowed("[always] madvise never\n")
    assert not hostmemory.huge_pages_allowed("always madvise [never]\n")
    assert not hostmemory.huge_pages_allowed("")


@pytest.mark.parametrize(
    ("enabled", "free_blocks", "expected"),
    [
        ("always [madvise] never", 2000, True),
        ("always madvise [never]", 2000, False),  # the kernel's setting says no
        ("always [madvise] never", 520, False),  # 16 would leave less than the reserve
        ("always [madvise] never", 0, False),
    ],
)
def test_huge_pages_are_taken_only_when_allowed_and_free_with_some_to_spare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: str, free_blocks: int, expected: bool
) -> None:
    """A 32 MiB buffer is 16 huge pages: it takes them only if the kernel allows huge pages
    and has them free beyond ``HUGE_RESERVE``, so that it never compacts memory for them."""
    settings, buddyinfo = tmp_path / "enabled", tmp_path / "buddyinfo"
    settings.write_text(enabled + "\n")
    buddyinfo.write_text(f"Node 0, zone   Normal   3 2 1 0 0 0 0 0 0 {free_blocks} 0\n")
    monkeypatch.setattr(hostmemory, "_THP_ENABLED", settings)
    monkeypatch.setattr(hostmemory, "_BUDDYINFO", buddyinfo)
    assert hostmemory.huge_pages_to_spare(32 << 20) is expected
    assert not hostmemory.huge_pages_to_spare(1 << 20)  # less than one huge page


@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("size", [1, 4096, (4 << 20) + 123])
def test_mapped_memory_is_zeroed_writable_and_given_back(huge: bool, size: int) -> None:
    address = hostmemory.map_populated(size, huge=huge)
    try:
        if huge and size >= hostmemory.HUGE_PAGE:
            assert address % hostmemory.HUGE_PAGE == 0
        view = (ctypes.c_char * size).from_address(address)
        assert bytes(view[: min(size, 4096)]) == bytes(min(size, 4096))
        view[size - 1] = b"x"
        assert view[size - 1] == b"x"
        assert _mapping(address) is not None
    finally:
        hostmemory.unmap(address, size)
    assert _mapping(address) is None  # nothing left behind, the trimmed edges included


def test_a_huge_mapping_is_exactly_its_pages() -> None:
    """Aligning the address maps a huge page more; what is left over either side is given
    back at once, and the mapping is one of its own (asking for huge pages sets it apart)."""
    size = (8 << 20) + 5
    address = hostmemory.map_populated(size, huge=True)
    try:
        length = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        assert _mapping(address) == (address, address + length)
    finally:
        hostmemory.unmap(address, size)


def test_huge_pages_back_the_buffer_when_the_kernel_has_them_free() -> None:
    size = 32 << 20
    if not hostmemory.huge_pages_to_spare(size):
        pytest.skip("this kernel has transparent huge pages off or too few free now")
    address = hostmemory.map_populated(size, huge=True)
    try:
        smaps = _smaps(address)
        assert smaps is not None
        # the kernel may split or not yet have all of it; most of it must be huge
        assert smaps["AnonHugePages"] * 1024 >= size // 2, smaps  # kB
    finally:
        hostmemory.unmap(address, size)


def test_an_impossible_size_is_a_clear_error() -> None:
    with pytest.raises(hostmemory.HostMemoryError, match="cannot map"):
        hostmemory.map_populated(1 << 62)


def _mapping(address: int) -> tuple[int, int] | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(part, 16) for part in line.split()[0].split("-"))
        if lo <= address < hi:
            return lo, hi
    return None


def _smaps(address: int) -> dict[str, int] | None:
    """The kB counters of the mapping that holds ``address``."""
    found: dict[str, int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(part, 16) for part in head.split("-"))
            if found is not None:
                break
            if lo <= address < hi:
                found = {}
        elif found is not None and line.split()[-1] == "kB":
            found[head.rstrip(":")] = int(line.split()[1])
    return found
