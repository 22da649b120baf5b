"""The journal's own rules, in-process: entries round-trip, paths are re-opened only if they
still lead to the very directory the client committed to, a journal nobody else may write,
and reapers that leave owed segments alone."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import harness
import msgpack
import pytest
from fault_helpers import NOBODY, require_root
from safetensors import safe_open
from shmstage_daemon import job, journal
from shmstage_daemon.admission import Peer
from shmstage_daemon.store import SlotWire

from shmstage import checkpoint, instance, names, segment
from shmstage.layout import TensorSpec
from shmstage.manifest import MANIFEST_NAME

ROOT = Peer(1, 0, 0, frozenset({0}))


def staged_job(
    directory: Path, instance_id: str, *, peer: Peer = ROOT, new: bool = False
) -> job.PersistJob:
    """A committed two-tensor job as the daemon holds it (``new``: to a new directory)."""
    return harness.staged_job(
        directory,
        instance_id,
        [
            (TensorSpec("a", "U8", (3,)), b"abc"),
            (TensorSpec("b", "I32", (2,)), b"\x01\x00\x00\x00\x02\x00\x00\x00"),
        ],
        peer=peer,
        new=new,
    )


def entry_of(persist: job.PersistJob, instance_id: str, peer: Peer = ROOT) -> journal.Entry:
    dir_fd = persist.destination.dir_fd
    path = journal.locate(dir_fd)
    assert path is not None
    st = os.fstat(dir_fd)
    wire = SlotWire.of(persist.layout, persist.segments)
    return journal.entry_for(persist, wire, instance_id, peer, path, (st.st_dev, st.st_ino))


def test_entries_round_trip_and_malformed_ones_are_refused(tmp_path: Path, instance_id) -> None:
    persist = staged_job(tmp_path / "c", instance_id)
    entry = entry_of(persist, instance_id)
    assert journal.Entry.from_bytes(entry.to_bytes()) == entry
    # What the daemon writes: the slot's parts encoded once and spliced in, same bytes.
    wire = SlotWire.of(persist.layout, persist.segments)
    assert entry.to_bytes(wire.packed) == entry.to_bytes()
    for bad in (b"", b"\xc1", b"\x80", entry.to_bytes()[:-3]):
        with pytest.raises(journal.JournalError):
            journal.Entry.from_bytes(bad)
    persist.destination.close()


def test_a_finished_job_is_recognised_and_needs_no_segments(tmp_path: Path, instance_id) -> None:
    """A daemon killed after the commit marker but before dropping the entry: finishing it
    again must succeed without the (already unlinked) segments and change nothing."""
    persist = staged_job(tmp_path / "c", instance_id)
    entry = entry_of(persist, instance_id)
    assert job.run(persist).ok
    manifest = (tmp_path / "c" / MANIFEST_NAME).read_bytes()
    for name in segment.list_names(instance_id):
        segment.unlink(name)
    result = journal.recover(entry)
    assert result.ok, result.message
    assert (tmp_path / "c" / MANIFEST_NAME).read_bytes() == manifest
    assert checkpoint.verify(tmp_path / "c") == []


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-per-tensor"])
def test_a_job_of_many_tensors_is_recovered_from_its_packed_or_unpacked_segments(
    tmp_path: Path, instance_id, packed: bool
) -> None:
    """A killed daemon's job of 300 small tensors is finished from its entry, whether its
    segments were packed or staged one per tensor (by a daemon from before packing)."""
    sizes = [i % 50 for i in range(300)]
    tensors = [(TensorSpec(f"t{i}", "U8", (n,)), bytes([i % 251]) * n) for i, n in enumerate(sizes)]
    persist = harness.staged_job(tmp_path / "c", instance_id, tensors, peer=ROOT, packed=packed)
    assert (len(persist.segments) < 300) == packed
    result = journal.recover(entry_of(persist, instance_id))
    assert result.ok, result.message
    assert checkpoint.verify(tmp_path / "c") == []
    with safe_open(str(tmp_path / "c" / "model.safetensors"), "numpy") as f:
        for spec, payload in tensors:
            assert f.get_tensor(spec.key).tobytes() == payload


def test_an_entry_whose_segments_match_no_packing_is_given_up(tmp_path: Path, instance_id) -> None:
    tensors = [(TensorSpec(f"t{i}", "U8", (4,)), b"abcd") for i in range(300)]
    persist = harness.staged_job(tmp_path / "c", instance_id, tensors, peer=ROOT)
    persist.segments = persist.segments[:2]
    result = journal.recover(entry_of(persist, instance_id))
    assert not result.ok and "do not match its layout" in result.message
    assert not (tmp_path / "c" / "model.safetensors").exists()


def test_a_job_whose_segments_are_gone_is_given_up_cleanly(tmp_path: Path, instance_id) -> None:
    persist = staged_job(tmp_path / "c", instance_id)
    entry = entry_of(persist, instance_id)
    persist.destination.close()
    for name in segment.list_names(instance_id):
        segment.unlink(name)
    result = journal.recover(entry)
    assert not result.ok and "staged data of the job is gone" in result.message
    assert os.listdir(tmp_path / "c") == []  # its temporary files were removed


def test_paths_are_reopened_only_to_the_same_directory(tmp_path: Path, instance_id) -> None:
    persist = staged_job(tmp_path / "c", instance_id)
    entry = entry_of(persist, instance_id)
    persist.destination.close()
    real = tmp_path / "c"
    real.rename(tmp_path / "moved")
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "moved", real)  # same path now leads there through a symlink
    result = journal.recover(entry)
    assert not result.ok and "without following a symlink" in result.message, result.message
    real.unlink()
    (tmp_path / "elsewhere").rename(real)  # same path, another directory
    result = journal.recover(entry)
    assert not result.ok and "no longer the directory" in result.message
    assert os.listdir(real) == []


def test_a_directory_its_user_can_no_longer_write_is_not_written(world: Path, instance_id) -> None:
    """Recovery acts with the user's own filesystem rights: a directory made read-only for
    it (here by its owner) gets nothing, even from a daemon running as root."""
    require_root("another uid")
    nobody = Peer(1, NOBODY, NOBODY, frozenset({NOBODY}))
    tmp_path = world
    persist = staged_job(tmp_path / "c", instance_id, peer=nobody)
    os.chown(tmp_path / "c", NOBODY, NOBODY)
    entry = entry_of(persist, instance_id, nobody)
    persist.destination.close()
    (tmp_path / "c").chmod(0o555)
    result = journal.recover(entry)
    assert not result.ok and "can no longer write" in result.message


def test_the_journal_directory_must_be_ours_alone(tmp_path: Path) -> None:
    require_root("chown")
    loose = tmp_path / "loose.journal"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    journal.Journal(loose).prepare()
    assert loose.stat().st_mode & 0o777 == 0o700
    foreign = tmp_path / "foreign.journal"
    foreign.mkdir()
    os.chown(foreign, NOBODY, NOBODY)
    with pytest.raises(journal.JournalError, match="not a directory owned by uid 0"):
        journal.Journal(foreign).prepare()
    os.symlink(loose, tmp_path / "link.journal")
    with pytest.raises(journal.JournalError):
        journal.Journal(tmp_path / "link.journal").prepare()


def test_unusable_entries_are_dropped_on_load(tmp_path: Path, instance_id) -> None:
    persist = staged_job(tmp_path / "c", instance_id)
    entry = entry_of(persist, instance_id)
    persist.destination.close()
    store = journal.Journal(tmp_path / "j")
    store.prepare()
    store.record(entry, fsync=True)
    (store.directory / "0123456789abcdef.9.job").write_bytes(b"garbage")
    (store.directory / f"{instance_id}.7.job").write_bytes(entry.to_bytes())  # wrong name
    (store.directory / f".{instance_id}.8.job.tmp").write_bytes(b"never acknowledged")
    assert store.load() == [entry]
    assert os.listdir(store.directory) == [entry.name]
    store.remove(entry.name, fsync=True)
    assert store.load() == []


def test_reapers_hold_back_what_a_journal_owes(tmp_path: Path) -> None:
    """A dead instance whose lock names a journal with its entries keeps every segment from
    other reapers; the journal's owner reaps all but the segments it is finishing."""
    dead = instance.InstanceLock.claim(journal_root=str(tmp_path), socket="/x.sock")
    owed = segment.create(dead.instance, 10)
    stray = segment.create(dead.instance, 10)
    os.close(dead.fd)  # the instance dies; its lock file stays
    journal_dir = Path(instance.journal_dir(str(tmp_path), dead.instance))
    journal_dir.mkdir()
    (journal_dir / f"{dead.instance}.1.job").touch()
    try:
        report = instance.reap(only_uid=os.geteuid())
        assert dead.instance in report.held
        assert sorted(segment.list_names(dead.instance)) == sorted([owed.name, stray.name])
        assert instance.predecessors("/x.sock", os.geteuid()) == [(dead.instance, str(journal_dir))]
        instance.reap(only_uid=os.geteuid(), keep={owed.name}, own_journals={str(journal_dir)})
        assert segment.list_names(dead.instance) == [owed.name]
        assert os.path.exists(instance.lock_path(dead.instance))  # still names the journal
        (journal_dir / f"{dead.instance}.1.job").unlink()
        instance.reap(only_uid=os.geteuid())
        assert segment.list_names(dead.instance) == []
        assert not os.path.exists(instance.lock_path(dead.instance))
        assert not journal_dir.exists()  # the emptied journal went with the lock
    finally:
        for name in segment.list_names(dead.instance):
            segment.unlink(name)
        if os.path.exists(instance.lock_path(dead.instance)):
            os.unlink(instance.lock_path(dead.instance))


