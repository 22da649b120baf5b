"""One connected client: reads frames, applies them to the store, answers.

A session is the thin asyncio shell around a protocol Connection. Whatever the client does
— garbage, a flood, vanishing mid-save — only this session ends; its layouts are released
and their segments unlinked once no job reads them any more.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import fcntl
import json
import logging
import math
import os
import stat
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from shmstage import datafile, names, segment, tree
from shmstage.layout import Layout, LayoutError
from shmstage.manifest import MANIFEST_NAME
from shmstage.protocol import (
    FD_OPS,
    MAX_FDS_PER_FRAME,
    PROTOCOL_VERSION,
    REPORT_PARTS,
    Connection,
    ErrorCode,
    Frame,
    ProtocolError,
    Role,
)
from shmstage.segment import SegmentRef
from shmstage_daemon import __version__, credentials, inflight, job, retention
from shmstage_daemon.admission import Peer, may_write_dir
from shmstage_daemon.host import SessionHost
from shmstage_daemon.slot import Slot, SlotState
from shmstage_daemon.store import StagedLayout, StoreError
from shmstage_daemon.transport import Transport, close_fds

log = logging.getLogger("shmstaged.session")

#: Segment descriptors go out in groups at most this size (one frame each), or smaller
#: when the client says it can take fewer at a time (``register.max_fds``).
FDS_PER_FRAME = MAX_FDS_PER_FRAME
MAX_METADATA_ENTRIES = 10_000
#: Jobs whose trainer may still report what the save cost it (a client that never
#: reports, an older one, must not make this grow).
MAX_UNREPORTED_JOBS = 64
#: Acquires of one layout that may wait at once; more is a client loop gone wrong.
MAX_WAITERS_PER_LAYOUT = 64
#: "restored" reports of restores from files one session may add to the metrics.
MAX_FILE_RESTORE_REPORTS = 4
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
#: A commit sent ahead of its copy ("prepared") is dropped if its "ready" does not come
#: within this long: it holds a slot, a journal entry and the client's tree meanwhile.
PREPARED_TIMEOUT_S = 300.0


class RequestError(Exception):
    """A request this client got wrong; answered with an error frame, session lives on."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Session:
    def __init__(self, daemon: SessionHost, sid: int, transport: Transport, peer: Peer) -> None:
        self.daemon = daemon
        self.id = sid
        self.transport = transport
        self.peer = peer
        self.conn = Connection(Role.DAEMON, max_frame_bytes=daemon.max_frame_bytes)
        self.client_name = "?"
        self.open = True
        self.greeted = False
        self._opened = time.monotonic()
        #: When the frame now arriving began to arrive, and the buffered bytes charged to
        #: this user for it (``max_buffered_bytes``).
        self._frame_started = 0.0
        self._buffer_charged = 0
        self._prepared_expiry: dict[int, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Commits sent while the client's copy still ran ("ready": false), by job id,
        #: until its "ready" starts them (or a cancel or disconnect drops them).
        self._prepared: dict[int, tuple[job.PersistJob, StagedLayout, Slot]] = {}
        #: Jobs started for this client whose "report" may still come, oldest first.
        self._unreported: collections.OrderedDict[int, job.PersistJob] = collections.OrderedDict()
        #: What this session's "restored" reports may still count (see ``_op_restored``):
        #: one from memory per lease it held to its end, a few from files.
        self._memory_restores = 0
        self._file_restores = MAX_FILE_RESTORE_REPORTS
        self.started = time.time()

    @property
    def store(self):
        return self.daemon.store

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
            await self._send_error(exc.request_id, exc.code, exc.message, fatal=True)
        except (ConnectionError, TimeoutError) as exc:
            log.warning("%s dropped: %s", self.describe(), exc or type(exc).__name__)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: internal error; dropping the session", self.describe())
            await self._send_error(0, ErrorCode.INTERNAL, "internal daemon error", fatal=True)
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
        if buffered and not self._buffer_charged:
            self._frame_started = time.monotonic()
        delta, self._buffer_charged = buffered - self._buffer_charged, buffered
        try:
            self.store.charge(
                self.id,
                "buffered_bytes",
                delta,
                self.store.limits.max_user_buffered_bytes,
                "max_buffered_bytes",
            )
        except StoreError as exc:
            self._buffer_charged -= delta
            raise ProtocolError(ErrorCode.LIMIT_EXCEEDED, exc.message) from None

    async def end(self, code: ErrorCode, message: str) -> None:
        """End the session from the daemon's side, telling the client why."""
        await self._send_error(0, code, message, fatal=True)
        self.close()

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        self.store.charge(self.id, "buffered_bytes", -self._buffer_charged, 0, "")
        self._buffer_charged = 0
        for job_id in list(self._prepared):
            self._drop_prepared(job_id)
        for task in self._tasks:
            task.cancel()
        self.conn.close()
        self.transport.close(linger=True)  # see ``inflight``: unread descriptors stay charged
        self.daemon.session_closed(self)

    async def _dispatch(self, frame: Frame) -> None:
        """Run one request. Descriptors are closed exactly once: here, unless the op is
        one that passes them (``commit``, ``lease``, ``latest``), whose handler owns them
        from its first line (closing a number twice could close whatever a writer thread
        opened under it in between)."""
        handler = getattr(self, f"_op_{frame.op}")
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
            self.daemon.telemetry.error(
                self.describe(), str(exc.code), exc.message, uid=self.peer.uid
            )
            await self._send_error(frame.id, exc.code, exc.message)
        except LayoutError as exc:
            self.daemon.telemetry.error(
                self.describe(), str(ErrorCode.BAD_REQUEST), str(exc), uid=self.peer.uid
            )
            await self._send_error(frame.id, ErrorCode.BAD_REQUEST, str(exc))

    async def send(
        self, op: str, request_id: int, body: dict[str, Any], fds: Sequence[int] = ()
    ) -> None:
        if not self.open:
            return
        await self.transport.send(self.conn.send(op, request_id, body, len(fds)), fds)

    async def _send_error(
        self, request_id: int, code: ErrorCode, message: str, *, fatal: bool = False
    ) -> None:
        if self.transport.closed:
            return
        try:
            frame = self.conn.error_frame(code, message, request_id, fatal=fatal)
            await self.transport.send(frame)
        except (ConnectionError, TimeoutError, OSError):
            pass

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

    # -- operations --------------------------------------------------------------

    async def _op_hello(self, frame: Frame) -> None:
        self.greeted = True
        self.client_name = frame.body["client"][:128]
        log.info("%s connected (client pid %s)", self.describe(), frame.body["pid"])
        await self.send(
            "welcome",
            frame.id,
            {
                "version": PROTOCOL_VERSION,
                "daemon": f"shmstaged {__version__}",
                "instance": self.daemon.instance,
                "limits": self.store.limits.to_wire(),
                "default_slots": self.daemon.default_slots,
            },
        )

    async def _op_status(self, frame: Frame) -> None:
        await self.send("status", frame.id, {"status": self.daemon.status(self.peer)})

    async def _op_metrics(self, frame: Frame) -> None:
        """The node's metrics: every user's saves, bytes and restores summed, so only for
        those who may see every user (``sees_everyone``); ``status`` shows anyone its own."""
        if not self.daemon.sees_everyone(self.peer):
            raise RequestError(
                ErrorCode.NOT_ALLOWED,
                f"uid {self.peer.uid} may not read shmstaged's metrics (they sum every "
                "user's activity): run as root or shmstaged's user, or join a group in its "
                "[server] operator_groups; `shmstage status` shows your own",
            )
        await self.send("metrics", frame.id, {"metrics": self.daemon.metrics()})

    async def _op_register(self, frame: Frame) -> None:
        if self.daemon.stopping:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "shmstaged is shutting down")
        began = time.perf_counter()
        layout = Layout.from_wire(
            frame.body["tensors"], max_tensors=self.store.limits.max_tensors_per_layout
        )
        slots = frame.body.get("slots", self.daemon.default_slots)
        planned = frame.body.get("planned_slots", slots)
        self.store.check_slots(planned)
        batch = _batch(frame)
        adopted = await self._adopt(layout, slots, planned)
        if adopted is not None:
            if self.open:
                await self._registered(frame, *adopted, batch=batch, began=began)
            return
        # room for every planned slot: the limits are checked for all of them now
        await self.daemon.retention.make_room(
            self.store.registration_bytes(layout, max(slots, planned)), self.peer.uid
        )
        nbytes = self.store.reserve(self.id, layout, slots, planned)
        making = time.perf_counter()
        try:
            refs = await self._make_slots(layout, slots, nbytes)
        except BaseException:
            self.store.unreserve(self.peer.uid, nbytes, len(layout.packing()) * slots)
            raise
        staged = self.store.add(self.id, layout, refs, nbytes, uid=self.peer.uid)
        self.daemon.telemetry.registered(created=staged.segment_count)
        if not self.open:  # the client left while segments were being made
            self.daemon.release(staged)
            return
        made = time.perf_counter() - making
        await self._registered(frame, staged, batch=batch, began=began, made=made)

    async def _registered(
        self,
        frame: Frame,
        staged: StagedLayout,
        adopted: int = 0,
        *,
        batch: int,
        began: float,
        made: float | None = None,
    ) -> None:
        """Answer a registration: the layout, then every slot's segments, writable. The log
        line says how long the client waited for the answer, and (``made``) what of that was
        making segments (the rest: reading and checking the layout, making room)."""
        log.info(
            "%s registered layout %d: %d tensors x %d slot(s) in %d segments, %d bytes, "
            "in %.3f s%s%s",
            self.describe(),
            staged.id,
            len(staged.layout.tensors),
            len(staged.slots),
            staged.segment_count,
            staged.bytes_reserved,
            time.perf_counter() - began,
            "" if made is None else f" (making segments {made:.3f} s)",
            f" ({adopted} segments adopted from a retained layout)" if adopted else "",
        )
        flat = [ref for slot in staged.slots for ref in slot.segments]
        reply = {"layout": staged.id, "slots": len(staged.slots), "segments": len(flat)}
        await self.send("registered", frame.id, {**reply, "adopted": adopted})
        await self._send_segments(
            frame.id, "segment_fds", {"layout": staged.id}, flat, batch, writable=True
        )

    async def _send_segments(
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
                count = await self.daemon.inflight.take(
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
        self.daemon.telemetry.error(
            self.describe(), str(ErrorCode.LIMIT_EXCEEDED), message, uid=self.peer.uid
        )
        await self._send_error(request_id, ErrorCode.LIMIT_EXCEEDED, message, fatal=True)
        raise ConnectionError(f"ended: {message}")

    async def _adopt(
        self, layout: Layout, slots: int, keep: int
    ) -> tuple[StagedLayout, int] | None:
        """Take over a retained layout of this user and structure, if there is one: its
        segments (and the checkpoint its newest slot holds) become this client's, up to
        ``keep`` slots of them, and only the slots it lacks of ``slots`` are created.

        Never one with a leased slot (``retention.adoptable``): between that check and
        ``store.adopt`` nothing awaits, so no lease can come in between."""
        retention = self.daemon.retention
        staged = retention.adoptable(self.peer.uid, layout, max(slots, keep))
        if staged is None:
            return None
        # Room first for what adopting adds to this user's bytes (its other retained
        # layouts count toward max_bytes); then look again, as a lease may have come.
        lacking = staged.slot_bytes * max(slots - len(staged.slots), 0)
        await retention.make_room(lacking, self.peer.uid, adopting=staged)
        if not self.open:  # its layouts were released or retained meanwhile
            raise ConnectionError("the client left while its registration waited for room")
        staged = retention.adoptable(self.peer.uid, layout, max(slots, keep))
        if staged is None:
            return None
        kept = len(staged.slots)
        slots = max(slots, kept)
        adopted = staged.segment_count
        nbytes = self.store.adopt(self.id, staged, slots)
        if kept < slots:
            try:
                await retention.make_room(nbytes, self.peer.uid)
                refs = await self._make_slots(layout, slots - kept, nbytes)
            except BaseException:
                self._disown(staged, nbytes)
                raise
            if self.store.layouts.get(staged.id) is not staged:  # collected: client gone
                self.daemon.unlink_later([ref.name for slot_refs in refs for ref in slot_refs])
                return staged, adopted
            self.store.extend(staged, refs)
        self.daemon.telemetry.registered(created=staged.segment_count - adopted, adopted=adopted)
        return staged, adopted

    async def _make_slots(self, layout: Layout, slots: int, nbytes: int) -> list[list[SegmentRef]]:
        """Create ``slots`` slots' segments (``nbytes``, already charged), in an I/O thread;
        a full /dev/shm is the client's SHM_EXHAUSTED, and the caller undoes the charge."""
        self.daemon.check_capacity(nbytes)
        try:
            return await self.daemon.run_io(self.daemon.create_segments, layout, slots)
        except segment.SegmentError as exc:
            raise RequestError(ErrorCode.SHM_EXHAUSTED, str(exc)) from None

    async def _op_add_slots(self, frame: Frame) -> None:
        """Bring a layout of this client's to ``slots`` slots: the ones it lacks are
        created and sent, writable, like a registration's. A client registers one slot for
        the save that stalls training and asks for the rest while that save persists."""
        staged = self.store.get(self.id, frame.body["layout"])
        batch = _batch(frame)
        wanted = frame.body["slots"]
        extra = max(wanted - len(staged.slots), 0)
        if extra:
            await self.daemon.retention.make_room(
                self.store.registration_bytes(staged.layout, extra), self.peer.uid
            )
        staged = self.store.get(self.id, staged.id)  # still this client's after the wait
        nbytes = self.store.reserve_slots(self.id, staged, wanted)
        refs: list[list[SegmentRef]] = []
        if nbytes:
            nsegments = len(staged.layout.packing()) * extra
            try:
                refs = await self._make_slots(staged.layout, extra, nbytes)
            except BaseException:
                self.store.unreserve(staged.uid, nbytes, nsegments, layouts=0)
                raise
            if staged.released or self.store.layouts.get(staged.id) is not staged:
                self.store.unreserve(staged.uid, nbytes, nsegments, layouts=0)
                self.daemon.unlink_later([ref.name for slot in refs for ref in slot])
                raise RequestError(
                    ErrorCode.UNKNOWN_LAYOUT, f"layout {staged.id} was released meanwhile"
                )
            self.store.add_slots(staged, refs, nbytes)
            self.daemon.telemetry.registered(created=nsegments, registration=False)
            log.info(
                "%s added %d slot(s) to layout %d: %d slot(s), %d bytes",
                self.describe(),
                extra,
                staged.id,
                len(staged.slots),
                staged.bytes_reserved,
            )
        flat = [ref for slot in refs for ref in slot]
        reply = {"layout": staged.id, "slots": len(staged.slots), "segments": len(flat)}
        await self.send("slots_added", frame.id, reply)
        await self._send_segments(
            frame.id, "segment_fds", {"layout": staged.id}, flat, batch, writable=True
        )

    def _disown(self, staged: StagedLayout, nbytes: int) -> None:
        if staged.owner == self.id and staged.retained is None:
            self.store.disown(staged, nbytes, time.monotonic())

    async def _op_acquire(self, frame: Frame) -> None:
        staged = self.store.get(self.id, frame.body["layout"])
        slot = self.store.try_acquire(self.id, staged)
        if slot is not None:
            await self.send(
                "acquired", frame.id, {"layout": staged.id, "slot": slot.index, "waited": 0.0}
            )
            return
        leased = [s.index for s in staged.slots if s.leased and s.state is SlotState.FREE]
        if not frame.body["wait"]:
            raise RequestError(
                ErrorCode.NO_FREE_SLOT,
                f"all {len(staged.slots)} slot(s) of layout {staged.id} are busy with earlier "
                "checkpoints"
                + (f" or leased by readers restoring from them (slots {leased})" if leased else "")
                + "; wait for a slot, or register the layout with more slots",
            )
        timeout = frame.body["timeout"]
        # NaN would poison the loop's timer heap; a negative or infinite one is a client bug.
        if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"acquire.timeout {timeout!r} must be a finite number of seconds >= 0, or null "
                "to wait as long as it takes",
            )
        staged.waiters = collections.deque(w for w in staged.waiters if not w.done())
        if len(staged.waiters) >= MAX_WAITERS_PER_LAYOUT:
            raise RequestError(
                ErrorCode.NO_FREE_SLOT,
                f"{len(staged.waiters)} acquires already wait for layout {staged.id}; wait for "
                "one to be answered before asking again",
            )
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        staged.waiters.append(waiter)
        if leased:
            log.warning(
                "%s: a save waits for slot(s) %s of layout %d, leased by readers restoring "
                "from them (a lease ends within %g s)",
                self.describe(),
                leased,
                staged.id,
                self.daemon.retention.policy.max_lease_seconds,
            )
        self.spawn(self._await_slot(frame, staged, waiter, timeout, bool(leased)))

    async def _await_slot(
        self,
        frame: Frame,
        staged: StagedLayout,
        waiter: asyncio.Future[Any],
        timeout: float | None,
        leased: bool = False,
    ) -> None:
        started = time.perf_counter()
        try:
            slot = await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            await self._send_error(
                frame.id,
                ErrorCode.NO_FREE_SLOT,
                f"no slot of layout {staged.id} became free within {timeout} s; earlier "
                "checkpoints are still being written",
            )
            return
        except StoreError as exc:
            await self._send_error(frame.id, exc.code, exc.message)
            return
        await self.send(
            "acquired",
            frame.id,
            {
                "layout": staged.id,
                "slot": slot.index,
                "waited": time.perf_counter() - started,
                "leased": leased,
            },
        )

    async def _op_cancel(self, frame: Frame) -> None:
        staged = self.store.get(self.id, frame.body["layout"])
        slot = self.store.slot(staged, frame.body["slot"])
        for job_id, (_, prepared_staged, prepared_slot) in list(self._prepared.items()):
            if prepared_staged is staged and prepared_slot is slot:
                self._drop_prepared(job_id)  # back to FILLING, then released below
        self.store.release_slot(self.id, staged, slot)
        await self.send("cancelled", frame.id, {"layout": staged.id, "slot": slot.index})

    async def _op_release(self, frame: Frame) -> None:
        staged = self.store.get(self.id, frame.body["layout"])
        self.daemon.release(staged)
        await self.send("released", frame.id, {"layout": staged.id})

    async def _op_commit(self, frame: Frame) -> None:
        # From here the Destination owns the descriptors; every path closes it exactly once.
        destination = _destination(frame)
        body = frame.body
        try:
            staged = self.store.get(self.id, body["layout"])
            self.store.slot(staged, body["slot"])
            # In an I/O thread, with the user's own filesystem rights: the names live in a
            # directory that may be the user's alone, and on NFS or Lustre each stat is a
            # server round trip the event loop must not wait for.
            await self.daemon.run_io(self._check_destination_as_peer, destination)
            staged = self.store.get(self.id, body["layout"])  # still there after the wait
            slot = self.store.slot(staged, body["slot"])
            header = staged.header(_string_map(body.get("file_metadata", {}), "file_metadata"))
            metadata = body.get("metadata", {})
            if len(metadata) > MAX_METADATA_ENTRIES:
                raise RequestError(ErrorCode.BAD_REQUEST, "metadata has too many entries")
            _check_json(metadata, "commit.metadata")
            _check_tree(body["tree"], staged.layout)
            ready = body.get("ready", True)
            if not ready:
                limit = self.store.limits.max_user_prepared
                self.store.charge(self.id, "prepared", 1, limit, "max_prepared")
            try:
                job_id = self.store.begin_job(self.id, staged, slot)
            except BaseException:
                if not ready:
                    self.store.charge(self.id, "prepared", -1, 0, "")
                raise
        except BaseException:
            destination.close()
            raise
        persist = job.PersistJob(
            id=job_id,
            layout=staged.layout,
            segments=slot.segments,
            header=header,
            destination=destination,
            tree=body["tree"],
            metadata=metadata,
            save_info={
                "client": self.client_name,
                "pid": self.peer.pid,
                "uid": self.peer.uid,
                "daemon": f"shmstaged {__version__}",
                "layout": staged.id,
                "slot": slot.index,
            },
            fsync=self.daemon.fsync,
            peer=self.peer,
            entries=staged.entries.get(destination.data_file),
        )
        wire = staged.wire(slot)
        try:
            # The entry will hold about this frame and the slot's record: charged to the
            # user (max_journal_bytes) until the entry goes, so that nobody fills the
            # journal's filesystem (a container's 64 MiB /dev/shm) for everyone.
            self.daemon.charge_journal(
                job_id, self.id, frame.size + sum(len(part) for part in wire.packed.values())
            )
            # Durable before acknowledged: a daemon killed after "committed" still owes it.
            await self.daemon.journal_commit(persist, wire, self.peer, owed=ready)
        except (OSError, StoreError) as exc:
            if not ready:
                self.store.charge(self.id, "prepared", -1, 0, "")
            self._abandon_commit(job_id, persist, staged, slot)
            if isinstance(exc, StoreError):
                raise
            raise self._journal_failed(exc) from None
        reply = {"layout": staged.id, "slot": slot.index, "job": job_id}
        if ready:
            self._start(persist, staged, slot, body)
            await self.send("committed", frame.id, reply)
            return
        # Prepared: the client is still copying. The slot stays out of everyone's reach
        # and the job waits for "ready"; without it (cancel, disconnect, the deadline) it
        # is dropped.
        self._prepared[job_id] = (persist, staged, slot)
        self._prepared_expiry[job_id] = asyncio.get_running_loop().call_later(
            PREPARED_TIMEOUT_S, self._expire_prepared, job_id
        )
        if not self.open:  # the client left while the entry was being written
            self._drop_prepared(job_id)
            return
        await self.send("prepared", frame.id, reply)

    async def _op_report(self, frame: Frame) -> None:
        """What a save cost the trainer, known only after its save() returned: for the
        metrics, and for the job's log line if it is still being written. Never answered;
        a report of a job this client did not commit (or reported already) is ignored."""
        body = frame.body
        persist = self._unreported.pop(body["job"], None)
        if persist is None:
            log.debug("%s reported unknown job %s; ignored", self.describe(), body["job"])
            return
        timings = {
            name: value
            for name in ("stall_seconds", *REPORT_PARTS)
            if (value := _finite(body.get(name))) is not None and value >= 0
        }
        persist.client_timings = timings
        self.daemon.telemetry.reported(timings)

    async def _op_ready(self, frame: Frame) -> None:
        """The client's copy into a prepared commit's slot is complete: start the job."""
        body = frame.body
        job_id, layout_id, slot_index = body["job"], body["layout"], body["slot"]
        persist, staged, slot = self._prepared.get(job_id, (None, None, None))
        if persist is None or (staged.id, slot.index) != (layout_id, slot_index):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"no prepared commit {job_id} of slot {slot_index} of layout {layout_id}",
            )
        del self._prepared[job_id]
        self._unprepare(job_id)
        try:
            await self.daemon.journal_publish(job_id)
        except OSError as exc:
            self._abandon_commit(job_id, persist, staged, slot)
            raise self._journal_failed(exc) from None
        self._start(persist, staged, slot, body)
        await self.send(
            "committed", frame.id, {"layout": staged.id, "slot": slot.index, "job": job_id}
        )

    def _start(
        self, persist: job.PersistJob, staged: StagedLayout, slot: Slot, timings: dict[str, Any]
    ) -> None:
        """Start the job; ``timings``: what a client older than the "report" op sent."""
        self.daemon.telemetry.staged(
            staged.layout.nbytes,
            _finite(timings.get("stage_seconds")),
            _finite(timings.get("slot_wait_seconds")),
        )
        self._unreported[persist.id] = persist
        while len(self._unreported) > MAX_UNREPORTED_JOBS:
            self._unreported.popitem(last=False)
        try:  # acknowledged: the slot's bytes are this checkpoint now, until refilled
            self.daemon.retention.remember(staged, slot, retention.held_of(persist, self.peer))
        except OSError as exc:
            log.debug("job %d: not restorable from memory: %s", persist.id, exc)
        self.daemon.start_job(self, staged, slot, persist)

    def _drop_prepared(self, job_id: int) -> None:
        """A prepared commit that will not happen (cancel, disconnect, deadline)."""
        self._unprepare(job_id)
        self._abandon_commit(job_id, *self._prepared.pop(job_id))

    def _unprepare(self, job_id: int) -> None:
        timer = self._prepared_expiry.pop(job_id, None)
        if timer is not None:
            timer.cancel()
        self.store.charge(self.id, "prepared", -1, 0, "")

    def _expire_prepared(self, job_id: int) -> None:
        if job_id not in self._prepared:
            return
        log.warning(
            "%s: commit %d waited %g s for its ready; dropped (the slot is the client's again)",
            self.describe(),
            job_id,
            PREPARED_TIMEOUT_S,
        )
        self._drop_prepared(job_id)

    def _abandon_commit(
        self, job_id: int, persist: job.PersistJob, staged: StagedLayout, slot: Slot
    ) -> None:
        """A commit never acknowledged: a pending journal entry goes, the slot is the
        client's again (FILLING). Nothing was written; the temporary files (and pending
        directory) the client made for it are removed — a trainer killed during its copy
        cannot — only while they are still the very ones (same inode), in an I/O thread."""
        self.daemon.journal_discard(job_id)
        self.daemon.abandon_job(self.id, staged, slot, job_id)
        discarding = self.daemon.run_io(job.discard, persist.destination, self.peer)
        self.daemon.track(asyncio.ensure_future(discarding))

    def _journal_failed(self, exc: OSError) -> RequestError:
        return RequestError(
            ErrorCode.STORAGE,
            f"cannot journal the checkpoint ({exc.strerror or exc}) in "
            f"{self.daemon.journal_path}; nothing was written — check that filesystem",
        )

    def _check_destination_as_peer(self, destination: job.Destination) -> None:
        with credentials.acting_as(self.peer):
            self._check_destination(destination)

    def _check_destination(self, destination: job.Destination) -> None:
        """Check the client's descriptors really are what the names say, and writable by it."""
        try:
            data_file = names.check_plain_name(destination.data_file, what="data file")
            if not data_file.endswith(datafile.SUFFIX):
                raise names.NameError_(f"data file {data_file!r} must end in {datafile.SUFFIX}")
            names.check_temp_name(destination.data_tmp, data_file)
            names.check_temp_name(destination.manifest_tmp, MANIFEST_NAME)
            if destination.pending:
                self._check_pending(destination)
            dir_fd = destination.dir_fd
            dir_st = os.fstat(dir_fd)
            if not stat.S_ISDIR(dir_st.st_mode):
                raise RequestError(ErrorCode.BAD_REQUEST, "first descriptor is not a directory")
            if not may_write_dir(dir_st, self.peer):
                raise RequestError(
                    ErrorCode.NOT_ALLOWED,
                    f"uid {self.peer.uid} cannot write the checkpoint directory itself, so "
                    "shmstaged will not write there on its behalf",
                )
            data = _check_file_fd(destination.data_tmp, destination.data_fd, dir_fd)
            manifest = _check_file_fd(destination.manifest_tmp, destination.manifest_fd, dir_fd)
            if (data.st_dev, data.st_ino) == (manifest.st_dev, manifest.st_ino):
                raise RequestError(
                    ErrorCode.BAD_REQUEST, "the data and manifest descriptors are the same file"
                )
        except names.NameError_ as exc:
            raise RequestError(ErrorCode.BAD_REQUEST, str(exc)) from None
        except OSError as exc:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"bad destination descriptor: {exc}"
            ) from None

    def _check_pending(self, destination: job.Destination) -> None:
        """A new directory: the parent is one the client may write, the pending directory is
        the very one named there, and the final name is free.

        In a sticky parent (/tmp) a user may rename only what it owns, and so may the
        daemon on its behalf: a pending directory of someone else's is refused there.
        """
        names.check_pending_dir_name(destination.pending_dir)
        names.check_final_dir_name(destination.final_dir)
        parent = os.fstat(destination.parent_fd)
        if not stat.S_ISDIR(parent.st_mode):
            raise RequestError(ErrorCode.BAD_REQUEST, "first descriptor is not a directory")
        if not may_write_dir(parent, self.peer):
            raise RequestError(
                ErrorCode.NOT_ALLOWED,
                f"uid {self.peer.uid} cannot write the directory that would hold "
                f"{destination.final_dir}, so shmstaged will not create it there on its behalf",
            )
        pending = os.fstat(destination.dir_fd)
        try:
            named = os.stat(
                destination.pending_dir, dir_fd=destination.parent_fd, follow_symlinks=False
            )
        except FileNotFoundError:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"{destination.pending_dir} does not exist in the parent"
            ) from None
        if (named.st_dev, named.st_ino) != (pending.st_dev, pending.st_ino):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"{destination.pending_dir} is not the directory whose descriptor came",
            )
        if parent.st_mode & stat.S_ISVTX and self.peer.uid not in (0, pending.st_uid):
            raise RequestError(
                ErrorCode.NOT_ALLOWED,
                f"{destination.pending_dir} belongs to uid {pending.st_uid}, not {self.peer.uid}",
            )
        try:
            os.stat(destination.final_dir, dir_fd=destination.parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        raise RequestError(
            ErrorCode.EXISTS,
            f"{destination.final_dir} already exists; shmstage never overwrites a checkpoint — "
            "save to a new directory",
        )

    # -- restoring from memory (see ``retention``) -------------------------------------

    async def _op_lease(self, frame: Frame) -> None:
        """Lease the exact checkpoint whose data file the client opened and whose manifest
        hashes to ``digest``: the daemon compares identities, never resolves a path."""
        try:
            if len(frame.fds) != 1:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"lease needs 1 descriptor (the checkpoint's data file, opened for "
                    f"reading), got {len(frame.fds)}",
                )
            st = _readable_fd(frame.fds[0], "lease", stat.S_ISREG, "a regular file")
        finally:
            close_fds(frame.fds)
        entry = self.daemon.retention.find((st.st_dev, st.st_ino), frame.body["digest"])
        # Another user's checkpoint this caller may not read is, to it, not in memory: a
        # refusal that said so would tell it what another user keeps there, and whose.
        if entry is None or not self.daemon.retention.may_read(self.peer, entry[2]):
            self.daemon.telemetry.leased("not_retained")
            raise RequestError(
                ErrorCode.NOT_RETAINED,
                "shmstaged does not hold this checkpoint in memory for you (never, refilled, "
                "given back, its files changed since, or another user's, which only members "
                "of its [server] restore_groups may restore from memory); read it from its "
                "files",
            )
        await self._grant(frame, entry, structure=False)

    async def _op_latest(self, frame: Frame) -> None:
        """Lease this user's newest acknowledged checkpoint in memory, durable or still
        being written; optionally of one structure, in one parent directory (descriptor)."""
        parent = None
        try:
            if len(frame.fds) > 1:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"latest takes at most 1 descriptor (the parent directory), got "
                    f"{len(frame.fds)}",
                )
            if frame.fds:
                st = _readable_fd(frame.fds[0], "latest", stat.S_ISDIR, "a directory")
                parent = (st.st_dev, st.st_ino)
        finally:
            close_fds(frame.fds)
        entry = self.daemon.retention.newest_of(self.peer.uid, frame.body.get("structure"), parent)
        if entry is None:
            self.daemon.telemetry.leased("not_retained")
            raise RequestError(
                ErrorCode.NOT_RETAINED,
                f"shmstaged holds no checkpoint of uid {self.peer.uid} in memory"
                + (" of that structure" if "structure" in frame.body else "")
                + (" in that directory" if parent is not None else ""),
            )
        await self._grant(frame, entry, structure=True)

    async def _grant(self, frame: Frame, entry: Any, *, structure: bool) -> None:
        staged, slot, held = entry
        batch = _batch(frame)
        lease = self.daemon.retention.grant(self.id, self.peer, entry, frame.body.get("seconds"))
        body: dict[str, Any] = {
            "lease": lease.id,
            "seconds": lease.expires - lease.granted,
            "job": held.job,
            "segments": len(slot.segments),
            "sizes": list(staged.layout.packing().sizes),
            "durable": held.durable,
            "digest": held.digest,
            "directory": held.directory,
            "data_file": held.data_file,
            "acknowledged_unix": held.acknowledged_unix,
        }
        if structure:  # the daemon's own record: latest() needs no manifest from a path
            body.update(
                tensors=staged.layout.to_wire(),
                tree=held.tree,
                metadata=held.metadata,
                checksums=held.checksums,
            )
        log.info(
            "%s leased job %d (uid %d, %s) for %.0f s",
            self.describe(),
            held.job,
            held.uid,
            "durable" if held.durable else "still being written",
            body["seconds"],
        )
        try:
            if self.peer.uid != held.uid:
                await self._unwritten(lease, slot)
            try:
                await self.send("leased", frame.id, body)
            except ValueError as exc:  # the structure does not fit one frame: nothing sent
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"the checkpoint's structure is too large to send ({exc}); restore it "
                    "by path, load(path), which reads the structure from its manifest",
                ) from None
            await self._send_segments(
                frame.id, "lease_fds", {"lease": lease.id}, slot.segments, batch, writable=False
            )
        except segment.SegmentError as exc:
            self.daemon.retention.end(lease)
            raise RequestError(ErrorCode.NOT_RETAINED, str(exc)) from None
        except BaseException:  # a refusal above, or the client gone
            if lease.id in self.daemon.retention.leases:
                self.daemon.retention.end(lease)
            raise

    async def _unwritten(self, lease: retention.Lease, slot: Slot) -> None:
        """Another user's lease holds only a slot nobody can write (see ``retention``): the
        kernel counts no writer of its segments now, and the daemon hands none out while
        the lease lasts. Refused otherwise: the reader reads the files."""
        try:
            written = await self.daemon.run_io(retention.writers, slot.segments)
        except segment.SegmentError:
            raise
        except OSError as exc:
            written = f"its segments cannot be checked now ({exc.strerror or exc})"
        else:
            if written is not None:
                written = f"a process still holds its segment {written} open for writing"
        if lease.id not in self.daemon.retention.leases:
            raise RequestError(
                ErrorCode.NOT_RETAINED,
                f"the lease ended while it was granted ({lease.revoked or 'expired'}); "
                "read the checkpoint from its files",
            )
        if written is not None:
            self.daemon.telemetry.leased("refused")
            raise RequestError(
                ErrorCode.NOT_RETAINED,
                f"uid {self.peer.uid} may not lease uid {lease.staged.uid}'s checkpoint "
                f"(job {lease.job}) from memory: {written} (its trainer, or a process it "
                "gave them to); read it from its files",
            )

    async def _op_renew(self, frame: Frame) -> None:
        lease = self.daemon.retention.lease_of(self.id, frame.body["lease"])
        seconds = self.daemon.retention.renew(lease, frame.body.get("seconds"))
        await self.send("renewed", frame.id, {"lease": lease.id, "seconds": seconds})

    async def _op_unlease(self, frame: Frame) -> None:
        """End a lease; ``held`` tells the reader whether it was still in force (if not,
        the slot may have been refilled while it read)."""
        lease = self.daemon.retention.leases.get(frame.body["lease"])
        held = lease is not None and lease.session == self.id
        if held:
            self.daemon.retention.end(lease)  # type: ignore[arg-type]
            self._memory_restores += 1
        await self.send("unleased", frame.id, {"lease": frame.body["lease"], "held": held})

    async def _op_restored(self, frame: Frame) -> None:
        """How a restore went (never answered): for the metrics. It is only the client's
        word, so a session's reports count only as far as it could have restored: from
        memory once per lease it held to its end, from files a few times (a restore opens
        a connection of its own and reports once); the rest are dropped."""
        body = frame.body
        if body["source"] == "memory":
            if not self._memory_restores:
                return
            self._memory_restores -= 1
        elif body["source"] == "files":
            if not self._file_restores:
                return
            self._file_restores -= 1
        self.daemon.telemetry.restored(body["source"], _finite(body["seconds"]), body["bytes"])

    async def job_finished(self, persist: job.PersistJob, result: job.JobResult) -> None:
        """Spawned (``spawn``): a client gone meanwhile ends it quietly."""
        await self.send(
            "job_done", 0, {"job": persist.id, "ok": result.ok, "result": result.to_wire()}
        )


