"""Channels, versions and pins, driven with no daemon: what a publish makes visible, what a
pin holds, who may read, and what ends with a connection.

``channels`` is pure (its timers go through ``schedule``): the tests below give it a real
``Store`` with a registered layout and fake timers, and state its rules.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from shmstage_daemon.admission import Peer
from shmstage_daemon.channels import Channels, Dropped, Version
from shmstage_daemon.retention import RetentionPolicy
from shmstage_daemon.slot import Held, Slot, SlotState
from shmstage_daemon.store import Limits, Store, StoreError

from shmstage.layout import Layout, TensorSpec
from shmstage.protocol import ErrorCode
from shmstage.segment import SegmentRef

PUBLISHER, READER, STRANGER = 1, 2, 3
UID, OTHER_UID, TEAM = 1000, 2000, 500
LAYOUT = Layout((TensorSpec("w", "F32", (1024,)),))
OWNER = Peer(pid=1, uid=UID, gid=UID, groups=frozenset())
MEMBER = Peer(pid=2, uid=OTHER_UID, gid=OTHER_UID, groups=frozenset({TEAM}))
OUTSIDER = Peer(pid=3, uid=OTHER_UID + 1, gid=OTHER_UID + 1, groups=frozenset())


class Timers:
    """Fake timers: each scheduled call waits until the test fires it."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, Callable[[], None], list[bool]]] = []

    def schedule(self, delay: float, fn: Callable[[], None]) -> _Handle:
        cancelled = [False]
        self.calls.append((delay, fn, cancelled))
        return _Handle(cancelled)

    def fire_all(self) -> None:
        for _delay, fn, cancelled in list(self.calls):
            if not cancelled[0]:
                fn()


class _Handle:
    def __init__(self, cancelled: list[bool]) -> None:
        self._cancelled = cancelled

    def cancel(self) -> None:
        self._cancelled[0] = True


class World:
    def __init__(self, slots: int = 2, publish_groups: frozenset[int] = frozenset({TEAM})) -> None:
        self.store = Store(Limits(shm_budget_bytes=1 << 30))
        for session, uid in ((PUBLISHER, UID), (READER, OTHER_UID), (STRANGER, UID + 7)):
            self.store.open_session(session, uid)
        refs = [[SegmentRef(f"seg-{n}", 4096)] for n in range(slots)]
        self.staged = self.store.add(PUBLISHER, LAYOUT, refs, 4096 * slots)
        self.policy = RetentionPolicy(max_leases=2, lease_seconds=60, max_lease_seconds=600)
        self.freed: list[Slot] = []
        self.timers = Timers()
        self.dropped: list[Dropped] = []
        self.channels = Channels(
            self.store,
            lambda: self.policy,
            lambda: publish_groups,
            lambda staged, slot: self.freed.append(slot),
            self.timers.schedule,
            on_dropped=self.dropped.append,
        )
        self.subscribed: list[int] = []

    def publish(self, step: int, name: str = "policy", share: tuple[int, ...] = ()) -> Version:
        """What the publisher does: acquire, fill, publish, hand the slot back."""
        slot = self.store.try_acquire(PUBLISHER, self.staged)
        assert slot is not None, "no free slot"
        version, _told = self.channels.publish(
            UID, name, step, self.staged, slot, tree={}, metadata={"step": step}, share=share
        )
        self.store.release_slot(PUBLISHER, self.staged, slot)
        return version

    def follow(self, session: int, peer: Peer, name: str = "policy") -> int:
        channel, _newest = self.channels.subscribe(
            session, peer, UID, name, self.subscribed.append
        )
        return channel.id


def test_a_published_version_is_the_channels_newest_until_a_newer_one() -> None:
    world = World()
    channel = world.follow(PUBLISHER + 10, OWNER)
    first = world.publish(1)
    assert world.channels.newest(world.channels.by_id[channel]) is first
    second = world.publish(2)
    assert world.channels.newest(world.channels.by_id[channel]) is second
    assert world.subscribed == [], "notify is the handler's to call, with the told list"


