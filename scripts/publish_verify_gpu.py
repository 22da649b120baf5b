"""What verifying a published version costs a reader (issue 35, gaps 1-3): the copy of a
version to the device unverified (the ring's registered mapping, one DMA), verified (the
same copy, then a check of the bytes in place), and how long after the version became
visible the daemon's checksums were there, beside the raw pinned host-to-device copy of
the same bytes. Also ``wait()`` at many small tensors once a version is visible (the pin's
answer, without the tree after the first), and the publish stall there.

A publisher (this process) publishes ``--versions`` versions of ``--gib`` GiB in
``--tensors`` bf16 tensors; a reader process follows the channel and, per version, copies
it with ``verify=False``, then with ``verify=True`` twice (the first waits for the
checksums if they are not there yet; the second is the verified copy alone). Versions from
the third on count (the first in each slot maps and registers it). Prints one JSON object.

    .venv/bin/python scripts/publish_verify_gpu.py                  # 7 GiB, GPU 0 (~2 min)
    .venv/bin/python scripts/publish_verify_gpu.py --device cpu --gib 0.05
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from restart_speed import start_daemon  # scripts/ is this script's sys.path[0]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reader(socket: str, device_name: str, versions: int, small: int, pipe: Any) -> None:
    import torch
    from shmstage_client import subscribe

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.empty(1, device=device)
    rows = []
    with subscribe("verify", socket=socket) as subscriber:
        pipe.send("ready")
        step = None
        for _ in range(versions):
            with subscriber.wait(newer_than=step, timeout=300) as version:
                woken = time.perf_counter()
                row: dict[str, float] = {}
                for what, verify in (("plain", False), ("first", True), ("verified", True)):
                    started = time.perf_counter()
                    held = version.state(device, verify=verify)
                    _sync(device)
                    row[what] = time.perf_counter() - started
                    assert version.verified == verify
                    del held
                row["woken_to_checksums"] = time.perf_counter() - woken - row["verified"]
                step = version.step
            rows.append(row)
            pipe.send("read")
        waits = []
        with subscribe("small", socket=socket) as tiny:
            pipe.send("ready")
            step = None
            for _ in range(small):
                assert pipe.recv() == "published"  # time the pin alone, not the publish
                started = time.perf_counter()
                with tiny.wait(newer_than=step, timeout=60) as version:
                    waits.append(time.perf_counter() - started)
                    step = version.step
                pipe.send("read")
    pipe.send({"rows": rows, "small_waits": waits})


def raw_h2d(nbytes: int, device: Any) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.fill_(1)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        target = host.to(device, non_blocking=True) if device.type == "cuda" else host.clone()
        _sync(device)
        times.append(time.perf_counter() - started)
        del target
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=7.0)
    parser.add_argument("--tensors", type=int, default=256)
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--small-tensors", type=int, default=10_000)
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    import torch
    from shmstage_client import Stager

    device = torch.device(args.device)
    per = max(1, int(args.gib * (1 << 30)) // 2 // args.tensors)
    state = {f"layer.{i}": torch.full((per,), float(i), dtype=torch.bfloat16, device=device)
             for i in range(args.tensors)}  # fmt: skip
    nbytes = per * 2 * args.tensors
    with tempfile.TemporaryDirectory() as where:
        daemon, socket = start_daemon(Path(where))
        try:
            context = multiprocessing.get_context("spawn")
            ours, theirs = context.Pipe()
            process = context.Process(
                target=reader,
                args=(socket, args.device, args.versions, 12, theirs),
            )
            process.start()
            assert ours.recv() == "ready"
            stalls = []
            small_stalls = []
            with Stager(socket, slots=3) as stager:
                for step in range(args.versions):
                    stalls.append(stager.publish(state, "verify", step=step).timings.stall_seconds)
                    assert ours.recv() == "read"
                assert ours.recv() == "ready"
                small = {f"s.{i}": torch.full((64,), float(i)) for i in range(args.small_tensors)}
                with Stager(socket, slots=3) as small_stager:
                    for step in range(12):
                        published = small_stager.publish(small, "small", step=step)
                        small_stalls.append(published.timings.stall_seconds)
                        ours.send("published")
                        assert ours.recv() == "read"
            result = ours.recv()
            process.join(60)
        finally:
            daemon.terminate()
            daemon.wait(30)
    rows = result["rows"][2:] or result["rows"]
    raw = raw_h2d(nbytes, device)

    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bytes": nbytes,
        "tensors": args.tensors,
        "raw_h2d_s": raw,
        "unverified_s": median("plain"),
        "verified_s": median("verified"),
        "unverified_over_raw": median("plain") / raw,
        "verified_over_raw": median("verified") / raw,
        "woken_to_checksums_s": median("woken_to_checksums"),
        "publish_stall_s": statistics.median(stalls[2:] or stalls),
        "small_tensors": args.small_tensors,
        "small_wait_ms": statistics.median(result["small_waits"][3:]) * 1e3,
        "small_publish_stall_ms": statistics.median(small_stalls[3:]) * 1e3,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
