"""Daemon instances: each live daemon holds a lock; segments of dead instances are reaped.

A SIGKILLed daemon leaves named segments in /dev/shm; in a container the next start would
find /dev/shm full and crash-loop. Every instance therefore holds an exclusive flock on
``/dev/shm/shmstage.<instance>.lock`` for its whole life. Segments of an instance whose lock
nobody holds are garbage — never a live daemon's.

This lives in the core, not the daemon, because two programs apply the same rule: the
daemon reaps at start, and the operator's ``shmstage gc`` reaps on demand without the
daemon package (or a running daemon) being present.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from dataclasses import dataclass, field
from typing import Final

from shmstage import segment

_LOCK = re.compile(r"^shmstage\.([0-9a-f]{16})\.lock$")
LOCK_DIR: Final = segment.SHM_DIR


def lock_path(instance: str) -> str:
    return os.path.join(LOCK_DIR, f"shmstage.{instance}.lock")


@dataclass
class InstanceLock:
    instance: str
    fd: int

    @classmethod
    def claim(cls) -> InstanceLock:
        """Create the lock already held, so no reaper ever sees it unlocked."""
        instance = segment.new_instance_id()
        tmp = os.path.join(LOCK_DIR, f".shmstage.{instance}.lock.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())
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


def live_instances() -> set[str]:
    """Instances whose lock is held right now."""
    return {instance for instance, path in _locks() if _held(path)}


def _locks() -> list[tuple[str, str]]:
    try:
        entries = os.listdir(LOCK_DIR)
    except FileNotFoundError:
        return []
    return [(m.group(1), os.path.join(LOCK_DIR, e)) for e in entries if (m := _LOCK.match(e))]


def _held(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except PermissionError:
        return True  # another user's daemon: treat as live, never touch
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@dataclass
class Reaped:
    """What a reap removed (or, with ``dry_run``, would remove), for logs and ``shmstage gc``."""

    segments: list[str] = field(default_factory=list)
    bytes: int = 0
    instances: set[str] = field(default_factory=set)
    locks: list[str] = field(default_factory=list)
    live: set[str] = field(default_factory=set)
    skipped_other_uid: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "segments": sorted(self.segments),
            "bytes": self.bytes,
            "dead_instances": sorted(self.instances),
            "locks": sorted(self.locks),
            "live_instances": sorted(self.live),
            "skipped_other_uid": self.skipped_other_uid,
        }


def reap(*, only_uid: int | None, dry_run: bool = False) -> Reaped:
    """Unlink segments and locks of instances that are not running.

    ``only_uid``: touch only files this uid owns (the daemon passes its own, so one user's
    daemon never removes another's files even when it could); ``None`` reaps every dead
    instance's files (root running ``shmstage gc``). A live instance's files are never
    touched: liveness is the flock, not a pid that may have been reused.
    """
    report = Reaped(live=live_instances())
    alive: dict[str, bool] = {}
    for name in segment.list_names():
        owner = segment.instance_of(name)
        if owner is None:
            continue
        # Checked after listing, per owner: a daemon that started after live_instances()
        # already holds its lock before its first segment exists, so it shows up here.
        if owner not in alive:
            alive[owner] = owner in report.live or _held(lock_path(owner))
        if alive[owner]:
            report.live.add(owner)
            continue
        try:
            st = os.stat(segment.SHM_DIR + name)
        except FileNotFoundError:
            continue
        if only_uid is not None and st.st_uid != only_uid:
            report.skipped_other_uid += 1
            continue
        if dry_run or segment.unlink(name):
            report.segments.append(name)
            report.bytes += st.st_blocks * 512
            report.instances.add(owner)
    for instance, path in _locks():
        if instance in report.live:
            continue
        try:
            if only_uid is not None and os.stat(path).st_uid != only_uid:
                continue
            if not dry_run:
                os.unlink(path)
        except FileNotFoundError:
            continue
        report.locks.append(path)
        report.instances.add(instance)
    return report


def reap_dead() -> int:
    """The daemon's start-up reap: this uid's leftovers only; returns the segments removed."""
    return len(reap(only_uid=os.geteuid()).segments)
