"""Channels: the newest weights a publisher hands to readers on its node, as versions that
readers pin.

A trainer that publishes (``Stager.publish``) fills a slot of its layout as a save does;
then, instead of a commit, the filled slot becomes version ``step`` of its channel — its
uid's ``name``. The rules:

- *Whole or nothing.* A version is made only from a slot whose copy is complete (the
  publisher's "publish" comes after it; a publisher that dies before leaves a FILLING slot,
  which is freed, never a version). ``save(..., publish=name)`` publishes the slot of an
  acknowledged commit: the same bytes, no second copy.
- *Immutable.* A slot holding a version is refilled only when its publisher acquires it
  again, which forgets the version first; a *pinned* slot is never acquired. So what a
  reader pins cannot change while the pin holds.
- *Increasing.* A channel's versions grow in step, strictly, for as long as the channel
  exists (while it has a version alive or a subscriber): a publish of an older or equal
  step is refused.
- *The ring.* A channel's versions live in the slots of its publisher's layout, a fixed
  ring that readers map once, slot by slot (``Slot.serial``), and keep. A publisher whose
  structure changes registers a new layout: a new ring.
- *Lifetime.* A version lives while its slot holds it and its layout is the daemon's — a
  live publisher's, or retained after it went (``retention``: only a layout whose slot
  holds an acknowledged checkpoint, as with ``save(..., publish=)``). A publish-only
  layout is released when its publisher goes: its versions are then gone for new pins,
  and pinned ones stay readable until their pins end.
- *Pins are bounded like leases*: each lasts ``[retention] lease_seconds`` (at most
  ``max_lease_seconds``), one uid holds at most ``max_leases`` pins (leases are counted
  apart), and pins die with their connection. A publisher whose free slots are all
  pinned waits for one to end (at most a pin's time) — the daemon never revokes a pin.
  A reader other than the owner never pins the last unpinned slot of a layout with
  several, so the owner's next publish always has a slot, or waits for its own readers.
- *Checksums.* Each version's tensors are checksummed after it became visible, off the
  loop (``versionsums``); a pin's answer carries them once they are there (a save's
  come from its job, once durable, if they were not there before). Readers never wait for
  them unless they ask to (``await_checksums``): a version is never held back for them.
- *Parts.* A sharded publisher (the ranks of a DCP/FSDP trainer on this node, each its own
  connection, layout and slot; same uid) publishes each step as ``count`` parts. A part's
  slot stays FILLING, its connection's, until every part of that step arrived; then each
  slot is handed back holding its part and the version becomes visible whole, once. A
  step that never completes — the connection that published one of its parts, or the
  last one that published that part number, ended; a newer step became visible; or
  its ``within`` seconds from its first part ran out — is dropped and every slot it held
  handed back: nothing of it is ever visible. Readers pin a sharded version as one (every
  part's slot pinned together). The step rules are a version's: a part of a step not newer
  than the newest visible one is refused.
- *Saved parts.* A rank of a sharded trainer that checkpoints (DCP through
  ``ShmStageWriter``) publishes the slot its commit just handed to a job as its part
  (``job``): the same bytes, no second copy. Such a slot is the job's, never the
  connection's: a dropped step gives nothing back (the job frees the slot when its file is
  written), and the part counts as arrived only while the slot still holds that job's
  checkpoint (``Slot.held``: a failed job, or a slot the job freed and the trainer
  acquired again, fails its step as a released layout does). Once visible, the job goes
  on writing the slot a reader may pin, as ``save(..., publish=)``'s does: a pinned slot
  is never acquired, whether its job ended well or not.
- *Rings ahead.* A reader may map every slot of the followed channel's ring before it pins
  a version (``ring_of``: the layout of its newest version, or the layout its publisher
  offered ahead of the first, ``offer``), so that its first version costs the copy
  alone. Nothing is pinned: only a pin says which version the bytes are.
- *Access.* A channel is its owner's; the owner may share it with groups that the
  daemon's ``[server] publish_groups`` allows (``share``); members of those groups may
  subscribe and pin. Anyone else is told there is no such channel shared with them,
  whether or not it exists.

Only the event loop calls into this module; it does no I/O (timers go through
``schedule``), so its rules are tested without a daemon (``tests/daemon/test_channels``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from shmstage.protocol import ErrorCode
from shmstage_daemon.admission import Peer
from shmstage_daemon.retention import RetentionPolicy
from shmstage_daemon.slot import Slot, SlotState
from shmstage_daemon.store import StagedLayout, Store, StoreError

#: A channel's name: what a reader subscribes to.
MAX_NAME = 128
#: The most parts of one sharded version (ranks of one node publishing together).
MAX_PARTS = 256
#: The longest a sharded version's first part waits for the others (``within``).
MAX_PART_WAIT_S = 600.0


class Timer(Protocol):
    def cancel(self) -> None: ...


Schedule = Callable[[float, Callable[[], None]], Timer]


def call_later(delay: float, fn: Callable[[], None]) -> Timer:
    return asyncio.get_running_loop().call_later(delay, fn)


@dataclass(eq=False)
class Version:
    """One published state: a slot's bytes under a step. ``id`` orders it among the slots'
    checkpoints and versions (``Slot.age``)."""

    id: int
    step: int
    #: The channel's id.
    channel: int
    staged: StagedLayout
    slot: Slot
    tree: Any
    metadata: dict[str, Any]
    #: ``tree`` as msgpack, as it came: sent to readers as it is, and only when it is not
    #: the tree a reader's connection was sent last (``publishing``).
    packed_tree: bytes = b""
    #: The save whose committed slot this is (``save(..., publish=)``), if any.
    job: int | None = None
    #: Each tensor's CRC-32C, once computed after it became visible (``versionsums``),
    #: and whether that computation ended (with checksums or without: it failed, or the
    #: slot was refilled first).
    checksums: list[int] | None = None
    summed: bool = False
    #: Told the checksums (None: there will be none) once the computation ends.
    waiting: list[Callable[[list[int] | None], None]] = field(default_factory=list)
    #: Which part of a sharded version this is (see *Parts*); 0 for a version of one part.
    part: int = 0
    #: On a sharded version's part 0, which readers pin and the channel lists: every part in
    #: order, itself first. Empty for a version of one publisher.
    parts: list[Version] = field(default_factory=list)
    #: A sharded part's global shape of each shard (flat key -> shape); None if unsharded.
    shapes: dict[str, list[int]] | None = None
    #: The connection that filled a part's slot and holds it until every part arrived.
    session: int = 0

    @property
    def every_part(self) -> list[Version]:
        """The slots that make this version: its parts, or itself alone."""
        return self.parts or [self]


@dataclass(eq=False)
class Assembly:
    """The parts of one step of a sharded version that arrived, until all ``count`` did."""

    step: int
    count: int
    #: The groups to share with, as the first part asked.
    share: frozenset[int]
    parts: dict[int, Version] = field(default_factory=dict)
    timer: Timer | None = None


@dataclass(frozen=True)
class Dropped:
    """A sharded step given up before every part arrived, and why (for the daemon's log:
    the ranks that published a part see only ``complete`` staying False)."""

    uid: int
    channel: str
    step: int
    arrived: tuple[int, ...]
    count: int
    why: str


@dataclass(eq=False)
class Subscription:
    """A connection following a channel; ``notify`` is told each new newest step."""

    session: int
    peer: Peer
    notify: Callable[[int], None]
    #: Told the id of a ring offered ahead of the channel's next version (``offer``).
    offered: Callable[[int], None] = lambda ring: None


@dataclass(eq=False)
class Channel:
    id: int
    uid: int
    name: str
    #: Groups whose members may read it (as the publisher asked, within publish_groups).
    shared: frozenset[int] = frozenset()
    #: Versions possibly still alive, oldest first (``Channels.current`` says which).
    versions: list[Version] = field(default_factory=list)
    #: The highest step ever published while the channel existed.
    last_step: int | None = None
    subscribers: dict[int, Subscription] = field(default_factory=dict)
    #: Sharded versions whose parts are still arriving, by step (see *Parts*).
    assembling: dict[int, Assembly] = field(default_factory=dict)
    #: The connection that last published each part number: the one expected to publish
    #: that part of the next step too.
    part_sessions: dict[int, int] = field(default_factory=dict)
    #: The layout of the newest version of one part: the ring readers map ahead of a
    #: version (``ring_of``); None before the first and for a sharded channel.
    ring: StagedLayout | None = None


@dataclass(eq=False)
class Pin:
    id: int
    session: int
    uid: int
    version: Version
    granted: float
    expires: float
    timer: Timer | None = None


def check_name(name: str) -> None:
    if not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise StoreError(
            ErrorCode.BAD_REQUEST,
            f"channel name {name[:MAX_NAME]!r} must be 1 to {MAX_NAME} printable characters",
        )


class Channels:
    """Every channel, its versions, its subscribers, and the pins on its versions."""

    def __init__(
        self,
        store: Store,
        policy: Callable[[], RetentionPolicy],
        publish_groups: Callable[[], frozenset[int]],
        on_free: Callable[[StagedLayout, Slot], None],
        schedule: Schedule = call_later,
        on_dropped: Callable[[Dropped], None] = lambda dropped: None,
    ) -> None:
        self._store = store
        #: Read at each use: a reload may change them.
        self._policy = policy
        self._publish_groups = publish_groups
        #: The last pin on a slot ended: a waiting fill may take it, a released layout go.
        self._on_free = on_free
        #: A sharded step was dropped unfinished: the shell logs it (this module does no I/O).
        self._on_dropped = on_dropped
        self._schedule = schedule
        self.channels: dict[tuple[int, str], Channel] = {}
        self.by_id: dict[int, Channel] = {}
        self.pins: dict[int, Pin] = {}
        self._channel_ids = itertools.count(1)
        self._pin_ids = itertools.count(1)

    # -- versions ----------------------------------------------------------------

    def current(self, version: Version) -> bool:
        """Whether a version is still there to be pinned (see the module's *Lifetime*):
        every part of it."""
        return all(self._holds(part) for part in version.every_part)

    def _holds(self, part: Version) -> bool:
        staged, slot = part.staged, part.slot
        return (
            slot.version is part
            and not staged.released
            and self._store.layouts.get(staged.id) is staged
            and slot in staged.slots
        )

    def newest(self, channel: Channel) -> Version | None:
        channel.versions = [v for v in channel.versions if self.current(v)]
        return channel.versions[-1] if channel.versions else None

    def publish(
        self,
        uid: int,
        name: str,
        step: int,
        staged: StagedLayout,
        slot: Slot,
        *,
        tree: Any,
        metadata: dict[str, Any],
        packed_tree: bytes = b"",
        share: Collection[int] = (),
        job: int | None = None,
    ) -> tuple[Version, list[Subscription]]:
        """Make ``slot`` (filled, its copy complete) version ``step`` of ``uid``'s channel
        ``name``; returns it and the subscriptions to tell. The caller has checked that the
        publisher holds the slot (or that it holds the commit being published)."""
        channel = self._publishable(uid, name, step, share)
        version = self._version(
            channel, step, staged, slot, tree, metadata, packed_tree, job=job
        )
        slot.version = version
        return version, self._visible(channel, version, frozenset(share))

    def publish_part(
        self,
        uid: int,
        name: str,
        step: int,
        staged: StagedLayout,
        slot: Slot,
        *,
        session: int,
        part: int,
        count: int,
        within: float,
        tree: Any,
        metadata: dict[str, Any],
        shapes: dict[str, list[int]],
        packed_tree: bytes = b"",
        share: Collection[int] = (),
        job: int | None = None,
    ) -> tuple[Version | None, list[Subscription]]:
        """Part ``part`` of ``count`` of version ``step`` (see *Parts*): ``slot``, filled by
        ``session`` and still FILLING, its — or, with ``job``, the slot that job of
        ``session``'s persists (*Saved parts*; the caller checked that it holds the job's
        checkpoint). Returns (None, []) while parts are missing; the part that completes
        the version gets it and the subscriptions to tell, every FILLING part's slot handed
        back holding its part. ``within``: seconds from a step's first part until it is
        dropped unless complete."""
        if not (0 < count <= MAX_PARTS and 0 <= part < count):
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"part {part} of {count}: a sharded version has 1 to {MAX_PARTS} parts, "
                "numbered from 0",
            )
        channel = self._publishable(uid, name, step, share)
        assembly = channel.assembling.get(step)
        if assembly is None:
            if not (math.isfinite(within) and 0 < within <= MAX_PART_WAIT_S):
                raise StoreError(
                    ErrorCode.BAD_REQUEST,
                    f"publish.within {within!r} must be a number of seconds in "
                    f"(0, {MAX_PART_WAIT_S:g}]",
                )
            assembly = Assembly(step, count, frozenset(share))
            channel.assembling[step] = assembly
            assembly.timer = self._schedule(
                within, lambda: self._abandon(channel, step, f"its {within:g} s ran out")
            )
        elif assembly.count != count:
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"step {step} of channel {name!r} was begun as {assembly.count} parts, not "
                f"{count}: every rank of the node must publish with the same part count",
            )
        if part in assembly.parts:
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"part {part} of step {step} of channel {name!r} was already published; "
                "each rank publishes its own part number once per step",
            )
        channel.part_sessions[part] = session
        assembly.parts[part] = self._version(
            channel, step, staged, slot, tree, metadata, packed_tree,
            part=part, shapes=shapes, session=session, job=job,
        )
        if len(assembly.parts) < count:
            return None, []
        self._forget_assembly(channel, assembly)
        parts = [assembly.parts[index] for index in range(count)]
        gone = [part.part for part in parts if not self._waiting(part)]
        if gone:  # the arriving part's slot stays its publisher's, as for any refusal
            self._give_back(other for other in parts if other.slot is not slot)
            raise StoreError(
                ErrorCode.NOT_RETAINED,
                f"step {step} of channel {name!r} is dropped: the slot of part(s) {gone} "
                "was given up before every part arrived (its publisher released its "
                "layout, or its checkpoint failed or was refilled); nothing of step "
                f"{step} is visible — publish the next step",
            )
        head = parts[0]
        head.parts = parts
        for each in parts:
            each.slot.version = each
            if each.job is None:  # a saved part's slot stays its job's until written
                self._store.release_slot(each.session, each.staged, each.slot)
        return head, self._visible(channel, head, assembly.share)

    def offer(
        self, uid: int, name: str, staged: StagedLayout, share: Collection[int] = ()
    ) -> tuple[Channel, list[Subscription]]:
        """``staged`` (the caller's) is the ring of ``uid``'s channel ``name`` from now,
        ahead of its first version there: readers map it before a version (``ring_of``),
        and ``share`` lets other users' readers follow the channel already. Returns the
        channel and the subscriptions to tell. A layout is offered for one channel at a
        time: offering it for another forgets the offer of a channel never published."""
        channel = self._publishable(uid, name, None, share)
        for other in [c for c in self.channels.values() if c.uid == uid and c is not channel]:
            if other.ring is staged and other.last_step is None:
                other.ring = None
                self._prune(other)
        channel.ring = staged
        channel.shared = frozenset(share)
        told = [s for s in channel.subscribers.values() if self.may_read(s.peer, channel)]
        return channel, told

    def _ring_held(self, channel: Channel) -> bool:
        staged = channel.ring
        return (
            staged is not None
            and not staged.released
            and self._store.layouts.get(staged.id) is staged
        )

    def _version(
        self,
        channel: Channel,
        step: int,
        staged: StagedLayout,
        slot: Slot,
        tree: Any,
        metadata: dict[str, Any],
        packed_tree: bytes,
        **rest: Any,
    ) -> Version:
        """A new version (or a sharded version's part) of ``channel``: the tree is kept packed
        as it came, or packed once here, for the readers it is sent to."""
        packed = packed_tree or msgpack.packb(tree, use_bin_type=True)
        return Version(
            self._store.next_id(), step, channel.id, staged, slot, tree, metadata, packed, **rest
        )

    def _publishable(
        self, uid: int, name: str, step: int | None, share: Collection[int]
    ) -> Channel:
        """The channel a version (or part) of ``step`` may be published to (a ring offered
        to: None), opened if new; raises what refuses it."""
        check_name(name)
        allowed = self._publish_groups()
        refused = sorted(set(share) - allowed)
        if refused:
            raise StoreError(
                ErrorCode.NOT_ALLOWED,
                f"channel {name!r} cannot be shared with gid(s) {refused}: shmstaged's "
                "[server] publish_groups does not list them; ask its operator, or share "
                "with a listed group",
            )
        channel = self.channels.get((uid, name))
        if step is None:
            return channel if channel is not None else self._open(uid, name)
        if channel is not None and channel.last_step is not None and step <= channel.last_step:
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"step {step} of channel {name!r} is not newer than its step "
                f"{channel.last_step}: versions of a channel only grow in step; publish a "
                "larger step (or a new channel name)",
            )
        if not -(1 << 63) <= step < 1 << 63:
            raise StoreError(ErrorCode.BAD_REQUEST, f"step {step} does not fit 64 bits")
        return channel if channel is not None else self._open(uid, name)

    def _visible(
        self, channel: Channel, version: Version, share: frozenset[int]
    ) -> list[Subscription]:
        """``version`` (its slots holding it) is the channel's newest: steps below it can
        never be shown, so their unfinished parts go; returns the subscriptions to tell."""
        channel.versions = [v for v in channel.versions if self.current(v)] + [version]
        channel.last_step = version.step
        channel.shared = share
        channel.ring = None if version.parts else version.staged
        for step in [step for step in channel.assembling if step < version.step]:
            self._abandon(channel, step, f"step {version.step} became visible first")
        told = [s for s in channel.subscribers.values() if self.may_read(s.peer, channel)]
        for other in [c for c in self.channels.values() if c.uid == channel.uid]:
            if other is not channel:
                self._prune(other)  # a publisher naming a new channel each time hoards nothing
        return told

    def _waiting(self, part: Version) -> bool:
        """Whether a waiting part's slot still holds it: held by the connection that filled
        it, or (a saved part) still holding its job's checkpoint — not given up with its
        layout or its connection, not failed, not acquired again."""
        staged, slot = part.staged, part.slot
        if staged.released or self._store.layouts.get(staged.id) is not staged:
            return False
        if part.job is not None:
            held = slot.held
            return held is not None and held.job == part.job
        return self._filling(part)

    @staticmethod
    def _filling(part: Version) -> bool:
        slot = part.slot
        return slot.state is SlotState.FILLING and slot.holder == part.session

    def _give_back(self, parts: Iterable[Version]) -> None:
        """Hand back the slots of a dropped step's parts that their connections still
        hold; a saved part's slot is its job's, which frees it once written."""
        for part in parts:
            if part.job is None and self._waiting(part):
                self._store.release_slot(part.session, part.staged, part.slot)

    def _forget_assembly(self, channel: Channel, assembly: Assembly) -> None:
        channel.assembling.pop(assembly.step, None)
        if assembly.timer is not None:
            assembly.timer.cancel()

    def _abandon(self, channel: Channel, step: int, why: str) -> None:
        """Drop step ``step``'s unfinished parts, handing their slots back (see *Parts*)."""
        assembly = channel.assembling.get(step)
        if assembly is None:
            return
        arrived = tuple(sorted(assembly.parts))
        self._on_dropped(
            Dropped(channel.uid, channel.name, step, arrived, assembly.count, why)
        )
        self._forget_assembly(channel, assembly)
        self._give_back(assembly.parts.values())
        self._prune(channel)

    def checksummed(self, version: Version, checksums: list[int] | None) -> None:
        """The computation of ``version``'s checksums ended: keep them while the version
        still holds its bytes (a result for a refilled slot describes other bytes; a
        released layout's pinned slot still holds them), and tell the waiting."""
        version.summed = True
        if checksums is not None and version.slot.version is version:
            version.checksums = checksums
        waiting, version.waiting = version.waiting, []
        for tell in waiting:
            tell(self.checksums_of(version))

    def checksums_of(self, version: Version) -> list[int] | None:
        """The version's checksums, if known now: computed after it became visible, or
        (``save(..., publish=)``) those its job computed writing the files, once durable."""
        if version.checksums is not None:
            return version.checksums
        held = version.slot.held
        if version.job is not None and held is not None and held.job == version.job:
            return held.checksums
        return None

    def await_checksums(
        self,
        session: int,
        pin_id: int,
        tell: Callable[[list[int] | None], None],
        part: int = 0,
    ) -> list[int] | bool | None:
        """The checksums of the version (of its part ``part``) that ``session``'s pin
        ``pin_id`` holds: the list, None when there will be none, or False when they are
        still being computed — ``tell`` then gets them (or None) once the computation
        ends."""
        pin = self.pins.get(pin_id)
        if pin is None or pin.session != session:
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"pin {pin_id} is not held by this connection (it ended, or never was); "
                "ask for checksums of a version while it is pinned",
            )
        parts = pin.version.every_part
        if not 0 <= part < len(parts):
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"checksums.part {part}: the pinned version has {len(parts)} part(s)",
            )
        version = parts[part]
        known = self.checksums_of(version)
        if known is not None or version.summed:
            return known
        version.waiting.append(tell)
        return False

    def summary(self, channel: Channel) -> dict[str, Any]:
        """What ``shmstage status`` shows of a channel, as plain data (``status`` decides
        who sees it)."""
        newest = self.newest(channel)
        parts = [] if newest is None else newest.every_part
        return {
            "uid": channel.uid,
            "name": channel.name,
            "newest_step": None if newest is None else newest.step,
            "versions": len(channel.versions),
            "slots": sum(len(part.staged.slots) for part in parts),
            "bytes": sum(part.staged.layout.nbytes for part in parts),
            "checksummed": bool(parts)
            and all(self.checksums_of(part) is not None for part in parts),
            "pins": sum(1 for pin in self.pins.values() if pin.version.channel == channel.id),
            "subscribers": len(channel.subscribers),
            "shared_gids": sorted(channel.shared),
        }

    def _open(self, uid: int, name: str) -> Channel:
        channel = Channel(next(self._channel_ids), uid, name)
        self.channels[(uid, name)] = channel
        self.by_id[channel.id] = channel
        return channel

    def _prune(self, channel: Channel) -> None:
        """Forget a channel with nothing alive and nobody following it."""
        if channel.subscribers or channel.assembling or self.newest(channel) is not None:
            return
        if channel.last_step is None and self._ring_held(channel):
            return  # offered ahead of its first version
        if any(pin.version.channel == channel.id for pin in self.pins.values()):
            return  # its step must keep growing while a reader holds one of its versions
        self.channels.pop((channel.uid, channel.name), None)
        self.by_id.pop(channel.id, None)

    # -- readers -----------------------------------------------------------------

    def may_read(self, peer: Peer, channel: Channel) -> bool:
        if peer.uid == channel.uid:
            return True
        return bool((peer.groups | {peer.gid}) & channel.shared & self._publish_groups())

    def subscribe(
        self,
        session: int,
        peer: Peer,
        owner: int,
        name: str,
        notify: Callable[[int], None],
        offered: Callable[[int], None] = lambda ring: None,
    ) -> tuple[Channel, Version | None]:
        """Follow ``owner``'s channel ``name``; returns it and its newest version now.

        One's own channel may be followed before its first version; another user's only
        once it exists and is shared with one of the follower's groups (refused the same
        way otherwise, so that the refusal tells nothing about other users' channels)."""
        check_name(name)
        if any(session in channel.subscribers for channel in self.channels.values()):
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                "this connection already follows a channel; subscribe to another on a "
                "connection of its own",
            )
        channel = self.channels.get((owner, name))
        if owner != peer.uid and (channel is None or not self.may_read(peer, channel)):
            raise StoreError(
                ErrorCode.NOT_ALLOWED,
                f"uid {peer.uid} may not follow channel {name!r} of uid {owner}: it is not "
                "shared with any of its groups (or not published yet); its publisher "
                "shares it with publish(..., share=[group]) for a group in shmstaged's "
                "[server] publish_groups",
            )
        if channel is None:
            channel = self._open(owner, name)
        channel.subscribers[session] = Subscription(session, peer, notify, offered)
        return channel, self.newest(channel)

    def pin(
        self,
        session: int,
        peer: Peer,
        channel_id: int,
        newer_than: int | None,
        seconds: float | None,
        now: float,
    ) -> Pin:
        """Pin the channel's newest version, if newer than ``newer_than``: its slot is not
        refilled until ``unpin``, the pin's time, or the connection's end. Refused with
        not_retained only when there is no such version (a held pin request then waits for
        one, ``publishing``): every check of the request itself comes first."""
        channel = self._followed(session, peer, channel_id)
        policy = self._policy()
        if seconds is None:
            seconds = policy.lease_seconds
        if not (math.isfinite(seconds) and seconds > 0):
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"pin.seconds {seconds!r} must be a finite number of seconds > 0",
            )
        seconds = min(seconds, policy.max_lease_seconds)
        version = self.newest(channel)
        if version is None or (newer_than is not None and version.step <= newer_than):
            raise StoreError(
                ErrorCode.NOT_RETAINED,
                f"channel {channel.name!r} has no version"
                + (f" newer than step {newer_than}" if newer_than is not None else "")
                + " in shmstaged's memory now; wait for the next one",
            )
        mine = sum(1 for pin in self.pins.values() if pin.uid == peer.uid)
        if mine >= policy.max_leases:
            raise StoreError(
                ErrorCode.LIMIT_EXCEEDED,
                f"uid {peer.uid} already holds {mine} pins (limit {policy.max_leases}, "
                "[retention] max_leases); close versions it no longer reads",
            )
        for part in version.every_part if peer.uid != channel.uid else ():
            slot = part.slot
            others = [other for other in part.staged.slots if other is not slot]
            if others and not slot.leased and all(other.leased for other in others):
                raise StoreError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"every other slot of channel {channel.name!r} is pinned: uid "
                    f"{peer.uid} may not pin the last one (its publisher needs a slot); "
                    "retry once a pin ended",
                )
        pin = Pin(next(self._pin_ids), session, peer.uid, version, now, now + seconds)
        self.pins[pin.id] = pin
        for part in version.every_part:
            part.slot.pins.add(pin.id)
        pin.timer = self._schedule(seconds, lambda: self._expire(pin.id))
        return pin

    def _followed(self, session: int, peer: Peer, channel_id: int) -> Channel:
        """The channel ``session`` follows, if ``peer`` may still read it: what a pin and a
        ring's descriptors are both checked against."""
        channel = self.by_id.get(channel_id)
        if channel is None or session not in channel.subscribers:
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"this connection does not follow channel {channel_id}; subscribe first",
            )
        if not self.may_read(peer, channel):  # a reload may have taken the sharing away
            raise StoreError(
                ErrorCode.NOT_ALLOWED,
                f"channel {channel.name!r} of uid {channel.uid} is not shared with uid "
                f"{peer.uid} any more",
            )
        return channel

    def ring_of(self, session: int, peer: Peer, channel_id: int) -> StagedLayout | None:
        """The ring of the channel ``session`` follows — the layout its newest version came
        from, while the daemon holds it — for a reader to map before it pins a version
        (nothing is pinned: the bytes it reads there mean nothing until a pin says which
        version they are). None when there is none now: no version yet, or its publisher
        released it (the next version names the next one)."""
        channel = self._followed(session, peer, channel_id)
        newest = self.newest(channel)
        if newest is not None and newest.parts:
            raise StoreError(
                ErrorCode.BAD_REQUEST,
                f"channel {channel.name!r} is published by a sharded publisher (one ring "
                "per rank); its rings are mapped by the first wait(), not ahead of it",
            )
        return channel.ring if self._ring_held(channel) else None

    def _expire(self, pin_id: int) -> None:
        pin = self.pins.get(pin_id)
        if pin is not None:
            self._end(pin)

    def unpin(self, session: int, pin_id: int) -> bool:
        """End a pin; whether it still held (False: it had expired, or is not this
        connection's)."""
        pin = self.pins.get(pin_id)
        if pin is None or pin.session != session:
            return False
        self._end(pin)
        return True

    def end_session(self, session: int) -> None:
        """A connection went: its pins end, its subscription too, and every unfinished
        sharded version it published a part of, or whose part it would publish (it
        published that part number last), is dropped."""
        for pin in [pin for pin in self.pins.values() if pin.session == session]:
            self._end(pin)
        for channel in list(self.channels.values()):
            gone = {part for part, held in channel.part_sessions.items() if held == session}
            for part in gone:
                del channel.part_sessions[part]
            for step, assembly in list(channel.assembling.items()):
                if gone - assembly.parts.keys() or any(
                    part.session == session for part in assembly.parts.values()
                ):
                    self._abandon(channel, step, "a publishing rank's connection ended")
            if channel.subscribers.pop(session, None) is not None:
                self._prune(channel)

    def _end(self, pin: Pin) -> None:
        del self.pins[pin.id]
        if pin.timer is not None:
            pin.timer.cancel()
        for part in pin.version.every_part:
            part.slot.pins.discard(pin.id)
            if not part.slot.leased:
                self._on_free(part.staged, part.slot)
