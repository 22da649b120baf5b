"""The process's descriptor table, grown once to the size a batch of segments needs.

Linux grows a process's file descriptor table by doubling (64, 128, 256, ...) as
descriptors are installed, and in a process with more than one thread each growth waits
for an RCU grace period (``expand_fdtable`` calls ``synchronize_rcu``) while every other
thread that opens a descriptor waits too. A trainer is always multi-threaded (torch starts
threads on import), so receiving 500 segments' descriptors in a new process grew its table
four times on the way to 1,024 entries: 39-48 ms on the H100 host (28-34 ms on a 2-core
build host), where one growth straight to that size took 6-8 ms (12 ms) and the 600
descriptors then went in in 0.2 ms. The daemon
reserves its table at start, while it is still single-threaded and growing costs no grace
period at all. Before a lease the client grows its table once for the batches and the
descriptors it keeps together: a restarted trainer's ``latest()`` otherwise grew it twice
(to 1,024 entries, then 2,048). A growth also holds up every descriptor the process opens
meanwhile (its socket, the next batch), so a thread of its own would hide nothing.

Tables never shrink, so a reservation is paid once per process. ``FDSize`` in
``/proc/self/status`` says how large the table is; growing it is a copy of a descriptor
onto the highest one needed, closed at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
from typing import Final

#: Never reserve more than this many entries (8 bytes each plus bitmaps): a layout of more
#: segments than this arrives in batches anyway.
MAX_RESERVE: Final = 1 << 16


def table_size() -> int:
    """Entries in this process's descriptor table now (0 where ``/proc`` does not say)."""
    try:
        fd = os.open(_STATUS, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        return _fd_size(fd)
    finally:
        os.close(fd)


def reserve(count: int) -> int:
    """Grow the descriptor table to hold descriptors 0 to ``count - 1`` (at most the soft
    RLIMIT_NOFILE and ``MAX_RESERVE``) in one step, if it is smaller; returns its size.

    Best effort: where the table cannot be grown (no ``/proc``, a limit in the way) the
    kernel grows it as descriptors arrive, as it would have anyway. Nothing open is
    touched: the copy goes to the lowest free descriptor at or above the highest one
    needed (``F_DUPFD``), never onto one in use.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = MAX_RESERVE
    highest = min(count, soft, MAX_RESERVE) - 1
    try:
        fd = os.open(_STATUS, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        size = _fd_size(fd)
        if size and highest >= size:
            with contextlib.suppress(OSError):
                os.close(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, highest))
            size = _fd_size(fd)
        return size
    finally:
        os.close(fd)


_STATUS: Final = "/proc/self/status"


def _fd_size(fd: int) -> int:
    """``FDSize`` from the open ``/proc/self/status`` (read afresh from its start)."""
    try:
        text = os.pread(fd, 1 << 16, 0)
        for line in text.splitlines():
            if line.startswith(b"FDSize:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0
