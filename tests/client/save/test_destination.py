"""Where a save goes: a new directory appears only once complete; the next save's pending
directory is made in the background, so a slow filesystem stalls only the first save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from client_helpers import SlowFilesystem
from harness import assert_same
from shmstage_client import CheckpointExists, DestinationError, SaveError, Stager, load

from shmstage import checkpoint, names
from shmstage.manifest import MANIFEST_NAME


def pending(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if names.is_pending_dir(p.name))


def state(step: int) -> dict:
    return {"w": torch.full((1024,), float(step)), "step": step}


def test_a_new_directory_appears_only_once_the_checkpoint_is_complete(module_daemon, ckpt) -> None:
    with Stager(module_daemon.socket) as stager:
        handle = stager.save(state(1), ckpt / "step-1")
        result = handle.wait(60)
        assert sorted(os.listdir(ckpt / "step-1")) == ["model.safetensors", MANIFEST_NAME]
        # After the save, the next one's pending directory waits beside it, held by the
        # client (see shmstage.names: the lock tells a cleaner it is in use).
        assert stager._spares.ready(30)
        (spare,) = pending(ckpt)
        made = os.listdir(ckpt / spare)  # its two temporary files, data and manifest
        assert len(made) == 2 and all(names.is_temp(name) for name in made)
        fd = os.open(ckpt / spare, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert names.is_held(fd) is True
        finally:
            os.close(fd)
        stager.save(state(2), ckpt / "step-2").wait(60)  # takes the spare...
        assert spare not in pending(ckpt)  # ...which became step-2
        assert stager._spares.ready(30)
    assert pending(ckpt) == []  # close() removed the last spare
    assert sorted(os.listdir(ckpt)) == ["step-1", "step-2"]
    assert result.files == ("model.safetensors", MANIFEST_NAME)
    for step in (1, 2):
        assert_same(load(ckpt / f"step-{step}"), state(step))


def test_a_slow_filesystem_stalls_only_the_first_save(
    module_daemon, ckpt, slow_filesystem: SlowFilesystem
) -> None:
    """Every mkdir and create costs 0.4 s (a simulated slow NFS server, see conftest). The
    first save pays for its directory and files; from the second on, the Stager made them
    in the background, and save() makes no filesystem round trip on the caller's thread."""
    delay = slow_filesystem.delay
    main = threading.current_thread().name
    with Stager(module_daemon.socket) as stager:
        first = stager.save(state(0), ckpt / "step-0")
        assert first.stall_seconds >= 3 * delay  # mkdir + two creates, on this thread
        assert first.timings.setup_seconds >= 3 * delay
        assert slow_filesystem.on(main) == ["mkdir", "create", "create"]
        handles = [first]
        for step in range(1, 4):
            assert stager._spares.ready(30)  # training steps pass between saves
            handles.append(stager.save(state(step), ckpt / f"step-{step}"))
            # No round trip on this thread: the destination costs next to nothing. (The
            # whole stall is bounded loosely: the commit waits for the daemon's journal,
            # which in this test lives on a disk the suite keeps busy.)
            assert slow_filesystem.on(main) == ["mkdir", "create", "create"]  # none since
            assert handles[-1].timings.setup_seconds < delay / 4, handles[-1].timings
            assert handles[-1].stall_seconds < 3 * delay, handles[-1].timings
        # Elsewhere (a new parent): no spare there, so this save pays once more.
        elsewhere = stager.save(state(9), ckpt / "other" / "step-9")
        assert elsewhere.stall_seconds >= 3 * delay
        for handle in (*handles, elsewhere):
            handle.wait(60)
    assert {name for _, name in slow_filesystem.calls} == {main, "shmstage-background_0"}
    for step in range(4):
        assert_same(load(ckpt / f"step-{step}"), state(step))
    assert_same(load(ckpt / "other" / "step-9"), state(9))


