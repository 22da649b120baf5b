"""PyTorch DCP through shmstage: ranks are real processes (gloo on CPU), nodes are real daemons.

Two daemons stand in for two nodes and write one shared directory: at world size 4, ranks 0-1
use the first and ranks 2-3 the second. What each rank does is in ``dcp_ranks.py``; here we
start them, fail a daemon when a scenario asks for it, and inspect what reached the disk.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from client_helpers import CopyGate
from harness import ForkedScript, RunningDaemon, start_daemon
from safetensors import safe_open
from shmstage_client.dcp import (
    MARKER_NAME,
    PROCESS_MODE_REFUSED,
    ShmStageReader,
    ShmStageWriter,
    verify,
)
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from shmstage import datafile, segment

pytestmark = pytest.mark.usefixtures("fork_server")  # the ranks are ForkedScripts

WORKER = Path(__file__).with_name("dcp_ranks.py")
RUN_TIMEOUT = 150.0


def run_ranks(
    scenario: str,
    world_size: int,
    work: Path,
    daemons: list[RunningDaemon],
    during: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    """Run one process per rank (forked from a server that imported torch once: see
    ``ForkedScript``); every rank must exit 0 within RUN_TIMEOUT."""
    for stale in work.glob("result-*.json"):
        stale.unlink()
    sockets = ",".join(str(d.socket) for d in daemons)
    common = ["--world-size", str(world_size), "--work", str(work), "--sockets", sockets]
    procs = [
        ForkedScript(
            WORKER, scenario, "--rank", str(rank), *common, workdir=work / f"output-{scenario}"
        )
        for rank in range(world_size)
    ]
    try:
        during()
        deadline = time.monotonic() + RUN_TIMEOUT
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [
        f"rank {rank} exited {p.returncode}:\n{err[-4000:]}"
        for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True))
        if p.returncode != 0
    ]
    assert not failed, "\n".join(failed)
    return [json.loads((work / f"result-{r}.json").read_text()) for r in range(world_size)]


def stop(daemons: list[RunningDaemon]) -> None:
    for running in daemons:
        if running.proc.poll() is None:
            running.proc.kill()
            running.proc.wait(10)
        for name in segment.list_names(running.instance):
            segment.unlink(name)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[RunningDaemon]]]:
    work = tmp_path_factory.mktemp("dcp")
    daemons = [start_daemon(work / "node-a"), start_daemon(work / "node-b")]
    yield work, daemons
    stop(daemons)


@pytest.fixture(scope="module")
def at_4(nodes: tuple[Path, list[RunningDaemon]]) -> list[dict[str, Any]]:
    """World size 4 saved (async twice, sync once) and loaded back bit-exactly."""
    work, daemons = nodes
    return run_ranks("world_size_4", 4, work, daemons)


@pytest.fixture(scope="module")
def at_2(nodes: tuple[Path, list[RunningDaemon]], at_4: list[dict[str, Any]]) -> list[dict]:
    """World size 2 resharded the size-4 checkpoint, saved its own, tried PROCESS mode."""
    work, daemons = nodes
    return run_ranks("world_size_2", 2, work, daemons)


def expected(work: Path, name: str) -> dict[str, Any]:
    return torch.load(work / f"expected-{name}.pt", weights_only=False)


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    """DCP's flattening of a nested state dict: dotted keys, list indices included."""
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for key, value in state.items():
            out |= flat(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: state}


def test_world_size_4_on_two_nodes_saves_and_loads_back_bit_exact(nodes, at_4) -> None:
    work, daemons = nodes
    assert [r["socket"] for r in at_4] == [str(daemons[0].socket)] * 2 + [
        str(daemons[1].socket)
    ] * 2
    assert all(r["saved"] for r in at_4)  # every rank compared all three loads bit for bit
    for step in (1, 2, 3):
        assert verify(work / "ckpt-4" / f"step-{step}") == []


def test_unchanged_structure_reuses_the_staging_layout(at_4, at_2) -> None:
    for result in at_4 + at_2:
        first, second = result["async_layouts"]
        assert first == second, f"rank {result['rank']} registered a new layout"


