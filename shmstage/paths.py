"""Where the daemon's control socket lives, decided the same way by daemon and client.

Both sides must arrive at the same path without talking to each other first, so the rule
lives in the core. The order reflects who usually runs what: an explicit `SHMSTAGE_SOCKET`
always wins (tests, containers, several daemons on one host); the packaged system service
listens on `/run/shmstage/shmstaged.sock`; a developer running `shmstaged` by hand gets a
per-user path that other users cannot squat on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ENV_SOCKET", "SOCKET_NAME", "SYSTEM_SOCKET", "default_socket_path"]

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
