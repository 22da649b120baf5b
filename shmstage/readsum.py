"""Reads that checksum their bytes while those are still in the processor's cache.

A restore reads every byte of a checkpoint out of shared memory (or a file) into a buffer
and checks it against the CRC-32C its manifest recorded. In two passes — ``preadv`` of a
16 MiB piece, then ``crc32c`` over it — the second pass reads the piece back from the
last-level cache or from memory: of the 4.1 thread-seconds 16 readers spent restoring
8 GiB on an H200 VM, 1.0-1.3 were that pass. ``read`` and ``copy`` here read a block of
1 MiB and checksum it straight after, from the core's own cache, in C (``_readsum.c``,
called through ctypes, which releases the GIL): 16 readers moved 8 GiB to an H200 in
0.245 s instead of 0.269 s, where reading alone took 0.229 s (docs/performance.md, "Restores").

The helper is built with the package where a C compiler is present (optional: the install
succeeds without one) and runs on x86-64 processors with SSE4.2. Elsewhere ``available()``
is False and callers read and checksum in two passes, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import os
from collections.abc import Sequence
from typing import Final

#: Set SHMSTAGE_NATIVE_READSUM=0 to read and checksum in two passes even where the helper
#: is built (for comparing the two; the checksums are the same).
ENABLED: Final = os.environ.get("SHMSTAGE_NATIVE_READSUM", "1") != "0"


def _load() -> ctypes.CDLL | None:
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("shmstage._readsum")
        if spec is not None and spec.origin:
            try:
                library = ctypes.CDLL(spec.origin)
            except OSError:
                return None
            if library.shmstage_readsum_init() != 0:
                return None  # no CRC-32C instruction here
            library.shmstage_read_sum.restype = ctypes.c_long
            library.shmstage_read_sum.argtypes = [
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_void_p,
            ]
            return library
    return None


_LIBRARY: Final = _load() if ENABLED else None


def available() -> bool:
    """Whether ``read`` and ``copy`` can run here (the helper is built and this processor
    has the instruction); if not, read and checksum in two passes."""
    return _LIBRARY is not None


def read(
    fd: int,
    offset: int,
    address: int,
    nbytes: int,
    spans: Sequence[tuple[int, int]],
    values: list[int],
    where: str,
) -> None:
    """``nbytes`` of ``fd`` from ``offset`` into memory at ``address``, continuing the
    CRC-32C in ``values`` of each span of them (``(lo, hi)`` offsets into the bytes read,
    ascending, not overlapping; a value is 0 to start). Raises OSError naming ``where``."""
    _run(fd, None, address, nbytes, offset, spans, values, where)


def copy(
    source: int,
    address: int,
    nbytes: int,
    spans: Sequence[tuple[int, int]],
    values: list[int],
    where: str,
) -> None:
    """``read``, from memory at ``source`` (a mapping) rather than a descriptor."""
    _run(-1, source, address, nbytes, 0, spans, values, where)


def _run(
    fd: int,
    source: int | None,
    address: int,
    nbytes: int,
    offset: int,
    spans: Sequence[tuple[int, int]],
    values: list[int],
    where: str,
) -> None:
    if _LIBRARY is None:
        raise RuntimeError("shmstage's native reads are not available here: check available()")
    before = 0
    for lo, hi in spans:
        if not before <= lo <= hi <= nbytes:
            raise ValueError(
                f"span ({lo}, {hi}) is not within the {nbytes} bytes read after the last one"
            )
        before = hi
    bounds = (ctypes.c_uint64 * (2 * len(spans)))(*[bound for span in spans for bound in span])
    sums = (ctypes.c_uint32 * len(spans))(*values)
    done = _LIBRARY.shmstage_read_sum(fd, source, address, nbytes, offset, bounds, len(spans), sums)
    values[:] = list(sums)
    if done == -errno.ENODATA:
        raise OSError(f"{where}: the file ended before {nbytes} bytes from {offset} were read")
    if done < 0:
        raise OSError(-done, f"{where}: {os.strerror(-done)}")
