"""Crafted commits: names with ``..``, absolute paths, symlinks, hard links, shared files,
wrong descriptors and malformed structures. The daemon writes nothing outside what the
requesting user could write, answers each with an error naming the problem, leaks no
descriptor, and keeps the session (and every other one) alive."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
from fault_helpers import assert_checkpoint_equals, make_state
from harness import RawClient, wait_for
from shmstage_client import Stager

from shmstage import checkpoint, names
from shmstage.manifest import MANIFEST_NAME

DATA_TMP = ".model.safetensors.0123456789abcdef.shmstage-tmp"
MANIFEST_TMP = ".shmstage-manifest.json.0123456789abcdef.shmstage-tmp"


class Committer:
    """A raw client holding one acquired slot of a one-tensor layout, committing by hand."""

    def __init__(self, socket: Path) -> None:
        self.raw = RawClient(socket)
        self.raw.request("register", {"tensors": [["w", "F32", [4], None]], "slots": 1})
        self.layout = self.raw.frame().body["layout"]
        for fd in self.raw.frame().fds:
            os.close(fd)
        self.raw.request("acquire", {"layout": self.layout, "wait": False, "timeout": None})
        self.slot = self.raw.frame().body["slot"]

    def commit(self, fds: list[int], **overrides: object):  # type: ignore[no-untyped-def]
        body = {
            "layout": self.layout,
            "slot": self.slot,
            "data_file": "model.safetensors",
            "data_tmp": DATA_TMP,
            "manifest_tmp": MANIFEST_TMP,
            "tree": {"d": [["w", {"T": "w"}]]},
            "metadata": {},
            "file_metadata": {},
            **overrides,
        }
        self.raw.request("commit", body, fds)
        for fd in fds:
            os.close(fd)
        return self.raw.frame()

    def job_done(self):  # type: ignore[no-untyped-def]
        return self.raw.frame(timeout=30)


def destination(directory: Path, data: str = DATA_TMP, manifest: str = MANIFEST_TMP) -> list[int]:
    directory.mkdir(exist_ok=True)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    return [dir_fd, *(os.open(name, flags, 0o644, dir_fd=dir_fd) for name in (data, manifest))]


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file the attacks aim at; it must come through every test untouched."""
    target = tmp_path / "outside" / "precious.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"precious")
    return target


def untouched(outside: Path) -> bool:
    return outside.read_bytes() == b"precious" and sorted(os.listdir(outside.parent)) == [
        "precious.safetensors"
    ]


@pytest.mark.parametrize(
    "field,value",
    [
        ("data_file", "../outside/precious.safetensors"),
        ("data_file", "/etc/evil.safetensors"),
        ("data_file", "sub/evil.safetensors"),
        ("data_file", ".."),
        ("data_file", ""),
        ("data_file", "evil.txt"),
        ("data_file", "nul\0.safetensors"),
        ("data_file", "x" * 300 + ".safetensors"),
        ("data_tmp", "../" + DATA_TMP),
        ("data_tmp", "/tmp/" + DATA_TMP),
        ("data_tmp", ".other.safetensors.0123456789abcdef.shmstage-tmp"),
        ("manifest_tmp", DATA_TMP),
        ("manifest_tmp", "shmstage-manifest.json"),
    ],
)
def test_names_that_could_escape_are_refused(
    daemon, ckpt: Path, outside: Path, field: str, value: str
) -> None:
    baseline = daemon.fd_count()
    committer = Committer(daemon.socket)
    frame = committer.commit(destination(ckpt / "c"), **{field: value})
    assert frame.op == "error" and frame.body["code"] == "bad_request", frame.body
    assert not frame.body["fatal"]
    assert untouched(outside)
    assert not checkpoint.is_complete(ckpt / "c")
    committer.raw.close()
    wait_for(lambda: daemon.fd_count() == baseline, 10, "the daemon's fds back to baseline")


def test_a_temporary_name_symlinked_outside_is_refused(daemon, ckpt: Path, outside: Path) -> None:
    directory = ckpt / "c"
    fds = destination(directory, data=".decoy")
    os.symlink(outside, directory / DATA_TMP)  # the name says tmp, the link points away
    fds[1] = os.open(outside, os.O_WRONLY)  # and the descriptor is the outside file
    committer = Committer(daemon.socket)
    frame = committer.commit(fds)
    assert frame.body["code"] == "bad_request"
    assert "is not the file whose descriptor came" in frame.body["message"]
    assert outside.read_bytes() == b"precious"


