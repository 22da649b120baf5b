"""The bench's ``shmstaged``: started the way a user's container starts it, and described.

A root container runs ``shmstaged`` with its default paths: the socket in
``/run/shmstage``, which in most containers sits on the overlay (a disk), not on a tmpfs.
The bench does the same unless ``--socket`` says otherwise, because a bench that put its
socket on a tmpfs on purpose hid a 6× stall that every container user paid (the journal
lived beside the socket and each commit waited for its fsync on the busy disk).

Where the journal lives is read from the daemon itself — its status or its start-up log —
never computed here, so the report says where it really is whatever the daemon decides.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .direct_io import filesystem_of

_LISTENING = re.compile(r"listening on (\S+)")
_JOURNAL_IN_LOG = re.compile(r"journal\S*\s+(?:\w+\s+){0,3}?(/\S+?)[,;:)]?(?:\s|$)")


def _journal_in(status: Any) -> str | None:
    """A journal path anywhere in the daemon's status (key containing "journal")."""
    if isinstance(status, dict):
        for key, value in status.items():
            if "journal" in str(key).lower():
                if isinstance(value, str) and value.startswith("/"):
                    return value
                if isinstance(value, dict):
                    for sub in ("path", "directory", "dir"):
                        if isinstance(value.get(sub), str):
                            return value[sub]
            found = _journal_in(value)
            if found:
                return found
    return None


@dataclass
class DaemonInfo:
    """What the report says about the daemon the shmstage rows talked to."""

    socket: str
    started_by_bench: bool
    socket_filesystem: str = "?"
    journal: str | None = None
    journal_filesystem: str | None = None
    journal_source: str = "not reported by this daemon"
    log_lines: list[str] = field(default_factory=list)

    def describe(self) -> str:
        who = "started by the bench" if self.started_by_bench else "already running"
        journal = (
            f"journal {self.journal} ({self.journal_filesystem}; {self.journal_source})"
            if self.journal
            else f"journal: {self.journal_source}"
        )
        return f"shmstaged {who}: socket {self.socket} ({self.socket_filesystem}); {journal}"


class BenchDaemon:
    """A ``shmstaged`` the bench starts with default paths (or ``--socket``) and stops.

    ``attach=True`` uses a daemon already listening at ``socket`` instead of starting one.
    """

    ready_timeout_s = 60.0

    def __init__(self, socket: str | None = None, *, attach: bool = False) -> None:
        self.requested = socket
        self.attach = attach
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp: str | None = None
        self.log_path: str | None = None
        self.socket: str | None = None
        self.info: DaemonInfo | None = None

    def _command(self) -> list[str]:
        """This interpreter when the daemon package is importable, else the console script."""
        if importlib.util.find_spec("shmstage_daemon") is not None:
            code = "import sys; from shmstage_daemon.main import main; sys.exit(main())"
            cmd = [sys.executable, "-c", code]
        else:
            exe = shutil.which("shmstaged")
            if exe is None:
                raise RuntimeError(
                    "shmstaged not found: neither the shmstage_daemon package nor the "
                    "shmstaged command is installed; install ./daemon beside the bench "
                    "(scripts/bootstrap.sh does) or pass --attach with --socket"
                )
            cmd = [exe]
        return cmd + (["--socket", self.requested] if self.requested else [])

    def log_text(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def log_tail(self, n: int = 2000) -> str:
        return self.log_text()[-n:]

    def start(self) -> str:
        """Start (or attach) once; returns the socket. Raises with the daemon's log on failure."""
        if self.socket is not None:
            return self.socket
        if self.attach:
            if not self.requested:
                raise RuntimeError("--attach needs --socket: the socket of the running daemon")
            self.socket = self.requested
            self.info = self._describe(started=False)
            return self.socket
        self.tmp = tempfile.mkdtemp(prefix="shmstage-bench-daemon-")
        self.log_path = os.path.join(self.tmp, "shmstaged.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self._command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            found = _LISTENING.search(self.log_text())
            if found:
                self.socket = found.group(1)
                break
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"shmstaged exited with {self.proc.returncode}: {self.log_tail()} "
                    "(another daemon on that socket? pass --socket PATH, or --attach to use it)"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"shmstaged not ready after {self.ready_timeout_s:.0f} s")
            time.sleep(0.02)
        self.info = self._describe(started=True)
        return self.socket

    def _describe(self, *, started: bool) -> DaemonInfo:
        assert self.socket is not None
        info = DaemonInfo(
            socket=self.socket,
            started_by_bench=started,
            socket_filesystem=filesystem_of(os.path.dirname(self.socket)),
        )
        status: Any = None
        with contextlib.suppress(Exception):
            from shmstage.control import ControlClient

            with ControlClient(self.socket, timeout=10) as client:
                status = client.status()
        journal = _journal_in(status)
        if journal:
            info.journal, info.journal_source = journal, "from the daemon's status"
        else:
            lines = self.log_text().splitlines()
            info.log_lines = [line for line in lines if "journal" in line.lower()][:5]
            for line in info.log_lines:
                found = _JOURNAL_IN_LOG.search(line)
                if found:
                    info.journal = found.group(1)
                    info.journal_source = "from the daemon's start-up log"
                    break
        if not info.journal:  # an older daemon says nothing: look beside its socket
            sock = Path(self.socket)
            beside = sorted(sock.parent.glob(f"{sock.name}*journal*"))
            if beside:
                info.journal = str(beside[0])
                info.journal_source = "found beside the socket: the daemon does not report it"
        if info.journal:
            info.journal_filesystem = filesystem_of(info.journal)
        return info

    def stop(self) -> None:
        """SIGTERM (SIGKILL only if ignored) a daemon this bench started; never an attached one."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        self.socket = None


class PrivateDaemon(BenchDaemon):
    """A ``shmstaged`` on a socket in a new private temp dir: for tools that may run beside
    other daemons (``scripts/dcp_gpu_bench.py`` under a test suite). The temp dir is on
    ``$TMPDIR``'s filesystem, a disk on most machines, as ``/run`` is in a container."""

    def __init__(self) -> None:
        self.private = tempfile.mkdtemp(prefix="shmstage-bench-sock-")
        super().__init__(os.path.join(self.private, "shmstaged.sock"))

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.private, ignore_errors=True)
