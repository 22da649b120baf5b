"""Publishing to readers on the node: real daemon, real reader and publisher processes.

A trainer publishes versions of its state (``Stager.publish``); other processes follow the
channel (``subscribe``). Every version a reader sees is one step throughout, pinned
versions never change, versions come in increasing order, and a process that dies — reader
or publisher — leaves nothing behind that anyone could see half-made.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RunningDaemon, start_daemon, wait_for
from shmstage_client import (
    ChecksumError,
    DaemonRefused,
    NoNewVersion,
    SlotUnavailable,
    Stager,
    load,
    subscribe,
)

from shmstage.control import ControlClient

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from channel_worker import state_of, uniform  # noqa: E402


@pytest.fixture(scope="module")
def daemon_for_channels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    running = start_daemon(tmp_path_factory.mktemp("channels-daemon"))
    yield running
    running.discard()


@pytest.fixture(scope="module")
def forks() -> Any:
    """Worker processes forked from one server that imported torch once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["channel_worker"])
    return context


@pytest.fixture
def socket(daemon_for_channels: RunningDaemon) -> str:
    return str(daemon_for_channels.socket)


def worker(
    forks: Any, role: str, *args: Any
) -> tuple[multiprocessing.process.BaseProcess, multiprocessing.connection.Connection]:
    """Start ``channel_worker.<role>``; its process and the end it tells things on."""
    import channel_worker

    ours, theirs = forks.Pipe()
    process = forks.Process(target=getattr(channel_worker, role), args=(*args, theirs))
    process.start()
    theirs.close()
    return process, ours


def heard(told: multiprocessing.connection.Connection, timeout: float = 60) -> Any:
    assert told.poll(timeout), "the worker said nothing in time"
    return told.recv()


def test_readers_see_whole_versions_in_increasing_order_while_a_publisher_runs_flat_out(
    forks: Any, socket: str, name: str
) -> None:
    """They follow the channel before its first version (the owner's own channel)."""
    final = 40
    readers = [worker(forks, "reader", socket, name, final) for _ in range(3)]
    for _process, told in readers:
        assert heard(told) == "following"
    with Stager(socket, slots=3) as stager:
        for step in range(final + 1):
            stager.publish(state_of(step), name, step=step)
        results = [heard(told) for _process, told in readers]
    for process, _told in readers:
        process.join(30)
        assert process.exitcode == 0
    for seen in results:
        assert seen["torn"] == [], f"versions seen mixing two steps: {seen['torn']}"
        assert seen["seen"] == sorted(set(seen["seen"])), "not in strictly increasing order"
        assert seen["seen"][-1] == final


def test_a_pinned_version_stays_unchanged_while_newer_ones_are_published(
    socket: str, name: str
) -> None:
    with Stager(socket, slots=2) as stager, subscribe(name, socket=socket) as subscriber:
        stager.publish(state_of(1), name, step=1)
        with subscriber.wait(timeout=10) as first:
            for step in range(2, 8):
                stager.publish(state_of(step), name, step=step)
            assert uniform(first.state(verify=True), 1) and first.verified
            assert uniform(first.state(verify=False), 1) and not first.verified
            assert dict(first.tensors())["w"].eq(1).all() and first.verified  # had them
            with subscriber.wait(newer_than=1, timeout=10) as newest:
                assert newest.step == 7 and uniform(newest.state(), 7)
                assert newest.metadata == {}
            assert first.pinned
        assert not first.pinned and not first.close(), "closed once, by the with block"


def test_wait_wakes_when_the_version_is_published_and_times_out_without_one(
    socket: str, name: str
) -> None:
    with Stager(socket) as stager, subscribe(name, socket=socket) as subscriber:
        started = time.monotonic()
        with pytest.raises(NoNewVersion, match="no version of channel"):
            subscriber.wait(timeout=0.3)
        assert 0.3 <= time.monotonic() - started < 2
        published = stager.publish(state_of(4), name, step=4, metadata={"run": "a"})
        assert published.subscribers == 1 and published.timings.stall_seconds > 0
        with subscriber.wait(newer_than=3, timeout=5) as version:
            assert (version.step, version.metadata) == (4, {"run": "a"})
        with pytest.raises(DaemonRefused, match=r"step 4 of channel .* is not newer than"):
            stager.publish(state_of(4), name, step=4)
        stager.publish(state_of(5), name, step=5)  # the refused publish gave its slot back


