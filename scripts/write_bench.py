"""How fast the daemon's writer makes a staged checkpoint durable, against the disk's limits.

Runs on any Linux host, no GPU: stages a synthetic layout in real shared-memory segments,
then times, on the same directory and bytes (medians of ``--runs``):

- ``disk limit (direct I/O)``: the bytes written with aligned ``O_DIRECT`` writes on
  ``--limit-threads`` threads, then fsync: what the disk can do;
- ``raw buffered write``: the same bytes with plain ``pwrite`` + fsync on one thread;
- ``shmstaged writer``: ``job.run`` — gather, checksum, write, fsync, link, manifest — with the
  write scheduler configured from the flags (``--jobs N`` runs N such jobs at once, of
  ``--owners`` users in turn, and reports their aggregate and each job's time).

The disk's pace drifts within minutes, so the limit and the writer (each ``--variants``
entry) are run in turn, round by round, and each writer is also reported as the median of
its time ÷ its own round's limit.

While each runs, /proc/meminfo is sampled every 10 ms: the peak of Dirty + Writeback, and
how much Cached grew (shared memory counts as Cached, so the figure is the growth over what
was staged before the write). Speed is never asserted anywhere; this prints figures.

    .venv/bin/python scripts/write_bench.py --dir /mnt/ckpt/bench --size 8GiB --tensors 500
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shmstage_daemon import gather, job, scheduler
from shmstage_daemon.admission import Peer

from shmstage import datafile, instance, names, segment
from shmstage.layout import Layout, TensorSpec
from shmstage.manifest import MANIFEST_NAME
from shmstage.packing import Packing
from shmstage.units import format_size, parse_size


class MemInfo:
    """Samples Dirty + Writeback and Cached from /proc/meminfo while a run goes on."""

    def __init__(self) -> None:
        self.peak_dirty = 0
        self.cached_before = self.cached_peak = self._read()["Cached"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _read() -> dict[str, int]:
        values = {}
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
        return values

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            values = self._read()
            self.peak_dirty = max(self.peak_dirty, values["Dirty"] + values["Writeback"])
            self.cached_peak = max(self.cached_peak, values["Cached"])

    def __enter__(self) -> MemInfo:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cached_after = self._read()["Cached"]


def stage(instance: str, sizes: list[int]) -> list[segment.SegmentRef]:
    """The segments the daemon would make for tensors of ``sizes`` (small ones packed in a
    large layout), filled with bytes that differ per segment (a 1 MiB random block,
    rotated)."""
    block = os.urandom(1 << 20)
    refs = []
    for index, size in enumerate(Packing.of(sizes).sizes):
        ref = segment.create(instance, size)
        fd = segment.open_fd(ref, writable=True)
        try:
            shift = index % len(block)
            pattern = block[shift:] + block[:shift]
            for offset in range(0, size, len(pattern)):
                os.pwrite(fd, pattern[: size - offset], offset)
        finally:
            os.close(fd)
        refs.append(ref)
    return refs


def persist_job(
    directory: Path, layout: Layout, refs: list[segment.SegmentRef], header: bytes, uid: int
) -> job.PersistJob:
    directory.mkdir(parents=True)
    if uid != os.getuid():  # another user's job: its directory is that user's (needs root)
        os.chown(directory, uid, -1)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    data_tmp, manifest_tmp = names.temp_name("model.safetensors"), names.temp_name(MANIFEST_NAME)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    dest = job.Destination(
        dir_fd,
        os.open(data_tmp, flags, 0o644, dir_fd=dir_fd),
        os.open(manifest_tmp, flags, 0o644, dir_fd=dir_fd),
        "model.safetensors",
        data_tmp,
        manifest_tmp,
        path=str(directory),
    )
    return job.PersistJob(
        id=1,
        layout=layout,
        segments=refs,
        header=header,
        destination=dest,
        tree={"d": [[spec.key, {"T": spec.key}] for spec in layout.tensors]},
        metadata={},
        save_info={},
        peer=Peer(pid=os.getpid(), uid=uid, gid=os.getgid(), groups=frozenset()),
    )


def raw_write(path: Path, total: int, *, direct: bool, threads: int, chunk: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]
    for buffer in buffers:
        buffer.write(os.urandom(chunk))
    offsets = list(range(0, total, chunk))

    def work(index: int) -> None:
        view = memoryview(buffers[index])
        for offset in offsets[index::threads]:
            length = min(chunk, total - offset)
            os.pwrite(fd, view[: -(-length // 4096) * 4096 if direct else length], offset)
        view.release()

    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
        os.ftruncate(fd, total)
        os.fsync(fd)
    finally:
        os.close(fd)
        for buffer in buffers:
            buffer.close()


LIMIT = "disk limit (direct I/O)"
#: The gathering knobs as the daemon has them (``--gather-regions`` changes the last).
DEFAULTS = {
    "MIN_MEAN_TENSOR_BYTES": gather.MIN_MEAN_TENSOR_BYTES,
    "MAX_REGIONS": gather.MAX_REGIONS,
}


def writer_row(variant: str) -> str:
    return "shmstaged writer" if variant == "default" else f"writer {variant}"


def use_variant(variant: str) -> None:
    """Set the gathering knobs as ``variant`` says (see ``--variants``)."""
    gather.MIN_MEAN_TENSOR_BYTES = DEFAULTS["MIN_MEAN_TENSOR_BYTES"]  # type: ignore[misc]
    regions = DEFAULTS["MAX_REGIONS"]
    for option in variant.split("+"):
        key, _, value = option.partition("=")
        if key == "regions":
            regions = max(1, int(value))
        elif key == "small":
            gather.MIN_MEAN_TENSOR_BYTES = 0  # type: ignore[misc]
        elif key != "default":
            raise SystemExit(f"unknown variant {option!r} (see --variants)")
    gather.MAX_REGIONS = regions  # type: ignore[misc]


def merged(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from single-run ``timed`` results of several rounds."""
    return {
        "seconds": statistics.median(s["seconds"] for s in samples),
        "all_seconds": [s["seconds"] for s in samples],
        "cpu_seconds": statistics.median(s["cpu_seconds"] for s in samples),
        "peak_dirty_writeback": max(s["peak_dirty_writeback"] for s in samples),
        "cached_growth_peak": max(s["cached_growth_peak"] for s in samples),
        "cached_growth_after": max(s["cached_growth_after"] for s in samples),
        "extra": samples[-1]["extra"],
    }


