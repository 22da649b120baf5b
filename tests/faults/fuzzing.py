"""Generated hostile frames over a real socket: what the hypothesis and atheris fuzzers send.

A "frame" here is one length-prefixed message as the daemon reads it, well-formed or not.
:class:`FuzzConnection` sends frames with or without descriptors, then proves the daemon is
still answering this connection (a ``status`` probe whose reply must come within
``ANSWER_TIMEOUT_S``) or that it closed it — never silence. When what was sent ends inside
a frame, the daemon is rightly waiting for the rest, so the probe instead ends the stream
and the daemon must close. Every frame the daemon sends back must itself be a valid
protocol frame, and descriptors it sends are closed here.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgpack

from shmstage.protocol import Connection, ProtocolError, Role

ANSWER_TIMEOUT_S: Final = 10.0
#: Descriptors of every kind a hostile peer might attach.
FD_KINDS: Final = ("pipe", "devnull", "dir", "socket", "memfd", "file")
#: Placeholders the generators put in a frame, filled in from this session's answers when
#: the frame is sent: hypothesis draws frames before the daemon hands out any ids.
LAYOUT, SLOT, TREE, COMMIT_FDS = "$layout", "$slot", "$tree", "$commit"
DATA_TMP: Final = ".model.safetensors.0123456789abcdef.shmstage-tmp"
MANIFEST_TMP: Final = ".shmstage-manifest.json.0123456789abcdef.shmstage-tmp"


class DaemonSilent(AssertionError):
    """The daemon neither answered nor closed the connection in time: a hang."""


def encode(message: Any) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def open_fds(kinds: Sequence[str], scratch: Path) -> list[int]:
    fds: list[int] = []
    for kind in kinds:
        if kind == COMMIT_FDS:  # what a real client passes: a fresh directory, two temporaries
            directory = Path(tempfile.mkdtemp(dir=scratch))
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            fds.append(dir_fd)
            fds += [os.open(n, flags, 0o644, dir_fd=dir_fd) for n in (DATA_TMP, MANIFEST_TMP)]
        elif kind == "pipe":
            r, w = os.pipe()
            fds.append(r)
            os.close(w)
        elif kind == "devnull":
            fds.append(os.open(os.devnull, os.O_RDWR))
        elif kind == "dir":
            fds.append(os.open(scratch, os.O_RDONLY | os.O_DIRECTORY))
        elif kind == "socket":
            a, b = socket.socketpair()
            fds.append(a.detach())
            b.close()
        elif kind == "memfd":
            fds.append(os.memfd_create("fuzz"))
        else:
            fds.append(os.open(scratch / "file", os.O_RDWR | os.O_CREAT, 0o600))
    return fds


class FuzzConnection:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(ANSWER_TIMEOUT_S)
        self.sock.connect(str(path))
        self.parser = Connection(Role.CLIENT)
        self.closed_by_daemon = False
        self.frames_sent = 0
        self.replies = 0
        self._framing = bytearray()  # what we sent, cut at frame boundaries as the daemon would
        self.layout: int = 0  # the last layout the daemon registered for us, and its keys
        self.keys: list[str] = []
        self.slot: int = 0  # the last slot it granted us
        self._registering: dict[int, list[str]] = {}
        #: After a hostile frame the daemon's framing and ours may differ (a truncated frame
        #: swallows the next one): from then on only the final probe asks for an answer.
        self.tainted = False

    def send(self, data: bytes, fds: Sequence[int] = ()) -> bool:
        """Send one frame's bytes; False once the daemon has hung up on us."""
        if self.closed_by_daemon:
            return False
        try:
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.closed_by_daemon = True
            return False
        except OSError as exc:  # e.g. ETOOMANYREFS is ours to avoid, not the daemon's fault
            raise AssertionError(f"sending a fuzz frame failed on our side: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        self.frames_sent += 1
        self._track_framing(data)
        return True

    def _track_framing(self, data: bytes) -> None:
        self._framing += data
        while len(self._framing) >= 4:
            length = struct.unpack_from(">I", self._framing)[0]
            if len(self._framing) < 4 + length:
                return
            del self._framing[: 4 + length]

    @property
    def inside_a_frame(self) -> bool:
        return bool(self._framing)

    def fill_in(self, value: Any) -> Any:
        """Replace the placeholders with what this session was given."""
        if value == LAYOUT:
            return self.layout
        if value == SLOT:
            return self.slot
        if value == TREE:
            return {"d": [[key, {"T": key}] for key in self.keys]}
        if isinstance(value, dict):
            return {k: self.fill_in(v) for k, v in value.items()}
        return value

    def hostile(self, data: bytes, fds: Sequence[int]) -> bool:
        self.tainted = True
        return self.send(data, fds)

    def request(self, message: dict[str, Any], fds: Sequence[int], *, answer: bool) -> bool:
        """Send one generated message; with ``answer``, wait for the reply to its id (or the
        daemon hanging up), so later frames can use what it granted. False once closed."""
        message = self.fill_in(message)
        request_id = message.get("id")
        if message.get("op") == "register" and isinstance(request_id, int):
            tensors = message.get("tensors")
            keys = [t[0] for t in tensors if isinstance(t, list) and t] if isinstance(
                tensors, list
            ) else []
            self._registering[request_id] = keys
        try:
            data = encode(message)
        except (OverflowError, TypeError, ValueError):
            for fd in fds:
                os.close(fd)
            return True  # not encodable: nothing was sent
        if not self.send(data, fds):
            return False
        if answer and not self.tainted and isinstance(message.get("id"), int):
            self._await(message["id"])
        return not self.closed_by_daemon

    def _await(self, request_id: int) -> None:
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while not self.closed_by_daemon:
            for frame in self._drain():
                if frame.id == request_id and frame.op != "segment_fds":
                    return
            if time.monotonic() > deadline:
                raise DaemonSilent(f"no answer to request {request_id} in {ANSWER_TIMEOUT_S} s")
            self._receive()

    def _receive(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 253)
        except TimeoutError:
            raise DaemonSilent("the daemon neither answered nor closed the connection") from None
        except ConnectionResetError:
            data, fds = b"", []
        self._feed(data, fds)

    def probe(self, request_id: int) -> None:
        """Prove the daemon is alive for us: a status answer, or an orderly close."""
        if self.inside_a_frame:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)  # "that frame will never end"
            request_id = -1  # nothing to answer: the daemon must close
        elif self.send(encode({"op": "status", "id": request_id, "nfds": 0})):
            self.frames_sent -= 1  # the probe is ours, not part of the fuzz count
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while not self.closed_by_daemon:
            for frame in self._drain():
                if frame.op == "status" and frame.id == request_id:
                    return
            if time.monotonic() > deadline:
                raise DaemonSilent(f"no answer to a status probe within {ANSWER_TIMEOUT_S} s")
            self._receive()

    def _feed(self, data: bytes, fds: list[int]) -> None:
        if not data and not fds:
            self.closed_by_daemon = True
        try:
            self.parser.receive_data(data, fds)
        except ProtocolError as exc:
            raise AssertionError(f"the daemon sent an invalid frame: {exc}") from exc

    def _drain(self) -> list[Any]:
        frames = []
        while True:
            try:
                frame = self.parser.next_frame()
            except EOFError:
                self.closed_by_daemon = True
                return frames
            except ProtocolError as exc:
                raise AssertionError(f"the daemon sent an invalid frame: {exc}") from exc
            if frame is None:
                return frames
            for fd in frame.fds:
                os.close(fd)
            self.replies += 1
            if frame.op == "registered":
                self.layout = frame.body["layout"]
                self.keys = self._registering.get(frame.id, [])
            elif frame.op == "acquired":
                self.slot = frame.body["slot"]
            frames.append(frame)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        self.parser.close()
