"""``mmap``, ``munmap`` and ``madvise`` through libc, for segments and staging memory alike.

Python's ``mmap.mmap`` holds the GIL while the kernel maps and faults pages in, keeps a
dup of the descriptor for the mapping's life, and cannot map at a chosen address; ctypes
calls release the GIL and do exactly what is asked. ``segment.Region`` maps shared-memory
segments back to back with these, ``hostmemory`` a restore's anonymous staging buffers.
"""

from __future__ import annotations

import ctypes
from typing import Final

libc: Final = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

_MAP_FAILED: Final = ctypes.c_void_p(-1).value


def failed(address: int | None) -> bool:
    """Whether ``libc.mmap`` returned its error value (the errno says why)."""
    return address is None or address == _MAP_FAILED
