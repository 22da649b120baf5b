"""``shmstage gc --checkpoints``: orphaned temporary files go, anything alive stays.

A temporary file is alive while someone holds a shared flock on it (the saving trainer,
and the daemon once the descriptor travelled with the commit). The tests hold such locks
the way the client does, on a descriptor of their own.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

from shmstage import names, orphans


def temp_file(directory: Path, *, age: float = 3600.0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / names.temp_name("model.safetensors")
    path.write_bytes(b"x" * 4096)
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_an_unlocked_old_temporary_file_is_removed(tmp_path: Path) -> None:
    orphan = temp_file(tmp_path / "run" / "step-1")
    report = orphans.sweep([tmp_path], only_uid=None)
    assert report.removed == [str(orphan)] and report.bytes >= 4096
    assert not orphan.exists()


def test_a_locked_one_stays_whoever_holds_the_lock(tmp_path: Path) -> None:
    alive = temp_file(tmp_path / "step-2")
    fd = os.open(alive, os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # as the client does right after creating it
    try:
        report = orphans.sweep([tmp_path], only_uid=None)
        assert report.removed == [] and report.live == 1
        assert alive.exists()
    finally:
        os.close(fd)


def test_a_young_one_stays_and_dry_run_removes_nothing(tmp_path: Path) -> None:
    young = temp_file(tmp_path / "a", age=0)
    old = temp_file(tmp_path / "b")
    report = orphans.sweep([tmp_path], only_uid=None, dry_run=True)
    assert report.removed == [str(old)] and report.young == 1
    assert young.exists() and old.exists()


def test_only_the_callers_own_files_unless_root(tmp_path: Path) -> None:
    theirs = temp_file(tmp_path / "c")
    report = orphans.sweep([tmp_path], only_uid=os.getuid() + 12345)
    assert report.removed == [] and report.other_uid == 1 and theirs.exists()


def test_a_fifo_under_a_temporary_name_neither_blocks_nor_goes(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    fifo = tmp_path / "d" / names.temp_name("model.safetensors")
    os.mkfifo(fifo)
    done = threading.Event()
    result: list[orphans.Swept] = []
    worker = threading.Thread(
        target=lambda: (result.append(orphans.sweep([tmp_path], only_uid=None)), done.set())
    )
    worker.start()
    assert done.wait(10), "the sweep blocked on a FIFO"
    assert result[0].removed == [] and fifo.exists()


def test_symlinked_directories_are_not_followed(tmp_path: Path) -> None:
    outside = temp_file(tmp_path / "outside")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path / "outside")
    report = orphans.sweep([tmp_path / "root"], only_uid=None)
    assert report.removed == [] and outside.exists()


def test_an_orphaned_pending_directory_goes_with_its_files_a_held_one_stays(
    tmp_path: Path,
) -> None:
    """A dead trainer's spare (or a dropped save's) pending directory: its files go, then
    the empty directory; one a live trainer holds (shared flock on the directory) stays."""
    orphan = tmp_path / names.pending_dir_name()
    temp_file(orphan)
    old = time.time() - 3600
    os.utime(orphan, (old, old))
    alive = tmp_path / names.pending_dir_name()
    alive.mkdir()
    os.utime(alive, (old, old))
    fd = os.open(alive, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        report = orphans.sweep([tmp_path], only_uid=None)
        assert not orphan.exists() and str(orphan) in report.removed
        assert alive.exists() and report.live == 1
    finally:
        os.close(fd)


def test_a_file_stays_while_a_dead_daemons_journal_cannot_be_read_but_not_a_live_ones(
    tmp_path: Path,
) -> None:
    """A journal ``gc`` may not read (here its path is a symlink, which is never followed;
    for a non-root ``gc``, a root daemon's private directory) might name any file: the file
    stays unless that journal's daemon is alive now — a live daemon holds the files it owes,
    and ``gc`` holds this one's lock."""
    from shmstage import instance

    lock = instance.InstanceLock.claim(journal_root=str(tmp_path / "journals"))
    (tmp_path / "journals").mkdir()
    (tmp_path / "elsewhere").mkdir()
    Path(instance.journal_dir(str(tmp_path / "journals"), lock.instance)).symlink_to(
        tmp_path / "elsewhere"
    )
    try:
        first = temp_file(tmp_path / "run" / "a")
        assert orphans.sweep([tmp_path / "run"], only_uid=None).removed == [str(first)]
        os.close(lock.fd)  # the daemon dies (its lock file stays, unheld)
        second = temp_file(tmp_path / "run" / "b")
        report = orphans.sweep([tmp_path / "run"], only_uid=None)
        assert report.removed == [] and report.owed == 1 and second.exists()
    finally:
        os.unlink(instance.lock_path(lock.instance))
