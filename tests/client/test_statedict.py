"""What the state dict may hold, refused before anything is created: a loop catching
SaveError never crashes, and a refused save leaves no directory, slot or segment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from harness import assert_same
from shmstage_client import SaveError, Stager, UnsupportedValue, load

from shmstage.protocol import DEFAULT_MAX_FRAME_BYTES

BIG = DEFAULT_MAX_FRAME_BYTES  # one string this long cannot travel in a commit


@pytest.mark.parametrize(
    ("state", "metadata", "message"),
    [
        ({"w": torch.ones(2), "meta": {"seed": 2**64}}, None, r"state_dict\['meta'\]\['seed'\]"),
        ({"w": torch.ones(2), "opt": {-(2**63) - 1: 0}}, None, r"state_dict\['opt'\]\[-9223"),
        ({"w": torch.ones(2), "n": [1, 2, -(2**70)]}, None, r"state_dict\['n'\]\[2\]"),
        ({"w": torch.ones(2)}, {"seed": 2**64}, "metadata holds an integer"),
    ],
)
def test_integers_outside_64_bits_are_refused_naming_the_key_and_the_range(
    daemon, ckpt: Path, state: dict, metadata: dict | None, message: str
) -> None:
    with Stager(daemon.socket) as stager, pytest.raises(UnsupportedValue, match=message) as info:
        stager.save(state, ckpt / "c", metadata=metadata)
    assert "nothing was written" in str(info.value)
    if metadata is None:
        assert "-9223372036854775808 .. 18446744073709551615" in str(info.value)
    assert os.listdir(ckpt) == [] and daemon.segments() == []


@pytest.mark.parametrize(
    ("state", "metadata", "where"),
    [
        ({"w": torch.ones(2), "cfg": {"blob": "x" * BIG}}, None, "state_dict['cfg']['blob']"),
        ({"w": torch.ones(2), "ids": ["y" * 8192] * (BIG // 8192)}, None, "state_dict['ids']"),
        ({"w": torch.ones(2)}, {"notes": "y" * BIG}, "the metadata"),
    ],
)
def test_plain_values_too_large_for_one_commit_are_refused_naming_where(
    daemon, ckpt: Path, state: dict, metadata: dict | None, where: str
) -> None:
    with Stager(daemon.socket) as stager, pytest.raises(UnsupportedValue) as info:
        stager.save(state, ckpt / "c", metadata=metadata)
    message = str(info.value)
    assert "32.0 MiB one commit message may carry" in message, message
    assert f"(most of it {where}" in message, message
    assert os.listdir(ckpt) == [] and daemon.segments() == []


def test_a_loop_catching_save_error_survives_every_refusal(daemon, ckpt: Path) -> None:
    bad = [
        {"w": torch.ones(2), "x": 2**64},
        {"w": torch.ones(2), "x": "z" * BIG},
        {"w": torch.ones(2), "x": {1, 2}},
        {"w": torch.ones(2, dtype=torch.complex128)},
    ]
    with Stager(daemon.socket, slots=1) as stager:
        for step, state in enumerate(bad):
            try:
                stager.save(state, ckpt / f"s{step}")
            except SaveError:
                pass
        stager.save({"w": torch.ones(2), "x": 2**64 - 1}, ckpt / "good").wait(60)
    assert os.listdir(ckpt) == ["good"]
    assert_same(load(ckpt / "good"), {"w": torch.ones(2), "x": 2**64 - 1})

