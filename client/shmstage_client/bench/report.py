"""Turning measurements into a table, a JSON file and a bar chart.

Absolute seconds depend on the machine; what carries over is how far each method sits
from the physical limits measured in the same run on the same bytes. So every row is
also expressed as a ratio: stall ÷ raw pinned copy and durable ÷ raw write + fsync.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .peers import MethodResult
from .synthetic import format_bytes


def environment() -> dict[str, Any]:
    """What the numbers were measured on; without it a JSON file cannot be compared."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    try:
        from importlib.metadata import version

        env["nvidia_resiliency_ext"] = version("nvidia-resiliency-ext")
    except Exception:
        env["nvidia_resiliency_ext"] = None
    return env


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_report(
    results: list[MethodResult], config: dict[str, Any], total_bytes: int
) -> dict[str, Any]:
    """The JSON-able report: config, environment and one row per method."""
    by_name = {r.name: r for r in results}
    copy = by_name.get("raw-copy")
    write = by_name.get("raw-write-fsync")
    copy_s = copy.median("stall_s") if copy else None
    write_s = write.median("durable_s") if write else None
    rows = []
    for r in results:
        stall = r.median("stall_s")
        durable = r.median("durable_s")
        rows.append(
            {
                "method": r.name,
                "kind": r.kind,
                "description": r.description,
                "status": r.status,
                "note": r.note,
                "error": r.error,
                "traceback": r.traceback,
                "repeats": len(r.samples),
                "stall_s": stall,
                "durable_s": durable,
                "stall_gbps": total_bytes / stall / 1e9 if stall else None,
                "durable_gbps": total_bytes / durable / 1e9 if durable else None,
                "stall_vs_raw_copy": _ratio(stall, copy_s),
                "durable_vs_raw_write": _ratio(durable, write_s),
                "first_stall_s": r.first.stall_s if r.first else None,
                "first_durable_s": r.first.durable_s if r.first else None,
                "first": asdict(r.first) if r.first else None,
                "samples": [asdict(s) for s in r.samples],
            }
        )
    return {
        "config": config,
        "environment": environment(),
        "limits": {"raw_copy_s": copy_s, "raw_write_fsync_s": write_s},
        "rows": rows,
    }


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(report: dict[str, Any]) -> str:
    """A fixed-width table for the terminal; errors and notes go underneath, untruncated."""
    cfg = report["config"]
    env = report["environment"]
    head = (
        f"shmstage-bench: {format_bytes(cfg['total_bytes'])} in {cfg['tensors']} {cfg['dtype']} "
        f"tensors on {cfg['device']}"
        + (f" ({env['gpu']})" if env.get("gpu") else "")
        + f", torch {env['torch']}, median of {cfg['repeats']} after a first save"
    )
    cols = [
        ("method", "<", 18),
        ("status", "<", 7),
        ("stall s", ">", 9),
        ("durable s", ">", 9),
        ("GB/s", ">", 7),
        ("÷copy", ">", 7),
        ("÷write", ">", 7),
        ("1st stall", ">", 9),
        ("1st dur.", ">", 9),
    ]
    lines = [head, "  ".join(f"{name:{align}{w}}" for name, align, w in cols)]
    lines.append("-" * len(lines[-1]))
    remarks = []
    for row in report["rows"]:
        cells = [
            row["method"],
            row["status"],
            _fmt(row["stall_s"], ".3f"),
            _fmt(row["durable_s"], ".3f"),
            _fmt(row["stall_gbps"], ".2f"),
            _fmt(row["stall_vs_raw_copy"], ".2f"),
            _fmt(row["durable_vs_raw_write"], ".2f"),
            _fmt(row["first_stall_s"], ".3f"),
            _fmt(row["first_durable_s"], ".3f"),
        ]
        lines.append("  ".join(f"{c:{a}{w}}" for c, (_, a, w) in zip(cells, cols, strict=True)))
        for label in ("error", "note"):
            if row[label]:
                remarks.append(f"  {row['method']}: {label}: {row[label]}")
    if remarks:
        lines.append("")
        lines.extend(remarks)
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str | Path) -> None:
    """Write the report; the parent directory is created if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def write_png(report: dict[str, Any], path: str | Path) -> str:
    """Grouped bars (stall, durable) per method on a log axis; returns a line for the log.

    matplotlib is an optional extra (``shmstage-client[bench]``): without it the chart is
    skipped with one line rather than failing a run whose table and JSON are fine.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: PNG chart skipped (pip install 'shmstage-client[bench]')"

    rows = report["rows"]
    names = [r["method"] for r in rows]
    ys = list(range(len(rows)))
    height = 0.38
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.8))
    stall = [r["stall_s"] or 0 for r in rows]
    durable = [r["durable_s"] or 0 for r in rows]
    ax.barh([y - height / 2 for y in ys], stall, height, label="stall (s)", color="#d62728")
    ax.barh([y + height / 2 for y in ys], durable, height, label="durable (s)", color="#1f77b4")
    positive = [v for v in stall + durable if v > 0]
    if positive:
        ax.set_xscale("log")
        ax.set_xlim(min(positive) / 2, max(positive) * 4)
    for y, r in zip(ys, rows, strict=True):
        if r["status"] != "ok":
            left = min(positive) / 1.9 if positive else 0
            ax.text(left, y, f"  {r['status']}", va="center", fontsize=8, color="gray")
    ax.set_yticks(ys, names)
    ax.invert_yaxis()
    cfg = report["config"]
    env = report["environment"]
    ax.set_title(
        f"{format_bytes(cfg['total_bytes'])}, {cfg['tensors']} {cfg['dtype']} tensors, "
        f"{cfg['device']}{' ' + env['gpu'] if env.get('gpu') else ''}, torch {env['torch']}"
        f" — median of {cfg['repeats']}",
        fontsize=9,
    )
    ax.set_xlabel("seconds (log scale; lower is better)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"chart written to {path}"
