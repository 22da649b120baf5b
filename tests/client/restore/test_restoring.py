"""Restoring: from the daemon's memory when it holds exactly the checkpoint, else the files.

Real daemons, real checkpoints, real files changed under the daemon's feet; ``load``,
``restore``, ``latest`` and ``prepare_restore`` (``restore.restoring``), the lease on the
daemon's memory (``restore.lease``) and the DCP reader's fallback per rank.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import assert_same
from shmstage_client import (
    CheckpointError,
    ChecksumError,
    Stager,
    latest,
    load,
    prepare_restore,
    restore,
)
from shmstage_client.dcp import ShmStageReader, ShmStageWriter
from shmstage_client.restore import restoring

from shmstage.manifest import MANIFEST_NAME


def state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 7, generator=gen),
        "flags": torch.rand(13, generator=gen) > 0.5,  # 13 bytes: what follows is unaligned
        "h": torch.randn(5, generator=gen).to(torch.float64),
        "e": torch.zeros(0, 3),
        "nested": [torch.arange(11, dtype=torch.int16) * seed, {"step": seed, "x": None}],
    }


def restored(path: Path, daemon, **kwargs: object):
    return load(path, with_info=True, socket=daemon.socket, **kwargs)


# -- by path ----------------------------------------------------------------------------


def test_load_reads_memory_exactly_while_the_daemon_holds_that_checkpoint(
    module_daemon, ckpt: Path
) -> None:
    with Stager(module_daemon.socket, slots=2) as stager:
        for seed in (1, 2):
            stager.save(state(seed), ckpt / f"c{seed}").wait(60)
        first = restored(ckpt / "c1", module_daemon)
        assert (first.source, first.verified, first.durable) == ("memory", True, True)
        assert first.path == ckpt / "c1" and first.reason == "" and first.job is not None
        assert first.bytes == sum(t.nbytes for t in _tensors(state(1)))
        assert set(first.phases) == {"lease", "transfer"}
        assert 0 < sum(first.phases.values()) <= first.seconds
        assert_same(first.state, state(1))
        stager.save(state(3), ckpt / "c3").wait(60)  # refills c1's slot: the oldest
        gone = restored(ckpt / "c1", module_daemon)
        assert gone.source == "files" and "does not hold this checkpoint" in gone.reason
        assert_same(gone.state, state(1))
        assert restored(ckpt / "c2", module_daemon).source == "memory"
        assert restored(ckpt / "c2", module_daemon, source="files").source == "files"
        assert_same(load(ckpt / "c3", socket=module_daemon.socket), state(3))


def test_many_small_tensors_share_segments_and_come_back_exactly(daemon, ckpt: Path) -> None:
    """A layout of hundreds of tensors packs its small ones into shared segments (odd
    sizes, mixed dtypes, one empty, one large enough for a segment of its own): the daemon
    makes a few segments per slot, not one per tensor, and the file, ``load`` from memory
    and ``latest`` all give back every tensor bit for bit."""
    from safetensors.torch import load_file

    from shmstage import segment

    def many(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tensors = {
            f"p{i}": torch.randn(i % 97 + 1, generator=gen).to(
                (torch.bfloat16, torch.float32, torch.float64)[i % 3]
            )
            for i in range(600)
        }
        tensors["big"] = torch.randn(300_000, generator=gen)  # 1.2 MB: a segment of its own
        tensors["empty"] = torch.zeros(0, 4)
        return tensors

    with Stager(daemon.socket, slots=2) as stager:
        stager.save(many(1), ckpt / "a").wait(60)
        stager.save(many(2), ckpt / "b").wait(60)
        assert 2 * 2 <= len(segment.list_names(daemon.instance)) <= 2 * 4  # 602 tensors
        on_disk = load_file(str(ckpt / "a" / "model.safetensors"))
        assert on_disk.keys() == many(1).keys()
        for key, tensor in many(1).items():
            assert torch.equal(on_disk[key], tensor), key
        first = restored(ckpt / "a", daemon)
        assert first.source == "memory" and first.verified
        assert_same(first.state, many(1))
        newest = latest(socket=daemon.socket)
        assert newest.source == "memory" and newest.path == ckpt / "b"
        assert_same(newest.state, many(2))


def test_restores_hold_off_the_garbage_collector_and_leave_it_as_the_caller_set_it(
    daemon, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new process's first restore of 500 tensors spent 80 ms in one full collection
    (see ``collection``); load() and latest() now run with the collector held off."""
    import gc

    seen: list[bool] = []
    original = restoring.transfer

    def spying(*args: object, **kwargs: object) -> object:
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(restoring, "transfer", spying)
    with Stager(daemon.socket) as stager:
        stager.save(state(1), ckpt / "c").wait(60)
        assert restored(ckpt / "c", daemon).source == "memory"
        assert latest(socket=daemon.socket).source == "memory"
        assert gc.isenabled()
        gc.disable()
        try:
            restored(ckpt / "c", daemon)
            assert not gc.isenabled()
        finally:
            gc.enable()
    assert seen == [False, False, False]