@pytest.mark.parametrize("final", ["model.safetensors", MANIFEST_NAME])
def test_a_final_name_planted_as_a_symlink_is_never_followed(
    daemon, ckpt: Path, outside: Path, final: str
) -> None:
    directory = ckpt / "c"
    fds = destination(directory)
    os.symlink(outside, directory / final)
    committer = Committer(daemon.socket)
    assert committer.commit(fds).op == "committed"
    done = committer.job_done()
    assert done.op == "job_done" and not done.body["ok"]
    assert done.body["result"]["code"] == "exists"
    assert f"{final} already exists" in done.body["result"]["message"]
    assert untouched(outside)
    assert os.readlink(directory / final) == str(outside)  # the planted link is left alone
    assert sorted(os.listdir(directory)) == [final]  # ours removed, manifest first


def test_hard_links_and_shared_files_are_refused(daemon, ckpt: Path, outside: Path) -> None:
    committer = Committer(daemon.socket)
    fds = destination(ckpt / "linked")
    os.link(ckpt / "linked" / DATA_TMP, ckpt / "linked" / "second-name")
    frame = committer.commit(fds)
    assert "links, not a fresh one" in frame.body["message"]
    directory = ckpt / "shared"
    fds = destination(directory)
    os.close(fds[2])
    os.unlink(directory / MANIFEST_TMP)
    os.link(directory / DATA_TMP, directory / MANIFEST_TMP)
    fds[2] = os.open(directory / MANIFEST_TMP, os.O_WRONLY)
    os.unlink(directory / DATA_TMP)
    os.link(directory / MANIFEST_TMP, directory / DATA_TMP)
    assert committer.commit(fds).body["code"] == "bad_request"
    assert untouched(outside)


def test_wrong_descriptors_are_refused_and_closed(daemon, ckpt: Path) -> None:
    baseline = daemon.fd_count()
    committer = Committer(daemon.socket)
    r, w = os.pipe()
    directory = destination(ckpt / "c")
    read_only = os.open(ckpt / "c" / DATA_TMP, os.O_RDONLY)
    cases = [
        ([os.dup(r), os.dup(w), os.dup(w)], "not a directory"),
        ([os.dup(directory[0]), os.dup(r), os.dup(w)], "not a regular file"),
        ([os.dup(directory[0]), os.dup(read_only), os.dup(directory[2])], "not open for writing"),
        ([os.dup(directory[0]), os.dup(directory[1])], "needs 3 descriptors"),
        ([], "needs 3 descriptors"),
    ]
    for fds, why in cases:
        frame = committer.commit(fds)
        assert frame.body["code"] == "bad_request" and why in frame.body["message"], frame.body
    for fd in (r, w, read_only, *directory):
        os.close(fd)
    committer.raw.close()
    wait_for(lambda: daemon.fd_count() == baseline, 10, "the daemon's fds back to baseline")


@pytest.mark.parametrize(
    "overrides,why",
    [
        ({"tree": {"d": [["w", {"T": "not-in-layout"}]]}}, "does not have"),
        ({"tree": {"f": "not a float"}}, "malformed"),
        ({"tree": {"d": [[b"bytes-key", 1]]}}, "malformed"),
        ({"tree": {"l": [b"raw bytes"]}}, "malformed"),
        ({"metadata": {"loss": math.nan}}, "plain JSON"),
        ({"metadata": {"blob": b"\x00"}}, "plain JSON"),
        ({"file_metadata": {"k": 1}}, "strings to strings"),
    ],
)
def test_structures_the_manifest_could_not_hold_are_refused_before_the_ack(
    daemon, ckpt: Path, overrides: dict, why: str
) -> None:
    """Before the fix these were acknowledged and then failed in the writer (or, for a tree
    naming a tensor the layout lacks, published a checkpoint that does not verify)."""
    committer = Committer(daemon.socket)
    frame = committer.commit(destination(ckpt / "c"), **overrides)
    assert frame.body["code"] == "bad_request" and why in frame.body["message"], frame.body
    assert os.listdir(ckpt / "c") == sorted(os.listdir(ckpt / "c"))  # untouched, no final name
    assert not [n for n in os.listdir(ckpt / "c") if not names.is_temp(n)]
    # The refused commit leaves the slot with its filler, who may cancel it.
    committer.raw.request("cancel", {"layout": committer.layout, "slot": committer.slot})
    assert committer.raw.frame().op == "cancelled"


