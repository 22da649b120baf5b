"""The store's per-user books, driven with no daemon: what one user may take, and that
everything taken goes back exactly once.

Per-user accounting is one pair: ``Store.take`` checks a counter against its limit and
returns a ``Taken``; its ``release`` gives it back once, to the user it was taken for,
whether or not the connection that asked is still open. The tests below state that pair's
rules and the registration and job limits built on the same books.
"""

from __future__ import annotations

import pytest
from shmstage_daemon.store import Limits, Store, StoreError

from shmstage.layout import Layout, TensorSpec
from shmstage.protocol import ErrorCode
from shmstage.segment import SegmentRef

SESSION, OTHER_SESSION, UID = 7, 8, 1000
LAYOUT = Layout((TensorSpec("w", "F32", (1024,)),))  # 4 KiB: one page a slot


def store_of(**limits: int) -> Store:
    store = Store(Limits(shm_budget_bytes=1 << 30, **limits))
    store.open_session(SESSION, UID)
    return store


def test_what_is_taken_counts_for_the_user_until_released_once() -> None:
    store = store_of(max_user_prepared=3)
    first = store.take(SESSION, "prepared", 1, 3, "max_prepared")
    second = store.take(SESSION, "prepared", 2, 3, "max_prepared")
    assert store.usage[UID].prepared == 3
    first.release()
    first.release()  # a second release gives nothing back
    assert store.usage[UID].prepared == 2
    second.release()
    assert store.usage[UID].prepared == 0


def test_a_take_over_the_limit_is_refused_naming_the_user_and_the_setting() -> None:
    store = store_of()
    store.take(SESSION, "journal_bytes", 60, 100, "max_journal_bytes")
    with pytest.raises(StoreError) as refused:
        store.take(SESSION, "journal_bytes", 41, 100, "max_journal_bytes")
    assert refused.value.code is ErrorCode.LIMIT_EXCEEDED
    assert "uid 1000 would hold 101 journal bytes (limit 100, max_journal_bytes)" in str(
        refused.value
    )
    assert store.usage[UID].journal_bytes == 60  # the refused take charged nothing


def test_connections_of_one_user_share_its_limit() -> None:
    store = store_of()
    store.open_session(OTHER_SESSION, UID)
    store.take(SESSION, "prepared", 2, 3, "max_prepared")
    with pytest.raises(StoreError, match="would hold 4 prepared"):
        store.take(OTHER_SESSION, "prepared", 2, 3, "max_prepared")


def test_what_a_closed_connection_took_goes_back_to_its_user() -> None:
    """A journal entry outlives the session that committed it: its bytes go back to the
    user when the job ends, not to whoever owns the session id by then."""
    store = store_of()
    store.open_session(OTHER_SESSION, UID)  # keeps the user on the books
    taken = store.take(SESSION, "journal_bytes", 500, 1000, "max_journal_bytes")
    store.forget_client(SESSION)
    taken.release()
    assert store.usage[UID].journal_bytes == 0


def test_a_growing_counter_is_checked_and_a_shrinking_one_never_refused() -> None:
    """A frame still arriving grows and shrinks its user's buffered bytes; a reload that
    lowers the limit must not make a shrinking frame an error."""
    store = store_of()
    buffered = store.take(SESSION, "buffered_bytes", 0, 0, "max_buffered_bytes")
    buffered.resize(800, 1000)
    with pytest.raises(StoreError, match="max_buffered_bytes"):
        buffered.resize(1200, 1000)
    assert (buffered.amount, store.usage[UID].buffered_bytes) == (800, 800)
    buffered.resize(300, 100)  # over a lowered limit, but smaller: allowed
    assert store.usage[UID].buffered_bytes == 300
    buffered.release()
    assert store.usage[UID].buffered_bytes == 0


def test_a_user_with_nothing_taken_leaves_the_books_when_its_last_connection_closes() -> None:
    store = store_of()
    store.take(SESSION, "prepared", 1, 3, "max_prepared").release()
    store.forget_client(SESSION)
    assert UID not in store.usage


def test_a_registration_over_the_users_max_bytes_is_refused_before_any_segment() -> None:
    store = store_of(max_user_bytes=3 * 4096)
    store.reserve(SESSION, LAYOUT, 2)
    with pytest.raises(StoreError, match=r"to 16384 bytes, over its limit of 12288 \(max_bytes"):
        store.reserve(SESSION, LAYOUT, 2)
    assert (store.usage[UID].bytes, store.reserved_bytes) == (8192, 8192)


def test_a_registration_planned_past_max_slots_is_refused_though_fewer_are_asked() -> None:
    store = store_of(max_slots=2)
    with pytest.raises(StoreError, match=r"slots=3: this daemon allows 1\.\.2"):
        store.reserve(SESSION, LAYOUT, 1, planned=3)
    assert store.reserved_bytes == 0


def test_a_user_has_at_most_max_jobs_checkpoints_being_written() -> None:
    store = store_of(max_user_jobs=1)
    refs = [[SegmentRef("/a", 4096)], [SegmentRef("/b", 4096)]]
    staged = store.add(SESSION, LAYOUT, refs, 8192)
    first, second = store.try_acquire(SESSION, staged), store.try_acquire(SESSION, staged)
    assert first is not None and second is not None
    job = store.begin_job(SESSION, staged, first)
    with pytest.raises(StoreError, match="already has 1 checkpoints being written"):
        store.begin_job(SESSION, staged, second)
    store.end_job(SESSION, staged, first, job)
    assert store.usage[UID].jobs == 0
    store.begin_job(SESSION, staged, second)


def test_a_commit_of_a_slot_this_client_does_not_fill_is_slot_not_owned() -> None:
    store = store_of()
    store.open_session(OTHER_SESSION, UID)
    staged = store.add(SESSION, LAYOUT, [[SegmentRef("/a", 4096)]], 4096)
    slot = store.try_acquire(OTHER_SESSION, staged)
    assert slot is not None
    with pytest.raises(StoreError) as refused:
        store.begin_job(SESSION, staged, slot)
    assert refused.value.code is ErrorCode.SLOT_NOT_OWNED
    assert store.usage[UID].jobs == 0  # the refusal counted no job
