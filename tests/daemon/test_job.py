"""The persist job, in-process on real segments and real files: what it writes is exactly
the staged bytes, however many tensors and whatever their sizes, and nothing that does not
verify is ever published.

Files go to ``tmp_path`` (ext4 here, which takes direct I/O), through a write scheduler
with small chunks, so that block and chunk boundaries fall everywhere in a few MiB.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import resident_pages, staged_job
from safetensors import safe_open
from shmstage_daemon import faults, gather, job, scheduler
from shmstage_daemon.chunkwriter import BLOCK

from shmstage import checkpoint, manifest, names, packing, segment
from shmstage.layout import TensorSpec

CHUNK = 16 * BLOCK


def pattern(index: int, nbytes: int) -> bytes:
    """Bytes that differ per tensor and per position, so any misplacement shows."""
    return (bytes(range(index % 7, 256)) * (nbytes // 200 + 1))[:nbytes]


@pytest.fixture
def small_chunks() -> Iterator[scheduler.WriteScheduler]:
    """The process's scheduler for this test: 64 KiB chunks, 3 I/O threads, 6 buffers."""
    disk = scheduler.WriteScheduler(io_threads=3, chunk_bytes=CHUNK, memory_bytes=6 * CHUNK)
    previous = scheduler.shared()
    scheduler.install(disk)
    yield disk
    scheduler.install(previous)
    disk.close()


