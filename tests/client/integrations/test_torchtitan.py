"""torchtitan 0.3 checkpointing through shmstage, on CPU with gloo and a real daemon.

What runs: torchtitan's own config machinery (``ConfigManager`` parsing its command line,
``--override.imports`` with our override, ``apply_overrides``), its ``OptimizersContainer``,
``LRSchedulersContainer``, ``ParallelAwareDataloader``, ``ModelWrapper`` and the manager
built by ``config.checkpoint.build(...)`` with the trainer's arguments, called where
``Trainer.train`` calls it, at world size 2 with an FSDP2-sharded model, each rank a process
of its own (``titan_ranks.py``, which forks them after importing torchtitan once).
What does not: ``torchtitan.trainer.Trainer`` itself, which needs triton and a CUDA device
(its model registry imports triton kernels), so the loop is ``titan_ranks.Run``'s copy of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import skip_unless_installed, start_daemon

from shmstage import segment

pytestmark = skip_unless_installed("torchtitan")

RANKS = Path(__file__).with_name("titan_ranks.py")
RUN_TIMEOUT = 150.0
SCENARIOS = {"first": 2, "modes": 1, "resume": 2}
LEFTOVER = ".step-9.0123456789abcdef.shmstage-pending"  # planted by titan_ranks.main


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A run killed after step 8's training (checkpoints at 2, 4, 6; the override's default
    mode); beside it, one rank with the manager's Config set in a config function (mode
    "disabled"); then the killed run's command again, resumed to step 10 (mode "async")."""
    work = tmp_path_factory.mktemp("titan")
    daemon = start_daemon(work / "node")
    try:
        done = subprocess.run(
            [sys.executable, str(RANKS), "--work", str(work), "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
        exits = json.loads((work / "exits.json").read_text()) if done.returncode == 0 else {}
        expected = {f"{name}-{r}": 0 for name, size in SCENARIOS.items() for r in range(size)}
        expected |= {"first-0": -9, "first-1": -9}  # SIGKILLed, as planned
        why = f"exits {exits}, launcher exit {done.returncode}:\n{done.stderr[-6000:]}"
        assert exits == expected, why
        results: dict[str, Any] = {
            name: [json.loads((work / f"result-{name}-{r}.json").read_text()) for r in range(size)]
            for name, size in SCENARIOS.items()
        }
        results["folder"] = work / "dump" / "checkpoint"
        yield results
    finally:
        daemon.proc.kill()
        daemon.proc.wait(10)
        for name in segment.list_names(daemon.instance):
            segment.unlink(name)


def test_the_override_on_torchtitans_command_line_builds_the_shmstage_manager(runs) -> None:
    for result in runs["first"]:
        assert result["manager"] == "ShmStageCheckpointManager"
        assert result["async_mode"] == "async_with_pinned_mem"  # the override's default
        assert result["socket"].endswith("shmstaged.sock")  # from the override's JSON
    assert {r["async_mode"] for r in runs["resume"]} == {"async"}


def test_a_killed_run_resumes_from_the_daemons_memory_with_the_same_losses(runs) -> None:
    """The resumed ranks also checked, before training on, that everything loaded (model
    and optimizer shards, LR scheduler, dataloader, train state) is bit-exact with what
    the killed run held when it saved step 6."""
    for first, resumed in zip(runs["first"], runs["resume"], strict=True):
        assert resumed["loaded_step"] == 6
        assert resumed["sources"] == {"0": "memory", "1": "memory"}
        for step in ("7", "8"):
            assert resumed["losses"][step] == first["losses"][step], step


def test_the_default_mode_copies_the_optimizer_state_behind_the_next_step(runs) -> None:
    for result in runs["first"]:
        assert result["deferred_bytes"] > 0


def test_keep_latest_k_counts_published_checkpoints_only(runs) -> None:
    """keep_latest_k=2. When the resumed run saved step 8, steps 2, 4 and 6 were published,
    8 was being written and a killed save had left ``.step-9.*.shmstage-pending`` behind: 2
    went, 4 stayed. torchtitan's own count (``step-(\\d+)`` anywhere in a name) takes the
    leftover for the newest checkpoint and deletes 4 too, as it would an in-flight save's
    directory; the leftover itself is not ours to delete (its data may still be landing)."""
    folder: Path = runs["folder"]
    names = sorted(p.name for p in folder.iterdir())
    assert names == [LEFTOVER, "step-10", "step-4", "step-6", "step-8"]
    from shmstage_client.dcp import MARKER_NAME, verify

    for step in ("step-4", "step-6", "step-8"):
        assert (folder / step / MARKER_NAME).is_file()
        assert verify(folder / step) == []


def test_the_last_steps_model_only_export_is_torchtitans_own_format(runs) -> None:
    """The ``modes`` rank also loaded its export with stock DCP, bit-exact with the model."""
    export = runs["folder"] / "step-10"
    assert (export / ".metadata").is_file()
    assert not list(export.glob("*.safetensors"))
    for result in runs["resume"]:
        assert "tok.weight" in result["final_model_keys"]


def test_synchronous_saves_load_back_from_files_through_the_managers_own_config(runs) -> None:
    """async_mode=disabled (no gloo group made), restore_source=files; the rank checked
    the state loaded from step 2 bit-exactly."""
    (result,) = runs["modes"]
    assert result["pg"] is False
    assert result["sources"] == {"0": "files"}


def test_an_unreachable_daemon_is_refused_before_training_naming_the_setting(runs) -> None:
    (result,) = runs["modes"]
    assert "no-daemon.sock" in result["unreachable"]
    assert "--checkpoint.socket" in result["unreachable"]


def test_a_save_whose_daemon_is_gone_fails_at_the_wait_naming_it_and_publishes_nothing(
    runs,
) -> None:
    """The daemon was killed after the manager was built: save() returned (training goes
    on), the wait for that save raised SaveError naming the checkpoint."""
    (result,) = runs["modes"]
    assert "step-1 failed and was not published" in result["lost"]
    assert "DaemonUnavailable" in result["lost"]
    assert not [name for name in result["lost_folder"] if name.startswith("step-")]


def test_importing_the_module_needs_no_torchtitan_and_using_it_names_the_extra(
    fresh_imports: dict[str, Any],
) -> None:
    """torchtitan made unimportable in a fresh interpreter (sys.modules entry None, the
    interpreter's own way of saying a module is absent; see ``conftest.FRESH_IMPORTS``):
    the import works, the class raises ImportError naming the extra."""
    refused = fresh_imports["torchtitan"]
    assert refused.startswith("ImportError: ")
    assert "pip install 'shmstage-client[torchtitan]'" in refused


def test_the_override_keeps_the_runs_settings_and_refuses_another_manager() -> None:
    from dataclasses import dataclass

    from shmstage_client.integrations import torchtitan as integration
    from torchtitan.components.checkpointer import CheckpointManager

    manager = integration.ShmStageCheckpointManager
    stock = CheckpointManager.Config(enable=True, interval=7, keep_latest_k=3)
    ours = integration.shmstage_checkpoint(stock, socket="/run/x.sock", slots=2)
    assert type(ours) is manager.Config and ours._owner is manager
    assert (ours.enable, ours.interval, ours.keep_latest_k) == (True, 7, 3)
    assert (ours.socket, ours.slots, ours.async_mode) == ("/run/x.sock", 2, "async_with_pinned_mem")
    again = integration.shmstage_checkpoint(ours, async_mode="async")
    assert (again.socket, again.async_mode) == ("/run/x.sock", "async")

    class OtherManager(CheckpointManager):
        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            replicas: int = 2

    with pytest.raises(TypeError, match=r"OtherManager\.Config"):
        integration.shmstage_checkpoint(OtherManager.Config())


def test_only_complete_step_directories_count_as_checkpoints(tmp_path: Path) -> None:
    from shmstage_client.integrations.torchtitan import _published_steps

    for name, marker in [
        ("step-3", "shmstage-dcp.json"),
        ("step-5", ".metadata"),  # torchtitan's own DCP checkpoint
        (".step-9.0123abcd.shmstage-pending", "shmstage-dcp.json"),  # being published
        ("step-11", None),  # a save that never committed
        ("step-7-old", "shmstage-dcp.json"),
    ]:
        (tmp_path / name).mkdir()
        if marker:
            (tmp_path / name / marker).write_text("{}")
    expected = {3: str(tmp_path / "step-3"), 5: str(tmp_path / "step-5")}
    assert _published_steps(str(tmp_path)) == expected
    assert _published_steps(str(tmp_path / "absent")) == {}
