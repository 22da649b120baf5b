"""Daemon instances: each live daemon holds a lock; segments of dead instances are reaped.

A SIGKILLed daemon leaves named segments in /dev/shm; in a container the next start would
find /dev/shm full and crash-loop. Every instance therefore holds an exclusive flock on
``/dev/shm/shmstage.<instance>.lock`` for its whole life. Segments of an instance whose lock
nobody holds are garbage — never a live daemon's.

With one exception: a daemon killed after acknowledging a commit still owes that checkpoint,
and the segments holding its bytes are all that is left of it. The daemon journals such jobs
(``shmstage_daemon.journal``) in a directory of its own, one ``<instance>.<job>.job`` file
each, and names that directory and its socket in its lock file. A reaper holds back every
segment of a dead instance whose journal still lists a job of that instance; the daemon that
serves the same socket next finds that journal through the lock (``predecessors``),
finishes those jobs and then reaps them itself.

This lives in the core, not the daemon, because two programs apply the same rule: the
daemon reaps at start, and the operator's ``shmstage gc`` reaps on demand without the
daemon package (or a running daemon) being present.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Final

from shmstage import segment

_LOCK = re.compile(r"^shmstage\.([0-9a-f]{16})\.lock$")
LOCK_DIR: Final = segment.SHM_DIR
#: Journal entries are ``<instance>.<job>`` plus this suffix; reapers only list names.
JOURNAL_SUFFIX: Final = ".job"
#: An entry written before its commit was acknowledged is ``.<entry name>`` plus this: it
#: owes nothing, and whoever finds it dead removes it.
PENDING_SUFFIX: Final = ".tmp"
_JOURNAL_KEY: Final = "journal="
_SOCKET_KEY: Final = "socket="


def lock_path(instance: str) -> str:
    return os.path.join(LOCK_DIR, f"shmstage.{instance}.lock")


def journal_dir(root: str, instance: str) -> str:
    """An instance's journal directory under ``root``: private, and named unguessably."""
    return os.path.join(root, f"shmstage.{instance}.journal")


@dataclass
class InstanceLock:
    instance: str
    fd: int

    @classmethod
    def claim(cls, journal_root: str | None = None, socket: str | None = None) -> InstanceLock:
        """Create the lock already held, so no reaper ever sees it unlocked.

        ``journal_root``: where this instance journals acknowledged jobs (its directory is
        ``journal_dir(journal_root, instance)``); recorded in the lock with the ``socket``
        it serves, so that reapers leave the segments of jobs it still owes alone and the
        next daemon on that socket finds the journal.
        """
        instance = segment.new_instance_id()
        tmp = os.path.join(LOCK_DIR, f".shmstage.{instance}.lock.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            content = f"{os.getpid()}\n"
            if journal_root:
                content += f"{_JOURNAL_KEY}{journal_dir(journal_root, instance)}\n"
            if socket:
                content += f"{_SOCKET_KEY}{socket}\n"
            os.write(fd, content.encode())
            os.rename(tmp, lock_path(instance))
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        return cls(instance, fd)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path(self.instance))
        os.close(self.fd)


@dataclass(frozen=True, slots=True)
class LockInfo:
    """What a lock file says, read without trusting it: who owns it, whether a live daemon
    holds it, and which journal it names."""

    uid: int
    held: bool
    journal: str | None
    socket: str | None = None


