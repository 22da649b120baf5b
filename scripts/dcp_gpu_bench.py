#!/usr/bin/env python3
"""One FSDP2 model saved with DCP ``async_save``: through shmstage vs DCP's FileSystemWriter.

Per rank and per method: the stall (how long ``async_save`` blocks training) and the time
until the checkpoint is durable (its future done: every rank's data written and fsynced and
the checkpoint committed). The first save of each method is reported apart — it includes
one-off setup such as shmstage's segment registration and pinning.

    # two GPUs, NCCL for training and gloo for DCP, one daemon for the node:
    torchrun --standalone --nproc-per-node 2 scripts/dcp_gpu_bench.py --start-daemon \\
        --json dcp-bench.json
    # anywhere, tiny, CPU and gloo only (what the test suite runs):
    torchrun --standalone --nproc-per-node 2 scripts/dcp_gpu_bench.py --device cpu \\
        --dim 64 --layers 2 --repeat 1 --start-daemon

Without torchrun it runs as a single rank. ``--start-daemon`` starts one shmstaged per node
(on its local rank 0) and stops it at the end; otherwise ranks use ``--socket`` or
``$SHMSTAGE_SOCKET``. Rank 0 prints a table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import bench_cli
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from shmstage_bench.peers import ShmstageDaemon
from shmstage_bench.report import environment
from shmstage_client.dcp import ShmStageWriter
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

METHODS = ("shmstage", "dcp-filesystem")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_cli.parser_for(__doc__)
    parser.add_argument("--dim", type=int, default=8192, help="width of each square layer")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="parameter dtype (AdamW state follows it)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="steady-state saves per method")
    bench_cli.add_rank_options(
        parser,
        METHODS,
        directory="/tmp/shmstage-dcp-bench",
        timeout=1800.0,
        device_help="default: cuda when available",
        dir_help="checkpoints (removed after each save); shared by all ranks",
        daemon_help="start a shmstaged per node for the run",
    )
    return bench_cli.parse_rank_options(parser, METHODS, argv)


def init_distributed(device: str, timeout: float) -> dist.ProcessGroup:
    """NCCL (or gloo on CPU) for training; a separate gloo group for DCP, as DCP advises."""
    bench_cli.init_distributed(device, timeout)
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))


class Model:
    """``layers`` square Linear layers, each its own FSDP2 unit, trained one AdamW step."""

    def __init__(self, args: argparse.Namespace) -> None:
        dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
        self.device = torch.device(args.device)
        torch.manual_seed(0)
        with torch.device("meta"):
            layers = [
                torch.nn.Linear(args.dim, args.dim, bias=False, dtype=dtype)
                for _ in range(args.layers)
            ]
            self.module = torch.nn.Sequential(*layers)
        mesh = init_device_mesh(args.device, (dist.get_world_size(),))
        for layer in self.module:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.module, mesh=mesh)
        self.module.to_empty(device=self.device)
        for layer in self.module:
            torch.nn.init.normal_(layer.weight, std=args.dim**-0.5)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.dtype = dtype
        self.dim = args.dim
        self.step()

    def step(self) -> None:
        x = torch.randn(8, self.dim, device=self.device, dtype=self.dtype)
        self.module(x).float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optim": optim}


def local_bytes(state: Any) -> int:
    """Bytes this rank holds in ``state`` (local shards of DTensors)."""
    if isinstance(state, DTensor):
        return local_bytes(state.to_local())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(local_bytes(v) for v in state)
    return 0


def node_socket(args: argparse.Namespace, group: dist.ProcessGroup) -> tuple[str | None, Any]:
    """This node's daemon: started by the node's first local rank, or given."""
    daemon = None
    path = args.socket or os.environ.get("SHMSTAGE_SOCKET")
    if args.start_daemon and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        daemon = ShmstageDaemon()
        path = daemon.start()
    offers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(offers, (socket.gethostname(), path if daemon else None), group=group)
    if args.start_daemon:
        path = next(p for host, p in offers if host == socket.gethostname() and p)
    return path, daemon


def save_once(
    method: str, model: Model, writer: Any, directory: Path, group: Any, timeout: float
) -> tuple[float, float]:
    """One async_save: (stall, durable) seconds, measured from the call on this rank."""
    state = model.state()
    if model.device.type == "cuda":
        torch.cuda.synchronize()  # training work already queued is not the save's stall
    dist.barrier(group=group)
    started = time.perf_counter()
    response = dcp.async_save(
        state, checkpoint_id=directory, storage_writer=writer, process_group=group
    )
    if hasattr(response, "staging_completion"):  # a stager that stages in the background
        response.staging_completion.result(timeout=timeout)
        stall = time.perf_counter() - started
        response.upload_completion.result(timeout=timeout)
    else:
        stall = time.perf_counter() - started
        response.result(timeout=timeout)
    return stall, time.perf_counter() - started


def run_method(
    method: str, args: argparse.Namespace, model: Model, sock: str | None, group: Any
) -> dict[str, Any]:
    """Every save of one method on this rank; a failure becomes the row's error."""
    row: dict[str, Any] = {
        "method": method,
        "rank": dist.get_rank(),
        "stall_s": [],
        "durable_s": [],
        "bytes": local_bytes(model.state()),
        "error": None,
    }
    writer: Any = None
    root = Path(args.dir)
    try:
        for rep in range(1 + args.repeat):
            directory = root / f"{method}-{rep}"
            if method == "shmstage":
                if writer is None:  # one writer for the run: its layout is reused
                    writer = ShmStageWriter(socket=sock, slots=args.slots, timeout=args.timeout)
            else:
                writer = FileSystemWriter(directory)
            stall, durable = save_once(method, model, writer, directory, group, args.timeout)
            row["stall_s"].append(stall)
            row["durable_s"].append(durable)
            if method == "shmstage" and writer.last_result is not None:
                row.setdefault("persist_s", []).append(writer.last_result.persist_seconds)
            dist.barrier(group=group)
            if dist.get_rank() == 0:
                shutil.rmtree(directory, ignore_errors=True)
            model.step()  # the next save sees new values, as in training
    except (Exception, dcp.CheckpointException) as exc:  # DCP's is a BaseException
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        traceback.print_exc(file=sys.stderr)
    finally:
        if method == "shmstage" and writer is not None:
            writer.close()
    return row


