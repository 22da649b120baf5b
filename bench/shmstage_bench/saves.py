"""One shmstage save as the user feels it: the wall-clock stall around ``save()``, its parts
as the client reports them, when it became durable, and whether it is bit-exact.

The parts come from the save's result or handle: ``stall_seconds`` (the client's own
wall-clock stall), ``prepare_seconds``, ``setup_seconds``, ``slot_wait_seconds``, ``copy_seconds``,
``commit_seconds``, ``persist_seconds``. Clients that predate a field show "-" for it: they
are read with ``getattr`` so the bench runs against any client version. A slot wait is
*backpressure* — saves asked for faster than the disk writes them — and is reported apart
from the stall it is part of.
"""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .report import Column

PARTS = (
    "stall_seconds",
    "prepare_seconds",
    "setup_seconds",
    "slot_wait_seconds",
    "copy_seconds",
    "commit_seconds",
    "persist_seconds",
    "copy_wait_seconds",
    "deferred_copy_seconds",
    "staged_seconds",
    # the daemon's split of persist_seconds (SaveResult): writer-bound or disk-bound
    "gather_seconds",
    "disk_wait_seconds",
    "sync_seconds",
    "publish_seconds",
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def save_parts(handle: Any, result: Any) -> dict[str, float | None]:
    """The parts of a save, from its result where present, else from its handle."""
    out: dict[str, float | None] = {}
    for key in (*PARTS, "stage_seconds"):
        value = _number(getattr(result, key, None))
        if value is None:
            value = _number(getattr(handle, key, None))
        out[key] = value
    return out


@dataclass
class SaveRecord:
    """One save: when it was issued, what it cost, and what became of it."""

    index: int
    path: str
    issued_at: float  # perf_counter at the call
    wall_stall_s: float = 0.0
    step: int | None = None
    durable_at: float | None = None
    parts: dict[str, float | None] = field(default_factory=dict)
    bit_exact: bool | None = None
    mismatch: str = ""
    error: str = ""

    @property
    def durable_s(self) -> float | None:
        return None if self.durable_at is None else self.durable_at - self.issued_at

    def backpressure_s(self) -> float:
        return self.parts.get("slot_wait_seconds") or 0.0

    def row(self, copy_s: float | None, origin: float) -> dict[str, Any]:
        """The table row: stall with and without backpressure, its parts, durable time."""
        net = self.wall_stall_s - self.backpressure_s()
        return {
            "name": f"save {self.index}"
            + (f" (step {self.step})" if self.step is not None else ""),
            "status": "error" if self.error else "ok",
            "error": self.error,
            "note": self.mismatch,
            "issued_s": self.issued_at - origin,
            "wall_stall_s": self.wall_stall_s,
            "backpressure_s": self.backpressure_s(),
            "stall_net_s": net,
            "stall_vs_raw_copy": net / copy_s if copy_s else None,
            **{k: v for k, v in self.parts.items()},
            "durable_s": self.durable_s,
            "bit_exact": self.bit_exact,
        }


class DurableClock:
    """A ``Stager(progress=...)`` callback that notes when each save became durable.

    Runs in the client's reader thread: it only records the time, as the Stager asks.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.at: dict[str, float] = {}
        self.failed: dict[str, str] = {}

    def __call__(self, event: Any) -> None:
        phase = getattr(event, "phase", "")
        if phase in ("durable", "failed"):
            with self._lock:
                key = os.path.realpath(event.path)
                self.at[key] = time.perf_counter()
                if phase == "failed":
                    self.failed[key] = str(getattr(event, "error", ""))


# ----------------------------------------------------------------- bit-exactness


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def first_difference(got: Any, want: Any, where: str = "") -> str:
    """ "" when ``got`` equals ``want`` bit for bit (tensors byte-compared, so NaN and -0.0
    count as themselves), else where the first difference is."""
    if _is_tensor(want):
        if not _is_tensor(got):
            return f"{where or 'root'}: not a tensor"
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return f"{where}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
        a, b = _raw(got), _raw(want.to(got.device))
        return "" if torch.equal(a, b) else f"{where}: bytes differ"
    if isinstance(want, Mapping):
        if not isinstance(got, Mapping) or list(got) != list(want):
            return f"{where or 'root'}: keys differ"
        for k in want:
            diff = first_difference(got[k], want[k], f"{where}.{k}" if where else str(k))
            if diff:
                return diff
        return ""
    if isinstance(want, Sequence) and not isinstance(want, str):
        if not isinstance(got, Sequence) or len(got) != len(want):
            return f"{where or 'root'}: lengths differ"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            diff = first_difference(g, w, f"{where}[{i}]")
            if diff:
                return diff
        return ""
    same = got == want or (got != got and want != want)  # NaN hyperparameters
    return "" if same else f"{where}: {got!r} != {want!r}"


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nested state, in traversal order."""
    if _is_tensor(tree):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in tensors_of(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in tensors_of(v)]
    return []


class Reaper:
    """Deletes checkpoints once durable, on its own thread, so a long sequence of saves
    never needs more disk than the few in flight (the GPU machine has 64 GiB)."""

    def __init__(self) -> None:
        self._items: list[tuple[Any, Path]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reaper", daemon=True)
        self._thread.start()

    def add(self, handle: Any, path: Path) -> None:
        with self._lock:
            self._items.append((handle, path))

    def _sweep(self) -> None:
        with self._lock:
            done = [(h, p) for h, p in self._items if h.done()]
            self._items = [(h, p) for h, p in self._items if not h.done()]
        for _, path in done:
            shutil.rmtree(path, ignore_errors=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            self._sweep()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sweep()


def issue(stager: Any, state: Any, path: Path, index: int, **kwargs: Any) -> tuple[SaveRecord, Any]:
    """Call ``save()`` and time it on the caller's thread: the stall the trainer feels."""
    record = SaveRecord(index, str(path), time.perf_counter())
    handle = stager.save(state, str(path), **kwargs)
    record.wall_stall_s = time.perf_counter() - record.issued_at
    return record, handle


def finish(record: SaveRecord, handle: Any, clock: DurableClock, timeout: float) -> Any:
    """Wait until durable and fill in the parts; a failed save is kept as an error."""
    try:
        result = handle.wait(timeout=timeout)
    except Exception as exc:  # SaveError and friends: a row, not a crash
        record.error = f"{type(exc).__name__}: {exc}"
        record.parts = save_parts(handle, None)
        return None
    record.parts = save_parts(handle, result)
    record.durable_at = clock.at.get(os.path.realpath(record.path), time.perf_counter())
    return result


def steady(records: list[SaveRecord]) -> list[SaveRecord]:
    """The saves a steady figure is the median of: all but the first of the sequence."""
    ok = [r for r in records if not r.error]
    return ok[1:] if len(ok) > 1 else ok


def median_row(name: str, records: list[SaveRecord], copy_s: float | None) -> dict[str, Any]:
    """A row of medians over ``records`` (of every numeric column of their rows)."""
    rows = [r.row(copy_s, 0.0) for r in records]
    out: dict[str, Any] = {"name": name, "status": "ok" if rows else "error"}
    if not rows:
        out["error"] = "no successful save to take a median of"
        return out
    keys = dict.fromkeys(k for r in rows for k in r if k != "issued_s")
    for key in keys:
        vals = [r[key] for r in rows if isinstance(r.get(key), float)]
        if vals:
            out[key] = statistics.median(vals)
    exact = [r.bit_exact for r in records if r.bit_exact is not None]
    out["bit_exact"] = all(exact) if exact else None
    return out


SAVE_COLUMNS = [
    Column("status", "status", "", 6),
    Column("issued_s", "issued s", ".2f", 8),
    Column("wall_stall_s", "stall s"),
    Column("backpressure_s", "backpr. s"),
    Column("stall_net_s", "stall-bp"),
    Column("stall_vs_raw_copy", "÷copy", "x", 6),
    Column("stall_seconds", "client s"),
    Column("prepare_seconds", "prep. s"),
    Column("setup_seconds", "setup s"),
    Column("copy_seconds", "copy s"),
    Column("commit_seconds", "commit s"),
    Column("durable_s", "durable s"),
    Column("persist_seconds", "persist s"),
]

SAVE_NOTES = [
    "stall: wall clock around save() on the trainer's thread; backpr.: its slot wait "
    "(saves asked for faster than the disk writes them); stall-bp: the stall without it, "
    "÷copy: stall-bp ÷ the raw pinned copy of the same bytes in the same run.",
    "client/prep./setup/copy/commit/persist: the client's own figures (result fields "
    "stall_seconds, prepare_seconds, setup_seconds, copy_seconds, commit_seconds, "
    "persist_seconds); "
    "- where this client does not report them.",
]


def substitute(tree: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``tree`` with its tensors replaced, in traversal order, by ``tensors`` (a snapshot's
    buffers), its other values kept: what the checkpoint must equal."""
    if _is_tensor(tree):
        return next(tensors)
    if isinstance(tree, Mapping):
        return {k: substitute(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(substitute(v, tensors) for v in tree)
    return copy.deepcopy(tree)