def read_lock(path: str) -> LockInfo | None:
    """The lock at ``path``, or None when there is none (gone, or not a regular file).

    /dev/shm is world-writable, so any local user can plant a FIFO, a symlink or a file of
    their own under a lock's name. The lock is opened ``O_NONBLOCK | O_NOFOLLOW`` (a FIFO
    must not block the daemon's start or ``shmstage gc``) and checked with ``fstat`` before
    anything is read; callers only believe a lock owned by the uid whose segments it
    concerns. One we may not open is another user's daemon's: live, never touched.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except PermissionError:
        return LockInfo(-1, True, None)
    except OSError:  # gone, a symlink (ELOOP), ...
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = True
        else:
            held = False
        text = os.read(fd, 8192).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and value:
            fields[key + sep] = value
    return LockInfo(st.st_uid, held, fields.get(_JOURNAL_KEY), fields.get(_SOCKET_KEY))


def predecessors(socket: str, uid: int) -> list[tuple[str, str]]:
    """``(instance, journal)`` of every dead instance of ``uid`` that served ``socket``.

    Only locks that ``uid`` owns count: another user cannot hand this daemon a journal.
    """
    found = []
    for instance, path in _locks():
        info = read_lock(path)
        if info is None or info.held or info.uid != uid:
            continue
        if info.socket == socket and info.journal:
            found.append((instance, info.journal))
    return found


def locks() -> dict[str, LockInfo | None]:
    """Every instance's lock as it reads now (None: gone, or not a lock at all)."""
    return {instance: read_lock(path) for instance, path in _locks()}


def live_instances() -> set[str]:
    """Instances whose lock is held right now."""
    live = set()
    for instance, path in _locks():
        info = read_lock(path)
        if info is not None and info.held:
            live.add(instance)
    return live


def journal_of(lock: str) -> str | None:
    """The journal directory a lock file names, if any (older locks name none)."""
    info = read_lock(lock)
    return None if info is None else info.journal


def owes_jobs(journal: str, instance: str) -> bool:
    """Whether ``journal`` still lists an acknowledged job of ``instance``.

    Only names are listed — no entry is parsed — so a reaper cannot be confused by an
    entry's contents. A journal that cannot be read counts as owing: when unsure, keep.
    """
    return owed_jobs(journal, instance) != []


def owed_jobs(journal: str, instance: str) -> list[str]:
    """The names of ``instance``'s entries in ``journal`` (``["?"]`` if it cannot be read)."""
    try:
        entries = os.listdir(journal)
    except FileNotFoundError:
        return []
    except OSError:
        return ["?"]
    suffix = JOURNAL_SUFFIX
    return sorted(e for e in entries if e.startswith(f"{instance}.") and e.endswith(suffix))


def _drop_unacknowledged(journal: str, instance: str, uid: int) -> None:
    """Remove a dead instance's pending entries (``.<instance>.<job>.job.tmp``): commits it
    never acknowledged, which its successor would drop too. Whoever reaps the lock does
    it, or the journal directory would outlive the lock with nobody left to find it.

    Only in a real directory (not a symlink) owned by the lock's uid: the lock names the
    journal, and a lock is a file anyone could have planted (``shmstage gc`` as root)."""
    prefix, suffix = f".{instance}.", f"{JOURNAL_SUFFIX}{PENDING_SUFFIX}"
    try:
        fd = os.open(journal, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if os.fstat(fd).st_uid != uid:
            return
        for name in os.listdir(fd):
            if name.startswith(prefix) and name.endswith(suffix):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def _locks() -> list[tuple[str, str]]:
    try:
        entries = os.listdir(LOCK_DIR)
    except FileNotFoundError:
        return []
    return [(m.group(1), os.path.join(LOCK_DIR, e)) for e in entries if (m := _LOCK.match(e))]


@dataclass
class Reaped:
    """What a reap removed (or, with ``dry_run``, would remove), for logs and ``shmstage gc``."""

    segments: list[str] = field(default_factory=list)
    bytes: int = 0
    instances: set[str] = field(default_factory=set)
    locks: list[str] = field(default_factory=list)
    live: set[str] = field(default_factory=set)
    skipped_other_uid: int = 0
    #: Dead instances whose journal still owes a checkpoint: nothing of theirs was touched.
    held: set[str] = field(default_factory=set)
    #: For each held instance: its journal directory, and the entries it still owes there.
    journals: dict[str, str] = field(default_factory=dict)
    owed: dict[str, list[str]] = field(default_factory=dict)
    held_segments: int = 0
    held_bytes: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "segments": sorted(self.segments),
            "bytes": self.bytes,
            "dead_instances": sorted(self.instances),
            "locks": sorted(self.locks),
            "live_instances": sorted(self.live),
            "skipped_other_uid": self.skipped_other_uid,
            "held_for_journal": sorted(self.held),
            "held": [
                {
                    "instance": held,
                    "journal": self.journals.get(held, ""),
                    "owed_jobs": self.owed.get(held, []),
                }
                for held in sorted(self.held)
            ],
            "held_segments": self.held_segments,
            "held_bytes": self.held_bytes,
        }


