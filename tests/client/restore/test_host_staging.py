"""The pinned staging a restore passes through (``restore.host_staging``): made ahead,
taken as it comes, kept for the next restore, freed when unused or when there is nothing to
restore.
"""

from __future__ import annotations

import time

import pytest
from shmstage_client import CheckpointError, latest
from shmstage_client.restore import host_staging


class _FakeStaging:
    """Stands in for a staging buffer registered with CUDA, which a machine without a GPU
    cannot make (a stand-in for that reason only): takes a while to make, like one."""

    made = 0

    def __init__(self, size: int, device: object = None, *, pin: bool = True) -> None:
        time.sleep(0.05)
        self.size, self.freed, self.pinned_with = size, False, [device] if pin else []
        self.address = 0
        type(self).made += 1

    def pin(self, device: object = None) -> None:
        if not self.pinned_with:
            self.pinned_with.append(device)

    def free(self) -> None:
        self.freed = True


def test_staging_made_ahead_is_taken_as_it_comes_and_never_made_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restore starts making its staging before it asks the daemon; its first reader
    then waits for that rather than register more of its own, and a later restore of no
    more bytes reuses it."""
    monkeypatch.setattr(host_staging, "_HostBuffer", _FakeStaging)
    monkeypatch.setattr(_FakeStaging, "made", 0)
    spares = host_staging._Spares()
    spares.prepare(1024)
    spares.prepare(1024)  # one is coming already
    taken = spares.take(1024)  # waits for the maker
    assert taken is not None and _FakeStaging.made == 1
    assert spares.take(1024) is None  # nothing more coming: the transfer makes its own
    spares.keep(taken)
    spares.prepare(512)  # a buffer that large is kept: none made
    assert _FakeStaging.made == 1
    assert spares.take(2048) is None  # too small for a larger restore
    assert spares.take(512) is taken
    spares.keep(taken)
    spares.free()
    assert taken.freed


def test_at_most_two_spare_staging_buffers_are_kept_the_largest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_staging, "_HostBuffer", _FakeStaging)
    spares = host_staging._Spares()
    buffers = [_FakeStaging(size) for size in (1024, 4096, 2048)]
    for buffer in buffers:
        spares.keep(buffer)
    deadline = time.monotonic() + 5
    while not buffers[0].freed and time.monotonic() < deadline:
        time.sleep(0.01)  # freed on a thread of its own
    assert [b.freed for b in buffers] == [True, False, False]
    assert spares.take(1) is buffers[2]  # the smallest that fits
    spares.free()


def test_a_maker_that_fails_wakes_the_reader_waiting_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(size: int, *args: object, **kwargs: object) -> None:
        time.sleep(0.05)
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(host_staging, "_HostBuffer", fail)
    spares = host_staging._Spares()
    spares.prepare(1024)
    begun = time.monotonic()
    assert spares.take(1024) is None  # the transfer then makes its own, and says so
    assert time.monotonic() - begun < 1.0


def test_staging_made_ahead_is_kept_as_long_as_asked_then_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``prepare_restore`` asks for: a restart script's start-up can outlast the
    minute a transfer's spare is kept, so its buffer waits for ``keep`` seconds instead."""
    monkeypatch.setattr(host_staging, "_HostBuffer", _FakeStaging)
    monkeypatch.setattr(host_staging, "KEEP_STAGING_S", 0.1)
    spares = host_staging._Spares()
    spares.prepare(1024, keep=1.0)
    made = spares.take(1024)
    assert made is not None
    spares.keep(made)  # given back by a transfer: the usual (here 0.1 s) countdown
    time.sleep(0.5)
    assert made.freed
    spares.prepare(1024, keep=1.0)
    time.sleep(0.5)  # longer than KEEP_STAGING_S, shorter than keep
    kept = spares.take(1024)
    assert kept is not None and not kept.freed
    spares.keep(kept)
    spares.free()


def test_staging_made_before_the_device_is_known_is_pinned_by_the_reader_that_takes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a node of several GPUs a bare "cuda" names no device before the process picks
    one, so the buffer made ahead is only faulted in; the first reader, which runs with
    the transfer's device current, registers it."""
    monkeypatch.setattr(host_staging, "_HostBuffer", _FakeStaging)
    monkeypatch.setattr(_FakeStaging, "made", 0)
    monkeypatch.setattr(host_staging, "_SPARES", host_staging._Spares())
    host_staging._SPARES.prepare(host_staging.PIECES * host_staging.PIECE * 2, None)
    staging = host_staging.Staging(2)
    staging.take()
    staging.take()
    buffer = staging._buffer
    assert isinstance(buffer, _FakeStaging) and buffer.pinned_with == [None]
    assert _FakeStaging.made == 1  # the one made ahead, taken
    staging.close()
    host_staging._SPARES.free()


def test_released_staging_is_freed_at_once_and_the_one_being_made_once_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restart that finds nothing to restore gives back what ``prepare_restore`` made
    (256 MiB pinned per rank) now, not after ``keep`` seconds."""
    monkeypatch.setattr(host_staging, "_HostBuffer", _FakeStaging)
    spares = host_staging._Spares()
    spares.prepare(1024, keep=600)
    made = spares.take(1024)
    assert made is not None
    spares.keep(made)
    spares.prepare(4096, keep=600)  # larger: a second one is being made
    spares.release()  # while it is
    deadline = time.monotonic() + 5
    while not made.freed and time.monotonic() < deadline:
        time.sleep(0.01)  # freed on a thread of its own
    assert made.freed
    assert spares.take(4096) is None  # the one being made was not kept: freed once made
    spares.prepare(1024, keep=600)  # after a release, a later prepare keeps its buffer
    again = spares.take(1024)
    assert again is not None and not again.freed
    spares.keep(again)
    spares.free()


def test_latest_finding_nothing_to_restore_releases_the_staging(
    daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_staging, "_SPARES", host_staging._Spares())
    made_ahead = _FakeStaging(1 << 20)  # what prepare_restore would have made on a GPU
    host_staging._SPARES.keep(made_ahead)
    with pytest.raises(CheckpointError, match="no checkpoint to restore"):
        latest(socket=daemon.socket)
    deadline = time.monotonic() + 5
    while not made_ahead.freed and time.monotonic() < deadline:
        time.sleep(0.01)  # freed on a thread of its own
    assert made_ahead.freed