def test_a_killed_reader_releases_its_pins_and_the_publisher_gets_its_slot(
    forks: Any, socket: str, name: str
) -> None:
    with Stager(socket, slots=1, wait_for_slot=False) as stager:
        stager.publish(state_of(1), name, step=1)
        holder, told = worker(forks, "holder", socket, name)
        try:
            assert heard(told) == 1  # pinned
            with pytest.raises(SlotUnavailable, match="leased by readers"):
                stager.publish(state_of(2), name, step=2)
        finally:
            holder.kill()
            holder.join(10)

        def published() -> bool:
            try:
                stager.publish(state_of(2), name, step=2)
            except SlotUnavailable:
                return False
            return True

        wait_for(published, 5, "the killed reader's pin to end")


def test_a_killed_reader_waiting_in_a_held_pin_leaves_nothing_held_or_pinned(
    forks: Any, socket: str, name: str
) -> None:
    """SIGKILLed while the daemon holds its pin request: the request dies with its
    connection, or the pin the version took for it just then does."""
    with Stager(socket, slots=1, wait_for_slot=False) as stager:
        waiter, told = worker(forks, "waiter", socket, name)
        try:
            assert heard(told) == "held"
        finally:
            waiter.kill()
        stager.publish(state_of(1), name, step=1)  # before or after the daemon saw it go
        waiter.join(10)

        def gone() -> bool:
            with ControlClient(socket) as control:
                channels = control.status()["channels"]
            (channel,) = [channel for channel in channels if channel["name"] == name]
            return channel["subscribers"] == channel["pins"] == 0

        wait_for(gone, 10, "the killed reader's subscription and pins to end")
        # one slot: a pin left behind would refuse this at once (SlotUnavailable)
        assert stager.publish(state_of(2), name, step=2).subscribers == 0


def test_a_publisher_killed_before_it_published_exposes_nothing_of_that_copy(
    forks: Any, socket: str, name: str, daemon_for_channels: RunningDaemon
) -> None:
    with subscribe(name, socket=socket) as subscriber:
        dier, told = worker(forks, "dier", socket, name)
        heard(told)  # step 2 is filled, unpublished
        with subscriber.wait(timeout=10) as version:
            assert version.step == 1
            dier.kill()  # SIGKILL
            dier.join(10)
            with pytest.raises(NoNewVersion):
                subscriber.wait(newer_than=1, timeout=0.5)
            assert uniform(version.state(), 1), "a pinned version outlives its publisher"
        with pytest.raises(NoNewVersion):  # its layout went with it: nothing left to pin
            subscriber.wait(timeout=0.5)
    log = daemon_for_channels.log()
    assert "internal error" not in log


def test_save_with_publish_publishes_the_committed_copy_without_a_second_one(
    socket: str, name: str, tmp_path: Path
) -> None:
    with Stager(socket) as stager, subscribe(name, socket=socket) as subscriber:
        handle = stager.save(state_of(9), tmp_path / "step-9", metadata={"step": 9}, publish=name)
        with subscriber.wait(timeout=10) as version:
            assert version.step == 9 and version.metadata == {"step": 9}
            assert uniform(version.state(), 9)
        handle.wait(30)
        assert uniform(load(tmp_path / "step-9"), 9)
        with subscriber.wait(timeout=10) as version:  # durable now: the job's checksums
            assert uniform(version.state(), 9) and version.verified
            assert uniform(version.state(verify=False), 9) and not version.verified
        with pytest.raises(ValueError, match="needs block=True"):
            stager.save(state_of(10), tmp_path / "x", metadata={"step": 10}, publish=name,
                        block=False)  # fmt: skip
        with pytest.raises(TypeError, match="a version's step is an int"):
            stager.save(state_of(10), tmp_path / "y", publish=name)


def test_tensors_stream_in_buckets_of_their_own_and_a_new_structure_starts_a_new_ring(
    socket: str, name: str
) -> None:
    with Stager(socket) as stager, subscribe(name, socket=socket) as subscriber:
        stager.publish(state_of(3), name, step=3)
        with subscriber.wait(timeout=10) as version:
            streamed = list(version.tensors(bucket_bytes=16 << 10))
            specs = version.specs
        assert [key for key, _ in streamed] == ["w", "layers.0", "layers.1"]
        assert specs == [
            ("w", torch.float32, (256, 256), 256 * 256 * 4),
            ("layers.0", torch.int64, (1000,), 8000),
            ("layers.1", torch.float32, (7,), 28),
        ], "in the order tensors() yields them"
        assert all(bool((tensor == 3).all()) for _, tensor in streamed)
        storages = {tensor.untyped_storage().data_ptr() for _, tensor in streamed}
        assert len(storages) == 2  # w alone (over the bucket); the two small ones together
        other = {"head": torch.arange(10, dtype=torch.float64), "step": 4}
        stager.publish(other, name, step=4)
        with subscriber.wait(newer_than=3, timeout=10) as version:
            state = version.state()
        assert torch.equal(state["head"], other["head"]) and state["step"] == 4