def test_a_dead_instance_s_unacknowledged_entries_go_with_its_lock(tmp_path: Path) -> None:
    """A daemon killed while a commit waited for its copy leaves a pending entry, which it
    never owed. Whoever reaps its lock — its successor, or a daemon on another socket that
    starts first — removes the entry and the journal with it: nobody could find that
    journal afterwards."""
    dead = instance.InstanceLock.claim(journal_root=str(tmp_path), socket="/x.sock")
    os.close(dead.fd)
    journal_dir = Path(instance.journal_dir(str(tmp_path), dead.instance))
    journal_dir.mkdir()
    (journal_dir / f".{dead.instance}.2.job.tmp").write_bytes(b"never acknowledged")
    (journal_dir / "unrelated").touch()
    try:
        report = instance.reap(only_uid=os.geteuid())
        assert dead.instance not in report.held
        assert not os.path.exists(instance.lock_path(dead.instance))
        assert os.listdir(journal_dir) == ["unrelated"]  # only its own pending entries
        (journal_dir / "unrelated").unlink()
        # A lock naming a journal through a symlink leads nowhere.
        planted = instance.InstanceLock.claim(journal_root=str(tmp_path), socket="/y.sock")
        os.close(planted.fd)
        target = tmp_path / "elsewhere"
        target.mkdir()
        (target / f".{planted.instance}.1.job.tmp").touch()
        os.symlink(target, instance.journal_dir(str(tmp_path), planted.instance))
        instance.reap(only_uid=os.geteuid())
        assert os.listdir(target) == [f".{planted.instance}.1.job.tmp"]
    finally:
        if os.path.exists(instance.lock_path(dead.instance)):
            os.unlink(instance.lock_path(dead.instance))
        if journal_dir.exists():
            shutil.rmtree(journal_dir)


