"""What slots hold, as the daemon's retention keeps track of it across many saves.

These drive ``Retention`` with a real ``Store`` and the slot life cycle the daemon runs
(acquire, commit acknowledged, job ended, acquire again), without processes or segments:
the index they check is pure event-loop state. The process-level behaviour (restores
from memory, leases, eviction) is in ``tests/client/test_restore.py`` and
``tests/faults/test_restore_faults.py``.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
import tracemalloc
from collections.abc import Awaitable, Callable

import pytest
from shmstage_daemon import job
from shmstage_daemon.admission import Peer
from shmstage_daemon.retention import Retention, RetentionPolicy, writers
from shmstage_daemon.slot import Held, Slot
from shmstage_daemon.store import Limits, StagedLayout, Store, StoreError
from shmstage_daemon.telemetry import Telemetry

from shmstage import segment
from shmstage.layout import Layout, TensorSpec
from shmstage.protocol import ErrorCode
from shmstage.segment import SegmentRef

SESSION, UID = 7, 1000


def retention_with_layout(slots: int = 2) -> tuple[Retention, StagedLayout]:
    store = Store(Limits(shm_budget_bytes=1 << 30))
    retention = Retention(
        store,
        RetentionPolicy(budget_bytes=1 << 30),
        Telemetry(),
        unlink=lambda names: None,  # type: ignore[arg-type,return-value]
        on_free=lambda staged, slot: None,
    )
    layout = Layout((TensorSpec("w", "F32", (1024,)),))
    refs = [[SegmentRef(f"/seg{i}", 4096)] for i in range(slots)]
    return retention, store.add(SESSION, layout, refs, 4096 * slots, uid=UID)


def save(retention: Retention, staged: StagedLayout, job_id: int) -> tuple[Slot, Held]:
    """One save as the daemon runs it: the oldest free slot, acknowledged, made durable."""
    slot = min(staged.slots, key=lambda s: s.age)
    slot.acquire(SESSION)
    slot.commit(SESSION, job_id)
    held = Held(
        job=job_id,
        uid=UID,
        nbytes=4096,
        acknowledged_unix=0.0,
        data_id=(1, job_id),  # each checkpoint's data file is a new inode
        directory_id=(1, 10**9 + job_id),
        parent_id=(1, 1),
        directory=f"/ckpt/step-{job_id}",
        data_file="model.safetensors",
        tree={"w": {"tensor": "w"}, "note": "x" * 2000},
        metadata={"step": job_id},
    )
    retention.remember(staged, slot, held)
    retention.job_ended(slot, job.JobResult(job_id, ok=True, digest=f"d{job_id}"))
    slot.finish(job_id)
    return slot, held


def test_only_checkpoints_still_in_a_slot_are_found() -> None:
    retention, staged = retention_with_layout()
    for job_id in range(1, 6):
        save(retention, staged, job_id)
    assert retention.find((1, 5), "d5") is not None and retention.find((1, 4), "d4") is not None
    assert retention.find((1, 3), "d3") is None  # its slot was refilled by job 5
    assert retention.find((1, 5), "d4") is None  # a digest that is not the checkpoint's
    newest = retention.newest_of(UID)
    assert newest is not None and newest[2].job == 5


def test_the_index_does_not_grow_with_every_save_ever_acknowledged() -> None:
    """Each acknowledged save is indexed by its data file with its tree and metadata; a
    refilled slot's entry must go, or a daemon running for months grows by every save
    (the soak saw 3.8 KiB per save before)."""
    retention, staged = retention_with_layout()
    for job_id in range(1, 201):  # warm up: the index reaches its working size
        save(retention, staged, job_id)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for job_id in range(201, 5201):
            save(retention, staged, job_id)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 << 10, f"5,000 saves grew retention's memory by {grown} bytes"
    assert retention.find((1, 5200), "d5200") is not None
    assert retention.find((1, 5199), "d5199") is not None
    assert retention.find((1, 5198), "d5198") is None


# -- who holds retained memory, and for how long (issue 32, items 5 and 7) -----------------
#
# A small node: layouts are accounting only (no segment exists), so sizes can be the
# issue's own (MiB); leases and revocations run on a real event loop.

MiB = 1 << 20
OWNER, READER, OTHER = 1001, 1002, 1003
GROUP = 500


class Node:
    """A Store and its Retention as the daemon wires them, with sessions of real uids."""

    def __init__(self, *, budget: int = 128 * MiB, shm: int = 256 * MiB, **policy: object):
        self.store = Store(Limits(shm_budget_bytes=shm, **policy.pop("limits", {})))  # type: ignore[arg-type]
        self.retention = Retention(
            self.store,
            RetentionPolicy(budget_bytes=budget, restore_groups=frozenset({GROUP}), **policy),  # type: ignore[arg-type]
            Telemetry(),
            unlink=self._unlinked,
            on_free=lambda staged, slot: None,
        )
        self.sessions = iter(range(100, 10_000))
        self.jobs = iter(range(1, 10_000))

    @staticmethod
    def _unlinked(names: list[str]) -> asyncio.Future[None]:
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def trainer(self, uid: int, mib: int, slots: int = 1, name: str = "w") -> StagedLayout:
        """A live layout of ``slots`` slots of ``mib`` MiB each, holding a checkpoint."""
        session = next(self.sessions)
        self.store.open_session(session, uid)
        layout = Layout((TensorSpec(name, "U8", (mib * MiB,)),))
        nbytes = self.store.reserve(session, layout, slots)
        refs = [[SegmentRef(f"/s{session}.{i}", mib * MiB)] for i in range(slots)]
        staged = self.store.add(session, layout, refs, nbytes, uid=uid)
        for _ in range(slots):
            self.save(staged)
        return staged

    def save(self, staged: StagedLayout) -> Held:
        job_id = next(self.jobs)
        slot = min((s for s in staged.slots if not s.leased), key=lambda s: s.age)
        slot.acquire(staged.owner)
        slot.commit(staged.owner, job_id)
        held = Held(
            job=job_id, uid=staged.uid, nbytes=staged.slot_bytes, acknowledged_unix=0.0,
            data_id=(2, job_id), directory_id=(2, -job_id), parent_id=(2, 0),
            directory=f"/ckpt/{job_id}", data_file="model.safetensors", tree={}, metadata={},
        )  # fmt: skip
        self.retention.remember(staged, slot, held)
        self.retention.job_ended(slot, job.JobResult(job_id, ok=True, digest=f"d{job_id}"))
        slot.finish(job_id)
        return held

    def die(self, staged: StagedLayout) -> None:
        """Its trainer's connection ends without releasing it."""
        session = staged.owner
        assert self.retention.keep(staged)
        self.store.forget_client(session)

    def lease(self, uid: int, staged: StagedLayout, groups: frozenset[int] = frozenset()):
        session = next(self.sessions)
        newest = staged.newest()
        assert newest is not None and newest.held is not None
        peer = Peer(1, uid, uid, groups or frozenset({uid}))
        return self.retention.grant(session, peer, (staged, newest, newest.held), None)

    def retained(self, uid: int) -> list[StagedLayout]:
        return [s for s in self.store.retained.values() if s.uid == uid]


