"""The listening socket: bind it safely, accept peers, admit them or tell them why not.

Who may connect at all is the allowlist's (``admission``: the pure rules); the limits a
user's connections count against are the store's. A refused peer is told why and given a
moment to read it: closing at once would leave it with "broken pipe" instead of the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shmstage.protocol import DAEMON_MAX_PENDING_FDS, Connection, ErrorCode, Role
from shmstage_daemon.admission import Peer, peer_of
from shmstage_daemon.settings import Settings
from shmstage_daemon.store import StoreError
from shmstage_daemon.transport import Transport

log = logging.getLogger("shmstaged")

#: How long a refused peer gets to read why, and how many may be reading at once.
REFUSAL_LINGER_S = 2.0
MAX_LINGERING_REFUSALS = 64


class StartupError(Exception):
    """The daemon cannot serve; the message says what to fix."""


class Listener:
    """Accepts connections on the daemon's socket and hands each admitted peer on."""

    def __init__(
        self,
        settings: Settings,
        admit: Callable[[Transport, Peer], None],
        track: Callable[[asyncio.Future[Any]], None],
    ) -> None:
        self._settings = settings
        #: Serves an admitted peer; raises StoreError to refuse it (its user's limits).
        self._admit_peer = admit
        self._track = track
        self.sock: socket.socket | None = None
        #: True when systemd passed the listening socket: it is systemd's, never unlinked.
        self.activated = False
        self._refusing = 0

    def listen(self, passed: socket.socket | None) -> None:
        """Take the socket systemd passed, or bind our own."""
        if passed is not None:
            self.activated = True
            self.sock = passed
        else:
            self.sock = bind(self._settings.socket_path)

    def close(self) -> None:
        """Stop listening; remove the socket file unless systemd passed the socket (it
        keeps listening on it across restarts)."""
        if self.sock is None:
            return
        self.sock.close()
        self.sock = None
        if not self.activated:
            with contextlib.suppress(FileNotFoundError):
                self._settings.socket_path.unlink()

    async def accept_loop(self) -> None:
        assert self.sock is not None
        listener = self.sock
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    log.error("out of file descriptors; not accepting for 1 s")
                    await asyncio.sleep(1)
                    continue
                # ECONNABORTED, ENOBUFS, EPROTO...: one failed accept must not end accepting.
                log.warning("accept failed: %s; continuing", exc)
                await asyncio.sleep(0.05)
                continue
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        try:
            peer = peer_of(sock)
        except OSError as exc:
            log.warning("cannot identify a peer: %s", exc)
            sock.close()
            return
        transport = Transport(sock, max_fds=DAEMON_MAX_PENDING_FDS)
        allowlist = self._settings.allowlist
        if not allowlist.admits(peer):
            log.warning("refused %s: not in the allowlist", peer.describe())
            self._turn_away(
                transport,
                ErrorCode.NOT_ALLOWED,
                f"uid {peer.uid} is not allowed to use shmstaged (allowed: "
                f"{allowlist.describe()}); add the user or one of its groups "
                "to shmstaged's allowed users",
            )
            return
        try:
            self._admit_peer(transport, peer)
        except StoreError as exc:
            log.warning("refused %s: %s", peer.describe(), exc.message)
            self._turn_away(transport, exc.code, exc.message)

    def _turn_away(self, transport: Transport, code: ErrorCode, message: str) -> None:
        """Tell a refused peer why (briefly: at most MAX_LINGERING_REFUSALS at once)."""
        refusal = Connection(Role.DAEMON).error_frame(code, message, fatal=True)
        if self._refusing >= MAX_LINGERING_REFUSALS:  # a flood: no courtesy, just close
            transport.close()
            return
        self._track(asyncio.get_running_loop().create_task(self._refuse(transport, refusal)))

    async def _refuse(self, transport: Transport, refusal: bytes) -> None:
        """Send the reason, then let the peer read it before closing.

        Closing at once would make the client's first send (its hello) fail with EPIPE
        before it ever reads why, leaving it with "broken pipe" instead of the fix.
        """
        self._refusing += 1
        try:
            async with asyncio.timeout(REFUSAL_LINGER_S):
                await transport.send(refusal)
                transport.sock.shutdown(socket.SHUT_WR)
                while True:
                    data, fds = await transport.recv()
                    for fd in fds:
                        os.close(fd)
                    if not data:
                        break
        except (TimeoutError, OSError):
            pass
        finally:
            self._refusing -= 1
            transport.close()


def bind(path: Path) -> socket.socket:
    """Bind the listening socket (mode 0660), refusing to steal one a live daemon serves."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    check_socket_directory(path.parent)
    try:
        st = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(f"{path} exists and is not a socket; remove it or pick --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink()  # left by a daemon that died
        except OSError as exc:
            raise StartupError(f"cannot check existing socket {path}: {exc}") from exc
        else:
            raise StartupError(f"another shmstaged is already serving {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o117)  # created 0660: never a moment of wider access
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot bind {path}: {exc.strerror}") from exc
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o660)
    sock.listen(128)
    return sock


def check_socket_directory(directory: Path) -> None:
    """Serve only from a directory no other user controls.

    Whoever may write the socket's directory may delete the socket and bind their own in
    its place, and trainers would then stage their tensors into segments that user owns.
    So the directory must be this daemon's own (or root's), not a symlink, and writable by
    nobody else — or sticky (like /tmp), where others cannot remove what is ours.
    """
    try:
        st = directory.lstat()
    except OSError as exc:
        raise StartupError(f"cannot use socket directory {directory}: {exc.strerror}") from None
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory (a symlink?)"
    elif st.st_uid not in (os.geteuid(), 0):
        problem = f"belongs to uid {st.st_uid}, not to this daemon's uid {os.geteuid()}"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        problem = "is writable by other users"
    if problem is not None:
        raise StartupError(
            f"socket directory {directory} {problem}: another user could replace the socket "
            "with their own; use a directory only this user (or root) can write, e.g. the "
            "default, or remove it and let shmstaged create it"
        )
