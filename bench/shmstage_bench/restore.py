"""Scenario ``restore``: how fast a restarted trainer gets its state back onto the device.

Rows, all on the same bytes in the same run: the raw pinned host-to-device copy (the
limit), the disk's read limit (the fastest of several cold parallel reads of the
checkpoint's files, O_DIRECT at three queue depths and through the page cache),
``load(path, device=..., source="files")`` with a cold page cache and with a warm one,
``load(..., source="memory")`` from the daemon's memory (the trainer still connected), and
the restart itself: a trainer process saves, its checkpoint is acknowledged and durable, it
is SIGKILLed, and a new process restores it with ``latest(device=...)`` — no path given —
timed and compared bit for bit with the state; the row "restart-prepared" does the same in
new processes that call ``prepare_restore`` before building the model (alternating with
the others). The memory and restart rows are medians of ``--restores`` (each restart a new
process; the samples are in the row); the last restarted process also saves once more:
that first save of a restarted trainer adopts the segments the daemon retained
(``segments_created`` 0, from the daemon's counters). Every row says where its restore
came from (``source``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Final

import torch

from .comparison import synthetic_config, synthetic_spec
from .direct_io import DirectIOUnsupported, drop_file_cache, read_direct
from .isolation import describe_exception, tell_parent
from .limits import PinnedMirror
from .method import synchronize
from .peers import import_stager
from .report import Column, Table, ratio
from .saves import first_difference
from .session import BenchSession
from .synthetic import SyntheticSpec


@dataclass(frozen=True)
class RestoreJob:
    spec: SyntheticSpec
    socket: str
    root: Path
    slots: int
    drop: str  # "auto", "fadvise" or "none"
    direct_threads: int
    direct_chunk: int
    wait_timeout: float
    #: Restores from memory in the bench's process, and restarted processes (medians).
    restores: int = 3

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"


def _load(job: RestoreJob, device: torch.device, source: str) -> Any:
    """``load`` of the bench's checkpoint from ``source``, with where it came from."""
    from shmstage_client import load

    return load(job.checkpoint, device=device, source=source, with_info=True, socket=job.socket)


def _segments_created(socket: str) -> float | None:
    """The daemon's count of segments it ever created (to see a first save adopt)."""
    from shmstage.control import ControlClient, ControlError

    try:
        with ControlClient(socket) as client:
            series = client.metrics()["shmstage_segments_created_total"]["series"]
    except (ControlError, KeyError):
        return None
    return float(series[0][1]) if series else None


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def _drop(job: RestoreJob, files: list[Path]) -> str:
    if job.drop == "none":
        return "page cache not dropped (--drop-caches none)"
    return drop_file_cache(files, system_wide=job.drop == "auto" and os.geteuid() == 0)


def _restore_row(seconds: float, restored: Any, expected: Any, note: str) -> dict[str, Any]:
    """A restore's row: its time (the bench's, synchronized), exactness, and where the
    restore says it came from (with why not from memory, when it fell back)."""
    mismatch = first_difference(restored.state, expected)
    fell_back = restored.source == "files" and restored.reason != "source='files'"
    why = f"files because: {restored.reason}" if fell_back else ""
    phases = ", ".join(f"{name} {value:.3f} s" for name, value in restored.phases.items())
    return {
        "status": "ok",
        "seconds": seconds,
        "restore_seconds": restored.seconds,
        "phases": restored.phases,
        "bit_exact": not mismatch,
        "verified": restored.verified,
        "note": "; ".join(filter(None, [note, phases, why, mismatch])),
        "source": restored.source,
    }


