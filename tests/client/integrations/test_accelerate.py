"""Accelerate's save_state/load_state through shmstage: real Accelerate, a real daemon, a
tiny model on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RunningDaemon, skip_unless_installed
from shmstage_client import Stager

pytestmark = skip_unless_installed("accelerate")


class Counter:
    """A custom object registered for checkpointing."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def setup(seed: int) -> tuple[Any, torch.nn.Module, Any, Any, Counter]:
    from accelerate import Accelerator

    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, scheduler, counter


def steps(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, counter: Counter,
          n: int) -> list[float]:
    """``n`` steps on random inputs drawn now: equal losses need equal random states."""
    losses = []
    for _ in range(n):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.step += 1
        counter.seen += 1
        losses.append(loss.item())
    return losses


def test_save_state_and_load_state_round_trip_everything_accelerate_saves(
    module_daemon: RunningDaemon, tmp_path: Path
) -> None:
    from shmstage_client.integrations.accelerate import load_state, save_state

    accelerator, model, optimizer, scheduler, counter = setup(seed=0)
    steps(accelerator, model, optimizer, scheduler, counter, 3)
    with Stager(module_daemon.socket) as stager:
        handle = save_state(accelerator, tmp_path / "step-3", stager=stager)
        expected = steps(accelerator, model, optimizer, scheduler, counter, 3)
        handle.wait(30)

        again = setup(seed=1)  # another initialisation: everything must come back
        restored = load_state(again[0], tmp_path / "step-3", socket=module_daemon.socket)
    assert restored.source == "memory"
    assert again[0].step == 3 and again[4].seen == 3
    assert again[3].state_dict()["last_epoch"] == 3
    assert steps(*again, 3) == expected  # model, optimizer, scheduler and RNG states


def test_load_state_without_a_path_takes_this_users_newest_checkpoint_under_a_directory(
    module_daemon: RunningDaemon, tmp_path: Path
) -> None:
    from shmstage_client.integrations.accelerate import load_state, save_state

    accelerator, model, optimizer, scheduler, counter = setup(seed=0)
    with Stager(module_daemon.socket) as stager:
        for step in (1, 2):
            steps(accelerator, model, optimizer, scheduler, counter, 1)
            save_state(accelerator, tmp_path / "ckpt" / f"step-{step}", stager=stager).wait(30)
        stager.save({"w": torch.ones(2)}, tmp_path / "plain").wait(30)
        again = setup(seed=1)
        restored = load_state(again[0], under=tmp_path / "ckpt", socket=module_daemon.socket)
        assert restored.path == tmp_path / "ckpt" / "step-2" and again[0].step == 2
        with pytest.raises(ValueError, match="not a checkpoint of shmstage's save_state"):
            load_state(again[0], tmp_path / "plain", socket=module_daemon.socket)