# -- a new directory: written pending, published by rename -----------------------------


def test_a_new_directory_s_entry_records_the_parent_and_both_names(
    tmp_path: Path, instance_id
) -> None:
    persist = staged_job(tmp_path / "c", instance_id, new=True)
    entry = entry_of(persist, instance_id)
    dest = persist.destination
    parent = os.stat(tmp_path)
    assert entry.directory == str(tmp_path) and entry.final_dir == "c"
    assert entry.directory_id == (parent.st_dev, parent.st_ino)
    assert entry.pending_dir == dest.pending_dir and names.is_pending_dir(entry.pending_dir)
    assert journal.Entry.from_bytes(entry.to_bytes()) == entry
    dest.close()


@pytest.mark.parametrize("killed", ["before writing", "after the manifest", "after the rename"])
def test_a_new_directory_is_finished_whatever_step_the_daemon_was_killed_at(
    tmp_path: Path, instance_id, killed: str
) -> None:
    persist = staged_job(tmp_path / "c", instance_id, new=True)
    entry = entry_of(persist, instance_id)
    dest = persist.destination
    if killed != "before writing":
        assert job.run(persist).ok  # the whole job ran: published as "c"...
        if killed == "after the manifest":  # ...put it back where a kill before the rename
            os.rename(tmp_path / "c", tmp_path / dest.pending_dir)  # would have left it
    else:
        dest.close()
    result = journal.recover(entry)
    assert result.ok, result.message
    assert os.listdir(tmp_path) == ["c"]
    assert checkpoint.verify(tmp_path / "c") == []


