"""Where a restore's bytes come from: a ``Source`` is ``size`` bytes that several threads
read into host memory a piece at a time.

One kind per place a checkpoint's bytes can be: a data file (``FileSource``), the daemon's
segments read through their descriptors (``SegmentSource``: what a lease keeps where this
process has room for them) or mapped read-only into this process (``MappedSource``, whose
bytes the DCP reader also views in place). Each reads and checksums in one pass where
``shmstage.readsum`` is built (``read_summed``), so the host reads the bytes once; the
transfer to a device (``transfer``) takes any of them.
"""

from __future__ import annotations

import abc
import bisect
import ctypes
import os
from collections.abc import Sequence
from typing import ClassVar

import crc32c

from shmstage import readsum


class Source(abc.ABC):
    """``size`` bytes somewhere, read into host memory a piece at a time."""

    size: int
    #: Where the bytes are, for messages.
    where: str

    @abc.abstractmethod
    def read_into(self, start: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes from ``start`` on; called from several threads."""

    #: Whether this kind of source can read and checksum in one pass (``_read_once``).
    one_pass: ClassVar[bool] = False

    @property
    def summing(self) -> bool:
        """Whether ``read_summed`` checksums the bytes in the pass that reads them
        (``shmstage.readsum``, where it is built), rather than in a second pass."""
        return self.one_pass and readsum.available()

    def read_summed(
        self, start: int, buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]
    ) -> None:
        """``read_into``, continuing the CRC-32C in ``values`` of each span of ``buffer``
        (``(lo, hi)`` offsets into it, ascending, not overlapping; 0 to start)."""
        if self.summing:
            self._read_once(start, buffer, spans, values)
        else:
            self.read_into(start, buffer)
            sum_spans(buffer, spans, values)

    def _read_once(
        self, start: int, buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]
    ) -> None:
        """``read_summed`` in one pass, for a source with ``one_pass``."""
        raise NotImplementedError



def sum_spans(buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]) -> None:
    """The second pass: continue each span's CRC-32C over the bytes already read."""
    for index, (lo, hi) in enumerate(spans):
        values[index] = crc32c.crc32c(buffer[lo:hi], values[index])


def _address(buffer: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class MappedSource(Source):
    """Bytes mapped into this process (the daemon's segments, read-only)."""

    def __init__(self, address: int, size: int, where: str) -> None:
        self.address, self.size, self.where = address, size, where

    def view(self, start: int, end: int) -> memoryview:
        """The mapped bytes in [start, end), read in place (the DCP reader's items)."""
        return memoryview((ctypes.c_char * (end - start)).from_address(self.address + start))

    def read_into(self, start: int, buffer: memoryview) -> None:
        ctypes.memmove(_address(buffer), self.address + start, len(buffer))  # GIL released

    one_pass = True

    def _read_once(
        self, start: int, buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]
    ) -> None:
        readsum.copy(self.address + start, _address(buffer), len(buffer), spans, values, self.where)


class FileSource(Source):
    """``size`` bytes of an open file from ``offset`` on (a data file's tensor data)."""

    def __init__(self, fd: int, offset: int, size: int, where: str) -> None:
        self.fd, self.offset, self.size, self.where = fd, offset, size, where

    def read_into(self, start: int, buffer: memoryview) -> None:
        _pread_exactly(self.fd, buffer, self.offset + start, self.where)

    one_pass = True

    def _read_once(
        self, start: int, buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]
    ) -> None:
        where, address = self.where, _address(buffer)
        readsum.read(self.fd, self.offset + start, address, len(buffer), spans, values, where)


class SegmentSource(Source):
    """Shared-memory segments read through their descriptors, laid out at ``offsets``
    (page-aligned, as ``segment.Region`` would map them; the gaps are never read).

    ``preadv`` copies a segment's pages straight out of the page cache: no page tables to
    fill while reading, none to tear down after (unmapping an 8 GiB mapping read end to
    end took 0.1-0.5 s on the H100 host, and blocks the process's page faults meanwhile).
    """

    def __init__(
        self, fds: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], where: str
    ) -> None:
        self.fds, self.offsets, self.sizes = list(fds), list(offsets), list(sizes)
        self.where = where
        self.size = (self.offsets[-1] + self.sizes[-1]) if self.offsets else 0

    def read_into(self, start: int, buffer: memoryview) -> None:
        end = start + len(buffer)
        index = max(0, bisect.bisect_right(self.offsets, start) - 1)
        while index < len(self.offsets) and self.offsets[index] < end:
            base = self.offsets[index]
            lo, hi = max(start, base), min(end, base + self.sizes[index])
            if hi > lo:
                piece = buffer[lo - start : hi - start]
                _pread_exactly(self.fds[index], piece, lo - base, self.where)
            index += 1

    one_pass = True

    def _read_once(
        self, start: int, buffer: memoryview, spans: Sequence[tuple[int, int]], values: list[int]
    ) -> None:
        """Segment by segment, each span's part in a segment checksummed as it is read."""
        end, address, first = start + len(buffer), _address(buffer), 0
        index = max(0, bisect.bisect_right(self.offsets, start) - 1)
        while index < len(self.offsets) and self.offsets[index] < end:
            base = self.offsets[index]
            lo, hi = max(start, base) - start, min(end, base + self.sizes[index]) - start
            if hi > lo:
                while first < len(spans) and spans[first][1] <= lo:
                    first += 1
                last = first
                while last < len(spans) and spans[last][0] < hi:
                    last += 1
                inside = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in spans[first:last]]
                sums = values[first:last]
                fd, offset = self.fds[index], start + lo - base
                readsum.read(fd, offset, address + lo, hi - lo, inside, sums, self.where)
                values[first:last] = sums
            index += 1


def _pread_exactly(fd: int, buffer: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise OSError(f"{where}: the file ended {len(buffer) - done} bytes early")
        done += got

