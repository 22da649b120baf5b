"""The slot's state machine, as ``slot.py``'s docstring states it, driven with no daemon.

FREE --acquire(client)--> FILLING(client) --commit--> PERSISTING(job) --job end--> FREE
FILLING --cancel / client gone--> FREE

Each test takes one rule of that table: an allowed transition lands where it says, a
forbidden one raises ``SlotError`` and leaves the slot as it was (the daemon answers the
client with that message; nothing about the slot changed).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from shmstage_daemon.slot import Held, Slot, SlotError, SlotState

from shmstage.segment import SegmentRef

CLIENT, OTHER, JOB = 1, 2, 10


def fresh() -> Slot:
    return Slot(0, [SegmentRef("/seg0", 4096)])


def held(job: int = JOB) -> Held:
    return Held(
        job=job,
        uid=1000,
        nbytes=4096,
        acknowledged_unix=0.0,
        data_id=(1, job),
        directory_id=(1, 100 + job),
        parent_id=None,
        directory="/ckpt",
        data_file="model.safetensors",
        tree=None,
        metadata={},
    )


def snapshot(slot: Slot) -> Slot:
    return replace(slot, leases=set(slot.leases))


def test_a_save_goes_free_filling_persisting_and_free_again() -> None:
    slot = fresh()
    slot.acquire(CLIENT)
    assert (slot.state, slot.holder) == (SlotState.FILLING, CLIENT)
    slot.commit(CLIENT, JOB)
    assert (slot.state, slot.holder, slot.job, slot.fills) == (SlotState.PERSISTING, None, JOB, 1)
    slot.finish(JOB)
    assert (slot.state, slot.job) == (SlotState.FREE, None)


def test_a_cancelled_fill_frees_the_slot_and_counts_no_fill() -> None:
    slot = fresh()
    slot.acquire(CLIENT)
    slot.cancel(CLIENT)
    assert (slot.state, slot.holder, slot.fills) == (SlotState.FREE, None, 0)


@pytest.mark.parametrize("state", ["filling", "persisting"])
def test_a_slot_that_is_not_free_cannot_be_acquired(state: str) -> None:
    slot = fresh()
    slot.acquire(CLIENT)
    if state == "persisting":
        slot.commit(CLIENT, JOB)
    before = snapshot(slot)
    with pytest.raises(SlotError, match=f"slot 0 is {state}"):
        slot.acquire(OTHER)
    assert slot == before


def test_a_leased_slot_is_never_acquired_so_a_reader_sees_its_bytes_unchanged() -> None:
    slot = fresh()
    slot.held = held()
    slot.leases.add(1)
    with pytest.raises(SlotError, match="leased or pinned by a reader"):
        slot.acquire(CLIENT)
    assert slot.state is SlotState.FREE and slot.held is not None


def test_acquiring_forgets_the_checkpoint_the_slot_held() -> None:
    slot = fresh()
    slot.held = held()
    slot.acquire(CLIENT)
    assert slot.held is None  # its bytes are about to change


@pytest.mark.parametrize("action", ["commit", "cancel"])
def test_only_the_client_filling_a_slot_may_commit_or_cancel_it(action: str) -> None:
    slot = fresh()
    slot.acquire(CLIENT)
    before = snapshot(slot)
    with pytest.raises(SlotError, match=f"not held by this client; acquire it before you {action}"):
        if action == "commit":
            slot.commit(OTHER, JOB)
        else:
            slot.cancel(OTHER)
    assert slot == before


@pytest.mark.parametrize("action", ["commit", "cancel"])
def test_a_free_slot_cannot_be_committed_or_cancelled(action: str) -> None:
    slot = fresh()
    with pytest.raises(SlotError, match="is free and not held by this client"):
        if action == "commit":
            slot.commit(CLIENT, JOB)
        else:
            slot.cancel(CLIENT)
    assert slot.state is SlotState.FREE


def test_a_persisting_slot_cannot_be_cancelled_by_the_client_that_filled_it() -> None:
    slot = fresh()
    slot.acquire(CLIENT)
    slot.commit(CLIENT, JOB)
    with pytest.raises(SlotError, match="is persisting"):
        slot.cancel(CLIENT)
    assert (slot.state, slot.job) == (SlotState.PERSISTING, JOB)


@pytest.mark.parametrize("ending", ["another job", "a free slot", "a filling slot"])
def test_only_the_job_writing_a_slot_frees_it(ending: str) -> None:
    slot = fresh()
    if ending != "a free slot":
        slot.acquire(CLIENT)
    if ending == "another job":
        slot.commit(CLIENT, JOB)
    before = snapshot(slot)
    with pytest.raises(SlotError, match=f"slot 0 is not persisting job {JOB + 1}"):
        slot.finish(JOB + 1)
    assert slot == before


def test_a_free_slot_holding_nothing_is_refilled_before_any_holding_a_checkpoint() -> None:
    empty, older, newer = fresh(), fresh(), fresh()
    older.held, newer.held = held(3), held(7)
    assert sorted([newer, empty, older], key=lambda s: s.age) == [empty, older, newer]
