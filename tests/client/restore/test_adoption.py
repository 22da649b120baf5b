"""A prepared restart: ``prepare_restore`` adopts the caller's retained layout while the
model is built, ``latest()`` reads the checkpoint out of it, and the first Stager takes it
over (``restore.adoption``, ``handoff``).

Real daemons and real retained layouts (a Stager closed with ``retain=True`` leaves its
layout as a killed trainer does); on this CPU-only machine nothing is pinned, which is the
path a machine without CUDA takes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness import RawClient, RunningDaemon, assert_same, wait_for
from shmstage_client import Stager, handoff, latest, load, pinning, prepare_restore
from shmstage_client.restore import adoption

from shmstage.control import ControlClient


@pytest.fixture(autouse=True)
def nothing_left_prepared() -> Iterator[None]:
    """Each test's daemon is its own: what one left on offer is not the next one's."""
    yield
    prepared = adoption.take(None)  # any socket: dropped either way
    if prepared is not None:
        prepared.drop()
    handoff.withdraw()


def state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 7, generator=gen),
        "flags": torch.rand(13, generator=gen) > 0.5,
        "nested": [torch.arange(11, dtype=torch.int16) * seed, {"step": seed}],
    }


def status(daemon) -> dict:
    with ControlClient(daemon.socket) as client:
        return client.status()["memory"]


def metric(daemon, name: str) -> float:
    with ControlClient(daemon.socket) as client:
        series = client.metrics()[f"shmstage_{name}"]["series"]
    return sum(value for _, value in series)


def killed_trainer(daemon, ckpt: Path, *seeds: int) -> None:
    """A trainer saves each state in turn, then goes without releasing its layout."""
    stager = Stager(daemon.socket, slots=2)
    for seed in seeds:
        stager.save(state(seed), ckpt / f"c{seed}").wait(60)
    stager.close(retain=True)
    wait_for(lambda: status(daemon)["retained_layouts"] == 1, 10, "the layout retained")


def mapped_segments(daemon: RunningDaemon) -> list[str]:
    """This daemon's segments that this process maps now (not another test's daemon's,
    whose objects in this worker process may not be collected yet)."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return [line for line in maps if f"/dev/shm/shmstage.{daemon.instance}." in line]


def test_a_prepared_restart_restores_from_its_adopted_layout_and_its_first_save_creates_nothing(
    daemon, ckpt: Path
) -> None:
    killed_trainer(daemon, ckpt, 1, 2)
    segments = sorted(daemon.segments())
    created = metric(daemon, "segments_created_total")
    prepare_restore("cpu", socket=daemon.socket)  # the model would be built meanwhile
    restored = latest(socket=daemon.socket)
    assert (restored.source, restored.verified, restored.durable) == ("memory", True, True)
    assert restored.path == ckpt / "c2" and "adopt" in restored.phases
    assert_same(restored.state, state(2))
    assert daemon.log().count("segments adopted from a retained layout") == 1
    registered = daemon.log().count("registered layout")  # the trainer's and the prepare's
    with Stager(daemon.socket) as stager:
        stager.save(state(3), ckpt / "c3").wait(60)
        # The prepare's layout, not a new one: no registration, no segment created.
        assert daemon.log().count("registered layout") == registered == 2
        assert sorted(daemon.segments()) == segments
        assert metric(daemon, "segments_created_total") == created
        # The first save took the other slot: the restored checkpoint is still in memory.
        again = load(ckpt / "c2", with_info=True, socket=daemon.socket)
        assert again.source == "memory"
    assert_same(load(ckpt / "c3"), state(3))


def test_a_prepare_whose_restore_never_comes_gives_the_layout_back_after_keep(
    daemon, ckpt: Path
) -> None:
    killed_trainer(daemon, ckpt, 1)
    prepare_restore("cpu", keep=1.0, socket=daemon.socket)
    daemon.wait_log("segments adopted from a retained layout")
    assert status(daemon)["retained_layouts"] == 0  # this process owns it now
    wait_for(lambda: status(daemon)["retained_layouts"] == 1, 15, "the layout retained again")
    wait_for(lambda: not mapped_segments(daemon), 15, "the adopted slots unmapped")
    assert adoption.take(daemon.socket) is None  # nothing left for a restore to take
    restored = latest(socket=daemon.socket)  # as if nothing had been prepared
    assert restored.source == "memory" and "adopt" not in restored.phases
    assert_same(restored.state, state(1))


def test_a_layout_a_reader_leases_is_not_adopted_and_latest_leases_as_usual(
    daemon, ckpt: Path
) -> None:
    killed_trainer(daemon, ckpt, 1)
    segments = sorted(daemon.segments())
    reader = RawClient(daemon.socket)
    try:
        reader.request("latest", {"max_fds": 64})
        leased = reader.frame()
        assert leased.op == "leased"
        received = 0
        while received < leased.body["segments"]:  # the lease's descriptors, not kept
            frame = reader.frame()
            for fd in frame.fds:
                os.close(fd)
            received += len(frame.fds)
        prepare_restore("cpu", socket=daemon.socket)
        restored = latest(socket=daemon.socket)
        assert restored.source == "memory" and "adopt" not in restored.phases
        assert_same(restored.state, state(1))
        assert "segments adopted" not in daemon.log()
        assert status(daemon)["retained_layouts"] == 1  # still retained, nobody's
        assert sorted(daemon.segments()) == segments  # adopt_only: nothing made instead
    finally:
        reader.close()