def test_steps_only_grow_and_a_refused_publish_leaves_the_slot_to_its_publisher() -> None:
    world = World()
    world.publish(5)
    slot = world.store.try_acquire(PUBLISHER, world.staged)
    assert slot is not None
    for step in (5, 4):
        with pytest.raises(StoreError, match=f"step {step} of channel 'policy' is not newer"):
            world.channels.publish(UID, "policy", step, world.staged, slot, tree={}, metadata={})
    assert slot.version is None and slot.state is SlotState.FILLING


def test_subscribers_allowed_to_read_are_the_ones_told() -> None:
    world = World()
    told: list[int] = []
    world.channels.subscribe(PUBLISHER + 10, OWNER, UID, "policy", told.append)
    world.publish(1, share=(TEAM,))
    world.channels.subscribe(READER, MEMBER, UID, "policy", told.append)
    slot = world.store.try_acquire(PUBLISHER, world.staged)
    assert slot is not None
    _version, tell = world.channels.publish(
        UID, "policy", 2, world.staged, slot, tree={}, metadata={}, share=()
    )
    assert [s.session for s in tell] == [PUBLISHER + 10], "unshared: the member is not told"


def test_a_pinned_slot_is_never_refilled_and_the_publisher_takes_another() -> None:
    world = World(slots=2)
    channel = world.follow(PUBLISHER + 10, OWNER)
    first = world.publish(1)
    pin = world.channels.pin(PUBLISHER + 10, OWNER, channel, None, None, now=0.0)
    assert pin.version is first
    second = world.publish(2)
    assert second.slot is not first.slot
    third = world.publish(3)  # the oldest free unpinned slot is the second's
    assert third.slot is second.slot and first.slot.version is first
    # with every slot pinned, nothing is free: the publisher waits (for a bounded pin)
    world.channels.pin(PUBLISHER + 10, OWNER, channel, None, None, now=0.0)
    assert world.store.try_acquire(PUBLISHER, world.staged) is None
    assert world.channels.unpin(PUBLISHER + 10, pin.id)
    assert world.freed == [first.slot], "the daemon hands a freed slot to a waiting fill"
    assert world.store.try_acquire(PUBLISHER, world.staged) is first.slot


def test_a_pin_asks_for_a_version_newer_than_a_step() -> None:
    world = World()
    channel = world.follow(PUBLISHER + 10, OWNER)
    with pytest.raises(StoreError, match="has no version in shmstaged's memory"):
        world.channels.pin(PUBLISHER + 10, OWNER, channel, None, None, now=0.0)
    world.publish(3)
    with pytest.raises(StoreError, match="no version newer than step 3") as refused:
        world.channels.pin(PUBLISHER + 10, OWNER, channel, 3, None, now=0.0)
    assert refused.value.code is ErrorCode.NOT_RETAINED
    assert world.channels.pin(PUBLISHER + 10, OWNER, channel, 2, None, now=0.0).version.step == 3


def test_a_pin_is_refused_not_retained_only_for_want_of_a_version_after_its_own_checks() -> None:
    """A held pin request (``publishing``) waits on not_retained alone: a request wrong in
    itself, or from a connection that follows no such channel, is refused at once."""
    world = World()
    channel = world.follow(PUBLISHER + 10, OWNER)
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(StoreError, match=r"pin\.seconds .* must be a finite") as refused:
            world.channels.pin(PUBLISHER + 10, OWNER, channel, None, seconds, now=0.0)
        assert refused.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(StoreError, match="does not follow channel") as refused:
        world.channels.pin(STRANGER, OUTSIDER, channel, None, None, now=0.0)
    assert refused.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(StoreError, match="has no version") as refused:
        world.channels.pin(PUBLISHER + 10, OWNER, channel, None, None, now=0.0)
    assert refused.value.code is ErrorCode.NOT_RETAINED and not world.channels.pins


