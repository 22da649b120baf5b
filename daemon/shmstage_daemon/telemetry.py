"""What the daemon has done lately: metrics, recent throughput and recent errors.

Only the event loop calls into a Telemetry (from job completions and request handling), so
it needs no locks. Writer threads report through their job's result, never here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Final

from shmstage.metrics import BYTE_BUCKETS, SECOND_BUCKETS, Registry
from shmstage.protocol import RESTORE_SOURCES

RECENT_JOBS: Final = 64
RECENT_ERRORS: Final = 20
#: Errors echo what a client sent; kept ones are cut so that one hostile request cannot
#: make ``status`` (which carries them to everyone) larger than a frame.
MAX_ERROR_CHARS: Final = 500
#: A client-reported duration beyond this is not a measurement: dropped from the metrics,
#: so a hostile ``1e308`` cannot turn the histograms' sums into infinity.
MAX_REPORTED_SECONDS: Final = 7 * 86400.0
#: "Recent throughput" means the saves finished within this many seconds.
THROUGHPUT_WINDOW_S: Final = 300.0
#: Answers that are nobody's error: "not in memory" is how every ``load(path)`` of a
#: checkpoint the daemon no longer holds begins (it then reads the files). Counted in
#: ``leases_total{result="not_retained"}``; listed among the errors, they buried real ones.
NOT_ERRORS: Final = frozenset({"not_retained"})


@dataclass(frozen=True, slots=True)
class FinishedJob:
    job: int
    client: str
    finished_unix: float
    ok: bool
    bytes: int
    persist_seconds: float
    directory: str
    uid: int = -1


@dataclass(frozen=True, slots=True)
class RecentError:
    time_unix: float
    client: str
    code: str
    message: str
    job: int | None = None
    uid: int = -1


def plausible(seconds: float | None) -> bool:
    """A duration a client reported that may enter the metrics."""
    return seconds is not None and 0 <= seconds <= MAX_REPORTED_SECONDS


def shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Telemetry:
    def __init__(self) -> None:
        r = self.registry = Registry("shmstage")
        r.counter("saves_total", "Checkpoints the daemon finished, by result.", labelled=True)
        r.counter("bytes_written_total", "Checkpoint bytes written to storage.")
        r.counter("bytes_staged_total", "Bytes committed by trainers for writing.")
        r.counter("errors_total", "Errors answered to clients or hit by jobs, by code.",
                  labelled=True)
        r.counter("registrations_total", "Layouts registered (segments created).")
        r.counter("segments_created_total", "Shared-memory segments created for layouts.")
        r.counter("segments_adopted_total", "Segments of retained layouts taken over by a "
                  "registration of the same user and structure (none created for them).")
        r.counter("retained_total", "Layouts kept in memory after their client went away.")
        r.counter("retained_evicted_total", "Retained memory given back, by reason (ttl, "
                  "budget, pressure, registration, adoption) and what (slot, layout).",
                  labelled=True)
        r.counter("leases_total", "Read leases on checkpoints in memory, by result (granted, "
                  "refused, not_retained, expired).", labelled=True)
        r.counter("restores_total", "Checkpoints restored, by where from (memory, files), as "
                  "clients reported them.", labelled=True)
        r.histogram("restore_seconds", "Time a client's restore took, by where from "
                    "(reported by the client).", SECOND_BUCKETS)
        r.histogram("stall_seconds", "Training stall: the wall-clock time of save() on the "
                    "trainer's thread (reported by the client after save() returned).",
                    SECOND_BUCKETS)
        r.histogram("copy_seconds", "The client's copy into shared memory, part of the stall "
                    "(reported by the client).", SECOND_BUCKETS)
        r.histogram("slot_wait_seconds", "Time a client waited for a free slot, part of the "
                    "stall (reported by the client).", SECOND_BUCKETS)
        r.histogram("persist_seconds", "Time a writer took to make a checkpoint durable.",
                    SECOND_BUCKETS)
        r.histogram("save_bytes", "Size of each written checkpoint.", BYTE_BUCKETS)
        for gauge, help_ in (
            ("clients", "Connected clients."),
            ("jobs_in_flight", "Checkpoints being written now."),
            ("shm_reserved_bytes", "Shared memory handed out to clients."),
            ("shm_budget_bytes", "Configured shared-memory budget."),
            ("segments", "Shared-memory segments the daemon owns."),
            ("retained_bytes", "Shared memory of layouts kept for a restart."),
            ("retained_layouts", "Layouts kept for a restart."),
            ("leases", "Read leases in force."),
            ("uptime_seconds", "Seconds since the daemon started."),
        ):
            r.gauge(gauge, help_)
        for result in ("ok", "failed"):
            r.inc("saves_total", 0, result=result)
        for source in RESTORE_SOURCES:
            r.inc("restores_total", 0, source=source)
        self.jobs: deque[FinishedJob] = deque(maxlen=RECENT_JOBS)
        self.errors: deque[RecentError] = deque(maxlen=RECENT_ERRORS)
        #: Each uid's own save totals, what ``status`` shows it instead of the node's.
        self._totals: dict[int, dict[str, int]] = {}

    # -- events ------------------------------------------------------------------

    def staged(self, nbytes: int, stage_seconds: float | None, slot_wait: float | None) -> None:
        """A client committed a slot. Clients older than the "report" op sent their copy
        and slot-wait times with the commit (``stage_seconds``); newer ones report later."""
        self.registry.inc("bytes_staged_total", nbytes)
        if plausible(stage_seconds):
            self.registry.observe("copy_seconds", float(stage_seconds))
        if plausible(slot_wait):
            self.registry.observe("slot_wait_seconds", float(slot_wait))

    def reported(self, timings: dict[str, float]) -> None:
        """A client said what a committed save cost it, once its save() had returned."""
        for name in ("stall_seconds", "copy_seconds", "slot_wait_seconds"):
            if plausible(timings.get(name)):
                self.registry.observe(name, timings[name])

    def registered(self, created: int = 0, adopted: int = 0, *, registration: bool = True) -> None:
        """A registration (or, ``registration=False``, slots added to one): what it made."""
        if registration:
            self.registry.inc("registrations_total")
        self.registry.inc("segments_created_total", created)
        self.registry.inc("segments_adopted_total", adopted)

    def retained(self) -> None:
        self.registry.inc("retained_total")

    def evicted(self, reason: str, what: str) -> None:
        self.registry.inc("retained_evicted_total", reason=reason, what=what)

    def leased(self, result: str) -> None:
        self.registry.inc("leases_total", result=result)

    def restored(self, source: str, seconds: float | None, nbytes: int) -> None:
        """A client said how a restore went (``restored``): from memory or from files."""
        if source not in RESTORE_SOURCES:
            return
        self.registry.inc("restores_total", source=source)
        if plausible(seconds) and nbytes >= 0:
            self.registry.observe("restore_seconds", float(seconds))  # type: ignore[arg-type]

    def job_finished(self, job: FinishedJob, code: str = "", message: str = "") -> None:
        self.jobs.append(job)
        totals = self._totals.setdefault(job.uid, _no_saves())
        totals["saves" if job.ok else "failed"] += 1
        totals["bytes"] += job.bytes if job.ok else 0
        self.registry.inc("saves_total", result="ok" if job.ok else "failed")
        self.registry.observe("persist_seconds", job.persist_seconds)
        if job.ok:
            self.registry.inc("bytes_written_total", job.bytes)
            self.registry.observe("save_bytes", job.bytes)
        else:
            self.error(job.client, code, message, job=job.job, uid=job.uid)

    def error(
        self, client: str, code: str, message: str, *, job: int | None = None, uid: int = -1
    ) -> None:
        if code in NOT_ERRORS:
            return
        self.registry.inc("errors_total", code=code or "unknown")
        self.errors.append(
            RecentError(
                time.time(), client, code[:64], shorten(message, MAX_ERROR_CHARS), job, uid
            )
        )

    # -- views -------------------------------------------------------------------

    def recent(self, now: float | None = None, uid: int | None = None) -> dict[str, Any]:
        """Saves finished in the last THROUGHPUT_WINDOW_S seconds and their write speed
        (only ``uid``'s, when given: what an unprivileged user may see)."""
        now = time.time() if now is None else now
        mine = [j for j in self.jobs if uid is None or j.uid == uid]
        window = [j for j in mine if now - j.finished_unix <= THROUGHPUT_WINDOW_S and j.ok]
        written = sum(j.bytes for j in window)
        busy = sum(j.persist_seconds for j in window)
        return {
            "window_seconds": THROUGHPUT_WINDOW_S,
            "saves": len(window),
            "bytes": written,
            "write_bytes_per_second": written / busy if busy > 0 else 0.0,
            "jobs": [asdict(j) for j in mine[-10:]],
        }

    def totals(self, uid: int) -> dict[str, int]:
        """One uid's saves, failures and bytes written since the daemon started."""
        return dict(self._totals.get(uid, _no_saves()))

    def recent_errors(self, uid: int | None = None) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.errors if uid is None or e.uid == uid]

    def snapshot(self, gauges: dict[str, float]) -> dict[str, Any]:
        for name, value in gauges.items():
            self.registry.set(name, value)
        return self.registry.snapshot()


def _no_saves() -> dict[str, int]:
    return {"saves": 0, "failed": 0, "bytes": 0}


def describe_stall(timings: dict[str, float]) -> str:
    """A job's log-line tail: what the save cost the trainer, when its client reported it
    before the job ended (it reports only after ``save()`` returned)."""
    if "stall_seconds" not in timings:
        return ""
    parts = ", ".join(
        f"{name.removesuffix('_seconds').replace('_', ' ')} {timings[name]:.3f} s"
        for name in ("copy_seconds", "slot_wait_seconds", "setup_seconds", "commit_seconds")
        if name in timings
    )
    return f"; trainer stall {timings['stall_seconds']:.3f} s" + (f" ({parts})" if parts else "")
