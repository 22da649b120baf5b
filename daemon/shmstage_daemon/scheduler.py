"""Every persist job's data writes, on one pool of I/O threads shared fairly.

A job's own thread gathers its checkpoint into aligned chunks (``gather``); the chunks are
written by a pool of I/O threads that all jobs share. Why one pool and not threads per
job: the disk has one limit (about 3.1 GB/s on the H200 host, reached with about four
direct writes in flight), so what matters is how many writes the node has in flight and
whose they are, not how many jobs there are. Eight trainers saving at once then share the
disk's limit instead of fighting over it, and a job's fsync (on its own thread) never
holds up another job's writes.

Fairness, memory and isolation:

- Chunks are written in turns: owners (uids) round-robin, then their jobs, then each job's
  chunks in order (``fairness.FairQueue``). One user's many jobs get one user's turns.
- Aligned buffers come from one pool of at most ``memory_bytes``, anonymous mappings made
  on demand and unmapped once no job is writing, so the daemon's resident memory returns
  to its baseline between checkpoints. Each job may hold at most its share of them: the
  pool split evenly between owners with jobs open, then between an owner's jobs (at least
  one buffer, at most ``io_threads + 1``: one being gathered while the rest are written).
- One owner's writes may occupy at most ``io_threads`` threads. A write that has run for
  ``stall_seconds`` (storage that stopped answering, e.g. a user's own FUSE mount) no
  longer counts as a thread: the pool starts another, up to ``io_threads`` extra, so other
  users' checkpoints keep moving while it hangs.

The threads return results only: a job learns of its writes through its ``JobWrites``,
and nothing here touches daemon state. Every wait wakes at least every ``POLL_S`` to see
the job's stop token, so a stopping daemon never waits on a job for more than one chunk.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol

import crc32c

from shmstage_daemon import chunkwriter, faults
from shmstage_daemon.chunkwriter import BLOCK, ChunkWriter, RefusalLog
from shmstage_daemon.fairness import FairQueue

DEFAULT_IO_THREADS: Final = 4
DEFAULT_CHUNK_BYTES: Final = 4 << 20
DEFAULT_MEMORY_BYTES: Final = 64 << 20
#: A write running this long counts as stalled storage, not as a busy thread.
STALL_S: Final = 10.0
POLL_S: Final = 0.1
_IDLE_S: Final = 5.0


class Stopped(Exception):
    """The job's stop token was set: its chunks still queued were dropped, none is written."""


class CorruptChunk(Exception):
    """Bytes changed in memory between their checksum at gather time and their write."""


class Progress(Protocol):
    written: int


class Check(NamedTuple):
    """One piece of a chunk as gathered: ``crc32c(chunk[start:end], seed) == crc``.

    A named tuple, not a frozen dataclass: at 10,000 tensors a job makes one per tensor on
    the thread that limits the write, and a tuple is made in a third of the time."""

    start: int
    end: int
    seed: int
    crc: int
    what: str