def test_each_rank_file_is_plain_safetensors_with_its_shard_offsets(nodes, at_4) -> None:
    work, _ = nodes
    step = work / "ckpt-4" / "step-2"
    names = sorted(os.listdir(step))
    data = [n for n in names if n.endswith(".safetensors")]
    assert data == [f"rank-{r:05d}-of-00004.safetensors" for r in range(4)]
    assert {n.replace(".safetensors", ".manifest.json") for n in data} <= set(names)
    assert MARKER_NAME in names
    assert set(names) - set(data) - {MARKER_NAME} == {
        n for n in names if n.endswith((".manifest.json", ".bytes"))
    }
    full = flat(expected(work, "ws4-step-2"))
    rows = 0
    for name in data:
        with safe_open(str(step / name), "pt") as f:
            sharding = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            assert set(sharding) == set(f.keys())
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shard = f.get_tensor(key)
                offsets = sharding[key]["saved_offsets"]
                region = full[key][
                    tuple(slice(o, o + n) for o, n in zip(offsets, shard.shape, strict=True))
                ]
                assert torch.equal(_bytes(shard), _bytes(region))
            rows += f.get_slice("model.a.weight").get_shape()[0]
    assert rows == 33  # the uneven shards (9, 8, 8, 8) add up to the whole tensor
    assert not [p for p in (work / "ckpt-4").iterdir() if p.name.startswith(".")]


def test_stock_hf_reader_and_shmstage_reader_load_world_size_4_in_one_process(nodes, at_4) -> None:
    work, _ = nodes
    step = work / "ckpt-4" / "step-2"
    full = expected(work, "ws4-step-2")
    tensors = {"model": full["model"], "optim": {"state": full["optim"]["state"]}}
    target = _zeros(tensors)
    dcp.load(target, storage_reader=HuggingFaceStorageReader(str(step)), no_dist=True)
    _assert_equal(flat(target), flat(tensors))
    target = _zeros(full)  # tensors, param groups and plain values alike
    target["extra"] = {"step": -1, "note": ""}
    target["optim"]["param_groups"][0]["lr"] = 0.0
    dcp.load(target, storage_reader=ShmStageReader(step), no_dist=True)
    _assert_equal(flat(target), flat(full))


def test_world_size_4_checkpoint_reshards_to_world_size_2(at_2) -> None:
    assert all(r["resharded"] for r in at_2)  # stock HF reader and ShmStageReader both


def test_world_size_2_on_two_nodes_saves_and_loads_back_bit_exact(nodes, at_2) -> None:
    work, _ = nodes
    assert all(r["saved"] for r in at_2)
    for step in (1, 2, 3):
        assert verify(work / "ckpt-2" / f"step-{step}") == []


def test_process_mode_is_refused_on_every_rank_saying_what_to_use(nodes, at_2) -> None:
    work, _ = nodes
    for result in at_2:
        assert PROCESS_MODE_REFUSED in result["process_mode"]
    assert not (work / "process-mode").exists()


def test_a_corrupt_rank_file_is_caught_naming_file_and_key(nodes, at_4, tmp_path) -> None:
    work, _ = nodes
    copy = tmp_path / "step-1"
    shutil.copytree(work / "ckpt-4" / "step-1", copy)
    victim = copy / "rank-00002-of-00004.safetensors"
    data = bytearray(victim.read_bytes())
    header = datafile.parse_header(bytes(data[: datafile.header_length(data[:8])]), len(data))
    data[header.tensors["model.a.weight"].begin] ^= 0xFF
    victim.write_bytes(bytes(data))
    problems = verify(copy)
    assert len(problems) == 1 and "'model.a.weight'" in problems[0]
    assert "rank-00002-of-00004.safetensors" in problems[0]
    full = expected(work, "ws4-step-1")
    corrupt = r"rank-00002-of-00004\.safetensors: checksum mismatch"
    with pytest.raises(dcp.CheckpointException, match=corrupt):
        dcp.load(_zeros(full), storage_reader=ShmStageReader(copy), no_dist=True)