def _destination(frame: Frame) -> job.Destination:
    """The commit's destination, owning its descriptors from here on: a new directory
    (parent, pending directory, data, manifest) or an existing one (directory, data,
    manifest), as the fields say."""
    fds, body = frame.fds, frame.body
    fields = ("pending_dir" in body) + ("final_dir" in body)
    count, what = (
        (4, "parent directory, pending directory, data file, manifest file")
        if fields
        else (3, "directory, data file, manifest file")
    )
    problem = (
        "commit.pending_dir and commit.final_dir go together"
        if fields == 1
        else f"commit needs {count} descriptors ({what}), got {len(fds)}"
        if len(fds) != count
        else ""
    )
    if problem:
        close_fds(fds)
        raise RequestError(ErrorCode.BAD_REQUEST, problem)
    names_ = (body["data_file"], body["data_tmp"], body["manifest_tmp"])
    if not fields:
        return job.Destination(fds[0], fds[1], fds[2], *names_)
    return job.Destination(
        fds[1],
        fds[2],
        fds[3],
        *names_,
        parent_fd=fds[0],
        pending_dir=body["pending_dir"],
        final_dir=body["final_dir"],
    )


def _batch(frame: Frame) -> int:
    """Descriptors per message the client takes (``max_fds``), checked."""
    batch = frame.body.get("max_fds", FDS_PER_FRAME)
    if not 1 <= batch <= FDS_PER_FRAME:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"{frame.op}.max_fds {batch} must be 1..{FDS_PER_FRAME} descriptors per message",
        )
    return batch


