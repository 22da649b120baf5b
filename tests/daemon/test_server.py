"""shmstaged as a process: admission, hostile frames, ownership, lifecycle, never torch."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import RawClient, packages_imported_by, start_daemon, wait_for
from shmstage_client import DaemonLost, DaemonUnavailable, Stager

from shmstage import checkpoint, instance, segment
from shmstage.protocol import PROTOCOL_VERSION


def test_garbage_and_oversized_frames_get_errors_and_spare_other_clients(
    daemon, raw_client, ckpt: Path
) -> None:
    state = {"w": torch.randn(16 << 20)}  # 64 MiB: its persist overlaps the attacks
    expected = state["w"].clone()
    with Stager(daemon.socket) as stager:
        handle = stager.save(state, ckpt / "c")
        garbage = raw_client()
        garbage.send_raw(b"\x00\x00\x00\x04\xc1\xc1\xc1\xc1")
        frame = garbage.frame()
        assert frame.op == "error" and frame.body["code"] == "bad_frame" and frame.body["fatal"]
        with pytest.raises(EOFError):
            garbage.frame()
        huge = raw_client()
        huge.send_raw(struct.pack(">I", 1 << 31))
        frame = huge.frame()
        assert frame.body["code"] == "frame_too_large"
        early = raw_client(hello=False)
        early.request("hello", {"version": PROTOCOL_VERSION, "client": "x", "pid": 1})
        early.frame()
        early.send_raw(
            early.conn.send("hello", 9, {"version": PROTOCOL_VERSION, "client": "x", "pid": 1})
        )
        assert early.frame().body["code"] == "out_of_order"
        handle.wait(60)
        # The well-behaved client carries on with more saves on the same connection.
        stager.save(state, ckpt / "d").wait(60)
    assert checkpoint.verify(ckpt / "c") == []
    assert torch.equal(checkpoint_tensor(ckpt / "c", "w"), expected)


def checkpoint_tensor(path: Path, key: str) -> torch.Tensor:
    from shmstage_client import load

    return load(path)[key]


def test_unsupported_protocol_version_is_refused_with_advice(raw_client) -> None:
    client = raw_client(hello=False)
    client.request("hello", {"version": 99, "client": "future", "pid": 1})
    frame = client.frame()
    assert frame.body["code"] == "unsupported_version"
    assert "upgrade" in frame.body["message"]


def test_slots_are_used_only_by_their_holder(raw_client) -> None:
    owner = raw_client()
    owner.request("register", {"tensors": [["w", "F32", [4], None]], "slots": 1})
    registered = owner.frame()
    layout = registered.body["layout"]
    fds_frame = owner.frame()
    for fd in fds_frame.fds:
        os.close(fd)
    # Committing a slot never acquired is refused.
    r, w = os.pipe()
    owner.request(
        "commit",
        {
            "layout": layout,
            "slot": 0,
            "data_file": "m.safetensors",
            "data_tmp": ".m.safetensors.0123456789abcdef.shmstage-tmp",
            "manifest_tmp": ".shmstage-manifest.json.0123456789abcdef.shmstage-tmp",
            "tree": None,
            "metadata": {},
            "file_metadata": {},
        },
        [r, w, r],
    )
    refusal = owner.frame()
    assert refusal.op == "error" and refusal.body["code"] in ("bad_request", "slot_not_owned")
    os.close(r)
    os.close(w)
    owner.request("acquire", {"layout": layout, "wait": False, "timeout": None})
    assert owner.frame().op == "acquired"
    owner.request("acquire", {"layout": layout, "wait": False, "timeout": None})
    assert owner.frame().body["code"] == "no_free_slot"
    # Another client cannot touch, or even see, this layout.
    other = raw_client()
    for op, body in [
        ("acquire", {"layout": layout, "wait": False, "timeout": None}),
        ("cancel", {"layout": layout, "slot": 0}),
        ("release", {"layout": layout}),
    ]:
        other.request(op, body)
        assert other.frame().body["code"] == "unknown_layout"
    owner.request("cancel", {"layout": layout, "slot": 0})
    assert owner.frame().op == "cancelled"
    owner.request("cancel", {"layout": layout, "slot": 0})
    assert owner.frame().body["code"] == "slot_not_owned"


def test_waiting_for_a_slot_times_out_with_a_clear_error(raw_client) -> None:
    client = raw_client()
    client.request("register", {"tensors": [["w", "U8", [1], None]], "slots": 1})
    layout = client.frame().body["layout"]
    for fd in client.frame().fds:
        os.close(fd)
    client.request("acquire", {"layout": layout, "wait": True, "timeout": 0.2})
    assert client.frame().op == "acquired"
    started = time.monotonic()
    client.request("acquire", {"layout": layout, "wait": True, "timeout": 0.2})
    frame = client.frame()
    assert frame.body["code"] == "no_free_slot" and "within 0.2 s" in frame.body["message"]
    assert time.monotonic() - started < 5


def test_the_daemon_never_imports_torch(daemon) -> None:
    with Stager(daemon.socket) as stager:  # exercise the daemon's whole path first
        stager.save({"w": torch.ones(3)}, daemon.socket.parent / "c").wait(60)
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "torch" not in maps
    loaded = packages_imported_by(
        [
            "shmstage_daemon.main",
            "shmstage_daemon.server",
            "shmstage_daemon.job",
            "shmstage.checkpoint",
            "shmstage.cli",
        ],
        ["torch"],
    )
    assert loaded == []


def test_the_daemon_grows_its_descriptor_table_once_at_start(daemon) -> None:
    """Before any client: growing it later, under load, would make every thread of the
    daemon that opens a descriptor wait out an RCU grace period, once per doubling."""
    from shmstage_daemon.server import RESERVED_FDS

    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    size = int(next(line for line in status.splitlines() if line.startswith("FDSize:")).split()[1])
    limits = Path(f"/proc/{daemon.proc.pid}/limits").read_text()
    soft = next(line for line in limits.splitlines() if line.startswith("Max open files"))
    assert size >= min(RESERVED_FDS, int(soft.split()[3]))


def test_missing_daemon_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable, match=r"no such file — is shmstaged running"):
        Stager(tmp_path / "nope.sock")


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p.write_text(""), "it is a regular file, not a socket"),
        (lambda p: p.mkdir(), "it is a directory, not a socket"),
        (lambda p: os.symlink(p.parent / "gone.sock", p), "a symlink to nothing"),
    ],
)
def test_a_socket_path_that_is_no_socket_says_what_it_is(tmp_path: Path, make, says) -> None:
    """The kernel refuses a connection to a file or a directory as it does to a socket
    whose daemon is gone; the client and the CLI say which it is, in the same words."""
    path = tmp_path / "shmstaged.sock"
    make(path)
    with pytest.raises(DaemonUnavailable) as info:
        Stager(path)
    assert says in str(info.value) and "daemon that created" not in str(info.value)
    cli = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "status", "--socket", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 3 and says in cli.stderr, cli.stderr


def test_a_client_whose_daemon_dies_gets_an_exception(daemon, ckpt: Path) -> None:
    stager = Stager(daemon.socket)
    stager.save({"w": torch.ones(4)}, ckpt / "a").wait(60)
    daemon.proc.kill()
    daemon.proc.wait(10)
    started = time.monotonic()
    # Whether the client's reader has already seen the connection end is a race with the
    # save: it fails as DaemonLost (the connection broke under it) or, once the loss is
    # known, DaemonUnavailable (the reconnect is refused). Either way at once, never a hang.
    with pytest.raises((DaemonLost, DaemonUnavailable)):
        stager.save({"w": torch.ones(4)}, ckpt / "b").wait(30)
    wait_for(lambda: not stager._connection.alive, 10, "the client to notice the loss")
    # From now on the Stager tries to reconnect (the daemon may have been restarted);
    # nobody serves the socket, so the save fails at once, saying so.
    with pytest.raises(DaemonUnavailable, match="connection refused"):
        stager.save({"w": torch.ones(4)}, ckpt / "b").wait(30)
    assert time.monotonic() - started < 10
    assert checkpoint.verify(ckpt / "a") == []  # what was persisted is untouched
    assert not (ckpt / "b").exists()  # nor anything made for it
    stager.close(timeout=1)
    assert os.listdir(ckpt) == ["a"]  # the spare pending directory went with close()


def test_sigterm_finishes_in_flight_checkpoints_then_exits_clean(daemon, ckpt: Path) -> None:
    stager = Stager(daemon.socket)
    handle = stager.save({"w": torch.randn(32 << 20)}, ckpt / "big")  # 128 MiB with fsync
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(60) == 0
    assert checkpoint.verify(ckpt / "big") == []
    try:
        handle.wait(5)  # the result may or may not have reached us before the socket closed
    except DaemonLost:
        pass
    assert segment.list_names(daemon.instance) == []
    stager.close(timeout=1)


def test_sigint_also_stops_cleanly(daemon) -> None:
    assert daemon.stop(signal.SIGINT) == 0
    assert "stopped" in daemon.log()


@pytest.mark.parametrize("signals", [[signal.SIGINT], [signal.SIGHUP, signal.SIGTERM]])
def test_a_signal_during_start_up_is_acted_on_once_the_daemon_can(
    tmp_path: Path, signals: list[int]
) -> None:
    """Start-up logs "listening on" before its event loop handles signals: a stop (or a
    reload) that lands in between waits for the loop, and the daemon stops cleanly."""
    daemon = start_daemon(tmp_path, env={"SHMSTAGE_FAULT": "pause-started:1"}, ready=False)
    try:
        wait_for(lambda: "fault: pausing at started" in daemon.log(), 10, "the start-up pause")
        for signum in signals:
            daemon.proc.send_signal(signum)
        assert daemon.proc.wait(30) == 0, daemon.log()
        assert "acting on signal(s) received while starting" in daemon.log()
        assert "stopped" in daemon.log()
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()


def test_a_second_daemon_refuses_a_live_socket_and_leaves_nothing_behind(
    daemon, tmp_path: Path
) -> None:
    """The refused daemon had claimed an instance (a lock file in /dev/shm) before it found
    the socket taken: it gives the instance back as it exits, rather than leaving the lock
    for the next daemon of this uid to reap."""
    before = set(os.listdir("/dev/shm"))
    out = subprocess.run(
        [sys.executable, "-m", "shmstage_daemon.main", "--socket", str(daemon.socket)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "already serving" in out.stderr
    assert daemon.proc.poll() is None
    # Daemons of tests running beside this one (on other workers) make names meanwhile, and
    # one may be killed meanwhile too (leaving its segments to its successor): a leftover is
    # a name of an instance that had none before this daemon ran and that nobody holds.
    live = instance.live_instances()
    known = {name.split(".")[1] for name in before if name.startswith("shmstage.")}
    left = {
        name
        for name in set(os.listdir("/dev/shm")) - before
        if name.startswith("shmstage.") and name.split(".")[1] not in live | known
    }
    assert left == set(), left


@pytest.mark.node_wide
def test_segments_of_a_killed_daemon_are_reaped_by_the_next(tmp_path: Path, ckpt: Path) -> None:
    first = start_daemon(tmp_path / "one")
    stager = Stager(first.socket, slots=2)
    stager.save({"w": torch.ones(100), "b": torch.ones(3)}, ckpt / "c").wait(60)
    assert len(first.segments()) == 4
    # The job's journal entry is dropped just after the client hears "durable"; killed
    # before that, the entry (rightly) holds the segments back for this socket's next daemon.
    wait_for(lambda: not any(first.journal.iterdir()), 10, "the finished job's entry to go")
    first.proc.kill()
    first.proc.wait(10)
    stager.close(timeout=1)
    assert len(first.segments()) == 4  # SIGKILL leaves them behind
    second = start_daemon(tmp_path / "two")
    try:
        assert first.segments() == []
        # Normally this daemon reaped them; a concurrently started one may have beaten it.
        assert "reaped 4 segment(s)" in second.log() or "reaped" not in second.log()
    finally:
        assert second.stop() == 0


def test_a_live_daemon_s_segments_are_never_reaped(daemon, tmp_path: Path, ckpt: Path) -> None:
    with Stager(daemon.socket, slots=1) as stager:
        stager.save({"w": torch.ones(10)}, ckpt / "c").wait(60)
        other = start_daemon(tmp_path / "other")
        try:
            assert len(daemon.segments()) == 1
        finally:
            other.stop()
        stager.save({"w": torch.ones(10)}, ckpt / "d").wait(60)


def test_raw_client_helper_is_sound(daemon) -> None:
    client = RawClient(daemon.socket)
    client.request("status", {})
    status = client.frame().body["status"]
    assert status["instance"] == daemon.instance and len(status["clients"]) == 1
    client.close()


def test_slots_added_later_are_sent_writable_and_handed_to_a_waiting_acquire(
    raw_client,
) -> None:
    client = raw_client()
    client.request(
        "register", {"tensors": [["w", "U8", [16], None]], "slots": 1, "planned_slots": 2}
    )
    registered = client.frame()
    assert registered.body["slots"] == 1 and registered.body["segments"] == 1
    layout = registered.body["layout"]
    for fd in client.frame().fds:
        os.close(fd)
    client.request("acquire", {"layout": layout, "wait": False, "timeout": None})
    assert client.frame().body["slot"] == 0
    waiting = client.request("acquire", {"layout": layout, "wait": True, "timeout": 10})
    adding = client.request("add_slots", {"layout": layout, "slots": 2})
    frames = {}
    for _ in range(3):
        frame = client.frame()
        frames[frame.op] = frame
    assert frames["slots_added"].id == adding and frames["slots_added"].body["slots"] == 2
    assert frames["slots_added"].body["segments"] == 1
    fds = frames["segment_fds"].fds
    assert frames["segment_fds"].body["first"] == 0 and len(fds) == 1
    assert os.fstat(fds[0]).st_size >= 16
    assert fcntl.fcntl(fds[0], fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    os.close(fds[0])
    # The acquire that waited (slot 0 is busy) got the new slot the moment it existed.
    assert frames["acquired"].id == waiting and frames["acquired"].body["slot"] == 1
    # Asking again for what the layout has adds nothing; more than the daemon allows is
    # refused, naming the range.
    client.request("add_slots", {"layout": layout, "slots": 2})
    again = client.frame()
    assert again.op == "slots_added" and again.body == {**again.body, "segments": 0, "slots": 2}
    client.request("add_slots", {"layout": layout, "slots": 99})
    refused = client.frame()
    assert refused.body["code"] == "bad_request" and "slots=99" in refused.body["message"]
    # Someone else's layout cannot be grown.
    other = raw_client()
    other.request("add_slots", {"layout": layout, "slots": 3})
    assert other.frame().body["code"] == "unknown_layout"
