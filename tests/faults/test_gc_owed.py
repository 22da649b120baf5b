"""``shmstage gc --checkpoints`` never removes what a journal owes, however the timing falls.

An acknowledged job's temporary files are locked by the daemon's descriptors; when the
daemon dies they are unlocked until its successor reopens them from the journal. A sweep
that decided once, before it started, that no dead daemon owed anything, then removed
whatever it found unlocked, lost the checkpoint of a daemon that died during the sweep.

The moment is real here: a real daemon, paused by the test-only ``SHMSTAGE_FAULT`` hook in
the middle of writing a real trainer's acknowledged save (the trainer SIGKILLed, so only
the daemon holds the files), is SIGKILLed at a chosen point of a real sweep. To land the
kill at that point the sweep's per-file step is wrapped (``monkeypatch`` on
``orphans._consider``, the one hook here): a daemon cannot otherwise be made to die
between two files of a sweep deterministically.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from fault_helpers import (
    assert_checkpoint_equals,
    journal_entries,
    kill,
    make_state,
    pending_dirs,
    read_marker,
    start_trainer,
    writing_dir,
)
from harness import wait_for

from shmstage import checkpoint, names, orphans

PAUSE = "60"  # longer than any test waits: the SIGKILL, not the pause, ends the window


def temporaries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if names.is_temp(p.name))


@pytest.mark.parametrize("when", ["before-the-sweep", "at-the-first-file"])
def test_a_daemon_killed_during_gc_keeps_its_owed_checkpoint(
    daemons, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    daemon = daemons(env={"SHMSTAGE_FAULT": f"pause-mid-stream:{PAUSE}"})
    trainer = start_trainer(daemon.socket, tmp_path, "commit", 4)
    read_marker(trainer, "BASE")
    read_marker(trainer, "COMMITTED")
    daemon.wait_log("fault: pausing at mid-stream")
    kill(trainer)  # from here only the daemon holds the job's temporary files
    assert len(journal_entries(daemon)) == 1
    owed = temporaries(writing_dir(tmp_path))
    assert owed, "the paused job has temporary files"
    # The dead trainer's spare pending directory is nobody's, and so is this old file:
    # the sweep must still remove them. The spare is prepared in the background after a
    # commit, so the SIGKILL may have found it still empty: it is listed by name, not only
    # as the parent of its temporary files.
    spare = [p for p in temporaries(tmp_path) if p not in owed]
    spare_dirs = [tmp_path / name for name in pending_dirs(tmp_path)]
    spare_dirs.remove(owed[0].parent)
    orphan = tmp_path / "old" / names.temp_name("model.safetensors")
    orphan.parent.mkdir()
    orphan.write_bytes(b"x")
    then = time.time() - 3600
    os.utime(orphan, (then, then))

    consider = orphans._consider
    calls = []

    def daemon_dies_first(*args: object, **kwargs: object) -> None:
        if not calls:
            daemon.kill()  # SIGKILL: its descriptors, and so its locks, are gone
        calls.append(args)
        consider(*args, **kwargs)

    if when == "before-the-sweep":
        daemon.kill()
    else:
        monkeypatch.setattr(orphans, "_consider", daemon_dies_first)
    swept = orphans.sweep([tmp_path], only_uid=None, min_age=0)

    assert all(p.exists() for p in owed), f"removed what the journal owes: {swept.removed}"
    nobodys = [*spare, orphan, *spare_dirs]
    assert sorted(swept.removed) == sorted(map(str, nobodys))
    assert swept.owed == len(owed)
    restarted = daemons()
    wait_for(lambda: checkpoint.is_complete(tmp_path / "victim"), 30, "the successor")
    assert_checkpoint_equals(tmp_path / "victim", make_state(4))
    assert journal_entries(restarted) == []