def test_pins_are_bounded_in_count_and_time_and_end_with_their_connection() -> None:
    world = World(slots=3)
    channel = world.follow(PUBLISHER + 10, OWNER)
    world.publish(1)
    pins = [world.channels.pin(PUBLISHER + 10, OWNER, channel, None, 9999, now=0.0) for _ in "ab"]
    assert pins[0].expires == 600.0, "never past max_lease_seconds"
    with pytest.raises(StoreError, match=r"already holds 2 pins \(limit 2, \[retention\] max_le"):
        world.channels.pin(PUBLISHER + 10, OWNER, channel, None, None, now=0.0)
    world.timers.fire_all()  # both run out
    assert not world.channels.pins and not pins[0].version.slot.pins
    assert not world.channels.unpin(PUBLISHER + 10, pins[0].id), "an ended pin did not hold"
    world.channels.pin(PUBLISHER + 10, OWNER, channel, None, None, now=0.0)
    world.channels.end_session(PUBLISHER + 10)
    assert not world.channels.pins
    assert world.channels.by_id[channel].subscribers == {}


def test_another_user_reads_only_a_channel_shared_with_its_group_that_the_daemon_allows() -> None:
    world = World(publish_groups=frozenset({TEAM}))
    with pytest.raises(StoreError, match="not shared with any of its groups") as refused:
        world.follow(READER, MEMBER)  # not published yet: the same refusal
    assert refused.value.code is ErrorCode.NOT_ALLOWED
    world.publish(1)
    with pytest.raises(StoreError, match="not shared with any of its groups"):
        world.follow(READER, MEMBER)  # published, not shared
    with pytest.raises(StoreError, match=r"gid\(s\) \[501\]: shmstaged's \[server\] publish_gr"):
        world.publish(2, share=(501,))
    world.publish(2, share=(TEAM,))
    channel = world.follow(READER, MEMBER)
    assert world.channels.pin(READER, MEMBER, channel, None, None, now=0.0).version.step == 2
    with pytest.raises(StoreError, match="not shared with any of its groups"):
        world.follow(STRANGER, OUTSIDER)


def test_another_user_never_pins_the_last_unpinned_slot() -> None:
    world = World(slots=2, publish_groups=frozenset({TEAM}))
    owner_channel = world.follow(PUBLISHER + 10, OWNER)
    first = world.publish(1, share=(TEAM,))
    world.channels.pin(PUBLISHER + 10, OWNER, owner_channel, None, None, now=0.0)
    world.publish(2, share=(TEAM,))
    channel = world.follow(READER, MEMBER)
    with pytest.raises(StoreError, match="may not pin the last one"):
        world.channels.pin(READER, MEMBER, channel, None, None, now=0.0)
    assert first.slot.pins, "the owner's own pin stands"


def test_a_refilled_or_released_slots_version_is_gone() -> None:
    world = World(slots=1)
    channel = world.follow(PUBLISHER + 10, OWNER)
    version = world.publish(1)
    slot = world.store.try_acquire(PUBLISHER, world.staged)  # refilling: the version goes
    assert slot is version.slot and slot.version is None
    assert world.channels.newest(world.channels.by_id[channel]) is None
    world.store.release_slot(PUBLISHER, world.staged, slot)
    world.publish(2)
    world.store.mark_released(world.staged)
    assert world.channels.newest(world.channels.by_id[channel]) is None


def test_a_channel_with_nothing_alive_and_nobody_following_is_forgotten() -> None:
    world = World(slots=1)
    world.follow(PUBLISHER + 10, OWNER)
    world.publish(7)
    world.store.mark_released(world.staged)
    world.channels.end_session(PUBLISHER + 10)
    assert world.channels.channels == {}


def test_channels_a_publisher_left_behind_are_forgotten_at_its_next_publish() -> None:
    world = World(slots=1)
    for step, name in enumerate(("a", "b", "c")):
        world.publish(step, name=name)  # each refills the one slot: the last channel lives
    assert list(world.channels.channels) == [(UID, "c")]


