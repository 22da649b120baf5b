"""A checkpoint in the daemon's memory, leased read-only by this process.

The daemon answers a ``lease`` (this exact checkpoint: its data file's descriptor and its
manifest's digest) or a ``latest`` (this user's newest) with the slot's segments as
read-only descriptors. A reader that copies everything (``restore``) keeps the
descriptors and reads through them (``sources.SegmentSource``) when this process can hold
that many; otherwise, and for readers that want views (DCP), they are mapped ``PROT_READ``
back to back in one address range (``segment.Region``) and closed at once — batch by
batch, so that a process with a short descriptor table (``ulimit -n 40``) still restores
from memory, a few segments per message (``lease_batch``). While the lease holds, the
daemon never refills the slot, so what is read cannot change; ``end()`` says
whether the lease still held when the reading was done (it expires after the seconds the
daemon granted, and dies with the connection).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Sequence
from typing import Any, Final

from shmstage import segment
from shmstage.protocol import MAX_FDS_PER_FRAME
from shmstage_client import connection as _connection
from shmstage_client.connection import DaemonConnection, receivable_fds, room_for_fds
from shmstage_client.errors import DaemonLost, SaveError
from shmstage_client.restore.sources import MappedSource, SegmentSource, Source

#: Seconds to wait for the daemon's answers (it maps nothing; this bounds a hung daemon).
REQUEST_TIMEOUT: Final = 30.0
#: Descriptors a lease leaves free for everything else when the table is short: a lease
#: maps and closes each batch before the next comes, and opens at most a data file
#: meanwhile (a registration keeps its segments' descriptors: it needs more room).
SHORT_HEADROOM: Final = 8


class LeaseBroken(SaveError):
    """The daemon granted a lease whose segments could not be received or mapped (a
    truncated segment, descriptors short, the connection lost); ``body``: its answer,
    which names the checkpoint (directory, digest) for a reader that falls back to files."""

    def __init__(self, why: str, body: dict[str, Any]) -> None:
        super().__init__(why)
        self.body = body


def lease_batch() -> int:
    """Segments per message to ask for: ``receivable_fds``, or where the descriptor table
    is too short for that (it wants room for two batches of 253 and 32 spare) as many as
    fit two at a time in what is left, down to one — slower, never refused while a single
    descriptor fits; raises SaveError (naming the limit to raise) only then."""
    try:
        return receivable_fds()
    except SaveError:
        soft, in_use = _connection.descriptor_room()
        batch = (soft - in_use - SHORT_HEADROOM) // 2
        if batch < 1:
            raise
        return min(batch, MAX_FDS_PER_FRAME)


class MemoryLease:
    """The segments of one leased slot, mapped read-only; ``body``: the daemon's answer
    (``leased``: job, sizes, durable, digest, directory, and for ``latest`` the structure)."""

    def __init__(self, connection: DaemonConnection, body: dict[str, Any]) -> None:
        self.connection = connection
        self.body = body
        self.id: int = body["lease"]
        self.sizes: list[int] = _sizes(body)
        self.region = segment.Region(self.sizes)  # offsets; mapped only without ``fds``
        self._mapped_range = True
        #: The segments' descriptors, when kept instead of mapped (``take(keep_fds=True)``).
        self.fds: list[int] | None = None
        self._ended = False

    @classmethod
    def take(
        cls,
        connection: DaemonConnection,
        op: str,
        body: dict[str, Any],
        fds: Sequence[int] = (),
        *,
        timeout: float = REQUEST_TIMEOUT,
        keep_fds: bool = False,
        identities: list[tuple[int, int]] | None = None,
    ) -> MemoryLease:
        """Ask for a lease (``op``: "lease" or "latest") and map what comes back — or, with
        ``keep_fds`` and room for them in this process, keep the descriptors (``source``
        reads through them); raises DaemonRefused ("not_retained" and others), DaemonLost
        before the daemon answered, or LeaseBroken after (its answer kept). ``identities``
        gets each segment's (st_dev, st_ino), in order: which segments these are."""
        handle = connection.start(op, {**body, "max_fds": lease_batch()}, fds)
        lease: MemoryLease | None = None
        reply = None
        try:
            reply = handle.next(timeout)
            if reply.op != "leased":
                raise DaemonLost(f"shmstaged answered {op} with {reply.op}")
            try:
                lease = cls(connection, reply.body)
            except (ValueError, segment.SegmentError):
                connection.post("unlease", {"lease": reply.body["lease"]})
                raise
            if keep_fds and room_for_fds(len(lease.sizes)):
                lease.fds = []
            received = 0
            while received < len(lease.sizes):
                frame = handle.next(timeout)
                kept = 0  # the lease owns these now; the rest are closed here
                try:
                    if frame.op != "lease_fds" or frame.body["first"] != received:
                        raise DaemonLost(f"unexpected {frame.op} while receiving a lease")
                    if received + len(frame.fds) > len(lease.sizes):
                        raise DaemonLost("shmstaged sent more segments than it leased")
                    for fd in frame.fds:
                        if identities is not None:
                            st = os.fstat(fd)
                            identities.append((st.st_dev, st.st_ino))
                        if lease.fds is None:
                            lease.region.map(received, fd, writable=False)
                        else:
                            _check_size(fd, lease.region.sizes[received])
                            lease.fds.append(fd)
                            kept += 1
                        received += 1
                finally:
                    for fd in frame.fds[kept:]:
                        os.close(fd)
        except (SaveError, OSError, ValueError) as exc:
            if lease is not None:
                lease.close()
            if reply is None or reply.op != "leased" or isinstance(exc, LeaseBroken):
                raise
            raise LeaseBroken(str(exc) or type(exc).__name__, reply.body) from exc
        except BaseException:
            if lease is not None:
                lease.close()
            raise
        finally:
            handle.finish()
        return lease

    @property
    def address(self) -> int:
        if self.fds is not None:
            raise ValueError("this lease kept its descriptors: read through source()")
        return self.region.address

    def source(self, where: str) -> Source:
        """The leased bytes, for ``transfer``, at ``offsets()``."""
        if self.fds is not None:
            return SegmentSource(self.fds, self.region.offsets, self.region.sizes, where)
        return MappedSource(self.region.address, self.region.size, where)

    def offsets(self) -> list[int]:
        """Where each segment starts in the mapped range (page aligned)."""
        return list(self.region.offsets)

    def end(self) -> bool:
        """End the lease; True when it still held until now (nothing was refilled while
        this process read), False when it had expired or the daemon went away."""
        if self._ended:
            return False
        self._ended = True
        try:
            reply = self.connection.call("unlease", {"lease": self.id}, timeout=REQUEST_TIMEOUT)
        except SaveError:
            return False
        return bool(reply.body.get("held"))

    def close(self) -> None:
        """End the lease if ``end`` was not called, and unmap — on a thread of its own:
        tearing down the page tables of a mapping read end to end costs 0.1-0.5 s for
        8 GiB (H100 host), which the restore's caller need not wait for. Nothing may use
        the mapping after this (readers copy out of it), and nothing registered it."""
        if not self._ended:
            self._ended = True
            with contextlib.suppress(SaveError, OSError):
                self.connection.post("unlease", {"lease": self.id})
        if self.fds is not None:
            for fd in self.fds:
                os.close(fd)
            self.fds = []
        if self._mapped_range:
            self._mapped_range = False  # twice would unmap whatever was mapped there since
            threading.Thread(target=self.region.close, name="shmstage-unmap", daemon=True).start()


def _check_size(fd: int, size: int) -> None:
    """A kept segment must hold its bytes, as ``Region.map`` checks a mapped one."""
    actual = os.fstat(fd).st_size
    if actual < size:
        raise segment.SegmentError(
            errno.EINVAL, f"segment is {actual} bytes but {size} were expected"
        )


def _sizes(body: dict[str, Any]) -> list[int]:
    sizes = body["sizes"]
    if (
        not isinstance(sizes, list)
        or len(sizes) != body["segments"]
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)
    ):
        raise ValueError("shmstaged sent a lease whose segment sizes do not add up")
    return sizes
