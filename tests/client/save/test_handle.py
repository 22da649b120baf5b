"""What a save reports it cost: the wall-clock stall of save() on the caller's thread, and
its parts — on the handle, the result, the progress events, the daemon's log and metrics."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import pytest
import torch
from client_helpers import SlowFilesystem
from harness import start_daemon
from shmstage_client import SaveEvent, Stager
from shmstage_client.save.handle import WRITE_PHASES, _write_phases

from shmstage import packing, segment
from shmstage.control import ControlClient

PARTS = ("prepare", "setup", "slot_wait", "copy", "commit")


def test_stall_seconds_is_the_wall_clock_time_of_save(daemon, ckpt: Path) -> None:
    events: list[SaveEvent] = []
    gaps = []
    handles = []
    with Stager(daemon.socket, progress=events.append) as stager:
        for step in range(8):
            state = {"w": torch.full((1 << 16,), float(step)), "step": step}
            started = time.perf_counter()
            handle = stager.save(state, ckpt / f"step-{step}")
            wall = time.perf_counter() - started
            t = handle.timings
            assert handle.stall_seconds == t.stall_seconds <= wall
            gaps.append(wall - t.stall_seconds)
            # The parts are laps inside the stall; stage_seconds is the deprecated copy.
            assert sum(getattr(t, f"{part}_seconds") for part in PARTS) <= t.stall_seconds
            assert all(getattr(t, f"{part}_seconds") >= 0 for part in PARTS)
            assert t.stage_seconds == t.copy_seconds > 0
            handles.append(handle)
            assert stager._spares.ready(30)  # between saves, as training steps would be
        results = [handle.wait(60) for handle in handles]
    # Within 5 ms: what a user timing save() sees is what the handle says.
    assert statistics.median(gaps) < 0.005, gaps
    assert max(gaps) < 0.05, gaps  # a loaded machine may preempt the odd save
    assert [r.timings for r in results] == [h.timings for h in handles]
    assert all(r.stall_seconds == r.timings.stall_seconds for r in results)
    staged = [e for e in events if e.phase == "staged"]
    durable = [e for e in events if e.phase == "durable"]
    assert [e.timings for e in staged] == [h.timings for h in handles]
    assert sorted(e.stall_seconds for e in durable) == sorted(h.stall_seconds for h in handles)


def test_a_two_phase_save_stalls_for_its_stage_and_its_commit(daemon, ckpt: Path) -> None:
    """``Staged.timings`` is the stage() call's; the handle adds the commit() call's."""
    with Stager(daemon.socket) as stager:
        started = time.perf_counter()
        staged = stager.stage({"w": torch.ones(1 << 16)})
        stage_wall = time.perf_counter() - started
        # The stall is the whole call: nothing but returning lies outside it (0.25 s of slack
        # for a loaded CI machine, whose scheduler once took 60 ms there).
        assert staged.stall_seconds <= stage_wall < staged.stall_seconds + 0.25
        assert staged.timings.commit_seconds == 0
        started = time.perf_counter()
        handle = staged.commit(ckpt / "c")
        commit_wall = time.perf_counter() - started
        t = handle.timings
        assert t.copy_seconds == staged.copy_seconds
        assert t.slot_wait_seconds == staged.slot_wait_seconds
        assert t.commit_seconds > 0 and t.setup_seconds > staged.setup_seconds
        assert staged.stall_seconds < t.stall_seconds <= stage_wall + commit_wall
        assert t.stall_seconds > stage_wall + commit_wall - 0.25
        handle.wait(60)


def test_the_daemon_logs_and_measures_the_wall_clock_stall_not_the_copy(
    tmp_path: Path, ckpt: Path, slow_filesystem: SlowFilesystem
) -> None:
    """A slow destination (simulated, see conftest) makes the stall much longer than the
    copy: the daemon's job line and its stall histogram must show the stall. The report
    comes after save() returned; the job is held mid-stream so it is there to log it."""
    daemon = start_daemon(tmp_path / "d", env={"SHMSTAGE_FAULT": "pause-mid-stream:3"})
    try:
        with Stager(daemon.socket) as stager:
            handle = stager.save({"a": torch.ones(256), "b": torch.ones(256)}, ckpt / "c")
            t = handle.timings
            assert t.stall_seconds >= 3 * slow_filesystem.delay > 10 * t.copy_seconds
            handle.wait(60)
        line = next(line for line in daemon.log().splitlines() if f"job {handle.job}: " in line)
        assert f"trainer stall {t.stall_seconds:.3f} s (copy {t.copy_seconds:.3f} s" in line
        with ControlClient(daemon.socket) as control:
            metrics = control.metrics()
        (stall,) = metrics["shmstage_stall_seconds"]["series"]
        (copy,) = metrics["shmstage_copy_seconds"]["series"]
        assert stall[1]["count"] == 1 and stall[1]["sum"] == pytest.approx(t.stall_seconds)
        assert copy[1]["count"] == 1 and copy[1]["sum"] == pytest.approx(t.copy_seconds)
    finally:
        daemon.kill()
        for name in segment.list_names(daemon.instance):
            segment.unlink(name)


def test_a_result_splits_the_daemons_persist_time(daemon, ckpt: Path) -> None:
    """The writer gathering, waiting on the disk, syncing, publishing: each non-negative,
    together within ``persist_seconds`` (which also counts the job's start), and the same
    figures in the daemon's line for the job."""
    state = {f"w{i}": torch.full((1024 + i,), float(i)) for i in range(200)}
    with Stager(daemon.socket) as stager:
        handle = stager.save(state, ckpt / "c")
        result = handle.wait(60)
    parts = [getattr(result, name) for name in WRITE_PHASES]
    assert all(part >= 0 for part in parts), parts
    assert result.gather_seconds > 0 and result.publish_seconds > 0, parts
    assert sum(parts) <= result.persist_seconds + 1e-6
    line = next(
        line
        for line in daemon.log().splitlines()
        if f"job {handle.job}: " in line and "written" in line
    )
    assert (
        f"gather {result.gather_seconds:.3f} s, disk wait {result.disk_wait_seconds:.3f} s" in line
    )


def test_the_daemon_logs_what_a_registration_cost(daemon, ckpt: Path) -> None:
    """Per registration: its segments, how long the client waited for the answer, and what
    of that went into making the segments (an operator's view of a first save's daemon
    part) — within the client's own setup time."""
    state = {f"w{i}": torch.ones(64 + i) for i in range(300)}  # packed: one shared segment
    with Stager(daemon.socket) as stager:
        handle = stager.save(state, ckpt / "c")
        handle.wait(60)
    line = next(line for line in daemon.log().splitlines() if "registered layout" in line)
    found = re.search(
        r"300 tensors x 1 slot\(s\) in (\d+) segments, \d+ bytes, "
        r"in ([\d.]+) s \(making segments ([\d.]+) s\)",
        line,
    )
    assert found is not None, line
    segments, answered, making = int(found[1]), float(found[2]), float(found[3])
    assert segments == len(packing.Packing.of([4 * (64 + i) for i in range(300)])) == 1
    assert 0 <= making <= answered <= handle.timings.setup_seconds + 0.001


def test_write_phases_from_the_daemon_are_taken_only_when_plausible() -> None:
    """A daemon that does not report them, or reports nonsense, leaves the fields at 0."""
    assert _write_phases(None) == {}
    assert _write_phases({"gather_seconds": 1, "disk_wait_seconds": 0.5}) == {
        "gather_seconds": 1.0,
        "disk_wait_seconds": 0.5,
    }
    junk = {"gather_seconds": True, "sync_seconds": -1.0, "publish_seconds": "2", "rm": 1.0}
    assert _write_phases(junk) == {}


def test_a_report_of_a_job_that_is_not_the_clients_is_ignored(raw_client) -> None:
    """The report is never answered; one naming a job this client did not commit changes
    no metric, and the session lives on."""
    raw = raw_client()
    raw.request("report", {"job": 99, "stall_seconds": 5.0})
    raw.request("metrics", {})
    frame = raw.frame()
    assert frame.op == "metrics"
    assert frame.body["metrics"]["shmstage_stall_seconds"]["series"][0][1]["count"] == 0
