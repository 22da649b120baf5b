"""Client-test fixtures: one real shmstaged per test module, and a slow network filesystem
(``client_helpers.SlowFilesystem``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from client_helpers import SlowFilesystem
from harness import FORK_PRELOAD, RunningDaemon, own_fork_server, start_daemon
from shmstage_client.save import destination


@pytest.fixture(scope="module")
def module_daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    """One shmstaged for a whole test module: a start costs a second of the machine's
    time, and most tests only need a daemon to save through, each under its own directory
    (``ckpt``) with its own Stager. A test that looks at the daemon itself — its log, its
    segments, its layout numbers — or stops it, or needs a setting, has its own
    (``daemon``, or ``harness.start_daemon``)."""
    running = start_daemon(tmp_path_factory.mktemp(f"{request.module.__name__}-daemon"))
    yield running
    running.discard()


@pytest.fixture
def socket(module_daemon: RunningDaemon) -> str:
    """The module's daemon's socket, for the tests that only connect (a module with a
    daemon of its own overrides this)."""
    return str(module_daemon.socket)


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """A channel of this test's own (a channel's versions only grow)."""
    return request.node.name[:100]


@pytest.fixture(scope="module")
def fork_server() -> Iterator[None]:
    """The server that ``ForkedScript``'s processes are forked from, importing torch once."""
    with own_fork_server(FORK_PRELOAD):
        yield


@pytest.fixture
def slow_filesystem(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowFilesystem]:
    fs = SlowFilesystem(delay=0.4)
    monkeypatch.setattr(destination, "os", fs)
    yield fs