@pytest.fixture(params=["one-thread", "regions"])
def gathering(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the file is gathered: all on the job's thread, or cut into regions of at least
    two chunks on threads of their own, as a file of large tensors is (the thresholds
    lowered so that a file of a few chunks, of any tensors, is cut)."""
    if request.param == "regions":
        monkeypatch.setattr(gather, "MIN_REGION_BYTES", 2 * CHUNK)
        monkeypatch.setattr(gather, "MIN_MEAN_TENSOR_BYTES", 0)
    return request.param


@pytest.fixture
def fault(request: pytest.FixtureRequest) -> Iterator[None]:
    """Arm a test-only fault hook in this process (``indirect`` parameter), then disarm."""
    faults.load(request.param)
    yield
    faults.load("")


def tensors_of(sizes: list[int]) -> list[tuple[TensorSpec, bytes]]:
    return [(TensorSpec(f"t{i}", "U8", (n,)), pattern(i, n)) for i, n in enumerate(sizes)]


def assert_written_exactly(directory: Path, tensors: list[tuple[TensorSpec, bytes]]) -> None:
    """Stock safetensors reads every tensor back; every per-tensor checksum matches."""
    with safe_open(str(directory / "model.safetensors"), "numpy") as f:
        assert sorted(f.keys()) == sorted(spec.key for spec, _ in tensors)
        for spec, payload in tensors:
            assert f.get_tensor(spec.key).tobytes() == payload, spec.key
    assert checkpoint.verify(directory) == []


def entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


SIZES_AROUND_BOUNDARIES = [
    0,
    1,
    BLOCK - 1,
    BLOCK,
    BLOCK + 1,
    0,
    CHUNK - 1,
    CHUNK,
    CHUNK + 1,
    3 * CHUNK + BLOCK - 1,
    2,
    0,
]


@pytest.mark.parametrize(
    "sizes",
    [
        SIZES_AROUND_BOUNDARIES,
        list(reversed(SIZES_AROUND_BOUNDARIES)),
        [7],  # a file shorter than one block: the whole file is the padded tail
        [0, 0, 0],  # only empty tensors
        [CHUNK - 4096],  # header + data end exactly on a chunk boundary
    ],
    ids=["around-boundaries", "reversed", "one-tiny-tensor", "only-empty", "exactly-a-chunk"],
)
def test_tensor_sizes_around_block_and_chunk_boundaries_are_written_exactly(
    tmp_path: Path,
    instance_id: str,
    small_chunks: scheduler.WriteScheduler,
    sizes: list[int],
    gathering: str,
) -> None:
    tensors = tensors_of(sizes)
    persist = staged_job(tmp_path / "c", instance_id, tensors)
    result = job.run(persist)
    assert result.ok, result.message
    size = len(persist.header) + sum(sizes)
    assert (tmp_path / "c" / "model.safetensors").stat().st_size == size  # padding cut off
    assert result.bytes == size
    assert_written_exactly(tmp_path / "c", tensors)
    assert persist.progress.written == sum(sizes)
    assert entries(tmp_path / "c") == ["model.safetensors", "shmstage-manifest.json"]


def test_many_small_tensors_are_gathered_into_shared_chunks(
    tmp_path: Path, instance_id: str, small_chunks: scheduler.WriteScheduler, gathering: str
) -> None:
    """2,000 tensors of 0 to 3 KiB: most chunks hold dozens of tensors, many tensors
    straddle two chunks; more chunks than the pool has buffers."""
    rng = random.Random(7)
    tensors = tensors_of([rng.randrange(0, 3 * 1024) for _ in range(2000)])
    persist = staged_job(tmp_path / "c", instance_id, tensors)
    assert job.run(persist).ok
    assert_written_exactly(tmp_path / "c", tensors)


def test_tensors_packed_into_shared_segments_are_gathered_from_their_places(
    tmp_path: Path, instance_id: str, small_chunks: scheduler.WriteScheduler, gathering: str
) -> None:
    """A layout of many tensors, its small ones packed several to a segment, large ones
    (here over a pack's size) in segments of their own between them: every tensor comes
    from its own place, whole, whichever thread gathers it."""
    rng = random.Random(3)
    sizes = [rng.randrange(0, 5000) for _ in range(600)]
    sizes[10] = sizes[300] = packing.PACK_BELOW + 123  # large: their own segments
    sizes[11] = 0
    tensors = tensors_of(sizes)
    persist = staged_job(tmp_path / "c", instance_id, tensors, packed=True)
    assert 2 < len(persist.segments) < 10
    assert job.run(persist).ok
    assert_written_exactly(tmp_path / "c", tensors)


def test_tensors_back_to_back_in_a_pack_are_read_together(
    tmp_path: Path,
    instance_id: str,
    small_chunks: scheduler.WriteScheduler,
    monkeypatch: pytest.MonkeyPatch,
    gathering: str,
) -> None:
    """Model tensors' sizes are multiples of 64 bytes, so packed ones follow each other in
    their segment as they do in the file: a run of them is read a piece at a time (a spy
    counts the real reads), not tensor by tensor, and each still gets its own checksum.
    Empty tensors and a large one between them do not get in the way."""
    reads: list[int] = []
    real = gather._read_exactly

    def counting(fd: int, target: memoryview, offset: int, ref: segment.SegmentRef) -> None:
        reads.append(len(target))
        real(fd, target, offset, ref)

    monkeypatch.setattr(gather, "_read_exactly", counting)
    rng = random.Random(5)
    sizes = [64 * rng.randrange(1, 40) for _ in range(900)]
    sizes[5] = sizes[6] = sizes[400] = 0
    sizes[300] = packing.PACK_BELOW + 64
    tensors = tensors_of(sizes)
    persist = staged_job(tmp_path / "c", instance_id, tensors, packed=True)
    result = job.run(persist)
    assert result.ok, result.message
    assert sum(reads) == sum(sizes)
    pieces = -(-(len(persist.header) + sum(sizes)) // CHUNK)
    assert len(reads) <= pieces + 4 * len(persist.segments) + 4 < len(sizes) // 10
    assert_written_exactly(tmp_path / "c", tensors)


def test_runs_are_parts_that_follow_each_other_in_one_segment() -> None:
    """A run ends where the next part is in another segment, or not right after the last
    byte read (a packed tensor whose size is not a multiple of the pack's alignment); an
    empty part never breaks one; a part of a tensor cut by a region starts inside it."""
    places = [(0, 0), (0, 64), (0, 192), (0, 192), (0, 320), (1, 0), (0, 384)]
    plan = [(0, 0, 64), (1, 0, 128), (2, 0, 0), (3, 0, 100), (4, 0, 64), (5, 0, 10), (6, 8, 56)]
    assert gather.runs(plan, places) == [
        (0, 0, [(0, 0, 64), (1, 0, 128), (2, 0, 0), (3, 0, 100)]),
        (0, 320, [(4, 0, 64)]),
        (1, 0, [(5, 0, 10)]),
        (0, 392, [(6, 8, 56)]),
    ]
    assert gather.runs([(2, 0, 0)], places) == [(0, 192, [(2, 0, 0)])]
    assert gather.runs([], places) == []


def test_a_packed_segment_is_opened_once_for_its_tensors_and_closed_after(
    tmp_path: Path,
    instance_id: str,
    small_chunks: scheduler.WriteScheduler,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Opening a segment per tensor cost a tenth of a 10,000-tensor gather; tensors packed
    together follow each other, so their segment is opened once (a spy counts the real
    opens), and no descriptor outlives the job."""
    opened: list[str] = []
    real = gather.open_segment

    def counting(ref: segment.SegmentRef) -> int:
        opened.append(ref.name)
        return real(ref)

    monkeypatch.setattr(gather, "open_segment", counting)
    tensors = tensors_of([1000 + i for i in range(400)])
    before = sorted(os.listdir("/proc/self/fd"))
    persist = staged_job(tmp_path / "c", instance_id, tensors, packed=True)
    assert job.run(persist).ok
    assert sorted(opened) == sorted(ref.name for ref in persist.segments)
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert_written_exactly(tmp_path / "c", tensors)


def test_default_chunks_a_tensor_larger_than_a_chunk(tmp_path: Path, instance_id: str) -> None:
    """The daemon's default chunk size, with a tensor of several chunks that ends unaligned."""
    chunk = scheduler.shared().chunk_bytes
    tensors = tensors_of([5, 2 * chunk + 3, chunk - 5, 1000])
    persist = staged_job(tmp_path / "c", instance_id, tensors)
    assert job.run(persist).ok
    assert_written_exactly(tmp_path / "c", tensors)


def test_a_direct_write_leaves_the_file_out_of_the_page_cache(
    tmp_path: Path, instance_id: str
) -> None:
    """Where the filesystem takes direct I/O, none of the 24 MiB stays cached after the job."""
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    tensors = tensors_of([8 << 20, 8 << 20, (8 << 20) + 13])
    persist = staged_job(tmp_path / "c", instance_id, tensors)
    assert job.run(persist).ok
    cached = resident_pages(tmp_path / "c" / "model.safetensors")
    assert cached <= 2, f"{cached} pages of the data file are in the page cache"
    assert_written_exactly(tmp_path / "c", tensors)


@pytest.mark.parametrize("fault", ["flip-gathered:2"], indirect=True)
def test_bytes_changed_between_gather_and_write_are_never_published(
    tmp_path: Path,
    instance_id: str,
    small_chunks: scheduler.WriteScheduler,
    fault: None,
    gathering: str,
) -> None:
    """Memory corruption cannot be caused for real: the test-only ``flip-gathered`` shim
    flips a bit in the second gathered chunk after its checksums were taken. The I/O thread
    checks the chunk again before writing it, so the job fails and removes its files."""
    tensors = tensors_of([CHUNK // 2, 3 * CHUNK, 100])
    persist = staged_job(tmp_path / "c", instance_id, tensors)
    result = job.run(persist)
    assert not result.ok and result.code == "internal", result
    assert "tensor 't1'" in result.message and "changed in the daemon's memory" in result.message
    assert "nothing was published" in result.message
    assert entries(tmp_path / "c") == []


@pytest.mark.parametrize("buffers, gatherers", [(16, 4), (6, 3), (4, 1)])
def test_a_file_of_large_tensors_is_gathered_in_regions_and_checksummed_whole(
    tmp_path: Path,
    instance_id: str,
    monkeypatch: pytest.MonkeyPatch,
    buffers: int,
    gatherers: int,
) -> None:
    """Tensors cut by every region boundary (one spans three regions): each tensor's
    checksum, combined from its parts, is that of its bytes. The job has as many regions,
    up to four, as the pool lets it have gatherers (three I/O threads: a one-gatherer job
    holds four buffers, and each gatherer more one more)."""
    monkeypatch.setattr(gather, "MIN_REGION_BYTES", 2 * CHUNK)
    monkeypatch.setattr(gather, "MIN_MEAN_TENSOR_BYTES", CHUNK)
    used: list[int] = []
    in_regions = gather.in_regions

    def spy(*args: object) -> list[int]:  # counts the regions, then runs the real thing
        used.append(len(args[-1]))  # type: ignore[arg-type]
        return in_regions(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gather, "in_regions", spy)
    disk = scheduler.WriteScheduler(io_threads=3, chunk_bytes=CHUNK, memory_bytes=buffers * CHUNK)
    monkeypatch.setattr(scheduler, "_shared", disk)
    sizes = [CHUNK + 7, 5 * CHUNK + 3, 2 * CHUNK - 1, CHUNK // 2]
    tensors = [(TensorSpec(f"t{i}", "U8", (n,)), os.urandom(n)) for i, n in enumerate(sizes)]
    persist = staged_job(tmp_path / "c", instance_id, tensors)
    assert len(gather.regions(len(persist.header), sizes, CHUNK)) == 4
    result = job.run(persist)
    disk.close()
    assert result.ok, result.message
    assert used == ([gatherers] if gatherers > 1 else [])
    assert_written_exactly(tmp_path / "c", tensors)
    assert persist.progress.written == sum(sizes)


def test_small_tensors_are_gathered_on_one_thread() -> None:
    """Regions pay off only where reading and checksumming release the GIL for long: a
    file of small tensors, however large, is one region."""
    assert gather.regions(4096, [64 << 10] * 50_000, 4 << 20) == [0]
    assert gather.regions(4096, [16 << 20] * 8, 4 << 20) == [0]  # 128 MiB: too little
    starts = gather.regions(4096, [16 << 20] * 512, 4 << 20)
    assert len(starts) == gather.MAX_REGIONS and starts[0] == 0


def test_a_job_reports_where_its_time_went(
    tmp_path: Path, instance_id: str, small_chunks: scheduler.WriteScheduler
) -> None:
    """Gathering, waiting on the disk, syncing, publishing: none negative, together the
    job's time, and on the wire as the client reads them."""
    tensors = tensors_of([4096 + 3 * i for i in range(300)])
    result = job.run(staged_job(tmp_path / "c", instance_id, tensors))
    assert result.ok and result.phases is not None, result
    phases = result.phases.wire()
    assert set(phases) == {"gather_seconds", "disk_wait_seconds", "sync_seconds", "publish_seconds"}
    assert all(value >= 0 for value in phases.values()), phases
    assert phases["gather_seconds"] > 0 and phases["publish_seconds"] > 0, phases
    assert sum(phases.values()) == pytest.approx(result.seconds, abs=1e-3)
    assert result.to_wire()["phases"] == phases
    assert_written_exactly(tmp_path / "c", tensors)


def test_a_later_save_renders_its_manifest_from_the_entries_an_earlier_one_kept(
    tmp_path: Path, instance_id: str, small_chunks: scheduler.WriteScheduler
) -> None:
    """The entries come back with the result; given to the next job of the layout they
    are used as they are, and entries of another data file are not."""
    tensors = tensors_of([100, 200, 300])
    first = job.run(staged_job(tmp_path / "a", instance_id, tensors))
    assert first.ok and first.entries is not None, first
    again = staged_job(tmp_path / "b", instance_id, tensors)
    again.layout, again.entries = first.entries.layout, first.entries
    second = job.run(again)
    assert second.ok and second.entries is first.entries
    other = staged_job(tmp_path / "c", instance_id, tensors)
    other.layout = first.entries.layout
    other.entries = manifest.TensorEntries(other.layout, "another.safetensors")
    third = job.run(other)
    assert third.ok and third.entries is not None
    assert third.entries is not other.entries and third.entries.data_file == "model.safetensors"
    for name in ("a", "b", "c"):
        assert_written_exactly(tmp_path / name, tensors)


@pytest.mark.parametrize("fault", ["pause-write:0.05"], indirect=True)
def test_a_slow_disk_shows_as_disk_wait_not_as_gathering(
    tmp_path: Path, instance_id: str, small_chunks: scheduler.WriteScheduler, fault: None
) -> None:
    """Every write held up 50 ms (a slow disk: the fault hook, since no test can slow this
    disk for real): the job's thread spends that time waiting for its buffers to come
    back, and says so, rather than counting it as its own gathering."""
    tensors = tensors_of([CHUNK] * 12)  # 13 chunks on 3 I/O threads: >= 0.2 s of writes
    result = job.run(staged_job(tmp_path / "c", instance_id, tensors))
    assert result.ok and result.phases is not None, result
    assert result.phases.disk_wait >= 0.1, result.phases
    assert result.phases.disk_wait > 4 * result.phases.gather, result.phases
    assert_written_exactly(tmp_path / "c", tensors)


def test_a_segment_gone_before_it_is_gathered_fails_the_job_without_a_hang(
    tmp_path: Path, instance_id: str, gathering: str
) -> None:
    """A segment that cannot be read fails the job at once, with the pool down to one
    buffer (which the failed chunk holds): the job fails naming the segment, and removes
    its files."""
    disk = scheduler.WriteScheduler(io_threads=1, chunk_bytes=CHUNK, memory_bytes=CHUNK)
    previous = scheduler.shared()
    scheduler.install(disk)
    try:
        rng = random.Random(3)
        tensors = tensors_of([rng.randrange(1, 3 * 1024) for _ in range(2000)])
        persist = staged_job(tmp_path / "c", instance_id, tensors)
        segment.unlink(persist.segments[1500].name)
        results: list[job.JobResult] = []
        runner = threading.Thread(target=lambda: results.append(job.run(persist)), daemon=True)
        runner.start()
        runner.join(30)
    finally:
        scheduler.install(previous)
        disk.close()
    assert results, "the job hung"
    result = results[0]
    assert not result.ok and result.code == "storage", result
    assert persist.segments[1500].name in result.message, result.message
    assert entries(tmp_path / "c") == []


class LogLines(logging.Handler):
    """Collects the daemon's log records and signals when one contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = threading.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        if self.text in line:
            self.seen.set()


@pytest.mark.parametrize("fault", ["pause-mid-stream:1"], indirect=True)
def test_a_stop_mid_stream_interrupts_the_job_and_keeps_its_files(
    tmp_path: Path, instance_id: str, small_chunks: scheduler.WriteScheduler, fault: None
) -> None:
    """The daemon's stop token, set while the job is held mid-stream for a second by the
    ``pause-mid-stream`` hook (the first tensor is in the file by then): the job stops at
    its next chunk and returns ``interrupted``, leaving both temporary files for the
    journal — nothing removed, nothing published."""
    lines = LogLines("fault: pausing at mid-stream")
    logger = logging.getLogger("shmstaged.faults")
    logger.addHandler(lines)
    try:
        tensors = tensors_of([100, 5 * CHUNK, 7])
        persist = staged_job(tmp_path / "c", instance_id, tensors)
        results: list[job.JobResult] = []
        runner = threading.Thread(target=lambda: results.append(job.run(persist)))
        runner.start()
        assert lines.seen.wait(60), lines.lines
        persist.stop.set()
        runner.join(60)
    finally:
        logger.removeHandler(lines)
    assert results and results[0].interrupted and not results[0].ok, results
    assert "stopped while writing model.safetensors" in results[0].message
    left = entries(tmp_path / "c")
    assert len(left) == 2 and all(names.is_temp(name) for name in left), left
    data = next(tmp_path / "c" / name for name in left if "model" in name)
    assert data.read_bytes()[len(persist.header) : len(persist.header) + 100] == pattern(0, 100)


@pytest.mark.parametrize("renameat2", ["kernel", "refused"])
def test_publishing_a_directory_never_replaces_anything_that_holds_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renameat2: str
) -> None:
    """``rename_noreplace`` with renameat2(RENAME_NOREPLACE), and with its fallback for a
    filesystem or C library that refuses it — simulated by hiding renameat2, since no such
    filesystem is at hand: a file or a non-empty directory under the new name stays."""
    if renameat2 == "refused":
        monkeypatch.setattr(job, "_renameat2", None)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (tmp_path / "pending").mkdir()
        (tmp_path / "a-file").write_text("kept")
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "theirs").write_text("kept")
        for taken in ("a-file", "full"):
            with pytest.raises(FileExistsError):
                job.rename_noreplace(dir_fd, "pending", taken)
        assert (tmp_path / "a-file").read_text() == "kept"
        assert os.listdir(tmp_path / "full") == ["theirs"]
        job.rename_noreplace(dir_fd, "pending", "published")
        assert sorted(os.listdir(tmp_path)) == ["a-file", "full", "published"]
    finally:
        os.close(dir_fd)


def test_a_new_directory_is_published_by_rename_and_undone_on_failure(
    tmp_path: Path, instance_id: str
) -> None:
    tensors = [(TensorSpec("w", "U8", (5,)), b"hello")]
    persist = staged_job(tmp_path / "c", instance_id, tensors, new=True)
    assert job.run(persist).ok
    assert os.listdir(tmp_path) == ["c"] and checkpoint.verify(tmp_path / "c") == []
    failing = staged_job(tmp_path / "d", instance_id, tensors, new=True)
    (tmp_path / "d").mkdir()  # the final name is taken meanwhile
    result = job.run(failing)
    assert not result.ok and result.code == "exists", result.message
    assert sorted(os.listdir(tmp_path)) == ["c", "d"] and os.listdir(tmp_path / "d") == []
