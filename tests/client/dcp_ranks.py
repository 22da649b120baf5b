"""One rank of a multi-process DCP scenario; tests/client/test_dcp.py starts one per rank.

    python dcp_ranks.py SCENARIO --rank R --world-size N --work DIR --sockets A,B

Ranks are separate processes with gloo on CPU. ``--sockets`` stands for the nodes: with two
daemons and four ranks, ranks 0-1 use the first and ranks 2-3 the second. Each rank trains a
small FSDP2 model with AdamW, so its state dict holds uneven DTensor shards, replicated plain
tensors (a buffer, the optimizer's step counters) and non-tensor items (param groups, extras).

A scenario checks what it can on the ranks and writes ``result-R.json`` for the test; any
failure exits non-zero with the traceback on stderr. Expected values are full (unsharded)
state dicts saved by rank 0 as ``expected-NAME.pt``, so any world size can compare with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for harness
import torch.distributed.checkpoint as dcp
from harness import assert_same, wait_file
from shmstage_client.dcp import ShmStageReader, ShmStageWriter
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

TIMEOUT = 60.0


class Net(torch.nn.Module):
    """33 and 5 rows shard unevenly over 2 and 4 ranks (one rank of 4 holds no row of ``b``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 33)
        self.b = torch.nn.Linear(33, 5, dtype=torch.bfloat16)
        self.register_buffer("scale", torch.arange(7, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).to(torch.bfloat16)).float().sum()


