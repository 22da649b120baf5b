"""Helpers for the client tests: a slow network filesystem, simulated in the client only;
a gate that holds a Stager's copy thread.

A module of its own, not the conftest: ``from conftest import ...`` resolves to whichever
conftest was imported first, so a run that also collects another directory's conftest
(tests/security) failed to import these.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from shmstage_client import Stager


class SlowFilesystem:
    """The destination module's ``os`` with a server round trip added to every mkdir and
    every create, as on Lustre or NFS under load.

    A mock, and only of the one thing a test cannot cause here: a slow metadata server.
    Everything else (the daemon, its checks, the real directories and files) is real. Each
    slow call is recorded with the thread that made it, so a test can tell the trainer's
    thread from the Stager's background thread.
    """

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _round_trip(self, what: str) -> None:
        self.calls.append((what, threading.current_thread().name))
        time.sleep(self.delay)

    def mkdir(self, *args: Any, **kwargs: Any) -> None:
        self._round_trip("mkdir")
        os.mkdir(*args, **kwargs)

    def open(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT:
            self._round_trip("create")
        return os.open(path, flags, *args, **kwargs)

    def on(self, thread: str) -> list[str]:
        """The slow calls made on the thread named ``thread``."""
        return [what for what, name in self.calls if name == thread]


class CopyGate:
    """Keeps a Stager's copy thread busy until ``open()``: deferred CPU copies queue behind.

    Not a mock: a real job on the real thread, so a test knows for certain that a
    non-blocking save's copy has not run yet, and that whatever returned only once the
    gate was open (``opened``) waited for it.
    """

    def __init__(self, stager: Stager) -> None:
        self._open = threading.Event()
        self.opened = threading.Event()  # set before the copy thread is let go
        self._job = stager._copier.copy_thread().submit(self._open.wait, 60)

    def open(self) -> None:
        self.opened.set()
        self._open.set()

    def open_in(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.open)
        timer.start()
        return timer
