"""Process faults: real SIGKILLs of the trainer and of the daemon at the moments that matter.

Where the moment is microseconds wide in a healthy daemon (mid-stream, between the last
data file and the commit marker, inside layout registration), the daemon is started with
the test-only ``SHMSTAGE_FAULT`` hook (``shmstage_daemon.faults``), which pauses the
daemon's own thread at that point and logs it; the test waits for that log line and then
delivers a real SIGKILL inside the window. ``mid-stream`` is "after the first tensor", so
the earlier checkpoints these tests keep use one-tensor states that never reach it; for the
other points ``@n`` picks the job to hold.

In every case: no torn checkpoint is visible, earlier checkpoints verify, the next daemon
start leaves no segment (or lock) of the dead instance behind, and a client of a killed
daemon gets an error quickly.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from fault_helpers import (
    assert_checkpoint_equals,
    assert_not_published,
    assert_not_torn,
    assert_same_state,
    instance_clean,
    journal_entries,
    kill,
    make_state,
    pending_dirs,
    read_marker,
    single_tensor_state,
    start_trainer,
)
from harness import wait_for
from shmstage_client import SaveError, Stager, load

from shmstage import checkpoint, names, segment
from shmstage.manifest import MANIFEST_NAME

PAUSE = "60"  # longer than any test waits: the SIGKILL, not the pause, ends the window
DATA = "model.safetensors"


# -- the trainer dies ------------------------------------------------------------------


def test_a_trainer_killed_during_the_copy_leaves_nothing(daemons, tmp_path: Path) -> None:
    daemon = daemons()
    trainer = start_trainer(daemon.socket, tmp_path, "copy", 1)
    read_marker(trainer, "BASE")
    read_marker(trainer, "COPYING")  # slot FILLING, half of it copied
    assert len(daemon.segments()) > 0
    kill(trainer)
    # Its session ends, the slot it held is dropped, its segments are unlinked.
    wait_for(lambda: daemon.segments() == [], 10, "the dead trainer's segments to go")
    # Its commit, sent ahead of the copy, was only journaled pending; that entry goes too.
    wait_for(lambda: journal_entries(daemon) == [], 10, "the pending entry to go")
    # And the daemon, which had its descriptors, removed the pending directory and the
    # temporary files the trainer made for it (the trainer could not).
    wait_for(lambda: pending_dirs(tmp_path) == [], 10, "the dead save's pending directory")
    assert not (tmp_path / "victim").exists()
    assert_checkpoint_equals(tmp_path / "base", single_tensor_state(1))
    with Stager(daemon.socket) as stager:  # the daemon serves on
        stager.save(make_state(5), tmp_path / "after").wait(60)
    assert_checkpoint_equals(tmp_path / "after", make_state(5))


@pytest.mark.parametrize("mode", ["commit", "wait"])
def test_a_trainer_killed_after_commit_still_gets_its_checkpoint(
    daemons, tmp_path: Path, mode: str
) -> None:
    """(b) killed after commit, before the data is durable; (c) killed while it waits for
    durability. The daemon owns the data from the commit on, so the checkpoint completes."""
    daemon = daemons(env={"SHMSTAGE_FAULT": "pause-mid-stream:2"})
    trainer = start_trainer(daemon.socket, tmp_path, mode, 2)
    read_marker(trainer, "BASE")
    read_marker(trainer, "COMMITTED" if mode == "commit" else "WAITING")
    daemon.wait_log("fault: pausing at mid-stream")  # the job is not durable yet
    assert not checkpoint.is_complete(tmp_path / "victim")
    kill(trainer)
    wait_for(lambda: checkpoint.is_complete(tmp_path / "victim"), 30, "the checkpoint")
    assert_checkpoint_equals(tmp_path / "victim", make_state(2))  # not the -1s written after
    assert_checkpoint_equals(tmp_path / "base", single_tensor_state(2))
    assert_retained(daemon, tmp_path / "victim", make_state(2))
    assert journal_entries(daemon) == []


def test_a_trainer_killed_while_waiting_for_a_slot(daemons, tmp_path: Path) -> None:
    """(c) blocked acquiring the only slot while the previous checkpoint persists."""
    daemon = daemons(env={"SHMSTAGE_FAULT": "pause-mid-stream:3"})
    trainer = start_trainer(daemon.socket, tmp_path, "slot-wait", 3)
    read_marker(trainer, "BASE")
    read_marker(trainer, "ACQUIRING")
    daemon.wait_log("fault: pausing at mid-stream")
    time.sleep(0.5)  # let it reach the blocking acquire (the slot stays busy for seconds)
    kill(trainer)
    wait_for(lambda: checkpoint.is_complete(tmp_path / "victim"), 30, "the first checkpoint")
    assert_checkpoint_equals(tmp_path / "victim", make_state(3))
    assert_not_published(tmp_path / "victim2")
    assert_retained(daemon, tmp_path / "victim", make_state(3))
    with Stager(daemon.socket) as stager:
        stager.save(single_tensor_state(4), tmp_path / "after").wait(60)


def assert_retained(daemon, path: Path, state: object) -> None:
    """The dead trainer's layout is kept for a restart (``retention``), holding its newest
    checkpoint: restorable from memory, bit-exact; its TTL and budget bound it (see
    ``test_restore_faults``)."""
    restored = load(path, with_info=True, socket=daemon.socket)
    assert restored.source == "memory", restored.reason
    assert_same_state(restored.state, state)


# -- the daemon dies -------------------------------------------------------------------


@pytest.mark.node_wide
def test_daemon_killed_during_registration(daemons, tmp_path: Path) -> None:
    """(d) SIGKILL while the daemon creates a layout's segments: the client hears it at
    once, nothing is published, and the next start reaps the half-made layout."""
    daemon = daemons(env={"SHMSTAGE_FAULT": f"pause-register:{PAUSE}"})
    stager = Stager(daemon.socket)
    outcome: list[BaseException | None] = []

    def save() -> None:
        try:
            stager.save(make_state(6), tmp_path / "victim")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=save)
    thread.start()
    daemon.wait_log("fault: pausing at register")
    assert len(daemon.segments()) >= 1
    killed_at = time.monotonic()
    daemon.kill()
    thread.join(15)
    assert not thread.is_alive(), "save() hung on a dead daemon"
    assert isinstance(outcome[0], SaveError), outcome
    assert time.monotonic() - killed_at < 10
    # The client removed what it made: the pending directory and its temporary files.
    assert not (tmp_path / "victim").exists() and pending_dirs(tmp_path) == []
    stager.close(timeout=1)
    assert len(daemon.segments()) >= 1  # SIGKILL left them
    restarted = daemons()
    assert instance_clean(daemon.instance)
    with Stager(restarted.socket) as fresh:
        fresh.save(make_state(6), tmp_path / "again").wait(60)
    assert_checkpoint_equals(tmp_path / "again", make_state(6))


def test_a_save_whose_daemon_dies_during_the_copy_leaves_nothing(daemons, tmp_path: Path) -> None:
    """The daemon is SIGKILLed while the trainer copies (its commit already sent): save()
    raises, and the trainer removes the pending directory and files it made."""
    daemon = daemons()
    stager = Stager(daemon.socket)
    stager.save(single_tensor_state(11), tmp_path / "base").wait(60)
    copy = stager._copier.copy

    def killed_meanwhile(*args: object, **kwargs: object) -> None:
        daemon.kill()
        copy(*args, **kwargs)

    stager._copier.copy = killed_meanwhile  # type: ignore[method-assign]
    with pytest.raises(SaveError):
        stager.save(make_state(11), tmp_path / "victim")
    stager.close(timeout=1)
    assert not (tmp_path / "victim").exists() and pending_dirs(tmp_path) == []
    assert_checkpoint_equals(tmp_path / "base", single_tensor_state(11))


@pytest.mark.parametrize("first_start", ["successor", "bystander"])
def test_daemon_killed_while_a_commit_waits_for_its_copy(
    daemons, tmp_path: Path, first_start: str
) -> None:
    """save() sends its commit ahead of the copy; the daemon journals it only pending. A
    daemon killed before the client says "ready" owes nothing: the next start drops the
    pending entry and reaps the segments, and nothing is ever published — also when a
    daemon on another socket (a bystander) starts first and reaps the dead one's lock."""
    daemon = daemons()
    trainer = start_trainer(daemon.socket, tmp_path, "copy", 8)
    read_marker(trainer, "BASE")
    read_marker(trainer, "COPYING")  # the commit went out before the copy began
    wait_for(lambda: journal_entries(daemon), 10, "the commit to be journaled pending")
    pending = journal_entries(daemon)
    # Written under its temporary name: not owed, and no reaper holds segments for it.
    assert len(pending) == 1 and pending[0].startswith(".") and pending[0].endswith(".tmp")
    daemon.kill()
    if first_start == "bystander":
        daemons(where=tmp_path / "other")
    restarted = daemons()
    assert journal_entries(restarted) == [] == journal_entries(daemon)
    assert instance_clean(daemon.instance)
    kill(trainer)
    assert_not_published(tmp_path / "victim")
    assert_checkpoint_equals(tmp_path / "base", single_tensor_state(8))


