"""A waiting reader's pin, held by the daemon until the version comes: real daemon, real
sockets.

``wait()`` asks for a pin with ``hold``; the daemon keeps the request while no version
newer than asked is visible, pins the first one made visible and answers with it — the
answer is the wake-up, with no announcement and no second request. Nothing is ever left
held or pinned for a reader that stopped waiting, timed out or went.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RawClient, RunningDaemon, wait_for
from shmstage_client import NoNewVersion, Stager, subscribe
from shmstage_client.save.publish import Part, publish_flat
from shmstage_client.statedict import Flattened

from shmstage.control import ControlClient

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from channel_worker import on_held_pin, state_of, uniform  # noqa: E402


def pins_on(socket: str, name: str) -> int:
    """The pins the daemon counts on this user's channel ``name`` (``shmstage status``)."""
    with ControlClient(socket) as control:
        channels = control.status()["channels"]
    return sum(channel["pins"] for channel in channels if channel["name"] == name)


def following(socket: str, name: str) -> tuple[RawClient, int]:
    """A protocol-level reader following ``name``, and the channel's id."""
    client = RawClient(Path(socket))
    client.request("subscribe", {"name": name})
    answer = client.frame()
    assert answer.op == "subscribed", answer
    return client, answer.body["channel"]


def served_so_far(client: RawClient) -> Any:
    """A status round trip: the daemon served every earlier request of this connection."""
    client.request("status", {})
    answer = client.frame()
    assert answer.op == "status", f"{answer.op} {answer.body}"
    return answer.body["status"]


def test_a_held_pin_is_answered_by_the_pin_itself_once_the_version_is_published(
    socket: str, name: str
) -> None:
    with Stager(socket, slots=2) as stager:
        client, channel = following(socket, name)
        try:
            held = client.request("pin", {"channel": channel, "newer_than": None, "hold": 30})
            served_so_far(client)  # held, unanswered: nothing to pin yet
            stager.publish(state_of(1), name, step=1)
            pinned = client.frame()
            assert (pinned.op, pinned.id, pinned.body["step"]) == ("pinned", held, 1)
            assert 0 < pinned.body["seconds"] <= 600
            fds = client.frame()
            assert (fds.op, fds.id, fds.body["pin"]) == ("ring_fds", held, pinned.body["pin"])
            for fd in fds.fds:
                os.close(fd)
            status = served_so_far(client)  # no "version" frame: the answer said it
            (mine,) = [c for c in status["channels"] if c["name"] == name]
            assert mine["pins"] == 1 and mine["newest_step"] == 1
        finally:
            client.close()
        wait_for(lambda: pins_on(socket, name) == 0, 10, "the closed reader's pin to end")


def test_a_parked_wait_returns_the_version_pinned_by_its_one_request(
    socket: str, name: str
) -> None:
    with Stager(socket, slots=2) as stager, subscribe(name, socket=socket) as subscriber:
        assert subscriber._max_hold == 60, "the daemon says how long it holds a pin"
        sent = on_held_pin(subscriber, lambda: stager.publish(state_of(2), name, step=2))
        with subscriber.wait(timeout=30) as version:
            assert [op for op, _body in sent] == ["pin"] and 0 < sent[0][1]["hold"] <= 30
            assert version.step == 2 and uniform(version.state(), 2)
            assert subscriber._next_event(0) is None, "no announcement besides the pin"
            assert subscriber.newest == 2 and pins_on(socket, name) == 1
        assert pins_on(socket, name) == 0


def test_a_held_pin_of_a_sharded_channel_is_answered_once_every_part_landed(
    socket: str, name: str
) -> None:
    """Two ranks (two connections) publish the halves of ``w``: the held request is
    answered by the pin of the whole version, when its last part makes it visible."""
    ranks = [Stager(socket), Stager(socket)]

    def part(rank: int, step: int) -> bool:
        shard = {"w": torch.full((4,), float(10 * step + rank))}
        published = publish_flat(
            ranks[rank],
            lambda: Flattened.of(shard, {"w": [4 * rank]}),
            name,
            step=step,
            metadata=None,
            share=(),
            part=Part(rank, 2, {"w": [8]}),
        )
        return published.complete

    def publish_both() -> None:
        assert not part(0, 1) and pins_on(socket, name) == 0, "half a version pins nothing"
        assert part(1, 1)

    try:
        with subscribe(name, socket=socket) as subscriber:
            sent = on_held_pin(subscriber, publish_both)
            with subscriber.wait(timeout=30) as version:
                assert [op for op, _body in sent] == ["pin"] and pins_on(socket, name) == 1
                assert (version.step, version.parts) == (1, 2)
                assert version.state()["w"].tolist() == [10.0] * 4 + [11.0] * 4
            assert pins_on(socket, name) == 0
    finally:
        for rank in ranks:
            rank.close()