def test_files_go_into_an_existing_directory_as_before(module_daemon, ckpt) -> None:
    (ckpt / "made-first").mkdir()
    (ckpt / "made-first" / "notes.txt").write_text("kept")
    with Stager(module_daemon.socket) as stager:
        stager.save(state(3), ckpt / "made-first").wait(60)
        with pytest.raises(CheckpointExists, match="never overwrites"):
            stager.save(state(4), ckpt / "made-first")
    assert sorted(os.listdir(ckpt / "made-first")) == [
        "model.safetensors",
        "notes.txt",
        MANIFEST_NAME,
    ]
    assert_same(load(ckpt / "made-first"), state(3))


def test_a_spare_that_no_longer_fits_is_not_used(module_daemon, ckpt, tmp_path: Path) -> None:
    """The parent path now leads elsewhere (a symlink switched, as ``latest`` links are):
    the spare in the old directory is dropped, and the save goes where the path leads."""
    (tmp_path / "run-a").mkdir()
    (tmp_path / "run-b").mkdir()
    os.symlink(tmp_path / "run-a", ckpt / "run")
    with Stager(module_daemon.socket) as stager:
        stager.save(state(1), ckpt / "run" / "s1").wait(60)
        assert stager._spares.ready(30)
        (ckpt / "run").unlink()
        os.symlink(tmp_path / "run-b", ckpt / "run")
        stager.save(state(2), ckpt / "run" / "s2").wait(60)
        # The spare made in run-a is removed in the background; one waits in run-b now.
        assert stager._spares.ready(30)
    assert sorted(os.listdir(tmp_path / "run-a")) == ["s1"]
    assert sorted(os.listdir(tmp_path / "run-b")) == ["s2"]
    assert_same(load(tmp_path / "run-b" / "s2"), state(2))


def test_missing_parents_are_made_and_a_failed_save_removes_them(module_daemon, ckpt) -> None:
    with Stager(module_daemon.socket, slots=1, wait_for_slot=False) as stager:
        stager.save(state(1), ckpt / "a" / "b" / "c").wait(60)
        held = stager.stage(state(2))  # the only slot: the next save is refused
        with pytest.raises(SaveError):
            stager.save(state(2), ckpt / "x" / "y" / "z")
        held.cancel()
    assert sorted(os.listdir(ckpt)) == ["a"]  # x/y, made for the refused save, went with it
    assert_same(load(ckpt / "a" / "b" / "c"), state(1))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_text("x"), "is a regular file, not a directory"),
        (lambda p: os.symlink(p.parent / "nowhere", p), "is a symlink to nothing"),
        (lambda p: os.mkfifo(p), "is a named pipe, not a directory"),
    ],
)
def test_a_destination_that_is_not_a_directory_says_what_it_is(
    module_daemon, ckpt, make, message: str
) -> None:
    make(ckpt / "c")
    with (
        Stager(module_daemon.socket) as stager,
        pytest.raises(DestinationError, match=message) as info,
    ):
        stager.save(state(1), ckpt / "c")
    assert "nothing was written" in str(info.value)
    assert sorted(os.listdir(ckpt)) == ["c"]


def test_an_empty_path_is_a_clear_error(module_daemon) -> None:
    with Stager(module_daemon.socket) as stager:
        with pytest.raises(DestinationError, match="the checkpoint path is empty"):
            stager.save(state(1), "")
        staged = stager.stage(state(1))
        with pytest.raises(DestinationError, match="the checkpoint path is empty"):
            staged.commit("")
        assert not staged.open  # the slot went back


def test_a_final_name_that_appears_meanwhile_fails_the_save_and_is_left_alone(
    tmp_path: Path, ckpt
) -> None:
    """Someone creates the destination while the job streams: publishing refuses to
    replace it (``exists``), and removes only what the job made."""
    from harness import start_daemon

    from shmstage import segment

    daemon = start_daemon(tmp_path / "d", env={"SHMSTAGE_FAULT": "pause-mid-stream:3"})
    try:
        with Stager(daemon.socket) as stager:
            handle = stager.save({"a": torch.ones(64), "b": torch.ones(64)}, ckpt / "c")
            daemon.wait_log("fault: pausing at mid-stream")
            (ckpt / "c").mkdir()
            (ckpt / "c" / "theirs").write_text("someone else's")
            with pytest.raises(SaveError, match="appeared while the checkpoint was written"):
                handle.wait(60)
        assert os.listdir(ckpt / "c") == ["theirs"]
        assert pending(ckpt) == []
    finally:
        daemon.kill()
        for name in segment.list_names(daemon.instance):
            segment.unlink(name)