def test_memory_is_read_through_kept_descriptors_or_mapped_when_too_few_are_free(
    module_daemon, ckpt: Path, monkeypatch: pytest.MonkeyPatch, read_passes: str
) -> None:
    """A restore keeps the leased segments' descriptors and reads through them when the
    process has room for them; with a low RLIMIT_NOFILE it maps them instead. Either way
    the bytes are exact and no descriptor is left open."""
    from shmstage_client.restore import lease as lease_module

    many = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(300)}
    kept: list[bool] = []
    take = lease_module.MemoryLease.take.__func__

    def spying(cls, *args, **kwargs):
        got = take(cls, *args, **kwargs)
        kept.append(got.fds is not None)
        return got

    monkeypatch.setattr(lease_module.MemoryLease, "take", classmethod(spying))
    with Stager(module_daemon.socket) as stager:
        stager.save(many, ckpt / "many").wait(60)
        assert stager._layouts.current is not None and stager._layouts.current.growth is not None
        stager._layouts.current.growth.result(60)  # its second slot's descriptors come and go first
        before = len(os.listdir("/proc/self/fd"))
        through_fds = restored(ckpt / "many", module_daemon)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (before + 200, hard))
        try:
            mapped = restored(ckpt / "many", module_daemon)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert len(os.listdir("/proc/self/fd")) <= before
    assert kept == [True, False]
    for got in (through_fds, mapped):
        assert got.source == "memory"
        assert_same(got.state, many)


def test_a_changed_manifest_or_data_file_is_not_the_checkpoint_in_memory(
    module_daemon, ckpt: Path
) -> None:
    with Stager(module_daemon.socket, slots=2) as stager:
        stager.save(state(1), ckpt / "m").wait(60)
        stager.save(state(2), ckpt / "d").wait(60)
        manifest = ckpt / "m" / MANIFEST_NAME
        manifest.write_bytes(manifest.read_bytes() + b"\n")  # same content, other bytes
        data = ckpt / "d" / "model.safetensors"
        shutil.copyfile(data, ckpt / "copy")
        os.replace(ckpt / "copy", data)  # same bytes, another file
        for name, seed in (("m", 1), ("d", 2)):
            result = restored(ckpt / name, module_daemon)
            assert result.source == "files", name
            assert_same(result.state, state(seed))


def test_without_a_daemon_load_reads_the_files_and_says_why(module_daemon, ckpt: Path) -> None:
    with Stager(module_daemon.socket) as stager:
        stager.save(state(4), ckpt / "c").wait(60)
    nowhere = ckpt.parent / "no-daemon.sock"
    result = load(ckpt / "c", with_info=True, socket=nowhere)
    assert result.source == "files" and "no-daemon.sock" in result.reason
    assert_same(result.state, state(4))
    with pytest.raises(CheckpointError, match="cannot restore from shmstaged's memory"):
        load(ckpt / "c", source="memory", socket=nowhere)
    with pytest.raises(ValueError, match="source='disk'"):
        load(ckpt / "c", source="disk")
    plain = restore(ckpt / "c", socket=nowhere, verify=False)
    assert plain.source == "files" and not plain.verified
    assert_same(plain.state, state(4))


def test_a_corrupt_file_still_raises_naming_key_and_file(module_daemon, ckpt: Path) -> None:
    with Stager(module_daemon.socket) as stager:
        stager.save(state(5), ckpt / "c").wait(60)
    data = ckpt / "c" / "model.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01  # inside the last tensor of the file
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=r"tensor 'nested\.0' in .*model\.safetensors"):
        load(ckpt / "c", socket=module_daemon.socket)


# -- latest -----------------------------------------------------------------------------


