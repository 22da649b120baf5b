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
import pwd
import socket
import stat
import struct
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "ENV_DAEMON_USER",
    "ENV_SOCKET",
    "SOCKET_NAME",
    "SYSTEM_SOCKET",
    "UntrustedDaemon",
    "check_daemon",
    "connect_problem",
    "default_socket_path",
    "file_kind",
    "trusted_daemon_uids",
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


#: The packaged service's user; a client also trusts a daemon of its own uid and root's.
SERVICE_USER = "shmstage"
ENV_DAEMON_USER = "SHMSTAGE_DAEMON_USER"
_PEERCRED = struct.Struct("3i")


class UntrustedDaemon(ConnectionError):
    """What answers at the socket is not a daemon this user should hand tensors to."""


def trusted_daemon_uids(environ: Mapping[str, str] | None = None) -> frozenset[int]:
    """root, the caller, and the service user (``$SHMSTAGE_DAEMON_USER``, else "shmstage")."""
    env = os.environ if environ is None else environ
    trusted = {0, os.getuid()}
    name = env.get(ENV_DAEMON_USER) or SERVICE_USER
    try:
        trusted.add(int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid)
    except KeyError:
        pass
    return frozenset(trusted)


def check_daemon(sock: socket.socket, path: Path) -> None:
    """Refuse a daemon (or a socket directory) that another local user controls.

    Without this, whoever creates ``/tmp/shmstage-<uid>`` first could run a daemon of
    their own there: the trainer would stage its tensors into segments that user owns and
    reads, and be told "durable" for checkpoints never written. The peer's credentials
    (SO_PEERCRED: the listening process, fixed when it listened) must be root's, the
    caller's or the service user's, and so must the socket's directory, which nobody else
    may write (unless sticky, like /tmp, where others cannot remove what is not theirs).
    Raises UntrustedDaemon naming what is wrong and the fix.
    """
    trusted = trusted_daemon_uids()
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    fix = (
        f"connect only to the system socket or one you started; if the service runs as "
        f"another user, name it in ${ENV_DAEMON_USER}"
    )
    if uid not in trusted:
        raise UntrustedDaemon(
            f"the process serving {path} runs as uid {uid}, which is neither root, this user "
            f"nor the shmstaged service user: refusing to stage tensors there — {fix}"
        )
    try:
        st = os.lstat(path.parent)
    except OSError as exc:
        raise UntrustedDaemon(f"cannot check {path.parent}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in trusted:
        what = f"owned by uid {st.st_uid}" if stat.S_ISDIR(st.st_mode) else "not a directory"
        raise UntrustedDaemon(
            f"the socket's directory {path.parent} is {what}: another user could swap the "
            f"socket — {fix}"
        )
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not st.st_mode & stat.S_ISVTX:
        raise UntrustedDaemon(
            f"the socket's directory {path.parent} is writable by other users, who could "
            f"swap the socket — {fix}"
        )
