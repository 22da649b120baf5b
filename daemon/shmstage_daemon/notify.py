"""The systemd service protocol, spoken directly: sd_notify datagrams and socket activation.

Both halves are tiny wire protocols (one AF_UNIX datagram per notification; inherited fds
starting at 3 described by three environment variables), so we implement them here instead
of depending on libsystemd or python-systemd, which are often missing in containers and
virtualenvs. Outside systemd every call is a cheap no-op, so the daemon needs no
"am I under systemd?" branches.

The watchdog ping is sent from the asyncio event loop on purpose: the loop is what serves
trainers, so a loop blocked by a bug must stop the pings and let systemd restart the daemon.
A ping from a helper thread would keep a wedged daemon looking healthy.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
import time
from collections.abc import MutableMapping

__all__ = [
    "SD_LISTEN_FDS_START",
    "Notifier",
    "listen_fds",
    "listen_fds_with_names",
    "unix_stream_listener",
    "watchdog_loop",
]

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
# A notification that cannot be delivered within this time is dropped: blocking the event
# loop longer than this on a wedged service manager would hurt trainers more than a lost
# STATUS= line. (The kernel only blocks a datagram send when the receiver's queue is full.)
_SEND_TIMEOUT_S = 1.0


def _notify_address(value: str) -> str | bytes | None:
    """Translate `$NOTIFY_SOCKET` into an address for `sendto`.

    A leading "@" denotes the Linux abstract namespace (NUL-prefixed name); otherwise the
    value must be an absolute path. Anything else (e.g. the "vsock:" form newer systemd uses
    for VMs) is unsupported and disables notifications rather than crashing the daemon.
    """
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


class Notifier:
    """Sends sd_notify messages to the service manager named by `$NOTIFY_SOCKET`.

    The environment is read once at construction, so a Notifier captures the protocol state
    the daemon was started with; later changes to os.environ (or `unset_environment=True`,
    which keeps children we spawn from pinging systemd on our behalf) do not affect it.
    Send failures are logged once and otherwise ignored: losing a STATUS= line must never
    take the daemon down.
    """

    def __init__(
        self,
        environ: MutableMapping[str, str] | None = None,
        *,
        unset_environment: bool = False,
    ) -> None:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        self._address = _notify_address(raw) if raw else None
        if raw and self._address is None:
            log.warning("NOTIFY_SOCKET=%r is not a supported address; not notifying", raw)
        self._watchdog_usec = env.get("WATCHDOG_USEC")
        self._watchdog_pid = env.get("WATCHDOG_PID")
        self._sock: socket.socket | None = None
        self._warned = False
        if unset_environment:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                env.pop(name, None)

    @property
    def enabled(self) -> bool:
        """True when a service manager is listening, i.e. messages are actually sent."""
        return self._address is not None

    def notify(self, *fields: str) -> bool:
        """Send one datagram of newline-separated `KEY=VALUE` fields; return whether it went out.

        Fields must not contain newlines (systemd would read them as extra assignments), so
        they are replaced by spaces here rather than trusted to every caller.
        """
        if self._address is None:
            return False
        payload = "\n".join(f.replace("\n", " ") for f in fields).encode()
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.settimeout(_SEND_TIMEOUT_S)
                self._sock = sock
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            if not self._warned:
                log.warning("sd_notify to %r failed: %s", self._address, exc)
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd start-up (or a reload) finished and the socket is serving."""
        fields = ["READY=1"]
        if status is not None:
            fields.append(f"STATUS={status}")
        return self.notify(*fields)

    def status(self, text: str) -> bool:
        """Set the one-line status `systemctl status` shows (e.g. clients, bytes in flight)."""
        return self.notify(f"STATUS={text}")

    def stopping(self, status: str | None = None) -> bool:
        """Announce an orderly shutdown, so systemd does not treat draining as a hang."""
        fields = ["STOPPING=1"]
        if status is not None:
            fields.append(f"STATUS={status}")
        return self.notify(*fields)

    def reloading(self, status: str | None = None) -> bool:
        """Announce a configuration reload; send `ready()` when it is done.

        MONOTONIC_USEC lets systemd (v253+, Type=notify-reload) match this message to the
        reload it requested; older versions ignore the field.
        """
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        fields = ["RELOADING=1", f"MONOTONIC_USEC={usec}"]
        if status is not None:
            fields.append(f"STATUS={status}")
        return self.notify(*fields)

    def watchdog(self) -> bool:
        """Send one keep-alive ping."""
        return self.notify("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Seconds between pings (half of WatchdogSec), or None when no watchdog applies.

        Half the timeout is what sd_watchdog_enabled(3) recommends: it tolerates one late
        ping. WATCHDOG_PID, when set, names the process the watchdog is meant for; any other
        process (e.g. a child that inherited the environment) must not ping.
        """
        if self._address is None or not self._watchdog_usec:
            return None
        if self._watchdog_pid:
            try:
                if int(self._watchdog_pid) != os.getpid():
                    return None
            except ValueError:
                return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            log.warning("ignoring malformed WATCHDOG_USEC=%r", self._watchdog_usec)
            return None
        if usec <= 0:
            return None
        return usec / 2 / 1_000_000

    def close(self) -> None:
        """Release the sending socket (the daemon keeps one for its whole life otherwise)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


async def watchdog_loop(notifier: Notifier, interval: float) -> None:
    """Ping WATCHDOG=1 every `interval` seconds until cancelled.

    Run it as a task on the daemon's own event loop (never in a thread or executor): a loop
    stuck in a blocking call then stops pinging and systemd restarts the service.
    """
    if interval <= 0:
        raise ValueError(f"watchdog interval must be positive, got {interval}")
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)


