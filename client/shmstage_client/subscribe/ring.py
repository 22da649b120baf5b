"""The ring: a publisher's slots mapped read-only into this process, once each, and kept.

Every version of a channel lives in a slot of its publisher's layout, a fixed set that
the daemon reuses; so a subscriber maps each slot the first time a version lands in it
and keeps it for every later version there. For a CUDA device it also registers each
slot's mapping with CUDA once (``cudaHostRegister`` with ``cudaHostRegisterReadOnly``:
a read-only mapping cannot be registered without it), which costs ~0.04 s/GiB and makes
every later copy to the device run at pinned speed (55 GB/s against ~9 GB/s from an
unregistered mapping on an H100/H200 host). A publisher that changes its structure
registers a new layout: a new ring, and this one is retired once no open version uses it.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Sequence
from typing import Final

from shmstage import segment
from shmstage.layout import Layout
from shmstage_client import pinning

log = logging.getLogger("shmstage.client")

#: ``cudaHostRegisterReadOnly``: the device only reads the range (required for PROT_READ).
HOST_REGISTER_READ_ONLY: Final = 0x08


class Ring:
    """One publisher layout's slots, by the daemon's slot key, mapped ``PROT_READ``."""

    def __init__(self, ring_id: int, layout: Layout, sizes: Sequence[int]) -> None:
        if list(layout.packing().sizes) != list(sizes):
            raise ValueError("shmstaged sent a ring whose segment sizes do not match its tensors")
        self.id = ring_id
        self.layout = layout
        self.sizes = list(sizes)
        self._regions: dict[int, segment.Region] = {}
        #: Registered bases per slot (CUDA), and slots whose registration failed.
        self._registered: dict[int, list[int]] = {}
        self._unpinnable = False
        #: Open versions reading from this ring, and whether it was retired meanwhile.
        self._users = 0
        self._retired = False
        self._lock = threading.Lock()

    def has(self, slot: int) -> bool:
        return slot in self._regions

    def region(self, slot: int) -> segment.Region:
        return self._regions[slot]

    def map(self, slot: int, first: int, fds: Sequence[int]) -> None:
        """Map the next segments of ``slot`` (from segment ``first``); always closes ``fds``."""
        try:
            region = self._regions.get(slot)
            if region is None:
                if first != 0:
                    raise ValueError(f"segments of slot {slot} arrived from {first}, not 0")
                region = self._regions[slot] = segment.Region(self.sizes)
            if first + len(fds) > len(self.sizes):
                raise ValueError("shmstaged sent more segments than the ring's slot holds")
            for index, fd in enumerate(fds, first):
                region.map(index, fd, writable=False)
        finally:
            for fd in fds:
                os.close(fd)

    def drop(self, slot: int) -> None:
        """Forget a slot whose segments did not all arrive (mapped again next time)."""
        region = self._regions.pop(slot, None)
        if region is not None:
            region.close()

    def register(self, slot: int) -> bool:
        """Register ``slot``'s mapping with CUDA once (kept while the ring lives); False
        when CUDA refuses, after one warning: copies then run at pageable speed."""
        with self._lock:
            if slot in self._registered:
                return True
            if self._unpinnable:
                return False
            region = self._regions[slot]
            bases: list[int] = []
            flags = pinning.HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY
            try:
                pinning.register_range(region.address, region.size, flags, bases)
            except pinning.PIN_FAILURES as exc:
                pinning.unregister(bases)
                self._unpinnable = True
                warnings.warn(
                    f"shmstage: could not register the published slots with CUDA ({exc}); "
                    "versions will be copied to the device at pageable speed",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return False
            self._registered[slot] = bases
            return True

    def use(self) -> None:
        with self._lock:
            self._users += 1

    def done(self) -> None:
        with self._lock:
            self._users -= 1
            close = self._retired and not self._users
        if close:
            self._close()

    def retire(self) -> None:
        """No new version will come from this ring: close it once no version reads it."""
        with self._lock:
            self._retired = True
            close = not self._users
        if close:
            self._close()

    def _close(self) -> None:
        """Unregister every range before unmapping it (a range unmapped while registered
        makes later registrations fail with error 712)."""
        for bases in self._registered.values():
            failures = pinning.unregister(bases)
            if failures:
                log.warning("cudaHostUnregister failed for a published slot: %s", failures[0])
        self._registered.clear()
        for region in self._regions.values():
            region.close()
        self._regions.clear()