class _Buffer:
    """An aligned buffer: an anonymous mapping (page-aligned, and unmapped when freed, where
    heap blocks of this size stayed in malloc's arenas), its pages faulted in by the kernel
    at once (MAP_POPULATE: 64 MiB took 23 ms that way, 57 ms faulted in by the first
    copies into it)."""

    __slots__ = ("mapping", "view")

    def __init__(self, nbytes: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self.mapping = mmap.mmap(-1, nbytes, flags=flags)
        self.view = memoryview(self.mapping)

    def unmap(self) -> None:
        # A slice a gatherer still holds keeps the pages mapped; they go when it does.
        with contextlib.suppress(BufferError):
            self.view.release()
            self.mapping.close()


@dataclass(eq=False)
class Chunk:
    """A run of the data file's bytes, gathered into an aligned buffer to be written at
    ``offset``. Only the job's gather thread fills it; once submitted, only an I/O thread
    reads it."""

    buffer: _Buffer
    offset: int
    length: int = 0
    #: Bytes of tensor data in it (the rest is header), and how many of them progress
    #: already counted (a chunk written through early is written again later).
    data_bytes: int = 0
    counted: int = 0
    checks: list[Check] = field(default_factory=list)

    @property
    def view(self) -> memoryview:
        return self.buffer.view

    @property
    def room(self) -> int:
        return len(self.buffer.view) - self.length

    def verify(self) -> None:
        """Recompute every piece's checksum: what is written is what was checksummed."""
        view = self.view
        for check in self.checks:  # pieces of at most a chunk: crc32c itself, no wrapper
            actual = crc32c.crc32c(view[check.start : check.end], check.seed)
            if actual != check.crc:
                raise CorruptChunk(
                    f"the bytes of {check.what} changed in the daemon's memory between "
                    f"gathering (crc32c {check.crc:#010x}) and writing ({actual:#010x}) at "
                    f"file offset {self.offset + check.start}; nothing was published — "
                    "this points at failing memory: check the kernel log for ECC errors"
                )


class WriteScheduler:
    """The node's data writes: one fair pool of I/O threads and aligned buffers."""

    def __init__(
        self,
        *,
        io_threads: int = DEFAULT_IO_THREADS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        direct: bool = True,
        stall_seconds: float = STALL_S,
        name: str = "shmstage-disk",
    ) -> None:
        if chunk_bytes < BLOCK or chunk_bytes % BLOCK:
            raise ValueError(f"chunk_bytes must be a multiple of {BLOCK}, not {chunk_bytes}")
        self.io_threads = io_threads
        self.chunk_bytes = chunk_bytes
        self.buffers = max(1, memory_bytes // chunk_bytes)
        self.per_job = io_threads + 1
        self.direct = direct
        self.stall_seconds = stall_seconds
        self.refusals = RefusalLog()
        self._name = name
        self._cond = threading.Condition()
        self._queue: FairQueue[Chunk] = FairQueue()
        self._jobs: collections.Counter[Hashable] = collections.Counter()  # owner -> open
        self._open = 0
        self._free: list[_Buffer] = []
        self._allocated = 0
        self._threads = 0
        #: thread ident -> (owner, when its write began), for writes in progress.
        self._running: dict[int, tuple[Hashable, float]] = {}
        self._closed = False

    @property
    def buffer_bytes(self) -> int:
        """Memory in aligned buffers now (all of it is returned while no job writes)."""
        return self._allocated * self.chunk_bytes

    # -- what jobs call ----------------------------------------------------------

    def writer_for(self, fd: int, where: str) -> ChunkWriter:
        """The chunk writer for a data descriptor (direct where its filesystem allows)."""
        return chunkwriter.open_writer(
            fd,
            chunk_bytes=self.chunk_bytes,
            refused=self.refusals,
            where=where,
            direct=self.direct,
        )

    def open(
        self,
        writer: ChunkWriter,
        *,
        owner: Hashable,
        stop: threading.Event,
        progress: Progress | None = None,
        gatherers: int = 1,
    ) -> JobWrites:
        """A job's handle on the pool, until its ``close``; ``owner`` is whose turn it takes.
        ``gatherers``: threads that would fill its chunks at once (``gather.in_regions``);
        the handle's ``gatherers`` says how many the pool allows now (see ``_gatherers``)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the write scheduler is closed")
            self._jobs[owner] += 1
            self._open += 1
            allowed = max(1, min(gatherers, self._gatherers(owner)))
            writes = JobWrites(self, writer, owner, stop, progress, allowed)
            while self._threads < self.io_threads:
                self._start_thread()
        return writes

    def close(self) -> None:
        """Let the threads go once the queue is empty (jobs still open may finish)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- state, always under self._cond ---------------------------------------------

    def share(self, owner: Hashable, extra: int = 0) -> int:
        """Buffers one of ``owner``'s jobs may hold now: the pool split between owners,
        then between that owner's open jobs; a job with ``extra`` gatherers may hold as
        many more, within that split (each holds the chunk it fills)."""
        owners = len(self._jobs) or 1
        mine = self._jobs.get(owner, 0) or 1
        return max(1, min(self.per_job + extra, self.buffers // owners // mine))

    def _gatherers(self, owner: Hashable) -> int:
        """Gatherers a job of ``owner``'s may have: one, and one more for every buffer its
        part of the pool holds beyond a one-gatherer job's share. With eight users writing
        at once there is none to spare: four gatherers per job then fought over two
        buffers (8 GiB in 8 jobs on the H100 host: 5.3-6.4 s and 8.3 CPU-seconds, against
        5.1 s and 5.4 on one gatherer each)."""
        owners = len(self._jobs) or 1
        mine = self._jobs.get(owner, 0) or 1
        return max(1, self.buffers // owners // mine - self.per_job + 1)

    def _take_buffer(self) -> _Buffer | bool:
        """A free buffer; else True if the caller may map a new one (counted already)."""
        if self._free:
            return self._free.pop()
        if self._allocated < self.buffers:
            self._allocated += 1
            return True
        return False

    def _give_back(self, writes: JobWrites, chunk: Chunk) -> None:
        writes.held -= 1
        self._free.append(chunk.buffer)

    def _release_idle_buffers(self) -> None:
        """No job is writing: the buffers go back to the OS until the next checkpoint."""
        for buffer in self._free:
            buffer.unmap()
        self._allocated -= len(self._free)
        self._free.clear()

    def _fail(self, writes: JobWrites, error: BaseException) -> None:
        """The job's first error stands; nothing it still has queued is written."""
        if writes.failure is None:
            writes.failure = error
        self._drop(writes)

    def _drop(self, writes: JobWrites) -> None:
        for chunk in self._queue.drop(writes.owner, writes):
            writes.queued -= 1
            self._give_back(writes, chunk)
        self._cond.notify_all()

    def _stalled(self, now: float) -> int:
        return sum(1 for _, began in self._running.values() if now - began > self.stall_seconds)

    def _grow_if_stalled(self) -> None:
        """Writes stuck on storage that stopped answering do not count as threads."""
        if not self._running or not self._queue:
            return
        healthy = self._threads - self._stalled(time.monotonic())
        if healthy < self.io_threads and self._threads < 2 * self.io_threads:
            self._start_thread()

    def _may_write(self, owner: Hashable) -> bool:
        busy = sum(1 for who, _ in self._running.values() if who == owner)
        return busy < self.io_threads

    def _start_thread(self) -> None:
        self._threads += 1
        name = f"{self._name}-{self._threads}"
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    # -- the I/O threads -----------------------------------------------------------

    def _serve(self) -> None:
        me = threading.get_ident()
        while True:
            with self._cond:
                taken = self._next(me)
                if taken is None:
                    return
                writes, chunk = taken
            error: BaseException | None = None
            try:
                if writes.stop.is_set():
                    raise Stopped
                faults.maybe_eio("write")
                faults.pause("write")
                chunk.verify()
                writes.writer.write(chunk.view, chunk.offset, chunk.length)
            except BaseException as exc:  # the job's to raise, never the pool's
                error = exc
            with self._cond:
                del self._running[me]
                writes.writing -= 1
                if error is None:
                    writes.count(chunk)
                else:
                    self._fail(writes, error)
                self._give_back(writes, chunk)
                self._cond.notify_all()
            # Nothing of this chunk may stay alive while the thread waits for the next:
            # its job (and its checks, one per tensor) would, until another job comes.
            del taken, writes, chunk, error

    def _next(self, me: int) -> tuple[JobWrites, Chunk] | None:
        """The next chunk in turn for thread ``me``, or None when the thread should end."""
        while True:
            taken = self._queue.pop(self._may_write) if self._queue else None
            if taken is not None:
                writes, chunk = taken
                assert isinstance(writes, JobWrites)
                writes.queued -= 1
                writes.writing += 1
                self._running[me] = (writes.owner, time.monotonic())
                return writes, chunk
            surplus = self._threads > self.io_threads + self._stalled(time.monotonic())
            if (self._closed and not self._queue) or surplus:
                self._threads -= 1
                return None
            self._cond.wait(_IDLE_S)


class JobWrites:
    """One job's chunks on the pool; used by that job's threads only (its gatherers take
    and submit chunks under the pool's lock).

    A context manager: leaving it waits until none of the job's writes is in progress and
    drops what is still queued, so no write outlives the job (its descriptor is closed
    next, and a write landing in a reused descriptor would corrupt another file).
    """

    def __init__(
        self,
        scheduler: WriteScheduler,
        writer: ChunkWriter,
        owner: Hashable,
        stop: threading.Event,
        progress: Progress | None,
        gatherers: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self.writer = writer
        self.owner = owner
        self.stop = stop
        self.progress = progress
        self.failure: BaseException | None = None
        self.held = 0  # buffers out of the pool: being gathered, queued or being written
        self.queued = 0
        self.writing = 0
        #: Seconds its gatherers waited for a buffer while their share was in flight (added
        #: up), and the job waited for its writes to end (``drain``): see ``disk_wait``.
        self.waited = 0.0
        self.drained = 0.0
        #: Threads that may fill its chunks at once (see ``extra``).
        self.gatherers = gatherers
        self._gathering: list[Chunk] = []
        self._closed = False

    @property
    def extra(self) -> int:
        """Gatherers beyond the first. Each holds the chunk it fills: one buffer more per
        extra gatherer, so the job's writes stay as many in flight."""
        return max(0, self.gatherers - 1)

    def __enter__(self) -> JobWrites:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chunk(self, offset: int) -> Chunk:
        """An empty chunk for the file's bytes from ``offset`` (a multiple of BLOCK).

        Waits while the job holds its share of buffers; raises the job's first write
        error, or Stopped once the stop token is set.
        """
        pool = self.scheduler
        with pool._cond:
            began = 0.0
            while True:
                self._check()
                if self.held < pool.share(self.owner, self.extra):
                    buffer = pool._take_buffer()
                    if buffer:
                        self.held += 1
                        break
                began = began or time.perf_counter()
                pool._grow_if_stalled()
                pool._cond.wait(POLL_S)
            if began:
                self.waited += time.perf_counter() - began
        if buffer is True:  # mapped outside the lock: populating takes a millisecond or two
            try:
                buffer = _Buffer(pool.chunk_bytes)
            except BaseException:
                with pool._cond:
                    pool._allocated -= 1
                    self.held -= 1
                raise
        assert isinstance(buffer, _Buffer)
        chunk = Chunk(buffer, offset)
        with pool._cond:
            self._gathering.append(chunk)
        return chunk

    def submit(self, chunk: Chunk) -> None:
        """Queue a gathered chunk for writing; the job may not touch it any more."""
        pool = self.scheduler
        with pool._cond:
            self._gathering.remove(chunk)
            if self.failure is not None:
                pool._give_back(self, chunk)
                self._check()
            self.queued += 1
            pool._queue.put(self.owner, self, chunk)
            pool._grow_if_stalled()
            pool._cond.notify_all()

    def disk_wait(self, gatherers: int) -> float:
        """Seconds the job waited on the disk, for a buffer (its ``gatherers``' average) or
        for its last writes: the rest of its time gathering is its own work, so this tells
        a disk-bound write from a writer-bound one."""
        return self.waited / max(1, gatherers) + self.drained

    def fail(self, error: BaseException) -> None:
        """End the job's writes with ``error`` (one of its gatherers failed): queued chunks
        are dropped, and its other gatherers raise it when they next ask for a chunk."""
        with self.scheduler._cond:
            self.scheduler._fail(self, error)

    def drain(self) -> None:
        """Until every submitted chunk is written; raises the job's first write error."""
        pool = self.scheduler
        began = time.perf_counter()
        with pool._cond:
            while self.queued or self.writing:
                if self.stop.is_set() and self.failure is None:
                    pool._fail(self, Stopped())
                pool._grow_if_stalled()
                pool._cond.wait(POLL_S)
            self.drained += time.perf_counter() - began
            self._check()

    def write_through(self, chunk: Chunk) -> None:
        """Write a chunk still being gathered, as far as it goes, and wait for it and all
        before it (it is written again in full later). For the ``mid-stream`` fault hook,
        which promises that the first tensor is in the file."""
        self.drain()
        chunk.verify()
        self.writer.write(chunk.view, chunk.offset, chunk.length)
        with self.scheduler._cond:
            self.count(chunk)

    def count(self, chunk: Chunk) -> None:
        """A chunk is in the file: progress for ``shmstage status`` (under the pool's lock)."""
        if self.progress is not None:
            self.progress.written += chunk.data_bytes - chunk.counted
        chunk.counted = chunk.data_bytes

    def close(self) -> None:
        if self._closed:
            return
        pool = self.scheduler
        with pool._cond:
            self._closed = True
            pool._drop(self)
            while self.writing:
                pool._cond.wait(POLL_S)
            for chunk in self._gathering:
                pool._give_back(self, chunk)
            self._gathering.clear()
            pool._jobs[self.owner] -= 1
            if pool._jobs[self.owner] <= 0:
                del pool._jobs[self.owner]
            pool._open -= 1
            if pool._open == 0:
                pool._release_idle_buffers()
            pool._cond.notify_all()

    def _check(self) -> None:
        """Raise what ended the job's writes (under the pool's lock)."""
        if self.failure is None and self.stop.is_set():
            self.scheduler._fail(self, Stopped())
        if self.failure is not None:
            raise self.failure


_shared: WriteScheduler | None = None
_shared_lock = threading.Lock()


def install(scheduler: WriteScheduler) -> None:
    """Make ``scheduler`` the one every job of this process uses (the daemon's, configured)."""
    global _shared
    with _shared_lock:
        _shared = scheduler


def shared() -> WriteScheduler:
    """The process's scheduler: the daemon's, or one with default settings (jobs run
    outside a daemon: tests, tools)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WriteScheduler()
        return _shared
