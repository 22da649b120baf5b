"""A filled slot on its way to the daemon: the commit, its answers, and giving up cleanly.

``Stager.save`` sends the commit ahead of the copy (``ready=False``) and completes it once
the copy is done; ``Stager.stage`` hands the caller a ``Staged`` to commit later
(``Staged.commit``), the way PyTorch DCP learns each rank's file only after staging.
Either way a commit ends in exactly one of: a ``SaveHandle`` (the daemon owns the data),
or the slot handed back and everything created for the destination removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shmstage_client.connection import DaemonConnection, RequestHandle
from shmstage_client.errors import SaveError
from shmstage_client.save.destination import Fields, Target, open_target
from shmstage_client.save.handle import Clock, SaveHandle, SaveTimings, TimingViews, Tracker
from shmstage_client.statedict import check_fits

if TYPE_CHECKING:
    from shmstage_client.save.handover import Landing
    from shmstage_client.save.slots import MappedLayout

log = logging.getLogger("shmstage.client")


@dataclass
class Destination:
    """Everything a commit names: where (opened) and what (checked)."""

    target: Target
    fields: Fields

    def abort(self) -> None:
        """Remove what was created for this commit and close everything: it will not happen."""
        self.target.abort()


class Staged(TimingViews):
    """A filled slot waiting for its destination (``Stager.stage``).

    ``commit()`` hands it to the daemon to write; ``cancel()`` hands it back unwritten.
    Exactly one of them happens, once. Until then the slot is this client's, and later
    saves needing it wait — so resolve every Staged (as a context manager, leaving it
    uncommitted cancels). ``commit()`` may run on another thread than ``stage()`` did (DCP
    commits from its checkpoint thread), never concurrently with another call on it.

    ``timings``: what staging cost (its ``stall_seconds`` is the ``stage()`` call's own);
    the handle ``commit()`` returns adds the commit's part.

    Made by the Stager with what a commit needs of it: the ``connection`` the daemon granted
    the slot on (only that session may commit or cancel it), the ``tracker`` that follows
    its saves to their outcome and reports what they cost, how long to wait for the daemon
    (``request_timeout``) and the default ``data_file``.
    """

    def __init__(
        self,
        mapped: MappedLayout,
        slot: int,
        encoded: Any,
        packed_tree: bytes,
        *,
        connection: DaemonConnection,
        tracker: Tracker,
        request_timeout: float,
        data_file: str,
    ) -> None:
        self.connection = connection  # the daemon gave the slot to this session
        self._tracker = tracker
        self.request_timeout, self.data_file = request_timeout, data_file
        self.mapped = mapped
        self.layout_id = mapped.id
        self.slot = slot
        self.nbytes = mapped.layout.nbytes
        self._encoded = encoded
        self._packed_tree = packed_tree
        self.timings = SaveTimings()
        #: A non-blocking ``stage()``'s copy still on its way (``handover``); None once
        #: ``stage()`` returned with every byte copied.
        self.landing: Landing | None = None
        self._lock = threading.Lock()
        self._state = "staged"  # -> "committing" -> "committed" | "cancelled"

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    @property
    def open(self) -> bool:
        """Neither committed nor cancelled yet."""
        return self._state == "staged"

    def commit(
        self,
        path: str | os.PathLike[str],
        *,
        data_file: str | None = None,
        file_metadata: Mapping[str, str] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Have the daemon write the staged tensors to the new directory ``path``.

        ``data_file``: the data file's name (default: the Stager's ``data_file``).
        ``file_metadata``: strings for the safetensors header's ``__metadata__`` (default
        ``{"format": "pt"}``). ``metadata``: JSON values kept in the manifest. If the
        destination or the commit is refused, the slot is handed back and this raises. After
        a non-blocking ``stage()`` it first waits for the copy to land (within the Stager's
        ``request_timeout``; counted as ``copy_wait_seconds``).
        """
        clock = Clock()
        try:
            if self.landing is not None:
                self.landing.wait(self.request_timeout)
                clock.lap("copy_wait")
            fields = Fields.check(data_file or self.data_file, file_metadata, metadata)
            check_fits(self._encoded, self._packed_tree, fields.packed_metadata)
            clock.lap("prepare")
            destination = Destination(open_target(path, fields.data_file), fields)
            clock.lap("setup")
        except BaseException:
            self.cancel()
            raise
        handle = self.complete(destination, self.send_commit(destination, ready=True))
        clock.lap("commit")
        self._tracker.staged(handle, self.timings + clock.timings())
        return handle

    def cancel(self) -> None:
        """Hand the slot back unwritten; nothing to do once committed or cancelled."""
        with self._lock:
            if self._state != "staged":
                return
            self._state = "cancelled"
        timeout = self.request_timeout
        if self.landing is not None and not self.landing.settled(timeout):
            log.warning(
                "slot %d is still being copied into after %s s; it stays this client's until "
                "the copy ends and the Stager closes",
                self.slot,
                timeout,
            )
            return
        self._hand_back()

    def send_commit(self, destination: Destination, *, ready: bool) -> RequestHandle:
        """Send the commit; ``ready=False`` before the copy is complete (see ``Stager.save``)."""
        with self._lock:
            if self._state != "staged":
                destination.abort()
                raise SaveError(f"this staged save was already {self._state}; stage again")
            self._state = "committing"
        target = destination.target
        body: dict[str, Any] = {
            "layout": self.layout_id,
            "slot": self.slot,
            **destination.fields.wire(),
            **target.wire(),
        }
        if not ready:
            body["ready"] = False
        prepacked = {"tree": self._packed_tree, "metadata": destination.fields.packed_metadata}
        try:
            return self.connection.start("commit", body, target.fds(), prepacked=prepacked)
        except BaseException:
            self._give_up(destination)
            raise

    def complete(self, destination: Destination, request: RequestHandle) -> SaveHandle:
        """Hand the slot over (``hand_over``) and return the handle that follows the job."""
        job = self.hand_over(destination, request)
        path = destination.target.path
        assert path is not None
        return SaveHandle(self._tracker, self.connection, job, path)

    def hand_over(self, destination: Destination, request: RequestHandle) -> int:
        """Wait for the commit's answer; after a prepared one, report the copy complete.
        Returns the daemon's job id: from now on the daemon owns the data.

        Whatever fails, what was created for the destination goes and the slot is handed
        back (the daemon drops a prepared commit with it), then this raises.
        """
        timeout = self.request_timeout
        try:
            try:
                reply = request.next(timeout)
            finally:
                request.finish()
            if reply.op == "prepared":
                ready = {"layout": self.layout_id, "slot": self.slot, "job": reply.body["job"]}
                reply = self.connection.call("ready", ready, timeout=timeout)
        except BaseException as exc:
            self._give_up(destination)
            if isinstance(exc, SaveError) and "unknown fields" in str(exc):
                raise SaveError(
                    f"shmstaged at {self.connection.path} is older than this client (it "
                    f"does not know {exc}); upgrade shmstaged to the client's version"
                ) from exc
            raise
        finally:
            destination.target.close_fds()
        self._state = "committed"
        return int(reply.body["job"])

    def abandon(self, early: RequestHandle | None) -> None:
        """The copy failed: hand the slot back, dropping a commit sent ahead of it."""
        if early is None:
            self.cancel()
            return
        with contextlib.suppress(SaveError):
            early.next(30)  # "prepared" or a refusal: either way the slot is ours
        early.finish()
        self._state = "cancelled"
        self._hand_back()

    def _give_up(self, destination: Destination) -> None:
        """The commit will not happen: remove what was created for it, hand the slot back
        (the daemon refused or never saw the commit, or drops the prepared one with it)."""
        destination.abort()
        self._state = "cancelled"
        self._hand_back()

    def _hand_back(self) -> None:
        try:
            self.connection.call(
                "cancel", {"layout": self.layout_id, "slot": self.slot}, timeout=30
            )
        except SaveError as exc:
            log.warning("could not hand slot %d back to shmstaged: %s", self.slot, exc)