def test_a_new_directory_s_pending_directory_must_still_be_the_one(
    tmp_path: Path, instance_id
) -> None:
    persist = staged_job(tmp_path / "c", instance_id, new=True)
    entry = entry_of(persist, instance_id)
    pending = tmp_path / persist.destination.pending_dir
    persist.destination.close()
    pending.rename(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", pending)  # same name, now a symlink to it
    result = journal.recover(entry)
    assert not result.ok and "the checkpoint's directory is gone" in result.message
    assert not (tmp_path / "c").exists()


def test_a_final_name_taken_meanwhile_fails_the_job_and_is_left_alone(
    tmp_path: Path, instance_id
) -> None:
    persist = staged_job(tmp_path / "c", instance_id, new=True)
    entry = entry_of(persist, instance_id)
    persist.destination.close()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "theirs").write_text("kept")
    result = journal.recover(entry)
    assert not result.ok and result.code == "exists", result.message
    assert os.listdir(tmp_path) == ["c"]  # the pending directory went, theirs stayed
    assert os.listdir(tmp_path / "c") == ["theirs"]


def test_entries_written_before_new_directories_were_renamed_still_load(
    tmp_path: Path, instance_id
) -> None:
    persist = staged_job(tmp_path / "c", instance_id)
    entry = entry_of(persist, instance_id)
    persist.destination.close()
    older = msgpack.unpackb(entry.to_bytes(), raw=False, strict_map_key=False)
    for key in ("pending_dir", "pending_id", "final_dir"):
        del older[key]
    older["v"] = 1
    assert journal.Entry.from_bytes(msgpack.packb(older, use_bin_type=True)) == entry


def test_gc_finds_the_files_an_entry_names(tmp_path: Path, instance_id) -> None:
    """``shmstage gc`` reads entries without the daemon package (``orphans``): it must find
    the data file, the manifest and a new directory's pending directory of a real entry."""
    from shmstage import orphans

    persist = staged_job(tmp_path / "c", instance_id, new=True)
    entry = entry_of(persist, instance_id)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / entry.name).write_bytes(entry.to_bytes())
    dir_fd = os.open(tmp_path / "j", os.O_RDONLY | os.O_DIRECTORY)
    try:
        found = orphans._entry_files(dir_fd, entry.name)
    finally:
        os.close(dir_fd)
    assert found == {entry.data_id, entry.manifest_id, entry.pending_id}
    assert entry.pending_id != (0, 0)
    persist.destination.close()
