"""The handover: a deferred copy lands, then the daemon gets the slot.

A non-blocking save returns while its copy still runs (``deferred_copy``), its commit already sent
with ``"ready": false``: the daemon has checked and journaled it and waits. Nobody on the
caller's thread is left to say ``ready`` when the copy completes, so each Stager keeps one
handover thread: for each deferred copy, in the order they started, it waits until the bytes
are in shared memory (a CUDA event's blocking host wait, or the copy thread's future: no GIL
held, no core spun), then runs what follows — for a save, ``ready`` and the daemon's
``committed`` — and settles the copy's ``Landing``. Every wait there ends: the copy is finite
work, and the daemon's answers are bounded by the Stager's ``request_timeout`` (a lost daemon
fails them at once).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

from shmstage_client.errors import SaveTimeout
from shmstage_client.save.deferred_copy import DeferredCopy

log = logging.getLogger("shmstage.client")


class Landing:
    """One deferred copy, from its start until it landed and its follow-up ran.

    ``done`` completes then: with None, or with the error that ended the save (the copy's
    own, or the follow-up's). Once it is done nothing reads the saved tensors any more,
    whatever the outcome.
    """

    def __init__(self, copy: DeferredCopy, what: str) -> None:
        self.copy = copy
        self.what = what
        self.started = time.perf_counter()
        self.landed_at: float | None = None
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()

    @property
    def copy_seconds(self) -> float:
        """From the start of the deferred copy until the host saw it land (0 until then)."""
        return 0.0 if self.landed_at is None else self.landed_at - self.started

    def hold_back(self, timeout: float | None) -> None:
        """Before a covered tensor is mutated: make the mutation come after the copy (on the
        device where it can, see ``DeferredCopy.wait_device``)."""
        if not self.done.done():
            self.copy.wait_device(timeout)

    def settled(self, timeout: float | None) -> bool:
        """Wait until done, without raising the save's error (that belongs to its handle)."""
        done, _ = concurrent.futures.wait([self.done], timeout)
        return bool(done)

    def wait(self, timeout: float | None) -> None:
        """Until done; raises SaveTimeout, or the error that ended the save."""
        if not self.settled(timeout):
            raise SaveTimeout(
                f"the copy of {self.what} into shared memory was not complete within "
                f"{timeout} s; it still runs (call again)"
            )
        self.done.result()


#: What follows a landing, on the handover thread: given the landing and the copy's error
#: (None if it landed), it hands the slot over or gives it back; what it raises ends the save.
FollowUp = Callable[[Landing, BaseException | None], None]


class Handover:
    """The Stager's handover thread (started on first use)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Landing, FollowUp] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, landing: Landing, follow_up: FollowUp) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="shmstage-handover", daemon=True
            )
            self._thread.start()
        self._queue.put((landing, follow_up))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            landing, follow_up = item
            error: BaseException | None = None
            try:
                landing.copy.wait_host(None)
                landing.landed_at = time.perf_counter()
            except BaseException as exc:
                error = exc
            try:
                follow_up(landing, error)
            except BaseException as exc:
                error = exc
            if error is None:
                landing.done.set_result(None)
            else:
                landing.done.set_exception(error)

    def close(self, timeout: float | None) -> None:
        """Stop the thread after the landings already submitted (bounded)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("shmstage handover thread still waits for a copy; left behind")
        self._thread = None