def summarize(row: dict[str, Any]) -> dict[str, Any]:
    def split(values: list[float]) -> tuple[float | None, float | None]:
        first = values[0] if values else None
        steady = statistics.median(values[1:]) if len(values) > 1 else None
        return first, steady

    row["first_stall_s"], row["stall_median_s"] = split(row["stall_s"])
    row["first_durable_s"], row["durable_median_s"] = split(row["durable_s"])
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:8.3f}"

    header = (
        f"{'method':<16}{'rank':>5}{'GiB/rank':>10}{'stall 1st':>11}{'stall med':>11}"
        f"{'durable 1st':>13}{'durable med':>13}  error"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['method']:<16}{r['rank']:>5}{r['bytes'] / 2**30:>10.2f}"
            f"{cell(r['first_stall_s']):>11}{cell(r['stall_median_s']):>11}"
            f"{cell(r['first_durable_s']):>13}{cell(r['durable_median_s']):>13}"
            f"  {r['error'] or ''}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    group = init_distributed(args.device, args.timeout)
    daemon = None
    try:
        sock, daemon = node_socket(args, group)
        model = Model(args)
        if dist.get_rank() == 0:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
        rows = [summarize(run_method(m, args, model, sock, group)) for m in args.methods]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows, group=group)
        if dist.get_rank() == 0:
            everyone = sorted(
                (r for rank_rows in gathered for r in rank_rows),
                key=lambda r: (r["method"], r["rank"]),
            )
            report = {
                "config": {k: v for k, v in vars(args).items() if k != "json"}
                | {"world_size": dist.get_world_size()},
                "environment": environment(),
                "rows": everyone,
            }
            print(format_table(everyone))
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=1))
        failed = any(r["error"] for r in rows)
        dist.barrier(group=group)
    finally:
        if daemon is not None:
            daemon.stop()
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
