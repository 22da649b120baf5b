"""Storage faults on real filesystems: a full disk, a failing device, a directory removed or
made read-only mid-stream, /dev/shm exhausted at registration, an unwritable journal.

What is real and what is not: a disk that stops answering is a real ext4 frozen with
``fsfreeze``; ENOSPC comes from a 2 MiB tmpfs; the device write error
from ext4 on a loop device whose backing store runs out (the kernel fails the writes in
the block layer and the direct write reports it — as ENOSPC, which is how the loop driver
passes the backing file's error up); EIO itself only through the daemon's test-only
``eio-write`` shim, since this kernel has no device-mapper to fail a device with EIO; the
read-only directory through chattr +i on a real ext4, and through chmod for a client that
is not root;
/dev/shm exhaustion through a private mount namespace whose /dev/shm is a small tmpfs.

Each case: the client gets an error naming the cause, no partial file is left under a final
name (nor, where the directory allows removal, any temporary file), earlier checkpoints
verify, and the daemon goes on serving.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from fault_helpers import (
    NOBODY,
    admitting_nobody,
    assert_checkpoint_equals,
    frozen,
    journal_entries,
    loop_ext4,
    make_state,
    nobody_dir,
    published_files,
    ramfs,
    require_root,
    run_as,
    single_tensor_state,
    small_tmpfs,
    writing_dir,
)
from harness import wait_for
from shmstage_client import PersistError, SaveError, Stager, StagingLimitExceeded

from shmstage import checkpoint, segment
from shmstage.datafile import build_header
from shmstage.layout import Layout, TensorSpec


def assert_clean_failure(path: Path, *, existing: bool = False) -> None:
    """Nothing at all left by a failed save: no final names, no temporaries, and no
    directory unless it was there before (``existing``)."""
    if existing:
        assert os.listdir(path) == [], os.listdir(path)
    else:
        assert not path.exists(), os.listdir(path)


def fill(path: Path) -> None:
    """Fill the filesystem holding ``path`` to the last byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)


def serves_on(daemon, where: Path) -> None:  # type: ignore[no-untyped-def]
    with Stager(daemon.socket) as stager:
        stager.save(make_state(99), where).wait(60)
    assert_checkpoint_equals(where, make_state(99))


def test_destination_full_enospc(daemons, tmp_path: Path) -> None:
    daemon = daemons()
    with small_tmpfs(tmp_path / "small", "2m") as small, Stager(daemon.socket) as stager:
        stager.save(single_tensor_state(1), small / "earlier").wait(60)
        with pytest.raises(PersistError, match=r"No space left on device \(ENOSPC\)") as info:
            stager.save({"w": torch.ones(1 << 20)}, small / "big").wait(60)  # 4 MiB
        assert info.value.code == "storage"
        assert "model.safetensors" in str(info.value) and "filesystem is full" in str(info.value)
        assert_clean_failure(small / "big")
        assert_checkpoint_equals(small / "earlier", single_tensor_state(1))
    serves_on(daemon, tmp_path / "after")


def test_a_filesystem_refusing_direct_io_is_written_through_the_page_cache(
    daemons, tmp_path: Path
) -> None:
    """ramfs refuses O_DIRECT for real: the checkpoints land there all the same, through the
    page cache, and the log says so once for the filesystem, not once per checkpoint."""
    daemon = daemons()
    with ramfs(tmp_path / "ram") as ram, Stager(daemon.socket) as stager:
        for seed in (1, 2, 3):
            stager.save(make_state(seed), ram / f"c{seed}").wait(60)
            assert_checkpoint_equals(ram / f"c{seed}", make_state(seed))
    said = [line for line in daemon.log().splitlines() if "refuses direct I/O" in line]
    assert len(said) == 1, said
    assert f"the filesystem of {ram}/" in said[0] and "EINVAL when asked for it" in said[0]
    serves_on(daemon, tmp_path / "after")  # and the disk beside it is written directly