def test_a_daemon_killed_mid_save_fails_every_rank_and_publishes_nothing(tmp_path) -> None:
    daemons = [start_daemon(tmp_path / "node-a"), start_daemon(tmp_path / "node-b")]

    def kill_node_b_once_all_ranks_staged() -> None:
        deadline = time.monotonic() + RUN_TIMEOUT
        while len(list(tmp_path.glob("staged-*"))) < 4:
            assert time.monotonic() < deadline, "the ranks never staged"
            time.sleep(0.02)
        daemons[1].stop(signal.SIGKILL)
        (tmp_path / "go").touch()  # only now may the coordinator plan and ranks commit

    try:
        results = run_ranks("daemon_dies", 4, tmp_path, daemons, kill_node_b_once_all_ranks_staged)
    finally:
        stop(daemons)
    for result in results:  # every rank, including those whose own daemon is fine
        assert result["killed-mid-save"].startswith("CheckpointException")
        assert result["daemon-gone"].startswith("CheckpointException")
        assert "shmstaged" in result["killed-mid-save"]  # the cause is named
        assert result["mid-save-seconds"] < 30 and result["after-seconds"] < 30  # no hang
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["good"]
    assert verify(ckpt / "good") == []  # the earlier checkpoint is untouched
    for pending in (p for p in ckpt.iterdir() if p.name.startswith(".")):
        assert pending.name.endswith(".shmstage-pending")
        assert not (pending / MARKER_NAME).exists()
        assert not list(pending.glob("*.safetensors"))  # nothing a stock reader would pick up
    full = expected(tmp_path, "good")
    target = _zeros(full)
    dcp.load(target, storage_reader=ShmStageReader(ckpt / "good"), no_dist=True)
    _assert_equal(flat(target)["model.a.weight"], full["model"]["a.weight"])


def test_async_save_with_a_guard_copies_fsdp2_shards_behind_the_next_step(nodes) -> None:
    """World size 2, FSDP2, a writer with ``guard=`` (dcp_ranks.scenario_guarded): every
    checkpoint equals the state at its call, and its shards — parameters and AdamW state,
    all but a buffer and the step counters — were copied after async_save returned."""
    work, daemons = nodes
    results = run_ranks("guarded", 2, work, daemons)
    for result in results:
        assert len(result["deferred"]) == 2, result
        assert all(share > 0.9 for share in result["deferred"]), result


