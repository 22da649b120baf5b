"""A checkpoint in the daemon's memory, leased and mapped read-only into this process.

The daemon answers a ``lease`` (this exact checkpoint: its data file's descriptor and its
manifest's digest) or a ``latest`` (this user's newest) with the slot's segments as
read-only descriptors. They are mapped ``PROT_READ`` back to back in one address range
(``segment.Region``) and closed at once. While the lease holds, the daemon never refills
the slot, so what is read cannot change; ``end()`` says whether the lease still held when
the reading was done (it expires after the seconds the daemon granted, and dies with the
connection).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from typing import Any, Final

from shmstage import segment
from shmstage_client.connection import DaemonConnection, receivable_fds
from shmstage_client.errors import DaemonLost, SaveError

#: Seconds to wait for the daemon's answers (it maps nothing; this bounds a hung daemon).
REQUEST_TIMEOUT: Final = 30.0


class MemoryLease:
    """The segments of one leased slot, mapped read-only; ``body``: the daemon's answer
    (``leased``: job, sizes, durable, digest, directory, and for ``latest`` the structure)."""

    def __init__(self, connection: DaemonConnection, body: dict[str, Any]) -> None:
        self.connection = connection
        self.body = body
        self.id: int = body["lease"]
        self.sizes: list[int] = _sizes(body)
        self.region = segment.Region(self.sizes)
        self._mapped_range = True
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
    ) -> MemoryLease:
        """Ask for a lease (``op``: "lease" or "latest") and map what comes back; raises
        DaemonRefused ("not_retained" and others) or DaemonLost."""
        handle = connection.start(op, {**body, "max_fds": receivable_fds()}, fds)
        lease: MemoryLease | None = None
        try:
            reply = handle.next(timeout)
            if reply.op != "leased":
                raise DaemonLost(f"shmstaged answered {op} with {reply.op}")
            try:
                lease = cls(connection, reply.body)
            except (ValueError, segment.SegmentError):
                connection.post("unlease", {"lease": reply.body["lease"]})
                raise
            mapped = 0
            while mapped < len(lease.sizes):
                frame = handle.next(timeout)
                try:
                    if frame.op != "lease_fds" or frame.body["first"] != mapped:
                        raise DaemonLost(f"unexpected {frame.op} while receiving a lease")
                    for fd in frame.fds:
                        lease.region.map(mapped, fd, writable=False)
                        mapped += 1
                finally:
                    for fd in frame.fds:
                        os.close(fd)
        except BaseException:
            if lease is not None:
                lease.close()
            raise
        finally:
            handle.finish()
        return lease

    @property
    def address(self) -> int:
        return self.region.address

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
        if self._mapped_range:
            self._mapped_range = False  # twice would unmap whatever was mapped there since
            threading.Thread(target=self.region.close, name="shmstage-unmap", daemon=True).start()


def _sizes(body: dict[str, Any]) -> list[int]:
    sizes = body["sizes"]
    if (
        not isinstance(sizes, list)
        or len(sizes) != body["segments"]
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)
    ):
        raise ValueError("shmstaged sent a lease whose segment sizes do not add up")
    return sizes
