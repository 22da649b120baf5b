"""``subscribe``: follow a channel's newest published weights from another process.

A trainer publishes each step's weights (``Stager.publish``); a rollout worker, an
evaluator or a serving sidecar on the same node follows them::

    with shmstage_client.subscribe("policy") as subscriber:
        step = None
        while training:
            with subscriber.wait(newer_than=step, timeout=600) as version:
                model.load_state_dict(version.state(device="cuda"))
                step = version.step

The subscriber's connection stays open and ``wait`` never polls: it asks the daemon for a
pin of a version newer than the one it has, and the daemon *holds* the request until such
a version is visible, pins it then and answers — the answer that wakes the reader is the
pin, one frame after the publish (a hold lasts at most the daemon's
``max_pin_hold_seconds``; ``wait`` asks again within its own timeout). A daemon that does
not hold pins (older than this client) pushes a frame when a new version is visible, and
``wait`` then pins the newest. The first time a version lands in a slot of the publisher's
ring, that slot is mapped read-only (``ring``) — kept for every later version there.
Closing the subscriber (or its process dying) ends its pins and its held request.

A version published by a sharded trainer (``shmstage_client.dcp.ShmStagePublisher``) is
made of one part per rank of the node, each in a slot of that rank's ring: ``wait`` pins
them as one and returns a ``ShardedVersion`` (``sharded``), which reassembles full
tensors from the parts or hands out one rank's own shards.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pwd
import time
from typing import Any, Final

import torch

from shmstage.layout import Layout
from shmstage_client.connection import DaemonConnection, RequestHandle
from shmstage_client.errors import DaemonLost, DaemonRefused, SaveError, SaveTimeout
from shmstage_client.restore.lease import lease_batch
from shmstage_client.subscribe.ring import PIECE_TIMEOUT_S, Ring
from shmstage_client.subscribe.sharded import ShardedVersion
from shmstage_client.subscribe.version import PIN_MARGIN_S, Version

log = logging.getLogger("shmstage.client")

#: Seconds to wait for the daemon's answers (this bounds a hung daemon, not a version).
REQUEST_TIMEOUT: Final = 30.0


class NoNewVersion(SaveTimeout):
    """``wait`` timed out: no version newer than asked became visible."""


def subscribe(
    name: str,
    *,
    owner: int | str | None = None,
    socket: str | os.PathLike[str] | None = None,
) -> Subscriber:
    """Follow channel ``name`` of ``owner`` (a uid or user name; default: this process's
    user). Another user's channel must be shared with one of this user's groups
    (``publish(..., share=[group])``, or ``Stager.offer(name, share=[group])`` ahead of
    the first version); otherwise this raises DaemonRefused. One's own channel may be
    followed before its first version."""
    return Subscriber(name, owner=owner, socket=socket)


class Subscriber:
    """A channel followed on a connection of its own (see the module)."""

    def __init__(
        self,
        name: str,
        *,
        owner: int | str | None = None,
        socket: str | os.PathLike[str] | None = None,
    ) -> None:
        self.name = name
        self._connection = DaemonConnection(
            socket, client_name=f"shmstage-subscriber pid {os.getpid()}"
        )
        body: dict[str, Any] = {"name": name}
        if owner is not None:
            body["owner"] = owner if isinstance(owner, int) else pwd.getpwnam(owner).pw_uid
        self._events: RequestHandle | None = None
        #: The longest the daemon holds a pin request for a version to come (see the
        #: module); None: it does not (an older daemon), and wait() pins once told.
        hold = (self._connection.welcome.get("limits") or {}).get("max_pin_hold_seconds")
        self._max_hold: float | None = (
            float(hold) if type(hold) in (int, float) and hold > 0 else None
        )
        #: The rings of the last version pinned (one per part), by id.
        self._rings: dict[int, Ring] = {}
        #: The last version tree the daemon sent per part: it sends one again only when it
        #: differs.
        self._trees: dict[int, Any] = {}
        try:
            self._events = self._connection.start("subscribe", body)
            reply = self._events.next(REQUEST_TIMEOUT)
        except BaseException:
            self.close()
            raise
        self.channel: int = reply.body["channel"]
        #: The newest step the daemon announced (None: no version yet).
        self.newest: int | None = reply.body["newest"]
        # Grow the descriptor table for a slot's segments now, not in the first wake-up:
        # a growth waits for an RCU grace period (6-12 ms; ``shmstage.descriptors``). Where
        # there is no room, the first pin says so.
        with contextlib.suppress(SaveError):
            lease_batch()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait(
        self, newer_than: int | None = None, timeout: float | None = None
    ) -> Version | ShardedVersion:
        """The newest version newer than step ``newer_than`` (any, if None), pinned: waits
        until the publisher publishes one, at most ``timeout`` seconds (None: for ever),
        then raises NoNewVersion. Use the Version as a context manager (or ``close()`` it):
        its slot is not refilled while it is pinned, and the publisher may wait for it.
        A sharded publisher's version is a ShardedVersion (the same calls, and its parts)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._take_announcements()
        while True:
            if self._max_hold is not None:  # the daemon pins it as soon as there is one
                hold = self._max_hold
                if deadline is not None:
                    hold = max(0.0, min(hold, deadline - time.monotonic()))
                version = self._pin(newer_than, hold)
                if version is not None:
                    return version
            elif self._wanted(newer_than):
                version = self._pin(newer_than)
                if version is not None:
                    return version
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise NoNewVersion(
                    f"no version of channel {self.name!r} newer than step {newer_than} "
                    f"within {timeout} s (newest announced: {self.newest})"
                )
            if self._max_hold is None:
                self._announced(self._next_event(left))

    def prepare(
        self,
        device: str | torch.device = "cuda",
        *,
        timeout: float | None = None,
        block: bool = False,
    ) -> int:
        """Map every slot of the channel's ring now and register them with CUDA for
        ``device`` in the background, so that the first version ``wait()`` returns is
        copied at the ring's speed — the copy alone — instead of paying the registration
        of its slot (~0.04-0.065 s/GiB on an H100 host). Call it once the subscriber is
        made, before waiting: a rollout worker that subscribes ahead of the trainer's
        next publish then loses no time to it. A method, not a ``subscribe()`` flag, so
        that its wait has a timeout and its refusals an obvious caller.

        The ring is the layout the publisher offered (``Stager.offer``, after
        ``reserve``) or published its newest version from: before either, this waits for
        the publisher's offer or first version, at most ``timeout`` seconds (None: for
        ever), then raises NoNewVersion; an announced version is kept for ``wait()``.
        Nothing is pinned: the bytes mapped mean something only through a pinned version.
        ``block``: also wait (within ``timeout``) until every slot is registered;
        otherwise a version that comes meanwhile waits for its slot's registration (slots
        register one after another, ~0.05 s/GiB each). A version from another ring (the
        publisher's structure changed) drops what was prepared and is copied as without
        it. Without CUDA (or for a CPU ``device``) the slots are mapped and nothing is
        registered. ``close()`` releases it all. Returns the number of slots mapped. Not
        for a sharded publisher's channel
        (DaemonRefused: its rings are mapped by the first ``wait()``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._take_announcements()
        while (ring := self._ask_ring()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise NoNewVersion(
                    f"channel {self.name!r} had no version, so no ring to prepare, within "
                    f"{timeout} s; its publisher offers one ahead with Stager.offer({self.name!r})"
                    " after reserve(), or prepare once it published"
                )
            if (frame := self._next_event(left)) is not None:
                self._announced(frame)
        target = torch.device(device)
        if target.type == "cuda" and torch.cuda.is_available():
            if target.index is None:  # the ring registers on threads whose device is 0
                target = torch.device("cuda", torch.cuda.current_device())
            ring.prepare(target)
            left = PIECE_TIMEOUT_S if deadline is None else max(0.0, deadline - time.monotonic())
            if block and not ring.registered(left):
                raise SaveTimeout(
                    f"registering the ring of channel {self.name!r} with CUDA did not end "
                    f"within {left:.1f} s; its first version will wait for what is left"
                )
        return ring.slots

    def _ask_ring(self) -> Ring | None:
        """The channel's ring with every slot mapped (the daemon sends the slots this
        connection lacks); None when the channel has none now."""
        body = {"channel": self.channel, "max_fds": lease_batch()}
        handle = self._connection.start("ring", body)
        try:
            reply = handle.next(REQUEST_TIMEOUT).body
            if reply["ring"] is None:
                return None
            ring = self._rings.get(reply["ring"])
            if ring is None:
                if "tensors" not in reply:
                    raise DaemonLost("shmstaged sent a ring never sent before without its tensors")
                layout = Layout.from_wire(reply["tensors"], max_tensors=1 << 30)
                ring = Ring(reply["ring"], layout, reply["sizes"])
            for ring_id in self._rings.keys() - {ring.id}:
                self._rings.pop(ring_id).retire()  # the daemon forgot them too
            self._rings[ring.id] = ring
            for slot in reply["slots"]:
                fields = {"ring": ring.id, "slot": slot}
                self._receive_slot(handle, ring, slot, reply["segments"], "slot_fds", fields)
            return ring
        finally:
            handle.finish()

    def _receive_slot(
        self,
        handle: RequestHandle,
        ring: Ring,
        slot: int,
        count: int,
        op: str,
        fields: dict[str, Any],
    ) -> None:
        """Map ``slot`` of ``ring`` from the ``op`` frames carrying its ``count`` segments,
        each with ``fields`` and the index of its first (forgotten if they do not all
        arrive: mapped again next time)."""
        received = 0
        try:
            while received < count:
                frame = handle.next(REQUEST_TIMEOUT)
                fds = frame.fds
                got = {name: frame.body.get(name) for name in fields}
                if frame.op != op or got != fields or frame.body["first"] != received:
                    for fd in fds:
                        os.close(fd)
                    raise DaemonLost(f"unexpected {frame.op} while receiving a ring's slot")
                ring.map(slot, received, fds)
                received += len(fds)
        except BaseException:
            ring.drop(slot)
            raise

    def _wanted(self, newer_than: int | None) -> bool:
        return self.newest is not None and (newer_than is None or self.newest > newer_than)

    def _next_event(self, timeout: float | None) -> Any:
        assert self._events is not None
        try:
            return self._events.next(timeout)
        except SaveTimeout:
            return None

    def _take_announcements(self) -> None:
        """Read the announcements that arrived since the last wait, without blocking."""
        while (frame := self._next_event(0)) is not None:
            self._announced(frame)

    def _announced(self, frame: Any) -> None:
        if frame is None or frame.op == "ring_ready":  # prepare() asks for the ring again
            return
        if frame.op != "version":
            raise DaemonLost(f"shmstaged sent {frame.op} on a subscription")
        step = frame.body["step"]
        if self.newest is None or step > self.newest:
            self.newest = step

    def _pin(self, newer_than: int | None, hold: float = 0.0) -> Version | ShardedVersion | None:
        """Pin the newest version newer than ``newer_than`` — with ``hold``, the first one
        visible within ``hold`` seconds, pinned by the daemon as it becomes visible — and
        map its slots if this is their first version here; None when there was none (or
        it was gone by then: refilled, its publisher gone): ask again."""
        asked = time.monotonic()
        body: dict[str, Any] = {"channel": self.channel, "newer_than": newer_than}
        body["max_fds"] = lease_batch()
        if hold:
            body["hold"] = hold
        handle = self._connection.start("pin", body)
        try:
            try:
                reply = handle.next(hold + REQUEST_TIMEOUT)
            except DaemonRefused as exc:
                if exc.code == "not_retained":
                    return None
                raise
            except SaveError:  # the daemon hung or went: no answer comes to settle
                raise
            except BaseException:  # KeyboardInterrupt: leave nothing held, nothing pinned
                if self._max_hold is not None:  # a daemon that knows "unhold"
                    self._unhold(handle)
                raise
            if reply.op == "no_newer":
                return None
            if hold:  # pinned when the version came, and the pin's time counted from then
                asked = time.monotonic()
            return self._take(handle, reply.body, asked)
        finally:
            handle.finish()

    def _unhold(self, handle: RequestHandle) -> None:
        """Settle a pin request that this subscriber stopped waiting in: the daemon
        answers it "no_newer" at once if it holds it — or it was answered meanwhile, and a
        pin that came is taken (its slots mapped, as the daemon now counts them sent here)
        and ended, never left behind for the pin's whole time."""
        unheld = self._connection.start("unhold", {"request": handle.id})
        try:
            answer = handle.next(REQUEST_TIMEOUT)  # its one answer, whichever it is
            if answer.op == "pinned":
                self._take(handle, answer.body, time.monotonic()).close()
        except SaveError as exc:  # a refused answer pinned nothing; a lost connection ends all
            log.debug("settling a held pin request of channel %r: %s", self.name, exc)
        finally:
            unheld.finish()

    def _take(
        self, handle: RequestHandle, pinned: dict[str, Any], asked: float
    ) -> Version | ShardedVersion:
        """The version a "pinned" answer gives, its slots mapped (unpinned if they do not
        all arrive). ``asked``: when the pin's ``seconds`` (what was left of it when the daemon
        answered) began, as near as this side knows."""
        sharded = "parts" in pinned
        entries = pinned["parts"] if sharded else [pinned]
        unpin = self._unpin
        try:
            for index, entry in enumerate(entries):
                if "tree" in entry:
                    self._trees[index] = entry["tree"]
                elif index not in self._trees:
                    raise DaemonLost("shmstaged pinned a version without its tree, never sent")
            rings = [self._ring_for(entry) for entry in entries]
            for ring_id in self._rings.keys() - {ring.id for ring in rings}:
                self._rings.pop(ring_id).retire()  # the daemon forgot it too
            for index, (entry, ring) in enumerate(zip(entries, rings, strict=True)):
                self._receive(handle, ring, entry, index if sharded else None)
        except BaseException:
            unpin(pinned["pin"])
            raise
        if self.newest is None or pinned["step"] > self.newest:
            self.newest = pinned["step"]
        expires = asked + pinned["seconds"] - PIN_MARGIN_S
        if not sharded:
            return Version(
                step=pinned["step"],
                metadata=pinned["metadata"],
                encoded=self._trees[0],
                ring=rings[0],
                slot=pinned["slot"],
                pin=pinned["pin"],
                expires=expires,
                unpin=unpin,
                fetch_checksums=self._fetch_checksums,
                checksums=pinned.get("checksums"),
            )
        parts = [
            Version(
                step=pinned["step"],
                metadata=pinned["metadata"],
                encoded=self._trees[index],
                ring=ring,
                slot=entry["slot"],
                pin=pinned["pin"],
                expires=expires,
                unpin=_pinned_as_a_whole,
                fetch_checksums=functools.partial(self._fetch_checksums, part=index),
                checksums=entry.get("checksums"),
            )
            for index, (entry, ring) in enumerate(zip(entries, rings, strict=True))
        ]
        return ShardedVersion(
            parts,
            layouts=[ring.layout for ring in rings],
            trees=[self._trees[index] for index in range(len(entries))],
            shapes=[entry.get("shapes", {}) for entry in entries],
            pin=pinned["pin"],
            unpin=unpin,
        )

    def _ring_for(self, pinned: dict[str, Any]) -> Ring:
        """A (part of a) version's ring: one mapped, or a new one (the publisher's
        structure changed: the old one is retired once no version reads it)."""
        ring = self._rings.get(pinned["ring"])
        if ring is not None:
            return ring
        if "tensors" not in pinned:
            raise DaemonLost("shmstaged pinned a version of a new ring without its structure")
        layout = Layout.from_wire(pinned["tensors"], max_tensors=1 << 30)
        ring = self._rings[pinned["ring"]] = Ring(pinned["ring"], layout, pinned["sizes"])
        return ring

    def _receive(
        self, handle: RequestHandle, ring: Ring, pinned: dict[str, Any], part: int | None
    ) -> None:
        """Map the slot's segments, which follow the answer when this connection was not
        sent them before (a sharded version's part by part, each frame naming its part)."""
        slot, count = pinned["slot"], pinned["segments"]
        if not count:
            if not ring.has(slot):
                raise DaemonLost(f"shmstaged sent no segments for slot {slot}, never mapped")
            return
        self._receive_slot(handle, ring, slot, count, "ring_fds", {"part": part})

    def _unpin(self, pin: int) -> bool:
        try:
            reply = self._connection.call("unpin", {"pin": pin}, timeout=REQUEST_TIMEOUT)
        except SaveError:
            return False
        return bool(reply.body.get("held"))

    def _fetch_checksums(
        self, pin: int, seconds: float, part: int | None = None
    ) -> list[int] | None:
        """The daemon's checksums for a pinned version (its part ``part``), waiting up to
        ``seconds`` for it to finish computing them (0: those it has now); None if there
        are none."""
        body: dict[str, Any] = {"pin": pin, "seconds": seconds}
        if part is not None:
            body["part"] = part
        reply = self._connection.call("checksums", body, timeout=seconds + REQUEST_TIMEOUT)
        checksums = reply.body["checksums"]
        return None if checksums is None else list(checksums)

    def close(self) -> None:
        """End the subscription and every pin it holds (the connection's end does)."""
        if self._events is not None:
            self._events.finish()
            self._events = None
        self._connection.close()
        rings, self._rings = self._rings, {}
        for ring in rings.values():
            ring.retire()


def _pinned_as_a_whole(pin: int) -> bool:
    """A sharded version's part does not unpin: the version does, once, for every part."""
    return True
