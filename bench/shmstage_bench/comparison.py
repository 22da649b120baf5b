"""Scenario ``peers``: shmstage side by side with its peers and the physical limits.

Every method checkpoints the same synthetic state dict (rebuilt from the same seed in its
own process) into the same filesystem, one after the other, so that the only thing that
differs between rows is the method. A method that fails, crashes, hangs or is not
installed is a row saying so.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from dataclasses import replace
from typing import Any

from .budget import PROCESS_GRACE_S, Planner
from .method import BenchContext, MethodResult
from .peers import MethodJob, available_methods, leftovers, remove_leftovers, run_method
from .report import Column, Table, ratio
from .session import BenchSession
from .synthetic import SyntheticSpec, format_bytes

#: Limits measured both before and after the methods that follow them, their samples
#: joined: a VM's disk drifted between 3.5 and 5.1 s for the same 8 GiB within minutes
#: (``docs/performance.md``), so a limit taken only before the shmstage rows
#: made their ratio to it a matter of when each ran.
BRACKETED = ("disk-limit-direct",)

#: A method whose process holds this many more descriptors at its end than at its start
#: is reported as leaking (a peer's worker pipes and shared-memory handles are a few).
LEAK_THRESHOLD = 64


def synthetic_spec(args: argparse.Namespace) -> SyntheticSpec:
    return SyntheticSpec(
        total_bytes=args.total_bytes,
        tensors=args.tensors,
        min_tensor_bytes=args.min_tensor_bytes,
        max_tensor_bytes=args.max_tensor_bytes,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
    )


def synthetic_config(args: argparse.Namespace, spec: SyntheticSpec) -> dict[str, Any]:
    sizes = spec.sizes()
    return {
        "what": f"{format_bytes(spec.total_bytes)} in {spec.tensors} {spec.dtype} tensors",
        "total_bytes": spec.total_bytes,
        "tensors": spec.tensors,
        "min_tensor_bytes": spec.min_tensor_bytes,
        "max_tensor_bytes": spec.max_tensor_bytes,
        "smallest_tensor_bytes": min(sizes),
        "largest_tensor_bytes": max(sizes),
        "dtype": spec.dtype,
        "device": spec.device,
        "seed": spec.seed,
        "slots": args.slots,
    }


def _method_timeout(args: argparse.Namespace) -> float:
    """The parent's deadline for one method's process: setup plus every save's own limit."""
    if args.method_timeout is not None:
        return args.method_timeout
    return 300.0 + (args.repeats + 1) * args.save_timeout


def _failed(cls: Any, error: str, traceback: str = "") -> MethodResult:
    return MethodResult(
        cls.name, cls.kind, cls.description, status="error", error=error, traceback=traceback
    )


def _leak(res: MethodResult) -> str:
    """What the method's process was left holding, when that looks like a leak."""
    if res.fds_after == -1:
        return "no descriptor left at its end (EMFILE): it leaked them all"
    if res.fds_before is None or res.fds_after is None:
        return ""
    leaked = res.fds_after - res.fds_before
    return f"leaked {leaked} descriptors" if leaked >= LEAK_THRESHOLD else ""


def _not_run(cls: Any, why: str) -> MethodResult:
    return MethodResult(cls.name, cls.kind, cls.description, status="not run", note=why)


def _beyond_scale(cls: Any, spec: SyntheticSpec, named: bool) -> str:
    """Why a peer is not run at this tensor count (its own measured record), or ""."""
    if cls.scale_limit is None or named:
        return ""
    tensors, evidence = cls.scale_limit
    if spec.tensors <= tensors:
        return ""
    return f"skipped at {spec.tensors:,} tensors: {evidence}; name it in --methods to run it anyway"


def _measure(
    session: BenchSession,
    name: str,
    spec: SyntheticSpec,
    ctx: BenchContext,
    share_s: float | None = None,
    stretch_s: float = 0.0,
) -> MethodResult:
    """One method, in a process of its own: a row, whatever happens to that process.

    ``share_s``: what it may spend of ``--budget`` (see ``budget``; ``stretch_s`` more for a
    first repeat); its process gets that plus a grace for starting and ending, and plans
    its repeats to fit.
    """
    args = session.args
    cls = available_methods()[name]
    if cls.kind == "shmstage" and not session.socket:
        return _failed(cls, session.daemon_error or "no shmstaged")
    beyond = _beyond_scale(cls, spec, getattr(args, "methods_named", True))
    if beyond:
        session.log(f"{name}: {beyond}")
        return _not_run(cls, beyond)
    root = session.root / name
    job = MethodJob(
        name, spec, replace(ctx, root=root), args.repeats, args.save_timeout, share_s, stretch_s
    )
    timeout = _method_timeout(args)
    if share_s is not None:
        timeout = min(timeout, share_s + stretch_s + PROCESS_GRACE_S)
    before = leftovers(cls)
    outcome = session.run(name, run_method, (job,), timeout)
    shutil.rmtree(root, ignore_errors=True)  # also what a killed process left behind
    remove_leftovers(cls, before)
    if outcome.ok:
        res = outcome.value
    else:
        error = outcome.error
        if share_s is not None and timeout < _method_timeout(args) and "hung" in error:
            error = (
                f"{error}: its share of the --budget ({share_s:.0f} s, plus "
                f"{PROCESS_GRACE_S:.0f} s for its process) ran out before it handed back a row"
            )
        res = _failed(cls, error, outcome.traceback or outcome.log_tail[-1500:])
    res.process_s = outcome.seconds
    leak = _leak(res)
    if leak:
        res.note = "; ".join(filter(None, [res.note, leak]))
    return res


