"""File names inside a checkpoint directory, and the rules that keep writes inside it.

The daemon never resolves a path a user supplied: it works relative to a directory
descriptor the client opened, on plain names that these rules accept — no separators, no
``.``/``..``, nothing ending in ``.safetensors`` unless it is complete.

A save to a new directory is written into a hidden *pending directory* beside it
(``.shmstage-pending.<16 hex>``, in the destination's parent) and published by renaming
that directory to its final name. Inside, and inside an existing directory a save writes
into, the files carry hidden *temporary names* (``.<final>.<16 hex>.shmstage-tmp``) until
they are linked to their final names. Neither pattern ever ends in ``.safetensors``.

Who still needs a temporary file or pending directory (the locking convention). The client
takes ``flock(fd, LOCK_SH)`` (``hold``) on its own descriptor of every temporary file and
pending directory right after creating it. The descriptor travels to the daemon with the
commit (SCM_RIGHTS shares the open file description, and with it the lock), so the lock is
held for as long as the trainer or the daemon may still write there: a pending directory a
trainer prepared for its next save, a save being copied, a job being written. Once both
have closed their descriptors the lock is gone. So a cleaner (``shmstage gc``) tells a live
one from an orphan of a dead trainer or daemon by trying ``LOCK_EX | LOCK_NB`` on a
descriptor of its own (``is_held``): it fails while anyone holds the shared lock. Where the
filesystem refuses flock (some NFS setups) nothing is held, and ``is_held`` says so (None):
decide by age there. A restarted daemon finishing a journaled job re-opens the files and
takes the lock again.
"""

from __future__ import annotations

import contextlib
import fcntl
import secrets
from typing import Final

TEMP_SUFFIX: Final = ".shmstage-tmp"
PENDING_PREFIX: Final = ".shmstage-pending."
MAX_NAME_BYTES: Final = 255
_TOKEN_HEX: Final = 16


class NameError_(ValueError):
    """A file name that could escape the checkpoint directory or look complete too early."""


def check_plain_name(name: str, *, what: str) -> str:
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\0" in name
        or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
    ):
        raise NameError_(f"{what} {name!r:.80} is not a plain file name")
    return name


def temp_name(final: str) -> str:
    """A hidden, unguessable name that never ends in the final name's suffix."""
    return f".{final}.{secrets.token_hex(8)}{TEMP_SUFFIX}"


def check_temp_name(name: str, final: str) -> str:
    check_plain_name(name, what="temporary file")
    if not (name.startswith(f".{final}.") and name.endswith(TEMP_SUFFIX)):
        raise NameError_(f"temporary file {name!r:.80} does not belong to {final!r}")
    return name


def is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def pending_dir_name() -> str:
    """A hidden, unguessable name for a save's directory until it is published."""
    return f"{PENDING_PREFIX}{secrets.token_hex(_TOKEN_HEX // 2)}"


def is_pending_dir(name: str) -> bool:
    token = name[len(PENDING_PREFIX) :]
    return (
        name.startswith(PENDING_PREFIX)
        and len(token) == _TOKEN_HEX
        and all(c in "0123456789abcdef" for c in token)
    )


def check_pending_dir_name(name: str) -> str:
    check_plain_name(name, what="pending directory")
    if not is_pending_dir(name):
        raise NameError_(f"pending directory {name!r:.80} is not {PENDING_PREFIX}<16 hex digits>")
    return name


def check_final_dir_name(name: str) -> str:
    """A checkpoint directory's own name: plain, and never one a cleaner takes for debris."""
    check_plain_name(name, what="checkpoint directory")
    if is_temp(name) or is_pending_dir(name):
        raise NameError_(f"checkpoint directory {name!r:.80} has a temporary name")
    return name


def hold(fd: int) -> bool:
    """Take the shared lock that marks a temporary file or pending directory as in use
    (see the module docstring); False where the filesystem refuses flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def is_held(fd: int) -> bool | None:
    """Whether some process holds a temporary file or pending directory (``fd`` is the
    caller's own descriptor of it); None when the filesystem cannot tell."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    return False
