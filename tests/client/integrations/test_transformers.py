"""The Hugging Face Trainer (and TRL's SFTTrainer) through ShmStageCallback: real
transformers, real daemons, a tiny Llama on the CPU.

Runs are real processes forked from a forkserver that imported transformers and TRL once
(``hf_train``), so a test can SIGKILL one mid-run without paying the import again.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import RunningDaemon, own_fork_server, skip_unless_installed, start_daemon

pytestmark = skip_unless_installed("transformers", "trl")

HERE = Path(__file__).parent
NOBODY = 65534


#: What the forkserver imports once. Not ``hf_train`` itself: Python 3.11's forkserver
#: does not apply the parent's sys.path before its preload (and skips a module it cannot
#: import without a word); the forked runs get it, and import ``hf_train`` cheaply.
PRELOAD = [
    "torch",
    "transformers.trainer",
    "transformers.models.llama.modeling_llama",
    "trl.trainer.sft_trainer",
    "datasets",
    "shmstage_client.integrations.transformers",
]


@pytest.fixture(scope="module")
def forks() -> Iterator[Any]:
    import sys

    sys.path.insert(0, str(HERE))
    with own_fork_server(PRELOAD) as context:
        yield context


def start(context: Any, workdir: Path, socket: Path, **kwargs: Any) -> Any:
    """Fork a run of ``hf_train.train``; this process never imports transformers."""
    import hf_launch

    workdir.mkdir(exist_ok=True)
    process = context.Process(
        target=hf_launch.train, args=(str(workdir), str(socket)), kwargs=kwargs
    )
    process.start()
    return process


def finish(process: Any, workdir: Path) -> tuple[int, dict[str, Any]]:
    """Wait for a run; its exit code and its result."""
    process.join(120)
    assert process.exitcode is not None, "the training run did not finish in 120 s"
    result = workdir / f"result-{process.pid}.json"
    return process.exitcode, json.loads(result.read_text()) if result.exists() else {}


def run(context: Any, workdir: Path, socket: Path, **kwargs: Any) -> dict[str, Any]:
    code, result = finish(start(context, workdir, socket, **kwargs), workdir)
    assert code == 0, f"the training run exited with {code}"
    return result


def test_a_run_killed_mid_training_resumes_from_memory_with_the_losses_of_an_uninterrupted_run(
    forks: Any, module_daemon: RunningDaemon, tmp_path: Path
) -> None:
    reference = start(forks, tmp_path / "reference", module_daemon.socket, stock=True)
    killed = start(forks, tmp_path / "run", module_daemon.socket, kill_at=10)
    code, _ = finish(killed, tmp_path / "run")
    assert code == -9, "the run was to be SIGKILLed at step 10"
    out = tmp_path / "run" / "out"
    # Every visible checkpoint is complete: checkpoint-8 was acknowledged before the kill.
    assert sorted(p.name for p in out.glob("checkpoint-*")) in (
        ["checkpoint-4"],
        ["checkpoint-4", "checkpoint-8"],
    )
    resumed = run(forks, tmp_path / "run", module_daemon.socket, resume=True)
    _, uninterrupted = finish(reference, tmp_path / "reference")

    assert resumed["restored"] == {"source": "memory", "path": str(out / "checkpoint-8")}
    assert [entry["step"] for entry in resumed["losses"]] == list(range(1, 13))
    assert resumed["losses"] == uninterrupted["losses"]  # loss, grad norm, lr, epoch: exact


def test_rotation_never_removes_a_checkpoint_still_being_written_and_none_shows_partial(
    forks: Any, tmp_path: Path
) -> None:
    # The daemon holds the second checkpoint's write for 3 s once its data file is written
    # (before its manifest; daemon/shmstage_daemon/faults.py): the later saves are written
    # and published meanwhile, and rotated with save_total_limit=1.
    daemon = start_daemon(tmp_path / "d", env={"SHMSTAGE_FAULT": "pause-before-manifest:3@2"})
    try:
        result = run(
            forks, tmp_path, daemon.socket, steps=16, save_steps=2, save_total_limit=1,
            watch=True,
        )  # exit code 0: every save, the held one included, completed (a failure raises)
        log = daemon.log()
    finally:
        daemon.discard()
    assert "fault: pausing at before-manifest" in log
    assert "job 2: model.safetensors written" in log  # checkpoint-4, published at last
    seen = result["seen"]
    for snapshot in seen:  # a checkpoint is visible only once complete
        assert set(snapshot["visible"].values()) <= {"complete"}, snapshot
        assert snapshot["stock_last"] in (None, "complete"), snapshot
    rotated_meanwhile = [
        s for s in seen
        if "checkpoint-4" not in s["visible"] and "checkpoint-2" not in s["visible"]
        and any(int(name.split("-")[1]) > 4 for name in s["visible"])
    ]
    assert rotated_meanwhile, "no later checkpoint was published and rotated during the hold"
    # Once every save is durable the limit holds, newest kept, nothing hidden left behind.
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-16"]
    assert [e["step"] for e in result["losses"]] == list(range(1, 17))


def test_trls_sft_trainer_saves_and_resumes_through_the_callback(
    forks: Any, module_daemon: RunningDaemon, tmp_path: Path
) -> None:
    first = run(forks, tmp_path, module_daemon.socket, use_trl=True, steps=6, save_steps=3)
    assert first["class"] == "SFTTrainer"  # the callback keeps the Trainer's class name
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    resumed = run(
        forks, tmp_path, module_daemon.socket, use_trl=True, steps=8, save_steps=3, resume=True
    )
    assert resumed["restored"]["path"] == str(out / "checkpoint-6")
    assert [e["step"] for e in resumed["losses"]] == list(range(1, 9))
    assert resumed["losses"][:6] == first["losses"]


def test_resume_and_last_checkpoint_skip_a_newer_checkpoint_another_user_planted(
    forks: Any, module_daemon: RunningDaemon, tmp_path: Path
) -> None:
    from shmstage_client.integrations.transformers import last_checkpoint

    run(forks, tmp_path, module_daemon.socket, steps=4, save_steps=2)
    out = tmp_path / "out"
    out.chmod(0o1777)  # a shared, sticky output directory: anyone may add an entry
    # Another user's checkpoint-99: valid in every respect but who wrote it (a copy of
    # this run's, owned by uid 65534 as if that user had saved it).
    planted = out / "checkpoint-99"
    shutil.copytree(out / "checkpoint-4", planted)
    for path in (planted, *planted.iterdir()):
        os.chown(path, NOBODY, NOBODY)

    assert last_checkpoint(out) == str(out / "checkpoint-4")
    resumed = run(forks, tmp_path, module_daemon.socket, steps=6, save_steps=2, resume=True)
    assert resumed["before"]["stock_last"] == str(planted)  # what the Trainer alone takes
    assert resumed["restored"]["path"] == str(out / "checkpoint-4")
    assert [e["step"] for e in resumed["losses"]] == list(range(1, 7))


def test_load_best_model_at_end_waits_for_the_best_checkpoint_and_loads_it(
    forks: Any, module_daemon: RunningDaemon, tmp_path: Path
) -> None:
    import torch
    from shmstage_client import load

    result = run(forks, tmp_path, module_daemon.socket, steps=8, save_steps=2, best=True)
    best = result["best"]
    assert best is not None and Path(best).parent == tmp_path / "out"
    saved = load(best, socket=module_daemon.socket)
    final = json.loads((tmp_path / "final-model.json").read_text())
    assert final.keys() == {key for key in saved if key != "hf_trainer"}
    for key, values in final.items():
        assert torch.equal(torch.tensor(values, dtype=saved[key].dtype), saved[key]), key