def on_a_loop(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


def test_a_layout_a_reader_leases_is_never_adopted_its_owner_gets_fresh_segments() -> None:
    """Adopting hands the owner writable descriptors to every slot: with a reader copying
    one of them, the owner could rewrite the bytes (keeping the CRC-32C) under it."""

    async def scenario() -> None:
        node = Node()
        staged = node.trainer(OWNER, 8)
        node.die(staged)
        lease = node.lease(READER, staged, frozenset({GROUP}))
        assert node.retention.adoptable(OWNER, staged.layout, 1) is None
        node.retention.end(lease)
        assert node.retention.adoptable(OWNER, staged.layout, 1) is staged

    on_a_loop(scenario)


def test_another_user_may_lease_a_checkpoint_only_once_its_trainer_is_gone() -> None:
    async def scenario() -> None:
        node = Node()
        staged = node.trainer(OWNER, 8, slots=2)
        with pytest.raises(StoreError) as refused:
            node.lease(READER, staged, frozenset({GROUP}))
        assert refused.value.code == ErrorCode.NOT_RETAINED
        assert "trainer still holds" in refused.value.message
        node.retention.end(node.lease(OWNER, staged))  # its own: whenever it likes
        node.die(staged)
        node.retention.end(node.lease(READER, staged, frozenset({GROUP})))

    on_a_loop(scenario)


def test_the_kernel_names_a_segment_a_process_may_still_write(instance_id: str) -> None:
    """A writable mapping counts even after its descriptor was closed; a read-only one
    never does (real segments in /dev/shm, under a live instance's id, so that no daemon
    of another test reaps them meanwhile)."""
    refs = [segment.create(instance_id, 4096) for _ in range(2)]
    try:
        assert writers(refs) is None
        fd = segment.open_fd(refs[1], writable=True)
        mapping = mmap.mmap(fd, 4096)
        os.close(fd)
        assert writers(refs) == refs[1].name
        mapping.close()
        fd = segment.open_fd(refs[1], writable=False)
        reading = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
        os.close(fd)
        assert writers(refs) is None
        reading.close()
    finally:
        for ref in refs:
            segment.unlink(ref.name)


def test_a_bigger_newer_retention_of_one_user_does_not_evict_anothers() -> None:
    """The budget gives back from the uid retaining the most, not the oldest checkpoint."""

    async def scenario() -> None:
        node = Node(budget=128 * MiB)
        victims = node.trainer(OWNER, 40)
        node.die(victims)
        node.die(node.trainer(OTHER, 100, name="big"))  # 140 MiB retained: over by 12
        assert node.retained(OWNER) == [victims]
        assert node.retained(OTHER) == []
        node.die(node.trainer(OTHER, 30, name="a"))
        node.die(node.trainer(OTHER, 30, name="b"))
        node.die(node.trainer(OTHER, 30, name="c"))  # 130: OTHER's oldest goes
        assert node.retained(OWNER) == [victims] and len(node.retained(OTHER)) == 2

    on_a_loop(scenario)


def test_retained_memory_is_charged_to_its_user_and_kept_within_its_share() -> None:
    async def scenario() -> None:
        node = Node(budget=128 * MiB, user_budget_bytes=64 * MiB)
        node.die(node.trainer(OWNER, 40))
        assert node.store.retained_of(OWNER) == 40 * MiB
        node.die(node.trainer(OTHER, 30, name="a"))
        node.die(node.trainer(OTHER, 30, name="b"))  # 60 of its 64
        node.die(node.trainer(OTHER, 30, name="c"))  # 90: its own oldest goes, not OWNER's
        assert node.store.retained_of(OTHER) == 60 * MiB
        assert node.store.retained_of(OWNER) == 40 * MiB

    on_a_loop(scenario)


def test_a_user_cannot_hold_retained_memory_past_its_max_bytes_by_leasing_its_own() -> None:
    """The issue's attack, scaled: a uid with max_bytes 96 MiB retains 96 MiB layouts one
    after another, each leased by a process of its own so that nothing gives it back.
    Each new registration of its own now takes its retained memory first (leased or not,
    after the grace): it never holds more than its max_bytes, and another user's
    registration finds room."""

    async def scenario() -> None:
        node = Node(
            budget=128 * MiB, shm=256 * MiB, revoke_grace=0.05, limits={"max_user_bytes": 96 * MiB}
        )
        leases = []
        for round_ in range(4):
            needed = node.store.registration_bytes(
                Layout((TensorSpec(f"w{round_}", "U8", (96 * MiB,)),)), 1
            )
            await node.retention.make_room(needed, OTHER)
            staged = node.trainer(OTHER, 96, name=f"w{round_}")
            leases.append(node.lease(OTHER, staged))
            node.die(staged)
            usage = node.store.usage[OTHER]
            assert usage.bytes + usage.retained_bytes <= 96 * MiB
        assert node.store.retained_bytes <= 96 * MiB
        assert sum(lease.id in node.retention.leases for lease in leases) == 1  # the others revoked
        await node.retention.make_room(90 * MiB, OWNER)
        node.trainer(OWNER, 90)  # shm_exhausted before: 384 MiB were held

    on_a_loop(scenario)


def test_a_leased_layout_past_its_ttl_goes_within_the_grace() -> None:
    async def scenario() -> None:
        node = Node(ttl=0.05, revoke_grace=0.1)
        staged = node.trainer(OWNER, 8)
        node.die(staged)
        lease = node.lease(READER, staged, frozenset({GROUP}))
        await asyncio.sleep(0.06)
        node.retention.sweep()
        assert lease.revoked == "ttl" and lease.expires - time.monotonic() <= 0.1
        await asyncio.sleep(0.15)
        assert lease.id not in node.retention.leases  # its reader's unlease says held: false
        node.retention.sweep()
        assert node.store.retained == {}

    on_a_loop(scenario)


def test_a_registration_gets_leased_retained_memory_after_the_grace() -> None:
    async def scenario() -> None:
        node = Node(budget=128 * MiB, shm=128 * MiB, revoke_grace=0.1)
        staged = node.trainer(OWNER, 100)
        node.die(staged)
        lease = node.lease(READER, staged, frozenset({GROUP}))
        began = time.monotonic()
        await node.retention.make_room(64 * MiB, OTHER)
        assert time.monotonic() - began < 0.1 + 1.5
        assert node.store.retained == {} and lease.id not in node.retention.leases
        node.trainer(OTHER, 64)

    on_a_loop(scenario)


def test_a_users_leases_on_one_checkpoint_cannot_be_chained_past_max_lease_seconds() -> None:
    async def scenario() -> None:
        node = Node(max_lease_seconds=2.0, lease_seconds=2.0)
        staged = node.trainer(OWNER, 8)
        node.die(staged)
        first = node.lease(OWNER, staged)
        first.granted -= 1.5  # as if it had been held 1.5 s
        node.retention.end(first)
        second = node.lease(OWNER, staged)
        assert second.deadline - second.granted == pytest.approx(0.5, abs=0.05)
        second.granted -= 0.5
        node.retention.end(second)
        with pytest.raises(StoreError) as refused:
            node.lease(OWNER, staged)
        assert refused.value.code == ErrorCode.LIMIT_EXCEEDED
        assert "max_lease_seconds" in refused.value.message
        node.retention.end(node.lease(READER, staged, frozenset({GROUP})))  # its own count

    on_a_loop(scenario)


def test_a_lower_share_after_a_reload_is_enforced_by_the_sweep() -> None:
    async def scenario() -> None:
        node = Node(budget=128 * MiB)
        node.die(node.trainer(OWNER, 30, name="a"))
        node.die(node.trainer(OWNER, 30, name="b"))
        node.retention.policy = RetentionPolicy(
            budget_bytes=128 * MiB, user_budget_bytes=40 * MiB
        )  # as a SIGHUP reload sets it
        node.retention.sweep()
        (kept,) = node.retained(OWNER)
        assert kept.layout.tensors[0].key == "b"  # the newest stays

    on_a_loop(scenario)