def timed(runs: int, prepare: Callable[[int], Any], run: Callable[[Any], Any]) -> dict[str, Any]:
    seconds, cpu, dirty, cached_peak, cached_after, extra = [], [], [], [], [], None
    for attempt in range(runs):
        state = prepare(attempt)
        os.sync()
        with MemInfo() as memory:
            started, used = time.perf_counter(), time.process_time()
            extra = run(state)
            seconds.append(time.perf_counter() - started)
            cpu.append(time.process_time() - used)
        dirty.append(memory.peak_dirty)
        cached_peak.append(memory.cached_peak - memory.cached_before)
        cached_after.append(memory.cached_after - memory.cached_before)
    return {
        "seconds": statistics.median(seconds),
        "all_seconds": seconds,
        "cpu_seconds": statistics.median(cpu),
        "peak_dirty_writeback": max(dirty),
        "cached_growth_peak": max(cached_peak),
        "cached_growth_after": max(cached_after),
        "extra": extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where to write (emptied)")
    parser.add_argument("--size", default="2GiB", help="bytes per checkpoint")
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=1, help="checkpoints written at once")
    parser.add_argument(
        "--owners", type=int, default=1, help="users those jobs belong to (more than 1: root)"
    )
    parser.add_argument("--io-threads", type=int, default=scheduler.DEFAULT_IO_THREADS)
    parser.add_argument("--write-chunk", default="4MiB")
    parser.add_argument("--write-buffers", default="64MiB")
    parser.add_argument("--buffered", action="store_true", help="the writer without O_DIRECT")
    parser.add_argument(
        "--gather-regions",
        type=int,
        default=gather.MAX_REGIONS,
        help="at most this many threads gather a file of large tensors (1: the job's alone)",
    )
    parser.add_argument(
        "--variants",
        default="default",
        help="comma list of writers to alternate with the direct-I/O limit, round by round; "
        "each '+'-joined from: default, regions=N (at most N gathering threads; 1: the "
        "job's alone), small (files of small tensors get several too)",
    )
    parser.add_argument("--limit-threads", type=int, default=4)
    parser.add_argument("--skip-limits", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    if args.owners > 1 and os.geteuid() != 0:
        parser.error("--owners above 1 writes as other uids: run as root")
    DEFAULTS["MAX_REGIONS"] = max(1, args.gather_regions)
    variants = [variant.strip() for variant in args.variants.split(",") if variant.strip()]
    for variant in variants:
        use_variant(variant)  # an unknown one fails now, not after the staging
    use_variant("default")
    total = parse_size(args.size)
    count = max(1, args.tensors)
    # multiples of 64 bytes, as model tensors are (as shmstage-bench draws them)
    sizes = [total // count // 64 * 64] * count
    sizes[-1] += total - sum(sizes)
    specs = [TensorSpec(f"layers.{i}.weight", "U8", (n,)) for i, n in enumerate(sizes)]
    layout = Layout.of(specs)
    header = datafile.build_header(layout, {"format": "pt"})
    chunk = parse_size(args.write_chunk)
    disk = scheduler.WriteScheduler(
        io_threads=args.io_threads,
        chunk_bytes=chunk,
        memory_bytes=parse_size(args.write_buffers),
        direct=not args.buffered,
    )
    scheduler.install(disk)
    # A held instance lock, so that no daemon on this node reaps the segments as a dead
    # instance's leftovers while the benchmark runs.
    lock = instance.InstanceLock.claim()
    args.dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    print(
        f"{format_size(total)} in {count} tensors x {args.jobs} job(s) of {args.owners} "
        f"user(s) -> {args.dir}; io_threads {args.io_threads}, write_chunk "
        f"{format_size(chunk)}, write_buffers {args.write_buffers}, "
        f"{'buffered' if args.buffered else 'direct'}",
        flush=True,
    )
    refs = [stage(lock.instance, sizes) for _ in range(args.jobs)]
    try:
        scratch = args.dir / "raw"

        def fresh(_attempt: int) -> Path:
            scratch.unlink(missing_ok=True)
            return scratch

        def limit(_state: Any) -> None:
            raw_write(
                scratch, total * args.jobs, direct=True, threads=args.limit_threads, chunk=chunk
            )

        if not args.skip_limits:
            rows["raw buffered write"] = timed(
                args.runs,
                fresh,
                lambda path: raw_write(
                    path, total * args.jobs, direct=False, threads=1, chunk=chunk
                ),
            )
            scratch.unlink(missing_ok=True)

        def jobs(attempt: int) -> list[job.PersistJob]:
            shutil.rmtree(args.dir / "ckpt", ignore_errors=True)
            return [
                persist_job(
                    args.dir / "ckpt" / f"{attempt}-{index}",
                    layout,
                    refs[index],
                    header,
                    uid=os.getuid() + 60000 * (index % args.owners),
                )
                for index in range(args.jobs)
            ]

        phases: list[str] = []

        def write(persists: list[job.PersistJob]) -> list[float]:
            with concurrent.futures.ThreadPoolExecutor(len(persists)) as pool:
                results = list(pool.map(job.run, persists))
            for result in results:
                if not result.ok:
                    raise SystemExit(f"the writer failed: {result.message}")
                if result.phases is not None:
                    phases.append(result.phases.describe())
            return [result.seconds for result in results]

        rounds: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.runs):  # the disk's pace drifts: each round has its own limit
            if not args.skip_limits:
                rounds.setdefault(LIMIT, []).append(timed(1, fresh, limit))
                scratch.unlink(missing_ok=True)
            for variant in variants:
                use_variant(variant)
                rounds.setdefault(writer_row(variant), []).append(timed(1, jobs, write))
        rows |= {name: merged(samples) for name, samples in rounds.items()}
        shutil.rmtree(args.dir / "ckpt", ignore_errors=True)
    finally:
        for group in refs:
            for ref in group:
                segment.unlink(ref.name)
        lock.release()
        disk.close()

    nbytes = total * args.jobs
    limit = rows.get(LIMIT, {}).get("seconds")
    buffered = rows.get("raw buffered write", {}).get("seconds")
    print(
        f"{'method':<26}{'median s':>10}{'GB/s':>8}{'/direct':>9}{'/buffered':>10}"
        f"{'cpu s/GiB':>10}{'dirty+wb peak':>15}{'cached +peak':>14}{'cached +after':>15}"
    )
    for name, row in rows.items():
        ratio = f"{row['seconds'] / limit:.2f}" if limit else "-"
        vs_buffered = f"{row['seconds'] / buffered:.2f}" if buffered else "-"
        print(
            f"{name:<26}{row['seconds']:>10.3f}{nbytes / row['seconds'] / 1e9:>8.2f}"
            f"{ratio:>9}{vs_buffered:>10}{row['cpu_seconds'] / (nbytes / 2**30):>10.3f}"
            f"{format_size(row['peak_dirty_writeback']):>15}"
            f"{format_size(max(0, row['cached_growth_peak'])):>14}"
            f"{format_size(max(0, row['cached_growth_after'])):>15}"
        )
    if LIMIT in rows:
        for variant in variants:
            paired = [
                writer["seconds"] / bound["seconds"]
                for writer, bound in zip(rounds[writer_row(variant)], rounds[LIMIT], strict=True)
            ]
            shown = ", ".join(f"{ratio:.2f}" for ratio in paired)
            print(
                f"{writer_row(variant)} / its round's limit: median "
                f"{statistics.median(paired):.2f} ({shown})"
            )
    if phases:
        print(f"shmstaged writer, last job: {phases[-1]}")
    per_job = rows[writer_row(variants[-1])]["extra"]
    if args.jobs > 1 and per_job:
        print("per job (last run), s: " + ", ".join(f"{s:.2f}" for s in per_job))
    if args.json:
        args.json.write_text(
            json.dumps({"bytes": nbytes, "args": vars(args), "rows": rows}, default=str, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