def test_descriptors_on_other_operations_are_closed_not_leaked(daemon) -> None:
    baseline = daemon.fd_count()
    raw = RawClient(daemon.socket)
    for _ in range(50):
        r, w = os.pipe()
        raw.request("status", {}, [r, w])
        os.close(r)
        os.close(w)
        frame = raw.frame()
        assert frame.body["code"] == "bad_request"
        assert "only commit, lease and latest pass" in frame.body["message"]
    raw.request("status", {})
    assert raw.frame().op == "status"  # the session lives on
    raw.close()
    # A greeting with descriptors ends the session (found by the fuzzer: it used to leave
    # the handshake half done, and the next request crashed the session internally).
    early = RawClient(daemon.socket, hello=False)
    r, w = os.pipe()
    early.request("hello", {"version": 2, "client": "x", "pid": 1}, [r, w])
    os.close(r)
    os.close(w)
    early.send_raw(early.conn.send("status", 2, {}))
    frame = early.frame()
    assert frame.body["code"] == "bad_request" and frame.body["fatal"], frame.body
    with pytest.raises((EOFError, ConnectionResetError)):  # reset: our status went unread
        early.frame()
    early.close()
    wait_for(lambda: daemon.fd_count() == baseline, 10, "the daemon's fds back to baseline")
    assert "internal error" not in daemon.log()


@pytest.mark.parametrize("timeout", [math.nan, -1.0, math.inf])
def test_acquire_timeouts_that_would_poison_the_loop_are_refused(daemon, timeout: float) -> None:
    raw = RawClient(daemon.socket)
    raw.request("register", {"tensors": [["w", "U8", [1], None]], "slots": 1})
    layout = raw.frame().body["layout"]
    for fd in raw.frame().fds:
        os.close(fd)
    raw.request("acquire", {"layout": layout, "wait": False, "timeout": None})
    raw.frame()
    raw.request("acquire", {"layout": layout, "wait": True, "timeout": timeout})
    frame = raw.frame()
    assert frame.body["code"] == "bad_request" and "finite number" in frame.body["message"]
    raw.close()


def test_a_symlinked_checkpoint_directory_is_written_where_it_leads(daemon, ckpt: Path) -> None:
    (ckpt / "real").mkdir()
    os.symlink(ckpt / "real", ckpt / "link")
    with Stager(daemon.socket) as stager:
        stager.save(make_state(1), ckpt / "link" / "step").wait(60)
    assert_checkpoint_equals(ckpt / "real" / "step", make_state(1))
    assert os.path.islink(ckpt / "link")


def test_the_daemon_runs_with_its_hard_descriptor_limit(daemons) -> None:
    """Every client, segment hand-over and job holds descriptors: a soft limit of 1024
    (the usual default) would let a few busy clients starve all others with EMFILE."""
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is not installed")
    started = daemons(prefix=["prlimit", "--nofile=1024:8192"])
    limits = Path(f"/proc/{started.proc.pid}/limits").read_text()
    soft, hard = next(line for line in limits.splitlines() if "open files" in line).split()[3:5]
    assert (soft, hard) == ("8192", "8192"), limits


def _journal(daemon) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(os.listdir(daemon.journal))


def test_a_commit_sent_ahead_of_its_copy_starts_nothing_until_ready(daemon, ckpt: Path) -> None:
    """save() sends its commit before the copy ("ready": false): the daemon checks and
    journals it pending, answers "prepared", and writes only after "ready"."""
    committer = Committer(daemon.socket)
    frame = committer.commit(destination(ckpt / "c"), ready=False)
    assert frame.op == "prepared", frame.body
    job = frame.body["job"]
    pending = _journal(daemon)
    assert len(pending) == 1 and pending[0].startswith(".")  # not owed: a reaper ignores it
    assert not [n for n in os.listdir(ckpt / "c") if not names.is_temp(n)]
    # A "ready" naming another job or slot is refused; the prepared commit stays.
    committer.raw.request("ready", {"layout": committer.layout, "slot": 7, "job": job})
    assert committer.raw.frame().body["code"] == "bad_request"
    committer.raw.request(
        "ready",
        {"layout": committer.layout, "slot": committer.slot, "job": job, "stage_seconds": 0.01},
    )
    assert committer.raw.frame().op == "committed"
    done = committer.job_done()
    assert done.op == "job_done" and done.body["ok"], done.body
    assert checkpoint.verify(ckpt / "c") == []
    wait_for(lambda: _journal(daemon) == [], 10, "the finished job's entry to go")
    committer.raw.close()


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_a_prepared_commit_that_never_gets_ready_is_dropped(daemon, ckpt: Path, how: str) -> None:
    committer = Committer(daemon.socket)
    assert committer.commit(destination(ckpt / "c"), ready=False).op == "prepared"
    if how == "cancel":
        committer.raw.request("cancel", {"layout": committer.layout, "slot": committer.slot})
        assert committer.raw.frame().op == "cancelled"
        # The slot is free again: it can be acquired and committed once more.
        committer.raw.request(
            "acquire", {"layout": committer.layout, "wait": False, "timeout": None}
        )
        assert committer.raw.frame().op == "acquired"
    else:
        committer.raw.close()
        wait_for(lambda: daemon.segments() == [], 10, "the client's segments to go")
    wait_for(lambda: _journal(daemon) == [], 10, "the pending entry to go")
    # Nothing published, and the temporary files the client made are gone: a trainer
    # killed during its copy cannot remove them itself.
    wait_for(lambda: os.listdir(ckpt / "c") == [], 10, "the temporary files to go")
    if how == "cancel":
        committer.raw.close()


