"""Restarting from the daemon's memory: real trainers SIGKILLed, real leases, real faults.

A trainer that dies leaves its newest acknowledged checkpoint in a slot the daemon keeps
(retained); a restarted trainer restores it at memory speed and adopts the segments. Each
test causes the situation for real — a SIGKILLed trainer process, a reader holding a lease
over the socket, another uid (65534), a byte flipped in a segment as the daemon's uid, a
retention budget too small, a TTL running out, a write held mid-stream by the test-only
``SHMSTAGE_FAULT`` hook — and checks where ``load``/``latest`` got the state from and that
it is bit-exact.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import re
import threading
from pathlib import Path

import pytest
import torch
from fault_helpers import (
    NOBODY,
    admitting_nobody,
    assert_same_state,
    kill,
    make_state,
    read_marker,
    run_as,
    start_trainer,
)
from harness import RawClient, wait_for
from shmstage_client import (
    CheckpointError,
    Stager,
    latest,
    load,
)
from shmstage_client.errors import SaveError, SlotUnavailable

from shmstage import manifest, segment
from shmstage.cli import format_status
from shmstage.control import ControlClient
from shmstage.manifest import MANIFEST_NAME

PAUSE = "60"


def memory_of(daemon) -> dict:
    with ControlClient(daemon.socket) as client:
        return client.status()["memory"]


def metric(daemon, name: str, **labels: str) -> float:
    with ControlClient(daemon.socket) as client:
        series = client.metrics()[f"shmstage_{name}"]["series"]
    return sum(value for found, value in series if labels.items() <= found.items())


def retained(daemon, count: int = 1) -> None:
    wait_for(lambda: memory_of(daemon)["retained_layouts"] == count, 10, f"{count} retained")


def restored(path: Path, daemon, **kwargs: object):
    return load(path, with_info=True, socket=daemon.socket, **kwargs)


def lease_exact(client: RawClient, path: Path) -> dict:
    """Lease the checkpoint at ``path`` over a raw connection (as ``load`` does), mapping
    nothing: returns the daemon's answer (``leased``, or an error's body), the segment
    descriptors checked to be read-only and closed."""
    document = (path / MANIFEST_NAME).read_bytes()
    fd = os.open(path / "model.safetensors", os.O_RDONLY)
    try:
        client.request("lease", {"digest": manifest.digest(document)}, [fd])
    finally:
        os.close(fd)
    leased = client.frame()
    if leased.op != "leased":
        return leased.body
    received = 0
    while received < leased.body["segments"]:
        frame = client.frame()
        assert frame.op == "lease_fds"
        for fd in frame.fds:
            mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
            try:  # read-only, and no shared writable mapping can be made of it either
                with pytest.raises(PermissionError):
                    mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            assert mode == os.O_RDONLY  # the daemon opened it read-only
        received += len(frame.fds)
    return leased.body


def unlease(client: RawClient, lease: int) -> bool:
    client.request("unlease", {"lease": lease})
    return client.frame().body["held"]


# -- the trainer dies; the restart restores from memory ------------------------------------


def test_restore_from_memory_after_the_trainer_was_sigkilled_mid_training(
    daemons, tmp_path: Path
) -> None:
    """Killed in the middle of copying its next checkpoint: the one before it (``step-1``)
    is the newest acknowledged, and comes back from memory, by path and without one."""
    daemon = daemons()
    trainer = start_trainer(daemon.socket, tmp_path, "steps", 7)
    read_marker(trainer, "BASE")
    read_marker(trainer, "STEP-1")
    read_marker(trainer, "COPYING")
    kill(trainer)
    retained(daemon)
    with ControlClient(daemon.socket) as client:  # what `shmstage status` shows
        table = format_status(client.status())
    where = re.escape(str(tmp_path / "step-1"))
    assert re.search(r"^  0 .* retained\s+(29m|30m)\d\ds\s+0\s+" + where + "$", table, re.M)
    by_path = restored(tmp_path / "step-1", daemon)
    assert (by_path.source, by_path.verified, by_path.durable) == ("memory", True, True)
    assert_same_state(by_path.state, make_state(8))
    newest = latest(socket=daemon.socket)
    assert (newest.source, newest.path) == ("memory", tmp_path / "step-1")
    assert_same_state(newest.state, make_state(8))
    # Each restore reported itself (one way, as it closed its connection).
    wait_for(lambda: metric(daemon, "restores_total", source="memory") == 2, 10, "2 reports")
    assert not (tmp_path / "victim").exists()  # the copy it died in was never committed
    # base, of another structure, was released when the trainer changed structure
    assert restored(tmp_path / "base", daemon).source == "files"


def test_latest_restores_a_checkpoint_still_being_written(daemons, tmp_path: Path) -> None:
    """Acknowledged, its writer held mid-stream, the trainer SIGKILLed: ``latest`` brings
    back the staged bytes (not the -1s the trainer wrote after save() returned), without
    checksums to check (none exist yet), and the checkpoint still completes on disk."""
    # Held long enough for the kill and the restore from memory below (about 0.05 s);
    # the rest of the pause is only waited out before the checkpoint completes.
    daemon = daemons(env={"SHMSTAGE_FAULT": "pause-mid-stream:2"})
    trainer = start_trainer(daemon.socket, tmp_path, "commit", 3)
    read_marker(trainer, "BASE")
    read_marker(trainer, "COMMITTED")
    daemon.wait_log("fault: pausing at mid-stream")
    kill(trainer)
    newest = latest(socket=daemon.socket)
    assert (newest.source, newest.durable, newest.verified) == ("memory", False, False)
    assert newest.path == tmp_path / "victim"
    assert_same_state(newest.state, make_state(3))
    assert not (tmp_path / "victim" / MANIFEST_NAME).exists()
    wait_for(lambda: (tmp_path / "victim" / MANIFEST_NAME).exists(), 30, "the checkpoint")
    again = latest(socket=daemon.socket)
    assert (again.source, again.durable, again.verified) == ("memory", True, True)
    assert_same_state(again.state, make_state(3))


def test_the_restarted_trainers_first_save_adopts_the_retained_segments(
    daemons, tmp_path: Path
) -> None:
    daemon = daemons()
    trainer = start_trainer(daemon.socket, tmp_path, "commit-grown", 4)
    read_marker(trainer, "BASE")
    read_marker(trainer, "COMMITTED")
    kill(trainer)
    retained(daemon)
    wait_for(lambda: memory_of(daemon)["checkpoints"][0]["durable"], 30, "victim durable")
    before = sorted(daemon.segments())
    assert len(before) == 2 * 4  # 4 tensors (3 layers and the bias) x both slots, retained
    created = metric(daemon, "segments_created_total")
    state = latest(socket=daemon.socket).state  # restore, then train on and save
    with Stager(daemon.socket) as stager:
        stager.save(state, tmp_path / "after-restart").wait(60)
        assert sorted(daemon.segments()) == before  # not one segment created
        assert metric(daemon, "segments_created_total") == created
        assert metric(daemon, "segments_adopted_total") == len(before)
        # The first save took the other slot: the restored checkpoint is still in memory.
        assert restored(tmp_path / "victim", daemon).source == "memory"
    assert_same_state(load(tmp_path / "after-restart"), make_state(4))


# -- leases --------------------------------------------------------------------------------


def test_a_lease_blocks_the_refill_of_its_slot_and_the_next_save_takes_another(
    daemon, raw_client, ckpt: Path
) -> None:
    states = [make_state(seed) for seed in (1, 2, 3)]
    with Stager(daemon.socket, slots=2) as stager:
        stager.save(states[0], ckpt / "c1").wait(60)  # slot 0
        stager.save(states[1], ckpt / "c2").wait(60)  # slot 1
        reader = raw_client()
        lease = lease_exact(reader, ckpt / "c1")  # the older one: what a fill takes first
        stager.save(states[2], ckpt / "c3").wait(60)  # so this one must take slot 1
        assert restored(ckpt / "c1", daemon).source == "memory"  # untouched under its lease
        assert restored(ckpt / "c2", daemon).source == "files"  # refilled by c3
        assert restored(ckpt / "c3", daemon).source == "memory"
        assert unlease(reader, lease["lease"]) is True
    for path, state in zip(("c1", "c2", "c3"), states, strict=True):
        assert_same_state(load(ckpt / path), state)


def test_a_save_waits_for_a_lease_on_its_only_slot_and_says_so(
    daemon, raw_client, ckpt: Path
) -> None:
    with Stager(daemon.socket, slots=1, wait_for_slot=False) as stager:
        stager.save(make_state(1), ckpt / "c1").wait(60)
        reader = raw_client()
        lease = lease_exact(reader, ckpt / "c1")
        with pytest.raises(SlotUnavailable, match="leased by readers restoring"):
            stager.save(make_state(2), ckpt / "c2")
        stager.wait_for_slot = True
        done = threading.Event()
        saver = threading.Thread(
            target=lambda: (stager.save(make_state(2), ckpt / "c2").wait(60), done.set())
        )
        saver.start()
        daemon.wait_log("waits for slot(s) [0] of layout")
        assert not done.wait(0.5)  # the lease holds the slot
        assert unlease(reader, lease["lease"]) is True
        saver.join(60)
        assert done.is_set()
    assert_same_state(load(ckpt / "c2"), make_state(2))


def test_a_lease_is_bounded_in_time_and_dies_with_its_connection(
    daemons, tmp_path: Path, ckpt: Path
) -> None:
    config = tmp_path / "lease.toml"
    config.write_text("[retention]\nlease_seconds = 1\nmax_lease_seconds = 2\nmax_leases = 1\n")
    daemon = daemons("--config", str(config))
    with Stager(daemon.socket) as stager:
        stager.save(make_state(1), ckpt / "c1").wait(60)
        first = RawClient(daemon.socket)
        body = lease_exact(first, ckpt / "c1")
        assert body["seconds"] == 1 and body["durable"]
        first.request("renew", {"lease": body["lease"], "seconds": 3600})
        assert first.frame().body["seconds"] <= 2  # never past max_lease_seconds
        second = RawClient(daemon.socket)
        refused = lease_exact(second, ckpt / "c1")  # max_leases: one per uid
        assert refused["code"] == "limit_exceeded" and "max_leases" in refused["message"]
        daemon.wait_log(f"lease {body['lease']} of uid 0")
        assert unlease(first, body["lease"]) is False  # it had expired
        lease = lease_exact(second, ckpt / "c1")["lease"]
        second.close()  # a reader that vanishes takes its lease with it
        wait_for(lambda: memory_of(daemon)["leases"] == 0, 10, "the lease to end")
        first.close()
        assert lease > body["lease"]


def test_a_foreign_uid_is_refused_unless_a_restore_group_admits_it(
    daemons, world: Path
) -> None:
    ckpt = world / "ckpt"
    ckpt.mkdir()
    states = [make_state(1), make_state(2)]
    reader = """
