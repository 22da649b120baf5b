"""What a save reports: its timings, its outcome, and the handle that follows it to disk.

``SaveTimings`` is what the trainer paid, known the moment ``save()`` returns:
``stall_seconds`` is the wall-clock time of the call on the caller's thread, the number to
compare with a step time; the other fields are its parts. ``SaveResult`` adds what the
daemon reports once the checkpoint is durable.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from shmstage_client.errors import DaemonLost, PersistError, SaveError, SaveTimeout

if TYPE_CHECKING:
    from shmstage_client.connection import DaemonConnection
    from shmstage_client.save.handover import Landing

log = logging.getLogger("shmstage.client")


@dataclass(frozen=True)
class SaveTimings:
    """Where a save's stall went, in seconds.

    ``stall_seconds``: from entering ``save()`` until it returned, on the caller's thread —
    what a training step pays, whatever the parts below add up to. ``prepare_seconds``:
    flattening the state dict and checking it. ``setup_seconds``: reusing (or, for a new
    structure, registering and mapping) the staging layout, and preparing the destination
    directory and files. ``slot_wait_seconds``: waiting for a free slot (earlier
    checkpoints still being written). ``copy_seconds``: copying the tensors into shared
    memory on the caller's thread (for a non-blocking save: the eager copies, and queueing
    the deferred one). ``commit_seconds``: sending the commit and waiting for the daemon's
    answers. ``copy_wait_seconds``: waiting for the previous non-blocking save's copy to
    land before this save could start (it shares the layout); in ``Staged.commit()``, for
    the copy of its own non-blocking ``stage()``.

    Known later, for a non-blocking save (``save(..., block=False)``): ``deferred_copy_seconds``,
    from the start of its deferred copy until the copy landed, and ``staged_seconds``, from
    entering ``save()`` until the daemon owned the data (copy landed, ``ready`` answered).
    For a blocking save the first is 0 and the second is when ``save()`` returned; for a
    non-blocking one both are 0 until the copy has landed.

    For a two-phase save (``Stager.stage`` then ``Staged.commit``), ``stall_seconds`` is the
    time both calls blocked their callers, added up; when ``commit()`` runs on another
    thread (as PyTorch DCP's ``async_save`` does), the training thread stalled only for
    the ``stage()`` part, ``Staged.timings.stall_seconds``.
    """

    stall_seconds: float = 0.0
    prepare_seconds: float = 0.0
    setup_seconds: float = 0.0
    slot_wait_seconds: float = 0.0
    copy_seconds: float = 0.0
    commit_seconds: float = 0.0
    copy_wait_seconds: float = 0.0
    deferred_copy_seconds: float = 0.0
    staged_seconds: float = 0.0

    @property
    def stage_seconds(self) -> float:
        """Deprecated: the copy alone, ``copy_seconds`` (it never was the whole stall)."""
        return self.copy_seconds

    def wire(self) -> dict[str, float]:
        """The ``report`` message's fields (the protocol knows the stall and these parts)."""
        return {
            "stall_seconds": self.stall_seconds,
            "prepare_seconds": self.prepare_seconds,
            "setup_seconds": self.setup_seconds,
            "slot_wait_seconds": self.slot_wait_seconds,
            "copy_seconds": self.copy_seconds,
            "commit_seconds": self.commit_seconds,
        }

    def __add__(self, other: SaveTimings) -> SaveTimings:
        return SaveTimings(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


class TimingViews:
    """The parts of ``timings`` most read, as attributes of what carries a ``SaveTimings``
    (a ``Staged``, DCP's ``StageStats``)."""

    timings: SaveTimings

    @property
    def stall_seconds(self) -> float:
        return self.timings.stall_seconds

    @property
    def copy_seconds(self) -> float:
        return self.timings.copy_seconds

    @property
    def stage_seconds(self) -> float:
        """Deprecated alias of ``copy_seconds``."""
        return self.timings.copy_seconds

    @property
    def slot_wait_seconds(self) -> float:
        return self.timings.slot_wait_seconds

    @property
    def setup_seconds(self) -> float:
        return self.timings.setup_seconds


class Clock:
    """Times one call's parts; ``timings()`` closes it, measuring the stall up to now."""

    __slots__ = ("_parts", "_since", "started")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self._since = self.started
        self._parts: dict[str, float] = {}

    def lap(self, part: str) -> None:
        """Charge the time since the previous lap to ``part`` (``setup``, ``copy``, ...)."""
        now = time.perf_counter()
        key = f"{part}_seconds"
        self._parts[key] = self._parts.get(key, 0.0) + now - self._since
        self._since = now

    def timings(self) -> SaveTimings:
        stall = time.perf_counter() - self.started
        return SaveTimings(stall_seconds=stall, staged_seconds=stall, **self._parts)


@dataclass(frozen=True)
class SaveResult:
    """What a finished save cost: the trainer's part (``timings``, as on the handle) and
    the daemon's (``persist_seconds``, from the commit until the checkpoint was durable).

    The daemon's part, split: ``gather_seconds`` — its writer reading and checksumming the
    staged tensors; ``disk_wait_seconds`` — the writer waiting on the disk; ``sync_seconds``
    — the data file's fsync; ``publish_seconds`` — manifest, renames, directory sync. A
    large gather and little disk wait means the writer, not the disk, set the pace (many
    small tensors); the reverse, the disk. All 0 from a daemon that does not report them.
    """

    path: Path
    bytes: int
    timings: SaveTimings
    persist_seconds: float
    files: tuple[str, ...]
    gather_seconds: float = 0.0
    disk_wait_seconds: float = 0.0
    sync_seconds: float = 0.0
    publish_seconds: float = 0.0

    @property
    def stall_seconds(self) -> float:
        return self.timings.stall_seconds

    @property
    def prepare_seconds(self) -> float:
        return self.timings.prepare_seconds

    @property
    def setup_seconds(self) -> float:
        return self.timings.setup_seconds

    @property
    def slot_wait_seconds(self) -> float:
        return self.timings.slot_wait_seconds

    @property
    def copy_seconds(self) -> float:
        return self.timings.copy_seconds

    @property
    def commit_seconds(self) -> float:
        return self.timings.commit_seconds

    @property
    def copy_wait_seconds(self) -> float:
        return self.timings.copy_wait_seconds

    @property
    def deferred_copy_seconds(self) -> float:
        return self.timings.deferred_copy_seconds

    @property
    def staged_seconds(self) -> float:
        return self.timings.staged_seconds

    @property
    def stage_seconds(self) -> float:
        """Deprecated alias of ``copy_seconds``."""
        return self.timings.copy_seconds


@dataclass(frozen=True)
class SaveEvent:
    """What ``Stager(progress=...)`` is told: a save was staged, became durable, or failed.

    ``phase`` is "staged" (the daemon owns the data: ``save()`` is returning, or a
    non-blocking save's copy was handed over), "durable" (with ``result``) or "failed"
    (with ``error``). ``timings``: the trainer's side of the save.
    """

    path: Path
    phase: str
    timings: SaveTimings
    result: SaveResult | None = None
    error: SaveError | None = None

    @property
    def stall_seconds(self) -> float:
        return self.timings.stall_seconds

    @property
    def slot_wait_seconds(self) -> float:
        return self.timings.slot_wait_seconds

    @property
    def stage_seconds(self) -> float:
        """Deprecated alias of ``timings.copy_seconds``."""
        return self.timings.copy_seconds


ProgressCallback = Callable[[SaveEvent], None]


class SaveHandle:
    """A committed save being written by the daemon.

    ``timings`` (and ``stall_seconds``) are known when ``save()`` returns; a non-blocking
    save adds its deferred copy's figures once the copy has landed (``staged()``). The
    outcome is settled once, when the daemon's answer (or the loss of the daemon) arrives:
    that is when the save's log line is written and the progress callback runs, whether or
    not anybody calls ``wait()``.
    """

    def __init__(
        self,
        tracker: Tracker,
        connection: DaemonConnection,
        job: int | None,
        path: Path,
        landing: Landing | None = None,
    ) -> None:
        self._tracker = tracker
        # Job ids are per connection: forget this one on the connection that knows it,
        # not on a newer one the Stager made after a daemon restart.
        self._connection = connection
        #: The daemon's job id; for a non-blocking save, known once the copy was handed over.
        self.job = job
        self.path = path
        self._landing = landing
        self.timings = SaveTimings()
        self._result: SaveResult | None = None
        self._error: SaveError | None = None
        self._settled = threading.Event()

    @property
    def stall_seconds(self) -> float:
        """How long ``save()`` held the caller's thread (see ``SaveTimings``)."""
        return self.timings.stall_seconds

    def staged(self, timeout: float | None = None) -> None:
        """Wait until this save's copy has landed in shared memory and the daemon owns it.

        After it returns — or raises the save's error: the copy has stopped either way —
        nothing reads the saved tensors any more, and the caller may change them however it
        likes. Needed only by a non-blocking save's caller that mutates saved tensors
        outside the guarded optimizers' ``step()`` (for a blocking save it returns at
        once). Raises SaveTimeout if ``timeout`` runs out first.
        """
        if self._landing is not None:
            self._landing.wait(timeout)

    def _staged(self, timings: SaveTimings) -> None:
        """The daemon owns the data (``save()`` is returning, or a non-blocking save's copy
        was handed over): record what it cost, tell the progress callback, and from now on
        settle the outcome when the daemon's answer comes."""
        assert self.job is not None
        self.timings = timings
        self._tracker.notify(SaveEvent(self.path, "staged", timings))
        self._connection.job_future(self.job).add_done_callback(self._settle)

    def follow(self, landing: Landing) -> None:
        """Follow a non-blocking save's deferred copy: ``staged()`` waits for it."""
        self._landing = landing

    def failed_before_handover(self, error: BaseException) -> SaveError:
        """A non-blocking save ended before the daemon owned its data: nothing is written.
        Returns the error the handle settled with (``error`` itself if a SaveError)."""
        settled: SaveError
        if isinstance(error, DaemonLost):
            settled = DaemonLost(
                f"checkpoint {self.path} was not written: {error}; shmstaged was lost before "
                "the copy was handed over, so nothing of it is published (this Stager "
                "reconnects on its next save)"
            )
        elif isinstance(error, SaveError):
            settled = error
        else:
            settled = SaveError(f"checkpoint {self.path}: the deferred copy failed: {error!r}")
        self._conclude(settled)
        return settled

    def done(self) -> bool:
        return self._settled.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until the checkpoint is durable (or failed); raises a SaveError subclass."""
        if not self._settled.wait(timeout):
            raise SaveTimeout(
                f"checkpoint {self.path} was not durable within {timeout} s; it is still "
                "being written (call wait() again)"
            )
        self._tracker.forget(self)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _settle(self, future: concurrent.futures.Future[dict[str, Any]]) -> None:
        """Runs once, in the connection's reader thread (or here, if already done)."""
        try:
            message = future.result()
            result = message["result"]
            if not message["ok"]:
                raise PersistError(result.get("code", "?"), result.get("message", "unknown"))
            self._result = SaveResult(
                path=self.path,
                bytes=int(result["bytes"]),
                timings=self.timings,
                persist_seconds=float(result["persist_seconds"]),
                files=tuple(result["files"]),
                **_write_phases(result.get("phases")),
            )
            self._conclude(None)
            return
        except DaemonLost as exc:
            error: SaveError = DaemonLost(
                f"checkpoint {self.path} has no confirmed result: {exc}. It may be incomplete "
                "(`shmstage verify` tells: a new directory appears only once complete, and a "
                "restarted shmstaged finishes what it acknowledged); this Stager reconnects on "
                "its next save"
            )
        except SaveError as exc:
            error = exc
        except Exception as exc:  # a malformed answer must still settle the handle
            error = SaveError(f"checkpoint {self.path}: unexpected answer: {exc!r}")
        self._conclude(error)

    def _conclude(self, error: SaveError | None) -> None:
        """Log the outcome, tell the progress callback, release ``wait()``."""
        self._error = error
        if self._result is not None:
            r = self._result
            t = r.timings
            log.info(
                "shmstage save %s: %s durable; stall %.3f s (copy %.3f s, %.2f GB/s; slot "
                "wait %.3f s; setup %.3f s; commit %.3f s; prepare %.3f s)%s, persist %.3f s "
                "(%.2f GB/s)",
                self.path,
                _size(r.bytes),
                t.stall_seconds,
                t.copy_seconds,
                _gbps(r.bytes, t.copy_seconds),
                t.slot_wait_seconds,
                t.setup_seconds,
                t.commit_seconds,
                t.prepare_seconds,
                _deferred(t),
                r.persist_seconds,
                _gbps(r.bytes, r.persist_seconds),
            )
            event = SaveEvent(self.path, "durable", self.timings, result=r)
        else:
            log.warning("shmstage save %s failed: %s", self.path, self._error)
            event = SaveEvent(self.path, "failed", self.timings, error=self._error)
        self._tracker.notify(event)  # before wait() returns: events arrive in order
        self._settled.set()


class Tracker:
    """The saves a Stager has in flight, its progress callback, and the reports to the
    daemon of what each save cost the trainer (sent from the Stager's ``background``
    thread, off the caller's critical path)."""

    def __init__(
        self, progress: ProgressCallback | None, background: concurrent.futures.Executor
    ) -> None:
        self._progress = progress
        self._background = background
        self._unsettled: set[SaveHandle] = set()
        self._lock = threading.Lock()

    def track(self, handle: SaveHandle) -> None:
        with self._lock:
            self._unsettled.add(handle)

    def staged(self, handle: SaveHandle, timings: SaveTimings) -> None:
        """The daemon owns a save's data: follow it to its outcome, tell the daemon what
        it cost the trainer (for its log line and metrics), tell the progress callback."""
        self.track(handle)
        self._background.submit(_report, handle, timings)
        handle._staged(timings)

    def forget(self, handle: SaveHandle) -> None:
        with self._lock:
            self._unsettled.discard(handle)
        if handle.job is not None:
            handle._connection.forget_job(handle.job)

    def unsettled(self) -> list[SaveHandle]:
        """The saves whose outcome is not known yet."""
        with self._lock:
            return list(self._unsettled)

    def notify(self, event: SaveEvent) -> None:
        if self._progress is None:
            return
        try:
            self._progress(event)
        except Exception:  # a broken callback must not fail the save or kill the reader
            log.exception("shmstage progress callback raised; ignored")


def _report(handle: SaveHandle, timings: SaveTimings) -> None:
    """Tell the daemon what the save cost the trainer (for its log line and metrics)."""
    with contextlib.suppress(SaveError, OSError):
        handle._connection.post("report", {"job": handle.job, **timings.wire()})


def _deferred(t: SaveTimings) -> str:
    """The log line's words for a non-blocking save's copy after ``save()`` returned."""
    if not t.deferred_copy_seconds:
        return ""
    return (
        f"; deferred copy {t.deferred_copy_seconds:.3f} s, staged {t.staged_seconds:.3f} s "
        f"after the call (waited {t.copy_wait_seconds:.3f} s for the previous copy)"
    )


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


#: The daemon's split of ``persist_seconds`` (a ``job_done`` result's ``phases``).
WRITE_PHASES: Final = ("gather_seconds", "disk_wait_seconds", "sync_seconds", "publish_seconds")


def _write_phases(phases: object) -> dict[str, float]:
    """The phases a result reported, those that are plain non-negative numbers."""
    if not isinstance(phases, dict):
        return {}
    return {
        key: float(value)
        for key, value in phases.items()
        if key in WRITE_PHASES
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and value >= 0
    }
