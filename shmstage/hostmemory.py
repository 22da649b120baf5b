"""Anonymous host memory for staging buffers: faulted in up front, in huge pages when free.

A restore copies its bytes to the device through a few pinned staging buffers (the
client's ``reading``). A restarted trainer is a new process and makes them first: on the
H100 host faulting in 32 MiB of 4 KiB pages took 7-11 ms, most of the time it took to
make a buffer (registering it with CUDA took 2 ms), and the driver serialises the rest,
so the 18 buffers of a restore were all there only after 0.28-0.39 s while the restore
itself takes about as long. In transparent huge pages the kernel faults in and zeroes a
buffer 2 MiB at a time: 18 buffers of 32 MiB, registered, took 89-94 ms instead of
151-186 ms on an H200 host, and a restarted trainer's restore of 8 GiB 0.32-0.35 s
instead of 0.38-0.39 s (alternating on one VM; ``restart-tried.txt``, now in the history
of ``docs/perf/``).

Huge pages are taken only when the kernel's page allocator has them free (``/proc/
buddyinfo``) with ``HUGE_RESERVE`` to spare: with the usual ``defrag=madvise`` a huge-page
fault that finds none free compacts memory first, which once made 18 such buffers take
1.4 s instead of 0.27 s on a build host whose memory was full of page cache. Otherwise,
and wherever the kernel refuses, the memory is in 4 KiB pages as before.

Mapping and faulting in go through libc (``shmstage.mapping``), which releases the GIL:
``mmap.mmap`` holds it while the kernel faults pages in (on a 2-core build host, another
thread's Python ran at 23 % of its speed meanwhile), and a restore makes its buffers on a
thread beside the ones that read.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path
from typing import Final

from shmstage.mapping import failed, libc

HUGE_PAGE: Final = 2 << 20
#: Free huge pages left to others when a buffer takes some: 1 GiB.
HUGE_RESERVE: Final = 512
#: Orders of the page allocator's free lists (``/proc/buddyinfo``) at and above a huge page.
_HUGE_ORDER: Final = (HUGE_PAGE // mmap.PAGESIZE).bit_length() - 1
_MADV_HUGEPAGE: Final = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE: Final = 23  # Linux 5.14
_BUDDYINFO: Final = Path("/proc/buddyinfo")
_THP_ENABLED: Final = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class HostMemoryError(OSError):
    """The kernel refused the memory; the message says how much and why."""


def free_huge_pages(buddyinfo: str | None = None) -> int:
    """How many huge pages the page allocator could hand out now without compacting
    memory: its free blocks of a huge page or more, counted in huge pages (0 where
    ``/proc/buddyinfo`` cannot be read)."""
    if buddyinfo is None:
        try:
            buddyinfo = _BUDDYINFO.read_text()
        except OSError:
            return 0
    total = 0
    for line in buddyinfo.splitlines():
        # "Node 0, zone   Normal   4622   4227 ...": free blocks of order 0, 1, 2, ...
        counts = line.split(",", 1)[-1].split()[2:]
        for order, count in enumerate(counts):
            if order >= _HUGE_ORDER and count.isdigit():
                total += int(count) << (order - _HUGE_ORDER)
    return total


def huge_pages_allowed(enabled: str | None = None) -> bool:
    """Whether transparent huge pages may back memory that asks for them (the kernel's
    setting is ``always`` or ``madvise``, not ``never``)."""
    if enabled is None:
        try:
            enabled = _THP_ENABLED.read_text()
        except OSError:
            return False
    return "[never]" not in enabled and "[" in enabled


def huge_pages_to_spare(size: int) -> bool:
    """Whether ``size`` bytes may come in huge pages without the kernel compacting memory
    for them, leaving ``HUGE_RESERVE`` free."""
    need = -(-size // HUGE_PAGE)
    return size >= HUGE_PAGE and huge_pages_allowed() and free_huge_pages() >= need + HUGE_RESERVE


def map_populated(size: int, *, huge: bool = False) -> int:
    """``size`` bytes of private anonymous memory, every page faulted in; with ``huge``, at
    a huge-page boundary and asking for transparent huge pages (see ``huge_pages_to_spare``).
    Returns the address, for ``unmap``."""
    length = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    if not huge or length < HUGE_PAGE:
        return _map(length, mmap.MAP_POPULATE)
    reserved = length + HUGE_PAGE
    base = _map(reserved, 0)
    address = -(-base // HUGE_PAGE) * HUGE_PAGE
    if address > base:  # keep exactly [address, address + length): unmap() frees it all
        libc.munmap(base, address - base)
    if base + reserved > address + length:
        libc.munmap(address + length, base + reserved - address - length)
    libc.madvise(address, length, _MADV_HUGEPAGE)  # a kernel without THP: plain pages
    if libc.madvise(address, length, _MADV_POPULATE_WRITE) != 0:
        if ctypes.get_errno() != errno.EINVAL:  # out of memory, say
            err = ctypes.get_errno()
            unmap(address, length)
            raise HostMemoryError(err, f"cannot fault in {size} bytes: {os.strerror(err)}")
        ctypes.memset(address, 0, length)  # before Linux 5.14: touch every page
    return address


def unmap(address: int, size: int) -> None:
    """Give back memory from ``map_populated``."""
    libc.munmap(address, size)


def _map(length: int, extra_flags: int) -> int:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | extra_flags
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if failed(address):
        err = ctypes.get_errno()
        raise HostMemoryError(err, f"cannot map {length} bytes of memory: {os.strerror(err)}")
    return int(address)
