"""Lightning through shmstage: real Lightning, real daemons, a tiny model on the CPU.

Runs (``lightning_run``) are real processes forked from a forkserver that imported
Lightning once, so a test can SIGKILL one mid-run without paying Lightning's import
again for every process.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import socket as socketlib
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RunningDaemon, own_fork_server, start_daemon

from shmstage.checkpoint import CheckpointError
from shmstage.manifest import MANIFEST_NAME

HERE = Path(__file__).parent
STEPS = 14


@pytest.fixture(scope="module")
def forks() -> Iterator[multiprocessing.context.ForkServerContext]:
    sys.path.insert(0, str(HERE))
    # Python 3.11's forkserver ignores sys.path for its preload: preload what an installed
    # package reaches (the tiny lightning_run is imported by each child, from HERE).
    preload = ["lightning.pytorch", "torch.distributed.checkpoint"]
    with own_fork_server([*preload, "shmstage_client.integrations.lightning"]) as context:
        yield context


def run(context: Any, workdir: Path, *args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """Run ``lightning_run.fit`` in a process of its own; its exit code and its result."""
    import lightning_run

    process = context.Process(target=lightning_run.fit, args=(str(workdir), *args), kwargs=kwargs)
    process.start()
    process.join(120)
    assert process.exitcode is not None, "the Lightning run did not finish in 120 s"
    result = workdir / f"result-{process.pid}.json"
    return process.exitcode, json.loads(result.read_text()) if result.exists() else {}


@pytest.fixture(scope="module")
def killed_and_resumed(
    forks: Any, module_daemon: RunningDaemon, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """An uninterrupted run (saving with ``block=False``); a run SIGKILLed after step 10
    (checkpoints at 3, 6, 9); a new process resuming that run with ``ckpt_path="last"``."""
    socket = str(module_daemon.socket)
    straight = tmp_path_factory.mktemp("straight")
    code, uninterrupted = run(forks, straight, socket, STEPS, block=False)
    assert code == 0
    interrupted = tmp_path_factory.mktemp("interrupted")
    code, _ = run(forks, interrupted, socket, STEPS, kill_at=10)
    assert code == -9  # SIGKILL, as it meant to
    code, resumed = run(forks, interrupted, socket, STEPS, ckpt_path="last")
    assert code == 0
    return {
        "uninterrupted": uninterrupted, "resumed": resumed, "dir": interrupted / "ckpt",
        "straight": straight,
    }  # fmt: skip


def test_a_run_sigkilled_mid_training_resumes_from_last_with_exactly_the_uninterrupted_losses(
    killed_and_resumed: dict[str, Any],
) -> None:
    uninterrupted = dict(map(tuple, killed_and_resumed["uninterrupted"]["losses"]))
    resumed = killed_and_resumed["resumed"]["losses"]
    assert [step for step, _ in resumed] == list(range(9, STEPS))  # from the step-9 checkpoint
    assert {step: loss for step, loss in resumed} == {
        step: uninterrupted[step] for step in range(9, STEPS)
    }  # bit-exact: the losses are float.hex()


def test_a_checkpoint_saved_with_block_false_holds_the_state_at_the_save(
    forks: Any, module_daemon: RunningDaemon, killed_and_resumed: dict[str, Any]
) -> None:
    """The uninterrupted run saved with ``block=False``: the optimizers' tensors were
    copied behind the next step's start and the guard held that step's update back. A copy
    that read them late would hold step 10's weights, and a run resumed from it would not
    see the uninterrupted losses."""
    assert killed_and_resumed["uninterrupted"]["deferred"]  # the copy did run behind
    straight = killed_and_resumed["straight"]
    checkpoint = str(straight / "ckpt" / "epoch=1-step=9.ckpt")
    code, resumed = run(forks, straight, str(module_daemon.socket), STEPS, ckpt_path=checkpoint)
    assert code == 0
    uninterrupted = dict(map(tuple, killed_and_resumed["uninterrupted"]["losses"]))
    assert resumed["losses"] == [[step, uninterrupted[step]] for step in range(9, STEPS)]


def test_the_resume_after_a_sigkill_reads_the_checkpoint_from_the_daemons_memory(
    killed_and_resumed: dict[str, Any],
) -> None:
    resumed = killed_and_resumed["resumed"]
    assert resumed["source"] == "memory", resumed["reason"]
    assert resumed["path"] == str(killed_and_resumed["dir"] / "last.ckpt")


def test_modelcheckpoint_keeps_top_k_and_last_complete_when_every_write_is_slow(
    forks: Any, tmp_path: Path
) -> None:
    """A slow write (the daemon's ``pause-before-manifest`` fault hook holds every
    checkpoint 0.4 s before its manifest: a shim for a disk slower than the save rate) and
    slots enough for every save to go ahead make each removal ModelCheckpoint asks for
    come while the checkpoint it removes is still being written. No removal may tear one,
    or miss one that appears later; every ``.ckpt`` seen at any moment is complete."""
    daemon = start_daemon(tmp_path / "d", env={"SHMSTAGE_FAULT": "pause-before-manifest:0.4"})
    ckpt = tmp_path / "ckpt"
    seen_incomplete: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for name in os.listdir(ckpt) if ckpt.exists() else []:
                path = ckpt / name
                complete = (path / MANIFEST_NAME).exists() or not path.exists()  # or removed
                if name.endswith(".ckpt") and path.is_dir() and not complete:
                    seen_incomplete.append(name)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        code, _ = run(forks, tmp_path, str(daemon.socket), 4, every=1, top_k=1, slots=8)
    finally:
        stop.set()
        watcher.join()
        daemon.discard()
    assert code == 0
    assert seen_incomplete == []
    names = sorted(name for name in os.listdir(ckpt) if name.endswith(".ckpt"))
    assert names == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert all((ckpt / name / MANIFEST_NAME).exists() for name in names)
    hidden = [name for name in os.listdir(ckpt) if "shmstage-re" in name]
    assert hidden == []  # every replacement installed, every removal finished


def _odd_values() -> dict[str, Any]:
    """What Lightning checkpoints hold besides the model and optimizer tensors."""
    return {
        "epoch": 3,
        "global_step": 2**70,  # beyond 64 bits: shmstage's plain values could not hold it
        "pytorch-lightning_version": "2.6.6",
        "state_dict": OrderedDict(
            [("w", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)), ("n", torch.tensor(7))]
        ),
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(3)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0], "foreach": None}],
            }
        ],
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': 'loss'}": {
                "best_k_models": {"/ckpt/epoch=0.ckpt": torch.tensor(0.25)},
                "best_model_score": torch.tensor(float("nan")),
                "kth_value": float("-inf"),
            }
        },
        "hyper_parameters": {
            "widths": (16, 32),
            "dtype": torch.bfloat16,
            "root": Path("/data"),
            "ns": argparse.Namespace(a=1),
            "tags": {"x", "y"},
            "raw": b"\x00\xff",
            3: -0.0,
            "nan": float("nan"),
        },
        "lr_schedulers": [{"step_size": 4, "_last_lr": [0.005]}],
    }


def _assert_identical(got: Any, want: Any, where: str = "checkpoint") -> None:
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert got.flatten().view(torch.uint8).tolist() == want.flatten().view(torch.uint8).tolist()
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            _assert_identical(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_identical(a, b, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got.hex() == want.hex() or (math.isnan(got) and math.isnan(want)), where
        assert math.copysign(1, got) == math.copysign(1, want), where
    else:
        assert got == want, where


def test_every_non_tensor_part_of_a_checkpoint_round_trips_exactly(
    module_daemon: RunningDaemon, tmp_path: Path
) -> None:
    from shmstage_client.integrations.lightning import ShmStageCheckpointIO

    io = ShmStageCheckpointIO(module_daemon.socket)
    checkpoint = _odd_values()
    io.save_checkpoint(checkpoint, tmp_path / "odd.ckpt")
    io.teardown()  # durable
    loaded = io.load_checkpoint(tmp_path / "odd.ckpt", weights_only=False)
    _assert_identical(loaded, _odd_values())
    assert io.last_restored is not None and io.last_restored.source == "files"  # released


def test_saving_again_at_a_path_replaces_it_only_once_the_new_checkpoint_is_durable(
    module_daemon: RunningDaemon, tmp_path: Path
) -> None:
    from shmstage_client.integrations.lightning import ShmStageCheckpointIO

    io = ShmStageCheckpointIO(module_daemon.socket)
    last = tmp_path / "last.ckpt"
    for step in range(3):
        io.save_checkpoint({"global_step": step, "state_dict": {"w": torch.full((4,), step)}}, last)
    io.teardown()
    assert io.load_checkpoint(last)["global_step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_importing_the_module_needs_no_lightning_and_using_it_names_the_extra(
    fresh_imports: dict[str, Any],
) -> None:
    """Lightning cannot be uninstalled here: a fresh interpreter hides it (see
    ``conftest.FRESH_IMPORTS``); the module imports, its class refuses."""
    refused = fresh_imports["lightning"]
    assert refused.startswith("ImportError: ")
    assert "pip install 'shmstage-client[lightning]'" in refused


def test_load_checkpoint_refuses_a_last_ckpt_another_user_put_in_a_shared_directory() -> None:
    """A hostile local user saves a checkpoint of its own as ``last.ckpt`` in a directory
    both may write (sticky, like /tmp): ``ckpt_path="last"`` would pick it, and the
    plugin must not hand its bytes to this run."""
    sys.path.insert(0, str(HERE.parent.parent / "security"))
    from sec_helpers import ATTACKER, GROUP, ensure_accounts, save_as
    from shmstage_client.integrations.lightning import ShmStageCheckpointIO

    attacker = ensure_accounts()[ATTACKER]
    base = Path(tempfile.mkdtemp(prefix="shmstage-lightning-", dir="/tmp"))  # both may reach
    base.chmod(0o755)
    where = base / "d"
    where.mkdir()
    where.chmod(0o755)
    config = where / "shmstaged.toml"
    config.write_text(f'[server]\nallowed_groups = ["{GROUP}"]\n')
    daemon = start_daemon(where, "--config", str(config))
    daemon.socket.chmod(0o666)
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    try:
        assert "SAVED" in save_as(attacker, daemon.socket, str(shared / "last.ckpt"))
        io = ShmStageCheckpointIO(daemon.socket)
        with pytest.raises(CheckpointError, match=f"belongs to uid {attacker.uid}"):
            io.load_checkpoint(shared / "last.ckpt")
        assert io.last_restored is None
    finally:
        daemon.discard()
        shutil.rmtree(base, ignore_errors=True)


def _free_port() -> int:
    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_two_rank_fsdp2_run_saves_sharded_checkpoints_through_shmstage_and_resumes_exactly(
    forks: Any, module_daemon: RunningDaemon, tmp_path: Path
) -> None:
    """Two gloo ranks of ``ModelParallelStrategy`` (FSDP2: Lightning's ``FSDPStrategy``
    wraps FSDP1, which torch refuses to run on a CPU) save sharded checkpoints with
    ``ShmStageModelParallelStrategy``: DCP rank files written by shmstaged, published whole;
    two new ranks resume from the step-4 one and see exactly the uninterrupted losses."""
    import lightning_run
    from shmstage_client.dcp import MARKER_NAME

    def ranks(steps: int, ckpt_path: str | None) -> list[dict[str, Any]]:
        port, socket = _free_port(), str(module_daemon.socket)
        processes = [
            forks.Process(
                target=lightning_run.sharded_fit,
                args=(rank, port, str(tmp_path), socket, steps, ckpt_path),
            )
            for rank in range(2)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
        assert [process.exitcode for process in processes] == [0, 0]
        return [
            json.loads((tmp_path / f"sharded-{rank}-{process.pid}.json").read_text())
            for rank, process in enumerate(processes)
        ]

    straight = ranks(8, None)
    ckpt = tmp_path / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["epoch=1-step=4.ckpt", "epoch=2-step=8.ckpt", "last.ckpt"]
    for name in os.listdir(ckpt):
        files = os.listdir(ckpt / name)
        assert MARKER_NAME in files and "meta.pt" not in files
        assert sum(f.endswith(".safetensors") for f in files) == 2
    resumed = ranks(8, str(ckpt / "epoch=1-step=4.ckpt"))
    for rank in range(2):
        want = {step: loss for step, loss in straight[rank]["losses"] if step >= 4}
        assert dict(map(tuple, resumed[rank]["losses"])) == want
        assert resumed[rank]["sources"] in (["files"], ["memory"], ["files", "memory"])


@pytest.mark.parametrize("given", ["by keyword", "by position"])
def test_a_step_given_a_closure_runs_it_while_the_copy_is_in_flight_and_updates_after(
    module_daemon: RunningDaemon, tmp_path: Path, given: str
) -> None:
    """Lightning steps its optimizers as ``optimizer.step(closure)``, the forward and
    backward inside the closure: the guard must let the closure run behind the copy of a
    ``block=False`` save and hold back only the update (a gate keeps the copy from running
    until the test opens it)."""
    from client_helpers import CopyGate
    from shmstage_client import Stager, load

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 8)
    closure_saw_the_copy_done: list[bool] = []
    gates: list[CopyGate] = []

    def closure() -> torch.Tensor:
        closure_saw_the_copy_done.extend(gate.opened.is_set() for gate in gates)
        optimizer.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss

    with Stager(module_daemon.socket) as stager:
        stager.guard(optimizer)
        optimizer.step(closure)  # AdamW's state exists from here
        before = model.weight.detach().clone()
        gate = CopyGate(stager)
        gates.append(gate)
        handle = stager.save({"w": model.weight}, tmp_path / "c", block=False)
        gate.open_in(0.2)
        if given == "by keyword":  # as Lightning's precision plugins call it
            optimizer.step(closure=closure)
        else:
            optimizer.step(closure)
        assert closure_saw_the_copy_done == [False]  # forward and backward ran meanwhile
        assert gate.opened.is_set()  # and the update waited for the copy
        handle.wait(60)
    assert torch.equal(load(tmp_path / "c")["w"], before)
    assert not torch.equal(model.weight.detach(), before)


def test_a_replacement_a_killed_trainer_left_durable_is_installed_by_the_next_load(
    module_daemon: RunningDaemon, tmp_path: Path
) -> None:
    """A trainer killed after its new ``last.ckpt`` was durable but before the exchange
    leaves it under its hidden name (its pid in it): the next load installs it, newer than
    what ``last.ckpt`` names. One older than ``last.ckpt`` (what a kill right after the
    exchange leaves there) is never installed."""
    from shmstage_client import Stager
    from shmstage_client.integrations.lightning import ShmStageCheckpointIO, pack

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process has now
    last = tmp_path / "last.ckpt"

    def save(step: int, path: Path) -> None:
        with Stager(module_daemon.socket) as stager:
            state = {"global_step": step, "state_dict": {"w": torch.full((2,), step)}}
            stager.save(pack(state), path).wait(60)

    save(1, last)
    save(2, tmp_path / f".last.ckpt.shmstage-replacing-{dead.pid}-4")
    io = ShmStageCheckpointIO(module_daemon.socket)
    assert io.load_checkpoint(last)["global_step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]

    save(0, tmp_path / f".last.ckpt.shmstage-replacing-{dead.pid}-5")  # older than step 2's
    os.utime(tmp_path / f".last.ckpt.shmstage-replacing-{dead.pid}-5" / MANIFEST_NAME, (1, 1))
    assert io.load_checkpoint(last)["global_step"] == 2