def test_latest_picks_by_structure_and_directory_among_a_users_checkpoints(
    daemon, ckpt: Path
) -> None:
    (ckpt / "a").mkdir()
    (ckpt / "b").mkdir()
    other = {"other": torch.ones(3)}
    with Stager(daemon.socket) as first, Stager(daemon.socket) as second:
        first.save(state(1), ckpt / "a" / "s1").wait(60)
        second.save(other, ckpt / "b" / "s1").wait(60)
        first.save(state(2), ckpt / "a" / "s2").wait(60)
        newest = latest(socket=daemon.socket)
        assert (newest.source, newest.path) == ("memory", ckpt / "a" / "s2")
        assert latest(socket=daemon.socket, like=other).path == ckpt / "b" / "s1"
        in_b = latest(socket=daemon.socket, under=ckpt / "b")
        assert in_b.path == ckpt / "b" / "s1"
        assert_same(in_b.state, other)
        assert latest(socket=daemon.socket, like=state(9)).path == ckpt / "a" / "s2"
        with pytest.raises(CheckpointError, match="cannot restore from shmstaged's memory"):
            latest(socket=daemon.socket, like={"unknown": torch.ones(1)}, source="memory")


def test_latest_without_a_daemon_takes_the_newest_complete_checkpoint_under(
    daemon, ckpt: Path
) -> None:
    with Stager(daemon.socket) as stager:
        for seed in (3, 1, 2):  # committed in this order: names do not decide
            stager.save(state(seed), ckpt / f"step-{seed}").wait(60)
            time.sleep(0.01)
    (ckpt / "step-9").mkdir()  # not a checkpoint: never picked
    nowhere = ckpt.parent / "no-daemon.sock"
    result = latest(socket=nowhere, under=ckpt)
    assert (result.source, result.path) == ("files", ckpt / "step-2")
    assert_same(result.state, state(2))
    with pytest.raises(CheckpointError, match="pass under="):
        latest(socket=nowhere)


def test_latest_restores_from_memory_whatever_became_of_the_directory_and_says_what(
    daemon, ckpt: Path
) -> None:
    """The daemon's own record (structure, checksums) serves: a changed manifest, a
    checkpoint archived elsewhere or deleted, a run directory renamed — still the bytes
    from memory, verified, with the reason saying what changed on disk."""
    run = ckpt / "run"
    run.mkdir()
    with Stager(daemon.socket, slots=2) as stager:
        stager.save(state(1), run / "s1").wait(60)
        stager.save(state(2), run / "s2").wait(60)
        plain = latest(socket=daemon.socket)
        assert (plain.source, plain.verified, plain.reason) == ("memory", True, "")
        manifest = run / "s2" / MANIFEST_NAME
        manifest.write_bytes(manifest.read_bytes() + b"\n")  # same content, other bytes
        changed = latest(socket=daemon.socket)
        assert (changed.source, changed.verified, changed.path) == ("memory", True, run / "s2")
        assert "manifest changed" in changed.reason
        assert_same(changed.state, state(2))
        (ckpt / "archive").mkdir()
        os.rename(run / "s2", ckpt / "archive" / "s2")  # a job script archives it
        for under in (None, run):
            moved = latest(socket=daemon.socket, under=under)
            assert (moved.source, moved.verified, moved.durable) == ("memory", True, True)
            assert f"{run / 's2'} no longer exists (moved or deleted)" in moved.reason
            assert_same(moved.state, state(2))
        shutil.rmtree(ckpt / "archive")
        assert latest(socket=daemon.socket).source == "memory"
        os.rename(run, ckpt / "run-done")  # the run directory itself, by path
        renamed = latest(socket=daemon.socket, under=run)
        assert renamed.source == "memory" and "moved, replaced or deleted" in renamed.reason
        assert_same(renamed.state, state(2))
        with pytest.raises(CheckpointError, match="no complete checkpoint"):
            latest(socket=daemon.socket, under=ckpt / "elsewhere")


def _truncate_largest_segment(daemon) -> None:
    """As the daemon's uid (root here): the largest segment of its slots loses its bytes,
    so a lease's segment no longer holds the checkpoint (a real, early memory failure)."""
    from shmstage import segment

    names = daemon.segments()
    largest = max(names, key=lambda name: os.stat(segment.SHM_DIR + name).st_size)
    os.truncate(segment.SHM_DIR + largest, 0)


