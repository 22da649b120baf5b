"""Isolation between users and between clients, with real uids (a child dropped to
``nobody``) and the daemon's real per-client limits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fault_helpers import (
    admitting_nobody,
    assert_checkpoint_equals,
    make_state,
    nobody_dir,
    run_as,
    single_tensor_state,
)
from harness import RawClient, wait_for
from shmstage_client import Stager, StagingLimitExceeded

from shmstage.control import ControlClient


def test_a_uid_outside_the_allowlist_is_refused_clearly(daemons, world: Path) -> None:
    daemon = daemons(where=world / "d")
    (world / "d").chmod(0o755)
    code = f"""
        try:
            Stager("{daemon.socket}")
        except SaveError as exc:
            print(type(exc).__name__, exc)
        """
    # The socket is 0660 root: the kernel already keeps nobody out, and the client says how.
    assert "permission denied — add this user to the group" in run_as(code)
    # Reachable socket: the daemon itself refuses, by SO_PEERCRED uid, naming the fix.
    daemon.socket.chmod(0o666)
    out = run_as(code)
    assert out.startswith("DaemonRefused"), out
    assert "uid 65534 is not allowed to use shmstaged" in out and "allowed users" in out
    assert "refused pid" in daemon.log()
    with Stager(daemon.socket) as stager:  # root, in the allowlist, is unaffected
        stager.save(single_tensor_state(1), world / "ok").wait(60)


def test_another_uid_cannot_open_a_clients_segments(daemons, world: Path) -> None:
    """Segments are 0600 and owned by the daemon's uid: an allowed user of another uid (a
    second trainer on the node) can neither open nor map another client's staging buffers."""
    daemon = admitting_nobody(daemons, world)
    with Stager(daemon.socket, slots=2) as stager:
        stager.save(make_state(2), world / "root-ckpt").wait(60)
        names = daemon.segments()
        assert len(names) == 2 * 4
        out = run_as(
            f"""
            for name in {names!r}:
                for how in ("posix_ipc", "path"):
                    try:
                        if how == "posix_ipc":
                            posix_ipc.SharedMemory(name, 0, read_only=True)
                        else:
                            os.open("/dev/shm" + name, os.O_RDONLY)
                        print("OPENED", name)
                    except (PermissionError, posix_ipc.PermissionsError):
                        print("DENIED")
            # Nor through the daemon: its layouts are per connection.
            raw = socket.socket(socket.AF_UNIX)
            raw.connect("{daemon.socket}")
            conn = protocol.Connection(protocol.Role.CLIENT)
            raw.sendall(conn.send("hello", 1, {{"version": 2, "client": "x", "pid": 1}}))
            raw.sendall(conn.send("acquire", 2, {{"layout": 1, "wait": False, "timeout": None}}))
            frames = []
            while len(frames) < 2:
                conn.receive_data(raw.recv(65536))
                while (frame := conn.next_frame()) is not None:
                    frames.append(frame)
            print("ACQUIRE", frames[1].body.get("code"))
            """
        )
    assert "OPENED" not in out
    assert out.count("DENIED") == 2 * len(names)
    assert "ACQUIRE unknown_layout" in out
    assert_checkpoint_equals(world / "root-ckpt", make_state(2))


def test_a_non_root_user_cannot_make_the_daemon_write_where_it_cannot(
    daemons, world: Path
) -> None:
    """nobody points a commit at a directory it may not write — reached through a symlink
    it owns, with temporary files root left there writable — and the daemon refuses."""
    daemon = admitting_nobody(daemons, world)
    protected = world / "protected"
    protected.mkdir(mode=0o755)
    tmp_names = (
        ".model.safetensors.0123456789abcdef.shmstage-tmp",
        ".shmstage-manifest.json.0123456789abcdef.shmstage-tmp",
    )
    for name in tmp_names:
        (protected / name).touch(mode=0o666)
        (protected / name).chmod(0o666)
    home = nobody_dir(world / "home")
    os.symlink(protected, home / "link")
    out = run_as(
        f"""
        client = Stager("{daemon.socket}")
        conn = client._connection
        reply = conn.start("register", {{"tensors": [["w", "F32", [4], None]], "slots": 1}})
        layout = reply.next(10).body["layout"]
        for fd in reply.next(10).fds:
            os.close(fd)
        reply.finish()
        slot = conn.call("acquire", {{"layout": layout, "wait": False, "timeout": None}},
                         timeout=10).body["slot"]
        dir_fd = os.open("{home}/link", os.O_RDONLY | os.O_DIRECTORY)
        fds = [dir_fd] + [os.open(n, os.O_WRONLY, dir_fd=dir_fd) for n in {tmp_names!r}]
        try:
            conn.call("commit", {{"layout": layout, "slot": slot, "data_file": "model.safetensors",
                      "data_tmp": {tmp_names[0]!r}, "manifest_tmp": {tmp_names[1]!r},
                      "tree": {{"T": "w"}}, "metadata": {{}}, "file_metadata": {{}}}},
                      fds, timeout=10)
            print("ACCEPTED")
        except SaveError as exc:
            print("REFUSED", exc)
        """
    )
    assert "REFUSED" in out and "[not_allowed]" in out, out
    assert "cannot write the checkpoint directory" in out
    assert sorted(os.listdir(protected)) == sorted(tmp_names)
    assert all((protected / n).stat().st_size == 0 for n in tmp_names)


