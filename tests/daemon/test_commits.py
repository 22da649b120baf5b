"""The commit handler's rules, driven with no socket and no daemon process (h11 style).

``Commits`` is built here as the daemon builds it for a session, with the few things it
uses: a real ``Store`` (the slots and the user's books), real descriptors of a real
checkpoint directory (the destination checks run for real), and stand-ins for the rest:

- ``Replies`` stands for the session: who the client is, and what it was answered.
- ``Journal`` stands for the journal's side (``owed.Owed``), whose files the daemon writes
  in a thread of its own; ``Writers`` for the writer pool (``jobs.Jobs``), where a job
  would stream the slot to disk. Each records what the handler asked of it.

That is not mocking a fault: no failure is faked to make a test pass, except the one
journal that cannot be written (``Journal(fails=...)``), which stands for a full journal
filesystem. The stand-ins exist because the handler is built from narrow collaborators;
the real journal and writers are exercised end to end in tests/faults and tests/client.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
from shmstage_daemon import commits, requests, treediff
from shmstage_daemon.admission import Peer
from shmstage_daemon.commits import Commits
from shmstage_daemon.requests import RequestError
from shmstage_daemon.slot import SlotState
from shmstage_daemon.store import Limits, StagedLayout, Store, StoreError
from shmstage_daemon.telemetry import Telemetry

from shmstage import names, tree
from shmstage.layout import Layout, TensorSpec
from shmstage.manifest import MANIFEST_NAME
from shmstage.protocol import ErrorCode, Frame, Packed
from shmstage.segment import SegmentRef

SESSION = 7
PEER = Peer(pid=os.getpid(), uid=os.getuid(), gid=os.getgid(), groups=frozenset())
LAYOUT = Layout((TensorSpec("w", "F32", (1024,)),))


class Replies:
    """Stands for the session the handler answers on."""

    id = SESSION
    peer = PEER
    client_name = "trainer"

    def __init__(self) -> None:
        self.open = True
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def send(self, op: str, request_id: int, body: dict[str, Any], fds: Any = ()) -> None:
        self.sent.append((op, body))

    def describe(self) -> str:
        return f"client {SESSION} (trainer)"


class Journal:
    """Stands for the journal's side (``owed.Owed``): which entries exist, in which state."""

    def __init__(self, fails: OSError | None = None) -> None:
        self.fails = fails
        self.entries: dict[int, str] = {}
        self.journal = SimpleNamespace(directory=Path("/dev/shm/shmstage.test.journal"))

    def charge(self, job_id: int, session_id: int, nbytes: int) -> None:
        pass

    async def commit(self, persist: Any, wire: Any, peer: Peer, *, owed: bool = True) -> None:
        if self.fails is not None:
            raise self.fails
        self.entries[persist.id] = "owed" if owed else "pending"

    async def publish(self, job_id: int) -> None:
        self.entries[job_id] = "owed"

    def discard(self, job_id: int) -> None:
        self.entries.pop(job_id, None)