def test_a_guarded_writer_returns_a_staging_future_done_when_the_copy_lands(
    module_daemon, ckpt
) -> None:
    """``ShmStageWriter(guard=optimizer)``: async_save returns DCP's AsyncSaveResponse while
    the copy is still held (see CopyGate); the optimizer step right after it waits for the
    copy; the checkpoint is the state at the call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(seed: int) -> None:
        torch.manual_seed(seed)
        model(torch.randn(8, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": {"step": 1}}
    want = _clone(state)
    writer = ShmStageWriter(socket=module_daemon.socket, guard=optimizer)
    try:
        gate = CopyGate(writer._get_stager())
        response = dcp.async_save(
            state, checkpoint_id=ckpt / "c", storage_writer=writer, no_dist=True
        )
        assert isinstance(response, AsyncSaveResponse)
        assert not response.staging_completion.done()  # the copy is held
        gate.open_in(0.05)
        step(1)
        assert gate.opened.is_set(), "the optimizer stepped before the copy landed"
        response.staging_completion.result(timeout=30)
        response.upload_completion.result(timeout=60)
        assert writer.last_stage is not None
        assert writer.last_stage.timings.deferred_copy_seconds > 0
    finally:
        writer.close()
    target = _zeros(state)
    dcp.load(target, storage_reader=ShmStageReader(ckpt / "c"), no_dist=True)
    _assert_equal(target, want)


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def test_single_process_dcp_save_into_an_existing_checkpoint_is_refused(
    module_daemon, ckpt
) -> None:
    state = {"w": torch.arange(6.0).view(2, 3), "meta": {"epoch": 3}}
    writer = ShmStageWriter(ckpt / "c", socket=module_daemon.socket)
    try:
        dcp.save(state, storage_writer=writer, no_dist=True)
        before = sorted(os.listdir(ckpt / "c"))
        with pytest.raises(dcp.CheckpointException, match="never overwrites"):
            dcp.save(state, storage_writer=writer, no_dist=True)
    finally:
        writer.close()
    assert sorted(os.listdir(ckpt / "c")) == before
    target = {"w": torch.zeros(2, 3), "meta": {"epoch": 0}}
    dcp.load(target, storage_reader=ShmStageReader(ckpt / "c"), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and target["meta"] == {"epoch": 3}


def test_a_save_started_before_the_previous_one_committed_fails_that_one_cleanly(
    module_daemon, ckpt
) -> None:
    held = threading.Event()

    class HeldPlanner(DefaultSavePlanner):
        def create_global_plan(self, all_plans: list[Any]) -> Any:
            assert held.wait(30)
            return super().create_global_plan(all_plans)

    writer = ShmStageWriter(socket=module_daemon.socket)
    first = dcp.async_save(
        {"w": torch.ones(4)},
        checkpoint_id=ckpt / "first",
        storage_writer=writer,
        planner=HeldPlanner(),
        no_dist=True,
    )
    second = dcp.async_save(
        {"w": torch.full((4,), 2.0)},
        checkpoint_id=ckpt / "second",
        storage_writer=writer,
        no_dist=True,
    )
    second.result(timeout=30)
    held.set()
    with pytest.raises(dcp.CheckpointException, match="newer async_save started"):
        first.result(timeout=30)
    writer.close()
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["second"]
    target = {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=ShmStageReader(ckpt / "second"), no_dist=True)
    assert torch.equal(target["w"], torch.full((4,), 2.0))


def test_an_unreachable_daemon_fails_the_save_not_the_training_step(tmp_path) -> None:
    writer = ShmStageWriter(tmp_path / "c", socket=tmp_path / "no-daemon-here.sock")
    future = dcp.async_save({"w": torch.ones(3)}, storage_writer=writer, no_dist=True)
    with pytest.raises(dcp.CheckpointException, match="cannot connect to shmstaged"):
        future.result(timeout=30)
    assert not (tmp_path / "c").exists()
    writer.close()


def test_writer_connects_lazily_and_refuses_to_cross_a_process_boundary(tmp_path) -> None:
    writer = ShmStageWriter(tmp_path / "c", socket=tmp_path / "no-daemon-here.sock")
    with pytest.raises(TypeError, match=r"AsyncCheckpointerType\.THREAD"):
        pickle.dumps(writer)
    writer.close()


def _zeros(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros(v) for v in state]
    return state


def _assert_equal(actual: Any, expected_: Any) -> None:
    if isinstance(expected_, dict):
        assert sorted(actual) == sorted(expected_)
        for key in expected_:
            _assert_equal(actual[key], expected_[key])
    elif isinstance(expected_, torch.Tensor):
        assert actual.dtype == expected_.dtype and actual.shape == expected_.shape
        assert torch.equal(_bytes(actual), _bytes(expected_))
    else:
        assert actual == expected_


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def test_the_gpu_bench_script_runs_at_tiny_size_on_cpu_with_gloo(tmp_path) -> None:
    script = Path(__file__).parents[2] / "scripts" / "dcp_gpu_bench.py"
    report = tmp_path / "report.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    tiny = ["--device", "cpu", "--dim", "64", "--layers", "2", "--repeat", "1", "--start-daemon"]
    run = subprocess.run(
        [
            *torchrun,
            "2",
            str(script),
            *tiny,
            "--dir",
            str(tmp_path / "ckpt"),
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(report.read_text())["rows"]
    assert sorted((r["method"], r["rank"]) for r in rows) == [
        ("dcp-filesystem", 0),
        ("dcp-filesystem", 1),
        ("shmstage", 0),
        ("shmstage", 1),
    ]
    for row in rows:
        assert row["error"] is None and len(row["stall_s"]) == len(row["durable_s"]) == 2
        assert 0 < row["stall_median_s"] <= row["durable_median_s"]
    assert "stall med" in run.stdout and "durable med" in run.stdout
    assert list((tmp_path / "ckpt").iterdir()) == []  # every checkpoint was removed