from pathlib import Path
import fcntl, os, json
ckpt = Path({ckpt!r})
out = {{}}
r = load(ckpt / "c2", with_info=True, socket={sock!r})
out["source"], out["reason"] = r.source, r.reason
try:
    load(ckpt / "c2", source="memory", socket={sock!r})
except CheckpointError as exc:
    out["memory"] = str(exc)
for name in ("c2", "c1"):  # the second would be the last slot of root's layout
    s = socket.socket(socket.AF_UNIX); s.connect({sock!r})
    c = protocol.Connection(protocol.Role.CLIENT)
    s.sendall(c.send("hello", 1, {{"version": 2, "client": "x", "pid": 1}}))
    fd = os.open(ckpt / name / "model.safetensors", os.O_RDONLY)
    digest = __import__("shmstage.manifest").manifest.digest(
        (ckpt / name / "shmstage-manifest.json").read_bytes())
    socket.send_fds(s, [c.send("lease", 2, {{"digest": digest}}, 1)], [fd])
    frames = []
    while len(frames) < 2 or (frames[1].op == "leased" and len(frames) < 3):
        data, fds, _, _ = socket.recv_fds(s, 1 << 16, 8)
        c.receive_data(data, fds)
        while (f := c.next_frame()) is not None:
            frames.append(f)
            for got in f.fds:
                out.setdefault("modes", []).append(fcntl.fcntl(got, fcntl.F_GETFL) & os.O_ACCMODE)
                os.close(got)
    out[name] = [frames[1].op, frames[1].body.get("code") or frames[1].body.get("segments")]
    globals()["keep_" + name] = s
