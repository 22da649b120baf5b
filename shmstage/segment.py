"""POSIX shared-memory segments: one per staged tensor, owned and named by the daemon.

Names carry the daemon instance's prefix, ``/shmstage.<instance>.<random>``, so a restarted
daemon can tell its own leftovers from a live instance's and nobody can guess a name. Space
is reserved with ``posix_fallocate``: ``ftruncate`` on tmpfs reserves nothing and a full
/dev/shm would later kill the writer with SIGBUS, whereas fallocate reports ENOSPC now.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from typing import Final

import posix_ipc

NAME_PREFIX: Final = "shmstage."
SHM_DIR: Final = "/dev/shm"
_NAME = re.compile(r"^/shmstage\.([0-9a-f]{16})\.([0-9a-f]{24})$")


class SegmentError(OSError):
    """Creating or mapping a segment failed; the message says which and why."""


def new_instance_id() -> str:
    return secrets.token_hex(8)


def segment_name(instance: str) -> str:
    return f"/{NAME_PREFIX}{instance}.{secrets.token_hex(12)}"


def instance_of(name: str) -> str | None:
    """The daemon instance a segment name belongs to, or None if it is not ours."""
    match = _NAME.match(name if name.startswith("/") else "/" + name)
    return match.group(1) if match else None


def mapping_size(nbytes: int) -> int:
    """Zero-byte tensors still get a one-byte segment: mmap cannot map nothing."""
    return max(nbytes, 1)


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """What the daemon keeps per segment: a name and a size, never a mapping it doesn't use."""

    name: str
    size: int


def create(instance: str, nbytes: int) -> SegmentRef:
    """Create and reserve a 0600 segment; on failure nothing is left behind."""
    name = segment_name(instance)
    size = mapping_size(nbytes)
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
    except posix_ipc.ExistentialError as exc:  # a 96-bit random collision: not in practice
        raise SegmentError(errno.EEXIST, f"shared-memory segment {name} exists: {exc}") from exc
    except OSError as exc:
        raise SegmentError(exc.errno, f"cannot create shared memory in {SHM_DIR}: {exc}") from exc
    try:
        os.posix_fallocate(shm.fd, 0, size)
    except OSError as exc:
        shm.close_fd()
        _unlink_quietly(name)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SegmentError(
                exc.errno,
                f"{SHM_DIR} is full: cannot reserve {size} bytes for a staging segment "
                f"({_free_hint()}); free space there or lower the checkpoint's size",
            ) from exc
        raise SegmentError(exc.errno, f"cannot reserve {size} bytes in {SHM_DIR}: {exc}") from exc
    shm.close_fd()
    return SegmentRef(name, size)


def open_fd(ref: SegmentRef, *, writable: bool) -> int:
    """A fresh descriptor on an existing segment (the caller closes it)."""
    try:
        shm = posix_ipc.SharedMemory(ref.name, 0, read_only=not writable)
    except posix_ipc.ExistentialError as exc:
        raise SegmentError(errno.ENOENT, f"segment {ref.name} vanished: {exc}") from exc
    return shm.fd


def map_fd(fd: int, size: int, *, writable: bool) -> mmap.mmap:
    """Map a segment descriptor; the descriptor may be closed right after."""
    actual = os.fstat(fd).st_size
    if actual < size:
        raise SegmentError(errno.EINVAL, f"segment is {actual} bytes but {size} were expected")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)


def unlink(name: str) -> bool:
    """Remove a segment's name; memory is freed once the last mapping goes."""
    return _unlink_quietly(name)


def _unlink_quietly(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def list_names(instance: str | None = None) -> list[str]:
    """Segment names in /dev/shm that belong to shmstage (optionally to one instance)."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    names = []
    for entry in entries:
        owner = instance_of(entry)
        if owner is not None and (instance is None or owner == instance):
            names.append("/" + entry)
    return names


def _free_hint() -> str:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return "free space unknown"
    return f"{st.f_bavail * st.f_frsize} of {st.f_blocks * st.f_frsize} bytes free"
