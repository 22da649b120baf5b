"""Publishing from a sharded trainer: two FSDP2 ranks (gloo, separate processes, each its
own ``ShmStagePublisher``) publish each step as the two parts of one version, and this
process reads it.

A reader never sees a step before both ranks' parts landed; what it reads is the full
(unsharded) state bit for bit, or a rank's own shards; steps only grow; a rank SIGKILLed
before its part exposes nothing of that step, and the part the other rank published of it
gives its slot back at once.

Run as a script, this file is one rank (``rank_main``): the test starts two.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for harness
from harness import RunningDaemon, assert_same, start_daemon, wait_file
from shmstage_client import NoNewVersion, subscribe
from shmstage_client.subscribe.sharded import (
    IncompleteTensor,
    Shard,
    ShardedVersion,
    _coverage,
)

CHANNEL = "sharded-policy"
PER_NODE = "per-node"
TIMEOUT = 60.0
#: Where the reader puts what it reads: on a GPU machine the device too (the ranks publish
#: from the host: two ranks of one GPU have no NCCL, and gloo gathers no CUDA tensors).
READ_ON = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


class Net(torch.nn.Module):
    """33 and 5 rows shard unevenly over 2 ranks; ``scale`` is a buffer every rank holds
    whole (FSDP2 does not shard buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 33)
        self.b = torch.nn.Linear(33, 5, dtype=torch.bfloat16)
        self.register_buffer("scale", torch.arange(7, dtype=torch.float64))


def state(model: torch.nn.Module, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "extra": {"step": step, "tag": "sharded"}}


def rank_main(rank: int, work: Path, socket: str, node_socket: str) -> None:
    """One rank: publish steps 1-2 together, step 3 with rank 1 held back until the test
    says go, then step 4 with rank 1 never publishing (it is killed), then step 5 on
    rank 0 alone, which needs the slot that step 4's part held. Beside that, step 1 on
    channel "per-node" through ``node_socket``: each rank a node of its own."""
    import torch.distributed as dist
    from shmstage_client import DaemonRefused, SlotUnavailable
    from shmstage_client.dcp import ShmStagePublisher
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group(
        "gloo",
        init_method=f"file://{work}/rendezvous",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=TIMEOUT),
    )
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (2,))
    for module in (model.a, model.b, model):
        fully_shard(module, mesh=mesh)
    # one slot per step in flight: a part the daemon does not give back is felt at once
    publisher = ShmStagePublisher(CHANNEL, socket=socket, slots=2, wait_for_slot=False)
    assert publisher.reserve(state(model, 0)).changed
    # a guarded optimizer's shards may be copied after a non-blocking publish returns
    publisher.guard(torch.optim.SGD(model.parameters(), lr=0.1))

    def fill(step: int) -> None:
        """New weights on every rank's shard; the full state and each rank's shards saved
        for the test to compare with."""
        with torch.no_grad():
            for parameter in model.parameters():
                local = parameter.to_local()
                numbers = torch.Generator().manual_seed(step * 100 + rank)
                local.copy_(torch.randn(local.shape, generator=numbers).to(local.dtype))
        sd = model.state_dict()
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
        local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in sd.items()}
        if rank == 0:
            torch.save({"model": full, "extra": {"step": step, "tag": "sharded"}},
                       work / f"expected-{step}.pt")  # fmt: skip
        torch.save({"model": local, "extra": {"step": step, "tag": "sharded"}},
                   work / f"local-{rank}-{step}.pt")  # fmt: skip

    for step in (1, 2):
        fill(step)
        published = publisher.publish(
            state(model, step), step=step, metadata={"loss": step / 10}, block=step == 1
        )
        if step == 2:  # non-blocking: handed over once copied; visible() says if it completed
            at_return = published.complete
            (work / f"r{rank}-2").write_text(f"{at_return} {published.visible(TIMEOUT)}")
        dist.barrier()
        if step == 1:  # kept open: a publish-only layout's versions go with it
            per_node = ShmStagePublisher(PER_NODE, socket=node_socket)
            assert per_node.publish(state(model, 1), step=1).complete
            (work / f"node-{rank}").write_text(f"{per_node.part} of {per_node.parts}")
    fill(3)
    reused = not publisher.reserve(state(model, 3)).changed
    assert reused, "every publish of this structure used the layout reserved at first"
    if rank == 1:
        wait_file(work / "go-3")
    published = publisher.publish(state(model, 3), step=3, metadata={"loss": 0.3})
    (work / f"r{rank}-3").write_text(str(published.complete))
    wait_file(work / "go-4")  # the test holds step 3 pinned from here on
    if rank == 1:
        (work / "r1-4").touch()
        time.sleep(TIMEOUT)  # never publishes step 4: killed here
        return
    try:
        publisher.publish(state(model, 3), step=3)
    except DaemonRefused as exc:
        (work / "lower-step").write_text(str(exc))
    publisher.publish(state(model, 4), step=4)  # waits for rank 1's part, which never comes
    (work / "r0-4").touch()
    wait_file(work / "go-5")
    started, deadline = time.monotonic(), time.monotonic() + 20.0
    while True:  # step 3's slot is pinned: only step 4's can be free
        try:
            publisher.publish(state(model, 5), step=5)
            break
        except SlotUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    (work / "r0-5").write_text(f"{time.monotonic() - started:.3f}")
    os._exit(0)  # no collective at exit: rank 1 is gone


# -- the test's side -----------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    running = start_daemon(tmp_path_factory.mktemp("sharded-daemon"))
    yield running
    running.discard()


