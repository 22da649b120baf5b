#!/usr/bin/env python3
"""What a checkpoint costs a Lightning Trainer: its default CheckpointIO, its AsyncCheckpointIO
and shmstage's ShmStageCheckpointIO (blocking and ``block=False``), side by side.

One process trains the bench's Llama-style decoder (``shmstage_bench.model``; about 1.07 B
parameters by default, built on the GPU, fp32 weights under ``precision="bf16-mixed"``, fused
AdamW: 12 bytes of checkpoint a parameter) on random tokens, once per method, with
``ModelCheckpoint(every_n_train_steps=--save-every, save_top_k=1)``. A callback times every
step, from one ``on_train_batch_end`` to the next after waiting for the training stream
(never the whole device: shmstage's copy runs on a side stream). ModelCheckpoint saves in the
same hook, after that mark, so a checkpoint's cost is what the two steps after it took beyond
two plain steps (with ``block=False`` the next optimizer step waits for the rest of the copy).
The first save of each method is reported apart (shmstage makes and pins its segments then).
Printed per method: the median plain step, the median cost per checkpoint (and each), the
first save's cost, the seconds ``teardown`` waited for writes still running, and each
method's cost over the default's. On a GPU it first checks ``ShmStageFSDPStrategy`` (FSDP1,
which torch runs on no CPU): a sharded save through shmstage and a bit-exact resume.

    # one H100, under 8 minutes; starts its own shmstaged on a private socket under /tmp:
    PYTHONPATH=.:daemon:client:bench python3 scripts/lightning_gpu_bench.py --json lightning.json
    # anywhere, tiny, CPU (a check of the script, not a measurement):
    python scripts/lightning_gpu_bench.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bench_cli
import torch

METHODS = ("default", "async", "shmstage", "shmstage-nonblocking")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_cli.parser_for(__doc__)
    bench_cli.add_sizes(
        parser, dim=2048, layers=20, heads=16, kv_heads=8, ffn=5632, vocab=32000, seq=1024, batch=8
    )
    bench_cli.add_trainer_options(parser, METHODS, save_every=20, saves=3)
    parser.add_argument("--warmup", type=int, default=5, help="steps before the first save")
    parser.add_argument("--slots", type=int, default=2, help="shmstage staging slots")
    bench_cli.add_output_options(parser, "/var/tmp")
    parser.add_argument(
        "--no-fsdp1-check", action="store_true",
        help="skip the ShmStageFSDPStrategy save-and-resume check (GPU only)",
    )  # fmt: skip
    return bench_cli.shrink_if_tiny(
        parser.parse_args(argv), dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256,
        seq=32, batch=2, save_every=3, warmup=2,
    )  # fmt: skip


def model_config(args: argparse.Namespace) -> Any:
    from shmstage_bench.model import ModelConfig

    return ModelConfig(
        vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
        kv_heads=args.kv_heads, ffn=args.ffn, seq=args.seq, batch=args.batch, micro_batches=1,
    )  # fmt: skip


def run_method(
    method: str, args: argparse.Namespace, device: str, out: Path, socket: str | None
) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from shmstage_bench.model import Decoder
    from shmstage_client.integrations.lightning import ShmStageCheckpointIO
    from torch.utils.data import DataLoader

    cfg = model_config(args)
    cuda = device == "cuda"

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            with torch.device(device):  # built where it trains
                self.net = Decoder(cfg)
            self.gen = torch.Generator(device=device).manual_seed(0)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens = torch.randint(
                0, cfg.vocab, (cfg.batch, cfg.seq + 1), device=device, generator=self.gen
            )
            logits = self.net(tokens[:, :-1])
            return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=cuda or None)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(list(range(steps)), batch_size=1)

    class StepClock(Callback):
        """A mark at every step's end, once the training stream is done with it."""

        def __init__(self) -> None:
            self.marks: list[tuple[int, float]] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            if cuda:
                torch.cuda.current_stream().synchronize()
            self.marks.append((trainer.global_step, time.perf_counter()))

    steps = args.warmup + args.saves * args.save_every + 2
    plugins: list[Any] = []
    io = None
    if method == "async":
        plugins.append(AsyncCheckpointIO())
    elif method.startswith("shmstage"):
        io = ShmStageCheckpointIO(socket, slots=args.slots, block=method == "shmstage")
        plugins.append(io)
    directory = out / method
    clock = StepClock()
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1,
        precision="bf16-mixed" if cuda else "32-true", max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[clock, ModelCheckpoint(dirpath=directory, every_n_train_steps=args.save_every,
                                          save_top_k=1)],
        plugins=plugins or None,
    )  # fmt: skip
    module = Module()
    params = sum(p.numel() for p in module.parameters())
    started = time.perf_counter()
    fit_end: list[float] = []

    class FitEnd(Callback):
        def on_train_end(self, *_: Any) -> None:
            fit_end.append(time.perf_counter())

    trainer.callbacks.append(FitEnd())
    trainer.fit(module)
    finished = time.perf_counter()  # teardown (writes still running) is between the two
    marks = clock.marks
    intervals = {step: end - begin for (_, begin), (step, end) in itertools.pairwise(marks)}
    saved = [s for s in range(args.save_every, steps + 1, args.save_every) if s in intervals]
    near = {s + k for s in saved for k in (1, 2)}
    plain = [dt for s, dt in intervals.items() if s > args.warmup and s not in near]
    plain_s = statistics.median(plain) if plain else float("nan")
    costs = [
        intervals.get(s + 1, 0.0) + intervals.get(s + 2, 0.0) - 2 * plain_s
        for s in saved
        if s + 2 in intervals
    ]
    row: dict[str, Any] = {
        "method": method,
        "params": params,
        "plain_step_s": plain_s,
        "first_save_cost_s": costs[0] if costs else None,
        "save_cost_s": statistics.median(costs[1:]) if len(costs) > 1 else None,
        "save_costs_s": costs,
        "saves": len(costs),
        "teardown_wait_s": finished - fit_end[0] if fit_end else None,
        "fit_s": finished - started,
    }
    if io is not None:
        row["slots"] = args.slots
    del trainer, module, io
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    shutil.rmtree(directory, ignore_errors=True)
    os.sync()  # the next method starts with the disk's writeback done
    return row


