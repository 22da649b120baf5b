"""Fuzzing the daemon over its real socket, while a well-behaved client keeps saving.

Hypothesis generates sessions of hostile frames: wrong types, huge and zero lengths, deep
nesting, unknown operations, operations in the wrong order, descriptors where none are
expected and none where they are, and frames that are almost right (valid envelopes with
plausible ids, names and layouts) so the fuzz reaches past the parser into registration,
slots and commits. Atheris, when installed, mutates raw bytes with coverage guidance from
the very protocol parser the daemon runs (``atheris_frames.py``).

Throughout, a real Stager saves, mutates its tensors right after each save returns, and
checks every checkpoint equals what it saved. Afterwards the daemon must be alive, its
descriptor count back to its baseline and no segment of its left.

Frame budget: ``SHMSTAGE_FUZZ_FRAMES`` in total across the two fuzz tests (hypothesis gets
half of it when atheris is available, all of it otherwise: atheris sends ten times the
frames a second, hypothesis spends its time drawing examples). CI runs the default (6,000
frames); the full run is ``SHMSTAGE_FUZZ_FRAMES=100000``. Both fuzzers start from a new
seed each run, so that runs together cover more than one does: hypothesis by itself (no
example database), atheris from ``SHMSTAGE_FUZZ_SEED`` when set, else a random one that
the test prints and a failure names.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_helpers import assert_checkpoint_equals, make_state
from fuzzing import (
    COMMIT_FDS,
    DATA_TMP,
    FD_KINDS,
    LAYOUT,
    MANIFEST_TMP,
    SLOT,
    TREE,
    FuzzConnection,
    encode,
    open_fds,
)
from harness import wait_for
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from shmstage_client import Stager

from shmstage.layout import DTYPE_SIZES

TOTAL_FRAMES = int(os.environ.get("SHMSTAGE_FUZZ_FRAMES", "6000"))
HAVE_ATHERIS = importlib.util.find_spec("atheris") is not None
HYPOTHESIS_SHARE = 1 / 2 if HAVE_ATHERIS else 1.0
ATHERIS_SEED = int(os.environ.get("SHMSTAGE_FUZZ_SEED", "0")) or random.randrange(1, 2**31)
WALL_LIMIT_S = float(os.environ.get("SHMSTAGE_FUZZ_SECONDS", "1800"))
#: pytest's per-test timeout (the suite's 300 s) would cut the full run short: these
#: tests bound themselves by WALL_LIMIT_S, plus the time to check the daemon afterwards.
within_wall_limit = pytest.mark.timeout(WALL_LIMIT_S + 180)


# -- strategies ----------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), inner, max_size=4),
    max_leaves=10,
)
names = st.sampled_from(
    [
        "model.safetensors",
        DATA_TMP,
        MANIFEST_TMP,
        "../evil.safetensors",
        "/etc/evil.safetensors",
        "a/b.safetensors",
        "..",
        "",
        "shmstage-manifest.json",
    ]
) | st.text(max_size=16)
tensor_entry = st.lists(
    st.one_of(
        st.text(min_size=1, max_size=6),
        st.sampled_from([*DTYPE_SIZES, "F4", "x"]),
        st.lists(st.integers(0, 16), max_size=3),
        st.none() | st.lists(st.integers(-1, 8), max_size=3),
    ),
    min_size=4,
    max_size=4,
) | st.builds(
    lambda k, d, s: [k, d, s, None],
    st.sampled_from(["k0", "k1", "w"]),
    st.sampled_from(list(DTYPE_SIZES)),
    st.lists(st.integers(0, 8), max_size=2),
)
trees = st.sampled_from(
    [None, {"T": "k0"}, {"d": [["w", {"T": "w"}]]}, {"l": [{"T": "k1"}]}, {"f": "nan"}]
) | values
seconds = st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5)

FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "version": st.just(1) | st.integers(-(2**63), 2**64 - 1),
    "client": st.text(max_size=10),
    "pid": st.integers(0, 2**31),
    "tensors": st.lists(tensor_entry, max_size=4),
    "slots": st.integers(-1, 10),
    "layout": st.integers(0, 6),
    "slot": st.integers(-1, 3),
    "wait": st.booleans(),
    "timeout": st.none() | st.floats(-1, 0.3) | st.sampled_from([float("nan"), float("inf")]),
    "data_file": names,
    "data_tmp": names,
    "manifest_tmp": names,
    "tree": trees,
    "metadata": st.dictionaries(st.text(max_size=6), values, max_size=3),
    "file_metadata": st.dictionaries(st.text(max_size=6), st.text(max_size=6) | values),
    "stage_seconds": seconds,
    "slot_wait_seconds": seconds,
    "stall_seconds": seconds,
    "copy_seconds": seconds,
    "job": st.integers(-1, 10),
    "max_fds": st.integers(-1, 300),
    "status": values,
    "limits": values,
}
OPS: dict[str, list[str]] = {
    "hello": ["version", "client", "pid"],
    "register": ["tensors", "slots", "max_fds"],
    "acquire": ["layout", "wait", "timeout"],
    "cancel": ["layout", "slot"],
    "commit": ["layout", "slot", "data_file", "data_tmp", "manifest_tmp", "tree", "metadata",
               "file_metadata", "stage_seconds", "slot_wait_seconds"],
    "release": ["layout"],
    "report": ["job", "stall_seconds", "copy_seconds"],
    "status": [],
    "metrics": [],
    "welcome": ["version", "limits"],  # a daemon's op, from a client
    "error": ["status"],
    "job_done": ["status"],
}  # fmt: skip


valid_tensor = st.builds(
    lambda k, d, s, o: [k, d, s, o if o is None or len(o) == len(s) else None],
    st.text(min_size=1, max_size=4),
    st.sampled_from(list(DTYPE_SIZES)),
    st.lists(st.integers(0, 6), max_size=2),
    st.none() | st.lists(st.integers(0, 4), max_size=2),
)
def mostly(right: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``right`` four times in five (hypothesis weighs one_of branches evenly)."""
    return st.integers(0, 4).flatmap(lambda i: right if i else other)


PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "tensors": st.lists(valid_tensor, min_size=1, max_size=3, unique_by=lambda t: t[0]),
    "slots": st.integers(1, 2),
    "layout": mostly(st.just(LAYOUT), st.sampled_from([0, 10**6])),
    "slot": mostly(st.just(SLOT), st.sampled_from([1, 7, -1])),
    "wait": st.booleans(),
    "timeout": st.sampled_from([0.0, 0.05, 0.2]),
    "data_file": mostly(st.just("model.safetensors"), names),
    "data_tmp": mostly(st.just(DATA_TMP), names),
    "manifest_tmp": mostly(st.just(MANIFEST_TMP), names),
    "tree": mostly(st.just(TREE), st.sampled_from([None, {"T": "nope"}, {"l": []}]) | trees),
    "metadata": st.dictionaries(st.text(max_size=4), st.integers(-9, 9) | st.text(max_size=4)),
    "file_metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
    "stage_seconds": st.floats(0, 10),
    "slot_wait_seconds": st.floats(0, 10),
    "stall_seconds": st.floats(0, 10),
    "copy_seconds": st.floats(0, 10),
    "job": st.integers(0, 6),
    "max_fds": st.integers(1, 253),
}
#: Weighted towards the ops that lead somewhere: register, acquire, commit.
CLIENT_OPS = [
    *["register"] * 2,
    *["acquire", "commit"] * 3,
    *["cancel", "release", "status", "metrics", "report"],
]
#: Ops the daemon answers at once (acquire only when it need not wait for a slot).
ANSWERED_AT_ONCE = {"register", "cancel", "commit", "release", "status", "metrics"}


@st.composite
def plausible_frame(
    draw: st.DrawFn, op: str | None = None
) -> tuple[dict[str, Any], list[str], bool]:
    """A well-formed request with values that may be right for this session — or not quite:
    the fuzz then reaches registration, slots, commits and the writer, in any order."""
    op = op or draw(st.sampled_from(CLIENT_OPS))
    message: dict[str, Any] = {"op": op, "id": draw(st.integers(1, 1000)), "nfds": 0}
    optional = ("stage_seconds", "slot_wait_seconds", "file_metadata", "metadata", "max_fds")
    for name in OPS[op]:
        if name not in optional or draw(st.booleans()):
            message[name] = draw(PLAUSIBLE[name])
    kinds: list[str] = []
    if op == "commit":
        kinds = [COMMIT_FDS] if draw(st.integers(0, 5)) else draw(
            st.lists(st.sampled_from(FD_KINDS), max_size=3)
        )
        message["nfds"] = 3 if kinds == [COMMIT_FDS] else len(kinds)
    answer = op in ANSWERED_AT_ONCE or (op == "acquire" and message.get("wait") is False)
    return message, kinds, answer