def test_when_memory_fails_early_latest_reads_the_files_the_daemon_named_if_unchanged(
    daemon, ckpt: Path
) -> None:
    with Stager(daemon.socket, slots=1) as stager:
        stager.save(state(1), ckpt / "s1").wait(60)
        stager.save(state(2), ckpt / "s2").wait(60)  # refills the one slot
        _truncate_largest_segment(daemon)
        named = latest(socket=daemon.socket)
        assert (named.source, named.path, named.verified) == ("files", ckpt / "s2", True)
        assert "is 0 bytes" in named.reason  # the daemon refuses to pass a resized segment
        assert_same(named.state, state(2))
        manifest = ckpt / "s2" / MANIFEST_NAME
        manifest.write_bytes(manifest.read_bytes() + b"\n")  # no longer what the daemon wrote
        with pytest.raises(CheckpointError, match="not the one shmstaged wrote") as refused:
            latest(socket=daemon.socket)
        assert "no checkpoint to restore" in str(refused.value)
        shutil.rmtree(ckpt / "s2")  # archived: the older one under under= is next
        older = latest(socket=daemon.socket, under=ckpt)
        assert (older.source, older.path) == ("files", ckpt / "s1")
        assert_same(older.state, state(1))


def test_a_short_descriptor_table_restores_from_memory_batch_by_batch(
    daemon, ckpt: Path
) -> None:
    """At ``ulimit -n 40`` a lease of 200 segments comes a few per message, each mapped
    and closed before the next: from memory, not refused ("raise the limit")."""
    many = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(200)}
    with Stager(daemon.socket) as stager:
        stager.save(many, ckpt / "many").wait(60)
        script = (
            "import json, torch\n"
            "from shmstage_client import latest, load\n"
            f"newest = latest(socket={str(daemon.socket)!r})\n"
            f"by_path = load({str(ckpt / 'many')!r}, with_info=True, socket="
            f"{str(daemon.socket)!r})\n"
            "exact = all(torch.equal(r.state[f't{i}'], torch.full((i + 1,), float(i)))"
            " for r in (newest, by_path) for i in range(200))\n"
            "print(json.dumps([newest.source, by_path.source, exact, newest.reason,"
            " by_path.reason]))\n"
        )
        run = subprocess.run(
            ["bash", "-c", 'ulimit -n 40 && exec "$0" -c "$1"', sys.executable, script],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == ["memory", "memory", True, "", ""]


# -- DCP --------------------------------------------------------------------------------


def test_the_dcp_reader_serves_a_rank_file_from_memory_and_falls_back_per_rank(
    module_daemon, ckpt: Path
) -> None:
    saved = {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    writer = ShmStageWriter(ckpt / "c", socket=module_daemon.socket)
    try:
        dcp.save(saved, storage_writer=writer, no_dist=True)
        target = {k: torch.zeros_like(v) for k, v in saved.items()}
        reader = ShmStageReader(ckpt / "c", socket=module_daemon.socket)
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert reader.sources == {0: "memory"}
        assert_same(target, saved)
    finally:
        writer.close()  # released: nothing is kept
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    reader = ShmStageReader(ckpt / "c", socket=module_daemon.socket)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.sources == {0: "files"}
    assert_same(target, saved)



def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def test_prepare_restore_refuses_a_keep_that_is_not_seconds() -> None:
    for keep in (0, -1.0, float("inf"), float("nan"), "60"):
        with pytest.raises(ValueError, match=r"prepare_restore\(keep="):
            prepare_restore("cpu", keep=keep)  # type: ignore[arg-type]


def test_prepare_restore_grows_a_new_processs_descriptor_table_for_a_lease() -> None:
    """A new process's table holds 64 descriptors; a lease brings hundreds, and growing
    the table of a threaded process waits for an RCU grace period: done ahead, on a
    thread, so the restore finds the room made."""
    script = (
        "import time\n"
        "from shmstage import descriptors\n"
        "from shmstage_client import prepare_restore\n"
        "from shmstage_client.restore import restoring\n"
        "before, enough = descriptors.table_size(), restoring.LEASE_SEGMENTS\n"
        "prepare_restore('cpu')\n"
        "deadline = time.monotonic() + 10\n"
        "while descriptors.table_size() < enough and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(before, descriptors.table_size())\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    before, after = map(int, run.stdout.split())
    assert before < restoring.LEASE_SEGMENTS <= after