def test_a_non_blocking_publish_becomes_visible_once_its_guarded_copy_landed(
    socket: str, name: str
) -> None:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Stager(socket) as stager, subscribe(name, socket=socket) as subscriber:
        stager.guard(optimizer)
        expected = {key: value.clone() for key, value in model.state_dict().items()}
        published = stager.publish(model.state_dict(), name, step=1, block=False)
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()  # waits for the copy: the version is the state before this step
        published.visible(30)
        assert published.landing is not None and published.subscribers is None
        with subscriber.wait(timeout=10) as version:
            state = version.state()
        assert all(torch.equal(state[key], expected[key]) for key in expected)


def test_a_saved_and_published_version_stays_readable_while_the_daemon_retains_its_layout(
    forks: Any, socket: str, name: str, tmp_path: Path
) -> None:
    """A trainer that dies leaves its layout retained (it holds an acknowledged checkpoint):
    the version published from that save is still there for readers."""
    saver, told = worker(forks, "saver", socket, name, str(tmp_path / "step-3"))
    assert heard(told) == "saved"
    saver.kill()
    saver.join(10)
    with subscribe(name, socket=socket) as subscriber, subscriber.wait(timeout=10) as version:
        assert version.step == 3 and uniform(version.state(), 3)


def test_a_byte_written_into_a_published_slot_is_caught_by_a_reader_that_verifies(
    socket: str, name: str
) -> None:
    """The fault is caused for real: a process holding the slot's segments writable writes
    into a published version — here its own publisher, through the mapping it copied into,
    after publish() returned (the pin keeps the daemon from refilling a slot, not a writer
    from writing). The daemon checksummed the version once it was visible; a reader that
    verifies names the tensor, one that does not copies the written byte."""
    with Stager(socket, slots=1) as stager, subscribe(name, socket=socket) as subscriber:
        stager.publish(state_of(5), name, step=5)
        with subscriber.wait(timeout=10) as version:
            assert uniform(version.state(verify=True), 5) and version.verified  # they came
            assert stager._layouts.current is not None
            written = stager._layouts.current.slots[0][0]  # tensor "w" in the one slot
            assert written.shape == (256, 256) and bool((written == 5).all())
            written[3, 17] = 99.0
            with pytest.raises(ChecksumError, match="tensor 'w' in version 5"):
                version.state()  # "if-ready": it has them, so it verifies
            with pytest.raises(ChecksumError, match="tensor 'w' in version 5"):
                list(version.tensors(bucket_bytes=16 << 10, verify=True))
            state = version.state(verify=False)
            assert not version.verified and state["w"][3, 17] == 99.0
            assert bool((state["layers"][0] == 5).all())


def test_a_readers_connection_is_sent_a_versions_tree_only_when_it_changed(
    socket: str, name: str
) -> None:
    """At 10,000 tensors decoding the tree took a reader ~45 ms per version: the daemon
    sends it only when it is not the one the connection was sent last."""
    weights = {"w": torch.ones(16)}
    with Stager(socket) as stager, subscribe(name, socket=socket) as subscriber:
        sent: list[bool] = []
        ring_for = subscriber._ring_for

        def spy(pinned: dict[str, Any]) -> Any:  # what each "pinned" answer carried
            sent.append("tree" in pinned)
            return ring_for(pinned)

        subscriber._ring_for = spy  # type: ignore[method-assign]
        step = None
        for step_now, lr in ((1, 0.1), (2, 0.1), (3, 0.2), (4, 0.2)):
            stager.publish({**weights, "lr": lr}, name, step=step_now)
            with subscriber.wait(newer_than=step, timeout=10) as version:
                state = version.state()
                assert state["lr"] == lr and torch.equal(state["w"], weights["w"])
                step = version.step
        assert sent == [True, False, True, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_version_verified_onto_a_gpu_is_bit_exact_and_a_written_byte_is_caught_there(
    socket: str, name: str
) -> None:
    """To a GPU a verified copy is the ring's DMA, then a check in place (the same fault
    as above, written through the publisher's own mapping)."""
    with Stager(socket, slots=1) as stager, subscribe(name, socket=socket) as subscriber:
        stager.publish(state_of(6), name, step=6)
        with subscriber.wait(timeout=10) as version:
            state = version.state("cuda", verify=True)
            assert version.verified and state["w"].is_cuda and uniform(
                {**state, "w": state["w"].cpu(), "layers": [t.cpu() for t in state["layers"]]}, 6
            )
            streamed = dict(version.tensors("cuda", bucket_bytes=16 << 10, verify=True))
            assert version.verified and bool((streamed["w"] == 6).all())
            assert stager._layouts.current is not None
            stager._layouts.current.slots[0][1][999] = -1  # tensor "layers.0"
            with pytest.raises(ChecksumError, match=r"tensor 'layers\.0' in version 6"):
                version.state("cuda")
