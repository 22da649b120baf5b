"""A minimal, blocking control connection to shmstaged for operator tools (no torch).

``shmstage status`` and ``shmstage metrics`` only ask questions; they need neither the
client library (which imports torch) nor its reader thread. Every receive is bounded by a
deadline, so a wedged daemon makes the command fail with a message, never hang.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from shmstage.paths import UntrustedDaemon, check_daemon, connect_problem, default_socket_path
from shmstage.protocol import PROTOCOL_VERSION, Connection, Frame, ProtocolError, Role

__all__ = ["ControlClient", "ControlError"]


class ControlError(Exception):
    """The daemon could not be asked (not running, no permission, no answer in time)."""


class ControlClient:
    def __init__(
        self, socket_path: str | os.PathLike[str] | None = None, *, timeout: float = 10.0
    ) -> None:
        self.path = Path(socket_path) if socket_path is not None else default_socket_path()
        self.timeout = timeout
        self._conn = Connection(Role.CLIENT)
        self._ids = iter(range(1, 1 << 31))
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(self.path))
            check_daemon(self._sock, self.path)
        except UntrustedDaemon as exc:
            self._sock.close()
            raise ControlError(str(exc)) from None
        except OSError as exc:
            self._sock.close()
            raise ControlError(connect_problem(self.path, exc)) from None
        welcome = self.request(
            "hello",
            {"version": PROTOCOL_VERSION, "client": "shmstage-cli", "pid": os.getpid()},
        )
        self.welcome = welcome.body

    def request(self, op: str, body: dict[str, Any] | None = None) -> Frame:
        """Send one request and return its answer; an error frame raises ControlError."""
        request_id = next(self._ids)
        try:
            self._sock.sendall(self._conn.send(op, request_id, body or {}))
            frame = self._receive(request_id)
        except (OSError, EOFError) as exc:
            raise ControlError(f"shmstaged at {self.path} did not answer {op}: {exc}") from None
        except ProtocolError as exc:
            raise ControlError(f"shmstaged sent an invalid answer to {op}: {exc}") from None
        if frame.op == "error":
            raise ControlError(
                f"shmstaged refused {op}: {frame.body['message']} [{frame.body['code']}]"
            )
        return frame

    def _receive(self, request_id: int) -> Frame:
        deadline = time.monotonic() + self.timeout
        while True:
            frame = self._conn.next_frame()
            if frame is not None:
                for fd in frame.fds:  # none expected; never leak one
                    os.close(fd)
                if frame.id == request_id or (frame.op == "error" and frame.body["fatal"]):
                    return frame
                continue  # e.g. a job_done of someone else's: not ours
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no answer within {self.timeout} s")
            self._sock.settimeout(remaining)
            data, fds, _flags, _addr = socket.recv_fds(self._sock, 1 << 16, 16)
            self._conn.receive_data(data, fds)

    def status(self) -> dict[str, Any]:
        return self.request("status").body["status"]

    def metrics(self) -> dict[str, Any]:
        return self.request("metrics").body["metrics"]

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