# The earlier one-tensor save never reaches "mid-stream", but does reach "before-manifest".
@pytest.mark.parametrize(("point", "nth"), [("mid-stream", 1), ("before-manifest", 2)])
def test_an_acknowledged_checkpoint_survives_a_daemon_sigkill(
    daemons, tmp_path: Path, point: str, nth: int
) -> None:
    """(e) SIGKILL mid-stream and (f) between the last data file and the commit marker.

    The commit was acknowledged, so the journal has it and its segments outlive the daemon;
    the restarted daemon finishes it before reaping, bit for bit what was staged — though
    the trainer overwrote its tensors right after save() returned.
    """
    daemon = daemons(env={"SHMSTAGE_FAULT": f"pause-{point}:{PAUSE}@{nth}"})
    stager = Stager(daemon.socket)
    stager.save(single_tensor_state(7), tmp_path / "earlier").wait(60)
    state = make_state(7)
    handle = stager.save(state, tmp_path / "victim")
    for tensor in state["layers"]:
        tensor.zero_()
    daemon.wait_log(f"fault: pausing at {point}")
    assert len(journal_entries(daemon)) == 1
    victim = tmp_path / "victim"
    # A new directory is written as a hidden pending one, published only once complete.
    assert not victim.exists()
    if point == "before-manifest":  # the data file is complete under its final name...
        (written,) = [d for d in pending_dirs(tmp_path) if (tmp_path / d / DATA).exists()]
        assert not (tmp_path / written / MANIFEST_NAME).exists()  # ...but nothing is committed
    killed_at = time.monotonic()
    daemon.kill()
    with pytest.raises(SaveError):
        handle.wait(10)
    assert time.monotonic() - killed_at < 10, "the client took too long to notice"
    stager.close(timeout=1)
    assert_not_torn(victim)
    assert daemon.segments(), "the acknowledged job's segments must outlive the daemon"

    restarted = daemons()
    wait_for(lambda: checkpoint.is_complete(victim), 30, "the restarted daemon to finish it")
    assert_checkpoint_equals(victim, make_state(7))
    assert_checkpoint_equals(tmp_path / "earlier", single_tensor_state(7))
    wait_for(lambda: instance_clean(daemon.instance), 10, "the dead instance to be reaped")
    assert journal_entries(restarted) == [] == journal_entries(daemon)
    assert f"finished job 2 of instance {daemon.instance}" in restarted.log()
    assert not [p for p in victim.iterdir() if p.name.startswith(".")], "temporaries left"
    with Stager(restarted.socket) as fresh:  # a new Stager works against the new daemon
        fresh.save(make_state(8), tmp_path / "next").wait(60)
    assert_checkpoint_equals(tmp_path / "next", make_state(8))