def fsdp1_check(out: Path, socket: str | None) -> dict[str, Any]:
    """``ShmStageFSDPStrategy`` (FSDP1, sharded state dicts) at world size 1 on the GPU, the
    one place it can run (torch refuses FSDP1 on a CPU): save at step 3 through shmstage's
    DCP writer, resume a new Trainer from it, compare the losses bit for bit."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from shmstage_client.dcp import MARKER_NAME
    from shmstage_client.integrations.lightning import ShmStageFSDPStrategy
    from torch.utils.data import DataLoader

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
            )
            self.losses: list[tuple[int, str]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            g = torch.Generator(device="cuda").manual_seed(self.global_step)
            x = torch.randn(16, 64, device="cuda", generator=g)
            loss = torch.nn.functional.mse_loss(self.net(x), x.sum(1, keepdim=True).sin())
            self.losses.append((self.global_step, loss.item().hex()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(list(range(100)), batch_size=1)

    directory = out / "fsdp1"

    def fit(ckpt_path: str | None) -> list[tuple[int, str]]:
        module = Tiny()
        trainer = pl.Trainer(
            accelerator="gpu", devices=1, strategy=ShmStageFSDPStrategy(socket=socket),
            max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
            deterministic=True,
            callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1)],
        )  # fmt: skip
        trainer.fit(module, ckpt_path=ckpt_path)
        return module.losses

    try:
        straight = fit(None)
        saved = directory / "epoch=0-step=3.ckpt"
        marker = (saved / MARKER_NAME).is_file()
        resumed = fit(str(saved))
        same = resumed == [pair for pair in straight if pair[0] >= 3]
        return {"ok": marker and same, "marker": marker, "losses_equal": same}
    except Exception as exc:  # a row, never a crash of the bench
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = bench_cli.trainer_run(args, "lightning-bench-", parent="/var/tmp")
    with run as (device, out, socket):
        cfg = model_config(args)
        card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        print(
            f"model: {cfg.parameters() / 1e9:.3f} B parameters; checkpoint ~"
            f"{cfg.state_bytes() / 2**30:.1f} GiB; {card}; a save every {args.save_every} "
            f"steps; {args.saves} saves per method",
            flush=True,
        )
        fsdp1 = None
        if device == "cuda" and not args.no_fsdp1_check:
            fsdp1 = fsdp1_check(out, socket)
            print(f"ShmStageFSDPStrategy (FSDP1, sharded) save and resume: {fsdp1}", flush=True)
        rows = []
        for method in args.methods:
            row = run_method(method, args, device, out, socket)
            rows.append(row)
            cost = row["save_cost_s"]
            every = [round(c, 3) for c in row["save_costs_s"]]
            print(
                f"{method:21} plain step {row['plain_step_s']:.3f} s | cost per checkpoint "
                f"(median of {max(row['saves'] - 1, 0)}) "
                f"{'n/a' if cost is None else f'{cost:.3f} s'} | first "
                f"{row['first_save_cost_s'] or float('nan'):.3f} s | teardown waited "
                f"{row['teardown_wait_s'] or 0.0:.1f} s | all {every}",
                flush=True,
            )
        summary: dict[str, Any] = {
            "device": card, "config": vars(args), "rows": rows, "fsdp1_check": fsdp1,
        }  # fmt: skip
        base = next((r["save_cost_s"] for r in rows if r["method"] == "default"), None)
        if base:
            ratios = {
                r["method"]: r["save_cost_s"] / base
                for r in rows
                if r["save_cost_s"] is not None and base > 0
            }
            summary["cost_over_default"] = ratios
            print(
                "checkpoint cost over the default CheckpointIO's: "
                + ", ".join(f"{m} {v:.3f}" for m, v in ratios.items())
            )
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
