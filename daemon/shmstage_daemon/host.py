"""What a session may ask of the daemon that hosts it.

A session (``session``) serves one connection; the daemon (``server``) owns everything the
sessions share. The session depends on this small interface, not on the daemon's module,
so the two never import each other: ``server`` creates sessions, and a session sees the
daemon only through ``SessionHost``. Anything a session needs from the daemon is listed
here, which is also where to look before a session grows a new dependency.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from shmstage.layout import Layout
from shmstage.segment import SegmentRef
from shmstage_daemon.admission import Peer
from shmstage_daemon.inflight import InFlight
from shmstage_daemon.retention import Retention
from shmstage_daemon.slot import Slot
from shmstage_daemon.store import SlotWire, StagedLayout, Store
from shmstage_daemon.telemetry import Telemetry

if TYPE_CHECKING:
    from shmstage_daemon import job

T = TypeVar("T")


class SessionHost(Protocol):
    """The daemon, as its sessions see it (the event loop's state and its workers)."""

    store: Store
    telemetry: Telemetry
    retention: Retention
    inflight: InFlight
    instance: str
    fsync: bool
    stopping: bool

    @property
    def default_slots(self) -> int: ...

    @property
    def journal_path(self) -> Path: ...

    # -- work off the event loop ------------------------------------------------------
    async def run_io(self, fn: Callable[..., T], *args: Any) -> T: ...

    def create_segments(self, layout: Layout, slots: int) -> list[list[SegmentRef]]: ...

    def check_capacity(self, nbytes: int) -> None: ...

    def unlink_later(self, names: list[str]) -> asyncio.Future[Any]: ...

    def track(self, future: asyncio.Future[Any]) -> None: ...

    # -- layouts, jobs and the journal ----------------------------------------------
    def release(self, staged: StagedLayout) -> None: ...

    def charge_journal(self, job_id: int, session_id: int, nbytes: int) -> None: ...

    async def journal_commit(
        self, persist: job.PersistJob, wire: SlotWire, peer: Peer, *, owed: bool = True
    ) -> None: ...

    async def journal_publish(self, job_id: int) -> None: ...

    def journal_discard(self, job_id: int) -> None: ...

    def abandon_job(
        self, session_id: int, staged: StagedLayout, slot: Slot, job_id: int
    ) -> None: ...

    def start_job(
        self, session: Any, staged: StagedLayout, slot: Slot, persist: job.PersistJob
    ) -> None: ...

    def session_closed(self, session: Any) -> None: ...

    # -- what the operator asks -------------------------------------------------------
    def status(self, viewer: Peer | None = None) -> dict[str, Any]: ...

    def sees_everyone(self, peer: Peer) -> bool: ...

    def metrics(self) -> dict[str, Any]: ...