def test_no_room_for_the_commit_marker(daemons, tmp_path: Path) -> None:
    """The data file fits to the last page and is published; the manifest does not fit:
    the published data file must be taken back, leaving nothing under a final name."""
    daemon = daemons()
    with small_tmpfs(tmp_path / "small", "1m") as small, Stager(daemon.socket) as stager:
        (small / "victim").mkdir()
        free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
        numel = free
        while True:  # one U8 tensor whose data file is exactly the free space
            spec = TensorSpec("w", "U8", (numel,))
            size = len(build_header(Layout.of([spec]), {"format": "pt"})) + numel
            if size == free:
                break
            numel -= size - free
        with pytest.raises(PersistError, match="ENOSPC") as info:
            stager.save({"w": torch.ones(numel, dtype=torch.uint8)}, small / "victim").wait(60)
        assert "shmstage-manifest.json" in str(info.value)
        assert_clean_failure(small / "victim", existing=True)
    serves_on(daemon, tmp_path / "after")


def test_device_write_error_is_reported_by_the_direct_write_itself(daemons, tmp_path: Path) -> None:
    """Real block-device write failures: ext4 on a loop device backed by a file on a 6 MiB
    tmpfs. Data is written with O_DIRECT, so the device's failure comes back from the write
    itself (through the page cache it would only surface at fsync)."""
    daemon = daemons()
    with (
        small_tmpfs(tmp_path / "backing", "6m") as backing,
        loop_ext4(tmp_path / "disk", backing / "disk.img", size_mib=64) as disk,
        Stager(daemon.socket) as stager,
    ):
        stager.save(single_tensor_state(2), disk / "earlier").wait(60)
        with pytest.raises(PersistError) as info:
            stager.save({"w": torch.randn(4 << 20)}, disk / "big").wait(60)  # 16 MiB
        message = str(info.value)
        assert "writing model.safetensors" in message and "ENOSPC" in message, message
        assert_clean_failure(disk / "big")
        assert_checkpoint_equals(disk / "earlier", single_tensor_state(2))
    serves_on(daemon, tmp_path / "after")


def test_io_error_eio_via_the_test_only_shim(daemons, tmp_path: Path) -> None:
    """EIO cannot be caused for real here (no device-mapper): the daemon's test-only
    ``eio-write:2`` hook fails its second data write with EIO, as a dying disk would."""
    daemon = daemons(env={"SHMSTAGE_FAULT": "eio-write:2"})
    with Stager(daemon.socket) as stager:
        stager.save(single_tensor_state(3), tmp_path / "earlier").wait(60)
        with pytest.raises(PersistError, match=r"Input/output error \(EIO\)") as info:
            stager.save(make_state(3), tmp_path / "victim").wait(60)
        assert "check the device" in str(info.value)
        assert_clean_failure(tmp_path / "victim")
        assert_checkpoint_equals(tmp_path / "earlier", single_tensor_state(3))
        stager.save(make_state(4), tmp_path / "after").wait(60)  # the same client carries on
    assert_checkpoint_equals(tmp_path / "after", make_state(4))


def test_bytes_corrupted_in_memory_before_their_write_are_never_published(
    daemons, tmp_path: Path
) -> None:
    """Failing memory cannot be caused for real: the test-only ``flip-gathered:1`` shim
    flips a bit in the first chunk the writer gathered, after its checksums were taken. The
    I/O thread checks the chunk again right before writing it: the save fails naming the
    tensor, nothing is published, and the daemon goes on writing correct checkpoints."""
    daemon = daemons(env={"SHMSTAGE_FAULT": "flip-gathered:1"})
    with Stager(daemon.socket) as stager:
        with pytest.raises(PersistError, match="changed in the daemon's memory") as info:
            stager.save(single_tensor_state(6), tmp_path / "victim").wait(60)
        assert info.value.code == "internal" and "tensor 'w'" in str(info.value)
        assert_clean_failure(tmp_path / "victim")
    serves_on(daemon, tmp_path / "after")