class Trainer:
    def __init__(self, world_size: int, checkpoint_group: Any) -> None:
        self.checkpoint_group = checkpoint_group
        torch.manual_seed(0)  # the same full model on every rank, then sharded
        self.model = Net()
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(self.model.a, mesh=mesh)
        fully_shard(self.model.b, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        torch.manual_seed(1000 * self.steps + dist.get_rank())
        self.model(torch.randn(4, 16)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            self.model.scale.add_(1)

    def state(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim, "extra": {"step": self.steps, "note": "ok"}}

    def full_state(self) -> dict[str, Any] | None:
        """The unsharded state on rank 0 (None elsewhere): what every load must reproduce."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optim = get_state_dict(self.model, self.optimizer, options=options)
        if dist.get_rank() != 0:
            return None
        return {"model": model, "optim": optim, "extra": {"step": self.steps, "note": "ok"}}

    def load(self, reader: Any, *, tensors_only: bool = False) -> None:
        """Load into this (fresh) trainer through ``reader``; ``tensors_only`` skips objects."""
        state = self.state()
        target = state
        if tensors_only:  # what the stock HF reader can serve: tensors, not param groups
            target = {
                "model": state["model"],
                "optim": {"state": state["optim"]["state"]},
            }
        dcp.load(target, storage_reader=reader, process_group=self.checkpoint_group)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.steps = state["extra"]["step"]


def tensors_of(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": state["model"], "optim": {"state": state["optim"]["state"]}}


class Rank:
    def __init__(self, args: argparse.Namespace) -> None:
        self.rank, self.world_size = args.rank, args.world_size
        self.work = Path(args.work)
        sockets = args.sockets.split(",")
        self.socket = sockets[self.rank * len(sockets) // self.world_size]
        self.result: dict[str, Any] = {"rank": self.rank, "socket": self.socket}
        dist.init_process_group(
            "gloo",
            init_method=f"file://{self.work / f'store-{args.scenario}'}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=TIMEOUT),
        )
        # DCP's own collectives on a group of their own, so a save in flight never
        # interleaves with training's collectives (as a real trainer must do too).
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))

    def trainer(self) -> Trainer:
        return Trainer(self.world_size, self.checkpoint_group)

    def expect(self, name: str, trainer: Trainer) -> None:
        full = trainer.full_state()
        if full is not None:
            torch.save(full, self.work / f"expected-{name}.pt")

    def check_full(self, name: str, trainer: Trainer, *, tensors_only: bool = False) -> None:
        full = trainer.full_state()
        if full is not None:
            expected = torch.load(self.work / f"expected-{name}.pt", weights_only=False)
            if tensors_only:
                full, expected = tensors_of(full), tensors_of(expected)
            assert_same(full, expected, name, key_order=False)

    def signal(self, name: str) -> None:
        (self.work / f"{name}-{self.rank}").touch()

    def finish(self) -> None:
        (self.work / f"result-{self.rank}.json").write_text(json.dumps(self.result))
        dist.barrier()
        dist.destroy_process_group()


def save_and_reload(r: Rank) -> None:
    """Saves at this world size (async twice, then sync), then loads each back bit-exactly."""
    ckpt = r.work / f"ckpt-{r.world_size}"
    trainer = r.trainer()
    writer = ShmStageWriter(socket=r.socket)
    layouts = []
    for step in (1, 2):
        trainer.step()
        r.expect(f"ws{r.world_size}-step-{step}", trainer)
        started = time.perf_counter()
        future = dcp.async_save(
            trainer.state(),
            checkpoint_id=ckpt / f"step-{step}",
            storage_writer=writer,
            process_group=r.checkpoint_group,
        )
        r.result[f"stall-{step}"] = time.perf_counter() - started
        trainer.step()  # mutate every tensor while the save is in flight
        future.result(timeout=TIMEOUT)
        assert writer.last_stage is not None
        layouts.append(writer.last_stage.layout_id)
    r.result["async_layouts"] = layouts
    r.expect(f"ws{r.world_size}-step-3", trainer)
    dcp.save(
        trainer.state(),
        checkpoint_id=ckpt / "step-3",
        storage_writer=writer,
        process_group=r.checkpoint_group,
    )
    writer.close()
    for step in (1, 2, 3):
        fresh = r.trainer()
        fresh.load(ShmStageReader(ckpt / f"step-{step}"))
        r.check_full(f"ws{r.world_size}-step-{step}", fresh)
    r.result["saved"] = True


def load_resharded(r: Rank, saved_world_size: int) -> None:
    """Loads a checkpoint saved at another world size, with both readers."""
    saved = r.work / f"ckpt-{saved_world_size}" / "step-2"
    expected = f"ws{saved_world_size}-step-2"
    fresh = r.trainer()
    fresh.load(HuggingFaceStorageReader(str(saved)), tensors_only=True)
    r.check_full(expected, fresh, tensors_only=True)
    fresh = r.trainer()
    fresh.load(ShmStageReader(saved))
    r.check_full(expected, fresh)
    r.result["resharded"] = True


def refuse_process_mode(r: Rank) -> None:
    """async_save in PROCESS mode fails on every rank with the reason, without a hang."""
    trainer = r.trainer()
    trainer.step()
    writer = ShmStageWriter(socket=r.socket)
    future = dcp.async_save(
        trainer.state(),
        checkpoint_id=r.work / "process-mode",
        storage_writer=writer,
        process_group=r.checkpoint_group,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    try:
        future.result(timeout=TIMEOUT)
        r.result["process_mode"] = "saved"
    except Exception as exc:
        r.result["process_mode"] = f"{type(exc).__name__}: {exc}"
    writer.close()


def scenario_world_size_4(r: Rank) -> None:
    save_and_reload(r)
    r.finish()


def scenario_world_size_2(r: Rank) -> None:
    """Runs after world size 4 saved: reshards its checkpoint, then saves its own."""
    load_resharded(r, 4)
    save_and_reload(r)
    refuse_process_mode(r)
    r.finish()


class GatedPlanner(DefaultSavePlanner):
    """Holds the coordinator's global planning until the test says go (``go`` file).

    Every rank has staged by then, and no rank has committed: the test can fail a daemon
    at exactly that point.
    """

    def __init__(self, gate: Path) -> None:
        super().__init__()
        self.gate = gate

    def create_global_plan(self, all_plans: list[Any]) -> Any:
        deadline = time.monotonic() + TIMEOUT
        while not self.gate.exists():
            assert time.monotonic() < deadline, "the test never opened the gate"
            time.sleep(0.01)
        return super().create_global_plan(all_plans)


def scenario_daemon_dies(r: Rank) -> None:
    """One node's daemon is killed mid-save: every rank's save raises, nothing is published."""
    ckpt = r.work / "ckpt"
    trainer = r.trainer()
    writer = ShmStageWriter(socket=r.socket)
    trainer.step()
    r.expect("good", trainer)
    dcp.async_save(
        trainer.state(),
        checkpoint_id=ckpt / "good",
        storage_writer=writer,
        process_group=r.checkpoint_group,
    ).result(timeout=TIMEOUT)
    trainer.step()

    def attempt(name: str, planner: Any = None, staged: Callable[[], None] = lambda: None) -> str:
        started = time.monotonic()
        future = dcp.async_save(
            trainer.state(),
            checkpoint_id=ckpt / name,
            storage_writer=writer,
            planner=planner,
            process_group=r.checkpoint_group,
        )
        staged()
        try:
            future.result(timeout=TIMEOUT)
        except dcp.CheckpointException as exc:  # a BaseException: DCP's, not ours
            r.result[f"{name}-seconds"] = time.monotonic() - started
            return f"{type(exc).__name__}: {exc}"
        return "saved"

    # The test kills the second daemon once every rank has staged ("staged-R" files).
    r.result["killed-mid-save"] = attempt(
        "mid-save", GatedPlanner(r.work / "go"), lambda: r.signal("staged")
    )
    # Its daemon stays dead: the next save fails at staging, and still on every rank.
    r.result["daemon-gone"] = attempt("after")
    writer.close()
    r.finish()


def scenario_guarded(r: Rank) -> None:
    """async_save through a writer that guards the optimizer: the copy of the FSDP2 shards
    (DTensors, covered through their local tensors: ``deferred``, the share of the bytes
    copied late, is all but the buffer and the step counters) runs after async_save returned, the
    step right after it is held until the copy landed, and each checkpoint is the state at
    its call — the buffer ``scale``, changed outside the optimizer, included."""
    ckpt = r.work / "ckpt-guarded"
    trainer = r.trainer()
    writer = ShmStageWriter(socket=r.socket, guard=trainer.optimizer)
    deferred = []
    for step in (1, 2):
        trainer.step()
        r.expect(f"guarded-step-{step}", trainer)
        response = dcp.async_save(
            trainer.state(),
            checkpoint_id=ckpt / f"step-{step}",
            storage_writer=writer,
            process_group=r.checkpoint_group,
        )
        assert isinstance(response, AsyncSaveResponse), type(response)
        trainer.step()  # at once: its optimizer step waits for the copy
        response.staging_completion.result(timeout=TIMEOUT)
        response.upload_completion.result(timeout=TIMEOUT)
        stats = writer.last_stage
        assert stats is not None and stats.timings.deferred_copy_seconds > 0
        deferred.append(stats.deferred_bytes / stats.bytes)
    writer.close()
    for step in (1, 2):
        fresh = r.trainer()
        fresh.load(ShmStageReader(ckpt / f"step-{step}"))
        r.check_full(f"guarded-step-{step}", fresh)
    r.result["deferred"] = deferred
    r.finish()


def save_local_part(r: Rank, trainer: Trainer, name: str) -> None:
    """This rank's shards of every tensor, by DCP's flat key: what its part must hold."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _mappings = flatten_state_dict(trainer.state())
    local = {
        key: (value.to_local() if isinstance(value, DTensor) else value).clone()
        for key, value in flat.items()
        if isinstance(value, torch.Tensor)
    }
    torch.save(local, r.work / f"local-{r.rank}-{name}.pt")


def scenario_publish(r: Rank) -> None:
    """Each save also publishes its slots as the parts of a version (``publish_next``):
    step 1 through async_save, then (once the test holds step 1 pinned) step 2 through
    dcp.save and step 3 through async_save again; every checkpoint loads back bit-exactly
    with the stock HF reader."""
    from shmstage_client.dcp import ShmStagePublisher

    ckpt = r.work / "ckpt-publish"
    trainer = r.trainer()
    writer = ShmStageWriter(socket=r.socket, slots=2)
    # the same state published the usual way, for the reader to compare (kept connected:
    # a publisher's versions go with it)
    direct = ShmStagePublisher("dcp-direct", socket=r.socket, process_group=r.checkpoint_group)
    for step in (1, 2, 3):
        trainer.step()
        r.expect(f"pub-{step}", trainer)
        save_local_part(r, trainer, f"pub-{step}")
        if step == 1:
            direct.publish(trainer.state(), step=1)
        writer.publish_next(
            "dcp-policy", step=step, metadata={"loss": step / 10},
            process_group=r.checkpoint_group,
        )  # fmt: skip
        if step == 2:
            dcp.save(
                trainer.state(),
                checkpoint_id=ckpt / f"step-{step}",
                storage_writer=writer,
                process_group=r.checkpoint_group,
            )
        else:
            future = dcp.async_save(
                trainer.state(),
                checkpoint_id=ckpt / f"step-{step}",
                storage_writer=writer,
                process_group=r.checkpoint_group,
            )
            trainer.step()  # mutate every tensor while the save is in flight
            future.result(timeout=TIMEOUT)
        assert writer.last_published is not None and writer.last_published.step == step
        r.result[f"complete-{step}"] = writer.last_published.complete
        r.signal(f"saved-{step}")
        if step == 1:
            wait_file(r.work / "go-2")  # the test holds step 1 pinned from here on
        dist.barrier()
    wait_file(r.work / "read-3")  # a publisher's versions go with its connection
    writer.close()
    direct.close()
    for step in (1, 2, 3):
        fresh = r.trainer()
        fresh.load(HuggingFaceStorageReader(str(ckpt / f"step-{step}")), tensors_only=True)
        r.check_full(f"pub-{step}", fresh, tensors_only=True)
    r.finish()


def scenario_publish_rank_dies(r: Rank) -> None:
    """Rank 1 dies in its write_data, before its commit and part: rank 0's part of step 1
    waits (2 s) and is dropped; its file is written durable all the same."""
    trainer = r.trainer()
    writer = ShmStageWriter(socket=r.socket)
    writer.publish_next("dcp-dies", step=1, within=2.0, process_group=r.checkpoint_group)
    if r.rank == 1:
        def die(*args: Any, **kwargs: Any) -> Any:
            os._exit(17)

        writer.write_data = die  # type: ignore[method-assign]
    trainer.step()
    try:
        dcp.save(
            trainer.state(),
            checkpoint_id=r.work / "ckpt-dies",
            storage_writer=writer,
            process_group=r.checkpoint_group,
        )
        r.result["saved"] = True
    except Exception as exc:  # rank 1 is gone: DCP's gather of results fails
        r.result["saved"] = repr(exc)[:200]
    assert writer.last_result is not None, "rank 0's file was not reported durable"
    assert writer.last_published is not None
    r.result["complete"] = writer.last_published.complete
    r.result["durable"] = [str(writer.last_result.path / f) for f in writer.last_result.files]
    (r.work / f"result-{r.rank}.json").write_text(json.dumps(r.result))
    wait_file(r.work / "exit")  # connected until the test saw the step dropped by time
    os._exit(0)  # no collective at exit: rank 1 is gone


SCENARIOS = {
    "publish": scenario_publish,
    "publish_rank_dies": scenario_publish_rank_dies,
    "guarded": scenario_guarded,
    "world_size_4": scenario_world_size_4,
    "world_size_2": scenario_world_size_2,
    "daemon_dies": scenario_daemon_dies,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--sockets", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    SCENARIOS[args.scenario](Rank(args))


if __name__ == "__main__":
    main()
