#!/usr/bin/env python3
"""What a save costs per tensor: a steady ``Stager.save`` of many small tensors against
``torch._foreach_copy_`` of the same tensors, and the daemon's memory before, during and after.

Runs on any Linux host with a CPU build of torch; with ``--device cuda`` the tensors live on
the GPU (the reference is then ``_foreach_copy_`` into pinned host tensors, synchronized).
For each ``--tensors`` count, in one process, against a real shmstaged it starts (or
``--socket``):

- ``first``: the first save of the structure (registration, mapping, the first slot's setup),
  and its parts as ``SaveTimings`` names them;
- ``steady``: the median stall of ``--repeats`` later saves (``save()`` returns: the copy
  done and the daemon's answer in), each waited durable before the next, so that the
  daemon's writer does not run beside the next stall;
- ``foreach``: the median of ``torch._foreach_copy_`` of the same sources into
  preallocated destinations of the same sizes — the copy alone, the floor;
- the daemon's VmRSS (``/proc/PID/status``): idle, with the client's layout registered, and
  after the client closed its Stager and disconnected.

The state is a model's and an AdamW's state dicts as ``state_dict()`` nests them: ``N/4``
parameters of about ``--elements`` float32 elements each, and per parameter a 0-d
``step``, ``exp_avg`` and ``exp_avg_sq``; every save gets new dicts and new tensor
objects (as ``state_dict()`` and ``detach()`` make them) and a new learning rate. The
host is usually shared: run it a few times and read medians. Speed is never asserted;
this prints figures.

    .venv/bin/python scripts/save_overhead.py --tensors 10000 100000
    .venv/bin/python scripts/save_overhead.py --tensors 10000 --profile /tmp/save.prof
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from shmstage_client import Stager

#: The parts of a save's stall that ``SaveTimings`` names, printed for the steady saves.
PARTS = ("prepare", "setup", "slot_wait", "commit", "copy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--elements", type=int, default=256, help="typical elements per tensor")
    parser.add_argument("--repeats", type=int, default=7, help="steady saves (median)")
    parser.add_argument(
        "--plain",
        choices=("changing", "fixed"),
        default="changing",
        help="the plain values (learning rate, step) change every save, as in training "
        "(default), or stay the same",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--socket", default=None, help="use this shmstaged instead of one's own")
    parser.add_argument("--dir", default=None, help="checkpoints (default: a temp dir)")
    parser.add_argument(
        "--no-gc", action="store_true", help="disable Python's cyclic collector for the run"
    )
    parser.add_argument("--profile", default=None, help="cProfile the steady saves into this")
    parser.add_argument("--json", default=None, help="also write the figures here")
    return parser.parse_args(argv)


def make_state(count: int, elements: int, device: str) -> dict[str, Any]:
    """A model's and its AdamW's state dicts as ``state_dict()`` nests them, ``count``
    tensors in all: per parameter the weight, and a 0-d ``step``, ``exp_avg`` and
    ``exp_avg_sq``; plain values in the parameter groups (``new_step`` changes them)."""
    params = max(1, count // 4)
    generator = torch.Generator().manual_seed(count)
    sizes = torch.randint(elements // 2, elements * 3 // 2 + 1, (params,), generator=generator)
    model = {f"layers.{i}.weight": torch.randn(int(n)) for i, n in enumerate(sizes.tolist())}
    state = {
        i: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.rand_like(t),
            "exp_avg_sq": torch.rand_like(t),
        }
        for i, t in enumerate(model.values())
    }
    group = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    optimizer = {"state": state, "param_groups": [{**group, "params": list(range(params))}]}
    result: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if device != "cpu":
        result = _to(result, device)
    return result


def new_step(state: dict[str, Any], step: int, changing: bool = True) -> dict[str, Any]:
    """The state dict a training loop saves at ``step``: new dicts (as ``state_dict()``
    builds them), new tensor objects over the same storage (as ``detach()`` makes them),
    and (``changing``) a new learning rate and step."""
    optimizer = state["optimizer"]
    decay = 0.99 if changing else 1.0
    groups = [{**group, "lr": group["lr"] * decay} for group in optimizer["param_groups"]]
    state["optimizer"]["param_groups"] = groups
    return {
        "model": {key: t.detach() for key, t in state["model"].items()},
        "optimizer": {
            "state": {
                i: {k: t.detach() for k, t in s.items()} for i, s in optimizer["state"].items()
            },
            "param_groups": groups,
        },
        "step": step if changing else 0,
    }


def _to(node: Any, device: str) -> Any:
    if isinstance(node, torch.Tensor):
        return node.to(device)
    if isinstance(node, dict):
        return {key: _to(value, device) for key, value in node.items()}
    return node


def tensors_of(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for value in node.values() for t in tensors_of(value)]
    if isinstance(node, list | tuple):
        return [t for value in node for t in tensors_of(value)]
    return []


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (``RssAnon``, ``RssShmem``: its parts) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def foreach_floor(sources: list[torch.Tensor], device: str, repeats: int) -> float:
    pin = device == "cuda"
    dsts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in sources]
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        torch._foreach_copy_(dsts, sources, non_blocking=pin)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(count: int, args: argparse.Namespace, socket: str, pid: int | None, root: Path) -> dict:
    state = make_state(count, args.elements, args.device)
    sources = tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    row: dict[str, Any] = {"tensors": len(sources), "bytes": nbytes}
    if pid is not None:
        row["rss_idle_mib"] = rss_mib(pid)
    stalls = []
    parts: dict[str, list[float]] = {part: [] for part in PARTS}
    profiler = cProfile.Profile() if args.profile else None
    with Stager(socket, slots=2) as stager:
        for i in range(args.repeats + 1):
            path = root / f"n{count}-{i}"
            saved = new_step(state, i, args.plain == "changing")
            synchronize(args.device)
            if i > 0 and profiler is not None:
                profiler.enable()
            started = time.perf_counter()
            handle = stager.save(saved, path)
            stall = time.perf_counter() - started
            if profiler is not None:
                profiler.disable()
            handle.wait(600)
            shutil.rmtree(path, ignore_errors=True)
            if i == 0:
                row["first_s"] = stall
                row["first_parts_ms"] = {
                    part: getattr(handle.timings, f"{part}_seconds") * 1e3 for part in PARTS
                }
            else:
                stalls.append(stall)
                for part in PARTS:
                    parts[part].append(getattr(handle.timings, f"{part}_seconds"))
        if pid is not None:
            row["rss_registered_mib"] = rss_mib(pid)
    if pid is not None:
        time.sleep(1.0)  # the daemon notices the disconnection and releases the layout
        row["rss_after_mib"] = rss_mib(pid)
        row["rss_after_anon_mib"] = rss_mib(pid, "RssAnon")
        row["rss_after_shmem_mib"] = rss_mib(pid, "RssShmem")
    if profiler is not None:
        profiler.dump_stats(f"{args.profile}.{count}")
    row["steady_s"] = statistics.median(stalls)
    row["steady_min_s"] = min(stalls)
    row["foreach_s"] = foreach_floor(sources, args.device, args.repeats)
    row["ratio"] = row["steady_s"] / row["foreach_s"]
    row["parts_ms"] = {part: statistics.median(v) * 1e3 for part, v in parts.items()}
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.no_gc:
        gc.disable()
    root = Path(args.dir or tempfile.mkdtemp(prefix="shmstage-overhead-"))
    root.mkdir(parents=True, exist_ok=True)
    daemon: subprocess.Popen[bytes] | None = None
    socket = args.socket
    if socket is None:
        socket = str(root / "shmstaged.sock")
        log = (root / "shmstaged.log").open("wb")
        command = [sys.executable, "-m", "shmstage_daemon.main", "--socket", socket]
        daemon = subprocess.Popen(
            [*command, "--no-fsync", "--max-segments", "1000000"], stdout=log, stderr=log
        )
        deadline = time.monotonic() + 30
        while "ready: serving" not in (root / "shmstaged.log").read_text(errors="replace"):
            if daemon.poll() is not None or time.monotonic() > deadline:
                print((root / "shmstaged.log").read_text(errors="replace"), file=sys.stderr)
                return 1
            time.sleep(0.05)
    rows = []
    try:
        for count in args.tensors:
            row = measure(count, args, socket, daemon.pid if daemon else None, root)
            rows.append(row)
            rss = (
                f"; daemon RSS {row['rss_idle_mib']:.0f} -> {row['rss_registered_mib']:.0f} -> "
                f"{row['rss_after_mib']:.0f} MiB after the client left (anonymous "
                f"{row['rss_after_anon_mib']:.0f}, shared {row['rss_after_shmem_mib']:.0f})"
                if daemon
                else ""
            )
            print(
                f"{row['tensors']:>7} tensors, {row['bytes'] / 2**20:.1f} MiB: first save "
                f"{row['first_s'] * 1e3:.1f} ms; steady {row['steady_s'] * 1e3:.1f} ms "
                f"(min {row['steady_min_s'] * 1e3:.1f}) against _foreach_copy_ "
                f"{row['foreach_s'] * 1e3:.1f} ms: {row['ratio']:.2f}x{rss}",
                flush=True,
            )
            for what, parts in (
                ("first save parts (ms)", row["first_parts_ms"]),
                ("steady parts (median ms)", row["parts_ms"]),
            ):
                print(
                    f"         {what}: " + ", ".join(f"{p} {ms:.1f}" for p, ms in parts.items()),
                    flush=True,
                )
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(60)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
