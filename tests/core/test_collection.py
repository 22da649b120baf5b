"""The cyclic collector held off around a burst of containers, and given back as it was."""

from __future__ import annotations

import gc

import pytest

from shmstage.collection import collection_paused


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
