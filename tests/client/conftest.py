"""Client-test fixtures: a slow network filesystem (``client_helpers.SlowFilesystem``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from client_helpers import SlowFilesystem
from shmstage_client.save import destination


@pytest.fixture
def slow_filesystem(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowFilesystem]:
    fs = SlowFilesystem(delay=0.4)
    monkeypatch.setattr(destination, "os", fs)
    yield fs