PENDING = ".shmstage-pending.0123456789abcdef"


def pending_destination(parent: Path, name: str = PENDING) -> list[int]:
    """A new directory's descriptors, as the client makes them: the parent, the hidden
    pending directory in it, and the two temporary files inside."""
    parent.mkdir(exist_ok=True)
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    return [parent_fd, *destination(parent / name)]


def test_a_new_directory_is_published_by_renaming_its_pending_one(daemon, ckpt: Path) -> None:
    committer = Committer(daemon.socket)
    frame = committer.commit(
        pending_destination(ckpt), pending_dir=PENDING, final_dir="step-1"
    )
    assert frame.op == "committed", frame.body
    assert committer.job_done().body["ok"]
    assert os.listdir(ckpt) == ["step-1"]
    assert checkpoint.verify(ckpt / "step-1") == []
    committer.raw.close()


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"pending_dir": "victim", "final_dir": "c"}, "is not .shmstage-pending"),
        ({"pending_dir": "../" + PENDING, "final_dir": "c"}, "not a plain file name"),
        ({"pending_dir": PENDING, "final_dir": ".."}, "not a plain file name"),
        ({"pending_dir": PENDING, "final_dir": "a/b"}, "not a plain file name"),
        ({"pending_dir": PENDING, "final_dir": PENDING[:-1] + "0"}, "has a temporary name"),
        ({"pending_dir": PENDING, "final_dir": ".x.shmstage-tmp"}, "has a temporary name"),
        ({"pending_dir": PENDING}, "go together"),
        ({"final_dir": "c"}, "go together"),
    ],
)
def test_pending_and_final_directory_names_that_could_escape_are_refused(
    daemon, ckpt: Path, outside: Path, fields: dict, why: str
) -> None:
    baseline = daemon.fd_count()
    committer = Committer(daemon.socket)
    frame = committer.commit(pending_destination(ckpt), **fields)
    assert frame.body["code"] == "bad_request" and why in frame.body["message"], frame.body
    assert untouched(outside) and os.listdir(ckpt) == [PENDING]
    committer.raw.close()
    wait_for(lambda: daemon.fd_count() == baseline, 10, "the daemon's fds back to baseline")


def test_a_pending_directory_must_be_the_one_named(daemon, ckpt: Path, outside: Path) -> None:
    committer = Committer(daemon.socket)
    # The name in the parent is a symlink to the directory whose descriptor came.
    fds = pending_destination(ckpt / "a")
    os.rename(ckpt / "a" / PENDING, outside.parent / "moved")
    os.symlink(outside.parent / "moved", ckpt / "a" / PENDING)
    frame = committer.commit(fds, pending_dir=PENDING, final_dir="c")
    assert "is not the directory whose descriptor came" in frame.body["message"], frame.body
    # Three descriptors where a new directory needs four.
    fds = pending_destination(ckpt / "b")
    os.close(fds.pop(0))
    frame = committer.commit(fds, pending_dir=PENDING, final_dir="c")
    assert "needs 4 descriptors" in frame.body["message"], frame.body
    assert outside.read_bytes() == b"precious" and not (ckpt / "a" / "c").exists()


def test_a_final_name_already_there_is_refused_before_the_ack(daemon, ckpt: Path) -> None:
    committer = Committer(daemon.socket)
    (ckpt / "c").mkdir()
    (ckpt / "c" / "theirs").write_text("kept")
    frame = committer.commit(pending_destination(ckpt), pending_dir=PENDING, final_dir="c")
    assert frame.body["code"] == "exists" and "never overwrites" in frame.body["message"]
    assert os.listdir(ckpt / "c") == ["theirs"]
