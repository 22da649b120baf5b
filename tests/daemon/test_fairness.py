"""Fair turns between users: the queue every writer takes work from, and the job pool."""

from __future__ import annotations

import threading

from shmstage_daemon.fairness import FairExecutor, FairQueue


def drain(queue: FairQueue[str]) -> list[str]:
    taken = []
    while (item := queue.pop()) is not None:
        taken.append(item[1])
    return taken


def test_owners_take_turns_then_their_jobs_then_each_jobs_items_in_order() -> None:
    queue: FairQueue[str] = FairQueue()
    for item in ("a1.0", "a1.1", "a1.2", "a2.0", "a2.1", "b1.0", "b1.1", "c1.0"):
        owner, job = item[0], item[:2]
        queue.put(owner, job, item)
    assert len(queue) == 8
    assert drain(queue) == ["a1.0", "b1.0", "c1.0", "a2.0", "b1.1", "a1.1", "a2.1", "a1.2"]
    assert len(queue) == 0


def test_one_owner_with_many_jobs_gets_one_turn_in_two_against_another() -> None:
    """Eight jobs of one user against one job of another: the other still gets every
    second write, not one in nine."""
    queue: FairQueue[str] = FairQueue()
    for job in range(8):
        for index in range(4):
            queue.put("many", job, f"many{job}.{index}")
    for index in range(4):
        queue.put("one", 0, f"one.{index}")
    taken = drain(queue)
    assert taken[1::2][:4] == ["one.0", "one.1", "one.2", "one.3"]


def test_an_owner_that_comes_back_joins_the_end_of_the_turn() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.put("a", 1, "a.0")
    queue.put("b", 1, "b.0")
    assert queue.pop() == (1, "a.0")
    queue.put("a", 1, "a.1")  # a had nothing queued for a moment
    queue.put("c", 1, "c.0")
    assert drain(queue) == ["b.0", "a.1", "c.0"]


def test_owners_refused_by_eligible_keep_their_place() -> None:
    queue: FairQueue[str] = FairQueue()
    for item in ("a.0", "a.1", "b.0", "b.1"):
        queue.put(item[0], 1, item)
    assert queue.pop(lambda owner: owner != "a") == (1, "b.0")
    assert queue.pop(lambda owner: False) is None
    assert drain(queue) == ["a.0", "b.1", "a.1"]


def test_drop_removes_one_jobs_items_only() -> None:
    queue: FairQueue[str] = FairQueue()
    for item in ("a1.0", "a1.1", "a2.0", "b1.0"):
        queue.put(item[0], item[:2], item)
    assert queue.drop("a", "a1") == ["a1.0", "a1.1"]
    assert queue.drop("a", "a1") == []
    assert queue.drop("z", "z1") == []
    assert len(queue) == 2
    assert drain(queue) == ["a2.0", "b1.0"]


def test_the_job_pool_starts_queued_jobs_in_fair_turns() -> None:
    """One thread, held busy while four jobs of user 1 and one of user 2 queue: user 2's
    starts second, not last."""
    pool = FairExecutor(1, "test-jobs")
    gate = threading.Event()
    started: list[str] = []
    try:
        first = pool.submit_for(0, gate.wait, 30)
        futures = [pool.submit_for(1, started.append, f"u1-{i}") for i in range(4)]
        futures.append(pool.submit_for(2, started.append, "u2"))
        gate.set()
        assert first.result(30) is True
        for future in futures:
            future.result(30)
    finally:
        pool.shutdown()
    assert started == ["u1-0", "u2", "u1-1", "u1-2", "u1-3"]


def test_shutdown_cancels_what_never_started_and_reports_errors_as_futures_do() -> None:
    pool = FairExecutor(1, "test-jobs")
    gate, began = threading.Event(), threading.Event()
    running = pool.submit(lambda: began.set() or gate.wait(30))
    assert began.wait(30)
    queued = pool.submit(len, "never")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    gate.set()
    assert running.result(30) is True
    failing = FairExecutor(2, "test-jobs")
    try:
        future = failing.submit(int, "not a number")
        assert isinstance(future.exception(30), ValueError)
    finally:
        failing.shutdown()