def test_a_stop_that_times_out_leaves_the_job_to_the_next_start(daemons, tmp_path: Path) -> None:
    """SIGTERM with a job stuck past --shutdown-timeout: the job is neither abandoned nor
    its segments unlinked; when the stuck process is finally SIGKILLed, the next daemon
    finishes the checkpoint from the journal."""
    daemon = daemons("--shutdown-timeout", "1", env={"SHMSTAGE_FAULT": f"pause-mid-stream:{PAUSE}"})
    with Stager(daemon.socket) as stager:
        stager.save(make_state(9), tmp_path / "victim")
        daemon.wait_log("fault: pausing at mid-stream")
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.wait_log("did not finish within")
        stager.close(timeout=1)
    assert daemon.segments(), "segments of the unfinished job were unlinked"
    daemon.kill()  # what systemd does after TimeoutStopSec
    daemons()
    wait_for(lambda: checkpoint.is_complete(tmp_path / "victim"), 30, "the checkpoint")
    assert_checkpoint_equals(tmp_path / "victim", make_state(9))
    wait_for(lambda: instance_clean(daemon.instance), 10, "the dead instance to be reaped")


def big_state() -> dict:
    """256 MiB in 4 tensors: writing and fsyncing it takes far longer than a 0 s timeout."""
    return {
        "layers": [torch.full((16 << 20,), float(i)) for i in range(4)],
        "tail": torch.arange(1 << 16, dtype=torch.int64),
    }