def test_a_wait_that_times_out_pins_nothing_and_holds_nothing(socket: str, name: str) -> None:
    with Stager(socket) as stager, subscribe(name, socket=socket) as subscriber:
        with pytest.raises(NoNewVersion, match="no version of channel"):
            subscriber.wait(timeout=0.3)
        stager.publish(state_of(1), name, step=1)  # would pin for a request left held
        assert pins_on(socket, name) == 0
        with pytest.raises(NoNewVersion, match="newer than step 1"):
            subscriber.wait(newer_than=1, timeout=0)  # asks once, holds nothing
        client, channel = following(socket, name)
        try:
            held = client.request("pin", {"channel": channel, "newer_than": 1, "hold": 0.2})
            answer = client.frame()
            assert (answer.op, answer.id) == ("no_newer", held)
            assert answer.body == {"channel": channel, "newest": 1}
        finally:
            client.close()
        stager.publish(state_of(2), name, step=2)
        assert pins_on(socket, name) == 0


@pytest.mark.parametrize("came", [False, True], ids=["nothing-came", "the-version-came"])
def test_a_reader_that_stops_waiting_leaves_nothing_held_or_pinned(
    socket: str, name: str, came: bool
) -> None:
    """KeyboardInterrupt in ``wait()`` while the daemon holds its pin request: it drops
    the request, or — when the version came just then — the pin it took for it is taken
    and ended by the reader, which reads on as if nothing happened."""
    with Stager(socket, slots=2) as stager, subscribe(name, socket=socket) as subscriber:

        def interrupt() -> None:
            if came:  # the daemon pins it for the held request before publish returns
                stager.publish(state_of(3), name, step=3)
                assert pins_on(socket, name) == 1
            raise KeyboardInterrupt

        on_held_pin(subscriber, interrupt)
        with pytest.raises(KeyboardInterrupt):
            subscriber.wait(timeout=30)
        assert pins_on(socket, name) == 0
        if not came:
            stager.publish(state_of(3), name, step=3)
            assert pins_on(socket, name) == 0, "a dropped request pins nothing"
        with subscriber.wait(timeout=10) as version:  # the slot as the daemon sent it
            assert version.step == 3 and uniform(version.state(), 3)
        stager.publish(state_of(4), name, step=4)
        with subscriber.wait(newer_than=3, timeout=10) as version:
            assert version.step == 4 and uniform(version.state(), 4)
        assert pins_on(socket, name) == 0


def test_a_connections_held_pins_are_bounded_and_a_malformed_hold_is_refused_by_name(
    socket: str, name: str, module_daemon: RunningDaemon
) -> None:
    client, channel = following(socket, name)
    try:
        for hold in (-1, 61, math.nan, math.inf):
            client.request("pin", {"channel": channel, "hold": hold})
            refused = client.frame()
            assert (refused.op, refused.body["code"]) == ("error", "bad_request")
            assert "pin.hold" in refused.body["message"] and "0 to 60" in refused.body["message"]
        held = [client.request("pin", {"channel": channel, "hold": 30}) for _ in range(4)]
        client.request("pin", {"channel": channel, "hold": 30})
        refused = client.frame()
        assert (refused.op, refused.body["code"]) == ("error", "limit_exceeded")
        assert "already has 4 pin requests waiting" in refused.body["message"]
        client.sock.sendall(client.conn.send("pin", held[0], {"channel": channel, "hold": 30}))
        refused = client.frame()
        assert refused.id == held[0] and "already a held pin request" in refused.body["message"]
        unhold = client.request("unhold", {"request": held[0]})
        answered = client.frame()
        assert (answered.op, answered.id, answered.body) == (
            "no_newer", held[0], {"channel": channel, "newest": None}
        )  # fmt: skip
        answered = client.frame()
        assert (answered.id, answered.body) == (unhold, {"request": held[0], "held": True})
        client.request("unhold", {"request": held[0]})
        assert client.frame().body == {"request": held[0], "held": False}
        client.request("pin", {"channel": channel, "hold": 30})  # room for one again
        assert served_so_far(client)["channels"][0]["pins"] == 0
    finally:
        client.close()
    with Stager(socket) as stager, subscribe(name, socket=socket) as subscriber:
        stager.publish(state_of(1), name, step=1)
        with subscriber.wait(timeout=10) as version:
            assert version.step == 1 and pins_on(socket, name) == 1
    assert pins_on(socket, name) == 0
    assert "internal error" not in module_daemon.log()


def test_a_daemon_that_does_not_hold_pins_is_followed_by_its_announcements(
    socket: str, name: str
) -> None:
    """An older daemon's welcome names no ``max_pin_hold_seconds`` (and it would end the
    connection of a "pin" with a field it does not know): its subscriber pins once told.
    Faked by forgetting what this daemon's welcome said: no older daemon runs here."""
    with Stager(socket) as stager, subscribe(name, socket=socket) as subscriber:
        subscriber._max_hold = None
        sent = on_held_pin(subscriber, lambda: None)
        with pytest.raises(NoNewVersion):
            subscriber.wait(timeout=0.2)
        assert sent == [], "nothing asked before the announcement"
        stager.publish(state_of(5), name, step=5)
        with subscriber.wait(timeout=10) as version:
            assert [op for op, _body in sent] == ["pin"] and "hold" not in sent[0][1]
            assert version.step == 5 and uniform(version.state(), 5)
