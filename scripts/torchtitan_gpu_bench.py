#!/usr/bin/env python3
"""What a checkpoint costs a torchtitan training loop: its own CheckpointManager vs shmstage's.

One process (or torchrun ranks) trains a ~1B-parameter Llama-style decoder (plain PyTorch:
fp32 parameters, bf16 autocast, fused AdamW in torchtitan's ``OptimizersContainer``) and
checkpoints it through a torchtitan 0.3 checkpoint manager built exactly as its trainer
builds one, calling ``maybe_wait_for_staging`` right before ``optimizers.step()`` as
``Trainer.train_step`` does. Per method it reports, first save apart (setup: shmstage's
segments, torchtitan's staging process and pinned buffers):

- ``stall``: how long ``checkpointer.save()`` blocked the training thread;
- ``cost``: the save plus the step after it, minus a plain step (what the loop lost: a
  copy that overlaps the next forward and backward costs only what it outlasts them);
- ``durable``: from the call until the save's future was done (``disabled``: the call).

Methods: torchtitan's ``CheckpointManager`` with ``async_mode`` disabled, async and
async_with_pinned_mem (a staging process with pinned shared memory), and
``ShmStageCheckpointManager`` with async and async_with_pinned_mem (the copy behind the next
step, held by the optimizers' step pre-hooks). Each checkpoint is deleted once durable.

    # one GPU, a daemon for the run (about 5 minutes for the default 1B model):
    python scripts/torchtitan_gpu_bench.py --start-daemon --json torchtitan-bench.json
    # anywhere, tiny, CPU:
    python scripts/torchtitan_gpu_bench.py --device cpu --dim 64 --layers 2 --vocab 256 \\
        --seq 32 --saves 1 --start-daemon

Needs torchtitan 0.3 next to the repository's packages; on a machine with torch already
installed: ``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3`` and
``pip install tyro`` (the checkpointer imports its config package, which imports tyro).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import bench_cli
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

TITAN_METHODS = ("titan-disabled", "titan-async", "titan-async_with_pinned_mem")
SHMSTAGE_METHODS = ("shmstage-async", "shmstage-async_with_pinned_mem")
METHODS = TITAN_METHODS + SHMSTAGE_METHODS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_cli.parser_for(__doc__)
    bench_cli.add_sizes(parser, dim=2048, layers=16, vocab=32000, seq=2048, batch=2)
    parser.add_argument("--gap", type=int, default=3, help="plain steps before each save")
    parser.add_argument("--saves", type=int, default=2, help="steady-state saves per method")
    bench_cli.add_rank_options(
        parser, METHODS, directory="/tmp/shmstage-torchtitan-bench", timeout=900.0
    )
    return bench_cli.parse_rank_options(parser, METHODS, argv)


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = torch.nn.RMSNorm(dim)
        self.wqkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.ffn_norm = torch.nn.RMSNorm(dim)
        self.w13 = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        q, k, v = self.wqkv(self.attention_norm(h)).view(b, s, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = h + self.wo(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.w13(self.ffn_norm(h)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)


class Decoder(torch.nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        hidden = 256 * ((int(8 * args.dim / 3) + 255) // 256)
        self.tok_embeddings = torch.nn.Embedding(args.vocab, args.dim)
        self.layers = torch.nn.ModuleList(
            Block(args.dim, max(1, args.dim // 128), hidden) for _ in range(args.layers)
        )
        self.norm = torch.nn.RMSNorm(args.dim)
        self.output = torch.nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class Position:
    """Stands in for the dataloader's state (a few bytes, like torchtitan's)."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples = state_dict["samples"]


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


class Loop:
    """The model, torchtitan's optimizer and scheduler containers, one train step."""

    def __init__(self, args: argparse.Namespace) -> None:
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

        self.args = args
        self.device = torch.device(args.device)
        torch.manual_seed(0)
        self.model = Decoder(args).to(self.device)
        impl = "fused" if args.device == "cuda" else "foreach"
        optimizer_config = default_adamw(lr=3e-4)
        optimizer_config.implementation = impl
        self.optimizers = optimizer_config.build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=10).build(
            optimizers=self.optimizers, training_steps=10_000
        )
        self.position = Position()
        self.train_state = TrainState()
        self.checkpointer: Any = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self) -> None:
        args = self.args
        self.train_state.step += 1
        self.optimizers.zero_grad()
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        if self.checkpointer is not None:
            self.checkpointer.maybe_wait_for_staging()  # where Trainer.train_step calls it
        self.optimizers.step()
        self.lr_schedulers.step()
        self.position.samples += args.batch

    def timed_step(self) -> float:
        started = time.perf_counter()
        self.step()
        self.sync()
        return time.perf_counter() - started

    def state_bytes(self) -> int:
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                total += sum(v.numel() * v.element_size() for v in state.values()
                             if isinstance(v, torch.Tensor))
        return total