def _readable_fd(fd: int, op: str, kind: Any, what: str) -> os.stat_result:
    """A descriptor the client opened for reading (not O_PATH: that proves no access)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    st = os.fstat(fd)
    if flags & getattr(os, "O_PATH", 0) or flags & os.O_ACCMODE not in (os.O_RDONLY, os.O_RDWR):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{op}: the descriptor is not open for reading")
    if not kind(st.st_mode):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{op}: the descriptor is not {what}")
    return st


def _check_file_fd(name: str, fd: int, dir_fd: int) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{name}: descriptor is not a regular file")
    if st.st_nlink != 1:  # a fresh temporary file has exactly its one name
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"{name}: the file has {st.st_nlink} links, not a fresh one"
        )
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE not in (os.O_WRONLY, os.O_RDWR):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{name}: descriptor is not open for writing")
    try:
        named = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"{name} does not exist in the checkpoint directory"
        ) from None
    if (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{name} is not the file whose descriptor came")
    return st


def _string_map(value: object, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{what} must map strings to strings")
    if len(value) > MAX_METADATA_ENTRIES:
        raise RequestError(ErrorCode.BAD_REQUEST, f"{what} has too many entries")
    return value


def _check_json(value: object, what: str) -> None:
    """Refuse now what the manifest (strict JSON) could not hold, rather than after the ack."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"{what} must be plain JSON values: {exc}"
        ) from None


def _check_tree(encoded: object, layout: Layout) -> None:
    """The structure must decode and refer only to tensors the layout has.

    Otherwise the daemon would publish a checkpoint whose manifest refers to tensors that
    are not there, which ``verify`` and ``load`` then reject.
    """
    try:
        keys = tree.tensor_keys(encoded)
    except (ValueError, TypeError, RecursionError) as exc:
        raise RequestError(ErrorCode.BAD_REQUEST, f"commit.tree is malformed: {exc}") from None
    unknown = set(keys) - layout.key_set
    if unknown:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"commit.tree refers to tensors the layout does not have: {sorted(unknown)[:5]}",
        )
    # No JSON check needed: a tree tensor_keys accepts holds only None, bools, ints,
    # strings, lists and one-entry dicts with string tags, all of which JSON can hold.


def _finite(value: object) -> float | None:
    """A client-reported duration fit for the metrics (NaN or infinity would poison sums)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
