"""Restores from memory: leases on checkpoints the daemon still holds (lease, latest,
renew, unlease, restored).

A reader leases a slot holding an acknowledged checkpoint — the exact one whose data file
it opened (``lease``), or its user's newest (``latest``) — and gets the slot's segments
read-only; while the lease lasts the slot is never refilled. The rules of who may lease
what, and for how long, are ``retention``'s; this is the conversation.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Awaitable, Callable
from typing import Any

from shmstage import segment
from shmstage.protocol import ErrorCode, Frame
from shmstage_daemon import requests
from shmstage_daemon.requests import RequestError
from shmstage_daemon.retention import Lease, Retention, writers
from shmstage_daemon.session import Handler, Session
from shmstage_daemon.slot import Slot
from shmstage_daemon.telemetry import Telemetry
from shmstage_daemon.transport import close_fds

log = logging.getLogger("shmstaged.session")

#: "restored" reports of restores from files one session may add to the metrics.
MAX_FILE_RESTORE_REPORTS = 4


class Restores:
    """The lease ops of one session, and what its "restored" reports may still count."""

    def __init__(
        self,
        session: Session,
        retention: Retention,
        telemetry: Telemetry,
        *,
        run_io: Callable[..., Awaitable[Any]],
    ) -> None:
        self._session = session
        self._retention = retention
        self._telemetry = telemetry
        #: Runs blocking work (who holds a segment open for writing) in an I/O thread.
        self._run_io = run_io
        #: What this session's "restored" reports may still count (see ``restored``):
        #: one from memory per lease it held to its end, a few from files.
        self._memory_restores = 0
        self._file_restores = MAX_FILE_RESTORE_REPORTS

    def ops(self) -> dict[str, Handler]:
        return {
            "lease": self.lease,
            "latest": self.latest,
            "renew": self.renew,
            "unlease": self.unlease,
            "restored": self.restored,
        }

    async def lease(self, frame: Frame) -> None:
        """Lease the exact checkpoint whose data file the client opened and whose manifest
        hashes to ``digest``: the daemon compares identities, never resolves a path."""
        try:
            if len(frame.fds) != 1:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"lease needs 1 descriptor (the checkpoint's data file, opened for "
                    f"reading), got {len(frame.fds)}",
                )
            st = requests.readable_fd(frame.fds[0], "lease", stat.S_ISREG, "a regular file")
        finally:
            close_fds(frame.fds)
        entry = self._retention.find((st.st_dev, st.st_ino), frame.body["digest"])
        # Another user's checkpoint this caller may not read is, to it, not in memory: a
        # refusal that said so would tell it what another user keeps there, and whose.
        if entry is None or not self._retention.may_read(self._session.peer, entry[2]):
            self._telemetry.leased("not_retained")
            raise RequestError(
                ErrorCode.NOT_RETAINED,
                "shmstaged does not hold this checkpoint in memory for you (never, refilled, "
                "given back, its files changed since, or another user's, which only members "
                "of its [server] restore_groups may restore from memory); read it from its "
                "files",
            )
        await self._grant(frame, entry, structure=False)

    async def latest(self, frame: Frame) -> None:
        """Lease this user's newest acknowledged checkpoint in memory, durable or still
        being written; optionally of one structure, in one parent directory (descriptor)."""
        parent = None
        try:
            if len(frame.fds) > 1:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"latest takes at most 1 descriptor (the parent directory), got "
                    f"{len(frame.fds)}",
                )
            if frame.fds:
                st = requests.readable_fd(frame.fds[0], "latest", stat.S_ISDIR, "a directory")
                parent = (st.st_dev, st.st_ino)
        finally:
            close_fds(frame.fds)
        uid = self._session.peer.uid
        entry = self._retention.newest_of(uid, frame.body.get("structure"), parent)
        if entry is None:
            self._telemetry.leased("not_retained")
            raise RequestError(
                ErrorCode.NOT_RETAINED,
                f"shmstaged holds no checkpoint of uid {self._session.peer.uid} in memory"
                + (" of that structure" if "structure" in frame.body else "")
                + (" in that directory" if parent is not None else ""),
            )
        await self._grant(frame, entry, structure=True)

    async def _grant(self, frame: Frame, entry: Any, *, structure: bool) -> None:
        staged, slot, held = entry
        batch = requests.fds_per_message(frame)
        session = self._session
        lease = self._retention.grant(session.id, session.peer, entry, frame.body.get("seconds"))
        body: dict[str, Any] = {
            "lease": lease.id,
            "seconds": lease.expires - lease.granted,
            "job": held.job,
            "segments": len(slot.segments),
            "sizes": list(staged.layout.packing().sizes),
            "durable": held.durable,
            "digest": held.digest,
            "directory": held.directory,
            "data_file": held.data_file,
            "acknowledged_unix": held.acknowledged_unix,
        }
        if structure:  # the daemon's own record: latest() needs no manifest from a path
            body.update(
                tensors=staged.layout.to_wire(),
                tree=held.tree,
                metadata=held.metadata,
                checksums=held.checksums,
            )
        log.info(
            "%s leased job %d (uid %d, %s) for %.0f s",
            self._session.describe(),
            held.job,
            held.uid,
            "durable" if held.durable else "still being written",
            body["seconds"],
        )
        try:
            if self._session.peer.uid != held.uid:
                await self._unwritten(lease, slot)
            try:
                await self._session.send("leased", frame.id, body)
            except ValueError as exc:  # the structure does not fit one frame: nothing sent
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"the checkpoint's structure is too large to send ({exc}); restore it "
                    "by path, load(path), which reads the structure from its manifest",
                ) from None
            await self._session.send_segments(
                frame.id, "lease_fds", {"lease": lease.id}, slot.segments, batch, writable=False
            )
        except segment.SegmentError as exc:
            self._retention.end(lease)
            raise RequestError(ErrorCode.NOT_RETAINED, str(exc)) from None
        except BaseException:  # a refusal above, or the client gone
            if lease.id in self._retention.leases:
                self._retention.end(lease)
            raise

    async def _unwritten(self, lease: Lease, slot: Slot) -> None:
        """Another user's lease holds only a slot nobody can write (see ``retention``): the
        kernel counts no writer of its segments now, and the daemon hands none out while
        the lease lasts. Refused otherwise: the reader reads the files."""
        try:
            written = await self._run_io(writers, slot.segments)
        except segment.SegmentError:
            raise
        except OSError as exc:
            written = f"its segments cannot be checked now ({exc.strerror or exc})"
        else:
            if written is not None:
                written = f"a process still holds its segment {written} open for writing"
        if lease.id not in self._retention.leases:
            raise RequestError(
                ErrorCode.NOT_RETAINED,
                f"the lease ended while it was granted ({lease.revoked or 'expired'}); "
                "read the checkpoint from its files",
            )
        if written is not None:
            self._telemetry.leased("refused")
            raise RequestError(
                ErrorCode.NOT_RETAINED,
                f"uid {self._session.peer.uid} may not lease uid {lease.staged.uid}'s checkpoint "
                f"(job {lease.job}) from memory: {written} (its trainer, or a process it "
                "gave them to); read it from its files",
            )

    async def renew(self, frame: Frame) -> None:
        lease = self._retention.lease_of(self._session.id, frame.body["lease"])
        seconds = self._retention.renew(lease, frame.body.get("seconds"))
        await self._session.send("renewed", frame.id, {"lease": lease.id, "seconds": seconds})

    async def unlease(self, frame: Frame) -> None:
        """End a lease; ``held`` tells the reader whether it was still in force (if not,
        the slot may have been refilled while it read)."""
        lease = self._retention.leases.get(frame.body["lease"])
        held = lease is not None and lease.session == self._session.id
        if held:
            self._retention.end(lease)  # type: ignore[arg-type]
            self._memory_restores += 1
        await self._session.send("unleased", frame.id, {"lease": frame.body["lease"], "held": held})

    async def restored(self, frame: Frame) -> None:
        """How a restore went (never answered): for the metrics. It is only the client's
        word, so a session's reports count only as far as it could have restored: from
        memory once per lease it held to its end, from files a few times (a restore opens
        a connection of its own and reports once); the rest are dropped."""
        body = frame.body
        if body["source"] == "memory":
            if not self._memory_restores:
                return
            self._memory_restores -= 1
        elif body["source"] == "files":
            if not self._file_restores:
                return
            self._file_restores -= 1
        self._telemetry.restored(body["source"], requests.finite(body["seconds"]), body["bytes"])
