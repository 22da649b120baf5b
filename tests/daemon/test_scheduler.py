"""The write scheduler through its interface: jobs of several users share the I/O threads
in fair turns, hold at most their share of buffers, and stop, fail or stall alone.

The chunk writer here records writes in memory and can hold a write until the test lets
it go: a gate, not a clock, decides what is queued when a thread picks its next chunk, so
the orders asserted are deterministic.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Iterator

import pytest
from shmstage_daemon.chunkwriter import BLOCK, ChunkWriter
from shmstage_daemon.scheduler import Check, CorruptChunk, JobWrites, Stopped, WriteScheduler

from shmstage.checkpoint import checksum

WAIT_S = 30


class Recorder(ChunkWriter):
    """Records (name, offset, bytes) of each write; ``hold`` keeps writes waiting until
    ``release``; ``fail_at`` makes the n-th write of this writer raise EIO."""

    direct = True

    def __init__(
        self, name: str, log: list[tuple[str, int, bytes]], *, hold: bool = False, fail_at: int = 0
    ) -> None:
        super().__init__(-1)
        self.name = name
        self.log = log
        self.released = threading.Event()
        if not hold:
            self.released.set()
        self.fail_at = fail_at
        self.calls = 0
        self.entered = threading.Semaphore(0)
        self.lock = threading.Lock()

    def write(self, buffer: memoryview, offset: int, length: int) -> None:
        with self.lock:
            self.calls += 1
            call = self.calls
        self.entered.release()
        assert self.released.wait(WAIT_S), f"{self.name}: never released"
        if call == self.fail_at:
            raise OSError(errno.EIO, "injected by the test's chunk writer")
        with self.lock:
            self.log.append((self.name, offset, bytes(buffer[:length])))

    def finish(self, size: int) -> None:
        pass

    def wait_entered(self, count: int = 1) -> None:
        for _ in range(count):
            assert self.entered.acquire(timeout=WAIT_S), f"{self.name}: no write began"


@pytest.fixture
def pools() -> Iterator[list[WriteScheduler]]:
    made: list[WriteScheduler] = []
    yield made
    for pool in made:
        pool.close()


def pool_of(pools: list[WriteScheduler], buffers: int, **kwargs: object) -> WriteScheduler:
    pool = WriteScheduler(chunk_bytes=BLOCK, memory_bytes=buffers * BLOCK, **kwargs)  # type: ignore[arg-type]
    pools.append(pool)
    return pool


def put(writes: JobWrites, index: int, payload: bytes | None = None) -> None:
    """Gather one chunk (its ``index``-th block of the file) and submit it."""
    data = payload if payload is not None else f"{index}".encode() * 3
    chunk = writes.chunk(index * BLOCK)
    chunk.view[: len(data)] = data
    chunk.checks.append(Check(0, len(data), 0, checksum(data), f"block {index}"))
    chunk.length = len(data)
    writes.submit(chunk)


def test_chunks_of_several_users_are_written_in_fair_turns(pools: list[WriteScheduler]) -> None:
    """One I/O thread, held on user g's write while user a queues two chunks in each of two
    jobs and user b two in one job: then users alternate, and a's jobs take a's turns."""
    pool = pool_of(pools, buffers=12, io_threads=1)
    log: list[tuple[str, int, bytes]] = []
    gate = Recorder("g", log, hold=True)
    jobs = {
        "g": pool.open(gate, owner="g", stop=threading.Event()),
        "a1": pool.open(Recorder("a1", log), owner="a", stop=threading.Event()),
        "a2": pool.open(Recorder("a2", log), owner="a", stop=threading.Event()),
        "b1": pool.open(Recorder("b1", log), owner="b", stop=threading.Event()),
    }
    put(jobs["g"], 0)
    gate.wait_entered()
    for name in ("a1", "a2", "b1"):
        put(jobs[name], 0)
        put(jobs[name], 1)
    gate.released.set()
    for writes in jobs.values():
        writes.drain()
        writes.close()
    order = [f"{name}.{offset // BLOCK}" for name, offset, _ in log]
    assert order == ["g.0", "a1.0", "b1.0", "a2.0", "b1.1", "a1.1", "a2.1"]


def test_a_job_gets_extra_gatherers_only_while_its_part_of_the_pool_has_room(
    pools: list[WriteScheduler],
) -> None:
    """16 buffers, two I/O threads (a one-gatherer job's share: 3). Writing alone, a job
    may have the four gatherers it asks for and hold 3 + 3 buffers; with seven other users
    writing, its part of the pool is two buffers, and it gets one gatherer."""
    pool = pool_of(pools, buffers=16, io_threads=2)
    alone = pool.open(Recorder("a", []), owner="a", stop=threading.Event(), gatherers=4)
    assert alone.gatherers == 4 and pool.share("a", alone.extra) == 6
    alone.close()
    others = [
        pool.open(Recorder(f"u{i}", []), owner=f"u{i}", stop=threading.Event()) for i in range(7)
    ]
    crowded = pool.open(Recorder("a", []), owner="a", stop=threading.Event(), gatherers=4)
    assert crowded.gatherers == 1 and pool.share("a", crowded.extra) == 2
    for writes in [*others, crowded]:
        writes.close()


def test_a_job_holds_at_most_its_share_and_memory_goes_back_when_idle(
    pools: list[WriteScheduler],
) -> None:
    """8 buffers, user a with three jobs and user b with one: each of a's jobs may hold one
    buffer, b's job three (its per-job limit, two I/O threads + 1). A job at its share
    waits for one of its own writes to finish; buffers are unmapped once no job is open."""
    pool = pool_of(pools, buffers=8, io_threads=2)
    log: list[tuple[str, int, bytes]] = []
    held = Recorder("b", log, hold=True)
    a_jobs = [
        pool.open(Recorder(f"a{i}", log), owner="a", stop=threading.Event()) for i in range(3)
    ]
    b_job = pool.open(held, owner="b", stop=threading.Event())
    assert [pool.share("a"), pool.share("b")] == [1, 3]
    for index in range(3):
        put(b_job, index)
    held.wait_entered(2)  # two writes in progress, one queued: b holds its three buffers
    assert pool.buffer_bytes <= 8 * BLOCK
    fourth = threading.Thread(target=put, args=(b_job, 3))
    fourth.start()
    fourth.join(0.3)
    assert fourth.is_alive(), "a job took a fourth buffer beyond its share"
    held.released.set()
    fourth.join(WAIT_S)
    assert not fourth.is_alive()
    b_job.drain()
    for writes in [*a_jobs, b_job]:
        writes.close()
    assert sorted(offset // BLOCK for name, offset, _ in log if name == "b") == [0, 1, 2, 3]
    assert pool.buffer_bytes == 0


def test_a_stop_drops_what_is_queued_and_the_job_raises_stopped(
    pools: list[WriteScheduler],
) -> None:
    pool = pool_of(pools, buffers=8, io_threads=1)
    log: list[tuple[str, int, bytes]] = []
    held = Recorder("a", log, hold=True)
    stop = threading.Event()
    writes = pool.open(held, owner="a", stop=stop)
    other = pool.open(Recorder("b", log), owner="b", stop=threading.Event())
    put(writes, 0)
    put(writes, 1)  # its share: one write in progress, one queued
    held.wait_entered()
    stop.set()
    held.released.set()
    with pytest.raises(Stopped):
        writes.drain()
    with pytest.raises(Stopped):
        writes.chunk(2 * BLOCK)
    writes.close()
    assert [offset for name, offset, _ in log if name == "a"] == [0]  # the one in progress
    put(other, 0)
    other.drain()  # another job on the same pool is not affected
    other.close()
    assert ("b", 0, b"000") in log


def test_a_write_error_fails_its_job_only(pools: list[WriteScheduler]) -> None:
    pool = pool_of(pools, buffers=8, io_threads=1)
    log: list[tuple[str, int, bytes]] = []
    failing = pool.open(Recorder("a", log, fail_at=2), owner="a", stop=threading.Event())
    healthy = pool.open(Recorder("b", log), owner="b", stop=threading.Event())
    for index in range(4):
        put(healthy, index)
        with contextlib.suppress(OSError):  # raised here or by drain, whichever comes first
            put(failing, index)
    with pytest.raises(OSError, match="injected") as info:
        failing.drain()
    assert info.value.errno == errno.EIO
    failing.close()
    healthy.drain()
    healthy.close()
    assert [offset // BLOCK for name, offset, _ in log if name == "a"] == [0]
    assert [offset // BLOCK for name, offset, _ in log if name == "b"] == [0, 1, 2, 3]


def test_bytes_changed_after_gathering_are_caught_before_they_are_written(
    pools: list[WriteScheduler],
) -> None:
    """A bit flipped in a gathered chunk (what failing memory would do between the
    gather and the write): the I/O thread's check refuses the chunk."""
    pool = pool_of(pools, buffers=4, io_threads=1)
    log: list[tuple[str, int, bytes]] = []
    writes = pool.open(Recorder("a", log), owner="a", stop=threading.Event())
    put(writes, 0)
    chunk = writes.chunk(BLOCK)
    chunk.view[:5] = b"hello"
    chunk.checks.append(Check(0, 5, 0, checksum(b"hello"), "tensor 'w'"))
    chunk.length = 5
    chunk.view[4] ^= 1
    writes.submit(chunk)
    with pytest.raises(CorruptChunk, match="tensor 'w' changed in the daemon's memory"):
        writes.drain()
    writes.close()
    assert [offset for _, offset, _ in log] == [0]


def test_storage_that_stops_answering_holds_up_only_its_owner(
    pools: list[WriteScheduler],
) -> None:
    """User a's storage hangs with two writes in progress, taking both I/O threads. Past
    the stall time the pool starts more threads, which serve user b (a may not occupy more
    threads than the pool's size), so b's checkpoint completes while a's hangs."""
    pool = pool_of(pools, buffers=16, io_threads=2, stall_seconds=0.2)
    log: list[tuple[str, int, bytes]] = []
    hung = Recorder("a", log, hold=True)
    a_job = pool.open(hung, owner="a", stop=threading.Event())
    b_job = pool.open(Recorder("b", log), owner="b", stop=threading.Event())
    for index in range(3):
        put(a_job, index)
    hung.wait_entered(2)
    for index in range(2):
        put(b_job, index)
    b_job.drain()  # returns although both original threads are stuck in a's writes
    assert sorted(offset // BLOCK for name, offset, _ in log if name == "b") == [0, 1]
    assert hung.calls == 2, "a third write of the hung user's was started"
    hung.released.set()
    a_job.drain()
    for writes in (a_job, b_job):
        writes.close()
    assert sorted(offset // BLOCK for name, offset, _ in log if name == "a") == [0, 1, 2]