def build_checkpointer(method: str, loop: Loop, args: argparse.Namespace, sock: str | None) -> Any:
    """The manager torchtitan's trainer would build for this method's checkpoint config."""
    from torchtitan.components.checkpointer import CheckpointManager

    family, mode = method.split("-", 1)
    common: dict[str, Any] = {
        "enable": True,
        "folder": method,
        "interval": 1,
        "keep_latest_k": 0,  # each checkpoint is deleted here once durable
        "async_mode": mode,
        "last_save_model_only": False,
    }
    if family == "titan":
        config = CheckpointManager.Config(**common)
    else:
        from shmstage_client.integrations.torchtitan import ShmStageCheckpointManager

        config = ShmStageCheckpointManager.Config(**common, socket=sock, slots=args.slots)
    return config.build(
        dataloader=loop.position,
        model_parts=[loop.model],
        optimizers=loop.optimizers,
        lr_schedulers=loop.lr_schedulers,
        states={"train_state": loop.train_state},
        sd_adapter=None,
        base_folder=args.dir,
    )


def run_method(method: str, loop: Loop, args: argparse.Namespace, sock: str | None) -> dict:
    """Every save of one method; a failure becomes the row's error, never the run's end."""
    row: dict[str, Any] = {
        "method": method, "rank": dist.get_rank(), "plain_step_s": [], "stall_s": [],
        "next_step_s": [], "cost_s": [], "durable_s": [], "error": None,
    }
    try:
        loop.checkpointer = build_checkpointer(method, loop, args, sock)
        for _ in range(1 + args.saves):
            plain = [loop.timed_step() for _ in range(args.gap)]
            row["plain_step_s"] += plain
            loop.step()  # the step whose state is saved, as in Trainer.train
            loop.sync()  # work already queued is not the save's
            done: list[float] = []
            started = time.perf_counter()
            loop.checkpointer.save(loop.train_state.step)
            returned = time.perf_counter()
            future = loop.checkpointer.save_future
            if future is not None:
                future.add_done_callback(lambda _, done=done: done.append(time.perf_counter()))
            next_step = loop.timed_step()
            loop.checkpointer.maybe_wait_for_saving()
            durable = (done[0] if done else returned) - started
            row["stall_s"].append(returned - started)
            row["next_step_s"].append(next_step)
            row["cost_s"].append(returned - started + next_step - statistics.median(plain))
            row["durable_s"].append(durable)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(Path(args.dir) / method, ignore_errors=True)
    except (Exception, dcp.CheckpointException) as exc:  # DCP's: BaseException
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        traceback.print_exc(file=sys.stderr)
    finally:
        if loop.checkpointer is not None:
            try:
                loop.checkpointer.close()
            except Exception as exc:
                row["error"] = row["error"] or f"close: {type(exc).__name__}: {exc}"
            loop.checkpointer = None
        if dist.get_rank() == 0:
            shutil.rmtree(Path(args.dir) / method, ignore_errors=True)
    return summarize(row)


def summarize(row: dict[str, Any]) -> dict[str, Any]:
    for name in ("stall", "next_step", "cost", "durable"):
        values = row[f"{name}_s"]
        row[f"{name}_first_s"] = values[0] if values else None
        row[f"{name}_median_s"] = statistics.median(values[1:]) if len(values) > 1 else None
    plain = row["plain_step_s"]
    row["plain_step_median_s"] = statistics.median(plain) if plain else None
    return row


def format_table(rows: list[dict[str, Any]], gib: float) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    header = (
        f"{'method':<36}{'step':>8}{'stall 1st':>11}{'stall med':>11}{'next med':>10}"
        f"{'cost med':>10}{'durable med':>13}  error"
    )
    lines = [f"state: {gib:.2f} GiB per rank", header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['method'] + ' r' + str(r['rank']):<36}{cell(r['plain_step_median_s']):>8}"
            f"{cell(r['stall_first_s']):>11}{cell(r['stall_median_s']):>11}"
            f"{cell(r['next_step_median_s']):>10}{cell(r['cost_median_s']):>10}"
            f"{cell(r['durable_median_s']):>13}  {r['error'] or ''}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torchtitan.components.checkpointer  # noqa: F401
    except ImportError as exc:
        print(
            f"torchtitan 0.3 is needed ({exc}): pip install --no-deps torchtitan==0.3.0 "
            "spmd_types==0.2.3 && pip install tyro",
            file=sys.stderr,
        )
        return 2
    bench_cli.init_distributed(args.device, args.timeout)
    daemon = None
    try:
        sock = args.socket or os.environ.get("SHMSTAGE_SOCKET")
        if args.start_daemon and any(m.startswith("shmstage") for m in args.methods):
            from shmstage_bench.peers import ShmstageDaemon

            if dist.get_world_size() > 1:
                raise SystemExit("--start-daemon runs a world of one; start shmstaged yourself")
            daemon = ShmstageDaemon()
            sock = daemon.start()
        loop = Loop(args)
        for _ in range(2):  # optimizer state exists, kernels warm
            loop.step()
        loop.sync()
        gib = loop.state_bytes() / 2**30
        rows = [run_method(method, loop, args, sock) for method in args.methods]
        if dist.get_rank() == 0:
            print(format_table(rows, gib))
            if args.json:
                from shmstage_bench.report import environment

                config = {k: v for k, v in vars(args).items() if k != "json"}
                report = {"config": config | {"state_gib": gib}, "environment": environment(),
                          "rows": rows}
                Path(args.json).write_text(json.dumps(report, indent=1))
        return 1 if any(r["error"] for r in rows) else 0
    finally:
        if daemon is not None:
            daemon.stop()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
