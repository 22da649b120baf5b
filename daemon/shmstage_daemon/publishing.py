"""Publishing and subscribing: the conversation of ``channels`` (publish, subscribe, pin,
unpin, ring, offer).

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

A sharded publisher's ranks each publish a *part* (``parts``, ``part``, ``shapes``: each
shard's global shape by flat key, ``within``): the answer says whether that part made
the version visible. A pin of a sharded version answers with every part's ring, slot,
structure and tree (``parts``), and each part's segments follow in "ring_fds" frames
naming the part; the connection keeps what it was sent per ring and per part.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Final

from shmstage import segment
from shmstage.protocol import ErrorCode, Frame
from shmstage_daemon import requests
from shmstage_daemon.channels import Channels, Version
from shmstage_daemon.requests import RequestError
from shmstage_daemon.session import Handler, Session
from shmstage_daemon.slot import Slot, SlotState
from shmstage_daemon.store import StagedLayout, Store

log = logging.getLogger("shmstaged.session")

#: The longest a reader may wait for a version's checksums in one "checksums" request.
MAX_CHECKSUM_WAIT_S: Final = 60.0
#: How long a sharded version's first part waits for the others, unless it says.
DEFAULT_PART_WAIT_S: Final = 60.0


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

    def ops(self) -> dict[str, Handler]:
        return {
            "publish": self.publish,
            "subscribe": self.subscribe,
            "pin": self.pin,
            "unpin": self.unpin,
            "checksums": self.checksums,
            "ring": self.ring,
            "offer": self.offer,
        }

    def close(self) -> None:
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
            held = slot.held
            if held is None or held.job != body["job"]:
                raise RequestError(
                    ErrorCode.SLOT_NOT_OWNED,
                    f"slot {slot.index} of layout {staged.id} does not hold job "
                    f"{body['job']} (never committed, or refilled since); publish right "
                    "after the save",
                )
            tree, metadata = held.tree, held.metadata
            packed_tree = b""  # packed again from the decoded tree, unless the commit's is
            if staged.tree is not None and staged.tree[1] is tree:
                packed_tree = staged.tree[0]
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
        self._checksum(version, session.peer.uid)  # after the answer: never in the stall

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
        if len(metadata) > requests.MAX_METADATA_ENTRIES:
            raise RequestError(ErrorCode.BAD_REQUEST, "publish.metadata has too many entries")
        requests.check_json(metadata, "publish.metadata")
        return packed_tree, tree, metadata

    async def _publish_part(
        self, frame: Frame, staged: StagedLayout, slot: Slot, share: list[int]
    ) -> None:
        """One rank's part of a sharded version (``channels``'s *Parts*)."""
        body, session = frame.body, self._session
        if "job" in body:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                "save(..., publish=) publishes one process's checkpoint; a sharded version "
                "is published by each rank's publish of its part",
            )
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
            for part in version.every_part:  # after the answer: never in the stall
                self._checksum(part, session.peer.uid)

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
        if not self._telling:
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
        session = self._session
        pin = self._channels.pin(
            session.id,
            session.peer,
            frame.body["channel"],
            frame.body.get("newer_than"),
            frame.body.get("seconds"),
            time.monotonic(),
        )
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
                "seconds": pin.expires - pin.granted,
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
            self._channels.unpin(session.id, pin.id)
            raise RequestError(ErrorCode.NOT_RETAINED, str(exc)) from None
        except BaseException:
            self._channels.unpin(session.id, pin.id)
            raise

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
