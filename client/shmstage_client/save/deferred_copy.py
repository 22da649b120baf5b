"""A deferred copy: a copy into a slot that has started and may not have landed yet.

A non-blocking save (``Stager.save(..., block=False)``) starts the copy of the tensors a
guard covers and returns; the copy lands later, while the next forward and backward run.
Two parties wait for it, in different ways:

- the host — the Stager's handover thread, before it reports the copy complete to the
  daemon; a caller of ``SaveHandle.staged()``; the next save — waits until the bytes are in
  shared memory (``wait_host``);
- the optimizer, through the guard's step pre-hook, must not mutate a tensor before the copy
  has read it. It needs no host wait where the mutation itself is queued on a device: the
  device is told to wait (``wait_device``), and the host goes on queueing the step.

CUDA copies run on a side stream and are waited through an event (``StreamCopy``); CPU
copies run on a copy thread (``ThreadCopy``), which only the host can wait for. A save
with both has one of each (``CopyGroup``).
"""

from __future__ import annotations

import concurrent.futures
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from shmstage_client.errors import SaveTimeout

#: Polling a CUDA event for a bounded host wait: first sleep, and the longest.
_POLL_FIRST = 50e-6
_POLL_MAX = 1e-3


class DeferredCopy(ABC):
    """A started copy into a slot. Every wait is bounded by its ``timeout`` (None: until the
    copy ends, which it always does: it is a finite amount of work queued on a device or a
    thread); a wait that runs out raises SaveTimeout, and a copy that failed raises its error.
    """

    #: How many bytes it copies.
    nbytes: int = 0

    @abstractmethod
    def landed(self) -> bool:
        """Whether every byte is in the slot (never blocks)."""

    @abstractmethod
    def wait_host(self, timeout: float | None) -> None:
        """Block this thread until every byte is in the slot."""

    @abstractmethod
    def wait_device(self, timeout: float | None) -> None:
        """Make work queued from now on — on each copying device's current stream — run only
        after the copy. No host wait, except for a copy no device stream can wait for."""


class StreamCopy(DeferredCopy):
    """CUDA copies queued on a side stream, ended by an event.

    Holds the sources until the copy has landed: a tensor the caller drops meanwhile must not
    return to the caching allocator, which would hand its memory to the caller's stream while
    the side stream still reads it.
    """

    def __init__(
        self,
        device: torch.device,
        event: torch.cuda.Event,
        sources: Sequence[torch.Tensor],
        nbytes: int | None = None,
    ) -> None:
        """``nbytes``: the sources' bytes where the caller knows them (the layout's sizes;
        adding up 100,000 tensors' sizes costs tens of milliseconds in a save's stall)."""
        self.device = device
        self.nbytes = _nbytes(sources) if nbytes is None else nbytes
        self._event = event
        self._sources: Sequence[torch.Tensor] | None = sources

    def landed(self) -> bool:
        if self._event.query():
            self._sources = None
            return True
        return False

    def wait_host(self, timeout: float | None) -> None:
        if timeout is None:
            # A blocking-sync event: this thread sleeps in the driver, without the GIL and
            # without spinning a core the trainer's data loader may need.
            self._event.synchronize()
        else:
            deadline = time.monotonic() + timeout
            pause = _POLL_FIRST
            while not self._event.query():
                if time.monotonic() >= deadline:
                    raise SaveTimeout(
                        f"the copy from {self.device} into shared memory did not complete "
                        f"within {timeout} s (is the trainer's stream stuck?)"
                    )
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX)
        self._sources = None

    def wait_device(self, timeout: float | None) -> None:
        torch.cuda.current_stream(self.device).wait_event(self._event)


class ThreadCopy(DeferredCopy):
    """CPU copies running on a copy thread (``concurrent.futures`` future of the copy)."""

    def __init__(self, future: concurrent.futures.Future[None], nbytes: int) -> None:
        self._future = future
        self.nbytes = nbytes

    def landed(self) -> bool:
        return self._future.done()

    def wait_host(self, timeout: float | None) -> None:
        done, _ = concurrent.futures.wait([self._future], timeout)
        if not done:
            raise SaveTimeout(
                f"the copy of CPU tensors into shared memory did not complete within {timeout} s"
            )
        self._future.result()  # the copy's own error, if it failed

    def wait_device(self, timeout: float | None) -> None:
        self.wait_host(timeout)  # no stream can wait for a host thread


class CopyGroup(DeferredCopy):
    """One save's copies on several devices: landed when all have."""

    def __init__(self, parts: Sequence[DeferredCopy]) -> None:
        self.parts = list(parts)
        self.nbytes = sum(part.nbytes for part in self.parts)

    def landed(self) -> bool:
        return all(part.landed() for part in self.parts)

    def wait_host(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for part in self.parts:
            part.wait_host(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def wait_device(self, timeout: float | None) -> None:
        # Device waits first: they cost the host nothing, and a CPU part is usually done.
        for part in sorted(self.parts, key=lambda p: isinstance(p, ThreadCopy)):
            part.wait_device(timeout)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
