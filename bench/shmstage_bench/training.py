"""Scenario ``training``: checkpoints of a model being trained, as a trainer feels them.

A Llama-style decoder (``model``) is trained with AdamW; every N steps its model and
optimizer state go to ``Stager(slots=2).save()``, so each save overlaps the previous write.
Reported per save: the wall-clock stall around ``save()`` and its parts, backpressure apart;
per step: the time with nothing in flight, with a persist in flight and — with ``--guard``
(issue 14's ``stager.guard(optimizer)`` + ``save(..., block=False)``) — the step whose
forward and backward overlap the copy. Every checkpoint kept is loaded back once durable and
compared bit for bit with a snapshot of the state taken right before its ``save()`` (in
pinned buffers allocated up front; compared after the loop, so no comparison lands inside a
timed step): it must be the state at the call, not a mix of steps.

With ``--reserve`` a third run calls ``stager.reserve(state)`` before the loop (issue 36:
every slot registered, faulted in and pinned up front), so its first and second saves
stall for the copy only; its rows sit beside the plain run's first and second saves.
"""

from __future__ import annotations

import math
import shutil
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .compute import median
from .limits import PinnedMirror
from .model import CPU_DEFAULT, CUDA_DEFAULT, ModelConfig, Trainer
from .pagecache import read_meminfo
from .peers import import_stager
from .report import Column, Table, ratio
from .saves import (
    SAVE_COLUMNS,
    SAVE_NOTES,
    DurableClock,
    Reaper,
    SaveRecord,
    finish,
    first_difference,
    issue,
    median_row,
    steady,
    substitute,
    tensors_of,
)
from .session import BenchSession
from .synthetic import format_bytes

DEFAULT_SAVES = 4
INTERVAL_FRACTION = 0.6
WARMUP_STEPS = 3
UNSUPPORTED = "not supported by this client"


@dataclass(frozen=True)
class TrainingJob:
    cfg: ModelConfig
    device: str
    seed: int
    socket: str
    root: Path
    slots: int
    saves: int
    save_every: int | None
    guard: bool
    wait_timeout: float
    reserve: bool = False


def _memory_for_snapshots(nbytes: int, slots: int, root: Path, wanted: int) -> int:
    """How many snapshots (and checkpoints kept on disk until compared) fit on this node."""
    avail = read_meminfo().get("MemAvailable", 0)
    memory = (avail - slots * nbytes - nbytes - (4 << 30)) // max(nbytes, 1)
    disk = (shutil.disk_usage(root).free - (2 << 30)) // max(nbytes, 1) - slots
    return int(max(0, min(wanted, memory, disk)))


def _unsupported(job: TrainingJob) -> str:
    """Why the guarded run cannot happen with this client, or ""."""
    if job.guard and not hasattr(import_stager(), "guard"):
        return f"{UNSUPPORTED}: Stager has no guard() (issue 14's non-blocking save)"
    if job.reserve and not hasattr(import_stager(), "reserve"):
        return f"{UNSUPPORTED}: Stager has no reserve() (issue 36's setup before training)"
    return ""


