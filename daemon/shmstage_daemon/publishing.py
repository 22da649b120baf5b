"""Publishing and subscribing: the conversation of ``channels`` (publish, subscribe, pin,
unhold, unpin, checksums, ring, offer).

A publisher's "publish" turns the slot it filled (or the slot of a save it just committed)
into its channel's newest version; every subscriber's connection is told at once by a
"version" frame — pushed, never polled — continuing the answers to its "subscribe". A
subscriber then pins the newest version and gets the slot's segments read-only, once per
slot of the ring on its connection: it keeps them mapped across versions, and the
version's tree only when it differs from the last one sent there. Once a version is
visible (after the publisher's answer) it is checksummed off the loop (``versionsums``);
a pin's answer carries the checksums once they are there, and "checksums" asks for them
later, waiting a bounded time. What may be published, pinned and by whom is
``channels``'s; this is the conversation.

A reader may ask for every slot of its channel's ring ahead of any version ("ring": the
same read-only descriptors a pin sends, pinning nothing, none sent twice on a
connection); a publisher may name its layout as its channel's ring before its first
version ("offer"), and its followers are told ("ring_ready").

A waiting reader's "pin" may be *held* (``hold``): when no version newer than the one it
asks for is visible, the request stays here, the connection's, for at most ``hold``
seconds; the first version made visible meanwhile is pinned for it at once, on the loop,
and the answer to the request is the wake-up — one frame to the reader instead of an
announcement, a "pin" and its answer (no "version" frame is sent for the step such an
answer carries). The pin is taken, charged and bounded as any other (``Channels.pin``),
only when there is a version. A hold that runs out is answered "no_newer"; a reader that
stops waiting says "unhold", and a held request dies with its connection. The welcome
tells clients the longest hold (``limits.max_pin_hold_seconds``): an older daemon does not,
and its clients pin as before.

A sharded publisher's ranks each publish a *part* (``parts``, ``part``, ``shapes``: each
shard's global shape by flat key, ``within``): the answer says whether that part made
the version visible. A rank that checkpoints publishes the slot of its commit as its part
(``job``, as ``save(..., publish=)`` does; ``metadata`` then overrides the commit's). A
pin of a sharded version answers with every part's ring, slot, structure and tree
(``parts``), and each part's segments follow in "ring_fds" frames naming the part; the
connection keeps what it was sent per ring and per part.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from shmstage import segment
from shmstage.protocol import ErrorCode, Frame
from shmstage_daemon import requests
from shmstage_daemon.channels import Channels, Pin, Version
from shmstage_daemon.requests import RequestError
from shmstage_daemon.session import Handler, Session
from shmstage_daemon.slot import Slot, SlotState
from shmstage_daemon.store import StagedLayout, Store, StoreError

log = logging.getLogger("shmstaged.session")

#: The longest a reader may wait for a version's checksums in one "checksums" request.
MAX_CHECKSUM_WAIT_S: Final = 60.0
#: How long a sharded version's first part waits for the others, unless it says.
DEFAULT_PART_WAIT_S: Final = 60.0
#: The longest a "pin" is held for a version to come (``hold``; the welcome's
#: ``limits.max_pin_hold_seconds``): a reader waiting longer asks again, so that a request
#: is never kept long for a client that stopped listening.
MAX_PIN_HOLD_S: Final = 60
#: Pin requests one connection may have held at once. A subscriber holds one while it
#: waits; the rest is slack for one it stopped waiting in whose "unhold" never came. A
#: connection asking for more is refused: a flood of held requests costs nothing.
MAX_HELD_PINS: Final = 4


@dataclass(eq=False)
class HeldPin:
    """A "pin" of no version yet, held until one newer than ``newer_than`` is visible or
    ``timer`` answers that none came."""

    frame: Frame
    newer_than: int | None
    #: Descriptors per message the reader takes (``max_fds``), checked when it asked.
    batch: int
    timer: asyncio.TimerHandle


class Publishing:
    """The channel ops of one session: what it publishes, the channel it follows, the
    ring slots it was sent, and the announcement of versions to it."""

    def __init__(
        self,
        session: Session,
        store: Store,
        channels: Channels,
        checksum: Callable[[Version, int], None],
    ) -> None:
        self._session = session
        self._store = store
        self._channels = channels
        #: Start checksumming a version just made visible (``versionsums``), as a uid's.
        self._checksum = checksum
        #: The subscription: its request's id (the "version" frames carry it), the channel.
        self._request = 0
        self._channel = 0
        #: The rings this connection was sent (layout ids: one per part of the last version
        #: pinned), and the slots of each it has.
        self._sent: dict[int, set[int]] = {}
        #: The last version tree this connection was sent per part (packed): not sent again.
        self._trees: dict[int, bytes] = {}
        #: Each layout's shard shapes last checked (a sharded publisher sends them with
        #: every part, unchanged while its structure is).
        self._shapes: dict[int, dict[str, list[int]]] = {}
        #: The newest step to announce, the last announced, and whether a send is under
        #: way: a reader that is slow to read is told the newest, never a backlog.
        self._newest: int | None = None
        self._told: int | None = None
        self._telling = False
        #: This connection's held pin requests, by request id (see the module).
        self._held: dict[int, HeldPin] = {}
        #: Held by an answer that sends slots (a pin's, a ring's) while it decides which
        #: this connection lacks and sends them: a held pin is answered beside the
        #: session's requests, and two answers interleaved would each think the slots
        #: the other is sending are sent.
        self._sending = asyncio.Lock()

    def ops(self) -> dict[str, Handler]:
        return {
            "publish": self.publish,
            "subscribe": self.subscribe,
            "pin": self.pin,
            "unhold": self.unhold,
            "unpin": self.unpin,
            "checksums": self.checksums,
            "ring": self.ring,
            "offer": self.offer,
        }

    def close(self) -> None:
        for held in self._held.values():
            held.timer.cancel()
        self._held.clear()
        self._channels.end_session(self._session.id)

    async def publish(self, frame: Frame) -> None:
        body = frame.body
        session = self._session
        staged = self._store.get(session.id, body["layout"])
        slot = self._store.slot(staged, body["slot"])
        share = body.get("share", [])
        if not all(isinstance(gid, int) and not isinstance(gid, bool) for gid in share):
            raise RequestError(ErrorCode.BAD_REQUEST, "publish.share must be a list of gids")
        if "parts" in body:
            await self._publish_part(frame, staged, slot, share)
            return
        if "job" in body:  # save(..., publish=): the committed slot, as the commit named it
            packed_tree, tree, metadata = self._saved(body, staged, slot)
        else:
            packed_tree, tree, metadata = self._filled(body, staged, slot)
        version, told = self._channels.publish(
            session.peer.uid,
            body["name"],
            body["step"],
            staged,
            slot,
            tree=tree,
            metadata=metadata,
            packed_tree=packed_tree,
            share=share,
            job=body.get("job"),
        )
        if "job" not in body:
            self._store.release_slot(session.id, staged, slot)  # FREE, holding the version
        for subscription in told:
            subscription.notify(version.step)
        await session.send(
            "published",
            frame.id,
            {"name": body["name"], "step": version.step, "subscribers": len(told)},
        )
        self._checksum_later([version], session.peer.uid)

    def _saved(
        self, body: dict[str, Any], staged: StagedLayout, slot: Slot
    ) -> tuple[bytes, Any, dict[str, Any]]:
        """A publish of the slot a commit of this connection's just handed to its job
        (``body["job"]``): the commit's tree, and its metadata unless the publish gives the
        readers' own. Only a slot of this connection's layouts that still holds that very
        job's checkpoint: a job id of anyone else's, or of a slot refilled since, is
        refused."""
        held = slot.held
        if held is None or held.job != body["job"]:
            raise RequestError(
                ErrorCode.SLOT_NOT_OWNED,
                f"slot {slot.index} of layout {staged.id} does not hold job "
                f"{body['job']!r:.40} (never committed by this client, or refilled since); "
                "publish right after the save, naming its own job",
            )
        tree, metadata = held.tree, held.metadata
        if "metadata" in body:
            metadata = self._checked_metadata(body["metadata"])
        packed_tree = b""  # packed again from the decoded tree, unless the commit's is
        if staged.tree is not None and staged.tree[1] is tree:
            packed_tree = staged.tree[0]
        return packed_tree, tree, metadata

    @staticmethod
    def _checked_metadata(metadata: Any) -> dict[str, Any]:
        if not isinstance(metadata, dict):
            raise RequestError(ErrorCode.BAD_REQUEST, "publish.metadata must be a map")
        if len(metadata) > requests.MAX_METADATA_ENTRIES:
            raise RequestError(ErrorCode.BAD_REQUEST, "publish.metadata has too many entries")
        requests.check_json(metadata, "publish.metadata")
        return metadata

    def _filled(
        self, body: dict[str, Any], staged: StagedLayout, slot: Slot
    ) -> tuple[bytes, Any, dict[str, Any]]:
        """A publish of a slot this connection filled: its tree (checked as a commit's,
        once per layout and tree) and metadata."""
        if slot.state is not SlotState.FILLING or slot.holder != self._session.id:
            raise RequestError(
                ErrorCode.SLOT_NOT_OWNED,
                f"slot {slot.index} of layout {staged.id} is not being filled by this "
                "client; acquire it and copy into it before you publish it",
            )
        if "tree" not in body:
            raise RequestError(ErrorCode.BAD_REQUEST, "publish of a filled slot lacks tree")
        metadata = body.get("metadata", {})
        packed_tree, tree = requests.commit_tree(body["tree"], staged.layout, staged.tree)
        staged.tree = (packed_tree, tree)
        return packed_tree, tree, self._checked_metadata(metadata)

    async def _publish_part(
        self, frame: Frame, staged: StagedLayout, slot: Slot, share: list[int]
    ) -> None:
        """One rank's part of a sharded version (``channels``'s *Parts*): the slot it
        filled, or the slot its commit ``job`` just handed over (*Saved parts*)."""
        body, session = frame.body, self._session
        if "job" in body:
            packed_tree, tree, metadata = self._saved(body, staged, slot)
        else:
            packed_tree, tree, metadata = self._filled(body, staged, slot)
        shapes = self._checked_shapes(body.get("shapes", {}), staged)
        version, told = self._channels.publish_part(
            session.peer.uid,
            body["name"],
            body["step"],
            staged,
            slot,
            session=session.id,
            part=body.get("part", 0),
            count=body["parts"],
            within=body.get("within", DEFAULT_PART_WAIT_S),
            tree=tree,
            metadata=metadata,
            shapes=shapes,
            packed_tree=packed_tree,
            share=share,
            job=body.get("job"),
        )
        if version is not None:
            for subscription in told:
                subscription.notify(version.step)
        await session.send(
            "published",
            frame.id,
            {
                "name": body["name"],
                "step": body["step"],
                "subscribers": len(told),
                "visible": version is not None,
            },
        )
        if version is not None:
            self._checksum_later(version.every_part, session.peer.uid)

    def _checksum_later(self, parts: list[Version], uid: int) -> None:
        """Start checksumming a visible version's parts after the publisher's answer (never
        in its stall) and after the readers' wake-ups its publish spawned (held pins'
        answers, "version" frames: queued on the loop first), so that no checksum thread
        holds the GIL while they are sent."""
        loop = asyncio.get_running_loop()
        for part in parts:
            loop.call_soon(self._checksum, part, uid)

    def _checked_shapes(self, shapes: Any, staged: StagedLayout) -> dict[str, list[int]]:
        """Each shard's global shape, checked against the layout: one per tensor that has
        offsets, none for another, and the shard inside it."""
        if self._shapes.get(staged.id) == shapes:
            return self._shapes[staged.id]
        if not isinstance(shapes, dict):
            raise RequestError(ErrorCode.BAD_REQUEST, "publish.shapes must be a map")
        sharded = {spec.key: spec for spec in staged.layout.tensors if spec.offsets is not None}
        if shapes.keys() != sharded.keys():
            odd = sorted(shapes.keys() ^ sharded.keys())[:5]
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"publish.shapes must give the global shape of exactly the tensors that have "
                f"offsets; these differ: {odd}",
            )
        for key, spec in sharded.items():
            shape = shapes[key]
            assert spec.offsets is not None
            if (
                not isinstance(shape, list)
                or len(shape) != len(spec.shape)
                or not all(type(n) is int for n in shape)
                or any(
                    not 0 <= at <= at + n <= whole
                    for at, n, whole in zip(spec.offsets, spec.shape, shape, strict=True)
                )
            ):
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"publish.shapes[{key!r}] = {shape!r:.80}: the shard of shape "
                    f"{list(spec.shape)} at {list(spec.offsets)} does not lie inside it",
                )
        self._shapes = {staged.id: shapes}
        return shapes

    async def subscribe(self, frame: Frame) -> None:
        peer = self._session.peer
        owner = frame.body.get("owner", peer.uid)
        channel, newest = self._channels.subscribe(
            self._session.id, peer, owner, frame.body["name"], self._announce, self._offered
        )
        self._request, self._channel = frame.id, channel.id
        step = None if newest is None else newest.step
        self._told = step
        await self._session.send("subscribed", frame.id, {"channel": channel.id, "newest": step})

    async def offer(self, frame: Frame) -> None:
        """The caller's layout is its channel's ring ahead of the first version there
        (``Channels.offer``); followers are told, and may map it ("ring")."""
        body, session = frame.body, self._session
        staged = self._store.get(session.id, body["layout"])
        share = body.get("share", [])
        if not all(isinstance(gid, int) and not isinstance(gid, bool) for gid in share):
            raise RequestError(ErrorCode.BAD_REQUEST, "offer.share must be a list of gids")
        channel, told = self._channels.offer(session.peer.uid, body["name"], staged, share)
        for subscription in told:
            subscription.offered(staged.id)
        await session.send(
            "offered", frame.id, {"name": channel.name, "subscribers": len(told)}
        )

    def _offered(self, ring: int) -> None:
        """Tell this subscriber that a ring was offered (on its subscription, in order
        with the versions' frames)."""

        async def tell() -> None:
            await self._session.send(
                "ring_ready", self._request, {"channel": self._channel, "ring": ring}
            )

        self._session.spawn(tell())

    def _announce(self, step: int) -> None:
        self._newest = step
        if self._held:
            self._wake(step)
        if not self._telling and self._newest != self._told:
            self._telling = True
            self._session.spawn(self._tell())

    async def _tell(self) -> None:
        try:
            while self._newest is not None and self._newest != self._told:
                step = self._newest
                await self._session.send(
                    "version", self._request, {"channel": self._channel, "step": step}
                )
                self._told = step
        finally:
            self._telling = False

    async def pin(self, frame: Frame) -> None:
        batch = requests.fds_per_message(frame)
        hold = frame.body.get("hold", 0)
        if not 0 <= hold <= MAX_PIN_HOLD_S:  # NaN fails both
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"pin.hold {hold!r} must be 0 to {MAX_PIN_HOLD_S:g} seconds: how long to wait "
                "for a version newer than newer_than (0: answer at once); ask again to wait "
                "longer",
            )
        try:
            pin = self._take_pin(frame)
        except StoreError as exc:
            if exc.code != ErrorCode.NOT_RETAINED or not hold:
                raise
            self._hold(frame, hold, batch)  # nothing newer yet: the answer is the wake-up
            return
        await self._send_pinned(frame, pin, batch)

    def _take_pin(self, frame: Frame) -> Pin:
        """The pin a "pin" request asks for, now (``Channels.pin``: checked, charged)."""
        session, body = self._session, frame.body
        return self._channels.pin(
            session.id,
            session.peer,
            body["channel"],
            body.get("newer_than"),
            body.get("seconds"),
            time.monotonic(),
        )

    def _hold(self, frame: Frame, hold: float, batch: int) -> None:
        """Keep a "pin" of no version yet for ``hold`` seconds (see the module)."""
        if frame.id in self._held:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"request id {frame.id} is already a held pin request of this connection; "
                "give each request its own id",
            )
        if len(self._held) >= MAX_HELD_PINS:
            raise RequestError(
                ErrorCode.LIMIT_EXCEEDED,
                f"this connection already has {len(self._held)} pin requests waiting for a "
                f"version (pin.hold; at most {MAX_HELD_PINS}); wait for their answers, or "
                "unhold one, before holding another",
            )
        timer = asyncio.get_running_loop().call_later(hold, self._held_out, frame.id)
        self._held[frame.id] = HeldPin(frame, frame.body.get("newer_than"), batch, timer)

    def _wake(self, step: int) -> None:
        """Step ``step`` became visible: pin it for each held request it satisfies, on the
        loop now (the version cannot go before the answer is sent: the pin holds it)."""
        for request, held in list(self._held.items()):
            if held.newer_than is not None and step <= held.newer_than:
                continue
            del self._held[request]
            held.timer.cancel()
            try:
                pin = self._take_pin(held.frame)
            except StoreError as exc:  # over its uid's pins now, or no longer shared
                self._session.refused(exc.code, exc.message)
                self._session.spawn(self._session.send_error(request, exc.code, exc.message))
                continue
            self._told = pin.version.step  # the answer says so: no "version" frame too
            self._session.spawn(self._answer_held(held, pin))

    async def _answer_held(self, held: HeldPin, pin: Pin) -> None:
        try:
            await self._send_pinned(held.frame, pin, held.batch)
        except (RequestError, StoreError) as exc:  # the pin was ended: see _send_pinned
            self._session.refused(exc.code, exc.message)
            await self._session.send_error(held.frame.id, exc.code, exc.message)

    def _held_out(self, request: int) -> None:
        """A held pin request's hold ran out with no version newer than it asked for."""
        if self._held.pop(request, None) is not None:
            self._session.spawn(self._session.send("no_newer", request, self._no_newer()))

    def _no_newer(self) -> dict[str, Any]:
        channel = self._channels.by_id.get(self._channel)
        newest = None if channel is None else self._channels.newest(channel)
        return {"channel": self._channel, "newest": None if newest is None else newest.step}

    async def unhold(self, frame: Frame) -> None:
        """The reader stopped waiting in a held pin request: answer it "no_newer" now if it
        is still held. Either way it then has had, or is being sent, its one answer — a
        pin, perhaps, for the reader to end — which the reader waits for on that request
        alone (its frames' descriptors may hold up everything after them)."""
        request = frame.body["request"]
        held = self._held.pop(request, None)
        if held is not None:
            held.timer.cancel()
            await self._session.send("no_newer", request, self._no_newer())
        answer = {"request": request, "held": held is not None}
        await self._session.send("unheld", frame.id, answer)

    async def _send_pinned(self, frame: Frame, pin: Pin, batch: int) -> None:
        """Answer a "pin" with ``pin``: "pinned", then the segments of slots this
        connection lacks; the pin is ended if the answer cannot be sent whole."""
        try:
            async with self._sending:
                await self._send_pinned_now(frame, pin, batch)
        except BaseException:
            self._channels.unpin(self._session.id, pin.id)
            raise

    async def _send_pinned_now(self, frame: Frame, pin: Pin, batch: int) -> None:
        session = self._session
        version = pin.version
        parts = version.every_part
        sharded = bool(version.parts)
        try:
            # rings of earlier versions that this one does not use: the reader retires them
            self._sent = {part.staged.id: self._sent.get(part.staged.id, set()) for part in parts}
            entries = [self._part_entry(part, sharded) for part in parts]
            body: dict[str, Any] = {
                "pin": pin.id,
                "step": version.step,
                "seconds": pin.expires - time.monotonic(),  # left: a held pin's began earlier
                "metadata": version.metadata,
            }
            prepacked = None
            if sharded:
                first = entries[0]
                body.update(ring=first["ring"], slot=first["slot"], segments=0)
                body.update(sizes=first["sizes"], parts=entries)
            else:
                body.update(entries[0])
                tree = version.packed_tree
                prepacked = None if tree == self._trees.get(0) else {"tree": tree}
            try:
                await session.send("pinned", frame.id, body, prepacked=prepacked)
            except ValueError as exc:  # the structure does not fit one frame: nothing sent
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"version {version.step}'s structure is too large to send ({exc}); "
                    "publish fewer, larger tensors",
                ) from None
            for part in parts:
                self._trees[part.part] = part.packed_tree
            for part, entry in zip(parts, entries, strict=True):
                if entry["segments"]:
                    fields = {"pin": pin.id, "part": part.part} if sharded else {"pin": pin.id}
                    await session.send_segments(
                        frame.id, "ring_fds", fields, part.slot.segments, batch, writable=False
                    )
                    self._sent[part.staged.id].add(part.slot.serial)
        except segment.SegmentError as exc:
            raise RequestError(ErrorCode.NOT_RETAINED, str(exc)) from None

    def _part_entry(self, part: Version, sharded: bool) -> dict[str, Any]:
        """What a reader needs of one part (of the version itself, unsharded) to map its
        slot: ring, slot, segments to follow, sizes; the ring's structure the first time;
        a sharded part's tree when it differs from the last sent, and its shapes."""
        staged, slot = part.staged, part.slot
        sent = self._sent[staged.id]
        entry: dict[str, Any] = {
            "ring": staged.id,
            "slot": slot.serial,
            "segments": 0 if slot.serial in sent else len(slot.segments),
            "sizes": list(staged.layout.packing().sizes),
        }
        if not sent:
            entry["tensors"] = staged.layout.to_wire()
        checksums = self._channels.checksums_of(part)
        if checksums is not None:
            entry["checksums"] = checksums
        if sharded:
            entry["part"] = part.part
            entry["shapes"] = part.shapes or {}
            if part.packed_tree != self._trees.get(part.part):
                entry["tree"] = part.tree
        return entry

    async def ring(self, frame: Frame) -> None:
        """Every slot of the followed channel's ring, read-only, pinning nothing: a reader
        maps and registers them before its first version (``Subscriber.prepare``), and its
        pins then send none of them again. Checked as a pin is (``Channels.ring_of``); the
        descriptors are charged as a pin's are (``Session.send_segments``)."""
        async with self._sending:
            await self._send_ring(frame)

    async def _send_ring(self, frame: Frame) -> None:
        batch = requests.fds_per_message(frame)
        session = self._session
        staged = self._channels.ring_of(session.id, session.peer, frame.body["channel"])
        if staged is None:
            await session.send("ring_slots", frame.id, {"ring": None})
            return
        sent = self._sent.get(staged.id, set())
        self._sent = {staged.id: sent}  # as a pin of a version of this ring would
        slots = [slot for slot in staged.slots if slot.serial not in sent]
        sizes = list(staged.layout.packing().sizes)
        body: dict[str, Any] = {
            "ring": staged.id,
            "sizes": sizes,
            "slots": [slot.serial for slot in slots],
            "segments": len(sizes),
        }
        if not sent:
            body["tensors"] = staged.layout.to_wire()
        await session.send("ring_slots", frame.id, body)
        try:
            for slot in slots:
                fields = {"ring": staged.id, "slot": slot.serial}
                await session.send_segments(
                    frame.id, "slot_fds", fields, slot.segments, batch, writable=False
                )
                sent.add(slot.serial)
        except segment.SegmentError as exc:  # a slot's segment went: the reader asks again
            raise RequestError(ErrorCode.NOT_RETAINED, str(exc)) from None

    async def unpin(self, frame: Frame) -> None:
        held = self._channels.unpin(self._session.id, frame.body["pin"])
        await self._session.send("unpinned", frame.id, {"pin": frame.body["pin"], "held": held})

    async def checksums(self, frame: Frame) -> None:
        """The checksums of a pinned version, waiting for them up to ``seconds`` (0: only
        those known now); answered with null when there are none (yet)."""
        seconds = frame.body.get("seconds", 0.0)
        if not 0 <= seconds <= MAX_CHECKSUM_WAIT_S:  # NaN fails both
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"checksums.seconds {seconds!r} must be 0 to {MAX_CHECKSUM_WAIT_S:g}",
            )
        pin = frame.body["pin"]
        arrived: asyncio.Future[list[int] | None] = asyncio.get_running_loop().create_future()

        def tell(checksums: list[int] | None) -> None:
            if not arrived.done():
                arrived.set_result(checksums)

        part = frame.body.get("part", 0)
        known = self._channels.await_checksums(self._session.id, pin, tell, part)
        if known is not False or not seconds:
            await self._answer_checksums(frame.id, pin, None if known is False else known)
            return
        self._session.spawn(self._await_checksums(frame.id, pin, arrived, seconds))

    async def _await_checksums(
        self, request: int, pin: int, arrived: asyncio.Future[list[int] | None], seconds: float
    ) -> None:
        checksums = None
        with contextlib.suppress(TimeoutError):
            checksums = await asyncio.wait_for(asyncio.shield(arrived), seconds)
        await self._answer_checksums(request, pin, checksums)

    async def _answer_checksums(self, request: int, pin: int, checksums: list[int] | None) -> None:
        await self._session.send("checksummed", request, {"pin": pin, "checksums": checksums})
