"""Smoke test of ``shmstage-bench``: every method yields a row, at a size CI can afford.

Speed is not checked here (CI machines are noisy and have no GPU); what is checked is
that the harness drives every method end to end — including a real ``shmstaged`` that it
starts and stops itself — and writes a complete JSON report, so that a broken peer API or
client change shows up as a failing test rather than a silently missing row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shmstage_client.bench.peers import METHOD_NAMES
from shmstage_client.bench.synthetic import build_state_dict, parse_size, tensor_sizes

REPO = Path(__file__).resolve().parents[2]


def test_parse_size_units() -> None:
    assert parse_size("4MiB") == 4 << 20
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("4 parsecs")


def test_sizes_sum_exactly_and_are_deterministic() -> None:
    sizes = tensor_sizes(parse_size("64MiB"), 50, 4096, parse_size("16MiB"), seed=3)
    assert sum(sizes) == 64 << 20
    assert len(sizes) == 50
    assert all(s % 64 == 0 and s > 0 for s in sizes)
    assert sizes == tensor_sizes(parse_size("64MiB"), 50, 4096, parse_size("16MiB"), seed=3)
    sd = build_state_dict(1 << 20, 8, 4096, 1 << 18, seed=1)
    again = build_state_dict(1 << 20, 8, 4096, 1 << 18, seed=1)
    assert sum(t.numel() * t.element_size() for t in sd.values()) == 1 << 20
    assert all((a == b).all() for a, b in zip(sd.values(), again.values(), strict=True))


def test_bench_smoke_every_row_present(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    env = dict(os.environ)
    paths = [str(REPO / "client"), str(REPO / "daemon"), str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "shmstage_client.bench",
        "--device", "cpu", "--total-bytes", "4MiB", "--tensors", "8",
        "--min-tensor-bytes", "4KiB", "--max-tensor-bytes", "2MiB",
        "--repeats", "1", "--dir", str(tmp_path / "ckpt"),
        "--json", str(out), "--png", str(png), "--quiet",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert sorted(rows) == sorted(METHOD_NAMES)
    assert report["config"]["total_bytes"] == 4 << 20
    assert report["config"]["tensors"] == 8
    problems = {}
    for name, row in rows.items():
        # nvidia-resiliency-ext is GPU-only and not installed in CI: a skip is its result.
        expected = {"ok", "skipped"} if name.startswith("nvrx-") else {"ok"}
        if row["status"] not in expected:
            problems[name] = (row["status"], row["error"], row["traceback"])
            continue
        if row["status"] == "ok":
            assert row["repeats"] == 1, name
            assert row["stall_s"] is not None or row["durable_s"] is not None, name
    assert not problems, problems
    for name in ("torch-save", "dcp-save", "dcp-async", "dcp-async-stager", "shmstage-steady"):
        assert rows[name]["stall_s"] > 0 and rows[name]["durable_s"] >= rows[name]["stall_s"]
    assert rows["raw-copy"]["stall_vs_raw_copy"] == pytest.approx(1.0)
    assert rows["raw-write-fsync"]["durable_vs_raw_write"] == pytest.approx(1.0)
    assert png.exists() or "PNG chart skipped" in proc.stdout
    for name in METHOD_NAMES:
        assert name in proc.stdout
    # Every checkpoint was deleted once durable: the bench leaves no data behind.
    leftovers = list((tmp_path / "ckpt").iterdir()) if (tmp_path / "ckpt").exists() else []
    assert leftovers == []