@st.composite
def structured_frame(draw: st.DrawFn) -> tuple[dict[str, Any], list[str], None]:
    """An envelope that is usually well-formed, with fields usually of the right type."""
    op = draw(st.sampled_from(list(OPS)) | st.text(max_size=8) | values)
    message: dict[Any, Any] = {}
    if draw(st.integers(0, 9)):
        message["op"] = op
    if draw(st.integers(0, 9)):
        message["id"] = draw(st.integers(0, 50) | values)
    for name in OPS.get(op, []) if isinstance(op, str) else []:
        if draw(st.integers(0, 9)):  # sometimes missing
            message[name] = draw(FIELDS[name] if draw(st.integers(0, 4)) else values)
    if not draw(st.integers(0, 6)):  # an unknown field
        message[draw(st.text(max_size=6))] = draw(values)
    kinds = draw(st.lists(st.sampled_from(FD_KINDS), max_size=4))
    if op == "commit" and draw(st.booleans()):
        kinds = ["dir", "file", "file"]
    declared = draw(st.sampled_from([len(kinds), len(kinds), 0, 3, 253, 254, -1]) | values)
    message["nfds"] = declared
    return message, kinds, None  # None: hostile, never waited on


@st.composite
def raw_frame(draw: st.DrawFn) -> tuple[bytes, list[str], bool]:
    """Bytes no well-behaved peer would send."""
    kind = draw(st.integers(0, 6))
    if kind == 0:  # a length prefix promising far more than will ever come (or is allowed)
        return struct.pack(">I", draw(st.sampled_from([2**31, 2**32 - 1, 33 << 20, 0]))), [], False
    if kind == 1:  # random payload, honest length
        payload = draw(st.binary(min_size=1, max_size=64))
        return struct.pack(">I", len(payload)) + payload, [], False
    if kind == 2:  # deep nesting inside an otherwise valid map
        depth = draw(st.integers(1, 5000))
        payload = b"\x83\xa2op\xa5hello\xa2id\x01\xa7version" + b"\x91" * depth + b"\xc0"
        return struct.pack(">I", len(payload)) + payload, [], False
    if kind == 3:  # not a map at all
        return encode(draw(values)), draw(st.lists(st.sampled_from(FD_KINDS), max_size=2)), False
    if kind == 4:  # a truncated frame (the rest never comes)
        whole = encode({"op": "status", "id": 1, "nfds": 0})
        return whole[: draw(st.integers(1, len(whole) - 1))], [], False
    if kind == 5:  # descriptors with no frame to claim them
        return b"", ["pipe"] * draw(st.integers(1, 6)), False
    return draw(st.binary(min_size=1, max_size=32)), [], False


# Plausible frames, so a session lives long enough to reach deep states, and at most one
# hostile frame (which usually ends the session) somewhere among them.
session = st.tuples(
    st.booleans() | st.just(True),  # greet first (mostly)
    st.builds(
        lambda first, rest: first + rest,
        st.lists(plausible_frame("register"), max_size=1),  # often registered from the start
        st.lists(plausible_frame(), max_size=30),
    ),
    st.none() | structured_frame() | raw_frame(),
    st.floats(0, 1),  # where the hostile frame goes
)


# -- the run --------------------------------------------------------------------------


class GoodClient(threading.Thread):
    """Saves through the fuzz, mutating tensors right after each save returns."""

    def __init__(self, socket: Path, root: Path) -> None:
        super().__init__(daemon=True)
        self.socket, self.root = socket, root
        self.stop = threading.Event()
        self.saves = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Stager(self.socket, slots=2) as stager:
                while not self.stop.is_set():
                    seed = self.saves
                    state = make_state(seed, numel=256 + seed % 7, tensors=1 + seed % 3)
                    path = self.root / f"good-{seed}"
                    handle = stager.save(state, path)
                    for tensor in state["layers"]:
                        tensor.add_(1.0)
                    handle.wait(60)
                    assert_checkpoint_equals(path, make_state(seed, numel=256 + seed % 7,
                                                              tensors=1 + seed % 3))
                    shutil.rmtree(path)  # verified; keep the disk bounded over a long fuzz
                    self.saves += 1
        except BaseException as exc:
            self.error = exc

#: Fuzz sessions that reach an acknowledged commit and vanish leave their layout retained
#: for a restart (``retention``), fuzzed like the rest; it is given back a second later, so
#: that "no segment left" still holds at the end.
RETAIN_BRIEFLY = ("--retain-ttl", "1")