def test_in_a_sticky_directory_nobody_renames_another_users_directory(
    daemons, world: Path
) -> None:
    """In a sticky directory (/tmp) a user may rename only its own entries. nobody commits
    root's directory there as its "pending directory" — writable inside, so its files
    pass — hoping the root daemon renames it on its behalf; the daemon refuses."""
    daemon = admitting_nobody(daemons, world)
    sticky = world / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    pending = sticky / ".shmstage-pending.0123456789abcdef"
    pending.mkdir()
    pending.chmod(0o777)  # root's, but anyone may create files in it
    out = run_as(
        f"""
        client = Stager("{daemon.socket}")
        conn = client._connection
        reply = conn.start("register", {{"tensors": [["w", "F32", [4], None]], "slots": 1}})
        layout = reply.next(10).body["layout"]
        for fd in reply.next(10).fds:
            os.close(fd)
        reply.finish()
        slot = conn.call("acquire", {{"layout": layout, "wait": False, "timeout": None}},
                         timeout=10).body["slot"]
        names = (".model.safetensors.0123456789abcdef.shmstage-tmp",
                 ".shmstage-manifest.json.0123456789abcdef.shmstage-tmp")
        parent_fd = os.open("{sticky}", os.O_RDONLY | os.O_DIRECTORY)
        dir_fd = os.open("{pending}", os.O_RDONLY | os.O_DIRECTORY)
        fds = [parent_fd, dir_fd] + [
            os.open(n, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd) for n in names
        ]
        try:
            conn.call("commit", {{"layout": layout, "slot": slot, "data_file": "model.safetensors",
                      "data_tmp": names[0], "manifest_tmp": names[1],
                      "pending_dir": "{pending.name}", "final_dir": "taken",
                      "tree": {{"T": "w"}}, "metadata": {{}}, "file_metadata": {{}}}},
                      fds, timeout=10)
            print("ACCEPTED")
        except SaveError as exc:
            print("REFUSED", exc)
        """
    )
    assert "REFUSED" in out and "[not_allowed]" in out and "belongs to uid 0" in out, out
    assert sorted(os.listdir(sticky)) == [pending.name]


def small(seed: int) -> dict:
    return make_state(seed, numel=1 << 12)


def test_per_user_limits_are_enforced_and_spare_other_users(daemons, world: Path) -> None:
    """Limits hold per uid, across all its connections: a user cannot get around them by
    connecting again, and another user (nobody, a real second uid) saves undisturbed."""
    daemon = admitting_nobody(
        daemons, world,
        "--max-bytes", "1MiB", "--max-segments", "16", "--max-layouts", "2", "--max-jobs", "1",
        env={"SHMSTAGE_FAULT": "pause-mid-stream:2"},
    )  # fmt: skip
    with Stager(daemon.socket, slots=1) as greedy:
        with pytest.raises(StagingLimitExceeded, match="over its limit of 1048576") as info:
            greedy.save({"w": torch.ones(1 << 19)}, world / "bytes")  # 2 MiB
        assert "bytes" in str(info.value) and "max_bytes" in str(info.value)
        many = {f"t{i}": torch.ones(4) for i in range(17)}
        with pytest.raises(StagingLimitExceeded, match=r"17 segments, over its limit of 16"):
            greedy.save(many, world / "segments")
        # Layouts are counted for the user, whichever connection registers them.
        raws = [RawClient(daemon.socket) for _ in range(3)]
        for i, raw in enumerate(raws):
            raw.request("register", {"tensors": [[f"k{i}", "U8", [1], None]], "slots": 1})
            frame = raw.frame()
            if i < 2:
                for fd in raw.frame().fds:
                    os.close(fd)
        assert frame.body["code"] == "limit_exceeded" and "3 layouts" in frame.body["message"]
        assert "for all its connections together" in frame.body["message"]
        for raw in raws:
            raw.close()
        # A 1-byte tensor is charged the page it takes in /dev/shm, not 1 byte.
        wait_for(lambda: len(daemon.segments()) == 0, 10, "the raw clients' layouts to go")
        tiny = {f"b{i}": torch.ones(1, dtype=torch.uint8) for i in range(8)}
        greedy.save(tiny, world / "tiny").wait(60)
        with ControlClient(daemon.socket) as control:
            status = control.status()
        assert status["shm_reserved_bytes"] == 8 * 4096
    # One job at a time for this user: the second commit, while the first streams, is
    # refused, even from another connection...
    with Stager(daemon.socket, slots=2) as busy, Stager(daemon.socket, slots=1) as other:
        first = busy.save(small(3), world / "first")
        daemon.wait_log("fault: pausing at mid-stream")
        with pytest.raises(StagingLimitExceeded, match=r"being written \(limit 1, max_jobs\)"):
            other.save(small(4), world / "second")
        assert not (world / "second").exists()  # refused: nothing made for it
        # ...while another user, under its own limits, saves as if nothing happened.
        nobody_dir(world / "theirs")
        out = run_as(
            f"""
            with Stager("{daemon.socket}", slots=1) as stager:
                stager.save({{"w": torch.full((1000,), 5.0)}}, "{world}/theirs/ckpt").wait(60)
            print("SAVED")
            """
        )
        assert "SAVED" in out
        first.wait(60)
        other.save(small(4), world / "second").wait(60)  # the user's job slot came back
    assert_checkpoint_equals(world / "first", small(3))
    assert_checkpoint_equals(world / "second", small(4))
    assert_checkpoint_equals(world / "theirs" / "ckpt", {"w": torch.full((1000,), 5.0)})