class Writers:
    """Stands for the writer pool (``jobs.Jobs``): which jobs were started."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.started: list[int] = []

    def start(self, session: Any, staged: StagedLayout, slot: Any, persist: Any) -> None:
        self.started.append(persist.id)

    def abandon(self, session_id: int, staged: StagedLayout, slot: Any, job_id: int) -> None:
        self.store.abort_job(session_id, staged, slot, job_id)


class Bench:
    """One session's commit handler, a layout of one slot, and a checkpoint directory."""

    def __init__(self, tmp_path: Path, journal: Journal | None = None, **limits: int) -> None:
        self.store = Store(Limits(shm_budget_bytes=1 << 30, **limits))
        self.store.open_session(SESSION, PEER.uid)
        self.staged = self.store.add(SESSION, LAYOUT, [[SegmentRef("/seg0", 4096)]], 4096)
        self.slot = self.staged.slots[0]
        self.replies = Replies()
        self.journal = journal or Journal()
        self.writers = Writers(self.store)
        self.remembered: list[int] = []
        self.background: list[asyncio.Future[Any]] = []
        self.directory = tmp_path / "ckpt"
        self.directory.mkdir()

        async def run_io(fn: Callable[..., Any], *args: Any) -> Any:
            return fn(*args)  # inline: the test has no other work for the loop meanwhile

        retention = SimpleNamespace(
            remember=lambda staged, slot, held: self.remembered.append(held.job)
        )
        self.commits = Commits(
            self.replies,  # type: ignore[arg-type]
            self.store,
            retention,  # type: ignore[arg-type]
            Telemetry(),
            SimpleNamespace(fsync=False),  # type: ignore[arg-type]
            self.journal,  # type: ignore[arg-type]
            self.writers,  # type: ignore[arg-type]
            run_io=run_io,
            track=self.background.append,
        )

    def frame(self, op: str = "commit", **body: Any) -> Frame:
        """A commit into the checkpoint directory, with fresh temporary files."""
        if op != "commit":
            return Frame(op, 2, body)
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        data_tmp = names.temp_name("model.safetensors")
        manifest_tmp = names.temp_name(MANIFEST_NAME)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fds = (
            dir_fd,
            os.open(data_tmp, flags, 0o644, dir_fd=dir_fd),
            os.open(manifest_tmp, flags, 0o644, dir_fd=dir_fd),
        )
        fields = {
            "layout": self.staged.id,
            "slot": 0,
            "data_file": "model.safetensors",
            "data_tmp": data_tmp,
            "manifest_tmp": manifest_tmp,
            "tree": {"T": "w"},
        }
        return Frame("commit", 1, {**fields, **body}, fds, size=200)

    def answers(self) -> list[str]:
        return [op for op, _ in self.replies.sent]

    async def settled(self) -> None:
        """What the handler left running in the background (discarding files) is done."""
        await asyncio.gather(*self.background)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def test_a_commit_of_a_slot_the_client_does_not_hold_is_refused_and_journals_nothing(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        bench = Bench(tmp_path)  # the slot was never acquired
        with pytest.raises(StoreError) as refused:
            await bench.commits.commit(bench.frame())
        assert refused.value.code is ErrorCode.SLOT_NOT_OWNED
        assert "acquire it before you commit it" in refused.value.message
        assert bench.journal.entries == {} and bench.writers.started == []
        assert bench.answers() == [] and bench.slot.state is SlotState.FREE

    run(scenario)


def test_a_commit_is_journaled_as_owed_before_it_is_acknowledged_and_its_job_started(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        bench = Bench(tmp_path)
        bench.store.try_acquire(SESSION, bench.staged)
        await bench.commits.commit(bench.frame())
        job = bench.slot.job
        assert bench.journal.entries == {job: "owed"}
        assert bench.answers() == ["committed"] and bench.writers.started == [job]
        assert bench.remembered == [job]  # the slot's bytes are this checkpoint now
        assert bench.slot.state is SlotState.PERSISTING

    run(scenario)


def test_a_prepared_commit_holds_the_slot_until_its_ready_starts_the_job(tmp_path: Path) -> None:
    async def scenario() -> None:
        bench = Bench(tmp_path)
        bench.store.try_acquire(SESSION, bench.staged)
        await bench.commits.commit(bench.frame(ready=False))
        job = bench.slot.job
        assert bench.answers() == ["prepared"] and bench.writers.started == []
        assert bench.journal.entries == {job: "pending"}
        assert bench.slot.state is SlotState.PERSISTING  # out of everyone's reach
        assert bench.store.usage[PEER.uid].prepared == 1
        await bench.commits.ready(bench.frame("ready", job=job, layout=bench.staged.id, slot=0))
        assert bench.answers() == ["prepared", "committed"] and bench.writers.started == [job]
        assert bench.journal.entries == {job: "owed"}
        assert bench.store.usage[PEER.uid].prepared == 0

    run(scenario)


def test_a_prepared_commit_that_expires_gives_the_slot_back_and_its_files_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commits, "PREPARED_TIMEOUT_S", 0.05)

    async def scenario() -> None:
        bench = Bench(tmp_path)
        bench.store.try_acquire(SESSION, bench.staged)
        await bench.commits.commit(bench.frame(ready=False))
        job = bench.slot.job
        await asyncio.sleep(0.2)
        await bench.settled()
        assert (bench.slot.state, bench.slot.holder) == (SlotState.FILLING, SESSION)
        assert bench.journal.entries == {} and bench.writers.started == []
        assert bench.store.usage[PEER.uid].prepared == 0
        assert os.listdir(bench.directory) == []  # the temporary files it was given
        with pytest.raises(RequestError, match=f"no prepared commit {job}"):
            await bench.commits.ready(bench.frame("ready", job=job, layout=bench.staged.id, slot=0))

    run(scenario)


def test_a_cancelled_slot_drops_its_prepared_commit(tmp_path: Path) -> None:
    async def scenario() -> None:
        bench = Bench(tmp_path)
        bench.store.try_acquire(SESSION, bench.staged)
        await bench.commits.commit(bench.frame(ready=False))
        bench.commits.drop_prepared(bench.staged, bench.slot)
        await bench.settled()
        assert bench.slot.state is SlotState.FILLING and bench.journal.entries == {}
        assert bench.store.usage[PEER.uid].prepared == 0

    run(scenario)


def test_prepared_commits_past_max_prepared_are_refused_holding_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        bench = Bench(tmp_path, max_user_prepared=0)
        bench.store.try_acquire(SESSION, bench.staged)
        with pytest.raises(StoreError, match=r"would hold 1 prepared \(limit 0, max_prepared\)"):
            await bench.commits.commit(bench.frame(ready=False))
        assert bench.slot.state is SlotState.FILLING and bench.journal.entries == {}

    run(scenario)


def test_a_commit_the_journal_cannot_hold_is_refused_naming_it_and_the_slot_is_the_clients(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        bench = Bench(tmp_path, journal=Journal(fails=full))
        bench.store.try_acquire(SESSION, bench.staged)
        with pytest.raises(RequestError) as refused:
            await bench.commits.commit(bench.frame())
        await bench.settled()
        assert refused.value.code is ErrorCode.STORAGE
        assert "cannot journal the checkpoint (No space left on device) in " in str(refused.value)
        assert "/dev/shm/shmstage.test.journal; nothing was written" in str(refused.value)
        assert (bench.slot.state, bench.slot.holder) == (SlotState.FILLING, SESSION)
        assert bench.store.usage[PEER.uid].jobs == 0 and bench.writers.started == []

    run(scenario)


def test_a_commit_whose_tree_names_a_tensor_the_layout_lacks_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        bench = Bench(tmp_path)
        bench.store.try_acquire(SESSION, bench.staged)
        with pytest.raises(RequestError, match=r"tensors the layout does not have: \['v'\]"):
            await bench.commits.commit(bench.frame(tree={"T": "v"}))
        assert bench.slot.state is SlotState.FILLING and bench.journal.entries == {}

    run(scenario)


# -- the tree: decoded and checked once per layout and tree ------------------------------


def _packed(tree: object) -> Packed:
    return Packed(msgpack.packb(tree, use_bin_type=True))


def test_a_commit_of_the_tree_already_checked_decodes_nothing() -> None:
    layout = Layout.of([TensorSpec("w", "F32", (2,)), TensorSpec("b", "F32", (1,))])
    tree = {"d": [["w", {"T": "w"}], ["b", {"T": "b"}], ["lr", {"f": "0x1.0p-10"}]]}
    seen = requests.commit_tree(_packed(tree), layout, None)
    assert seen == (_packed(tree), tree)
    again = requests.commit_tree(_packed(tree), layout, seen)
    assert again is seen  # the same bytes: the decoded tree checked then, nothing decoded
    new_lr = {"d": [*tree["d"][:2], ["lr", {"f": "0x1.0p-11"}]]}
    assert requests.commit_tree(_packed(new_lr), layout, seen)[1] == new_lr


@pytest.mark.parametrize(
    ("tree", "code"),
    [
        ({"d": [["w", {"T": "w"}], ["x", {"T": "not-in-the-layout"}]]}, ErrorCode.BAD_REQUEST),
        ({"d": [["w", {"T": "w"}], ["lr", 0.5]]}, ErrorCode.BAD_REQUEST),  # a float untagged
        ({"d": [["w", {"T": "w"}], ["b", msgpack.ExtType(1, b"x")]]}, ErrorCode.BAD_FRAME),
    ],
)
def test_a_commit_of_another_tree_is_checked_whatever_was_checked_before(
    tree: object, code: ErrorCode
) -> None:
    layout = Layout.of([TensorSpec("w", "F32", (2,)), TensorSpec("b", "F32", (1,))])
    good = {"d": [["w", {"T": "w"}], ["b", {"T": "b"}]]}
    seen = requests.commit_tree(_packed(good), layout, None)
    with pytest.raises(RequestError) as info:
        requests.commit_tree(_packed(tree), layout, seen)
    assert info.value.code is code


class _Tensor:
    """A tensor leaf for ``tree.flatten`` (no torch in the daemon's tests)."""

    def __repr__(self) -> str:  # test ids must not differ between xdist workers
        return "Tensor()"


def _encoded(state: object) -> bytes:
    encoded, _ = tree.flatten(state, lambda value: isinstance(value, _Tensor))
    return msgpack.packb(encoded, use_bin_type=True)


def _training_state(**changes: object) -> dict:
    state = {
        "model": {f"w{i}": _Tensor() for i in range(50)},
        "optimizer": {
            "state": {i: {"step": _Tensor(), "exp_avg": _Tensor()} for i in range(50)},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": list(range(50))}],
        },
        "step": 10,
        "name": "run",
    }
    for path, value in changes.items():
        *parents, last = path.split("__")
        node: Any = state
        for part in parents:
            node = node[int(part) if part.isdigit() else part]
        node[int(last) if last.isdigit() else last] = value
    return state


@pytest.mark.parametrize(
    "changes",
    [
        {"step": 11},
        {"optimizer__param_groups__0__lr": 3e-4, "step": 12},
        {"optimizer__param_groups__0__lr": -0.0},
        {"step": True},  # a bool where an int was: the same under ==, not in the bytes
        {"step": 10.0},
        {"name": "another run"},
        {"optimizer__param_groups__0__params": list(range(51))},  # another count
        {"optimizer__param_groups__0__betas": [0.9, 0.99]},  # another tag
        {"model__w3": 5},  # a tensor became a plain value
        {"optimizer__state__7__extra": _Tensor()},  # a tensor the layout lacks
        {"model__w3": {"nested": [1, 2.5, None]}},
    ],
    ids=repr,
)
def test_a_changed_tree_decoded_in_part_is_what_a_whole_decoding_gives(changes: dict) -> None:
    """Whatever changed, the tree read against the previous one is the new one exactly
    (type for type: its encoding is the new bytes), or None and the whole check decides."""
    old = _encoded(_training_state())
    keys = frozenset(key for key, _ in tree.flatten(_training_state(), lambda v: isinstance(
        v, _Tensor))[1])  # fmt: skip
    old_tree = msgpack.unpackb(old, raw=False)
    new = _encoded(_training_state(**changes))
    result = treediff.patched(old, old_tree, new, keys)
    try:
        whole = msgpack.unpackb(new, raw=False)
        requests.check_tree(whole, Layout.of([TensorSpec(k, "F32", (1,)) for k in keys]))
    except RequestError:
        assert result is None
        return
    plain = all(not isinstance(v, _Tensor | dict | list | tuple) for v in changes.values())
    assert result is not None or not plain  # a plain value changed: read in part
    if result is not None:
        assert msgpack.packb(result, use_bin_type=True) == new
        if not any(path.startswith("model") for path in changes):
            assert result["d"][0][1] is old_tree["d"][0][1]  # the model: not decoded again


def test_a_changed_tree_with_a_raw_float_or_garbage_is_left_to_the_whole_check() -> None:
    old = _encoded(_training_state())
    old_tree = msgpack.unpackb(old, raw=False)
    keys = frozenset(f"model.w{i}" for i in range(50))
    raw_float = old.replace(msgpack.packb(10), msgpack.packb(10.0))  # "step": 10 -> 10.0
    assert raw_float != old
    assert treediff.patched(old, old_tree, raw_float, keys) is None
    assert treediff.patched(old, old_tree, old[:-3], keys) is None
    assert treediff.patched(old, old_tree, old + b"\xc0", keys) is None
