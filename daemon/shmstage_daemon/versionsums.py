"""Each published version's CRC-32C per tensor, computed off the event loop once it is
visible, so that its readers can verify what they copy.

A save's checksums come from its persist job, which reads every byte to write the files
(``gather``). A version made by ``publish()`` goes to no disk, so nothing would read it:
here the slot's segments are read as ``gather`` reads them — ``pread`` through a read
descriptor (``gather.open_segment``), never a mapping: a publisher holds its segments
writable and may truncate one, which would kill a daemon reading a mapping of it with
SIGBUS, while a read just comes up short — in pieces of ``PIECE_BYTES`` on a few threads,
each piece checksummed in the pass that reads it where ``shmstage.readsum`` is built;
a tensor's pieces are combined (``shmstage.checksums.combine``). The result comes back
to the loop, which attaches it to the version (``Channels.checksummed``) and answers the
readers waiting for it. It starts only after the "published" answer, so it never adds to
the publisher's stall; readers are woken at once and never wait for it unless they ask to.

A version whose slot is refilled meanwhile has no use for its checksums: a task that has
not started yet skips it (``wanted``), and the loop drops a result that came too late.
Versions are taken in turns between users (``FairExecutor``), one at a time: a user
publishing large versions back to back delays only its own.

The first version in each slot (the ring's first lap) waits ``FIRST_LAP_S_PER_GIB`` before
its checksums start: that is when readers map the slot and register it with CUDA, and
registering pages this pass is reading took half as long again (an H100 host, 7 GiB: a new
subscriber's first version 0.64-0.70 s with the checksums running, even on one thread,
against 0.45 s without). Later laps start at once: a registered reader's copy does not
mind them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from typing import Final

import crc32c

from shmstage import readsum
from shmstage.checksums import combine
from shmstage.layout import Layout
from shmstage.segment import SegmentRef
from shmstage_daemon.channels import Channels, Version
from shmstage_daemon.fairness import FairExecutor
from shmstage_daemon.gather import _read_exactly, open_segment

log = logging.getLogger("shmstaged.publish")

#: Threads checksumming one version's pieces, and the bytes of a piece (each thread keeps
#: one piece's buffer): 7 GiB in ~0.2-0.7 s, without taking the node's memory bandwidth
#: from the trainer's next copy.
PIECE_THREADS: Final = 4
PIECE_BYTES: Final = 4 << 20
#: How long a slot's first version waits per GiB before its checksums start (a reader's
#: registration, ~0.04-0.065 s/GiB), and at most.
FIRST_LAP_S_PER_GIB: Final = 0.07
FIRST_LAP_MAX_S: Final = 2.0

#: A piece: (segment, its tensors' parts in it as (tensor index, first byte, end byte)).
Piece = tuple[int, list[tuple[int, int, int]]]

_scratch = threading.local()


def pieces(layout: Layout, segments: int) -> list[Piece]:
    """The parts of every tensor with bytes, cut at ``PIECE_BYTES`` boundaries of their
    segment, in segment order and, within one, in byte order."""
    places = layout.packing_for(segments).places
    by_segment: list[list[tuple[int, int, int]]] = [[] for _ in range(segments)]
    for index, ((which, offset), nbytes) in enumerate(zip(places, layout.sizes, strict=True)):
        if nbytes:
            by_segment[which].append((offset, offset + nbytes, index))
    found: list[Piece] = []
    for which, tensors in enumerate(by_segment):
        piece_start = -1
        for start, end, index in sorted(tensors):
            at = start
            while at < end:
                lo = at // PIECE_BYTES * PIECE_BYTES
                if lo != piece_start:
                    found.append((which, []))
                    piece_start = lo
                cut = min(end, lo + PIECE_BYTES)
                found[-1][1].append((index, at, cut))
                at = cut
    return found


def _sum_piece(ref: SegmentRef, parts: Sequence[tuple[int, int, int]]) -> list[int]:
    """Each part's CRC-32C, read from segment ``ref`` in one read."""
    start, stop = parts[0][1], parts[-1][2]
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = (ctypes.c_char * PIECE_BYTES)()
    view = memoryview(buffer).cast("B")[: stop - start]
    spans = [(at - start, cut - start) for _, at, cut in parts]
    values = [0] * len(parts)
    fd = open_segment(ref)
    try:
        if readsum.available():
            address = ctypes.addressof(buffer)
            readsum.read(fd, start, address, stop - start, spans, values, ref.name)
        else:
            _read_exactly(fd, view, start, ref)
            values = [crc32c.crc32c(view[lo:hi]) for lo, hi in spans]
    finally:
        os.close(fd)
        view.release()
    return values


def compute(
    layout: Layout, refs: Sequence[SegmentRef], pool: concurrent.futures.Executor
) -> list[int]:
    """Every tensor's CRC-32C (layout order) in the staged segments ``refs``."""
    found = pieces(layout, len(refs))
    results = pool.map(lambda piece: _sum_piece(refs[piece[0]], piece[1]), found)
    totals = [0] * len(layout.tensors)
    starts = layout.packing_for(len(refs)).places
    for (_which, parts), values in zip(found, results, strict=True):
        for (index, at, cut), value in zip(parts, values, strict=True):
            first = at == starts[index][1]
            totals[index] = value if first else combine(totals[index], value, cut - at)
    return totals


class VersionSums:
    """Checksums versions on threads of its own and hands each result to ``channels``."""

    def __init__(self, channels: Channels) -> None:
        self._channels = channels
        self._versions = FairExecutor(1, "shmstage-versionsum")
        self._pieces = concurrent.futures.ThreadPoolExecutor(
            PIECE_THREADS, thread_name_prefix="shmstage-piecesum"
        )
        #: Slots (serials) whose first version was checksummed: an int per slot ever
        #: published, a few thousand over months.
        self._lapped: set[int] = set()
        self._stopped = False

    def start(self, version: Version, uid: int) -> None:
        """Checksum ``version`` (just made visible) as ``uid``'s task, in turn; the first
        in its slot once its readers have registered it (see the module)."""
        if version.slot.serial in self._lapped:
            self._submit(version, uid)
            return
        self._lapped.add(version.slot.serial)
        gib = version.staged.layout.nbytes / (1 << 30)
        delay = min(FIRST_LAP_MAX_S, FIRST_LAP_S_PER_GIB * gib)
        asyncio.get_running_loop().call_later(delay, self._submit, version, uid)

    def _submit(self, version: Version, uid: int) -> None:
        if self._stopped:
            return
        loop = asyncio.get_running_loop()
        staged, slot = version.staged, version.slot
        if slot.version is not version:  # refilled meanwhile: nothing left to checksum
            self._channels.checksummed(version, None)
            return
        layout, refs = staged.layout, list(slot.segments)

        def run() -> list[int] | None:
            # A read of what the loop owns, as a hint only: the loop checks again.
            if slot.version is not version:
                return None
            return compute(layout, refs, self._pieces)

        future = asyncio.wrap_future(self._versions.submit_for(uid, run), loop=loop)
        future.add_done_callback(lambda done: self._done(version, done))

    def _done(self, version: Version, future: asyncio.Future[list[int] | None]) -> None:
        sums: list[int] | None = None
        if future.cancelled():
            pass
        elif (error := future.exception()) is not None:
            log.warning("version %d: no checksums (%s)", version.step, error)
        else:
            sums = future.result()
        self._channels.checksummed(version, sums)

    def shutdown(self) -> None:
        self._stopped = True  # a first lap still waiting starts nothing
        self._versions.shutdown(wait=False, cancel_futures=True)
        self._pieces.shutdown(wait=False, cancel_futures=True)

