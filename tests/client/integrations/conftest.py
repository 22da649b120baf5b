"""Integration-test fixtures: one real shmstaged per test module, its socket, a channel name.

One daemon serves a whole module: the integrations' tests each save under their own
directory or publish on their own channel (``name``), so they do not see each other, and a
module pays the daemon's start-up once. A test that needs a daemon of its own (a fault
hook, a config, one it kills) starts it with ``harness.start_daemon``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import RunningDaemon, start_daemon


@pytest.fixture(scope="module")
def module_daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    running = start_daemon(tmp_path_factory.mktemp(f"{request.module.__name__}-daemon"))
    yield running
    running.discard()


@pytest.fixture
def socket(module_daemon: RunningDaemon) -> str:
    return str(module_daemon.socket)


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """A channel of this test's own on the module's daemon."""
    return request.node.name[:100]
