"""``shmstage status / ls / gc / metrics`` as an operator runs them, against a live daemon.

Two trainers are connected; one has a checkpoint held mid-write by the daemon's test-only
fault hook, so "jobs in flight with progress" is observed for real, not timed by luck.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness import RunningDaemon, packages_imported_by, start_daemon
from shmstage_client import Stager

from shmstage import checkpoint, instance, names, segment
from shmstage.manifest import MANIFEST_NAME

WAIT_S = 30.0
#: Long enough for every command below to look at the held job: they take about 1.2 s
#: together on a 2-core machine, so 4 s leaves over three times that; any longer is
#: only waited out by ``held.wait``.
PAUSE_S = 4


def shmstage(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture
def paused_daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    """A daemon whose checkpoints of two or more tensors stop after the first one, PAUSE_S s."""
    daemon = start_daemon(
        tmp_path / "d", env={"SHMSTAGE_FAULT": f"pause-mid-stream:{PAUSE_S}"}
    )
    yield daemon
    if daemon.proc.poll() is None:
        daemon.proc.kill()
        daemon.proc.wait(10)
    for name in segment.list_names(daemon.instance):
        segment.unlink(name)


def fake_dead_instance(segments: int) -> tuple[str, list[str]]:
    """What a SIGKILLed daemon leaves: an unheld lock and named segments."""
    dead = segment.new_instance_id()
    Path(instance.lock_path(dead)).write_text("12345\n")
    return dead, [segment.create(dead, 4096).name for _ in range(segments)]


@pytest.mark.node_wide
def test_status_ls_gc_and_metrics_against_a_live_daemon_with_two_clients(
    paused_daemon: RunningDaemon, ckpt: Path
) -> None:
    daemon = paused_daemon
    sock = str(daemon.socket)
    first = Stager(daemon.socket, slots=1)
    second = Stager(daemon.socket, slots=2)
    try:
        first.save({"w": torch.ones(1 << 16)}, ckpt / "step-100", metadata={"step": 100}).wait(
            WAIT_S
        )
        held = second.save(
            {"a": torch.ones(1 << 18), "b": torch.zeros(1 << 18)},
            ckpt / "step-200",
            metadata={"step": 200},
        )
        daemon.wait_log("fault: pausing at mid-stream", timeout=WAIT_S)

        # -- status --json: the daemon, its budget, both trainers, the held job's progress.
        status = json.loads(shmstage("status", "--json", "--socket", sock).stdout)
        assert status["instance"] == daemon.instance and status["pid"] == daemon.proc.pid
        assert 0 < status["shm_reserved_bytes"] <= status["shm_budget_bytes"]
        trainers = {
            c["id"]: c for c in status["clients"] if c["name"].startswith("shmstage-client")
        }
        assert sorted((c["layouts"], c["segments"]) for c in trainers.values()) == [
            (1, 1),
            (1, 4),
        ]
        assert all(c["pid"] == os.getpid() and c["uid"] == os.getuid() for c in trainers.values())
        (job,) = status["jobs"]
        assert job["bytes"] == 2 << 20 and 0 < job["bytes_written"] < job["bytes"]
        assert job["phase"] == "writing" and job["directory"] == str(ckpt / "step-200")
        assert status["recent"]["saves"] == 1 and status["totals"]["saves"] == 1

        # -- the checkpoints in memory: each layout's newest, live (owner connected).
        memory = {c["job"]: c for c in status["memory"]["checkpoints"]}
        assert memory[1]["directory"] == str(ckpt / "step-100") and memory[1]["durable"]
        assert memory[2]["bytes"] == 2 << 20 and not memory[2]["durable"]
        assert not any(c["retained"] for c in memory.values())

        # -- the table, and --watch with progress bars.
        table = shmstage("status", "--socket", sock).stdout
        assert "CLIENTS (2)" in table and "JOBS IN FLIGHT (1)" in table
        assert "CHECKPOINTS IN MEMORY (2; retention 0 B of" in table
        assert re.search(r"live, writing\s+-\s+0\s+" + re.escape(str(ckpt / "step-200")), table)
        assert str(ckpt / "step-200") in table and "50.0%" in table
        watch = shmstage("status", "--socket", sock, "--watch", "--count", "2", "--interval",
                         "0.1").stdout
        assert watch.count("JOBS IN FLIGHT (1)") == 2
        assert re.search(r"\[#+\.+\]\s+50\.0%", watch)

        # -- ls: the finished checkpoint is complete; the held one is still a hidden
        # pending directory (as are the trainers' spares), which is not a checkpoint.
        listed = {c["path"]: c for c in json.loads(shmstage("ls", str(ckpt), "--json").stdout)}
        assert listed[str(ckpt / "step-100")]["state"] == "complete"
        assert listed[str(ckpt / "step-100")]["step"] == 100
        assert list(listed) == [str(ckpt / "step-100")]
        assert any(names.is_pending_dir(p.name) for p in ckpt.iterdir())

        # -- gc: reaps a dead instance, never the live daemon's segments.
        live_before = sorted(daemon.segments())
        dead, dead_names = fake_dead_instance(3)
        dry = json.loads(shmstage("gc", "--dry-run", "--json").stdout)
        assert set(dead_names) <= set(dry["segments"]) and dry["dry_run"]
        assert all(os.path.exists(segment.SHM_DIR + n) for n in dead_names)
        report = json.loads(shmstage("gc", "--json").stdout)
        assert set(dead_names) <= set(report["segments"]) and dead in report["dead_instances"]
        assert daemon.instance in report["live_instances"]
        assert not any(os.path.exists(segment.SHM_DIR + n) for n in dead_names)
        assert not os.path.exists(instance.lock_path(dead))
        assert sorted(daemon.segments()) == live_before

        # The held checkpoint still completes after gc.
        assert held.wait(WAIT_S).bytes > 2 << 20
        assert checkpoint.verify(ckpt / "step-200") == []

        # -- metrics: Prometheus text with counters and histograms.
        text = shmstage("metrics", "--socket", sock).stdout
        assert 'shmstage_saves_total{result="ok"} 2' in text
        assert "# TYPE shmstage_persist_seconds histogram" in text
        assert "shmstage_stall_seconds_count 2" in text  # reported after save() returned
        assert "shmstage_copy_seconds_count 2" in text
        assert 'shmstage_persist_seconds_bucket{le="+Inf"} 2' in text
        assert "shmstage_clients 3" in text  # two trainers and this command
        sample = re.compile(r"^[a-z_]+(\{[^}]*\})? -?[0-9.e+]+$")
        for line in text.splitlines():
            assert line.startswith("# ") or sample.match(line), line
    finally:
        first.close()
        second.close()

    table = shmstage("ls", str(ckpt)).stdout.splitlines()
    assert table[0].split() == ["STEP", "STATE", "SIZE", "FILES", "COMMITTED", "PATH"]
    assert [row.split()[:2] for row in table[1:]] == [["100", "complete"], ["200", "complete"]]


def test_ls_reports_a_checkpoint_whose_files_do_not_match_its_manifest(
    daemon: RunningDaemon, ckpt: Path
) -> None:
    with Stager(daemon.socket) as stager:
        stager.save({"w": torch.ones(64)}, ckpt / "run" / "good", metadata={"step": 1}).wait(
            WAIT_S
        )
    shutil.copytree(ckpt / "run" / "good", ckpt / "run" / "cut")
    with open(ckpt / "run" / "cut" / "model.safetensors", "r+b") as f:
        f.truncate(10)
    (ckpt / "run" / "empty").mkdir()  # not a checkpoint: not listed
    (ckpt / "other").mkdir()
    (ckpt / "other" / MANIFEST_NAME).write_text("{not json")
    listed = {
        Path(c["path"]).name: c for c in json.loads(shmstage("ls", str(ckpt), "--json").stdout)
    }
    assert sorted(listed) == ["cut", "good", "other"]
    assert listed["good"]["state"] == "complete" and listed["good"]["files"] == 2
    assert listed["cut"]["state"] == "damaged"
    assert "model.safetensors is 10 bytes" in listed["cut"]["problem"]
    assert listed["other"]["state"] == "damaged" and listed["other"]["step"] is None
    table = shmstage("ls", str(ckpt)).stdout.splitlines()
    cut = next(i for i, line in enumerate(table) if line.endswith("run/cut"))
    assert table[cut + 1].lstrip().startswith("damaged: model.safetensors is 10 bytes")


def test_ls_gives_a_damaged_checkpoints_reason_a_line_of_its_own(tmp_path: Path) -> None:
    """The STATE column holds the state only: with the reason in it, one long reason
    stretched the column for every row and the rows wrapped."""
    for name, text in (("a", "{not json"), ("b", "[]"), ("c", '{"format": 1}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / MANIFEST_NAME).write_text(text)
    lines = shmstage("ls", str(tmp_path)).stdout.splitlines()
    header, rows = lines[0], [line for line in lines[1:] if not line.startswith(" ")]
    reasons = [line for line in lines[1:] if line.startswith(" ")]
    assert header.split() == ["STEP", "STATE", "SIZE", "FILES", "COMMITTED", "PATH"]
    assert [row.split()[1] for row in rows] == ["damaged"] * 3
    assert all(len(row) <= len(header) + 2 for row in rows), lines  # nothing stretched
    assert len(reasons) == 3 and all(r.strip().startswith("damaged: ") for r in reasons)
    assert "is not valid JSON" in reasons[0]


def test_commands_that_need_the_daemon_say_so_when_it_is_not_running(tmp_path: Path) -> None:
    for command in ("status", "metrics"):
        out = shmstage(command, "--socket", str(tmp_path / "none.sock"), check=False)
        assert out.returncode == 3
        assert "is shmstaged running?" in out.stderr
    out = shmstage("ls", str(tmp_path / "missing"), check=False)
    assert out.returncode == 2 and "is not a directory" in out.stderr


def test_the_cli_never_imports_torch_or_the_daemon() -> None:
    loaded = packages_imported_by(
        ["shmstage.cli", "shmstage.control", "shmstage.listing", "shmstage.instance"],
        ["torch", "shmstage_daemon", "shmstage_client", "psutil"],
    )
    assert loaded == []


def test_status_json_leaves_out_its_own_connection_and_ends_quietly_on_a_closed_pipe(
    daemon: RunningDaemon,
) -> None:
    status = json.loads(shmstage("status", "--json", "--socket", str(daemon.socket)).stdout)
    assert status["clients"] == []  # nobody but this command is connected
    piped = subprocess.run(
        f"{sys.executable} -m shmstage.cli status --json --socket {daemon.socket} | head -1",
        shell=True, capture_output=True, text=True, timeout=60,
    )
    assert piped.stdout.strip() == "{"
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, piped.stderr


def test_gc_says_what_a_dead_daemons_journal_keeps_and_why(tmp_path: Path) -> None:
    dead = segment.new_instance_id()
    journal = tmp_path / "shmstaged.sock.journal"
    journal.mkdir()
    (journal / f"{dead}.7.job").write_bytes(b"owed")
    Path(instance.lock_path(dead)).write_text(f"12345\njournal={journal}\n")
    held = [segment.create(dead, 1 << 20) for _ in range(2)]
    try:
        out = shmstage("gc").stdout
        assert f"kept: shared memory of dead instance {dead}" in out, out
        owes = f"its journal {journal} still owes 1 acknowledged checkpoint(s) ({dead}.7.job)"
        assert owes in out
        assert "kept in all: " in out
        report = json.loads(shmstage("gc", "--json").stdout)
        # Other dead daemons on this machine may be held too: this one's entry is exact.
        assert {"instance": dead, "journal": str(journal), "owed_jobs": [f"{dead}.7.job"]} in (
            report["held"]
        )
        assert report["held_segments"] >= 2 and report["held_bytes"] >= 2 << 20
        assert all(os.path.exists(segment.SHM_DIR + ref.name) for ref in held)
        # Temporary files are left alone while a journal owes checkpoints.
        swept = shmstage("gc", "--checkpoints", str(tmp_path)).stdout
        assert "none removed while a dead daemon's journal owes checkpoints" in swept
    finally:
        for ref in held:
            segment.unlink(ref.name)
        os.unlink(instance.lock_path(dead))


def test_status_lists_real_errors_not_loads_that_found_nothing_in_memory(
    daemon: RunningDaemon, ckpt: Path
) -> None:
    """An ordinary ``load(path)`` of a checkpoint the daemon no longer holds is answered
    not_retained and reads the files: no error of anyone's. It is counted in the metrics
    (leases_total{result="not_retained"}), and RECENT ERRORS keeps the real ones."""
    from shmstage_client import load

    with Stager(daemon.socket) as stager:  # closed: its layout is released, not retained
        stager.save({"w": torch.ones(4)}, ckpt / "a").wait(WAIT_S)
    for _ in range(3):
        assert load(ckpt / "a", socket=daemon.socket, with_info=True).source == "files"
    with Stager(daemon.socket, slots=9) as stager, pytest.raises(Exception, match="slots"):
        stager.save({"w": torch.ones(4)}, ckpt / "b").wait(WAIT_S)  # a real error
    status = json.loads(shmstage("status", "--json", "--socket", str(daemon.socket)).stdout)
    assert [e["code"] for e in status["errors"]] and all(
        e["code"] != "not_retained" for e in status["errors"]
    ), status["errors"]
    assert "not_retained" not in shmstage("status", "--socket", str(daemon.socket)).stdout
    metrics = shmstage("metrics", "--socket", str(daemon.socket)).stdout
    assert 'shmstage_leases_total{result="not_retained"} 3' in metrics, metrics