def test_a_versions_checksums_are_kept_only_while_its_slot_holds_it_and_waiters_hear_once() -> None:
    world = World(slots=1)
    channel = world.follow(PUBLISHER + 10, OWNER)
    version = world.publish(1)
    pin = world.channels.pin(PUBLISHER + 10, OWNER, channel, None, None, now=0.0)
    heard: list[list[int] | None] = []
    assert world.channels.await_checksums(PUBLISHER + 10, pin.id, heard.append) is False
    with pytest.raises(StoreError, match=f"pin {pin.id} is not held by this connection"):
        world.channels.await_checksums(READER, pin.id, heard.append)  # another's pin
    world.channels.checksummed(version, [0xC0FFEE])
    assert heard == [[0xC0FFEE]] and world.channels.checksums_of(version) == [0xC0FFEE]
    assert world.channels.await_checksums(PUBLISHER + 10, pin.id, heard.append) == [0xC0FFEE]
    assert heard == [[0xC0FFEE]], "told once, when they came"
    world.channels.unpin(PUBLISHER + 10, pin.id)
    late = world.publish(2)  # refills the one slot: step 1's bytes are gone
    world.channels.checksummed(version, [1])
    world.channels.checksummed(late, None)  # its computation failed: none, and none waited
    pin = world.channels.pin(PUBLISHER + 10, OWNER, channel, None, None, now=0.0)
    assert world.channels.await_checksums(PUBLISHER + 10, pin.id, heard.append) is None


def test_checksums_that_come_for_a_refilled_slot_are_dropped() -> None:
    world = World(slots=1)
    first = world.publish(1)
    second = world.publish(2)
    world.channels.checksummed(first, [7])  # computed late, over the bytes of step 2
    assert first.checksums is None and world.channels.checksums_of(second) is None


def test_a_channels_summary_says_its_newest_step_slots_pins_and_followers() -> None:
    world = World(slots=2)
    channel = world.follow(PUBLISHER + 10, OWNER)
    version = world.publish(4, share=(TEAM,))
    world.channels.pin(PUBLISHER + 10, OWNER, channel, None, None, now=0.0)
    world.channels.checksummed(version, [1])
    assert world.channels.summary(world.channels.by_id[channel]) == {
        "uid": UID,
        "name": "policy",
        "newest_step": 4,
        "versions": 1,
        "slots": 2,
        "bytes": 4096,
        "checksummed": True,
        "pins": 1,
        "subscribers": 1,
        "shared_gids": [TEAM],
    }


# -- sharded versions: parts ---------------------------------------------------------

RANK1 = 5


class Ranks(World):
    """Two ranks of one trainer (same uid, a connection and a layout each) publishing the
    halves of one tensor as the two parts of each version."""

    def __init__(self) -> None:
        super().__init__(slots=2)
        self.store.open_session(RANK1, UID)
        shard = [Layout((TensorSpec("w", "F32", (512,), (at,)),)) for at in (0, 512)]
        refs = [[[SegmentRef(f"r{rank}-{n}", 4096)] for n in range(2)] for rank in (0, 1)]
        self.layouts = [
            self.store.add(session, layout, rank_refs, 8192)
            for session, layout, rank_refs in zip((PUBLISHER, RANK1), shard, refs, strict=True)
        ]

    def part(
        self, rank: int, step: int, count: int = 2, within: float = 60.0
    ) -> tuple[Version | None, Slot]:
        """What one rank does: acquire, fill, publish its part (the daemon keeps the slot)."""
        session, staged = (PUBLISHER, RANK1)[rank], self.layouts[rank]
        slot = self.store.try_acquire(session, staged)
        assert slot is not None, f"rank {rank} has no free slot"
        version, _told = self.channels.publish_part(
            UID, "policy", step, staged, slot, session=session, part=rank, count=count,
            within=within, tree={"w": {"T": "w"}}, metadata={"rank": rank},
            shapes={"w": [1024]},
        )  # fmt: skip
        return version, slot


