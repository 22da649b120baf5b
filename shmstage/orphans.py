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
(its creator may not have locked it yet), and nothing a journal names is removed, whether
its daemon is alive or dead (``Owed``): after a crash the temporary files of acknowledged
jobs are unlocked until the next daemon reopens them, and only that daemon may decide
about them. The journals are read for each file while the sweep holds its lock, right
before the removal, never once up front: a daemon may die at any moment of a sweep.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import msgpack

from shmstage import instance, names

#: Default age below which a temporary file is never touched.
MIN_AGE_S: Final = 600.0
#: A journal directory (``shmstage_daemon.journal.journal_dir``), wherever its root is.
_JOURNAL_DIR: Final = re.compile(r"^shmstage\.([0-9a-f]{16})\.journal$")
#: The fields of a journal entry that name files (``shmstage_daemon.journal.Entry``): the
#: data file, the manifest, and the pending directory of a save to a new directory.
_ENTRY_FILES: Final = ("data_id", "manifest_id", "pending_id")
#: As the daemon's journal: a larger entry is not one it wrote, and it drops it.
_MAX_ENTRY_BYTES: Final = 256 * 1024 * 1024
#: Acknowledged entries, and those written before the acknowledgement (kept to be safe).
_ENTRY_SUFFIXES: Final = (
    instance.JOURNAL_SUFFIX,
    instance.JOURNAL_SUFFIX + instance.PENDING_SUFFIX,
)

FileId = tuple[int, int]  # (st_dev, st_ino)


@dataclass
class Swept:
    """What a sweep removed (or, dry, would remove) and what it left, and why."""

    removed: list[str] = field(default_factory=list)
    bytes: int = 0
    live: int = 0  # locked: a trainer or a daemon still owns them
    young: int = 0
    other_uid: int = 0
    owed: int = 0  # unlocked, but a journal still owes them (or may: see ``Owed``)

    def to_json(self) -> dict[str, object]:
        return {
            "removed": sorted(self.removed),
            "bytes": self.bytes,
            "left_live": self.live,
            "left_young": self.young,
            "left_other_uid": self.other_uid,
            "left_owed": self.owed,
        }


class Owed:
    """Whether any daemon's journal, live or dead, names a file: asked for each file the
    sweep is about to remove, while it holds that file's lock.

    Why that is enough, however a daemon's death and the sweep interleave: a daemon writes
    a job's entry before it acknowledges the job, and holds the job's files (their lock)
    from the commit until the job ends. Once the sweep holds a file's lock no live daemon
    holds it, so an entry naming it was written already and is still there to be read.

    A journal that cannot be read (another user's daemon's, a non-root ``gc``) does not owe
    the file if its daemon is alive now, by the same argument; if its daemon is dead, it
    might, and the file stays. Entries are read once each (their names are never reused)."""

    def __init__(self) -> None:
        self._entries: dict[str, frozenset[FileId]] = {}

    def names(self, st: os.stat_result) -> bool:
        identity = (st.st_dev, st.st_ino)
        locks = instance.locks()
        for journal, owner in _journals(locks).items():
            files = self._read(journal)
            if files is None:
                info = locks.get(owner)
                if info is not None and info.held:
                    continue
                return True
            if identity in files:
                return True
        return False

    def _read(self, journal: str) -> frozenset[FileId] | None:
        """The files the entries in ``journal`` name; None when it cannot be read."""
        try:
            fd = os.open(journal, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return frozenset()
        except OSError:
            return None
        try:
            found: set[FileId] = set()
            for name in os.listdir(fd):
                if not name.endswith(_ENTRY_SUFFIXES):
                    continue
                key = os.path.join(journal, name)
                if key not in self._entries:
                    files = _entry_files(fd, name)
                    if files is None:
                        return None
                    self._entries[key] = files
                found |= self._entries[key]
            return frozenset(found)
        except OSError:
            return None
        finally:
            os.close(fd)


def _journals(locks: dict[str, instance.LockInfo | None]) -> dict[str, str]:
    """Every journal directory that may hold entries, and the instance it belongs to: those
    the instance locks name, and any other in their roots and in /dev/shm (a successor
    finishing its predecessor's jobs has reaped the predecessor's lock already)."""
    found = {
        os.path.normpath(info.journal): owner
        for owner, info in locks.items()
        if info is not None and info.journal
    }
    roots = {os.path.dirname(path) for path in found} | {instance.LOCK_DIR}
    for root in roots:
        try:
            listed = os.listdir(root)
        except OSError:
            continue
        for name in listed:
            match = _JOURNAL_DIR.match(name)
            if match:
                found.setdefault(os.path.normpath(os.path.join(root, name)), match.group(1))
    return found


def _entry_files(dir_fd: int, name: str) -> frozenset[FileId] | None:
    """The files one journal entry names; None when it cannot be read. An entry the daemon
    could never load (not a regular file, too large, undecodable) owes nothing: the daemon
    drops it too."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:  # finished meanwhile
        return frozenset()
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_ENTRY_BYTES:
            return frozenset()
        data = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        entry = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types
        return frozenset()
    if not isinstance(entry, dict):
        return frozenset()
    files = set()
    for key in _ENTRY_FILES:
        value = entry.get(key)
        if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
            files.add((value[0], value[1]))
    return frozenset(files)


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
    owed = Owed()
    now = time.time()
    pending: list[tuple[Path, str]] = []
    for directory, name in _candidates(roots, max_depth, pending):
        _consider(directory, name, report, owed, only_uid, dry_run, now - min_age)
    # Then the pending directories (a save's, or a spare a dead trainer prepared): once
    # their files are gone, an empty one nobody holds goes too; deepest first.
    emptied = {str(Path(path).parent) for path in report.removed}
    for directory, name in reversed(pending):
        cutoff = math.inf if str(directory / name) in emptied else now - min_age
        _consider(directory, name, report, owed, only_uid, dry_run, cutoff, is_dir=True)
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
    owed: Owed,
    only_uid: int | None,
    dry_run: bool,
    cutoff: float,
    *,
    is_dir: bool = False,
) -> None:
    """Remove ``directory/name`` if it is an orphan: a regular temporary file or (with
    ``is_dir``) an empty pending directory, owned as required, older than ``cutoff``,
    held by nobody, and named by no journal (asked while we hold its lock)."""
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
            if owed.names(st):
                report.owed += 1
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
