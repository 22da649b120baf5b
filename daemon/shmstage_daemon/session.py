"""One connected client: reads frames, hands each to its op's handler, answers.

A session is the thin asyncio shell around a protocol Connection. Whatever the client does
— garbage, a flood, vanishing mid-save — only this session ends; its layouts are released
and their segments unlinked once no job reads them any more.

What an op does is not here: the daemon gives each session a table from op to handler
(``registration``, ``commits``, ``restores``, ``publishing``, ``status``), handlers built
for this session with the few services each uses. A handler answers through the session's
``send``, ``send_error`` and ``send_segments``, and raises ``RequestError`` (or the
store's ``StoreError``) for a request the client got wrong: the session answers that with
an error frame and lives on.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NoReturn

from shmstage import segment
from shmstage.layout import LayoutError
from shmstage.protocol import (
    FD_OPS,
    PROTOCOL_VERSION,
    Connection,
    ErrorCode,
    Frame,
    ProtocolError,
    Role,
)
from shmstage.segment import SegmentRef
from shmstage_daemon import __version__, inflight
from shmstage_daemon.admission import Peer
from shmstage_daemon.requests import RequestError
from shmstage_daemon.store import Store, StoreError
from shmstage_daemon.telemetry import Telemetry
from shmstage_daemon.transport import Transport, close_fds

log = logging.getLogger("shmstaged.session")

#: A connection must say hello within this long, and a frame whose first byte arrived must
#: be complete within FRAME_TIMEOUT_S: an idle or trickling peer holds nothing for long.
HELLO_TIMEOUT_S = 10.0
FRAME_TIMEOUT_S = 30.0
#: Why sending descriptors can fail for a reason that is nobody's fault in particular.
OUT_OF_DESCRIPTORS = {
    errno.ETOOMANYREFS: "too many descriptors in flight from shmstaged's user",
    errno.EMFILE: "shmstaged has as many descriptors open as its RLIMIT_NOFILE allows",
    errno.ENFILE: "the node has as many files open as fs.file-max allows",
}

#: What serves one op: called with the request's frame, on the session's read loop.
Handler = Callable[[Frame], Awaitable[None]]


class Session:
    def __init__(
        self,
        sid: int,
        transport: Transport,
        peer: Peer,
        *,
        max_frame_bytes: int,
        store: Store,
        telemetry: Telemetry,
        inflight: inflight.InFlight,
        welcome: Callable[[], dict[str, Any]],
        closed: Callable[[Session], None],
    ) -> None:
        self.id = sid
        self.transport = transport
        self.peer = peer
        self.conn = Connection(Role.DAEMON, max_frame_bytes=max_frame_bytes)
        self.client_name = "?"
        self.open = True
        self.greeted = False
        self._store = store
        self._telemetry = telemetry
        self._inflight = inflight
        #: The daemon's part of the "welcome" (instance, limits, default slots).
        self._welcome = welcome
        #: Told once the session has ended (the daemon forgets it, retains its layouts).
        self._closed = closed
        self._ops: dict[str, Handler] = {"hello": self._hello}
        #: Run first when the session ends (a handler dropping what it holds for the client).
        self._on_close: list[Callable[[], None]] = []
        self._opened = time.monotonic()
        #: When the frame now arriving began to arrive, and the buffered bytes charged to
        #: this user for it (``max_buffered_bytes``).
        self._frame_started = 0.0
        self._buffered = store.take(sid, "buffered_bytes", 0, 0, "max_buffered_bytes")
        self._tasks: set[asyncio.Task[None]] = set()
        self.started = time.time()

    def serve(self, ops: Mapping[str, Handler], on_close: Callable[[], None] | None = None) -> None:
        """Add ops this session answers (a handler's table), and what ends with it."""
        self._ops.update(ops)
        if on_close is not None:
            self._on_close.append(on_close)

    def describe(self) -> str:
        return f"client {self.id} ({self.client_name}, {self.peer.describe()})"

    # -- the read loop -----------------------------------------------------------

    async def run(self) -> None:
        try:
            while self.open:
                data, fds = await self._receive()
                self.conn.receive_data(data, fds)
                while self.open and (frame := self.conn.next_frame()) is not None:
                    await self._dispatch(frame)
                self._account_buffer()
        except EOFError:
            log.info("%s disconnected", self.describe())
        except ProtocolError as exc:
            log.warning("%s broke the protocol: %s", self.describe(), exc)
            await self.send_error(exc.request_id, exc.code, exc.message, fatal=True)
        except (ConnectionError, TimeoutError) as exc:
            log.warning("%s dropped: %s", self.describe(), exc or type(exc).__name__)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: internal error; dropping the session", self.describe())
            await self.send_error(0, ErrorCode.INTERNAL, "internal daemon error", fatal=True)
        finally:
            self.close()

    async def _receive(self) -> tuple[bytes, list[int]]:
        """The next bytes from the client, within whichever deadline applies now."""
        if not self.greeted:
            deadline, why = self._opened + HELLO_TIMEOUT_S, f"no hello within {HELLO_TIMEOUT_S:g} s"
        elif self.conn.buffered:
            deadline = self._frame_started + FRAME_TIMEOUT_S
            why = f"a frame was not complete {FRAME_TIMEOUT_S:g} s after it began"
        else:
            return await self.transport.recv()  # a trainer may idle between saves
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await self.transport.recv()
        except TimeoutError:
            raise ProtocolError(ErrorCode.BAD_FRAME, why) from None

    def _account_buffer(self) -> None:
        """Charge the bytes of a frame still arriving to the user (``max_buffered_bytes``)."""
        buffered = self.conn.buffered
        if buffered and not self._buffered.amount:
            self._frame_started = time.monotonic()
        try:
            self._buffered.resize(buffered, self._store.limits.max_user_buffered_bytes)
        except StoreError as exc:
            raise ProtocolError(ErrorCode.LIMIT_EXCEEDED, exc.message) from None

    async def end(self, code: ErrorCode, message: str) -> None:
        """End the session from the daemon's side, telling the client why."""
        await self.send_error(0, code, message, fatal=True)
        self.close()

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        self._buffered.release()
        for drop in self._on_close:
            drop()
        for task in self._tasks:
            task.cancel()
        self.conn.close()
        self.transport.close(linger=True)  # see ``inflight``: unread descriptors stay charged
        self._closed(self)

    async def _dispatch(self, frame: Frame) -> None:
        """Run one request. Descriptors are closed exactly once: here, unless the op is
        one that passes them (``commit``, ``lease``, ``latest``), whose handler owns them
        from its first line (closing a number twice could close whatever a writer thread
        opened under it in between)."""
        handler = self._ops[frame.op]
        try:
            if frame.op not in FD_OPS and frame.fds:
                close_fds(frame.fds)
                why = (
                    f"{frame.op} carried {len(frame.fds)} file descriptor(s); only commit, "
                    "lease and latest pass descriptors (they were closed)"
                )
                if frame.op == "hello":  # no handshake without its answer: end the session
                    raise ProtocolError(ErrorCode.BAD_REQUEST, why, frame.id)
                raise RequestError(ErrorCode.BAD_REQUEST, why)
            await handler(frame)
        except (RequestError, StoreError) as exc:
            self.refused(exc.code, exc.message)
            await self.send_error(frame.id, exc.code, exc.message)
        except LayoutError as exc:
            self.refused(ErrorCode.BAD_REQUEST, str(exc))
            await self.send_error(frame.id, ErrorCode.BAD_REQUEST, str(exc))

    def refused(self, code: ErrorCode, message: str) -> None:
        """Count a refusal among the user's recent errors (``status``)."""
        self._telemetry.error(self.describe(), str(code), message, uid=self.peer.uid)

    # -- answering ---------------------------------------------------------------------

    async def send(
        self,
        op: str,
        request_id: int,
        body: dict[str, Any],
        fds: Sequence[int] = (),
        *,
        prepacked: Mapping[str, bytes] | None = None,
    ) -> None:
        """``prepacked``: fields whose msgpack encoding the daemon kept (a version's tree)."""
        if not self.open:
            return
        frame = self.conn.send(op, request_id, body, len(fds), prepacked=prepacked)
        await self.transport.send(frame, fds)

    async def send_error(
        self, request_id: int, code: ErrorCode, message: str, *, fatal: bool = False
    ) -> None:
        if self.transport.closed:
            return
        try:
            frame = self.conn.error_frame(code, message, request_id, fatal=fatal)
            await self.transport.send(frame)
        except (ConnectionError, TimeoutError, OSError):
            pass

    async def send_segments(
        self,
        request_id: int,
        op: str,
        fields: dict[str, Any],
        refs: Sequence[SegmentRef],
        batch: int,
        *,
        writable: bool,
    ) -> None:
        """Segment descriptors in frames of at most ``batch``, opened now, closed once sent.

        Descriptors the client has not read yet are the daemon user's, to the kernel: one
        batch is in flight per connection (``Transport.drained``; a client that stops
        reading is dropped after the send timeout), and each is charged to this user until
        read, within its share (``inflight``: a batch shrinks to what is left of it). When
        no room comes, or the kernel refuses anyway (ETOOMANYREFS, the daemon out of
        descriptors), this requester hears limit_exceeded and nobody else notices; a
        registration's session then ends, since its client lacks segments the daemon
        counts as its own (the session's end releases or retains them, as for any client
        gone mid-registration).
        """
        first = 0
        while first < len(refs):
            fds: list[int] = []
            try:
                await self.transport.drained(self.transport.send_timeout)
                count = await self._inflight.take(
                    self.transport, self.peer.uid, min(batch, len(refs) - first)
                )
                for ref in refs[first : first + count]:
                    fds.append(segment.open_fd(ref, writable=writable))
                    if not writable:  # a reader mapping it would fault past a shorter end
                        segment.check_size(fds[-1], ref)
                await self.send(op, request_id, {**fields, "first": first}, fds)
            except inflight.NoRoom as exc:
                await self._transfer_refused(request_id, str(exc), fatal=writable)
            except OSError as exc:
                if exc.errno not in OUT_OF_DESCRIPTORS:
                    raise
                await self._transfer_refused(
                    request_id,
                    f"shmstaged could not pass segment descriptors now ({exc.strerror}: "
                    f"{OUT_OF_DESCRIPTORS[exc.errno]}); retry shortly",
                    fatal=writable,
                )
            finally:
                close_fds(fds)
            first += count

    async def _transfer_refused(
        self, request_id: int, message: str, *, fatal: bool
    ) -> NoReturn:
        """Refuse a transfer of segments as limit_exceeded: this request only, or with
        ``fatal`` the session (after telling the client why)."""
        log.warning("%s: segments not sent: %s", self.describe(), message)
        if not fatal:
            raise RequestError(ErrorCode.LIMIT_EXCEEDED, message)
        self.refused(ErrorCode.LIMIT_EXCEEDED, message)
        await self.send_error(request_id, ErrorCode.LIMIT_EXCEEDED, message, fatal=True)
        raise ConnectionError(f"ended: {message}")

    def pending_tasks(self) -> list[asyncio.Task[None]]:
        return list(self._tasks)

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` beside the session's reads. A client that vanished before its answer
        went out (an acquire that waited, then found the socket closed) ends the task
        quietly: the session's close gives back whatever was granted to it."""

        async def answering() -> None:
            try:
                await coro
            except (ConnectionError, TimeoutError, OSError) as exc:
                log.debug("%s: gone before its answer was sent (%s)", self.describe(), exc)

        task = asyncio.get_running_loop().create_task(answering())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the handshake -------------------------------------------------------------------

    async def _hello(self, frame: Frame) -> None:
        self.greeted = True
        self.client_name = frame.body["client"][:128]
        log.info("%s connected (client pid %s)", self.describe(), frame.body["pid"])
        await self.send(
            "welcome",
            frame.id,
            {"version": PROTOCOL_VERSION, "daemon": f"shmstaged {__version__}", **self._welcome()},
        )
