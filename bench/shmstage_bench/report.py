"""Turning measurements into text, a JSON file and a chart — whatever the measurements were.

Absolute seconds depend on the machine; what carries over is how far each row sits from the
physical limits measured in the same run on the same bytes, so tables carry ratios beside
the seconds. A report is a few tables (columns, rows, which columns to chart) plus the
config, the environment and the daemon it talked to; every scenario fills the same shape,
so one formatter and one chart drawer serve them all. Drawing never raises: the report is
the bench's product, and a failed chart is a line in the output, not a lost run.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Column:
    """``fmt``: a format spec for numbers, or "ms" (seconds shown in ms), "MiB" (bytes),
    "x" (a ratio), "yes" (a bool) or "" (text)."""

    key: str
    header: str
    fmt: str = ".3f"
    width: int = 9


@dataclass
class Table:
    name: str
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]] = field(default_factory=list)
    chart: list[str] = field(default_factory=list)  # keys of second-valued columns
    notes: list[str] = field(default_factory=list)


def environment() -> dict[str, Any]:
    """What the numbers were measured on; without it a JSON file cannot be compared."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "kernel": platform.release(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():  # the parent never creates a CUDA context for this
        env["gpu"] = torch.cuda.get_device_name()
    for dist in (
        "nvidia-resiliency-ext",
        "dlrover",
        "ml-flashpoint",
        "shmstage-client",
        "safetensors",
    ):
        try:
            from importlib.metadata import version

            env[dist.replace("-", "_")] = version(dist)
        except Exception:
            env[dist.replace("-", "_")] = None
    return env


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_report(
    scenario: str,
    config: dict[str, Any],
    tables: list[Table],
    *,
    daemon: dict[str, Any] | None,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """The JSON-able report."""
    return {
        "scenario": scenario,
        "config": config,
        "environment": environment(),
        "daemon": daemon,
        "notes": notes or [],
        "tables": [
            {
                "name": t.name,
                "title": t.title,
                "columns": [asdict(c) for c in t.columns],
                "chart": t.chart,
                "notes": t.notes,
                "rows": t.rows,
            }
            for t in tables
        ],
    }


def table(report: dict[str, Any], name: str) -> dict[str, Any]:
    """One table of a report by name."""
    for t in report["tables"]:
        if t["name"] == name:
            return t
    raise KeyError(
        f"no table {name!r} in the report (have {[t['name'] for t in report['tables']]})"
    )


def rows_by_name(report: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in table(report, name)["rows"]}


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "":
        return str(value)
    if fmt == "yes":
        return "yes" if value else "NO"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if fmt == "ms":
        return f"{value * 1e3:.1f}"
    if fmt == "MiB":
        return f"{value / (1 << 20):.0f}"
    if fmt == "x":
        return f"{value:.2f}"
    return format(value, fmt)


def _header(report: dict[str, Any]) -> str:
    cfg, env = report["config"], report["environment"]
    what = cfg.get("what") or ""
    gpu = f" ({env['gpu']})" if env.get("gpu") else ""
    return (
        f"shmstage-bench --scenario {report['scenario']}: {what}; {cfg.get('device', '?')}"
        f"{gpu}, torch {env['torch']}"
    )


def format_text(report: dict[str, Any]) -> str:
    """Fixed-width tables for the terminal; errors and notes underneath, untruncated."""
    lines = [_header(report)]
    daemon = report.get("daemon") or {}
    if daemon.get("description"):
        lines.append(daemon["description"])
    for t in report["tables"]:
        cols = [Column(**c) for c in t["columns"]]
        lines += ["", t["title"]]
        first = max(len(r["name"]) for r in t["rows"]) if t["rows"] else 8
        first = max(first, 6)
        head = f"{'':<{first}}  " + "  ".join(f"{c.header:>{c.width}}" for c in cols)
        lines += [head, "-" * len(head)]
        remarks = []
        for r in t["rows"]:
            cells = [_cell(r.get(c.key), c.fmt) for c in cols]
            lines.append(
                f"{r['name']:<{first}}  "
                + "  ".join(f"{cell:>{c.width}}" for cell, c in zip(cells, cols, strict=True))
            )
            for label in ("error", "note"):
                if r.get(label):
                    remarks.append(f"  {r['name']}: {label}: {r[label]}")
        lines += remarks
        lines += [f"  {n}" for n in t["notes"]]
    if report.get("notes"):
        lines.append("")
        lines += report["notes"]
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str | Path) -> None:
    """Write the report; the parent directory is created if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")


def write_png(report: dict[str, Any], path: str | Path) -> str:
    """One horizontal bar chart per table that has charted columns; returns a line for the log.

    The bench's distribution depends on matplotlib, but a run from a source tree (as
    ``scripts/gpu-check.sh`` does) may lack it: then the chart is skipped with one line
    rather than failing a run whose text and JSON are fine.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: PNG chart skipped (pip install matplotlib)"
    try:
        charted = [t for t in report["tables"] if t["chart"] and t["rows"]]
        if not charted:
            return "nothing to chart: PNG skipped"
        heights = [0.45 * len(t["rows"]) * max(1, len(t["chart"])) ** 0.5 + 1.4 for t in charted]
        fig, axes = plt.subplots(
            len(charted), 1, figsize=(11, sum(heights)), gridspec_kw={"height_ratios": heights}
        )
        axes = [axes] if len(charted) == 1 else list(axes)
        for ax, t in zip(axes, charted, strict=True):
            _draw(ax, t)
        fig.suptitle(_header(report), fontsize=9)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return f"chart written to {path}"
    except Exception as exc:  # the text and JSON are already out; say why no chart
        return f"PNG chart failed: {type(exc).__name__}: {exc}"


_COLORS = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def _draw(ax: Any, t: dict[str, Any]) -> None:
    """Grouped bars of the charted second-valued columns, on a log axis."""
    rows, keys = t["rows"], t["chart"]
    headers = {c["key"]: c["header"] for c in t["columns"]}
    height = 0.8 / len(keys)
    values = [[r.get(k) or 0 for r in rows] for k in keys]
    for i, (key, vals) in enumerate(zip(keys, values, strict=True)):
        ys = [y - 0.4 + height * (i + 0.5) for y in range(len(rows))]
        ax.barh(ys, vals, height, label=f"{headers.get(key, key)}", color=_COLORS[i % 6])
    positive = [v for vals in values for v in vals if isinstance(v, int | float) and v > 0]
    if positive:
        ax.set_xscale("log")
        ax.set_xlim(min(positive) / 2, max(positive) * 4)
    for y, r in enumerate(rows):
        if r.get("status", "ok") != "ok":
            left = min(positive) / 1.9 if positive else 0
            ax.text(left, y, f"  {r['status']}", va="center", fontsize=8, color="gray")
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_title(t["title"], fontsize=9)
    ax.set_xlabel("seconds (log scale; lower is better)", fontsize=8)
    ax.legend(loc="lower right", fontsize=7)
