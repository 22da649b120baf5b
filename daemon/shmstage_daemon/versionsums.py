"""Each published version's CRC-32C per tensor, computed off the event loop once it is
visible, so that its readers can verify what they copy.

A save's checksums come from its persist job, which reads every byte to write the files
(``gather``). A version made by ``publish()`` goes to no disk, so nothing would read it:
here a thread maps the slot's segments read-only and checksums every tensor in place
(``shmstage.checksums.checksums``: pieces on a few threads, the CRC-32C instruction at
~10 GB/s per thread, releasing the GIL), then the result comes back to the loop, which
attaches it to the version (``Channels.checksummed``) and answers the readers waiting for
it. It starts only after the "published" answer, so it never adds to the publisher's
stall; readers are woken at once and never wait for it unless they ask to.

A version whose slot is refilled meanwhile has no use for its checksums: a task that has
not started yet skips it (``wanted``), and the loop drops a result that came too late.
Versions are taken in turns between users (``FairExecutor``), one at a time: a user
publishing large versions back to back delays only its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Sequence
from typing import Final

from shmstage import checksums, segment
from shmstage.layout import Layout
from shmstage.segment import SegmentRef
from shmstage_daemon.channels import Channels, Version
from shmstage_daemon.fairness import FairExecutor
from shmstage_daemon.gather import open_segment

log = logging.getLogger("shmstaged.publish")

#: Threads checksumming one version's pieces: 7 GiB in ~0.2 s at ~10 GB/s each, without
#: taking the node's memory bandwidth from the trainer's next copy.
PIECE_THREADS: Final = 4


def compute(
    layout: Layout, refs: Sequence[SegmentRef], pool: concurrent.futures.Executor
) -> list[int]:
    """Every tensor's CRC-32C (layout order) in the staged segments ``refs``, read where
    they are through a read-only mapping."""
    region = segment.Region([ref.size for ref in refs])
    try:
        for index, ref in enumerate(refs):
            fd = open_segment(ref)
            try:
                segment.check_size(fd, ref)
                region.map(index, fd, writable=False)
            finally:
                os.close(fd)
        whole = memoryview(region.buffer()).cast("B")
        places = layout.packing_for(len(refs)).places
        try:
            views = [
                whole[region.offsets[which] + offset : region.offsets[which] + offset + size]
                for (which, offset), size in zip(places, layout.sizes, strict=True)
            ]
            try:
                return checksums.checksums(views, pool)
            finally:
                for view in views:
                    view.release()
        finally:
            whole.release()
    finally:
        region.close()


class VersionSums:
    """Checksums versions on threads of its own and hands each result to ``channels``."""

    def __init__(self, channels: Channels) -> None:
        self._channels = channels
        self._versions = FairExecutor(1, "shmstage-versionsum")
        self._pieces = concurrent.futures.ThreadPoolExecutor(
            PIECE_THREADS, thread_name_prefix="shmstage-piecesum"
        )

    def start(self, version: Version, uid: int) -> None:
        """Checksum ``version`` (just made visible) as ``uid``'s task, in turn."""
        loop = asyncio.get_running_loop()
        staged, slot = version.staged, version.slot
        layout, refs = staged.layout, list(slot.segments)

        def run() -> list[int] | None:
            # A read of what the loop owns, as a hint only: the loop checks again.
            if slot.version is not version:
                return None
            return compute(layout, refs, self._pieces)

        future = asyncio.wrap_future(self._versions.submit_for(uid, run), loop=loop)
        future.add_done_callback(lambda done: self._done(version, done))

    def _done(self, version: Version, future: asyncio.Future[list[int] | None]) -> None:
        sums: list[int] | None = None
        if future.cancelled():
            pass
        elif (error := future.exception()) is not None:
            log.warning("version %d: no checksums (%s)", version.step, error)
        else:
            sums = future.result()
        self._channels.checksummed(version, sums)

    def shutdown(self) -> None:
        self._versions.shutdown(wait=False, cancel_futures=True)
        self._pieces.shutdown(wait=False, cancel_futures=True)