def _median_row(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of the median restore among ``samples`` (the lower of the middle two), with
    every sample's time, bit-exact only if every one was, and where each came from."""
    row = dict(sorted(samples, key=lambda sample: sample["seconds"])[(len(samples) - 1) // 2])
    row["samples"] = [sample["seconds"] for sample in samples]
    row["bit_exact"] = all(sample["bit_exact"] for sample in samples)
    sources = [sample["source"] for sample in samples]
    if len(samples) > 1:
        times = ", ".join(f"{sample['seconds']:.3f}" for sample in samples)
        row["note"] = f"median of {len(samples)} ({times} s); {row['note']}"
    if len(set(sources)) > 1:
        row["note"] += f"; sources: {', '.join(sources)}"
    return row


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file())


#: How the disk's read limit is read: (threads, chunk, O_DIRECT). A virtual disk's reads
#: scale with the queue depth: on an H200 VM 8 GiB came off it at 1.5-1.8 GB/s with 4
#: O_DIRECT threads of 8 MiB, 2.0 with 16 of 32 MiB or 64 of 16 MiB, and 2.2 read cold
#: through the page cache on 64 threads (its read-ahead queues more), while ``load()``
#: read at 2.0 (``docs/performance.md``, "Restores"). The fastest way is the limit.
READ_WAYS: Final = (
    (4, 8 << 20, True),
    (16, 32 << 20, True),
    (64, 16 << 20, True),
    (64, 8 << 20, False),
)


def _read_limit(job: RestoreJob, files: list[Path], device: torch.device) -> dict[str, Any]:
    """The disk's read limit: the fastest of ``READ_WAYS`` (and the bench's own O_DIRECT
    threads and chunk), each reading the checkpoint's files cold."""
    ways = {(job.direct_threads, job.direct_chunk, True), *READ_WAYS}
    timings: list[tuple[float, str]] = []
    refused = ""
    for threads, chunk, direct in sorted(ways):
        if (direct and refused) or (not direct and job.drop == "none"):
            continue  # through a page cache left warm, a read is no limit of the disk's
        if not direct:
            _drop(job, files)
        try:
            seconds, _ = _timed(
                partial(read_direct, files, threads=threads, chunk=chunk, direct=direct), device
            )
        except DirectIOUnsupported as exc:
            refused = str(exc.strerror)
            continue
        how = "O_DIRECT" if direct else "page cache, cold"
        timings.append((seconds, f"{threads} x {chunk >> 20} MiB {how} {seconds:.3f} s"))
    if not timings:
        return {"status": "skipped", "note": refused}
    shown = "; ".join(text for _, text in timings)
    note = f"fastest of: {shown}" + (f"; O_DIRECT refused: {refused}" if refused else "")
    return {"status": "ok", "seconds": min(timings)[0], "note": note}


def measure(job: RestoreJob) -> dict[str, dict[str, Any]]:
    """In its own process: save once, then every restore path from limit to memory."""
    device = torch.device(job.spec.device)
    state = job.spec.build()
    tensors = list(state.values())
    rows: dict[str, dict[str, Any]] = {}
    job.root.mkdir(parents=True, exist_ok=True)
    with import_stager()(socket=job.socket, slots=job.slots) as stager:
        stager.save(state, str(job.checkpoint)).wait(timeout=job.wait_timeout)
        files = _files(job.checkpoint)

        mirror = PinnedMirror(tensors, pin=device.type == "cuda")
        mirror.copy_from(tensors, device)
        targets = [torch.empty_like(t) for t in tensors]
        h2d = [mirror.copy_to(targets, device) for _ in range(3)]
        del targets
        mirror.close()
        rows["raw-h2d"] = {
            "status": "ok",
            "seconds": statistics.median(h2d),
            "samples": h2d,
            "note": "" if device.type == "cuda" else "no CUDA: host-to-host",
        }

        rows["disk-read-limit"] = _read_limit(job, files, device)

        how = _drop(job, files)
        for name, note in (("load-cold", how), ("load-warm", "right after the cold load")):
            seconds, out = _timed(lambda: _load(job, device, "files"), device)
            rows[name] = _restore_row(seconds, out, state, note)
            del out
        try:
            samples = []
            for _ in range(max(1, job.restores)):  # one restored state at a time
                seconds, out = _timed(lambda: _load(job, device, "memory"), device)
                samples.append(_restore_row(seconds, out, state, "load(source='memory')"))
                del out
            rows["load-memory"] = _median_row(samples)
        except Exception as exc:
            rows["load-memory"] = {"status": "error", "error": describe_exception(exc)}
    shutil.rmtree(job.checkpoint, ignore_errors=True)
    return rows


def restart_trainer(job: RestoreJob) -> None:
    """The trainer that will be killed: save, report acknowledged and durable, then wait."""
    state = job.spec.build()
    job.root.mkdir(parents=True, exist_ok=True)
    stager = import_stager()(socket=job.socket, slots=job.slots)
    t0 = time.perf_counter()
    handle = stager.save(state, str(job.checkpoint))
    tell_parent({"event": "acknowledged", "stall_s": time.perf_counter() - t0})
    handle.wait(timeout=job.wait_timeout)
    tell_parent({"event": "durable", "durable_s": time.perf_counter() - t0})
    time.sleep(600)  # until SIGKILLed: the parent's deadline ends this either way


def restart_restore(job: RestoreJob, save: bool, prepared: bool = False) -> dict[str, Any]:
    """The new process: build the model's state, as a restarted trainer does, restore the
    killed trainer's newest checkpoint to the device with ``latest()`` (no path), check it
    against that state, and with ``save`` save it once as the restarted trainer would.
    ``prepared``: as the README's restart script does, call ``prepare_restore`` between
    initialising CUDA and building the model. The start-up before ``latest()`` (CUDA, the
    call, the model) is any restart's cost, not the restore's: it is timed apart
    (``startup_s``), so that what making the staging beside the model costs shows."""
    from shmstage_client import latest

    device = torch.device(job.spec.device)
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    if prepared:
        try:
            from shmstage_client import prepare_restore
        except ImportError:  # an older client, compared with --code: restores unprepared
            prepared = False
        else:
            prepare_restore(device)
    expected = job.spec.build()
    synchronize(device)
    startup = time.perf_counter() - started
    seconds, out = _timed(lambda: latest(device=device, socket=job.socket), device)
    note = "prepare_restore() first, then latest(device=...)" if prepared else "latest(device=...)"
    row = _restore_row(seconds, out, expected, note)
    row["startup_s"] = startup
    row["path_matches"] = out.path is not None and out.path.name == job.checkpoint.name
    if not save:
        return row
    created = _segments_created(job.socket)
    with import_stager()(socket=job.socket, slots=job.slots) as stager:
        t0 = time.perf_counter()
        handle = stager.save(out.state, str(job.root / "after-restart"))
        row["first_save_stall_s"] = time.perf_counter() - t0
        handle.wait(timeout=job.wait_timeout)
    after = _segments_created(job.socket)
    if created is not None and after is not None:
        row["segments_created"] = int(after - created)
    shutil.rmtree(job.root / "after-restart", ignore_errors=True)
    return row


def _restart(session: BenchSession, job: RestoreJob, timeout: float) -> dict[str, dict[str, Any]]:
    """Trainer saves and is SIGKILLed once durable; new processes restore, one by one,
    alternately as they come and with ``prepare_restore`` first: the rows "restart" and
    "restart-prepared" (or one row "restart" saying why there are none)."""
    try:
        child = session.child("restart-trainer", restart_trainer, (job,))
    except Exception as exc:
        return {
            "restart": {
                "status": "error",
                "error": f"trainer not started: {describe_exception(exc)}",
            }
        }
    try:
        acknowledged = child.next_message(session.part_timeout(timeout))
        durable = child.next_message(session.part_timeout(timeout))
        child.kill()  # SIGKILL, no handler runs: what an OOM kill or a NCCL abort does
        session.log("restart-trainer: SIGKILLed after its checkpoint was durable")
    except RuntimeError as exc:
        child.kill()
        error = {"status": "error", "error": f"trainer: {exc}", "traceback": child.follower.text()}
        return {"restart": error}
    finally:
        child.close()
    samples: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    count = max(1, job.restores)
    for index in range(2 * count):  # new processes, alternating; the last saves once more
        prepared = index % 2 == 1
        outcome = session.run(
            "restart-restore", restart_restore, (job, index == 2 * count - 1, prepared), timeout
        )
        if not outcome.ok:
            error = {
                "status": "error",
                "error": f"restore {index + 1} of {2 * count}: {outcome.error}",
                "traceback": outcome.traceback or outcome.log_tail,
            }
            return {"restart": error}
        samples[prepared].append(outcome.value)
    rows = {}
    for prepared, kept in samples.items():
        row = _median_row(kept)
        row["path_matches"] = all(sample["path_matches"] for sample in kept)
        row["startup_s"] = statistics.median(sample["startup_s"] for sample in kept)
        for key in ("first_save_stall_s", "segments_created"):
            if key in kept[-1]:
                row[key] = kept[-1][key]
        row["trainer_stall_s"] = acknowledged.get("stall_s")
        row["trainer_durable_s"] = durable.get("durable_s")
        rows["restart-prepared" if prepared else "restart"] = row
    return rows


ROW_NAMES = {
    "raw-h2d": "raw pinned host-to-device copy (limit)",
    "disk-read-limit": "disk read limit (fastest cold read)",
    "load-cold": "load() from files, cold cache",
    "load-warm": "load() from files, warm cache",
    "load-memory": "load() from daemon memory",
    "restart": "restart: latest() after SIGKILL",
    "restart-prepared": "restart: prepare_restore() at start-up, latest()",
}


def run(session: BenchSession) -> tuple[dict[str, Any], list[Table], list[str]]:
    args = session.args
    spec = synthetic_spec(args)
    config = synthetic_config(args, spec) | {"drop_caches": args.drop_caches}
    table = Table(
        "restore",
        "Restore to the device",
        [
            Column("status", "status", "", 7),
            Column("seconds", "s"),
            Column("gbps", "GB/s", ".2f", 6),
            Column("vs_h2d", "÷h2d", "x", 6),
            Column("vs_disk", "÷disk", "x", 6),
            Column("vs_cold", "÷cold", "x", 6),
            Column("bit_exact", "exact", "yes", 5),
            Column("source", "source", "", 8),
        ],
        chart=["seconds"],
    )
    rows: dict[str, dict[str, Any]] = {}
    if not session.socket:
        rows = {key: {"status": "error", "error": session.daemon_error} for key in ROW_NAMES}
    else:
        job = RestoreJob(
            spec,
            session.socket,
            session.root / "restore",
            args.slots,
            args.drop_caches,
            args.direct_threads,
            args.direct_chunk,
            args.save_timeout,
            args.restores,
        )
        outcome = session.run("restore", measure, (job,), args.part_timeout)
        if outcome.ok:
            rows.update(outcome.value)
        else:
            error = {
                "status": "error",
                "error": outcome.error,
                "traceback": outcome.traceback or outcome.log_tail,
            }
            rows.update({k: dict(error) for k in ROW_NAMES if not k.startswith("restart")})
        shutil.rmtree(job.root, ignore_errors=True)
        restart = replace(job, root=session.root / "restart")
        rows.update(_restart(session, restart, args.part_timeout))
        shutil.rmtree(session.root / "restart", ignore_errors=True)
    h2d = rows.get("raw-h2d", {}).get("seconds")
    disk = rows.get("disk-read-limit", {}).get("seconds")
    cold = rows.get("load-cold", {}).get("seconds")
    for key, label in ROW_NAMES.items():
        row = {"name": label, **rows.get(key, {"status": "error", "error": "not measured"})}
        seconds = row.get("seconds")
        row.update(
            gbps=spec.total_bytes / seconds / 1e9 if seconds else None,
            vs_h2d=ratio(seconds, h2d),
            vs_disk=ratio(seconds, disk) if key != "raw-h2d" else None,
            vs_cold=ratio(seconds, cold) if key not in ("raw-h2d", "disk-read-limit") else None,
        )
        table.rows.append(row)
    notes = [
        "÷h2d: ÷ the raw pinned host-to-device copy; ÷disk: ÷ the fastest cold read of the "
        "checkpoint's files (see its note); ÷cold: ÷ load() from the files with a cold page cache.",
    ]
    restarts = [rows.get(key, {}) for key in ("restart", "restart-prepared")]
    if all(row.get("status") == "ok" for row in restarts):
        unprepared, prepared = restarts
        notes.append(
            f"restart: start-up before latest() (initialising CUDA, building the model's "
            f"state on the device; prepare_restore() in between in the prepared processes) "
            f"{unprepared['startup_s']:.3f} s as they come, {prepared['startup_s']:.3f} s "
            f"prepared (medians)"
        )
        notes.append(
            f"restart: the restarted trainer's first save stalled "
            f"{prepared.get('first_save_stall_s', float('nan')):.3f} s and created "
            f"{prepared.get('segments_created')} segment(s) (0: it adopted the retained ones)"
        )
    return config, [table], notes