def _measure_again(
    session: BenchSession,
    name: str,
    spec: SyntheticSpec,
    ctx: BenchContext,
    results: list[MethodResult],
) -> None:
    """Measure limit ``name`` once more after the rows that followed it, and join the
    samples, so that the ratio to it does not ride on where the disk's pace drifted.
    Its time was kept back from the start (``budget.closing_reserve``): it gets all
    that is left."""
    before = next((r for r in results if r.name == name and r.status == "ok"), None)
    if before is None:
        return
    after = results[results.index(before) + 1 :]
    if not any(r.status == "ok" for r in after):
        return
    left = session.remaining()
    again = _measure(session, name, spec, ctx, None if left is None else max(left, 0.0))
    if again.status != "ok":
        before.note = "; ".join(filter(None, [before.note, f"after the methods: {again.error}"]))
        return
    counts = f"samples: {len(before.samples)} before the methods, {len(again.samples)} after"
    before.samples += again.samples
    before.note = "; ".join(filter(None, [before.note, counts]))


def _measure_all(
    session: BenchSession, spec: SyntheticSpec, ctx: BenchContext
) -> list[MethodResult]:
    """Every selected method in turn, each within its share of what is left of
    ``--budget``, the closing bracket's time kept back until it runs."""
    names = list(session.args.methods)
    methods = available_methods()
    bracketed = [i for i, n in enumerate(names[:-1]) if n in BRACKETED]
    planner = Planner([methods[n].kind for n in names], bracketed[0] if bracketed else None)
    results: list[MethodResult] = []
    for i, name in enumerate(names):
        seconds, stretch, why = planner.next(i, session.remaining())
        if why:
            session.log(f"{name}: {why}")
            results.append(_not_run(methods[name], why))
            continue
        started = time.monotonic()
        results.append(_measure(session, name, spec, ctx, seconds, stretch))
        planner.ran(i, time.monotonic() - started, results[-1].status == "ok")
    return results


def run(session: BenchSession) -> tuple[dict[str, Any], list[Table], list[str]]:
    args = session.args
    spec = synthetic_spec(args)
    ctx = BenchContext(
        device=args.torch_device,
        root=session.root,
        socket=session.socket,
        slots=args.slots,
        direct_threads=args.direct_threads,
        direct_chunk=args.direct_chunk,
        paired_limit="disk-limit-direct" in args.methods,
    )
    results = _measure_all(session, spec, ctx)
    for name in BRACKETED:
        _measure_again(session, name, spec, ctx, results)
    config = synthetic_config(args, spec) | {
        "repeats": args.repeats,
        "dir": str(session.root),
        "methods": list(args.methods),
        "direct_threads": args.direct_threads,
        "direct_chunk": args.direct_chunk,
    }
    config["what"] += f", median of {args.repeats} after a first save"
    notes = [
        "stall: until the caller may modify its tensors again; durable: until fsynced.",
        "÷write: durable ÷ buffered raw write + fsync; ÷direct: durable ÷ the disk limit "
        "(aligned O_DIRECT parallel writes + fsync), same bytes, same run, same filesystem; "
        "÷paired: each steady save right after a sample of that limit of its own, the median "
        "of each save's durable ÷ its sample (the disk's pace drifts within a run).",
        "dirty MiB: peak Dirty+Writeback (/proc/meminfo, every 20 ms) during the save; cache Δ: "
        "file page cache (Cached − Shmem) grown by the time it was durable (first save excluded).",
    ]
    return config, [methods_table(results, spec.total_bytes), trainer_table(results)], notes


