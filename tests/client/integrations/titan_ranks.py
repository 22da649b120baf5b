"""A torchtitan-shaped training run on CPU, its ranks forked; test_torchtitan.py starts it.

    python titan_ranks.py --work DIR --socket SOCKET

torchtitan 0.3's ``Trainer`` cannot run here (its model registry imports triton, and it picks
a CUDA device), so each rank does what ``Trainer.__init__`` and ``Trainer.train`` do with the
real torchtitan pieces: ``ConfigManager`` parses torchtitan's command line (with
``--override.imports`` naming our override) onto ``titan_config.tiny``, ``apply_overrides``
swaps the config nodes, ``config.checkpoint.build(...)`` gets the trainer's arguments
(``OptimizersContainer`` and ``LRSchedulersContainer`` built from their configs, a
``ParallelAwareDataloader``, the train state), and the loop calls the checkpointer where
``train``/``train_step`` do: ``load`` before the first step, ``maybe_wait_for_staging`` between
gradient clipping and ``optimizers.step()``, ``save(step, last_step=...)`` after each step,
``close`` at the end. The model is a small FSDP2-sharded decoder (uneven shards, a buffer).

Each rank writes ``result-SCENARIO-RANK.json``; a rank that fails prints its traceback and
exits 1; ``exits.json`` has every rank's exit status.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import faulthandler
import importlib
import json
import os
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # titan_config; tests/ for harness
import titan_config  # noqa: E402, F401  (and through it torchtitan's checkpointer, optimizers)
from harness import assert_same, start_daemon  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.config.override import apply_overrides  # noqa: E402

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

TIMEOUT = 60.0
RUN_LIMIT = 120.0
OVERRIDE = "shmstage_client.integrations.torchtitan.shmstage_checkpoint"
LEFTOVER = ".step-9.0123456789abcdef.shmstage-pending"
VOCAB = 67
#: What every rank imports on its way (the optimizers' first step imports torch._dynamo,
#: the override shmstage's DCP and client modules, tyro's parse typeguard): imported here
#: once, before the ranks are forked, instead of once in each of the five (torch._dynamo
#: alone costs a few CPU-seconds). The override module itself is not: its import by name
#: from torchtitan's command line is part of what the ranks test.
PRELOAD = (
    "torch._dynamo",
    "torch.distributed.checkpoint._fsspec_filesystem",
    "torch.utils.serialization",
    "shmstage_client.dcp",
    "shmstage_client.restore.restoring",
    "shmstage_client.save.publish",
    "shmstage_client.save.stager",
    "shmstage_client.subscribe.subscriber",
    "typeguard",
    "tyro._backends._tyro_backend",
    "tyro.constructors._struct_spec_dataclass",
)  # rows shard unevenly over 2 ranks (34 and 33)


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


class TinyDecoder(torch.nn.Module):
    def __init__(self, dim: int = 24, layers: int = 2) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, dim)
        self.layers = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(dim)
        self.out = torch.nn.Linear(dim, VOCAB, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) * self.scale
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))


class TokenStream(IterableDataset, Stateful):
    """Sample i of rank r is the same in every run: resuming must continue the stream."""

    def __init__(self, rank: int, seq_len: int) -> None:
        self.rank, self.seq_len, self.next = rank, seq_len, 0

    def __iter__(self) -> Any:
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.next)
            tokens = torch.randint(0, VOCAB, (self.seq_len + 1,), generator=g)
            self.next += 1
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next = state_dict["next"]


class TrainState(Stateful):
    """What torchtitan's Trainer saves as ``train_state`` (its own state_dict)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class Run:
    """The trainer's components, built from the parsed config as Trainer.__init__ does."""

    def __init__(self, rank: int, world_size: int, config: Any, *, checkpoint: Any = None) -> None:
        self.config = config
        torch.manual_seed(0)  # the same full model on every rank, then sharded
        self.model = TinyDecoder()
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizers = config.optimizer.build(model_parts=[self.model])
        self.lr_schedulers = config.lr_scheduler.build(
            optimizers=self.optimizers, training_steps=config.training.steps
        )
        self.dataloader = ParallelAwareDataloader(
            TokenStream(rank, config.training.seq_len),
            dp_rank=rank,
            dp_world_size=world_size,
            batch_size=config.training.local_batch_size,
        )
        self.train_state = TrainState()
        self.checkpointer = (checkpoint or config.checkpoint).build(
            dataloader=self.dataloader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
            base_folder=config.dump_folder,
        )
        self.losses: dict[int, float] = {}
        self.save_seconds: dict[int, float] = {}
        self._data: Any = None

    def load(self) -> None:
        self.checkpointer.load(step=self.config.checkpoint.load_step)

    def step(self) -> int:
        """One ``Trainer.train_step``, the checkpointer called where torchtitan calls it."""
        if self._data is None:
            self._data = iter(self.dataloader)
        state = self.train_state
        state.step += 1
        self.optimizers.zero_grad()
        inputs, labels = next(self._data)
        logits = self.model(inputs["input"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0, foreach=True)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        state.ntokens_seen += labels.numel()
        self.losses[state.step] = loss.item()
        return state.step

    def save(self, step: int) -> None:
        started = time.perf_counter()
        self.checkpointer.save(step, last_step=step == self.config.training.steps)
        self.save_seconds[step] = time.perf_counter() - started

    def snapshot(self) -> dict[str, Any]:
        """This rank's part of everything the checkpointer saves, copied."""
        return {
            "model": _local(self.model.state_dict()),
            "optimizer": _local(self.optimizers.state_dict()),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "dataloader": self.dataloader.state_dict(),
            "train_state": self.train_state.state_dict(),
        }


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _local(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local(item) for item in value)
    return copy.deepcopy(value)


class Rank:
    """One rank of one scenario, in a process of its own (forked by ``main``)."""

    def __init__(
        self, scenario: str, rank: int, world_size: int, work: Path, socket: str
    ) -> None:
        self.scenario, self.rank, self.world_size = scenario, rank, world_size
        self.work, self.socket = work, socket
        self.result: dict[str, Any] = {"rank": rank}
        dist.init_process_group(
            "gloo",
            init_method=f"file://{work / f'store-{scenario}'}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=TIMEOUT),
        )

    def config(self, *cli: str, dump: str = "dump") -> Any:
        """torchtitan's command line, parsed and overridden as torchtitan.train does."""
        config = ConfigManager().parse_args(
            ["--module", "titan_config", "--config", "tiny",
             f"--dump_folder={self.work / dump}", *cli]
        )
        if config.override.imports:  # Trainer.__init__, before any component is built
            apply_overrides(config.override, config)
        return config

    def override(self, **settings: Any) -> list[str]:
        """The command-line arguments that select shmstage, with ``settings``."""
        settings = {"socket": self.socket, **settings}
        return ["--override.imports", f"{OVERRIDE}={json.dumps(settings)}"]

    def expected_path(self, name: str) -> Path:
        return self.work / f"expected-{name}-rank{self.rank}.pt"

    def write(self) -> None:
        path = self.work / f"result-{self.scenario}-{self.rank}.json"
        path.write_text(json.dumps(self.result))

    def finish(self) -> None:
        self.write()
        dist.barrier()
        dist.destroy_process_group()


def first(r: Rank) -> None:
    """Train with checkpoints every 2 steps, copy behind the next step (the override's
    default mode); after step 8's training, before its save, wait for step 6 to be durable
    (as the next save would) and die by SIGKILL, leaving the daemon holding step 6."""
    config = r.config("--checkpoint.enable", *r.override())
    run = Run(r.rank, r.world_size, config)
    r.result["manager"] = type(run.checkpointer).__qualname__
    r.result["async_mode"] = str(run.checkpointer.async_mode.value)
    r.result["socket"] = run.checkpointer.socket
    run.load()
    while True:
        step = run.step()
        if step == 8:
            break
        run.save(step)
        if step == 6:
            torch.save(run.snapshot(), r.expected_path("step-6"))
    run.checkpointer.maybe_wait_for_saving()
    stage = run.checkpointer.writer.last_stage
    r.result["deferred_bytes"] = stage.deferred_bytes if stage else None
    r.result["losses"] = run.losses
    r.result["save_seconds"] = run.save_seconds
    r.write()
    os.kill(os.getpid(), signal.SIGKILL)


def resume(r: Rank) -> None:
    """A new run of the same command finds step 6 (the newest published checkpoint), loads
    it from the daemon's memory bit-exactly, and trains on to the end: a save at step 8
    (keep_latest_k=2 while it is in flight), the last step's model-only export at 10."""
    config = r.config("--checkpoint.enable", *r.override(async_mode="async"))
    run = Run(r.rank, r.world_size, config)
    r.result["async_mode"] = str(run.checkpointer.async_mode.value)
    run.load()
    r.result["loaded_step"] = run.train_state.step
    r.result["sources"] = run.checkpointer.last_load_sources
    expected = torch.load(r.expected_path("step-6"), weights_only=False)
    assert_same(run.snapshot(), expected, "state after loading step 6", key_order=False)
    while run.train_state.step < config.training.steps:
        run.save(run.step())
    run.checkpointer.close()
    r.result["losses"] = run.losses
    final = _local(run.model.state_dict())
    r.result["final_model_keys"] = sorted(final)
    torch.save(final, r.expected_path("final-model"))
    r.finish()


def modes(r: Rank) -> None:
    """One rank, the manager's own Config in a config function (no override): synchronous
    saves through shmstage, the model-only export, a load from files; a manager whose
    daemon does not answer, refused before training; one whose daemon dies before a save."""
    from shmstage_client.errors import DaemonUnavailable, SaveError
    from shmstage_client.integrations.torchtitan import ShmStageCheckpointManager

    config = r.config(dump="dump-modes")
    ckpt = ShmStageCheckpointManager.Config(
        enable=True,
        async_mode="disabled",
        interval=1,
        keep_latest_k=0,
        socket=r.socket,
        restore_source="files",
    )
    config.training.steps = 3
    run = Run(r.rank, r.world_size, config, checkpoint=ckpt)
    r.result["pg"] = run.checkpointer.pg is not None
    run.load()
    for _ in range(3):
        step = run.step()
        run.save(step)
        if step == 2:
            expected = run.snapshot()
    run.checkpointer.close()
    final = _local(run.model.state_dict())

    again = Run(r.rank, r.world_size, config, checkpoint=ckpt)
    again.checkpointer.load(step=2)
    r.result["sources"] = again.checkpointer.last_load_sources
    assert_same(again.snapshot(), expected, "state after loading step 2", key_order=False)
    again.checkpointer.close()

    export = {key: torch.zeros_like(value) for key, value in final.items()}
    dcp.load(export, checkpoint_id=str(Path(config.dump_folder) / "checkpoint" / "step-3"))
    assert_same(export, final, "the model-only export, read by stock DCP")

    try:
        nowhere = dataclasses.replace(ckpt, socket=str(r.work / "no-daemon.sock"))
        Run(r.rank, r.world_size, config, checkpoint=nowhere)
    except DaemonUnavailable as exc:
        r.result["unreachable"] = str(exc)

    # A daemon lost after the manager was built: the asynchronous save fails without
    # stopping the step, and the wait for it (the next save's, or close) raises SaveError.
    lost = start_daemon(r.work / "lost-node")
    elsewhere = dataclasses.replace(config, dump_folder=str(r.work / "dump-lost"))
    run = Run(r.rank, r.world_size, elsewhere, checkpoint=dataclasses.replace(
        ckpt, socket=str(lost.socket), async_mode="async"
    ))
    lost.proc.kill()
    lost.proc.wait(10)
    run.save(run.step())
    try:
        run.checkpointer.maybe_wait_for_saving()
    except SaveError as exc:
        r.result["lost"] = str(exc)
    run.checkpointer.close()
    folder = r.work / "dump-lost" / "checkpoint"
    r.result["lost_folder"] = sorted(os.listdir(folder)) if folder.exists() else []
    r.finish()


SCENARIOS = {"first": first, "resume": resume, "modes": modes}


def fork_rank(scenario: str, rank: int, world_size: int, args: argparse.Namespace) -> int:
    """A process for one rank: forked from this one, which imported torch, torchtitan,
    tyro and ``PRELOAD`` but used none of them (no tensor, no process group, no daemon
    connection), so each rank starts as a fresh trainer would, without paying the imports again."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        faulthandler.dump_traceback_later(RUN_LIMIT, exit=True)  # a hang shows where, and ends
        SCENARIOS[scenario](Rank(scenario, rank, world_size, Path(args.work), args.socket))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait(children: dict[str, int]) -> dict[str, int]:
    """Each child's exit status: its code, or minus the signal that ended it."""
    return {
        name: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for name, pid in children.items()
    }


def main() -> None:
    """The killed run ("first", 2 ranks) beside "modes" (1 rank), then "resume" (2 ranks);
    each rank's exit status goes to ``exits.json`` (the first run's ranks die by SIGKILL)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--socket", required=True)
    args = parser.parse_args()
    os.chdir(args.work)
    for module in PRELOAD:
        importlib.import_module(module)
    exits = wait(
        {f"first-{rank}": fork_rank("first", rank, 2, args) for rank in range(2)}
        | {"modes-0": fork_rank("modes", 0, 1, args)}
    )
    # What a save killed between its ranks' commits and its publish leaves beside the
    # checkpoints: a hidden pending directory, with a rank's committed data in it.
    leftover = Path(args.work) / "dump" / "checkpoint" / LEFTOVER / "rank-00000"
    leftover.mkdir(parents=True)
    (leftover / "rank-00000-of-00002.safetensors").write_bytes(b"\0" * 64)
    exits |= wait({f"resume-{rank}": fork_rank("resume", rank, 2, args) for rank in range(2)})
    (Path(args.work) / "exits.json").write_text(json.dumps(exits))


if __name__ == "__main__":
    main()
