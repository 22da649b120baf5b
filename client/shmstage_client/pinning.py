"""Page-locking the shared-memory segments for CUDA, so device-to-host copies run at pinned speed.

A D2H copy into an ordinary /dev/shm mapping runs at pageable speed (~20 GB/s on an H200)
because the driver bounces it through its own pinned buffer; after ``cudaHostRegister`` the
same mapping takes the copy engine's full rate (~55 GB/s). Registration is paid once per
layout, never per save.

The CUDA runtime is called through ctypes (``shmstage_client.cudart``): a failed
``cudaHostRegister`` leaves a sticky error, which is cleared there, and pinning falls back
to unpinned copies with one warning.
Registrations are split into chunks (one call of 512 GiB or more fails), and every range is
unregistered before it is unmapped (registering a range that was unmapped while registered
fails later with error 712).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import warnings
from collections.abc import Sequence
from typing import Final

import torch

from shmstage import segment
from shmstage_client import cudart

#: Pinned for every CUDA context in the process, not only the current device's.
HOST_REGISTER_PORTABLE: Final = 0x01
#: Well below the 512 GiB at which a single registration fails.
MAX_REGISTER_BYTES: Final = 256 << 30
_PAGE: Final = mmap.PAGESIZE


class PinError(cudart.CudaError):
    """Registration failed; the message names the CUDA error and what happens instead."""


#: What a pinning attempt may fail with (no libcudart, a CUDA error, a missing symbol);
#: each means unpinned copies, never a failed save.
PIN_FAILURES: Final = cudart.UNAVAILABLE


class PinnedRanges:
    """Address ranges registered with CUDA; ``release`` must run before they are unmapped."""

    def __init__(self) -> None:
        self._bases: list[int] = []

    def __len__(self) -> int:
        return len(self._bases)

    def register(
        self, buffers: Sequence[torch.Tensor], device: torch.device | None = None
    ) -> None:
        """Touch and register each uint8 buffer, large layouts on several threads (see
        ``segment.setup_groups``); all or nothing. ``device``: whose context the setup
        threads register in (None: each thread's current device, device 0 in a new one —
        which on a multi-GPU node would give the rank a context there)."""
        cudart.runtime()  # without CUDA this fails here, before any setup thread starts

        def pin(index: int) -> None:
            buffer = buffers[index]
            if buffer.numel() == 0:
                return
            prefault(buffer)
            with contextlib.nullcontext() if device is None else torch.cuda.device(device):
                register_range(
                    buffer.data_ptr(), buffer.numel(), HOST_REGISTER_PORTABLE, self._bases
                )

        try:
            segment.in_parallel([buffer.numel() for buffer in buffers], pin)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        failures = unregister(self._bases)
        if failures:
            warnings.warn(
                f"shmstage: cudaHostUnregister failed for {len(failures)} range(s): {failures[0]}",
                RuntimeWarning,
                stacklevel=2,
            )


def register_range(address: int, size: int, flags: int, bases: list[int]) -> None:
    """Register ``size`` bytes at ``address`` in calls under ``MAX_REGISTER_BYTES`` (one of
    512 GiB fails), appending each registered base to ``bases`` (``list.append`` is atomic,
    so setup threads share one list); raises PinError after clearing CUDA's sticky error,
    leaving what it registered in ``bases`` for the caller to release."""
    runtime = cudart.runtime()
    for start in range(0, size, MAX_REGISTER_BYTES):
        length = min(MAX_REGISTER_BYTES, size - start)
        code = runtime.lib.cudaHostRegister(address + start, length, flags)
        if code != 0:
            runtime.clear_sticky_error()  # CUDA's last error is per thread: here
            raise PinError(f"cudaHostRegister of {length} bytes failed: {runtime.error(code)}")
        bases.append(address + start)


def unregister(bases: list[int]) -> list[str]:
    """Unregister every base (before its range is unmapped); empties ``bases`` and returns
    the errors of those that failed (their sticky errors cleared)."""
    if not bases:
        return []
    runtime = cudart.runtime()
    failures = []
    for base in bases:
        code = runtime.lib.cudaHostUnregister(base)
        if code != 0:
            runtime.clear_sticky_error()
            failures.append(runtime.error(code))
    bases.clear()
    return failures


def region_pieces(region: segment.Region, count: int) -> list[tuple[int, int]]:
    """A mapped range cut, at segment boundaries, into about ``count`` pieces of about
    equal bytes, as (start, end) offsets: each is registered in one call, and a copy whose
    host memory spans two registrations fails (cudaErrorInvalidValue)."""
    count = max(1, count)
    cuts = [0]
    for offset in region.offsets[1:]:
        if offset >= len(cuts) * region.size / count:
            cuts.append(offset)
    cuts.append(region.size)
    return list(itertools.pairwise(cuts))


def prefault(buffer: torch.Tensor) -> None:
    """Fault the pages in, writable, before registering them: cudaHostRegister costs
    ~0.034-0.12 s/GiB on pages already in the page table against ~0.28-0.33 on untouched
    ones.

    One read-modify-write of a byte per page (``add_(0)``): it leaves every byte as it was
    — an adopted layout's slot still holds the checkpoint a restart may restore — as long
    as nothing else writes the buffer meanwhile (it would undo such a write), and, run
    on the setup threads' pieces, it scales where ``madvise(MADV_POPULATE_WRITE)`` does
    not: on the H100 host (Firecracker), 0.060 s/GiB on 8 threads against 0.136 for the
    madvise, whose page-table work serialises beyond two threads. Called on each setup
    thread's own piece (``PinnedRanges.register``).
    """
    if buffer.numel() == 0:
        return
    buffer[::_PAGE].add_(0)


def page_pieces(size: int, piece_bytes: int) -> list[tuple[int, int]]:
    """``size`` bytes cut into pieces of ``piece_bytes`` (rounded up to whole pages), as
    (start, end) offsets: a range registered a piece at a time, each copied as soon as it is
    registered. A copy must then never span two pieces (cudaErrorInvalidValue)."""
    step = max(_PAGE, -(-piece_bytes // _PAGE) * _PAGE)
    return [(start, min(start + step, size)) for start in range(0, size, step)] or [(0, 0)]


def prefault_read(address: int, size: int) -> None:
    """Read a byte of every page at ``address``, mapped read-only, before registering it:
    cudaHostRegister of a fresh read-only mapping of resident shm pages costs ~0.077 s/GiB,
    against ~0.041 once the pages are in the page table, and this read costs ~0.005 s/GiB
    (a read fault maps its neighbours too; MADV_POPULATE_READ took 0.032 s/GiB and
    MAP_POPULATE 0.045, on the H100 host, 2026-11-27). Writes nothing, so it suits a
    mapping this process may only read."""
    if size <= 0:
        return
    view = (ctypes.c_char * size).from_address(address)
    torch.frombuffer(view, dtype=torch.uint8)[::_PAGE].max()


def try_pin(buffers: list[torch.Tensor]) -> PinnedRanges | None:
    """Pin, or explain once why copies will run at pageable speed instead."""
    ranges = PinnedRanges()
    try:
        ranges.register(buffers)
    except PIN_FAILURES as exc:
        warnings.warn(
            f"shmstage: could not pin the staging segments ({exc}); GPU copies will run "
            "unpinned, at roughly a third of pinned bandwidth",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return ranges