def test_a_sharded_version_is_visible_only_once_every_part_arrived() -> None:
    ranks = Ranks()
    channel = ranks.channels.by_id[ranks.follow(PUBLISHER + 10, OWNER)]
    version, slot0 = ranks.part(0, 1)
    assert version is None and ranks.channels.newest(channel) is None
    assert slot0.state is SlotState.FILLING, "a waiting part's slot stays its publisher's"
    with pytest.raises(StoreError, match="has no version in shmstaged"):
        ranks.channels.pin(PUBLISHER + 10, OWNER, channel.id, None, None, now=0.0)
    version, slot1 = ranks.part(1, 1)
    assert version is not None and ranks.channels.newest(channel) is version
    assert [part.slot for part in version.every_part] == [slot0, slot1]
    assert slot0.state is slot1.state is SlotState.FREE and slot1.version is version.parts[1]
    assert version.metadata == {"rank": 0}, "the version's metadata is part 0's"
    pin = ranks.channels.pin(PUBLISHER + 10, OWNER, channel.id, None, None, now=0.0)
    assert slot0.pins == slot1.pins == {pin.id}, "one pin holds every part's slot"
    ranks.channels.unpin(PUBLISHER + 10, pin.id)
    assert ranks.freed == [slot0, slot1]


def test_a_part_of_a_step_whose_publisher_connection_ended_is_dropped_and_its_slots_freed() -> (
    None
):
    ranks = Ranks()
    channel = ranks.channels.by_id[ranks.follow(PUBLISHER + 10, OWNER)]
    _version, slot0 = ranks.part(0, 1)
    ranks.channels.end_session(PUBLISHER)  # rank 0 died with its part waiting
    assert slot0.state is SlotState.FREE and not channel.assembling
    version, slot1 = ranks.part(1, 1)  # the other rank's part of that step: waits afresh
    assert version is None and slot1.state is SlotState.FILLING
    ranks.timers.fire_all()  # and is dropped once its time ran out
    assert slot1.state is SlotState.FREE and ranks.channels.newest(channel) is None
    assert ranks.dropped == [  # each drop is told, with why, for the daemon's log
        Dropped(UID, "policy", 1, (0,), 2, "a publishing rank's connection ended"),
        Dropped(UID, "policy", 1, (1,), 2, "its 60 s ran out"),
    ]


def test_an_unfinished_step_is_dropped_once_a_newer_one_is_visible_and_steps_only_grow() -> None:
    ranks = Ranks()
    channel = ranks.channels.by_id[ranks.follow(PUBLISHER + 10, OWNER)]
    _none, stale = ranks.part(0, 1)  # rank 1's part of step 1 never comes
    ranks.part(0, 2)
    version, _slot = ranks.part(1, 2)
    assert version is not None and version.step == 2
    assert stale.state is SlotState.FREE and list(channel.assembling) == []
    assert ranks.dropped == [Dropped(UID, "policy", 1, (0,), 2, "step 2 became visible first")]
    with pytest.raises(StoreError, match="step 1 of channel 'policy' is not newer than its step 2"):
        ranks.part(1, 1)


def test_parts_must_agree_on_their_count_and_each_comes_once() -> None:
    ranks = Ranks()
    ranks.part(0, 1)
    with pytest.raises(StoreError, match="was begun as 2 parts, not 3"):
        ranks.part(1, 1, count=3)
    slot = ranks.store.try_acquire(PUBLISHER, ranks.layouts[0])
    assert slot is not None
    with pytest.raises(StoreError, match="part 0 of step 1 of channel 'policy' was already"):
        ranks.channels.publish_part(
            UID, "policy", 1, ranks.layouts[0], slot, session=PUBLISHER, part=0, count=2,
            within=60.0, tree={}, metadata={}, shapes={},
        )  # fmt: skip
    with pytest.raises(StoreError, match="1 to 256 parts"):
        ranks.part(1, 1, count=0)


def test_a_part_whose_layout_was_released_meanwhile_fails_its_step_as_a_refusal() -> None:
    ranks = Ranks()
    ranks.part(0, 1)
    ranks.store.mark_released(ranks.layouts[0])  # rank 0 published another structure
    with pytest.raises(StoreError, match=r"the slot of part\(s\) \[0\] was given up") as failed:
        ranks.part(1, 1)
    assert failed.value.code is ErrorCode.NOT_RETAINED
    # the arriving part's slot stays its publisher's to cancel, as after any refused publish
    assert [slot.state for slot in ranks.layouts[1].slots] == [SlotState.FILLING, SlotState.FREE]