def run_session(sock: Path, scratch: Path, greet: bool, frames: list) -> int:
    connection = FuzzConnection(sock)
    try:
        if greet:
            connection.request({"op": "hello", "id": 0, "nfds": 0, "version": 2,
                                "client": "fuzz", "pid": os.getpid()}, [], answer=True)  # fmt: skip
            connection.frames_sent -= 1
        for item, kinds, answer in frames:
            fds = open_fds(kinds, scratch)
            if isinstance(item, bytes):
                alive = connection.hostile(item, fds)
            else:
                connection.tainted |= answer is None  # a hostile message
                alive = connection.request(item, fds, answer=bool(answer))
            if not alive:
                break
        connection.probe(request_id=10**6)
        return connection.frames_sent
    finally:
        connection.close()


@within_wall_limit
def test_hypothesis_fuzz_over_the_socket(daemons, tmp_path: Path) -> None:
    daemon = daemons(*RETAIN_BRIEFLY)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for name in (DATA_TMP, MANIFEST_TMP):
        (scratch / name).touch()
    good = GoodClient(daemon.socket, tmp_path)
    good.start()
    wait_for(lambda: good.saves > 0 or good.error, 60, "the good client's first save")
    baseline = daemon.fd_count()
    target = int(TOTAL_FRAMES * HYPOTHESIS_SHARE)
    sent = 0

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        # Each example is real I/O against one long-lived daemon: shrinking would replay
        # thousands of sessions (minutes) and change the daemon under it. Report as found.
        phases=[Phase.generate],
    )
    @given(session)
    def fuzz(example: tuple[bool, list, Any, float]) -> None:
        nonlocal sent
        greet, frames, hostile, where = example
        if hostile is not None:
            frames.insert(round(where * len(frames)), hostile)
        sent += run_session(daemon.socket, scratch, greet, frames)
        assert daemon.proc.poll() is None, f"shmstaged died:\n{daemon.log()[-3000:]}"

    started = time.monotonic()
    while sent < target and time.monotonic() - started < WALL_LIMIT_S:
        fuzz()
    elapsed = time.monotonic() - started
    good.stop.set()
    good.join(120)
    print(f"\nhypothesis: {sent} frames in {elapsed:.1f} s; good client saved {good.saves}")
    (tmp_path.parent / "fuzz-frames-hypothesis.txt").write_text(f"{sent}\n")
    assert good.error is None, good.error
    assert sent >= target, f"only {sent} of {target} frames in {WALL_LIMIT_S} s"
    assert daemon.proc.poll() is None
    # Every fuzz connection is closed: the daemon holds what it held before, no more.
    wait_for(lambda: daemon.fd_count() <= baseline, 30, "the daemon's fds back to baseline")
    wait_for(lambda: daemon.segments() == [], 30, "no segment left")
    assert "Traceback" not in daemon.log(), daemon.log()[-5000:]


@within_wall_limit
@pytest.mark.skipif(not HAVE_ATHERIS, reason="atheris is not installed (no wheel here)")
def test_atheris_fuzz_over_the_socket(daemons, tmp_path: Path) -> None:
    daemon = daemons(*RETAIN_BRIEFLY)
    runs = TOTAL_FRAMES - int(TOTAL_FRAMES * HYPOTHESIS_SHARE)
    with Stager(daemon.socket) as stager:  # a layout and a job exist while it runs
        state = make_state(1)
        handle = stager.save(state, tmp_path / "before")
        baseline = daemon.fd_count()
        done = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("atheris_frames.py")),
             str(daemon.socket), f"-runs={runs}", "-max_len=2048", f"-seed={ATHERIS_SEED}",
             f"-artifact_prefix={tmp_path}/"],
            capture_output=True, text=True, timeout=WALL_LIMIT_S,
        )  # fmt: skip
        again = f"(SHMSTAGE_FUZZ_SEED={ATHERIS_SEED} repeats this run)"
        assert done.returncode == 0, f"{again}\n{done.stderr[-5000:]}"
        assert f"atheris: {runs} inputs" in done.stdout, f"{again}\n{done.stdout[-2000:]}"
        print("\n" + done.stdout.strip().splitlines()[-1], again)
        handle.wait(60)
        torch.manual_seed(0)
        stager.save(make_state(2), tmp_path / "after").wait(60)
    assert_checkpoint_equals(tmp_path / "before", make_state(1))
    assert_checkpoint_equals(tmp_path / "after", make_state(2))
    assert daemon.proc.poll() is None
    wait_for(lambda: daemon.fd_count() <= baseline, 30, "the daemon's fds back to baseline")
    wait_for(lambda: daemon.segments() == [], 30, "no segment left")
    assert "Traceback" not in daemon.log(), daemon.log()[-5000:]