def test_failure_after_the_commit_marker_unpublishes_it(daemons, tmp_path: Path) -> None:
    """The directory fsync is the job's last step, after the manifest has its name; if it
    fails (test-only ``eio-sync-dir`` shim) the manifest must go first, then the data —
    never a manifest whose data file is gone."""
    daemon = daemons(env={"SHMSTAGE_FAULT": "eio-sync-dir:1"})
    with Stager(daemon.socket) as stager:
        with pytest.raises(PersistError, match="syncing the checkpoint directory"):
            stager.save(make_state(5), tmp_path / "victim").wait(60)
        assert_clean_failure(tmp_path / "victim")
        stager.save(make_state(5), tmp_path / "again").wait(60)
    assert_checkpoint_equals(tmp_path / "again", make_state(5))


def test_destination_removed_mid_stream(daemons, tmp_path: Path) -> None:
    daemon = daemons(env={"SHMSTAGE_FAULT": "pause-mid-stream:1"})
    with Stager(daemon.socket) as stager:
        stager.save(single_tensor_state(6), tmp_path / "earlier").wait(60)
        handle = stager.save(make_state(6), tmp_path / "victim")
        daemon.wait_log("fault: pausing at mid-stream")
        shutil.rmtree(writing_dir(tmp_path))  # the new directory, still pending
        with pytest.raises(PersistError, match="was removed while") as info:
            handle.wait(60)
        assert str(tmp_path / "victim") in str(info.value)
        assert not (tmp_path / "victim").exists()
        assert_checkpoint_equals(tmp_path / "earlier", single_tensor_state(6))
        stager.save(make_state(7), tmp_path / "after").wait(60)
    assert_checkpoint_equals(tmp_path / "after", make_state(7))


def test_destination_made_immutable_mid_stream(daemons, tmp_path: Path) -> None:
    """chattr +i on a real ext4: not even root may add a name. The temporary files cannot
    be removed either (nobody can, until the flag goes), but nothing gets a final name."""
    daemon = daemons(env={"SHMSTAGE_FAULT": "pause-mid-stream:1"})
    with loop_ext4(tmp_path / "disk", tmp_path / "disk.img") as disk, Stager(
        daemon.socket
    ) as stager:
        stager.save(single_tensor_state(8), disk / "earlier").wait(60)
        handle = stager.save(make_state(8), disk / "victim")
        daemon.wait_log("fault: pausing at mid-stream")
        victim = writing_dir(disk)  # the new directory, still pending
        subprocess.run(["chattr", "+i", str(victim)], check=True, timeout=30)
        try:
            with pytest.raises(PersistError, match=r"Operation not permitted \(EPERM\)"):
                handle.wait(60)
            assert published_files(victim) == [] and not (disk / "victim").exists()
        finally:
            subprocess.run(["chattr", "-i", str(victim)], check=True, timeout=30)
        assert_checkpoint_equals(disk / "earlier", single_tensor_state(8))
        stager.save(make_state(9), disk / "after").wait(60)
    serves_on(daemon, tmp_path / "after")


def test_destination_made_read_only_for_its_user_mid_stream(daemons, world: Path) -> None:
    """A non-root trainer whose directory is chmod'ed read-only while the (root) daemon
    streams: the daemon re-checks before publishing, and publishes nothing."""
    daemon = admitting_nobody(daemons, world, env={"SHMSTAGE_FAULT": "pause-mid-stream:2@1"})
    ckpt = nobody_dir(world / "ckpt")
    result: list[str] = []

    def trainer() -> None:
        result.append(
            run_as(
                f"""
                state = {{"a": torch.ones(1000), "b": torch.zeros(1000)}}
                with Stager("{daemon.socket}") as stager:
                    stager.save({{"w": torch.ones(10)}}, "{ckpt}/earlier").wait(60)
                    try:
                        stager.save(state, "{ckpt}/victim").wait(60)
                    except PersistError as exc:
                        print("REFUSED", exc)
                """
            )
        )

    thread = threading.Thread(target=trainer)
    thread.start()
    daemon.wait_log("fault: pausing at mid-stream", timeout=60)
    victim = writing_dir(ckpt)  # the new directory, still pending
    victim.chmod(0o555)
    thread.join(90)
    assert "REFUSED" in result[0] and "can no longer write" in result[0], result
    assert not victim.exists() or published_files(victim) == []
    assert not (ckpt / "victim").exists()
    assert checkpoint.verify(ckpt / "earlier") == []