def methods_table(results: list[MethodResult], total_bytes: int) -> Table:
    by_name = {r.name: r for r in results}

    def limit(name: str, attr: str) -> float | None:
        r = by_name.get(name)
        return r.median(attr) if r else None

    copy_s = limit("raw-copy", "stall_s")
    write_s = limit("raw-write-fsync", "durable_s")
    direct_s = limit("disk-limit-direct", "durable_s")
    rows = []
    for r in results:
        stall, durable = r.median("stall_s"), r.median("durable_s")
        rows.append(
            {
                "name": r.name,
                "kind": r.kind,
                "description": r.description,
                "status": r.status,
                "note": "; ".join(filter(None, [r.note, writer_note(r)])),
                "error": r.error,
                "traceback": r.traceback,
                "repeats": len(r.samples),
                "stall_s": stall,
                "durable_s": durable,
                "stall_gbps": total_bytes / stall / 1e9 if stall else None,
                "durable_gbps": total_bytes / durable / 1e9 if durable else None,
                "stall_vs_raw_copy": ratio(stall, copy_s),
                "durable_vs_raw_write": ratio(durable, write_s),
                "durable_vs_direct": ratio(durable, direct_s),
                "durable_vs_paired_limit": r.median_detail("durable_vs_paired_limit"),
                "paired_limit_s": r.median_detail("paired_limit_s"),
                "restore_s": r.median_detail("restore_s"),  # peers that time one
                "first_stall_s": r.first.stall_s if r.first else None,
                "first_durable_s": r.first.durable_s if r.first else None,
                "dirty_writeback_peak_bytes": r.max_detail("dirty_writeback_peak_bytes"),
                "file_cache_delta_bytes": r.median_detail("file_cache_delta_bytes"),
                "process_s": r.process_s,
                "fds_before": r.fds_before,
                "fds_after": r.fds_after,
                "first": vars(r.first) if r.first else None,
                "samples": [vars(s) for s in r.samples],
            }
        )
    return Table(
        name="methods",
        title="Checkpoint methods (median of the repeats; first save apart)",
        columns=[
            Column("status", "status", "", 7),
            Column("stall_s", "stall s"),
            Column("durable_s", "durable s"),
            Column("stall_gbps", "GB/s", ".2f", 6),
            Column("stall_vs_raw_copy", "÷copy", "x", 6),
            Column("durable_vs_raw_write", "÷write", "x", 6),
            Column("durable_vs_direct", "÷direct", "x", 7),
            Column("durable_vs_paired_limit", "÷paired", "x", 7),
            Column("first_stall_s", "1st stall"),
            Column("first_durable_s", "1st dur."),
            Column("dirty_writeback_peak_bytes", "dirty MiB", "MiB", 9),
            Column("file_cache_delta_bytes", "cache Δ MiB", "MiB", 11),
        ],
        rows=rows,
        chart=["stall_s", "durable_s"],
    )


def writer_note(result: MethodResult) -> str:
    """Where shmstaged's writer spent a steady save's persist time (medians), for the rows
    whose saves report it: a writer that gathers longer than it waits on the disk, not
    the disk, sets the pace (many small tensors)."""
    parts = {
        label: result.median_detail(key)
        for label, key in (
            ("gather", "gather_seconds"),
            ("disk wait", "disk_wait_seconds"),
            ("sync", "sync_seconds"),
            ("publish", "publish_seconds"),
        )
    }
    if parts["gather"] is None:
        return ""
    shown = ", ".join(
        f"{label} {value:.3f} s" for label, value in parts.items() if value is not None
    )
    return f"writer: {shown}"


def trainer_table(results: list[MethodResult]) -> Table:
    """The fixed compute step, idle and while shmstaged persists (from ``shmstage-busy``)."""
    busy = next((r for r in results if r.name == "shmstage-busy"), None)
    table = Table(
        name="trainer",
        title="Trainer step (fixed compute loop) while shmstaged persists, against idle",
        columns=[
            Column("status", "status", "", 7),
            Column("step_s", "step ms", "ms", 8),
            Column("steps", "steps", "d", 6),
            Column("vs_idle", "÷idle", "x", 6),
        ],
    )
    if busy is None:
        table.notes.append("shmstage-busy not selected: no trainer measurement")
        return table
    idle = [s.detail["idle_step_s"] for s in busy.samples if s.detail.get("idle_step_s")]
    during = [s.detail["busy_step_s"] for s in busy.samples if s.detail.get("busy_step_s")]
    steps = sum(s.detail.get("busy_steps", 0) for s in busy.samples)
    idle_s = statistics.median(idle) if idle else None
    during_s = statistics.median(during) if during else None
    status = "ok" if busy.status == "ok" else busy.status
    table.rows = [
        {
            "name": "idle (nothing in flight)",
            "status": status,
            "step_s": idle_s,
            "steps": None,
            "vs_idle": 1.0 if idle_s else None,
            "error": busy.error,
        },
        {
            "name": "while shmstaged persists",
            "status": status,
            "step_s": during_s,
            "steps": steps,
            "vs_idle": ratio(during_s, idle_s),
        },
    ]
    if busy.status == "ok" and not during:
        table.notes.append("every persist ended before one step did: no step overlapped it")
    if busy.note:
        table.notes.append(busy.note)
    return table