def listen_fds_with_names(
    environ: MutableMapping[str, str] | None = None,
    *,
    unset_environment: bool = True,
) -> list[tuple[str, socket.socket]]:
    """Take over the sockets systemd passed by socket activation, with their FileDescriptorName.

    Implements sd_listen_fds_with_names(3): fds 3..3+LISTEN_FDS-1, only when LISTEN_PID is
    this process (the variables may have been inherited from a parent that was activated).
    FD_CLOEXEC is set so the sockets do not leak into anything we exec. The variables are
    removed by default so a child process cannot mistake them for its own. Passed fds that are
    not sockets are left alone (marked close-on-exec) and skipped. Names default to "unknown"
    as in libsystemd.
    """
    env = os.environ if environ is None else environ
    pid_s = env.get("LISTEN_PID")
    fds_s = env.get("LISTEN_FDS")
    names_s = env.get("LISTEN_FDNAMES")
    if unset_environment:
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(name, None)
    if not pid_s or not fds_s:
        return []
    try:
        pid = int(pid_s)
        count = int(fds_s)
    except ValueError:
        log.warning("ignoring malformed LISTEN_PID=%r / LISTEN_FDS=%r", pid_s, fds_s)
        return []
    if pid != os.getpid() or count <= 0:
        return []
    names = names_s.split(":") if names_s else []
    if len(names) != count:
        names = ["unknown"] * count
    result: list[tuple[str, socket.socket]] = []
    for offset in range(count):
        fd = SD_LISTEN_FDS_START + offset
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
            fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            log.warning("passed fd %d is not a usable socket (%s); skipping it", fd, exc)
            continue
        result.append((names[offset], sock))
    return result


def listen_fds(
    environ: MutableMapping[str, str] | None = None,
    *,
    unset_environment: bool = True,
) -> list[socket.socket]:
    """The sockets passed by socket activation (see listen_fds_with_names); [] when none."""
    return [sock for _, sock in listen_fds_with_names(environ, unset_environment=unset_environment)]


def unix_stream_listener(
    sockets: list[socket.socket], path: str | os.PathLike[str] | None = None
) -> socket.socket | None:
    """Pick the listening AF_UNIX stream socket to serve on, or None to bind our own.

    With `path`, only a socket bound to that path qualifies, so a unit that passes extra
    sockets (e.g. a metrics port) cannot be confused with the control socket.
    """
    wanted = os.fspath(path) if path is not None else None
    for sock in sockets:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            continue
        if wanted is not None and sock.getsockname() != wanted:
            continue
        return sock
    return None
