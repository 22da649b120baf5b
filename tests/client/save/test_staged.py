"""Stager.stage / Staged.commit: copy now, say where it goes later (what DCP needs)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from shmstage_client import CheckpointExists, SaveError, SlotUnavailable, Stager, load

from shmstage.manifest import MANIFEST_NAME


def test_stage_copies_now_and_commit_names_file_header_and_manifest(daemon, ckpt: Path) -> None:
    weights = torch.arange(12, dtype=torch.float32).view(3, 4)
    with Stager(daemon.socket) as stager:
        staged = stager.stage({"w": weights}, offsets={"w": [6, 0]})
        weights.zero_()  # the copy is done: later changes never reach the checkpoint
        result = staged.commit(
            ckpt / "c",
            data_file="rank-7.safetensors",
            file_metadata={"DCP_SHARDING_INFO": '{"w": {"saved_offsets": [6, 0]}}'},
            metadata={"step": 3},
        ).wait(60)
    assert result.files == ("rank-7.safetensors", MANIFEST_NAME)
    with safe_open(str(ckpt / "c" / "rank-7.safetensors"), "pt") as f:
        assert f.metadata() == {"DCP_SHARDING_INFO": '{"w": {"saved_offsets": [6, 0]}}'}
        assert torch.equal(f.get_tensor("w"), torch.arange(12.0).view(3, 4))
    manifest = json.loads((ckpt / "c" / MANIFEST_NAME).read_text())
    assert manifest["metadata"] == {"step": 3}
    assert manifest["tensors"]["w"]["offsets"] == [6, 0]
    assert torch.equal(load(ckpt / "c")["w"], torch.arange(12.0).view(3, 4))


def test_a_staged_slot_is_held_until_commit_or_cancel(daemon) -> None:
    state = {"w": torch.ones(4)}
    with Stager(daemon.socket, slots=1, wait_for_slot=False) as stager:
        staged = stager.stage(state)
        assert staged.open
        with pytest.raises(SlotUnavailable):
            stager.stage(state)
        staged.cancel()
        assert not staged.open
        with stager.stage(state) as again:  # leaving the block uncommitted cancels
            assert again.layout_id == staged.layout_id  # same structure, same segments
        stager.stage(state).cancel()


def test_a_refused_destination_hands_the_slot_back(daemon, ckpt: Path) -> None:
    state = {"w": torch.ones(4)}
    with Stager(daemon.socket, slots=1, wait_for_slot=False) as stager:
        stager.save(state, ckpt / "taken").wait(60)
        staged = stager.stage(state)
        with pytest.raises(CheckpointExists):
            staged.commit(ckpt / "taken")
        assert not staged.open
        with pytest.raises(SaveError, match="already cancelled"):
            staged.commit(ckpt / "elsewhere")
        stager.stage(state).commit(ckpt / "elsewhere").wait(60)  # the slot came back


def test_commit_may_come_from_another_thread_than_stage(daemon, ckpt: Path) -> None:
    with Stager(daemon.socket) as stager:
        staged = stager.stage({"w": torch.full((5,), 7.0)})
        outcome: list[object] = []
        thread = threading.Thread(
            target=lambda: outcome.append(staged.commit(ckpt / "t").wait(60)), daemon=True
        )
        thread.start()
        thread.join(60)
    assert outcome and torch.equal(load(ckpt / "t")["w"], torch.full((5,), 7.0))


def test_shard_offsets_are_part_of_the_structure(daemon) -> None:
    state = {"w": torch.ones(2, 2)}
    with Stager(daemon.socket) as stager:
        with stager.stage(state, offsets={"w": [0, 0]}) as first:
            pass
        with stager.stage(state, offsets={"w": [0, 0]}) as same:
            pass
        with stager.stage(state, offsets={"w": [2, 0]}) as moved:
            pass
    assert first.layout_id == same.layout_id != moved.layout_id


def test_a_save_refused_for_want_of_a_slot_leaves_no_file_or_descriptor(daemon, ckpt) -> None:
    state = {"w": torch.ones(4)}
    with Stager(daemon.socket, slots=1, wait_for_slot=False) as stager:
        held = stager.stage(state)
        descriptors = len(os.listdir("/proc/self/fd"))
        for i in range(5):
            with pytest.raises(SlotUnavailable):
                stager.save(state, ckpt / f"refused-{i}")
            assert os.listdir(ckpt) == []  # neither the directory nor its pending one
        assert len(os.listdir("/proc/self/fd")) == descriptors
        held.cancel()
