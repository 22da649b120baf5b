"""Bytes and file descriptors over a non-blocking unix stream socket, for asyncio.

asyncio's streams cannot carry SCM_RIGHTS, so this is the thin layer that can: it waits for
readiness with ``add_reader``/``add_writer`` and moves data with ``recv_fds``/``sendmsg``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import struct
import termios
from collections.abc import Sequence
from typing import Final

RECV_BYTES: Final = 256 * 1024


class TooManyDescriptors(ConnectionError):
    """The peer sent more descriptors at once than this side takes; the kernel dropped
    the excess (MSG_CTRUNC), so the stream can no longer be trusted."""


class Transport:
    def __init__(
        self, sock: socket.socket, *, send_timeout: float = 30.0, max_fds: int = 253
    ) -> None:
        """``max_fds``: descriptors accepted per receive. The daemon passes a handful
        (only a commit carries any): the kernel then installs no more than that in this
        process, whatever a client sends, and drops the rest itself."""
        sock.setblocking(False)
        self.sock = sock
        self.send_timeout = send_timeout
        self.max_fds = max_fds
        self._send_lock = asyncio.Lock()
        self.closed = False
        self._fd = sock.fileno()
        #: Readiness waits in progress: woken (and unregistered) by ``close``.
        self._waiting: set[asyncio.Future[None]] = set()
        #: Closed, but the socket kept open until the peer has read what was sent (``close``).
        self.lingering = False

    async def _ready(self, *, write: bool) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        fd = self._fd

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        (loop.add_writer if write else loop.add_reader)(fd, wake)
        self._waiting.add(future)
        try:
            await future
        finally:
            self._waiting.discard(future)
            if not self.closed:  # close() already unregistered it (the number may be reused)
                (loop.remove_writer if write else loop.remove_reader)(fd)

    async def recv(self) -> tuple[bytes, list[int]]:
        """The next chunk of bytes and the descriptors that came with it (b"" at EOF)."""
        while True:
            if self.closed:
                return b"", []
            try:
                data, fds, flags, _addr = socket.recv_fds(
                    self.sock, RECV_BYTES, self.max_fds, socket.MSG_CMSG_CLOEXEC
                )
                if flags & socket.MSG_CTRUNC:
                    close_fds(fds)
                    raise TooManyDescriptors(
                        f"the peer sent more than {self.max_fds} descriptors at once"
                    )
                return data, list(fds)
            except (BlockingIOError, InterruptedError):
                await self._ready(write=False)
            except (ConnectionResetError, BrokenPipeError):
                return b"", []

    async def send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Send all of ``data``; the descriptors ride with its first byte.

        A peer that stops reading cannot stall the daemon: after ``send_timeout`` the send
        fails with TimeoutError and the caller drops the session.
        """
        async with self._send_lock:
            await asyncio.wait_for(self._send_all(data, fds), self.send_timeout)

    @property
    def sending(self) -> bool:
        """A send is under way (what ``unread`` says may not count it yet)."""
        return self._send_lock.locked()

    async def _send_all(self, data: bytes, fds: Sequence[int]) -> None:
        view = memoryview(data)
        pending_fds = list(fds)
        while view:
            if self.closed:
                raise ConnectionError("connection closed")
            try:
                if pending_fds:
                    sent = socket.send_fds(self.sock, [view], pending_fds)
                    pending_fds = []
                else:
                    sent = self.sock.send(view)
                view = view[sent:]
            except (BlockingIOError, InterruptedError):
                await self._ready(write=True)

    async def drained(self, timeout: float) -> None:
        """Until the peer has read everything sent so far (SIOCOUTQ is 0), or TimeoutError.

        Descriptors in flight on a unix socket are charged to the *sender's* user until
        the receiver reads them: a client that asks for 60,000 segments and never reads
        would hold the daemon user's quota of in-flight descriptors and make every other
        user's registration fail with ETOOMANYREFS. So each batch waits for the last (and
        ``inflight`` bounds what all of a user's connections hold unread).
        """
        deadline = asyncio.get_running_loop().time() + timeout
        delay = 0.0002
        while self.unread() > 0:
            if self.closed:
                raise ConnectionError("connection closed")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the peer read nothing for {timeout:g} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)

    def unread(self) -> int:
        """Bytes sent that the peer has not read (SIOCOUTQ): 0 also once its socket is gone,
        since the kernel frees what was queued there, and the descriptors with it."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock, termios.TIOCOUTQ, b"\0" * 4))[0]
        except (OSError, ValueError):  # ValueError: this socket was closed
            return 0

    def close(self, *, linger: bool = False) -> None:
        """Close, possibly from another task than the one waiting to read or write.

        The descriptor's readiness callbacks are removed *before* the socket is closed and
        its number freed: otherwise a wait still registered under that number would later
        remove the callbacks of whichever new connection the kernel gave the same number
        (that connection would then never be read). Waiters wake and see ``closed``.

        ``linger``: while the peer has not read everything sent, keep the socket itself
        open, shut down both ways (``lingering``), for ``release`` to close later. What the
        daemon sent stays queued at the peer however this end is closed, descriptors
        included, and charged to the daemon's user by the kernel until the peer reads it or
        closes its own end; only an open socket can tell when that happened (``unread``).
        """
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(RuntimeError):  # no running loop: nothing registered
            loop = asyncio.get_running_loop()
            loop.remove_reader(self._fd)
            loop.remove_writer(self._fd)
        for future in self._waiting:
            if not future.done():
                future.set_result(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if linger and self.unread() > 0:
            self.lingering = True
        else:
            self.sock.close()

    def release(self) -> None:
        """Close the socket itself (after ``close``, of one that lingered)."""
        self.lingering = False
        self.sock.close()


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