def test_latest_of_another_structure_gives_the_prepared_layout_back(
    daemon, ckpt: Path
) -> None:
    killed_trainer(daemon, ckpt, 1)
    prepare_restore("cpu", socket=daemon.socket)
    daemon.wait_log("segments adopted from a retained layout")
    with pytest.raises(Exception, match="no checkpoint to restore"):
        latest(like={"other": torch.zeros(3)}, socket=daemon.socket)
    wait_for(lambda: status(daemon)["retained_layouts"] == 1, 10, "the layout retained again")
    restored = latest(socket=daemon.socket)
    assert restored.source == "memory"
    assert_same(restored.state, state(1))


def test_a_prepared_restore_by_path_reads_the_adopted_slot_only_for_that_checkpoint(
    daemon, ckpt: Path
) -> None:
    killed_trainer(daemon, ckpt, 1, 2)
    prepare_restore("cpu", socket=daemon.socket)
    older = load(ckpt / "c1", with_info=True, socket=daemon.socket)  # not the prepared one
    assert older.source == "memory" and "adopt" not in older.phases
    assert_same(older.state, state(1))
    wait_for(lambda: status(daemon)["retained_layouts"] == 1, 10, "the layout retained again")
    prepare_restore("cpu", socket=daemon.socket)
    time.sleep(0.2)
    newest = load(ckpt / "c2", with_info=True, socket=daemon.socket)
    assert newest.source == "memory" and "adopt" in newest.phases
    assert_same(newest.state, state(2))


def test_a_stager_made_before_the_restore_gives_the_adoption_back_and_adopts_as_usual(
    daemon, ckpt: Path
) -> None:
    killed_trainer(daemon, ckpt, 1, 2)
    segments = sorted(daemon.segments())
    prepare_restore("cpu", socket=daemon.socket)
    daemon.wait_log("segments adopted from a retained layout")
    with Stager(daemon.socket) as stager:  # before latest(): it cannot take the layout over
        wait_for(lambda: status(daemon)["retained_layouts"] == 1, 10, "the layout retained")
        restored = latest(socket=daemon.socket)
        assert restored.source == "memory" and "adopt" not in restored.phases
        stager.save(restored.state, ckpt / "c3").wait(60)
        assert sorted(daemon.segments()) == segments  # adopted again, nothing created
    assert_same(load(ckpt / "c3"), state(2))


def test_a_prepare_under_a_directory_adopts_only_a_checkpoint_saved_there(
    daemon, ckpt: Path
) -> None:
    killed_trainer(daemon, ckpt, 1)
    elsewhere = ckpt / "elsewhere"
    elsewhere.mkdir()
    prepare_restore("cpu", under=elsewhere, socket=daemon.socket)
    time.sleep(0.3)
    assert "segments adopted" not in daemon.log()
    assert adoption.take(daemon.socket) is None
    prepare_restore("cpu", under=ckpt, socket=daemon.socket)
    restored = latest(under=ckpt, socket=daemon.socket)
    assert restored.source == "memory" and "adopt" in restored.phases
    assert_same(restored.state, state(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_adopted_slot_is_pinned_ahead_and_the_first_save_registers_nothing(
    daemon, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prepare pins the checkpoint's slot and the one the first save fills; latest()
    copies straight out of the pinned slot to the device, and the Stager that takes the
    layout over calls cudaHostRegister no more."""
    torch.cuda.init()
    gpu = {key: value.cuda() for key, value in state(1).items() if key != "nested"}
    trainer = Stager(daemon.socket, slots=2)
    trainer.save(gpu, ckpt / "c1").wait(60)
    trainer.save(gpu, ckpt / "c2").wait(60)
    trainer.close(retain=True)
    wait_for(lambda: status(daemon)["retained_layouts"] == 1, 10, "the layout retained")
    prepare_restore("cuda", socket=daemon.socket)
    restored = latest(device="cuda", socket=daemon.socket)
    assert (restored.source, restored.verified) == ("memory", True)
    assert restored.phases["pin"] > 0 and {t.device.type for t in restored.state.values()} == {
        "cuda"
    }
    assert_same(restored.state, gpu)
    calls: list[int] = []
    real = pinning.register_range
    monkeypatch.setattr(
        pinning, "register_range", lambda *args: (calls.append(args[1]), real(*args))[1]
    )
    with Stager(daemon.socket) as stager:
        stager.save(restored.state, ckpt / "c3").wait(60)
        assert stager.pinned and calls == []
    assert_same({k: v.cuda() for k, v in load(ckpt / "c3").items()}, gpu)


def test_a_corrupted_byte_in_the_adopted_slot_is_caught_ahead_and_latest_reads_the_files(
    daemon, ckpt: Path
) -> None:
    killed_trainer(daemon, ckpt, 1)
    for name in daemon.segments():  # a flipped bit in every segment, as the daemon's uid
        with open(f"/dev/shm/{name.lstrip('/')}", "r+b") as segment:
            first = segment.read(1)
            segment.seek(0)
            segment.write(bytes([first[0] ^ 0x10]))
    prepare_restore("cpu", socket=daemon.socket)
    restored = latest(socket=daemon.socket)
    assert restored.source == "files" and "checksum mismatch" in restored.reason
    assert_same(restored.state, state(1))