def test_ls_does_not_take_a_pending_directory_for_a_checkpoint(module_daemon, ckpt) -> None:
    with Stager(module_daemon.socket) as stager:
        stager.save(state(5), ckpt / "step-5", metadata={"step": 5}).wait(60)
        assert stager._spares.ready(30)
        assert len(pending(ckpt)) == 1
        listed = subprocess.run(
            [sys.executable, "-m", "shmstage.cli", "ls", str(ckpt), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert listed.returncode == 0, listed.stderr
    assert [c["path"] for c in json.loads(listed.stdout)] == [str(ckpt / "step-5")]
    assert checkpoint.verify(ckpt / "step-5") == []


def test_close_waits_for_a_spare_still_being_made_and_removes_it(
    module_daemon, ckpt, slow_filesystem: SlowFilesystem
) -> None:
    stager = Stager(module_daemon.socket)
    stager.save(state(1), ckpt / "s1").wait(60)
    started = time.monotonic()
    stager.close()  # the spare's mkdir and creates take 1.5 s in the background
    assert time.monotonic() - started >= slow_filesystem.delay
    assert sorted(os.listdir(ckpt)) == ["s1"]


def test_a_trainer_that_exits_without_close_leaves_no_pending_directory(
    module_daemon, ckpt
) -> None:
    """The README's one-liner saves and exits without close(): the spare made for its next
    save is removed at exit, not left as a hidden directory of two empty files."""
    script = (
        "import torch\n"
        "from shmstage_client import Stager\n"
        f"Stager({str(module_daemon.socket)!r}).save({{'w': torch.ones(4)}}, {str(ckpt / 'c')!r})"
        ".wait(60)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(os.listdir(ckpt)) == ["c"]
    assert_same(load(ckpt / "c"), {"w": torch.ones(4)})


def _shared(path: Path, mode: int, uid: int = 0) -> Path:
    path.mkdir()
    path.chmod(mode)
    os.chown(path, uid, -1)
    return path


def test_a_save_refuses_a_directory_another_user_could_change_and_says_the_fix(
    module_daemon, ckpt
) -> None:
    """Whoever may rename entries where a checkpoint lands can swap it for their own: a
    group root without the sticky bit (2770), a world-writable directory saved into, a
    directory of another user — refused, naming it, its mode or owner, and the fix; a
    sticky one (as /tmp) is fine."""
    if os.geteuid() != 0:
        pytest.skip("directories of another owner need root")
    nobody = 65534
    group_root, world = _shared(ckpt / "group-root", 0o2770), _shared(ckpt / "open", 0o777)
    theirs, loose = _shared(ckpt / "theirs", 0o755, nobody), _shared(ckpt / "loose", 0o777)
    cases = [  # where the directory is, where the save goes, what the refusal says
        (group_root, group_root / "step-1", "mode 2770", "chmod +t"),
        (world, world / "step-1", "mode 777", "chmod +t"),
        (theirs, theirs / "step-1", "belongs to uid 65534", "directory of your own"),
        (loose, loose, "the existing directory saved into", "chmod +t"),
    ]
    with Stager(module_daemon.socket) as stager:
        for directory, into, said, fix in cases:
            with pytest.raises(DestinationError) as refused:
                stager.save(state(1), into)
            assert str(directory) in str(refused.value) and said in str(refused.value)
            assert fix in str(refused.value) and "nothing was written" in str(refused.value)
            assert os.listdir(directory) == []
        sticky = _shared(ckpt / "sticky", 0o3770)  # the fix: only owners rename entries
        stager.save(state(2), sticky / "step-2").wait(60)
        old_umask = os.umask(0o002)  # a group-friendly umask: the checkpoint stays ours
        try:
            stager.save(state(3), ckpt / "step-3").wait(60)
        finally:
            os.umask(old_umask)
    assert (ckpt / "step-3").stat().st_mode & 0o022 == 0
    assert_same(load(sticky / "step-2"), state(2))