def test_a_stop_past_its_timeout_keeps_the_checkpoint_for_the_next_start(
    daemons, tmp_path: Path
) -> None:
    """The real path, no fault hook: SIGTERM while a real 256 MiB write runs and a shutdown
    timeout of 0 s. The writer is told to stop and leaves its temporary files; the daemon
    exits cleanly and keeps the segments and the journal entry; the next start on the same
    socket publishes the checkpoint bit-exact."""
    daemon = daemons("--shutdown-timeout", "0")
    expected = big_state()
    with Stager(daemon.socket) as stager:
        stager.save(big_state(), tmp_path / "victim")  # acknowledged: the daemon owes it
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(60) == 0
        stager.close(timeout=1)
    log = daemon.log()
    assert "did not finish within 0 s; stopping their writers" in log, log
    assert "stopped while writing" in log or "stopped before the checkpoint" in log, log
    assert not (tmp_path / "victim").exists()  # a new directory: still pending
    (pending,) = pending_dirs(tmp_path)  # the job's (close() removed the Stager's spare)
    temps = [p.name for p in (tmp_path / pending).iterdir() if names.is_temp(p.name)]
    assert len(temps) == 2, f"the job's temporary files were removed: {temps}"
    assert daemon.segments(), "the owed job's segments were unlinked"
    assert journal_entries(daemon), "the journal entry was dropped"
    successor = daemons()
    wait_for(lambda: checkpoint.is_complete(tmp_path / "victim"), 60, "the checkpoint")
    assert_checkpoint_equals(tmp_path / "victim", expected)
    assert "finished job" in successor.log() or "after a restart" in successor.log()
    wait_for(lambda: instance_clean(daemon.instance), 10, "the dead instance to be reaped")


@pytest.mark.node_wide
def test_other_daemons_never_reap_what_a_journal_still_owes(daemons, tmp_path: Path) -> None:
    """A daemon on another socket starting while the killed one is down must leave the
    owed job's segments alone; the killed daemon's successor then finishes the job."""
    first = daemons(env={"SHMSTAGE_FAULT": f"pause-before-manifest:{PAUSE}"})
    stager = Stager(first.socket)
    stager.save(make_state(10), tmp_path / "victim")
    first.wait_log("fault: pausing at before-manifest")
    first.kill()
    stager.close(timeout=1)
    owed = first.segments()
    bystander = daemons(where=tmp_path / "other")
    assert "reaped" not in bystander.log()
    assert first.segments() == owed
    daemons()  # the successor on the first socket
    wait_for(lambda: checkpoint.is_complete(tmp_path / "victim"), 30, "the checkpoint")
    assert_checkpoint_equals(tmp_path / "victim", make_state(10))
    wait_for(lambda: instance_clean(first.instance), 10, "the dead instance to be reaped")
    assert segment.list_names(bystander.instance) == []
