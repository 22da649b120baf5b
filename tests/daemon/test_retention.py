"""What slots hold, as the daemon's retention keeps track of it across many saves.

These drive ``Retention`` with a real ``Store`` and the slot life cycle the daemon runs
(acquire, commit acknowledged, job ended, acquire again), without processes or segments:
the index they check is pure event-loop state. The process-level behaviour (restores
from memory, leases, eviction) is in ``tests/client/test_restore.py`` and
``tests/faults/test_restore_faults.py``.
"""

from __future__ import annotations

import tracemalloc

from shmstage_daemon import job
from shmstage_daemon.retention import Retention, RetentionPolicy
from shmstage_daemon.slot import Held, Slot
from shmstage_daemon.store import Limits, StagedLayout, Store
from shmstage_daemon.telemetry import Telemetry

from shmstage.layout import Layout, TensorSpec
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
