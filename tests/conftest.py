"""Shared fixtures: a real shmstaged process on a private socket, and its segments."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import RawClient, RunningDaemon, start_daemon

from shmstage import instance, segment


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    running = start_daemon(tmp_path)
    yield running
    if running.proc.poll() is None:
        running.proc.kill()
        running.proc.wait(10)
    for name in segment.list_names(running.instance):  # never leak into the next test
        segment.unlink(name)
    with contextlib.suppress(FileNotFoundError):  # a killed daemon's lock stays otherwise
        os.unlink(instance.lock_path(running.instance))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


@pytest.fixture
def raw_client(daemon: RunningDaemon) -> Iterator[Callable[..., RawClient]]:
    made: list[RawClient] = []

    def make(**kwargs: object) -> RawClient:
        client = RawClient(daemon.socket, **kwargs)  # type: ignore[arg-type]
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def instance_id() -> Iterator[str]:
    """A daemon instance id for in-process tests of jobs and the journal; its segments go."""
    made = segment.new_instance_id()
    yield made
    for name in segment.list_names(made):
        segment.unlink(name)
