"""Non-blocking saves behind a guard: the copy runs after save() returns, and nothing the
trainer does through the guarded optimizers can change a byte of the checkpoint.

On CPU the deferred copy runs on the Stager's copy thread. To know for certain that a step
came *before* the copy — not merely that it probably did — many tests hold that thread with
a gate (``CopyGate``): a real job queued on the real thread ahead of the copy, opened by the
test. A step that returns only once the gate was open proves the guard held it back.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from client_helpers import CopyGate
from harness import assert_same, clone, start_daemon, wait_for
from shmstage_client import DaemonLost, Stager, load
from shmstage_client.save.guard import Coverage

from shmstage import segment
from shmstage.control import ControlClient


class Net(torch.nn.Module):
    """Parameters an optimizer steps, and BatchNorm buffers that forward updates in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 128)
        self.norm = torch.nn.BatchNorm1d(128)
        self.b = torch.nn.Linear(128, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def trainer(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def forward_backward(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(1000 + seed)
    model(torch.randn(16, 64)).square().mean().backward()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    forward_backward(model, seed)
    optimizer.step()
    optimizer.zero_grad()


def state_of(model: Net, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}


def test_the_step_right_after_a_non_blocking_save_changes_no_byte_of_it(
    module_daemon, ckpt
) -> None:
    """24 steps, a non-blocking save every 3, each followed at once by a training step
    (forward updates BatchNorm's buffers, the optimizer every parameter and its state);
    every other save's copy is held until the step is under way, so its step certainly
    reached the guard before the copy ran."""
    model, optimizer = trainer()
    expected, handles, gaps = [], [], []
    with Stager(module_daemon.socket, slots=2) as stager:
        stager.guard(optimizer)
        for step in range(24):
            gate = None
            if step % 3 == 0:
                state = state_of(model, optimizer, step)
                expected.append(clone(state))
                if step % 6 == 0:
                    gate = CopyGate(stager)
                started = time.perf_counter()
                handle = stager.save(state, ckpt / f"step-{step}", block=False)
                gaps.append(time.perf_counter() - started - handle.stall_seconds)
                handles.append(handle)
                if gate is not None:
                    gate.open_in(0.05)
            train_step(model, optimizer, step)
            if gate is not None:
                assert gate.opened.is_set(), "the step ran before the copy: no guard held it"
        results = [handle.wait(60) for handle in handles]
    for handle, want in zip(handles, expected, strict=True):
        assert_same(load(handle.path), want, str(handle.path))
    # The parameters and the optimizer's state were copied after save() returned.
    assert all(r.timings.deferred_copy_seconds > 0 for r in results)
    assert all(r.staged_seconds >= r.stall_seconds for r in results)
    assert sorted(gaps)[len(gaps) // 2] < 0.005, gaps  # stall_seconds is save()'s wall clock


def test_a_mutation_outside_the_guard_before_staged_is_the_callers_error(
    module_daemon, ckpt
) -> None:
    """The guard holds back the optimizer, nothing else: an in-place change of a covered
    tensor before ``staged()`` reaches the checkpoint (as the README says); after
    ``staged()`` it cannot."""
    model, optimizer = trainer()
    weight = model.a.weight
    with Stager(module_daemon.socket) as stager:
        stager.guard(optimizer)
        before = weight.detach().clone()
        gate = CopyGate(stager)
        unsafe = stager.save({"w": weight}, ckpt / "unsafe", block=False)
        with torch.no_grad():
            weight.add_(1.0)  # not through the optimizer: nothing holds it back
        gate.open()
        unsafe.wait(60)
        assert torch.equal(load(ckpt / "unsafe")["w"], before + 1.0)

        before = weight.detach().clone()
        gate = CopyGate(stager)
        safe = stager.save({"w": weight}, ckpt / "safe", block=False)
        gate.open_in(0.05)
        safe.staged(timeout=30)
        assert gate.opened.is_set()
        with torch.no_grad():
            weight.add_(1.0)
        safe.wait(60)
        safe.staged(timeout=0)  # once landed it returns at once
    assert torch.equal(load(ckpt / "safe")["w"], before)


def test_tensors_no_guard_covers_are_copied_before_save_returns(module_daemon, ckpt) -> None:
    """Buffers (updated in place by forward), gradients and anything else outside the
    guarded optimizers' parameters and state are copied eagerly: changed right after
    save() returned, while the guarded copy is still held, the checkpoint has them as
    they were."""
    model, optimizer = trainer()
    train_step(model, optimizer, 0)
    forward_backward(model, 1)  # gradients present
    extra = torch.arange(1000.0)
    state = {
        **state_of(model, optimizer, 1),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "extra": extra,
    }
    want = clone(state)
    with Stager(module_daemon.socket) as stager:
        stager.guard(optimizer)
        gate = CopyGate(stager)
        handle = stager.save(state, ckpt / "c", block=False)
        model.train()
        forward_backward(model, 2)  # BatchNorm's running stats and the gradients change
        extra.mul_(-1.0)
        assert not torch.equal(model.norm.running_mean, want["model"]["norm.running_mean"])
        gate.open()
        result = handle.wait(60)
    assert_same(load(ckpt / "c"), want)
    assert result.timings.deferred_copy_seconds > 0


@pytest.mark.parametrize("one_call", [True, False], ids=["guard(a, b)", "guard(a); guard(b)"])
def test_several_optimizers_are_each_held_back(module_daemon, ckpt, one_call: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    sgd = torch.optim.SGD(model.a.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.AdamW([*model.norm.parameters(), *model.b.parameters()], lr=1e-2)

    def state(step: int) -> dict:
        return {"model": model.state_dict(), "sgd": sgd.state_dict(), "adam": adam.state_dict()}

    for step in range(2):
        forward_backward(model, step)
        sgd.step()
        adam.step()
    wants, handles = [], []
    with Stager(module_daemon.socket) as stager:
        if one_call:
            stager.guard(sgd, adam)
        else:
            stager.guard(sgd)
            stager.guard(adam)
        for step, first in ((2, sgd), (3, adam)):  # each optimizer steps first once
            wants.append(clone(state(step)))
            gate = CopyGate(stager)
            handles.append(stager.save(state(step), ckpt / f"s{step}", block=False))
            gate.open_in(0.05)
            forward_backward(model, step)
            first.step()
            assert gate.opened.is_set(), f"{type(first).__name__}.step() was not held back"
            (adam if first is sgd else sgd).step()
        for handle in handles:
            handle.wait(60)
    for handle, want in zip(handles, wants, strict=True):
        assert_same(load(handle.path), want)


def test_zero_grad_right_after_save_leaves_the_saved_gradients(module_daemon, ckpt) -> None:
    """Gradients are copied eagerly (backward writes them in place, outside any hook), so
    zero_grad(set_to_none=False) needs no hold and gets none: it runs while the guarded
    copy is still held, and the checkpoint keeps the gradients."""
    model, optimizer = trainer()
    forward_backward(model, 0)
    state = {"model": model.state_dict(), "grads": {n: p.grad for n, p in model.named_parameters()}}
    want = clone(state)
    with Stager(module_daemon.socket) as stager:
        stager.guard(optimizer)
        gate = CopyGate(stager)
        handle = stager.save(state, ckpt / "c", block=False)
        optimizer.zero_grad(set_to_none=False)
        assert not gate.opened.is_set()  # zero_grad did not wait for the copy
        assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())
        gate.open()
        handle.wait(60)
    assert_same(load(ckpt / "c"), want)


def test_an_lr_scheduler_step_right_after_save_leaves_the_old_lr(module_daemon, ckpt) -> None:
    """Param groups are plain values (encoded when save() is called) or, for a tensor
    ``lr``, tensors no guard covers (copied before save() returns): a scheduler's step
    right after save() changes neither in the checkpoint."""
    torch.manual_seed(0)
    model = Net()
    plain = torch.optim.SGD(model.a.parameters(), lr=0.1, momentum=0.9)
    tensor_lr = torch.optim.Adam(model.b.parameters(), lr=torch.tensor(0.01), foreach=False)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5),
        torch.optim.lr_scheduler.StepLR(tensor_lr, step_size=1, gamma=0.5),
    ]
    forward_backward(model, 0)
    plain.step()
    tensor_lr.step()
    state = {
        "plain": plain.state_dict(),
        "tensor_lr": tensor_lr.state_dict(),
        "schedulers": [s.state_dict() for s in schedulers],
    }
    want = clone(state)
    with Stager(module_daemon.socket) as stager:
        stager.guard(plain, tensor_lr)
        gate = CopyGate(stager)
        handle = stager.save(state, ckpt / "c", block=False)
        for scheduler in schedulers:
            scheduler.step()
        assert plain.param_groups[0]["lr"] == 0.05
        assert torch.equal(tensor_lr.param_groups[0]["lr"], torch.tensor(0.01) * 0.5)
        gate.open()
        handle.wait(60)
    got = load(ckpt / "c")
    assert got["plain"]["param_groups"][0]["lr"] == 0.1
    assert torch.equal(got["tensor_lr"]["param_groups"][0]["lr"], torch.tensor(0.01))
    assert_same(got, want)


def test_a_second_save_waits_for_the_first_copy_and_says_how_long(module_daemon, ckpt) -> None:
    model, optimizer = trainer()
    train_step(model, optimizer, 0)
    with Stager(module_daemon.socket, slots=2) as stager:
        stager.guard(optimizer)
        stager.save(state_of(model, optimizer, 0), ckpt / "warm").wait(60)  # registers
        first_want = clone(state_of(model, optimizer, 1))
        gate = CopyGate(stager)
        first = stager.save(state_of(model, optimizer, 1), ckpt / "first", block=False)
        gate.open_in(0.3)
        second = stager.save(state_of(model, optimizer, 2), ckpt / "second", block=False)
        assert gate.opened.is_set(), "the second save started before the first copy landed"
        first.staged(timeout=0)  # landed and handed over
        assert second.timings.copy_wait_seconds >= 0.15, second.timings
        assert second.stall_seconds >= second.timings.copy_wait_seconds
        assert first.timings.copy_wait_seconds < 0.15
        second.wait(60)
        first.wait(60)
    assert_same(load(ckpt / "first"), first_want)


def test_daemon_killed_while_a_deferred_copy_runs(tmp_path: Path, daemon, ckpt) -> None:
    """The handle raises DaemonLost, the guarded step and close() return, nothing is
    published; a daemon restarted on the same socket takes the next non-blocking save."""
    model, optimizer = trainer()
    train_step(model, optimizer, 0)
    restarted = None
    try:
        with Stager(daemon.socket) as stager:
            stager.guard(optimizer)
            stager.save(state_of(model, optimizer, 0), ckpt / "warm").wait(60)
            gate = CopyGate(stager)
            handle = stager.save(state_of(model, optimizer, 1), ckpt / "lost", block=False)
            daemon.proc.kill()
            daemon.proc.wait(10)
            gate.open_in(0.05)
            train_step(model, optimizer, 1)  # held until the copy landed, then goes on
            with pytest.raises(DaemonLost, match="nothing of it is published"):
                handle.staged(timeout=30)
            with pytest.raises(DaemonLost):
                handle.wait(30)
            assert not (ckpt / "lost").exists()
            assert stager._spares.ready(30)  # the next save's spare, made after this one
            spare = stager._spares._future.result().pending_name
            assert sorted(p.name for p in ckpt.iterdir()) == sorted([spare, "warm"])

            restarted = start_daemon(tmp_path / "restarted", socket=daemon.socket)
            want = clone(state_of(model, optimizer, 2))
            again = stager.save(state_of(model, optimizer, 2), ckpt / "again", block=False)
            train_step(model, optimizer, 2)
            again.wait(60)
            started = time.monotonic()
        assert time.monotonic() - started < 30  # close() did not hang
        assert_same(load(ckpt / "again"), want)
    finally:
        if restarted is not None:
            restarted.stop()
            for name in segment.list_names(restarted.instance):
                segment.unlink(name)


def test_removing_a_guard_makes_its_tensors_eager_again(module_daemon, ckpt, caplog) -> None:
    model, optimizer = trainer()
    train_step(model, optimizer, 0)
    weight = model.a.weight
    with Stager(module_daemon.socket) as stager:
        guard = stager.guard(optimizer)
        guard.remove()
        gate = CopyGate(stager)
        before = weight.detach().clone()
        handle = stager.save({"w": weight}, ckpt / "c", block=False)
        with torch.no_grad():
            weight.add_(1.0)  # it was copied before save() returned
        gate.open()
        result = handle.wait(60)
    assert torch.equal(load(ckpt / "c")["w"], before)
    assert result.timings.deferred_copy_seconds == 0
    assert "without a guard" in caplog.text


def test_guard_refuses_what_is_not_an_optimizer(module_daemon) -> None:
    with Stager(module_daemon.socket) as stager:
        with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
            stager.guard(torch.nn.Linear(2, 2))
        with pytest.raises(ValueError, match="at least one optimizer"):
            stager.guard()


def test_coverage_is_by_memory_the_optimizer_steps() -> None:
    """Views of a parameter or a state tensor are covered; copies, buffers, gradients and
    empty tensors are not."""
    model, optimizer = trainer()
    train_step(model, optimizer, 0)
    forward_backward(model, 1)
    weight = model.a.weight
    exp_avg = optimizer.state[weight]["exp_avg"]

    def tensors() -> list[torch.Tensor]:
        return [t for group in optimizer.param_groups for t in group["params"]] + [
            v for s in optimizer.state.values() for v in s.values()
        ]

    coverage = Coverage(tensors())
    covered = [
        model.state_dict()["a.weight"],  # a detached view
        weight[3:7],
        weight.t(),
        weight[:, ::2],
        exp_avg,
        optimizer.state[weight]["step"],
        optimizer.state_dict()["state"][0]["exp_avg_sq"],
    ]
    not_covered = [
        weight.detach().clone(),
        model.norm.running_mean,
        weight.grad,
        weight[0:0],
        torch.empty(0),
    ]
    assert [coverage.covers(t) for t in covered] == [True] * len(covered)
    assert [coverage.covers(t) for t in not_covered] == [False] * len(not_covered)
    # A view reaching past the storage's end is impossible; one of another storage is not.
    other = torch.zeros_like(weight)
    assert not coverage.covers(other)
    assert coverage.mask([other, model.norm.running_var]) is None
    assert coverage.mask([other, weight]) == [False, True]


TRAINER_DIES_BEFORE_THE_COPY = """
import sys, threading, time, torch
from shmstage_client import Stager
socket, root = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(256, 256)
optimizer = torch.optim.AdamW(model.parameters())
stager = Stager(socket)
stager.guard(optimizer)
stager.save(model.state_dict(), root + "/base").wait(60)
stager._copier.copy_thread().submit(threading.Event().wait, 600)  # the copy never runs
stager.save(model.state_dict(), root + "/victim", block=False)
print("SAVED", flush=True)
time.sleep(600)
"""


def test_a_trainer_that_dies_before_its_copy_landed_leaves_no_checkpoint(daemon, ckpt) -> None:
    """save(block=False) returned, the copy never landed, the trainer is SIGKILLed: its
    commit was only prepared, so the daemon drops it with the session — nothing published;
    what stays in memory is the earlier, acknowledged checkpoint (kept for a restart) —
    and serves on."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER_DIES_BEFORE_THE_COPY, str(daemon.socket), str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        line = trainer.stdout.readline()
        assert line.startswith("SAVED"), trainer.communicate(timeout=10)[1]
        assert daemon.segments()
    finally:
        trainer.kill()
        trainer.wait(10)
    def in_memory() -> list[str]:
        with ControlClient(daemon.socket) as control:
            held = control.status()["memory"]["checkpoints"]
        return [Path(c["directory"]).name for c in held]

    wait_for(lambda: in_memory() == ["base"], 10, "only the acknowledged checkpoint kept")
    assert not (ckpt / "victim").exists()
    assert [p.name for p in ckpt.iterdir() if not p.name.startswith(".")] == ["base"]
    with Stager(daemon.socket) as stager:
        stager.save({"w": torch.ones(3)}, ckpt / "after").wait(60)
    assert torch.equal(load(ckpt / "after")["w"], torch.ones(3))