def test_a_step_is_dropped_when_the_connection_that_publishes_a_missing_part_ends() -> None:
    ranks = Ranks()
    ranks.part(0, 1)
    ranks.part(1, 1)  # rank 1's connection publishes part 1
    _none, waiting = ranks.part(0, 2)
    ranks.channels.end_session(RANK1)  # killed before its part of step 2
    assert waiting.state is SlotState.FREE, "rank 0's part gives its slot back at once"
    assert not ranks.channels.channels[(UID, "policy")].assembling


def test_a_followers_ring_is_its_channels_newest_layout_checked_as_a_pin_is() -> None:
    world = World(publish_groups=frozenset({TEAM}))
    channel = world.follow(PUBLISHER + 10, OWNER)
    assert world.channels.ring_of(PUBLISHER + 10, OWNER, channel) is None, "no version yet"
    world.publish(1, share=(TEAM,))
    assert world.channels.ring_of(PUBLISHER + 10, OWNER, channel) is world.staged
    assert not world.staged.slots[0].pins and not world.channels.pins, "nothing is pinned"
    with pytest.raises(StoreError, match="does not follow channel"):
        world.channels.ring_of(READER, MEMBER, channel)  # not subscribed: as for a pin
    shared = world.follow(READER, MEMBER)
    assert world.channels.ring_of(READER, MEMBER, shared) is world.staged
    world.publish(2)  # no longer shared
    with pytest.raises(StoreError, match="not shared with uid") as refused:
        world.channels.ring_of(READER, MEMBER, shared)
    assert refused.value.code is ErrorCode.NOT_ALLOWED
    world.store.mark_released(world.staged)  # its publisher went: no ring until the next
    assert world.channels.ring_of(PUBLISHER + 10, OWNER, channel) is None


def test_an_offered_ring_is_the_channels_before_its_first_version_and_may_be_shared() -> None:
    world = World(publish_groups=frozenset({TEAM}))
    own = world.follow(PUBLISHER + 10, OWNER)
    with pytest.raises(StoreError, match="not shared with any of its groups"):
        world.follow(READER, MEMBER)
    with pytest.raises(StoreError, match=r"gid\(s\) \[501\]"):
        world.channels.offer(UID, "policy", world.staged, share=(501,))
    channel, told = world.channels.offer(UID, "policy", world.staged, share=(TEAM,))
    assert [s.session for s in told] == [PUBLISHER + 10] and channel.last_step is None
    assert world.channels.ring_of(PUBLISHER + 10, OWNER, own) is world.staged
    shared = world.follow(READER, MEMBER)  # shared ahead of the first version
    assert world.channels.ring_of(READER, MEMBER, shared) is world.staged
    with pytest.raises(StoreError, match="has no version"):
        world.channels.pin(READER, MEMBER, shared, None, None, now=0.0)
    world.channels.end_session(PUBLISHER + 10)
    world.channels.end_session(READER)
    assert (UID, "policy") in world.channels.channels, "kept while its ring lives"
    world.channels.offer(UID, "other", world.staged)  # one offered channel per layout
    assert (UID, "policy") not in world.channels.channels
    world.store.mark_released(world.staged)
    world.channels._prune(world.channels.channels[(UID, "other")])
    assert world.channels.channels == {}


# -- saved parts: a checkpointing rank's committed slot as its part ---------------------


