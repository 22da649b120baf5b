"""Shared fixtures: a real shmstaged process on a private socket, and its segments."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import STARTED, RawClient, RunningDaemon, start_daemon

from shmstage import instance, segment


@pytest.fixture(autouse=True, scope="session")
def discard_every_daemon() -> Iterator[None]:
    """At the session's end, no daemon a test started is left running, nor its segments,
    lock file or journal directory in /dev/shm (a test that kills one leaves them for the
    successor it starts; one that ends first leaves them for nobody)."""
    yield
    for running in STARTED:
        running.discard()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    running = start_daemon(tmp_path)
    yield running
    running.discard()  # never leak segments, a lock file or a journal into the next test


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
    """A live daemon instance for in-process tests of jobs and the journal: its lock is held
    (so that no daemon on the node, this suite's or another's, reaps its segments as a dead
    instance's while a test uses them), and its segments go after the test."""
    lock = instance.InstanceLock.claim()
    yield lock.instance
    for name in segment.list_names(lock.instance):
        segment.unlink(name)
    lock.release()


@pytest.fixture(params=["one pass", "two passes"])
def read_passes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A restore's reads checksummed in the pass that reads (``shmstage.readsum``, where
    it is built) or in a second pass over the bytes read (Python, everywhere else)."""
    from shmstage import readsum

    if request.param == "two passes":
        monkeypatch.setattr(readsum, "_LIBRARY", None)
    elif not readsum.available():
        pytest.skip("shmstage._readsum is not built or not usable here")
    return str(request.param)
