"""A sharded trainer's DCP checkpoint that is also a published version: each rank's
``ShmStageWriter`` save armed by ``publish_next`` publishes the slot it committed as its
part of the version (no second copy), and the checkpoint is what it would have been.

Ranks are real processes (gloo on CPU, ``dcp_ranks.py``) on one real daemon; this process
follows the channel as a reader would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RunningDaemon, assert_same, start_daemon
from shmstage_client import NoNewVersion, subscribe
from shmstage_client.subscribe.sharded import ShardedVersion
from test_dcp import expected, flat, run_ranks

pytestmark = pytest.mark.usefixtures("fork_server")  # the ranks are ForkedScripts

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    running = start_daemon(tmp_path_factory.mktemp("dcp-publish-daemon"))
    yield running
    running.discard()


def wait_file(path: Path, timeout: float = TIMEOUT) -> None:
    from dcp_ranks import wait_file as wait

    wait(path, timeout)


def tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """DCP's flat keys of a full state's tensors: what a published checkpoint holds."""
    return {key: value for key, value in flat(state).items() if isinstance(value, torch.Tensor)}


def read_back(version: ShardedVersion, work: Path, name: str) -> None:
    """The full state bit-exact, and each rank's part exactly its own shards."""
    whole = tensors(expected(work, name))
    assert_same(version.state(verify=True), whole, key_order=False)
    assert_same(dict(version.tensors()), whole, key_order=False)
    for rank in (0, 1):
        mine = torch.load(work / f"local-{rank}-{name}.pt")
        assert_same(version.part(rank).state(), mine, key_order=False)


def same_as_published(saved: ShardedVersion, direct: ShardedVersion) -> None:
    """What a checkpoint's version shows readers is what ShmStagePublisher's shows: the
    same parts, each shard where it was, the same bytes (the nesting is DCP's flat keys)."""
    assert saved.specs == direct.specs
    assert_same(dict(saved.tensors()), dict(direct.tensors()))
    for rank in (0, 1):
        assert saved.sharding(rank) == direct.sharding(rank)
        assert_same(dict(saved.part(rank).tensors()), dict(direct.part(rank).tensors()))


def test_two_ranks_dcp_saves_publish_their_committed_slots_as_one_version_each_step(
    node: RunningDaemon, tmp_path: Path
) -> None:
    held: list[str] = []

    def reader() -> None:
        with subscribe("dcp-policy", socket=node.socket) as subscriber:
            version = subscriber.wait(timeout=TIMEOUT)
            with version:  # step 1, pinned while steps 2 and 3 are saved and published
                assert isinstance(version, ShardedVersion) and version.parts == 2
                assert (version.step, version.metadata) == (1, {"loss": 0.1})
                wait_file(tmp_path / "saved-1-0")
                wait_file(tmp_path / "saved-1-1")
                read_back(version, tmp_path, "pub-1")
                shards = version.sharding(1)["model.a.weight"]
                assert (shards.offsets, shards.global_shape) == ((17, 0), (33, 16))
                other = subscribe("dcp-direct", socket=node.socket)
                with other, other.wait(timeout=TIMEOUT) as direct:
                    assert isinstance(direct, ShardedVersion) and direct.parts == 2
                    same_as_published(version, direct)
                (tmp_path / "go-2").touch()
                wait_file(tmp_path / "saved-3-0")
                wait_file(tmp_path / "saved-3-1")
                read_back(version, tmp_path, "pub-1")  # intact after two more saves
                held.append("step 1 intact")
            with subscriber.wait(newer_than=2, timeout=TIMEOUT) as newest:
                assert (newest.step, newest.metadata) == (3, {"loss": 0.3})
                read_back(newest, tmp_path, "pub-3")
            (tmp_path / "read-3").touch()
            with pytest.raises(NoNewVersion):
                subscriber.wait(newer_than=3, timeout=0.5).close()

    results = run_ranks("publish", 2, tmp_path, [node], during=reader)
    assert held == ["step 1 intact"]
    for step in (1, 2, 3):  # exactly one rank's part completed each version
        assert sorted(r[f"complete-{step}"] for r in results) == [False, True]
    assert "internal error" not in node.log()


def test_a_rank_killed_before_its_part_leaves_no_version_and_its_partner_file_is_durable(
    node: RunningDaemon, tmp_path: Path
) -> None:
    def dropped() -> None:
        with subscribe("dcp-dies", socket=node.socket) as subscriber:
            wait_file(tmp_path / "result-0.json")  # rank 0's part is in, its file durable
            node.wait_log(
                "step 1 of sharded channel 'dcp-dies' dropped with parts 0 of 2: its 2 s ran out"
            )
            with pytest.raises(NoNewVersion):
                subscriber.wait(timeout=0.5).close()
        (tmp_path / "exit").touch()

    with pytest.raises(AssertionError, match="rank 1 exited 17"):
        run_ranks("publish_rank_dies", 2, tmp_path, [node], during=dropped)
    result = json.loads((tmp_path / "result-0.json").read_text())
    assert result["complete"] is False and result["saved"] is not True
    (data,) = [Path(p) for p in result["durable"] if p.endswith(".safetensors")]
    assert data.stat().st_size > 0