print(json.dumps(out))
"""
    for server, allowed in (("", False), ("restore_groups = [65534]", True)):
        daemon = admitting_nobody(daemons, world, server=server)
        with Stager(daemon.socket, slots=2) as stager:
            stager.save(states[0], ckpt / "c1").wait(60)
            stager.save(states[1], ckpt / "c2").wait(60)
            stager.close(retain=True)  # another uid reads memory only once the trainer left
            out = json.loads(run_as(reader.format(ckpt=str(ckpt), sock=str(daemon.socket))))
            if allowed:  # a group member: from memory, descriptors read-only, one slot
                assert out["source"] == "memory" and "memory" not in out
                assert out["c2"] == ["leased", 4] and set(out["modes"]) == {os.O_RDONLY}
                assert out["c1"] == ["error", "limit_exceeded"]
            else:
                assert out["source"] == "files" and "restore_groups" in out["reason"]
                # refused as a checkpoint not in memory: nothing says it is, nor whose
                assert "uid 0" not in out["memory"] and "for you" in out["memory"]
                assert out["c2"] == ["error", "not_retained"]
        daemon.stop()
        for path in ("c1", "c2"):
            for child in sorted((ckpt / path).iterdir()):
                child.unlink()
            (ckpt / path).rmdir()
    assert NOBODY == 65534


# -- what memory no longer holds comes from the files ---------------------------------------


def test_a_corrupted_segment_byte_is_caught_and_load_reads_the_files(
    daemon, ckpt: Path, read_passes: str
) -> None:
    state = make_state(5)
    with Stager(daemon.socket, slots=1) as stager:
        stager.save(state, ckpt / "c").wait(60)
        layers = [n for n in daemon.segments() if os.stat(segment.SHM_DIR + n).st_size > 1000]
        assert len(layers) == 3
        for name in layers:  # one byte in each layer's segment, as the daemon's uid: real
            with open(segment.SHM_DIR + name, "r+b") as shm:
                first = shm.read(1)
                shm.seek(0)
                shm.write(bytes([first[0] ^ 0x40]))
        result = restored(ckpt / "c", daemon)
        assert result.source == "files" and "checksum mismatch" in result.reason
        assert_same_state(result.state, state)
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            restored(ckpt / "c", daemon, source="memory")
        trusting = restored(ckpt / "c", daemon, verify=False)  # verify=False trusts memory
        assert trusting.source == "memory" and not trusting.verified
        assert not any(
            torch.equal(got, want)
            for got, want in zip(trusting.state["layers"], state["layers"], strict=True)
        )


def test_retained_memory_is_given_back_over_budget_spare_slots_first_oldest_first(
    daemons, ckpt: Path
) -> None:
    one_slot = 3 * 4 * (1 << 16) + 4096  # make_state: three 64 Ki-float layers, a bias (a page)
    daemon = daemons("--retain-budget", str(one_slot * 3 // 2))
    for name in ("old", "new"):
        stager = Stager(daemon.socket, slots=2)
        stager.save({name: make_state(1)}, ckpt / name).wait(60)  # another structure each
        stager.close(retain=True)
    wait_for(lambda: "retained layout 1 of uid 0 given back (budget)" in daemon.log(), 10, "")
    assert daemon.log().count("slot 1 given back (budget)") == 2  # spares went first
    memory = memory_of(daemon)
    assert memory["retained_bytes"] == one_slot <= memory["budget_bytes"]
    old, new = restored(ckpt / "old", daemon), restored(ckpt / "new", daemon)
    assert (old.source, new.source) == ("files", "memory")
    assert "does not hold this checkpoint" in old.reason
    assert_same_state(old.state, {"old": make_state(1)})
    assert metric(daemon, "retained_evicted_total", reason="budget") == 3


def test_a_registration_that_needs_the_room_takes_it_from_retained_memory(
    daemons, ckpt: Path
) -> None:
    layout = 2 * (1 << 20)  # two slots of 1 MiB
    budget = str(layout * 3 // 2)  # room for three slots, and all of it may be retained
    daemon = daemons("--shm-budget", budget, "--retain-budget", budget)
    stager = Stager(daemon.socket, slots=2)
    stager.save({"a": torch.ones(1 << 18)}, ckpt / "a").wait(60)
    stager.close(retain=True)
    retained(daemon)
    with Stager(daemon.socket, slots=2) as other:  # needs one slot's worth: the spare goes
        other.save({"b": torch.ones(1 << 18)}, ckpt / "b").wait(60)
        assert restored(ckpt / "a", daemon).source == "memory"
        with Stager(daemon.socket, slots=1) as third:  # needs more: the whole layout goes
            third.save({"c": torch.ones(1 << 18)}, ckpt / "c").wait(60)
    result = restored(ckpt / "a", daemon)
    assert result.source == "files"
    assert_same_state(result.state, {"a": torch.ones(1 << 18)})
    assert metric(daemon, "retained_evicted_total", reason="registration") == 2


def test_a_retained_checkpoint_expires_after_its_ttl(daemons, ckpt: Path) -> None:
    daemon = daemons("--retain-ttl", "1")
    trainer_state = make_state(6)
    stager = Stager(daemon.socket)
    stager.save(trainer_state, ckpt / "c").wait(60)
    stager.close(retain=True)
    wait_for(lambda: "given back (ttl)" in daemon.log(), 15, "the TTL to run out")
    wait_for(lambda: daemon.segments() == [], 10, "its segments to go")
    result = restored(ckpt / "c", daemon)
    assert result.source == "files"
    assert_same_state(result.state, trainer_state)
    with pytest.raises(CheckpointError, match="no checkpoint to restore"):
        latest(socket=daemon.socket)
    assert latest(socket=daemon.socket, under=ckpt).path == ckpt / "c"  # from the files


@pytest.mark.parametrize("ending", ["SIGKILL", "SIGTERM", "expiry"])
def test_a_lease_that_ends_mid_restore_falls_back_to_the_files(
    daemons, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """The daemon killed or stopped, or the lease run out, while ``load`` holds it: the
    bytes it copied may be torn, so the files are read instead — never the internal
    NotInMemory. The kill, the stop and the expiry are real; only their moment is chosen,
    by a hook at the start of the copy out of memory."""
    from shmstage_client.restore import restoring

    config = tmp_path / "lease.toml"
    config.write_text("[retention]\nlease_seconds = 1\nmax_lease_seconds = 1\n")
    daemon = daemons("--config", str(config))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    expected = make_state(9)
    real_transfer = restoring.transfer

    def lease_ends_then_copy(*args: object, **kwargs: object):
        if ending == "SIGKILL":
            daemon.kill()
        elif ending == "SIGTERM":
            daemon.proc.terminate()
            daemon.proc.wait(30)
        else:
            daemon.wait_log("expired after")
        return real_transfer(*args, **kwargs)

    stager = Stager(daemon.socket)
    try:
        stager.save(expected, ckpt / "c").wait(60)
        monkeypatch.setattr(restoring, "transfer", lease_ends_then_copy)
        got = restored(ckpt / "c", daemon)
    finally:
        with contextlib.suppress(SaveError):  # the daemon may be gone
            stager.close(timeout=10)
    assert got.source == "files" and got.verified, got.reason
    assert "expired" in got.reason or "lease" in got.reason, got.reason
    assert_same_state(got.state, expected)
