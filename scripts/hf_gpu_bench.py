#!/usr/bin/env python3
"""What a checkpoint costs a Hugging Face Trainer: its own checkpointing vs ShmStageCallback.

One process trains a Llama built from its config (about 1.1B parameters by default, fp32
weights, ``bf16=True`` autocast, the Trainer's AdamW) on random tokens, once with the
Trainer's default checkpointing (``torch.save`` and safetensors into ``checkpoint-N/``) and
once with ``callbacks=[ShmStageCallback()]``, each saving every ``--save-every`` steps with
``save_total_limit=1``. A callback times every step, from one ``on_step_end`` to the next
after waiting for the training stream (never the whole device: shmstage's copy runs on a
side stream, and only the optimizer's step waits for it). A checkpoint's cost is what the
two steps after it took beyond two plain steps: the Trainer's save runs between them
(``_maybe_log_save_evaluate``), and with ShmStageCallback the optimizer step of the next
one waits for whatever of the copy the forward and backward did not hide. The first save of
each method is reported apart (setup: shmstage's segments are made and pinned then).
Printed: per method the median plain step, the median cost per checkpoint, the first
save's cost, and the ratio of the two methods' medians.

    # one H100, under 8 minutes; starts its own shmstaged (a private socket):
    python scripts/hf_gpu_bench.py --json hf-bench.json
    # anywhere, tiny, CPU (a check of the script, not a measurement):
    python scripts/hf_gpu_bench.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bench_cli
import torch

METHODS = ("trainer-default", "shmstage")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_cli.parser_for(__doc__)
    bench_cli.add_sizes(
        parser, layers=18, hidden=2048, intermediate=5632, heads=16, vocab=32000, seq=1024, batch=4
    )
    bench_cli.add_trainer_options(parser, METHODS, save_every=25, saves=4)
    bench_cli.add_output_options(parser, "a temp dir")
    return bench_cli.shrink_if_tiny(
        parser.parse_args(argv), layers=2, hidden=64, intermediate=128, heads=4, vocab=256,
        seq=32, batch=2, save_every=3, saves=3,
    )  # fmt: skip


class StepClock:
    """Seconds between consecutive ``on_step_end`` calls, the training stream drained."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.ends: list[float] = []

    def callback(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if clock.device == "cuda":
                    torch.cuda.current_stream().synchronize()
                clock.ends.append(time.perf_counter())

        return Clock()

    def intervals(self) -> list[float]:
        """Interval ``i`` is step ``i + 2`` (1-based): from the end of step i+1 to its end."""
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]


def build_model(args: argparse.Namespace, device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config)


def run_method(
    method: str, model: Any, args: argparse.Namespace, device: str, out: Path, socket: str | None
) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    steps = args.save_every * args.saves + 2
    rows = torch.randint(0, args.vocab, (steps * args.batch, args.seq))
    data = [{"input_ids": row, "labels": row} for row in rows]
    clock = StepClock(device)
    callbacks: list[Any] = [clock.callback()]
    shm = None
    if method == "shmstage":
        from shmstage_client.integrations.transformers import ShmStageCallback

        shm = ShmStageCallback(socket=socket, slots=2)
        callbacks.append(shm)
    target = out / method
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(target),
            max_steps=steps,
            per_device_train_batch_size=args.batch,
            learning_rate=1e-5,
            bf16=device == "cuda",
            use_cpu=device == "cpu",
            save_strategy="steps",
            save_steps=args.save_every,
            save_total_limit=1,
            logging_steps=10**9,
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
        ),
        train_dataset=data,
        callbacks=callbacks,
    )
    started = time.perf_counter()
    trainer.train()  # with ShmStageCallback, returns once every checkpoint is durable
    total = time.perf_counter() - started
    intervals = clock.intervals()
    saved_at = [s for s in range(1, steps + 1) if s % args.save_every == 0]
    # Interval index of step s is s - 2; the save at step s lands in steps s+1 and s+2.
    touched = {s + k - 2 for s in saved_at for k in (1, 2)}
    plain = [t for i, t in enumerate(intervals) if i not in touched and i >= 2]
    base = statistics.median(plain)
    costs = [
        sum(intervals[s + k - 2] for k in (1, 2) if s + k - 2 < len(intervals)) - 2 * base
        for s in saved_at
    ]
    row: dict[str, Any] = {
        "method": method,
        "steps": steps,
        "saves": len(saved_at),
        "plain_step_s": base,
        "first_save_cost_s": costs[0],
        "save_cost_s": statistics.median(costs[1:]) if len(costs) > 1 else costs[0],
        "save_costs_s": costs,
        "train_s": total,
        "checkpoints_left": sorted(p.name for p in target.glob("checkpoint-*")),
    }
    if shm is not None and shm.last_save is not None:
        timings = shm.last_save.timings
        row["last_save_stall_s"] = timings.stall_seconds
        row["last_save_deferred_copy_s"] = timings.deferred_copy_seconds
    del trainer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(target, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with bench_cli.trainer_run(args, "hf-bench-") as (device, out, socket):
        model = build_model(args, device)
        params = sum(p.numel() for p in model.parameters())
        state_gib = params * 4 * 3 / 2**30  # fp32 weights + AdamW's two moments
        card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        print(f"model: {params / 1e9:.3f} B parameters; checkpoint ~{state_gib:.1f} GiB; {card}")
        rows = []
        for method in args.methods:
            row = run_method(method, model, args, device, out, socket)
            rows.append(row)
            every = [round(c, 3) for c in row["save_costs_s"]]
            print(
                f"{method:16} plain step {row['plain_step_s']:.3f} s | cost per checkpoint "
                f"(median of {row['saves'] - 1}) {row['save_cost_s']:.3f} s | first "
                f"{row['first_save_cost_s']:.3f} s | all {every}",
                flush=True,
            )
        by = {row["method"]: row for row in rows}
        summary: dict[str, Any] = {"params": params, "device": card, "rows": rows}
        if len(by) == 2:
            ours, theirs = by["shmstage"]["save_cost_s"], by["trainer-default"]["save_cost_s"]
            # A cost within the steps' noise can come out negative: no ratio then.
            ratio = ours / theirs if theirs > 0 else None
            summary["shmstage_over_default"] = ratio
            shown = f"{ratio:.3f}" if ratio is not None else "n/a (default's cost <= 0)"
            print(
                f"checkpoint cost, shmstage / Trainer default: {shown} "
                f"({ours:.3f} s vs {theirs:.3f} s)"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
