"""Temporary files of saves that will never finish, and how ``shmstage gc`` removes them.

A save creates hidden temporary files (``names.temp_name``), for a new checkpoint inside a
hidden pending directory (``names.pending_dir_name``) beside it.
Normally the daemon turns them into the checkpoint or removes them. A trainer killed before
its commit reached the daemon, or a daemon that gave up a job it could not even reopen,
leaves them behind, where nothing else would ever clean them.

Telling an orphan from a live save needs no registry: the client takes a shared ``flock``
on each temporary file right after creating it, on its own descriptor. The lock belongs to
the open file description, which the daemon shares once the descriptor travels with the
commit, so it is held exactly as long as the trainer or the daemon may still write the
file. A file on which ``LOCK_EX | LOCK_NB`` succeeds is nobody's.

Two more rules keep ``gc`` from racing anyone: a file younger than ``min_age`` is left
(its creator may not have locked it yet), and nothing is removed while any dead daemon's
journal still owes a checkpoint (``instance.reap`` reports those as ``held``): after a
crash the temporary files of acknowledged jobs are unlocked until the next daemon
reopens them, and only that daemon may decide about them.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from shmstage import names

#: Default age below which a temporary file is never touched.
MIN_AGE_S: Final = 600.0


@dataclass
class Swept:
    """What a sweep removed (or, dry, would remove) and what it left, and why."""

    removed: list[str] = field(default_factory=list)
    bytes: int = 0
    live: int = 0  # locked: a trainer or a daemon still owns them
    young: int = 0
    other_uid: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "removed": sorted(self.removed),
            "bytes": self.bytes,
            "left_live": self.live,
            "left_young": self.young,
            "left_other_uid": self.other_uid,
        }


def sweep(
    roots: list[Path],
    *,
    only_uid: int | None,
    dry_run: bool = False,
    min_age: float = MIN_AGE_S,
    max_depth: int = 4,
) -> Swept:
    """Remove orphaned temporary files below ``roots`` (symlinks never followed).

    ``only_uid``: touch only that uid's files (a non-root operator); None: anyone's (root).
    """
    report = Swept()
    now = time.time()
    pending: list[tuple[Path, str]] = []
    for directory, name in _candidates(roots, max_depth, pending):
        _consider(directory, name, report, only_uid, dry_run, now - min_age)
    # Then the pending directories (a save's, or a spare a dead trainer prepared): once
    # their files are gone, an empty one nobody holds goes too; deepest first.
    emptied = {str(Path(path).parent) for path in report.removed}
    for directory, name in reversed(pending):
        cutoff = math.inf if str(directory / name) in emptied else now - min_age
        _consider(directory, name, report, only_uid, dry_run, cutoff, is_dir=True)
    return report


def _candidates(
    roots: list[Path], max_depth: int, pending: list[tuple[Path, str]]
) -> Iterator[tuple[Path, str]]:
    """Temporary files below ``roots``; pending directories are appended to ``pending``."""
    for root in roots:
        stack = [(root, 0)]
        while stack:
            directory, depth = stack.pop()
            try:
                with os.scandir(directory) as it:
                    entries = list(it)
            except OSError:
                continue
            for entry in entries:
                if names.is_temp(entry.name):
                    yield directory, entry.name
                elif depth < max_depth and entry.is_dir(follow_symlinks=False):
                    if names.is_pending_dir(entry.name):
                        pending.append((directory, entry.name))
                    stack.append((Path(entry.path), depth + 1))


def _consider(
    directory: Path,
    name: str,
    report: Swept,
    only_uid: int | None,
    dry_run: bool,
    cutoff: float,
    *,
    is_dir: bool = False,
) -> None:
    """Remove ``directory/name`` if it is an orphan: a regular temporary file or (with
    ``is_dir``) an empty pending directory, owned as required, older than ``cutoff``,
    and held by nobody."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        # O_NONBLOCK: a FIFO planted under a temporary name must not block the sweep.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if not (stat.S_ISDIR if is_dir else stat.S_ISREG)(st.st_mode):
                return
            if is_dir and os.listdir(fd):
                return  # something of someone's is still in it
            if only_uid is not None and st.st_uid != only_uid:
                report.other_uid += 1
                return
            if st.st_mtime > cutoff:
                report.young += 1
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                report.live += 1
                return
            if not dry_run and not _remove_if_same(dir_fd, name, st, is_dir):
                return
            report.removed.append(str(directory / name))
            report.bytes += st.st_blocks * 512
        finally:
            os.close(fd)  # drops our lock, after the name is gone
    finally:
        os.close(dir_fd)


def _remove_if_same(dir_fd: int, name: str, st: os.stat_result, is_dir: bool) -> bool:
    """Remove ``name`` only while it still names what we locked (rmdir: only if empty)."""
    with contextlib.suppress(OSError):
        named = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino):
            (os.rmdir if is_dir else os.unlink)(name, dir_fd=dir_fd)
            return True
    return False
