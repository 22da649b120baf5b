"""Fair turns between users: round-robin between owners (uids), then between their jobs.

The node is shared. Taking work in arrival order would let one user with many checkpoints
in flight (many trainers, or many connections) hold every writer while another user's one
checkpoint waits behind all of them. Work is therefore queued per owner and per job, and
taken one item at a time: the next owner in turn, that owner's next job in turn, that job's
oldest item. An owner or job with nothing queued loses nothing by waiting: it is simply
skipped, and joins the end of the turn when it queues again.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items queued per (owner, job), taken round-robin; not thread-safe (callers lock)."""

    def __init__(self) -> None:
        #: owner -> job -> items; dict order is the turn order (the first is next).
        self._owners: dict[Hashable, dict[Hashable, deque[T]]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def put(self, owner: Hashable, job: Hashable, item: T) -> None:
        self._owners.setdefault(owner, {}).setdefault(job, deque()).append(item)
        self._count += 1

    def pop(self, eligible: Callable[[Hashable], bool] | None = None) -> tuple[Hashable, T] | None:
        """The next item in turn, with its job; owners ``eligible`` refuses keep their turn.

        O(owners) at worst, O(1) when every owner is eligible.
        """
        for owner in list(self._owners):
            if eligible is not None and not eligible(owner):
                continue
            jobs = self._owners.pop(owner)
            job = next(iter(jobs))
            items = jobs.pop(job)
            item = items.popleft()
            if items:
                jobs[job] = items  # the job goes to the end of its owner's turn
            if jobs:
                self._owners[owner] = jobs  # and the owner to the end of the turn
            self._count -= 1
            return job, item
        return None

    def drop(self, owner: Hashable, job: Hashable) -> list[T]:
        """Remove and return everything a job still has queued."""
        jobs = self._owners.get(owner)
        if jobs is None or job not in jobs:
            return []
        items = list(jobs.pop(job))
        if not jobs:
            del self._owners[owner]
        self._count -= len(items)
        return items


class FairExecutor(concurrent.futures.Executor):
    """A thread pool that starts queued tasks in fair turns between owners.

    Used for whole persist jobs: a job holds its thread from the first chunk to the last
    fsync, so with more jobs than threads the next to start is the next owner's, not the
    next in arrival order. Tasks of one owner start in the order they came. Threads are
    started as needed (up to ``threads``) and are daemon threads: a daemon whose writer is
    stuck in the kernel can still exit (see the server's shutdown).
    """

    def __init__(self, threads: int, name: str) -> None:
        self._limit = threads
        self._name = name
        self._queue: FairQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]]
        self._queue = FairQueue()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._tasks = 0
        self._shutdown = False

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        return self.submit_for(None, fn, *args, **kwargs)

    def submit_for(
        self, owner: Hashable, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args, **kwargs)`` as one of ``owner``'s tasks."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._tasks += 1
            self._queue.put(owner, self._tasks, (future, lambda: fn(*args, **kwargs)))
            if self._idle == 0 and len(self._threads) < self._limit:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            else:
                self._cond.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._queue and not self._shutdown:
                    self._cond.wait()
                self._idle -= 1
                taken = self._queue.pop()
                if taken is None:
                    return  # shut down and nothing left
            future, call = taken[1]
            del taken
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                    del result
            # An idle thread must not keep its last task alive while it waits: a job's
            # result holds its layout and manifest (0.3 GiB for 100,000 tensors).
            del future, call

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                while (taken := self._queue.pop()) is not None:
                    taken[1][0].cancel()
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for thread in threads:
                thread.join()
