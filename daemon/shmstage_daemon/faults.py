"""Test-only fault hooks: hold the daemon still at a named point so a test can hurt it there.

Some faults must land in windows that last microseconds in a healthy daemon — between the
last data file and the commit marker, halfway through a stream, while segments of a layout
are being created. A test cannot SIGKILL the daemon there reliably by timing alone, so the
daemon can be told to pause (or fail) at such a point:

    SHMSTAGE_FAULT="pause-before-manifest:30,pause-mid-stream:5"

Each entry is ``<action>-<point>:<value>``. ``pause-<point>:<seconds>[@<n>]`` sleeps in the
thread that reached the point (only the n-th time it is reached, with ``@n``) and logs
``fault: pausing at <point>`` first, so a test waits for that line and then SIGKILLs,
removes the directory, or whatever the case needs. The one error action,
``eio-<point>:<n>``, makes the n-th write at that point fail with EIO: a shim for the one
storage fault a test cannot cause for real on this kernel (no device-mapper); the tests that
use it say so. ``pause-write:<seconds>`` holds up every data write: a slow disk, for the
same reason. ``flip-gathered:<n>`` flips a bit in the n-th chunk the writer gathered,
after its checksums were taken and before it is written: a shim for memory corruption,
which no test can cause for real, to show it is caught before anything is published.

The variable is read once, when the daemon starts, and never again. It is for the test
suite: production units never set it, and with it unset every hook is a dictionary miss.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from typing import Final

log = logging.getLogger("shmstaged.faults")

ENV: Final = "SHMSTAGE_FAULT"
#: Where the daemon consults the hooks; a typo in the variable is a startup error, not a
#: silently healthy daemon that makes a fault test pass for the wrong reason.
POINTS: Final = frozenset(
    {
        "started",  # in the main thread, once start-up logged "listening on", before the loop
        "register",  # in the I/O thread, after a layout's segments exist, before the reply
        "mid-stream",  # in the writer, after the first tensor of a data file is written
        "before-manifest",  # in the writer, after the data file has its final name
        "write",  # every data write of the writer (eio- fails one; pause- slows each)
        "sync-dir",  # the writer's last step, after the manifest has its name (eio-)
        "gathered",  # each chunk the writer gathered, before it is queued (only with flip-)
    }
)
ACTIONS: Final = ("pause", "eio", "flip")

_pauses: dict[str, tuple[float, int | None]] = {}
_eio: dict[str, int] = {}
_flips: dict[str, int] = {}
_counters: dict[str, itertools.count[int]] = {}
_lock = threading.Lock()


class FaultSpecError(ValueError):
    """SHMSTAGE_FAULT names an unknown action or point, or a bad value."""


def load(spec: str | None = None) -> list[str]:
    """Parse ``spec`` (default: the environment) once; returns what is armed, for the log."""
    spec = os.environ.get(ENV, "") if spec is None else spec
    _pauses.clear()
    _eio.clear()
    _flips.clear()
    _counters.clear()
    armed = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition(":")
        action, _, point = name.partition("-")
        if action not in ACTIONS or point not in POINTS or not value:
            raise FaultSpecError(
                f"{ENV}: {item!r} is not <action>-<point>:<value> with action in "
                f"{list(ACTIONS)} and point in {sorted(POINTS)}"
            )
        try:
            if action == "pause":
                seconds, _, nth = value.partition("@")
                _pauses[point] = (float(seconds), int(nth) if nth else None)
            else:
                (_eio if action == "eio" else _flips)[point] = int(value)
            _counters[point] = itertools.count(1)
        except ValueError:
            raise FaultSpecError(f"{ENV}: {item!r} has a bad value") from None
        armed.append(item)
    return armed


def armed(point: str) -> bool:
    """Whether a test armed ``point`` (for hooks that need preparing before they fire)."""
    return point in _pauses or point in _eio or point in _flips


def pause(point: str) -> None:
    """Sleep here if a test armed this point (called from I/O and writer threads)."""
    armed = _pauses.get(point)
    if armed is None:
        return
    seconds, nth = armed
    if nth is not None and _next(point) != nth:
        return
    log.warning("fault: pausing at %s for %.1f s (%s is set)", point, seconds, ENV)
    time.sleep(seconds)


def _next(point: str) -> int:
    with _lock:
        return next(_counters[point])


def maybe_eio(point: str) -> None:
    """Raise EIO on the armed call at this point, as a failing device would."""
    target = _eio.get(point)
    if target is None:
        return
    nth = _next(point)
    if nth == target:
        log.warning("fault: injecting EIO at %s (call %d, %s is set)", point, nth, ENV)
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def maybe_flip(point: str, data: memoryview, length: int) -> None:
    """Flip the lowest bit of the last of ``length`` bytes on the armed call at this point."""
    target = _flips.get(point)
    if target is None or length == 0:
        return
    nth = _next(point)
    if nth == target:
        log.warning("fault: flipping a bit at %s (call %d, %s is set)", point, nth, ENV)
        data[length - 1] ^= 1
