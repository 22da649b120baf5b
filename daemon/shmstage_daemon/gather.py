"""Gathering a data file into aligned chunks: its header, then every tensor back to back.

Direct I/O writes whole blocks from aligned memory at aligned offsets, but a safetensors
file allows no gaps between tensors, so tensors start wherever the previous one ended. The
job's thread therefore copies the file's bytes, in file order, into aligned chunks of the
pool's size (``scheduler``), and hands each full chunk to the I/O threads. Every chunk
starts at a multiple of its size, so only the file's last block is ever partial.

Each piece is read from its segment with ``preadv`` (a kernel copy from the tmpfs page
cache that releases the GIL and maps nothing: mapping a segment costs ~20 us, which at
10,000 tensors was a third of the write) and checksummed right after, while it is still
in the CPU cache: pieces of at most ``PIECE_BYTES`` (on this kind of host 1 MiB pieces
gathered and checksummed at ~6.9 GB/s on one thread, 16 MiB ones at ~5.1). The running
CRC-32C of each tensor is kept per piece, so an I/O thread can check every piece again
just before writing it (``scheduler.Chunk.verify``).

Small tensors packed into one segment (``shmstage.packing``) sit at 64-byte boundaries
there and back to back in the file, so wherever their sizes are multiples of 64 bytes —
as model tensors' are — a run of them is the same bytes in both (``runs``): it is read a
piece at a time, not tensor by tensor, and only the checksums are per tensor. Gathering
1 GiB in 10,000 tensors took 0.35-0.38 s on the H100 host that way, 0.42-0.46 s read
per tensor.

At 10,000 tensors one thread gathers. Helper threads filling the chunks while this one
laid them out made it slower on the H100 host — 1 GiB in 0.80 s with one helper,
1.00-1.05 s with two to four, against a disk limit of 0.60 s — because the per-tensor
work held the GIL; with runs, four regions gathered it in 0.23-0.26 s, but the write as a
whole took longer (the disk wrote four places at once: 1.31-1.48x the direct-I/O limit
against 1.21-1.26x). Large tensors are another matter: reading and
checksumming a 1 MiB piece releases the GIL for almost all of its time, and one thread
gathered 8 GiB in 500 tensors at 2.2 GB/s (3.75 s, the disk taking 4.44 s), below what a
fast disk takes. So a file whose tensors average ``MIN_MEAN_TENSOR_BYTES`` or more is cut
into contiguous regions at chunk boundaries, each gathered by a thread of its own
(``in_regions``); a tensor cut by a region boundary gets its CRC-32C combined from its
parts (``shmstage.checksums.combine``).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Final

import crc32c

from shmstage import segment
from shmstage.checksums import combine
from shmstage.layout import Layout
from shmstage.segment import SegmentRef
from shmstage_daemon import faults
from shmstage_daemon.scheduler import Check, Chunk, JobWrites

log = logging.getLogger("shmstaged.gather")

PIECE_BYTES: Final = 1 << 20
#: Regions: at most this many threads per file, each with at least this many bytes, and
#: only for tensors of this size on average. On the H100 host, 1 GiB in 2,000 tensors
#: (0.5 MiB each) was gathered in 0.17 s on four threads against 0.36 s on one; in 10,000
#: (0.1 MiB each) four threads made the write slower, 0.86 s against 0.63 s.
MAX_REGIONS: Final = 4
MIN_REGION_BYTES: Final = 256 << 20
MIN_MEAN_TENSOR_BYTES: Final = 512 << 10


#: How long a job keeps retrying to open a segment while the daemon is out of descriptors.
FD_RETRY_S: Final = 120.0


class SegmentResized(Exception):
    """A staged segment is not the size shmstaged made it: a process holding a writable
    descriptor on it (its trainer) truncated or grew it. The job reading it fails; no
    other job, and not the daemon, is concerned."""

    def __init__(self, ref: SegmentRef, found: int) -> None:
        super().__init__(f"segment {ref.name} is {found} bytes, not {ref.size}")
        self.ref = ref
        self.found = found


def _check_size(fd: int, ref: SegmentRef) -> None:
    found = os.fstat(fd).st_size
    if found != ref.size:
        raise SegmentResized(ref, found)


def open_segment(ref: SegmentRef) -> int:
    """A read descriptor on a staged segment, waiting out a shortage of descriptors.

    An acknowledged checkpoint must not fail for a resource another client can take: if
    connections (of any user) have pushed the daemon to its descriptor limit, the job waits
    for one to come free (bounded, with back-off) instead of failing and removing its files.
    """
    deadline = time.monotonic() + FD_RETRY_S
    delay = 0.01
    while True:
        try:
            return segment.open_fd(ref, writable=False)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or time.monotonic() > deadline:
                raise
            if delay == 0.01:
                log.warning("out of file descriptors opening a staged segment; retrying")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


class Gatherer:
    """Packs one data file, or one region of it from ``position`` on, into chunks; used by
    one thread only, and closed (``with``) for the segment it keeps open: tensors packed
    into one segment follow each other, so it is opened once for all of them."""

    def __init__(self, writes: JobWrites, position: int = 0) -> None:
        self.writes = writes
        #: File offset of the next byte gathered.
        self.position = position
        self._chunk: Chunk | None = None
        #: The segment read last and its descriptor, kept for the next run packed in it.
        self._open: tuple[SegmentRef, int] | None = None

    def add_bytes(self, data: bytes, what: str) -> None:
        """Gather bytes the daemon holds (the header)."""
        source = memoryview(data)
        done = 0
        while done < len(data):
            chunk = self._room()
            start = chunk.length
            size = min(len(data) - done, chunk.room)
            piece = source[done : done + size]
            chunk.view[start : start + size] = piece
            chunk.checks.append(Check(start, start + size, 0, crc32c.crc32c(piece), what))
            chunk.length += size
            done += size
            self.position += size

    def add_run(self, ref: SegmentRef, at: int, parts: Sequence[tuple[int, str]]) -> list[int]:
        """Gather ``parts`` — (bytes, what) of tensors, or of pieces of them, that follow
        each other in segment ``ref`` from byte ``at`` on as they do in the file — with one
        read per piece for all of them; returns each part's CRC-32C."""
        left = sum(nbytes for nbytes, _ in parts)  # of the run, still to read
        if not left:
            return [0] * len(parts)
        if self._open is None or self._open[0] is not ref:
            self.close()
            self._open = (ref, open_segment(ref))
            _check_size(self._open[1], ref)
        fd = self._open[1]
        checksums: list[int] = []
        chunk: Chunk | None = None
        target = memoryview(b"")
        start = read = 0  # where the piece read last is in its chunk, and its bytes used
        try:
            for nbytes, what in parts:
                crc = done = 0
                while done < nbytes:
                    if read == len(target):  # the piece is used up: read the next one
                        target.release()
                        chunk = self._room()
                        start, read = chunk.length, 0
                        size = min(left, chunk.room, PIECE_BYTES)
                        target = chunk.view[start : start + size]
                        _read_exactly(fd, target, at, ref)
                        chunk.length += size
                        chunk.data_bytes += size
                        self.position += size
                        at += size
                        left -= size
                    assert chunk is not None
                    take = min(nbytes - done, len(target) - read)
                    seed, crc = crc, crc32c.crc32c(target[read : read + take], crc)
                    chunk.checks.append(Check(start + read, start + read + take, seed, crc, what))
                    read += take
                    done += take
                checksums.append(crc)
        finally:
            target.release()
        return checksums

    def close(self) -> None:
        """Close the segment kept open (its tensors are gathered, or the job failed)."""
        if self._open is not None:
            os.close(self._open[1])
            self._open = None

    def __enter__(self) -> Gatherer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_through(self) -> None:
        """Have everything gathered so far in the file now (see ``JobWrites.write_through``)."""
        if self._chunk is not None and self._chunk.length:
            self.writes.write_through(self._chunk)
        else:
            self.writes.drain()

    def finish(self, *, drain: bool = True) -> int:
        """Submit the last chunk and (with ``drain``) wait for all of them; returns the
        position reached (the file's size for the whole file)."""
        if self._chunk is not None:
            self._submit()
        if drain:
            self.writes.drain()
        return self.position

    def _room(self) -> Chunk:
        """The chunk to gather into: the current one, or a new one once it is full."""
        if self._chunk is not None and self._chunk.room == 0:
            self._submit()
        if self._chunk is None:
            self._chunk = self.writes.chunk(self.position)
        return self._chunk

    def _submit(self) -> None:
        chunk, self._chunk = self._chunk, None
        assert chunk is not None
        faults.maybe_flip("gathered", chunk.view, chunk.length)
        self.writes.submit(chunk)


