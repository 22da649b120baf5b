"""Scenario ``overlapped``: each save issued while the previous one is still persisting.

This is how training checkpoints: the next save comes before the last one is on disk,
and with ``slots=2`` it fills the other slot while the daemon writes the first. Issue 12
found the stall promise broken exactly here (every commit waited for a journal fsync on
the disk the previous checkpoint saturated), invisible to a bench that waited for each
checkpoint before the next. Saves are issued at a fixed interval shorter than one write
(default 0.6 × a measured durable time); once they come faster than the disk drains them,
``save()`` waits for a slot — *backpressure*, reported apart from the stall.
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .comparison import synthetic_config, synthetic_spec
from .limits import PinnedMirror
from .peers import import_stager
from .report import Column, Table
from .saves import (
    SAVE_COLUMNS,
    SAVE_NOTES,
    DurableClock,
    Reaper,
    SaveRecord,
    finish,
    issue,
    median_row,
    steady,
)
from .session import BenchSession
from .synthetic import SyntheticSpec

DEFAULT_SAVES = 6
INTERVAL_FRACTION = 0.6


@dataclass(frozen=True)
class OverlappedJob:
    spec: SyntheticSpec
    socket: str
    root: Path
    slots: int
    saves: int
    interval: float | None
    wait_timeout: float


def raw_copy_seconds(tensors: list[torch.Tensor], device: torch.device) -> list[float]:
    """Three raw copies of ``tensors`` into a pinned (CPU: plain) host buffer."""
    mirror = PinnedMirror(tensors, pin=device.type == "cuda")
    try:
        return [mirror.copy_from(tensors, device) for _ in range(3)]
    finally:
        mirror.close()


def measure(job: OverlappedJob) -> dict[str, Any]:
    """In its own process: the raw copy, a first and a calibration save, then the sequence."""
    device = torch.device(job.spec.device)
    state = job.spec.build()
    copies = raw_copy_seconds(list(state.values()), device)
    clock, reaper = DurableClock(), Reaper()
    job.root.mkdir(parents=True, exist_ok=True)
    stager_cls = import_stager()
    records: list[SaveRecord] = []
    try:
        with stager_cls(socket=job.socket, slots=job.slots, progress=clock) as stager:
            prologue = []
            for index, name in ((0, "first"), (0, "calibration")):
                record, handle = issue(stager, state, job.root / name, index)
                finish(record, handle, clock, job.wait_timeout)
                reaper.add(handle, job.root / name)
                prologue.append(record)
                print(
                    f"{name} save: stall {record.wall_stall_s:.3f} s, durable {record.durable_s} s",
                    flush=True,
                )
            write_s = prologue[1].durable_s or prologue[1].wall_stall_s
            interval = job.interval if job.interval is not None else INTERVAL_FRACTION * write_s
            origin = time.perf_counter()
            handles = []
            for i in range(1, job.saves + 1):
                time.sleep(max(0.0, origin + (i - 1) * interval - time.perf_counter()))
                path = job.root / f"save-{i}"
                record, handle = issue(stager, state, path, i)
                records.append(record)
                handles.append(handle)
                reaper.add(handle, path)
            for record, handle in zip(records, handles, strict=True):
                finish(record, handle, clock, job.wait_timeout)
    finally:
        reaper.close()
    return {
        "copies": copies,
        "prologue": prologue,
        "records": records,
        "origin": origin,
        "interval": interval,
        "write_s": write_s,
    }


def run(session: BenchSession) -> tuple[dict[str, Any], list[Table], list[str]]:
    args = session.args
    spec = synthetic_spec(args)
    saves = args.saves or DEFAULT_SAVES
    config = synthetic_config(args, spec) | {"saves": saves, "interval_s": args.interval}
    config["what"] += f", {saves} overlapped saves, {args.slots} slots"
    saves_table = Table(
        "saves",
        "Overlapped saves (each issued while the previous one persists)",
        SAVE_COLUMNS,
        chart=["wall_stall_s", "backpressure_s", "durable_s"],
        notes=list(SAVE_NOTES),
    )
    limits = Table("limits", "Limit", [Column("status", "status", "", 6), Column("seconds", "s")])
    if not session.socket:
        saves_table.rows.append(
            {"name": "overlapped", "status": "error", "error": session.daemon_error}
        )
        return config, [limits, saves_table], []
    job = OverlappedJob(
        spec,
        session.socket,
        session.root / "overlapped",
        args.slots,
        saves,
        args.interval,
        args.save_timeout,
    )
    outcome = session.run("overlapped", measure, (job,), args.part_timeout)
    shutil.rmtree(job.root, ignore_errors=True)  # what a killed process left behind too
    if not outcome.ok:
        saves_table.rows.append(
            {
                "name": "overlapped",
                "status": "error",
                "error": outcome.error,
                "traceback": outcome.traceback or outcome.log_tail,
            }
        )
        return config, [limits, saves_table], []
    v = outcome.value
    copy_s = statistics.median(v["copies"])
    limits.rows.append(
        {
            "name": "raw pinned copy (same bytes)",
            "status": "ok",
            "seconds": copy_s,
            "samples": v["copies"],
        }
    )
    first, calibration = v["prologue"]
    rows = [first.row(copy_s, v["origin"]), calibration.row(copy_s, v["origin"])]
    rows[0]["name"], rows[1]["name"] = "first save (registers)", "calibration (alone)"
    for row in rows:
        row["issued_s"] = None
    rows += [r.row(copy_s, v["origin"]) for r in v["records"]]
    rows.append(median_row("steady: median of saves 2..N", steady(v["records"]), copy_s))
    saves_table.rows = rows
    config["interval_s"] = v["interval"]
    notes = [
        f"interval {v['interval']:.3f} s between saves; one save alone took {v['write_s']:.3f} s "
        "to be durable (calibration row).",
    ]
    return config, [limits, saves_table], notes
