"""Publishing and subscribing: the conversation of ``channels`` (publish, subscribe, pin,
unpin).

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
from shmstage_daemon.slot import SlotState
from shmstage_daemon.store import Store

log = logging.getLogger("shmstaged.session")

#: The longest a reader may wait for a version's checksums in one "checksums" request.
MAX_CHECKSUM_WAIT_S: Final = 60.0


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
        #: The ring this connection was sent (a layout id), and the slots of it it has.
        self._ring: int | None = None
        self._sent: set[int] = set()
        #: The last version tree this connection was sent (packed): not sent again.
        self._tree: bytes | None = None
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
            if slot.state is not SlotState.FILLING or slot.holder != session.id:
                raise RequestError(
                    ErrorCode.SLOT_NOT_OWNED,
                    f"slot {slot.index} of layout {staged.id} is not being filled by this "
                    "client; acquire it and copy into it before you publish it",
                )
            if "tree" not in body:
                raise RequestError(ErrorCode.BAD_REQUEST, "publish of a filled slot lacks tree")
            metadata = body.get("metadata", {})
            # what its readers will rebuild, checked as a commit's: once per layout and tree
            packed_tree, tree = requests.commit_tree(body["tree"], staged.layout, staged.tree)
            staged.tree = (packed_tree, tree)
            if len(metadata) > requests.MAX_METADATA_ENTRIES:
                raise RequestError(ErrorCode.BAD_REQUEST, "publish.metadata has too many entries")
            requests.check_json(metadata, "publish.metadata")
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

    async def subscribe(self, frame: Frame) -> None:
        peer = self._session.peer
        owner = frame.body.get("owner", peer.uid)
        channel, newest = self._channels.subscribe(
            self._session.id, peer, owner, frame.body["name"], self._announce
        )
        self._request, self._channel = frame.id, channel.id
        step = None if newest is None else newest.step
        self._told = step
        await self._session.send("subscribed", frame.id, {"channel": channel.id, "newest": step})

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
        staged, slot = version.staged, version.slot
        try:
            if staged.id != self._ring:  # a new ring: the reader maps its slots afresh
                self._ring = staged.id
                self._sent.clear()
            send = slot.serial not in self._sent
            body: dict[str, Any] = {
                "pin": pin.id,
                "step": version.step,
                "seconds": pin.expires - pin.granted,
                "ring": staged.id,
                "slot": slot.serial,
                "segments": len(slot.segments) if send else 0,
                "sizes": list(staged.layout.packing().sizes),
                "metadata": version.metadata,
            }
            if not self._sent:
                body["tensors"] = staged.layout.to_wire()
            tree = version.packed_tree
            prepacked = None if tree == self._tree else {"tree": tree}
            checksums = self._channels.checksums_of(version)
            if checksums is not None:
                body["checksums"] = checksums
            try:
                await session.send("pinned", frame.id, body, prepacked=prepacked)
                self._tree = tree
            except ValueError as exc:  # the structure does not fit one frame: nothing sent
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"version {version.step}'s structure is too large to send ({exc}); "
                    "publish fewer, larger tensors",
                ) from None
            if send:
                await session.send_segments(
                    frame.id, "ring_fds", {"pin": pin.id}, slot.segments, batch, writable=False
                )
                self._sent.add(slot.serial)
        except segment.SegmentError as exc:
            self._channels.unpin(session.id, pin.id)
            raise RequestError(ErrorCode.NOT_RETAINED, str(exc)) from None
        except BaseException:
            self._channels.unpin(session.id, pin.id)
            raise

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

        known = self._channels.await_checksums(self._session.id, pin, tell)
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