def reap(
    *,
    only_uid: int | None,
    dry_run: bool = False,
    keep: Collection[str] = (),
    own_journals: Collection[str] = (),
) -> Reaped:
    """Unlink segments and locks of instances that are not running.

    ``only_uid``: touch only files this uid owns (the daemon passes its own, so one user's
    daemon never removes another's files even when it could); ``None`` reaps every dead
    instance's files (root running ``shmstage gc``). A live instance's files are never
    touched: liveness is the flock, not a pid that may have been reused. Nor are those of a
    dead instance whose journal still owes a job — except by the daemon that owns that
    journal (``own_journals``: its own and its predecessors'), which passes the segments it
    is about to finish in ``keep`` and reaps the rest. A dead instance's journal directory
    goes with its lock once it is empty.
    """
    report = Reaped()
    keep = set(keep)
    locks = {instance: (path, read_lock(path)) for instance, path in _locks()}
    for instance, (_path, info) in locks.items():
        if info is None:
            continue
        if info.held:
            report.live.add(instance)
        elif info.journal and info.journal not in own_journals:
            owed = owed_jobs(info.journal, instance)
            if owed:
                report.held.add(instance)
                report.journals[instance] = info.journal
                report.owed[instance] = owed
    kept_owners = {segment.instance_of(name) for name in keep}
    alive: dict[str, bool] = {}
    for name in segment.list_names():
        owner = segment.instance_of(name)
        if owner is None or name in keep:
            continue
        try:
            st = os.stat(segment.SHM_DIR + name)
        except FileNotFoundError:
            continue
        # A lock speaks for an instance's segments only when the same uid owns both: one
        # planted by another user can neither keep a dead daemon's memory nor lend life.
        info = locks.get(owner, (None, None))[1]
        trusted = info is not None and info.uid in (st.st_uid, -1)
        if owner in report.held and trusted:
            report.held_bytes += st.st_blocks * 512
            report.held_segments += 1
            continue
        # Checked after listing, per owner: a daemon that started after the locks were
        # read already holds its lock before its first segment exists, so it shows up here.
        if owner not in alive:
            later = read_lock(lock_path(owner)) if not (trusted and info.held) else info
            alive[owner] = later is not None and later.held and later.uid in (st.st_uid, -1)
        if alive[owner]:
            report.live.add(owner)
            continue
        if only_uid is not None and st.st_uid != only_uid:
            report.skipped_other_uid += 1
            continue
        if dry_run or segment.unlink(name):
            report.segments.append(name)
            report.bytes += st.st_blocks * 512
            report.instances.add(owner)
    for instance, (path, info) in locks.items():
        if instance in report.live or instance in report.held or instance in kept_owners:
            continue
        if info is None or (only_uid is not None and info.uid != only_uid):
            continue  # not a lock (a planted FIFO...) or another user's: not ours to remove
        if not dry_run:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            if info.journal and os.path.basename(info.journal) == f"shmstage.{instance}.journal":
                _drop_unacknowledged(info.journal, instance, info.uid)
                with contextlib.suppress(OSError):
                    os.rmdir(info.journal)  # only if empty: an owed entry is never removed
        report.locks.append(path)
        report.instances.add(instance)
    return report


def reap_dead(keep: Collection[str] = (), own_journals: Collection[str] = ()) -> int:
    """The daemon's start-up reap: this uid's leftovers only; returns the segments removed."""
    return len(reap(only_uid=os.geteuid(), keep=keep, own_journals=own_journals).segments)
