"""What a restarted trainer's restore from the daemon's memory costs, part by part.

``memory_read_bench.py`` times restores inside one long-lived process. A restarted trainer
is a new process: its first restore also sets up what a long-lived one already has
(staging buffers registered with CUDA, the device buffer, the threads' CUDA state). This
stages a synthetic layout in real POSIX segments, then runs each variant in a new process
that restores it twice — *fresh* (the first restore) and *warm* (the second) — against
the raw pinned host-to-device copy measured in the same run. Medians of ``--rounds``.

Variants (comma list; ``+`` combines): ``default``; ``torch-pinned`` (staging in
``cudaHostAlloc`` memory, as when registering is refused); ``small-pages`` (staging in
4 KiB pages, never transparent huge pages); ``threads=N``; ``chunk=MiB``; ``piece=MiB`` and
``pieces=N`` (each reader's pinned pieces: their size and number); ``batch=ROWS``
(rows per batch of the device checks); ``switch=S``
(``sys.setswitchinterval(S)``: how much the readers' threads wait for the GIL);
``no-verify``; ``host-checks`` (checksums on the host, never the device); ``device-checks``
(``SHMSTAGE_DEVICE_CHECKSUMS=1`` with the device's checks warmed up before the first
restore, as a process has them from its third restore on); ``code=DIR`` (the client
from DIR, say an older commit's ``client/`` unpacked there: an A/B on one machine, its
variants alternating); ``parts`` also prints the thread-seconds spent allocating staging,
reading and checksumming (summed over the threads); ``timeline`` when each restore got
there, in ms from its start: its segments opened, the first reader's staging in hand, the
first piece sent, the last, the checksums checked, the call returned.

    python3 scripts/restart_read_bench.py --size 8GiB --tensors 500 \\
        --variants default,torch-pinned,default+parts
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memory_read_bench import h2d, sizes_of, staged

from shmstage import segment
from shmstage.units import format_size, parse_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="default,torch-pinned,default+parts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(Path(args.child), args.variants)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    total = parse_size(args.size)
    sizes = sizes_of(total, args.tensors, args.seed)
    with staged(sizes, args.seed) as (refs, offsets, crcs):
        limit = statistics.median(h2d(total, torch.device("cuda")) for _ in range(3))
        print(f"{format_size(total)} in {len(sizes)} segments; raw pinned H2D {limit:.3f} s")
        with tempfile.NamedTemporaryFile("w", suffix=".json") as spec:
            json.dump(
                {"names": [r.name for r in refs], "sizes": sizes, "offsets": offsets, "crcs": crcs},
                spec,
            )
            spec.flush()
            results: dict[str, list[tuple[float, float]]] = {}
            for _ in range(args.rounds):
                for variant in args.variants.split(","):
                    run = subprocess.run(
                        [sys.executable, __file__, "--child", spec.name, "--variants", variant],
                        capture_output=True,
                        text=True,
                        timeout=300,
                    )
                    if run.returncode:
                        print(f"  {variant}: failed: {run.stderr.strip()[-800:]}")
                        continue
                    report = json.loads(run.stdout.strip().splitlines()[-1])
                    results.setdefault(variant, []).append(tuple(report["seconds"]))
                    for index, parts in enumerate(report["parts"]):
                        shown = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
                        print(f"  {variant}: restore {index + 1} thread-seconds: {shown}")
                    for index, marks in enumerate(report["timeline"]):
                        shown = ", ".join(f"{k} {v * 1000:.1f}" for k, v in marks.items())
                        print(f"  {variant}: restore {index + 1} timeline (ms): {shown}")
        for variant, samples in results.items():
            fresh = statistics.median(s[0] for s in samples)
            warm = statistics.median(s[1] for s in samples)
            print(
                f"  {variant:<28} fresh {fresh:.3f} s ({fresh / limit:.2f}x)   "
                f"warm {warm:.3f} s ({warm / limit:.2f}x)   (fresh samples "
                + ", ".join(f"{s[0]:.3f}" for s in samples)
                + ")"
            )
    return 0


def child(spec_path: Path, variant: str) -> int:
    """A new process: restore the staged layout twice, as the variant says."""
    for option in variant.split("+"):
        if option.startswith("code="):  # before the client is imported
            sys.path.insert(0, option.partition("=")[2])
    import torch
    from shmstage_client import reading
    from shmstage_client.pinning import PinError

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context is any restart's cost, not the restore's
    spec = json.loads(spec_path.read_text())
    verify, parts, timeline = True, False, False
    for option in variant.split("+"):
        key, _, value = option.partition("=")
        if key == "torch-pinned":

            def refuse(self: Any) -> int:
                raise PinError("refused by the bench")

            reading._HostBuffer._register = refuse  # type: ignore[method-assign]
        elif key == "threads":
            reading.MAX_THREADS = int(value)  # type: ignore[misc]
        elif key == "chunk":
            reading.CHUNK = int(value) << 20  # type: ignore[misc]
        elif key == "piece":
            reading.PIECE = int(value) << 20  # type: ignore[misc]
        elif key == "pieces":
            reading.PIECES = int(value)  # type: ignore[misc]
        elif key == "small-pages":
            reading.HUGE_STAGING = False  # type: ignore[misc]
        elif key == "switch":  # the interpreter's GIL switch interval, in seconds
            sys.setswitchinterval(float(value))
        elif key == "no-verify":
            verify = False
        elif key == "batch":  # rows per batch of the device checks
            reading.device_checksums.BATCH_ROWS = int(value)  # type: ignore[misc]
        elif key == "host-checks":  # checksums on the host, never the device
            reading.DEVICE_CHECKSUMS = False  # type: ignore[misc]
        elif key == "device-checks":  # on, and warmed up first, as in a process's third
            reading.DEVICE_CHECKSUMS = True  # type: ignore[misc]
            reading.device_checksums.warm_up(torch.device("cuda"))
        elif key == "parts":
            parts = True
        elif key == "timeline":
            timeline = True
        elif key not in ("default", "code"):
            raise SystemExit(f"unknown variant {option!r}")
    spent: dict[str, float] = {}
    if parts:
        _time_parts(reading, spent)
    marks: dict[str, float] = {}
    started = [0.0]
    if timeline:
        _mark_timeline(reading, marks, started)
    where = zip(spec["sizes"], spec["offsets"], spec["crcs"], strict=True)
    placements = [
        reading.Placement(f"t{i}", torch.uint8, (n,), offset, n, crc)
        for i, (n, offset, crc) in enumerate(where)
    ]
    seconds, reports, timelines = [], [], []
    for _ in range(2):
        marks.clear()
        started[0] = begun = time.perf_counter()
        fds = [
            segment.open_fd(segment.SegmentRef(name, n), writable=False)
            for name, n in zip(spec["names"], spec["sizes"], strict=True)
        ]
        marks["opened"] = time.perf_counter() - begun
        try:
            source = reading.SegmentSource(fds, spec["offsets"], spec["sizes"], "bench")
            reading.transfer(source, placements, torch.device("cuda"), verify=verify)
            marks["returned"] = time.perf_counter() - begun
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - begun)
        finally:
            for fd in fds:
                os.close(fd)
        reports.append(dict(spent))
        spent.clear()
        timelines.append(dict(sorted(marks.items(), key=lambda mark: mark[1])))
    print(
        json.dumps(
            {
                "seconds": seconds,
                "parts": reports if parts else [],
                "timeline": timelines if timeline else [],
            }
        )
    )
    return 0


def _mark_timeline(reading: Any, marks: dict[str, float], started: list[float]) -> None:
    """Record in ``marks`` when (seconds after ``started[0]``) each restore first, or
    last, got past its parts."""

    def marked(
        fn: Callable[..., Any], before: str | None, after: str | None, first: bool
    ) -> Callable[..., Any]:
        def mark(name: str) -> None:
            if first:
                marks.setdefault(name, time.perf_counter() - started[0])
            else:
                marks[name] = time.perf_counter() - started[0]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before:
                mark(before)
            result = fn(*args, **kwargs)
            if after:
                mark(after)
            return result

        return wrapper

    reading._Staging.take = marked(reading._Staging.take, None, "staging", True)
    reading._Relay.send = marked(reading._Relay.send, "first piece", None, True)
    reading._Relay.send = marked(reading._Relay.send, None, "last piece", False)
    reading._Transfer._check = marked(reading._Transfer._check, None, "checked", False)


def _time_parts(reading: Any, spent: dict[str, float]) -> None:
    """Sum the seconds each thread spends in the transfer's parts."""
    lock = threading.Lock()

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            begun = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - begun

        return wrapper

    reading._HostBuffer.__init__ = timed("staging", reading._HostBuffer.__init__)
    reading.SegmentSource.read_into = timed("read", reading.SegmentSource.read_into)
    reading._Transfer._checksum = timed("checksum", reading._Transfer._checksum)
    # the device checks: queuing them (the checker thread), waiting for the checker once
    # the last chunk was queued, and the device's work after the copies
    checks = reading.device_checksums.DeviceChecksums
    checks.advance = timed("check-queue", checks.advance)
    reading._DeviceCheck.close = timed("check-behind", reading._DeviceCheck.close)
    reading._DeviceCheck.results = timed("check-tail", reading._DeviceCheck.results)


if __name__ == "__main__":
    sys.exit(main())
