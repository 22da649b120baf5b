"""A subscriber that prepares: every slot of the channel's ring mapped (and, on a GPU,
registered) before its first version, so that the first version is copied as every later
one is. Real daemon, real publisher (a Stager), real mappings; CPU (``test_gpu`` checks
the registration on a device).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from harness import RunningDaemon, start_daemon
from shmstage_client import DaemonRefused, NoNewVersion, SaveError, Stager, subscribe

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from channel_worker import state_of, uniform  # noqa: E402


@pytest.fixture(scope="module")
def socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    running: RunningDaemon = start_daemon(tmp_path_factory.mktemp("prepare-daemon"))
    yield str(running.socket)
    running.discard()


def shm_mappings() -> int:
    """This process's mappings of shared memory segments (a ring's slots are some)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return sum(1 for line in lines if "/dev/shm/" in line)


def soon(act: Callable[[], object], delay: float = 0.3) -> threading.Thread:
    """``act`` on a thread of its own after ``delay`` seconds (a publisher's next step)."""

    def later() -> None:
        time.sleep(delay)
        act()

    thread = threading.Thread(target=later)
    thread.start()
    return thread


@pytest.mark.parametrize("ahead", ["offered before the first version", "at the first version"])
def test_a_subscriber_that_prepared_reads_its_first_version_from_the_prepared_slots(
    socket: str, name: str, ahead: str
) -> None:
    """Prepared while waiting for its publisher: woken by the offer of the ring ahead of
    the first version (``Stager.offer``), or by the first version itself."""
    with Stager(socket, slots=3) as stager, subscribe(name, socket=socket) as subscriber:
        stager.reserve(state_of(0))
        first = 1
        if ahead.startswith("offered"):
            publisher = soon(lambda: stager.offer(name))
        else:
            publisher = soon(lambda: stager.publish(state_of(first), name, step=first))
        assert subscriber.prepare("cuda", timeout=30) == 3  # no CUDA here: mapped only
        publisher.join()
        (ring,) = subscriber._rings.values()
        regions = {slot: ring.region(slot) for slot in list(ring._regions)}
        mapped = shm_mappings()
        maps: list[tuple[int, int]] = []
        map_slot = ring.map

        def counted(slot: int, first: int, fds: Sequence[int]) -> None:
            maps.append((slot, first))
            map_slot(slot, first, fds)

        ring.map = counted  # type: ignore[method-assign]  # counts, maps for real
        for step in (first, 2, 3):
            if step > first or ahead.startswith("offered"):
                stager.publish(state_of(step), name, step=step)
            with subscriber.wait(newer_than=step - 1, timeout=10) as version:
                assert version.step == step and uniform(version.state("cpu"), step)
                assert version._ring is ring and version._ring.region(version._slot) is (
                    regions[version._slot]
                ), "the version was read from a slot mapped again, not the prepared one"
        assert maps == [], "the daemon sent a pinned slot's segments again"
        assert shm_mappings() == mapped, "a version mapped segments of its own"


def test_an_offer_tells_the_followers_and_needs_a_reserved_layout(socket: str, name: str) -> None:
    with Stager(socket, slots=2) as stager:
        with pytest.raises(SaveError, match="call reserve"):
            stager.offer(name)
        stager.reserve(state_of(0))
        with subscribe(name, socket=socket) as subscriber:
            assert stager.offer(name) == 1
            assert subscriber.prepare("cpu", timeout=0) == 2
            assert subscriber.newest is None, "an offer is no version"
            with pytest.raises(NoNewVersion):
                subscriber.wait(timeout=0.2)


def test_prepare_waits_for_the_first_version_within_its_timeout(socket: str, name: str) -> None:
    with subscribe(name, socket=socket) as subscriber:
        started = time.monotonic()
        with pytest.raises(NoNewVersion, match="no ring to prepare"):
            subscriber.prepare("cpu", timeout=0.3)
        assert time.monotonic() - started < 10
        assert subscriber._rings == {}


def test_a_version_of_a_new_structure_drops_the_prepared_ring_and_is_read_whole(
    socket: str, name: str
) -> None:
    with Stager(socket, slots=2) as stager, subscribe(name, socket=socket) as subscriber:
        stager.reserve(state_of(0))
        stager.publish(state_of(1), name, step=1)
        subscriber.prepare("cpu", timeout=10)
        (prepared,) = subscriber._rings.values()
        assert prepared.slots == 2
        grown = {**state_of(2), "extra": torch.arange(100.0)}
        stager.publish(grown, name, step=2)  # another layout: a new ring
        with subscriber.wait(newer_than=1, timeout=10) as version:
            state = version.state()
            assert version._ring is not prepared and version._ring.id != prepared.id
            assert torch.equal(state["extra"], torch.arange(100.0))
            assert uniform({key: state[key] for key in ("w", "layers", "step")}, 2)
        assert prepared.slots == 0 and list(subscriber._rings) == [version._ring.id]


def test_close_releases_every_prepared_mapping(socket: str, name: str) -> None:
    with Stager(socket, slots=3) as stager:
        stager.reserve(state_of(0))
        stager.publish(state_of(1), name, step=1)
        before = shm_mappings()
        subscriber = subscribe(name, socket=socket)
        subscriber.prepare("cpu", timeout=10)
        assert shm_mappings() > before
        subscriber.close()
        assert shm_mappings() == before


def test_prepare_again_maps_only_the_slots_added_since(socket: str, name: str) -> None:
    """A Stager adds its slots after its first save: the ring grows."""
    with Stager(socket, slots=3) as stager, subscribe(name, socket=socket) as subscriber:
        stager.publish(state_of(1), name, step=1)
        first = subscriber.prepare("cpu", timeout=10)
        stager.publish(state_of(2), name, step=2)
        stager.publish(state_of(3), name, step=3)
        (ring,) = subscriber._rings.values()
        kept = {slot: ring.region(slot) for slot in list(ring._regions)}
        assert subscriber.prepare("cpu", timeout=10) == 3 >= first
        assert all(ring.region(slot) is region for slot, region in kept.items())
        with subscriber.wait(newer_than=2, timeout=10) as version:
            assert uniform(version.state(), 3)


def test_a_sharded_channel_is_refused_with_the_reason(socket: str, name: str) -> None:
    from shmstage_client.save.publish import Part, publish_flat
    from shmstage_client.statedict import Flattened

    ranks = [Stager(socket) for _ in range(2)]
    try:
        for rank, stager in enumerate(ranks):
            shard = {"w": torch.full((4,), float(rank))}

            def flatten(shard: dict = shard, rank: int = rank) -> Flattened:
                return Flattened.of(shard, {"w": [4 * rank]})

            publish_flat(
                stager, flatten, name, step=1, metadata=None, share=(),
                part=Part(rank, 2, {"w": [8]}),
            )  # fmt: skip
        with subscribe(name, socket=socket) as subscriber:
            with pytest.raises(DaemonRefused, match="sharded publisher"):
                subscriber.prepare("cpu", timeout=10)
            with subscriber.wait(timeout=10) as version:
                assert version.state()["w"].tolist() == [0.0] * 4 + [1.0] * 4
    finally:
        for stager in ranks:
            stager.close()
