"""The cyclic collector held off around a burst of containers, and given back as it was."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import pytest

from shmstage.collection import collect_young, collection_paused


def test_the_collector_is_paused_inside_and_enabled_again_after_even_on_an_error() -> None:
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collection_paused():
        raise KeyError("x")
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled() -> None:
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def _collections(action: Callable[[], None]) -> list[int]:
    """The generations collected while ``action`` ran."""
    seen: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(note)
    try:
        action()
    finally:
        gc.callbacks.remove(note)
    return seen


def test_young_objects_are_collected_early_only_in_a_pause_that_will_end() -> None:
    """``collect_young`` does, where a thread would only wait, the collection the end of
    its pause would do; outside a pause, or in one of a disabled collector, nothing."""
    assert _collections(collect_young) == []

    def paused() -> None:
        with collection_paused():
            collect_young()

    assert _collections(paused) == [0]
    gc.disable()
    try:
        assert _collections(paused) == []
    finally:
        gc.enable()
    with collection_paused():  # another thread's pause is its own
        worker = threading.Thread(target=collect_young)
        assert _collections(lambda: (worker.start(), worker.join())) == []
