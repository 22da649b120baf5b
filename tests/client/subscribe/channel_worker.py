"""Processes on the other end of a channel, for test_publishing: run by a forkserver that
imported this module (and torch) once, each talking back through ``tell``.

    reader   follow a channel until step ``final``; tell "following" once it does, then
             what it saw
    holder   pin the newest version, tell its step, and hold it until killed
    dier     publish step 1, then fill a slot with step 2 and stop before publishing it,
             until killed
    saver    save step 3 durably to ``path`` and publish it (``save(..., publish=)``), then
             wait to be killed
    waiter   wait() for a version of a channel that has none; tell "held" once the daemon
             holds its pin request, then wait on until killed

``on_held_pin`` runs a test's code at the moment a subscriber's ``wait()`` has its pin
request held by the daemon, about to block for the answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from shmstage_client import Stager, subscribe


def state_of(step: int) -> dict[str, Any]:
    """Every element of every tensor is the step: a version mixing two is seen at once."""
    return {
        "w": torch.full((256, 256), float(step)),
        "layers": [torch.full((1000,), step, dtype=torch.int64), torch.full((7,), float(step))],
        "step": step,
    }


def uniform(state: dict[str, Any], step: int) -> bool:
    tensors = [state["w"], *state["layers"]]
    return state["step"] == step and all(bool((t == step).all()) for t in tensors)


def on_held_pin(subscriber: Any, hook: Callable[[], None]) -> list[tuple[str, dict[str, Any]]]:
    """Call ``hook`` in ``subscriber``'s next ``wait()`` once the daemon holds its pin
    request (a round trip on the same connection after it proves it: a connection's
    requests are served in order), just before it blocks for the answer; returns the list
    of (op, body) of every request the subscriber sends from now on."""
    sent: list[tuple[str, dict[str, Any]]] = []
    connection = subscriber._connection
    start = connection.start

    def spy(op: str, body: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        sent.append((op, dict(body)))
        handle = start(op, body, *args, **kwargs)
        if op == "pin" and body.get("hold") and not getattr(spy, "done", False):
            spy.done = True  # type: ignore[attr-defined]
            blocking = handle.next

            def held(timeout: float | None) -> Any:
                handle.next = blocking
                status = start("status", {})
                try:
                    status.next(10)
                finally:
                    status.finish()
                hook()
                return blocking(timeout)

            handle.next = held
        return handle

    connection.start = spy
    return sent


def reader(socket: str, name: str, final: int, tell: Any) -> None:
    seen, torn = [], []
    with subscribe(name, socket=socket) as subscriber:
        tell.send("following")
        step = None
        while step is None or step < final:
            with subscriber.wait(newer_than=step, timeout=30) as version:
                state = version.state()
                time.sleep(0.002)  # read slowly: the publisher is flat out meanwhile
                again = dict(version.tensors(bucket_bytes=64 << 10))
                if not uniform(state, version.step) or not all(
                    bool((t == version.step).all()) for t in again.values()
                ):
                    torn.append(version.step)
                seen.append(version.step)
                step = version.step
    tell.send({"seen": seen, "torn": torn})


def holder(socket: str, name: str, tell: Any) -> None:
    subscriber = subscribe(name, socket=socket)
    version = subscriber.wait(timeout=30)
    tell.send(version.step)
    time.sleep(3600)


def waiter(socket: str, name: str, tell: Any) -> None:
    subscriber = subscribe(name, socket=socket)
    on_held_pin(subscriber, lambda: tell.send("held"))
    subscriber.wait(timeout=3600)


def dier(socket: str, name: str, tell: Any) -> None:
    stager = Stager(socket, slots=2)
    stager.reserve(state_of(1))  # both slots now: filling step 2 leaves step 1 alone
    stager.publish(state_of(1), name, step=1)
    staged = stager.stage(state_of(2))  # filled, never published
    tell.send(staged.slot)
    time.sleep(3600)


def saver(socket: str, name: str, path: str, tell: Any) -> None:
    stager = Stager(socket)
    stager.save(state_of(3), path, metadata={"step": 3}, publish=name).wait(60)
    tell.send("saved")
    time.sleep(3600)
