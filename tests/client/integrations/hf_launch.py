"""The target the tests hand to a forked run: a name that unpickles without importing
transformers, so that the test process itself never imports it (the forkserver did)."""

from __future__ import annotations

from typing import Any


def train(*args: Any, **kwargs: Any) -> None:
    import hf_train

    hf_train.train(*args, **kwargs)
