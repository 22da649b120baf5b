"""The daemon's own heap: freed memory given back to the kernel after a large release.

A client of 100,000 tensors makes the daemon build a layout, trees and manifests of
millions of small objects. Once the client has gone they are freed, but glibc's malloc
keeps freed memory in its arenas for the next allocation (tens of MiB after such a
client), and a daemon that serves a node for months would keep the high-water mark of
its largest client. ``trim`` hands it back (``malloc_trim``); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("shmstaged")


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim() -> None:
    """Give the heap's free memory back to the kernel, where the C library can (blocking:
    call it off the event loop; ctypes releases the GIL meanwhile)."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)
