"""Daemon instances: each live daemon holds a lock; segments of dead instances are reaped.

A SIGKILLed daemon leaves named segments in /dev/shm; in a container the next start would
find /dev/shm full and crash-loop. Every instance therefore holds an exclusive flock on
``/dev/shm/shmstage.<instance>.lock`` for its whole life. At start a daemon unlinks the
segments of every instance whose lock nobody holds — never a live daemon's, and never a
segment owned by another uid.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from dataclasses import dataclass
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
    live = set()
    for instance, path in _locks():
        if _held(path):
            live.add(instance)
    return live


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


def reap_dead() -> int:
    """Unlink our uid's segments and locks of instances that are not running."""
    live = live_instances()
    uid = os.geteuid()
    reaped = 0
    for name in segment.list_names():
        owner = segment.instance_of(name)
        if owner is None or owner in live:
            continue
        try:
            if os.stat(segment.SHM_DIR + name).st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        if segment.unlink(name):
            reaped += 1
    for instance, path in _locks():
        if instance not in live:
            try:
                if os.stat(path).st_uid == uid:
                    os.unlink(path)
            except FileNotFoundError:
                pass
    return reaped
