"""What ``shmstage status`` and the metrics show, and to whom.

Root, the daemon's own user and the operator groups see every user's clients, jobs,
channels and errors; anyone else sees its own figures only (``sees_everyone``): uids,
pids, checkpoint paths, channel names and even the node's sums of other users are theirs
(a channel shared with a user is still its owner's: it is not listed to the user).
Everything here is read on the event loop and returned as plain data (it travels as
msgpack).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from shmstage.protocol import ErrorCode, Frame
from shmstage.units import format_size
from shmstage_daemon.admission import Peer
from shmstage_daemon.channels import Channels
from shmstage_daemon.config import measure_shm
from shmstage_daemon.jobs import JobRecord, Jobs
from shmstage_daemon.requests import RequestError
from shmstage_daemon.retention import Retention
from shmstage_daemon.session import Session
from shmstage_daemon.settings import Settings
from shmstage_daemon.store import StagedLayout, Store, UserUsage
from shmstage_daemon.telemetry import Telemetry


class Status:
    """The daemon's figures, as a viewer may see them."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        retention: Retention,
        telemetry: Telemetry,
        sessions: dict[int, Session],
        jobs: Jobs,
        stats: dict[str, int],
        identity: Callable[[], dict[str, Any]],
        started: float,
        channels: Channels,
    ) -> None:
        self._settings = settings
        self._store = store
        self._retention = retention
        self._telemetry = telemetry
        self._sessions = sessions
        self._jobs = jobs
        self._stats = stats
        #: The daemon's own part of the status (version, instance, socket, journal...).
        self._identity = identity
        self._started = started
        self._channels = channels

    def sees_everyone(self, peer: Peer) -> bool:
        """Root, the daemon's own user and the operator groups see every user's clients,
        jobs and errors; anyone else only their own (uids, pids and checkpoint paths of
        other users are theirs)."""
        return peer.uid in (0, os.geteuid()) or bool(peer.groups & self._settings.operator_gids)

    def status(self, viewer: Peer | None = None) -> dict[str, Any]:
        """Everything ``shmstage status`` shows (to ``viewer``); plain data (it travels as
        msgpack). Costs what the viewer may see: the sessions and jobs of its uid."""
        now = time.perf_counter()
        cap = measure_shm()
        store = self._store
        limits = store.limits
        only = None if viewer is None or self.sees_everyone(viewer) else viewer.uid
        own = store.usage.get(only, UserUsage()) if only is not None else UserUsage()
        sessions = [s for s in self._sessions.values() if only is None or s.peer.uid == only]
        jobs = {
            jid: r
            for jid, r in self._jobs.records.items()
            if only is None or r.session.peer.uid == only
        }
        memory = self._memory(
            x for x in store.layouts.values() if only is None or x.uid == only
        )
        if only is not None:
            memory.update(self._own_retention(only))
        return {
            **self._identity(),
            # An ordinary user's own figures only: the node's sums changed when another
            # user's trainer registered or died, which told its layout's size and when.
            "shm_reserved_bytes": store.reserved_bytes if only is None else own.bytes,
            "shm_budget_bytes": limits.shm_budget_bytes,
            "shm": {
                "total_bytes": cap.shm_total,
                "free_bytes": cap.shm_free,
                "memory_available_bytes": cap.mem_available,
            },
            "limits": {**limits.to_wire(), "default_slots": self._settings.default_slots},
            "clients": [self._client_status(s, jobs) for s in sessions],
            "memory": memory,
            "jobs": [
                {
                    "job": jid,
                    "client": r.session.id,
                    "client_pid": r.session.peer.pid,
                    "directory": r.directory,
                    "data_file": r.persist.destination.data_file,
                    "bytes": r.persist.layout.nbytes,
                    "bytes_written": r.persist.progress.written,
                    "phase": r.persist.progress.phase,
                    "running_seconds": now - r.started,
                }
                for jid, r in jobs.items()
            ],
            "channels": [
                self._channels.summary(channel)
                for channel in list(self._channels.channels.values())
                if only is None or channel.uid == only
            ],
            "recent": self._telemetry.recent(uid=only),
            "errors": self._telemetry.recent_errors(uid=only),
            "totals": dict(self._stats) if only is None else self._telemetry.totals(only),
            "restricted_to_uid": only,
        }

    def _memory(self, layouts: Iterable[StagedLayout]) -> dict[str, Any]:
        """The checkpoints in memory (each layout's newest) and the policy, for status."""
        now_mono, now = time.monotonic(), time.time()
        checkpoints = []
        for staged in layouts:
            slot = staged.newest()
            if slot is None or slot.held is None or staged.released:
                continue
            held = slot.held
            expires = None
            if staged.retained is not None:
                expires = max(self._retention.policy.ttl - (now_mono - staged.retained), 0.0)
            checkpoints.append(
                {
                    "uid": held.uid,
                    "layout": staged.id,
                    "job": held.job,
                    "directory": held.directory,
                    "data_file": held.data_file,
                    "bytes": held.nbytes,
                    "memory_bytes": staged.bytes_reserved,
                    "age_seconds": now - held.acknowledged_unix,
                    "durable": held.durable,
                    "retained": staged.retained is not None,
                    "expires_seconds": expires,
                    "leases": sum(len(s.leases) for s in staged.slots),
                }
            )
        return {
            **self._retention.policy.to_wire(),
            "retained_bytes": self._store.retained_bytes,
            "retained_layouts": len(self._store.retained),
            "leases": len(self._retention.leases),
            "checkpoints": checkpoints,
        }

    def _own_retention(self, uid: int) -> dict[str, int]:
        """Retention's node-wide figures, as far as they are ``uid``'s own."""
        retained = [x for x in self._store.retained.values() if x.uid == uid]
        return {
            "retained_bytes": sum(x.bytes_reserved for x in retained),
            "retained_layouts": len(retained),
            "leases": sum(1 for lease in self._retention.leases.values() if lease.uid == uid),
        }

    def _client_status(self, session: Session, jobs: dict[int, JobRecord]) -> dict[str, Any]:
        layouts = self._store.layouts_of(session.id)
        usage = self._store.usage.get(session.peer.uid)
        return {
            "id": session.id,
            "name": session.client_name,
            "pid": session.peer.pid,
            "uid": session.peer.uid,
            "connected_seconds": time.time() - session.started,
            "layouts": len(layouts),
            "segments": sum(x.segment_count for x in layouts),
            "bytes": sum(x.bytes_reserved for x in layouts),
            "jobs": sum(1 for r in jobs.values() if r.session is session),
            "user_jobs": usage.jobs if usage is not None else 0,
        }

    def metrics(self) -> dict[str, Any]:
        """A snapshot of the metrics registry, with the gauges read now."""
        store = self._store
        return self._telemetry.snapshot(
            {
                "clients": len(self._sessions),
                "jobs_in_flight": len(self._jobs),
                "shm_reserved_bytes": store.reserved_bytes,
                "shm_budget_bytes": store.limits.shm_budget_bytes,
                "segments": sum(x.segment_count for x in store.layouts.values()),
                "retained_bytes": store.retained_bytes,
                "retained_layouts": len(store.retained),
                "leases": len(self._retention.leases),
                "uptime_seconds": time.time() - self._started,
            }
        )

    def status_line(self) -> str:
        """The one line ``systemctl status`` shows (systemd's STATUS=)."""
        writing = len(self._jobs)
        return (
            f"{len(self._sessions)} client(s), {format_size(self._store.reserved_bytes)} "
            f"staged of {format_size(self._store.limits.shm_budget_bytes)}, {writing} job(s) "
            f"writing, {self._stats['saves']} saved, {self._stats['failed']} failed"
        )


class Asking:
    """The ``status`` and ``metrics`` ops of one session."""

    def __init__(self, view: Status, session: Session) -> None:
        self._view = view
        self._session = session

    def ops(self) -> dict[str, Callable[[Frame], Any]]:
        return {"status": self.status, "metrics": self.metrics}

    async def status(self, frame: Frame) -> None:
        session = self._session
        await session.send("status", frame.id, {"status": self._view.status(session.peer)})

    async def metrics(self, frame: Frame) -> None:
        """The node's metrics: every user's saves, bytes and restores summed, so only for
        those who may see every user (``sees_everyone``); ``status`` shows anyone its own."""
        peer = self._session.peer
        if not self._view.sees_everyone(peer):
            raise RequestError(
                ErrorCode.NOT_ALLOWED,
                f"uid {peer.uid} may not read shmstaged's metrics (they sum every "
                "user's activity): run as root or shmstaged's user, or join a group in its "
                "[server] operator_groups; `shmstage status` shows your own",
            )
        await self._session.send("metrics", frame.id, {"metrics": self._view.metrics()})