def test_shm_budget_exhausted_at_registration(daemons, tmp_path: Path) -> None:
    daemon = daemons("--shm-budget", "1MiB")
    with Stager(daemon.socket) as stager:
        stager.save(single_tensor_state(10), tmp_path / "earlier").wait(60)
        with pytest.raises(StagingLimitExceeded, match="shared-memory budget") as info:
            stager.save({"w": torch.ones(1 << 19)}, tmp_path / "big")  # 2 MiB
        assert info.value.code == "shm_exhausted"
        assert_clean_failure(tmp_path / "big")
        stager.save(single_tensor_state(11), tmp_path / "small").wait(60)
    assert_checkpoint_equals(tmp_path / "earlier", single_tensor_state(10))
    wait_for(lambda: daemon.segments() == [], 10, "the released layouts' segments to go")


def shm_namespace() -> list[str]:
    """Run the daemon in a private mount namespace whose /dev/shm is an 8 MiB tmpfs."""
    require_root("a private /dev/shm")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace: {probe.stderr.decode().strip()}")
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"',
        "shmstaged-in-namespace",
    ]


@pytest.mark.parametrize("when", ["before", "during"])
def test_dev_shm_full_at_registration(daemons, tmp_path: Path, when: str) -> None:
    """A real, full /dev/shm. ``before``: filled before the registration, which the daemon
    refuses up front; ``during``: filled while the daemon creates the layout's segments
    (the test-only ``pause-register`` hook holds it after the first), so the kernel's
    ENOSPC from posix_fallocate is what refuses it. Either way no segment is left."""
    fault = {"SHMSTAGE_FAULT": "pause-register:2@2"} if when == "during" else None
    daemon = daemons("--shm-budget", "100%", prefix=shm_namespace(), env=fault)
    shm = Path(f"/proc/{daemon.proc.pid}/root/dev/shm")
    ours = lambda: [n for n in os.listdir(shm) if segment.instance_of(n)]  # noqa: E731
    with Stager(daemon.socket, slots=1) as stager:
        stager.save(single_tensor_state(12), tmp_path / "earlier").wait(60)
        state = {"a": torch.ones(3 << 18), "b": torch.ones(3 << 18)}  # 2 x 3 MiB of 8
        if when == "before":
            (shm / "filler").write_bytes(b"\0" * (3 << 20))
            with pytest.raises(StagingLimitExceeded, match="free space in /dev/shm"):
                stager.save(state, tmp_path / "big")
        else:
            failed: list[BaseException] = []

            def save() -> None:
                try:
                    stager.save(state, tmp_path / "big")
                except SaveError as exc:
                    failed.append(exc)

            thread = threading.Thread(target=save)
            thread.start()
            daemon.wait_log("fault: pausing at register")
            (shm / "filler").write_bytes(b"\0" * (3 << 20))
            thread.join(60)
            assert failed and isinstance(failed[0], StagingLimitExceeded), failed
            assert "/dev/shm is full" in str(failed[0])
        assert_clean_failure(tmp_path / "big")
        # The earlier layout was released for the new structure, which never came to be.
        wait_for(lambda: ours() == [], 10, "no segment to remain")
        (shm / "filler").unlink()
        stager.save(single_tensor_state(13), tmp_path / "small").wait(60)
    assert_checkpoint_equals(tmp_path / "earlier", single_tensor_state(12))