def _read_exactly(fd: int, target: memoryview, offset: int, ref: SegmentRef) -> None:
    done = 0
    while done < len(target):
        got = os.preadv(fd, [target[done:]], offset + done)
        if got == 0:  # truncated since it was opened
            raise SegmentResized(ref, os.fstat(fd).st_size)
        done += got


def regions(
    header_bytes: int, sizes: Sequence[int], chunk_bytes: int, most: int | None = None
) -> list[int]:
    """Where each region of a data file starts (the first at 0), at chunk boundaries, at
    most ``most`` (default ``MAX_REGIONS``): one region for a file of small tensors or of
    less than two regions' bytes."""
    total = header_bytes + sum(sizes)
    if not sizes or sum(sizes) < MIN_MEAN_TENSOR_BYTES * len(sizes):
        return [0]
    most = MAX_REGIONS if most is None else most
    count = max(1, min(most, total // MIN_REGION_BYTES))
    chunks = -(-total // chunk_bytes)
    starts = sorted({chunks * index // count * chunk_bytes for index in range(count)})
    return [start for start in starts if start < total] or [0]


def whole_file(
    writes: JobWrites,
    header: bytes,
    layout: Layout,
    refs: Sequence[SegmentRef],
    starts: Sequence[int],
) -> list[int]:
    """Gather a data file — header, then every tensor — from the regions at ``starts``
    (``regions``), and wait for all its writes; returns every tensor's CRC-32C. One region
    is gathered in order on this thread, where the ``mid-stream`` fault hook pauses once
    the first tensor is in the file."""
    if len(starts) > 1:
        checksums = in_regions(writes, header, layout, refs, starts)
        writes.drain()
        return checksums
    plan = [(index, 0, size) for index, size in enumerate(layout.sizes)]
    with Gatherer(writes) as data:
        data.add_bytes(header, "the safetensors header")
        if faults.armed("mid-stream") and len(plan) > 1:
            checksums = _gather_plan(data, layout, refs, plan[:1])
            data.write_through()  # "mid-stream" means the first tensor is in the file
            faults.pause("mid-stream")
            checksums += _gather_plan(data, layout, refs, plan[1:])
        else:
            checksums = _gather_plan(data, layout, refs, plan)
        data.finish()
    return checksums


def in_regions(
    writes: JobWrites,
    header: bytes,
    layout: Layout,
    refs: Sequence[SegmentRef],
    starts: Sequence[int],
) -> list[int]:
    """Gather the whole file (header, then every tensor) on one thread per region, this
    one taking the first; returns every tensor's CRC-32C. The first error of any region
    fails the job's writes, so the others stop at their next chunk, and is raised once
    all have stopped. Does not wait for the writes (the caller drains)."""
    ends = [*starts[1:], len(header) + layout.nbytes]
    plans: list[list[Part]] = [[] for _ in starts]
    for index, (first, last) in enumerate(layout.data_offsets()):
        offset = len(header) + first  # of the tensor in the file
        for region, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
            begin, end = max(lo, offset), min(hi, len(header) + last)
            if begin < end:
                plans[region].append((index, begin - offset, end - begin))
    checksums: list[list[int]] = [[] for _ in starts]
    errors: list[BaseException | None] = [None] * len(starts)

    def gather(region: int) -> None:
        try:
            with Gatherer(writes, starts[region]) as data:
                if region == 0:
                    data.add_bytes(header, "the safetensors header")
                checksums[region] = _gather_plan(data, layout, refs, plans[region])
                data.finish(drain=False)
        except BaseException as exc:
            errors[region] = exc
            writes.fail(exc)

    threads = [
        threading.Thread(target=gather, args=(region,), name=f"shmstage-gather-{region}")
        for region in range(1, len(starts))
    ]
    for thread in threads:
        thread.start()
    gather(0)
    for thread in threads:
        thread.join()
    failed = next((error for error in errors if error is not None), None)
    if failed is not None:
        raise failed
    whole = [0] * len(layout.tensors)
    for plan, crcs in zip(plans, checksums, strict=True):
        for (index, at, nbytes), crc in zip(plan, crcs, strict=True):
            whole[index] = crc if at == 0 else combine(whole[index], crc, nbytes)
    return whole


#: Part of a tensor a region gathers: (tensor index, its first byte, bytes).
Part = tuple[int, int, int]


def _gather_plan(
    data: Gatherer, layout: Layout, refs: Sequence[SegmentRef], plan: Sequence[Part]
) -> list[int]:
    """Gather the parts of ``plan``, in order, a run at a time; returns each one's CRC-32C."""
    places = layout.packing_for(len(refs)).places
    checksums: list[int] = []
    for which, at, parts in runs(plan, places):
        pieces = [(nbytes, f"tensor {layout.tensors[index].key!r}") for index, _, nbytes in parts]
        checksums += data.add_run(refs[which], at, pieces)
    return checksums


def runs(
    plan: Sequence[Part], places: Sequence[tuple[int, int]]
) -> list[tuple[int, int, list[Part]]]:
    """``plan``'s parts grouped into runs, each (segment, first byte there, parts): parts
    that follow each other in a segment as they do in the file, which one read gathers.

    Packed tensors are 64-byte aligned in their segment and back to back in the file, so a
    run ends wherever a packed tensor's size is not a multiple of 64 (model tensors rarely
    are: their dimensions are), and at every tensor of a segment of its own.
    """
    grouped: list[tuple[int, int, list[Part]]] = []
    end = -1
    for part in plan:
        index, at, nbytes = part
        which, offset = places[index]
        source = offset + at
        if grouped and (nbytes == 0 or (which == grouped[-1][0] and source == end)):
            grouped[-1][2].append(part)
        else:
            grouped.append((which, source, [part]))
        if nbytes:
            end = source + nbytes
    return grouped