def measure(job: TrainingJob) -> dict[str, Any]:
    """In its own process: train, save every N steps, compare every kept checkpoint."""
    why = _unsupported(job)
    if why:
        return {"unsupported": why}
    device = torch.device(job.device)
    trainer = Trainer(job.cfg, device, job.seed)
    job.root.mkdir(parents=True, exist_ok=True)

    def compute_done() -> None:
        """Wait for the trainer's own stream only: a whole-device synchronize would also
        wait for a guarded save's copy on its side stream, outside the timed step."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def timed_step() -> float:
        compute_done()
        t0 = time.perf_counter()
        trainer.step()
        compute_done()
        return time.perf_counter() - t0

    warm = [timed_step() for _ in range(WARMUP_STEPS)]  # creates AdamW's state, warms kernels
    state = trainer.state()
    tensors = tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pin = device.type == "cuda"
    keep = _memory_for_snapshots(nbytes, job.slots, job.root, job.saves + 1)
    mirrors = [PinnedMirror(tensors, pin=pin) for _ in range(max(1, keep))]
    copies = [mirrors[0].copy_from(tensors, device) for _ in range(3)]
    print(
        f"{len(tensors)} tensors, {format_bytes(nbytes)}; raw copy {statistics.median(copies):.3f}"
        f" s; {keep} snapshot(s) kept for comparison",
        flush=True,
    )

    clock, reaper = DurableClock(), Reaper()
    kept: list[tuple[SaveRecord, Any]] = []  # (record, expected state) compared at the end
    records: list[SaveRecord] = []
    steps: list[tuple[int, float, str]] = []
    save_kwargs = {"block": False} if job.guard else {}
    stager_cls = import_stager()
    with stager_cls(socket=job.socket, slots=job.slots, progress=clock) as stager:
        if job.guard:
            stager.guard(trainer.optimizer)
        reserve_s = None
        if job.reserve:
            t0 = time.perf_counter()
            stager.reserve(trainer.state())
            reserve_s = time.perf_counter() - t0
            print(f"reserve(): {reserve_s:.3f} s", flush=True)

        def save(index: int, step: int, kwargs: dict[str, Any]) -> tuple[SaveRecord, Any]:
            """Snapshot (if this save is compared) untimed, then the timed ``save()``."""
            current = trainer.state()
            snap = len(kept) < keep and (index == 0 or index > job.saves - keep + 1)
            expected = None
            if snap:
                mirror = mirrors[len(kept) % len(mirrors)]
                mirror.copy_from(tensors_of(current), device)
                expected = substitute(current, iter(mirror.views))
            path = job.root / f"step-{step}"
            record, handle = issue(stager, current, path, index, **kwargs)
            record.step = step
            if expected is not None:
                kept.append((record, expected))
            else:
                reaper.add(handle, path)
            return record, handle

        first, handle = save(0, WARMUP_STEPS, {})
        finish(first, handle, clock, job.wait_timeout)
        write_s = first.parts.get("persist_seconds") or first.durable_s or 1.0
        every = job.save_every or max(1, math.ceil(INTERVAL_FRACTION * write_s / median(warm)))
        print(
            f"first save: stall {first.wall_stall_s:.3f} s, durable {first.durable_s} s; "
            f"a save every {every} steps",
            flush=True,
        )
        handles: list[Any] = []
        step = WARMUP_STEPS
        for index in range(1, job.saves + 2):  # the last round only times steps
            for k in range(every):
                in_flight = any(not h.done() for h in handles)
                seconds = timed_step()
                step += 1
                kind = (
                    "copy"
                    if job.guard and handles and k == 0
                    else ("persist" if in_flight else "idle")
                )
                steps.append((step, seconds, kind))
            if index <= job.saves:
                record, handle = save(index, step, save_kwargs)
                records.append(record)
                handles.append(handle)
        for record, handle in zip(records, handles, strict=True):
            finish(record, handle, clock, job.wait_timeout)
    reaper.close()
    _compare(kept)
    for mirror in mirrors:
        mirror.close()
    return {
        "copies": copies,
        "warm_steps": warm,
        "first": first,
        "records": records,
        "steps": steps,
        "every": every,
        "tensors": len(tensors),
        "state_bytes": nbytes,
        "kept": len(kept),
        "reserve_s": reserve_s,
    }


def _compare(kept: list[tuple[SaveRecord, Any]]) -> None:
    """Load each kept checkpoint back and compare it with the state at its call."""
    from shmstage_client import load

    for record, expected in kept:
        if record.error:
            continue
        try:
            loaded = load(record.path)
            record.mismatch = first_difference(loaded, expected)
            record.bit_exact = not record.mismatch
        except Exception as exc:
            record.bit_exact, record.mismatch = False, f"load failed: {type(exc).__name__}: {exc}"
        shutil.rmtree(record.path, ignore_errors=True)


def model_config(args: Any) -> ModelConfig:
    base = CUDA_DEFAULT if args.device == "cuda" else CPU_DEFAULT
    flags = {
        "dim": args.dim,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "ffn": args.ffn,
        "vocab": args.vocab,
        "seq": args.seq,
        "batch": args.batch,
        "micro_batches": args.micro_batches,
    }
    return replace(base, **{k: v for k, v in flags.items() if v is not None})


def run(session: BenchSession) -> tuple[dict[str, Any], list[Table], list[str]]:
    args = session.args
    cfg = model_config(args)
    saves = args.saves or DEFAULT_SAVES
    config = {
        "what": f"Llama-style decoder, {cfg.parameters() / 1e6:.0f} M parameters, "
        f"~{format_bytes(cfg.state_bytes())} of state with AdamW, {saves} saves, "
        f"{args.slots} slots",
        "model": cfg.as_dict(),
        "parameters": cfg.parameters(),
        "saves": saves,
        "save_every": args.save_every,
        "guard": args.guard,
        "reserve": args.reserve,
        "slots": args.slots,
        "seed": args.seed,
    }
    modes = [("plain", False, False)] + ([("guard", True, False)] if args.guard else [])
    modes += [("reserve", False, True)] if args.reserve else []
    tables = {
        "limits": Table(
            "limits",
            "Limit: raw pinned copy of the same bytes",
            [Column("status", "status", "", 6), Column("seconds", "s")],
        ),
        "saves": Table(
            "saves",
            "Saves during training (each overlapping the previous write)",
            [
                *SAVE_COLUMNS,
                Column("copy_wait_seconds", "cp.wait s"),
                Column("deferred_copy_seconds", "late cp s"),
                Column("staged_seconds", "staged s"),
                Column("bit_exact", "exact", "yes", 5),
            ],
            chart=["wall_stall_s", "backpressure_s", "durable_s"],
            notes=[
                *SAVE_NOTES,
                "cp.wait: waiting for the previous non-blocking save's copy; late cp: a "
                "non-blocking save's copy after save() returned, from its start until it "
                "landed; staged: from the call until the daemon owned the data.",
            ],
        ),
        "steps": Table(
            "steps",
            "Training step time (median)",
            [
                Column("status", "status", "", 6),
                Column("step_s", "step ms", "ms", 8),
                Column("steps", "steps", "d", 5),
                Column("vs_idle", "÷idle", "x", 6),
            ],
        ),
    }
    notes: list[str] = []
    for mode, guard, reserve in modes:
        if not session.socket:
            _error_rows(tables, mode, session.daemon_error)
            continue
        job = TrainingJob(
            cfg,
            args.device,
            args.seed,
            session.socket,
            session.root / f"training-{mode}",
            args.slots,
            saves,
            args.save_every,
            guard,
            args.save_timeout,
            reserve,
        )
        outcome = session.run(f"training-{mode}", measure, (job,), args.part_timeout)
        shutil.rmtree(job.root, ignore_errors=True)
        if not outcome.ok:
            _error_rows(tables, mode, outcome.error, outcome.traceback or outcome.log_tail)
        elif "unsupported" in outcome.value:
            _error_rows(tables, mode, outcome.value["unsupported"])
        else:
            notes += _mode_rows(tables, mode, guard, outcome.value)
    return config, list(tables.values()), notes


def _error_rows(tables: dict[str, Table], mode: str, error: str, tb: str = "") -> None:
    for t in tables.values():
        t.rows.append({"name": mode, "status": "error", "error": error, "traceback": tb})


def _mode_rows(tables: dict[str, Table], mode: str, guard: bool, v: dict[str, Any]) -> list[str]:
    copy_s = statistics.median(v["copies"])
    tables["limits"].rows.append(
        {"name": f"{mode}: raw copy", "status": "ok", "seconds": copy_s, "samples": v["copies"]}
    )
    origin = v["first"].issued_at
    first = v["first"].row(copy_s, origin)
    first["name"] = f"{mode}: first save " + (
        "(after reserve())" if v.get("reserve_s") is not None else "(registers)"
    )
    rows = [first]
    for r in v["records"]:
        row = r.row(copy_s, origin)
        row["name"] = f"{mode}: {row['name']}"
        rows.append(row)
    stable = steady(v["records"])
    summary = median_row(f"{mode}: steady (median of saves 2..N)", stable, copy_s)
    tables["saves"].rows += [*rows, summary]
    by_kind: dict[str, list[float]] = {"idle": [], "persist": [], "copy": []}
    for _, seconds, kind in v["steps"]:
        by_kind[kind].append(seconds)
    idle = median(by_kind["idle"]) or median(v["warm_steps"])
    labels = [("idle", "nothing in flight"), ("persist", "a persist in flight")]
    if guard:
        labels.append(("copy", "overlaps the copy (guard)"))
    for kind, label in labels:
        step_s = median(by_kind[kind])
        tables["steps"].rows.append(
            {
                "name": f"{mode}: {label}",
                "status": "ok",
                "step_s": step_s,
                "steps": len(by_kind[kind]),
                "vs_idle": ratio(step_s, idle),
                "samples": by_kind[kind],
            }
        )
    exact = [r.bit_exact for r in [v["first"], *v["records"]] if r.bit_exact is not None]
    notes = [
        f"{mode}: {v['tensors']} tensors, {format_bytes(v['state_bytes'])}; a save every "
        f"{v['every']} steps; steady stall-bp ÷ raw copy "
        f"{_fmt(summary.get('stall_vs_raw_copy'))} (wall stall ÷ raw copy "
        f"{_fmt(ratio(summary.get('wall_stall_s'), copy_s))}); {sum(exact)} of "
        f"{len(v['records']) + 1} checkpoints compared bit-exact"
        + ("" if all(exact) else " — MISMATCH, see the rows"),
    ]
    if v.get("reserve_s") is not None:
        second = v["records"][0].wall_stall_s if v["records"] else None
        notes.append(
            f"{mode}: reserve() before the loop took {_fmt(v['reserve_s'])} s; then the first "
            f"save stalled {_fmt(v['first'].wall_stall_s)} s and the second "
            f"{_fmt(second)} s (raw copy {_fmt(copy_s)} s; compare the plain run's rows)"
        )
    if guard:
        target = 0.010 + 0.001 * v["tensors"] / 100
        notes.append(
            f"{mode}: save() returned in {_fmt(summary.get('wall_stall_s'), 1e3)} ms, "
            f"{_fmt(summary.get('stall_net_s'), 1e3)} ms without backpressure (medians; "
            f"issue 14's bound for {v['tensors']} tensors: {target * 1e3:.1f} ms); its copy "
            f"landed {_fmt(summary.get('deferred_copy_seconds'), 1e3)} ms after it started "
            f"(÷ raw copy {_fmt(ratio(summary.get('deferred_copy_seconds'), copy_s))}), the "
            f"daemon owned the data {_fmt(summary.get('staged_seconds'), 1e3)} ms after the "
            "call"
        )
    return notes


def _fmt(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.2f}"