def test_unwritable_journal_refuses_the_commit_and_hands_the_slot_back(
    daemons, tmp_path: Path
) -> None:
    """The journal on a full tmpfs (Docker's small /dev/shm): a commit that cannot be
    journaled is refused before it is acknowledged — an error, not a hang — the slot goes
    back to the client, and saving works again once there is room."""
    with small_tmpfs(tmp_path / "run", "256k") as run:
        daemon = daemons("--journal-dir", str(run), where=run)
        filler = run / "filler"
        with Stager(daemon.socket, slots=1) as stager:
            stager.save(single_tensor_state(14), tmp_path / "earlier").wait(60)
            wait_for(lambda: journal_entries(daemon) == [], 10, "the journal to empty")
            fill(filler)
            with pytest.raises(SaveError, match="cannot journal the checkpoint") as info:
                stager.save(make_state(14), tmp_path / "victim")
            assert info.value.code == "storage"  # type: ignore[attr-defined]
            assert_clean_failure(tmp_path / "victim")
            filler.unlink()
            stager.save(make_state(15), tmp_path / "again").wait(60)  # the one slot is back
        assert_checkpoint_equals(tmp_path / "again", make_state(15))
        daemon.stop()
    assert NOBODY  # the constant is shared with the isolation tests


def _save_in_thread(stager: Stager, state: dict, path: Path) -> tuple[threading.Thread, list]:
    outcome: list = []

    def save() -> None:
        try:
            outcome.append(stager.save(state, path))
        except BaseException as exc:  # reported by the test
            outcome.append(exc)

    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    return thread, outcome


def test_a_save_never_waits_for_the_disk_under_the_socket(daemons, tmp_path: Path) -> None:
    """The container case: /run, where the socket lives, is on a disk, and that disk stops
    answering (a real ext4, frozen). The journal lives in memory (/dev/shm), so save()
    returns and its checkpoint (on another filesystem) becomes durable while the disk under
    the socket is frozen solid. Nothing the trainer waits for touches it."""
    with loop_ext4(tmp_path / "run", tmp_path / "run.img") as run:
        daemon = daemons(socket=run / "shmstaged.sock")  # its log is not on that disk
        assert "journal /dev/shm/shmstage." in daemon.log() and " on tmpfs" in daemon.log()
        with Stager(daemon.socket, slots=2) as stager:
            stager.save(make_state(1), tmp_path / "warm").wait(60)  # layout registered
            with frozen(run):
                thread, outcome = _save_in_thread(stager, make_state(2), tmp_path / "during")
                thread.join(60)
                assert not thread.is_alive(), "save() waited for the frozen disk"
                [handle] = outcome
                handle.wait(60)  # durable too: nothing of the job is on that disk
    assert_checkpoint_equals(tmp_path / "during", make_state(2))


def test_a_disk_journal_is_refused_unless_allowed_and_then_waits_for_the_disk(
    daemons, tmp_path: Path
) -> None:
    """Why the default matters: with the journal on that same disk (allowed explicitly),
    a save cannot return while the disk is frozen; it completes once the disk thaws."""
    with loop_ext4(tmp_path / "run", tmp_path / "run.img") as run:
        sock = run / "shmstaged.sock"
        with pytest.raises(RuntimeError, match="is not memory-backed") as refused:
            daemons("--journal-dir", str(run), socket=sock)
        assert "allow_disk_journal" in str(refused.value)
        daemon = daemons("--journal-dir", str(run), "--allow-disk-journal", socket=sock)
        assert f"journal {run}/shmstage." in daemon.log() and "disk-backed" in daemon.log()
        with Stager(daemon.socket, slots=2) as stager:
            stager.save(make_state(1), tmp_path / "warm").wait(60)
            with frozen(run):
                thread, outcome = _save_in_thread(stager, make_state(3), tmp_path / "during")
                thread.join(2)
                assert thread.is_alive() and outcome == [], "the commit did not wait"
            thread.join(60)  # thawed: the journal entry is written, save() returns
            [handle] = outcome
            handle.wait(60)
    assert_checkpoint_equals(tmp_path / "during", make_state(3))