class SavingRanks(Ranks):
    """The two ranks checkpoint (DCP through ShmStageWriter): each commits its slot to a
    job and publishes that slot as its part, while the job persists it."""

    def saved_part(self, rank: int, step: int, within: float = 60.0) -> tuple[Version | None, Slot]:
        session, staged = (PUBLISHER, RANK1)[rank], self.layouts[rank]
        slot = self.store.try_acquire(session, staged)
        assert slot is not None, f"rank {rank} has no free slot"
        job = self.store.begin_job(session, staged, slot)
        slot.held = Held(  # what retention.remember sets once the commit is acknowledged
            job, UID, 2048, 0.0, (0, job), (0, 0), None, "/ckpt", "rank.safetensors",
            {"w": {"T": "w"}}, {"dcp": {"rank": rank}},
        )  # fmt: skip
        version, _told = self.channels.publish_part(
            UID, "policy", step, staged, slot, session=session, part=rank, count=2,
            within=within, tree={"w": {"T": "w"}}, metadata={"step": step},
            shapes={"w": [1024]}, job=job,
        )  # fmt: skip
        return version, slot

    def job_ends(self, rank: int, slot: Slot, ok: bool = True) -> None:
        """What Jobs._done does: a failed job's slot holds no checkpoint any more."""
        assert slot.job is not None
        if not ok:
            slot.held = None
        self.store.end_job((PUBLISHER, RANK1)[rank], self.layouts[rank], slot, slot.job)


def test_saved_parts_make_a_version_while_their_jobs_still_persist_the_slots() -> None:
    ranks = SavingRanks()
    channel = ranks.channels.by_id[ranks.follow(PUBLISHER + 10, OWNER)]
    version, slot0 = ranks.saved_part(0, 1)
    assert version is None and slot0.state is SlotState.PERSISTING
    version, slot1 = ranks.saved_part(1, 1)
    assert version is not None and ranks.channels.newest(channel) is version
    assert [part.job for part in version.every_part] == [slot0.job, slot1.job]
    assert slot0.state is slot1.state is SlotState.PERSISTING, "still the jobs' slots"
    assert slot0.version is version and slot1.version is version.parts[1]
    pin = ranks.channels.pin(PUBLISHER + 10, OWNER, channel.id, None, None, now=0.0)
    ranks.job_ends(0, slot0)
    ranks.job_ends(1, slot1, ok=False)  # a failed job: the pinned bytes stay as they are
    assert ranks.channels.current(version)
    for rank in (0, 1):  # the pinned slots are never handed out: the other one is
        (session, staged) = ((PUBLISHER, RANK1)[rank], ranks.layouts[rank])
        assert ranks.store.try_acquire(session, staged) is staged.slots[1]
    ranks.channels.unpin(PUBLISHER + 10, pin.id)
    assert ranks.freed == [slot0, slot1]


def test_a_dropped_step_never_frees_a_slot_its_job_still_writes() -> None:
    ranks = SavingRanks()
    channel = ranks.channels.by_id[ranks.follow(PUBLISHER + 10, OWNER)]
    _none, saved = ranks.saved_part(0, 1)
    ranks.timers.fire_all()  # rank 1's part never came: the step's time ran out
    assert not channel.assembling and ranks.channels.newest(channel) is None
    assert saved.state is SlotState.PERSISTING and saved.held is not None, "the job's still"
    _none, again = ranks.saved_part(0, 2)
    ranks.channels.end_session(PUBLISHER)  # rank 0 died with its part of step 2 waiting
    assert again.state is SlotState.PERSISTING and again.held is not None
    assert [d.why for d in ranks.dropped] == [
        "its 60 s ran out", "a publishing rank's connection ended"
    ]
    ranks.job_ends(0, saved)  # the jobs free their slots once written, as ever
    assert saved.state is SlotState.FREE and saved.version is None


def test_a_saved_part_whose_job_failed_or_whose_slot_was_refilled_fails_its_step() -> None:
    for spoil in ("failed", "refilled"):
        ranks = SavingRanks()
        channel = ranks.channels.by_id[ranks.follow(PUBLISHER + 10, OWNER)]
        _none, saved = ranks.saved_part(0, 1)
        ranks.job_ends(0, saved, ok=spoil != "failed")
        if spoil == "refilled":
            assert ranks.store.try_acquire(PUBLISHER, ranks.layouts[0]) is not None
            assert ranks.store.try_acquire(PUBLISHER, ranks.layouts[0]) is saved
        with pytest.raises(StoreError, match=r"part\(s\) \[0\] was given up") as failed:
            ranks.saved_part(1, 1)
        assert failed.value.code is ErrorCode.NOT_RETAINED
        assert ranks.channels.newest(channel) is None and not channel.assembling