@pytest.fixture(scope="module")
def other_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    running = start_daemon(tmp_path_factory.mktemp("other-node-daemon"))
    yield running
    running.discard()


def start_ranks(work: Path, sockets: tuple[str, str]) -> list[subprocess.Popen[bytes]]:
    command = [sys.executable, __file__, "--work", str(work), "--socket", sockets[0]]
    return [
        subprocess.Popen(
            [*command, "--node-socket", sockets[rank], "--rank", str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]


def test_two_fsdp2_ranks_publish_one_version_per_step_seen_whole_only_once_every_part_landed(
    daemon: RunningDaemon, other_node: RunningDaemon, tmp_path: Path
) -> None:
    ranks = start_ranks(tmp_path, (str(daemon.socket), str(other_node.socket)))
    try:
        with subscribe(CHANNEL, socket=daemon.socket) as subscriber:
            wait_file(tmp_path / "r0-3")  # steps 1 and 2 are out; rank 0's part of 3 too
            # each rank on a node of its own: each node's version holds that rank's shards
            assert [(tmp_path / f"node-{r}").read_text() for r in (0, 1)] == ["0 of 1"] * 2
            for rank, node in enumerate((daemon, other_node)):
                follower = subscribe(PER_NODE, socket=node.socket)
                with follower, follower.wait(timeout=TIMEOUT) as version:
                    assert isinstance(version, ShardedVersion) and version.parts == 1
                    mine = torch.load(tmp_path / f"local-{rank}-1.pt")
                    assert_same(version.part(0).state(), mine)
                    missing = "missing 17:33" if rank == 0 else "missing 0:17"
                    with pytest.raises(IncompleteTensor, match=f"'model.a.weight'.*{missing}"):
                        version.state()
            assert (tmp_path / "r0-3").read_text() == "False", "rank 0's part alone is not it"
            # step 2 went out with block=False: at return neither rank knew; one completed it
            step_2 = sorted((tmp_path / f"r{rank}-2").read_text() for rank in (0, 1))
            assert step_2 == ["None False", "None True"], step_2
            with subscriber.wait(timeout=TIMEOUT) as version:
                assert version.step == 2 and version.metadata == {"loss": 0.2}
            with pytest.raises(NoNewVersion):
                subscriber.wait(newer_than=2, timeout=1.0).close()
            (tmp_path / "go-3").touch()
            with subscriber.wait(newer_than=2, timeout=TIMEOUT) as version:
                assert isinstance(version, ShardedVersion) and version.parts == 2
                assert version.step == 3 and version.metadata == {"loss": 0.3}
                expected = torch.load(tmp_path / "expected-3.pt")
                for device in READ_ON:
                    assert_same(version.state(device, verify=True), expected)
                    assert version.verified, "each part checked against the daemon's checksums"
                    streamed = dict(version.tensors(device, bucket_bytes=512))
                    assert {t.device.type for t in streamed.values()} == {device}
                    flat = {f"model.{k}": v for k, v in expected["model"].items()}
                    assert_same(streamed, flat)
                    assert [spec.key for spec in version.specs] == list(streamed)
                    for rank in (0, 1):  # a reader sharded the same way takes its own shards
                        mine = torch.load(tmp_path / f"local-{rank}-3.pt")
                        assert_same(version.part(rank).state(device), mine)
                assert version.sharding(1)["model.a.weight"].offsets == (17, 0)
                (tmp_path / "go-4").touch()  # step 3 stays pinned while rank 1 dies
                wait_file(tmp_path / "r0-4")
                wait_file(tmp_path / "r1-4")
                ranks[1].send_signal(signal.SIGKILL)
                ranks[1].wait(TIMEOUT)
                (tmp_path / "go-5").touch()
                wait_file(tmp_path / "r0-5")
                daemon.wait_log(  # the operator sees why step 4 never came
                    f"step 4 of sharded channel {CHANNEL!r} dropped with parts 0 of 2: "
                    "a publishing rank's connection ended"
                )
                with pytest.raises(NoNewVersion):
                    subscriber.wait(newer_than=3, timeout=1.0).close()
            assert "not newer than its step 3" in (tmp_path / "lower-step").read_text()
            assert ranks[0].wait(TIMEOUT) == 0
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            output = process.communicate()[0].decode(errors="replace")
            if process.returncode not in (0, -signal.SIGKILL):
                pytest.fail(f"a rank failed ({process.returncode}):\n{output[-3000:]}")


def _shard(part: int, at: int, rows: int) -> Shard:
    return Shard(part, "w", (at, 0), (rows, 4), (33, 4), torch.float32)


def test_a_tensor_whose_shards_do_not_cover_it_names_the_tensor_and_the_rows_missing() -> None:
    with pytest.raises(IncompleteTensor, match=r"tensor 'w' of shape \[33, 4\]: .* hold 68 of its "
                       r"132 elements \(missing 17:33 of dimension 0\)"):  # fmt: skip
        _coverage("w", [_shard(0, 0, 17)])
    with pytest.raises(IncompleteTensor, match="the shards of parts 0 and 1 overlap"):
        _coverage("w", [_shard(0, 0, 17), _shard(1, 16, 17)])
    # the same shard from two parts (replicated) is read from the lowest part
    assert _coverage("w", [_shard(0, 0, 17), _shard(1, 0, 17), _shard(1, 17, 16)]) == [
        _shard(0, 0, 17),
        _shard(1, 17, 16),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--node-socket", required=True)
    arguments = parser.parse_args()
    rank_main(arguments.rank, arguments.work, arguments.socket, arguments.node_socket)
