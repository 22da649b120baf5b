"""Where the daemon's control socket lives, decided the same way by daemon and client.

Both sides must arrive at the same path without talking to each other first, so the rule
lives in the core. The order reflects who usually runs what: an explicit `SHMSTAGE_SOCKET`
always wins (tests, containers, several daemons on one host); the packaged system service
listens on `/run/shmstage/shmstaged.sock`; a developer running `shmstaged` by hand gets a
per-user path that other users cannot squat on.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "ENV_SOCKET",
    "SOCKET_NAME",
    "SYSTEM_SOCKET",
    "connect_problem",
    "default_socket_path",
    "file_kind",
]

ENV_SOCKET = "SHMSTAGE_SOCKET"
SOCKET_NAME = "shmstaged.sock"
# Must match ListenStream= in systemd/shmstaged.socket and the tmpfiles.d entry.
SYSTEM_SOCKET = Path("/run/shmstage") / SOCKET_NAME


def default_socket_path(
    *,
    prefer_system: bool = True,
    environ: Mapping[str, str] | None = None,
    uid: int | None = None,
) -> Path:
    """Return the control socket path to use when neither a flag nor a config file names one.

    Order: `$SHMSTAGE_SOCKET`; `/run/shmstage/shmstaged.sock` when running as root, or
    (with `prefer_system`, the client's default) when that socket exists, because the system
    service runs as the `shmstage` user and a trainer in the `shmstage` group must find it
    without configuration; `$XDG_RUNTIME_DIR/shmstage/shmstaged.sock`; finally
    `/tmp/shmstage-<uid>/shmstaged.sock`.

    The daemon passes `prefer_system=False`: a developer's unprivileged daemon must not try
    to bind over the system service's socket just because it exists.
    """
    env = os.environ if environ is None else environ
    explicit = env.get(ENV_SOCKET)
    if explicit:
        return Path(explicit)
    if uid is None:
        uid = os.getuid()
    if uid == 0 or (prefer_system and SYSTEM_SOCKET.exists()):
        return SYSTEM_SOCKET
    runtime_dir = env.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.path.isabs(runtime_dir):
        return Path(runtime_dir) / "shmstage" / SOCKET_NAME
    return Path(f"/tmp/shmstage-{uid}") / SOCKET_NAME


def connect_problem(path: Path, exc: OSError) -> str:
    """Why connecting to the daemon's socket at ``path`` failed, and what to do, in the same
    words for the client library and the ``shmstage`` command.

    The kernel answers "connection refused" both for a socket nobody listens on any more
    and for a path that is no socket at all; only the first means the daemon is gone.
    """
    what = f"cannot connect to shmstaged at {path}"
    if isinstance(exc, FileNotFoundError):
        dangling = os.path.islink(path)
        return (
            f"{what}: {'a symlink to nothing' if dangling else 'no such file'} — is "
            "shmstaged running? (systemctl status shmstaged; or set SHMSTAGE_SOCKET / pass "
            "the daemon's --socket)"
        )
    if isinstance(exc, PermissionError):
        return (
            f"{what}: permission denied — add this user to the group that owns the socket "
            "(usermod -aG shmstage $USER, then log in again)"
        )
    if exc.errno == errno.ECONNREFUSED:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFSOCK
        if stat.S_ISDIR(mode):
            return (
                f"{what}: it is a directory, not a socket — pass the socket itself (for "
                f"example {Path(path) / SOCKET_NAME})"
            )
        if not stat.S_ISSOCK(mode):
            return (
                f"{what}: it is a {file_kind(mode)}, not a socket — the path is wrong (check "
                "SHMSTAGE_SOCKET or socket=), or shmstaged's socket was replaced: remove the "
                "file and restart shmstaged"
            )
        return (
            f"{what}: connection refused — the daemon that created this socket is gone; "
            "start shmstaged (systemctl restart shmstaged)"
        )
    return f"{what}: {exc.strerror or exc}"


def file_kind(mode: int) -> str:
    """What a file is, in words, for messages about a path that is not what it should be."""
    if stat.S_ISREG(mode):
        return "regular file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISFIFO(mode):
        return "named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"
