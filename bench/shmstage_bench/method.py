"""One way of taking a checkpoint, behind one small interface, and how it is measured.

Every method — the physical limits, the peers and shmstage itself — is driven the same
way: ``setup(state_dict)`` once, ``run_once(state_dict, directory)`` per checkpoint into a
directory that does not exist yet, ``close()`` at the end. ``run_once`` returns two times
measured from the moment the trainer asks for a checkpoint:

* ``stall_s``: until the trainer may modify its tensors again (what a training step pays);
* ``durable_s``: until the checkpoint is on storage and fsynced (what a crash tolerates).

A method that cannot run here raises :class:`MethodUnavailable` from ``setup`` (a
"skipped" row); anything else it raises becomes an "error" row with the exception text.
Each method runs in its own process (see ``isolation``), so a crash or a hang is an error
row too, drawn by the parent.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from .budget import RepeatPlan
from .isolation import describe_exception, open_fds
from .pagecache import PageCacheSampler

StateDict = dict[str, torch.Tensor]


@dataclass
class Timing:
    """One checkpoint's times, in seconds from the save call; ``None`` where not meaningful."""

    stall_s: float | None
    durable_s: float | None
    detail: dict[str, Any] = field(default_factory=dict)


class MethodUnavailable(Exception):
    """Raised by ``setup`` when a method cannot run in this environment (reported as skipped)."""


@dataclass
class BenchContext:
    """What a method needs besides the state dict: device, daemon socket, where to write."""

    device: torch.device
    root: Path
    socket: str | None = None
    slots: int = 2
    direct_threads: int = 4
    direct_chunk: int = 8 << 20
    #: Whether the steady row measures the direct-I/O limit right before each of its saves
    #: (``ShmstageSteady``): the disk's pace drifts by more than the gap being measured.
    paired_limit: bool = False
    owns_process_group: bool = False

    def ensure_process_group(self) -> None:
        """Create the one-rank process group some peers need, remembering that we did."""
        self.owns_process_group |= ensure_process_group(self.device)

    def shmstage_socket(self) -> str:
        if not self.socket:
            raise RuntimeError("no shmstaged socket: the bench could not start its daemon")
        return self.socket


def synchronize(device: torch.device) -> None:
    """Wait for queued copies on ``device``; a stall is only over once the bytes have landed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ensure_process_group(device: torch.device) -> bool:
    """A one-rank, in-process process group for DCP and nvidia-resiliency-ext.

    Both coordinate ranks through ``torch.distributed`` even with a single rank, and DCP's
    ``async_save`` insists on a CPU backend; an in-memory ``HashStore`` avoids needing a
    free TCP port or environment variables.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise MethodUnavailable("torch.distributed is not available in this build")
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def fsync_dir(path: Path) -> None:
    """fsync a directory so that the new entries in it survive a crash too."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Method(ABC):
    """One way of taking a checkpoint."""

    name: ClassVar[str]
    kind: ClassVar[str] = "peer"  # "limit", "peer" or "shmstage"
    description: ClassVar[str]
    #: (tensors, evidence): above this many tensors the peer is known not to finish a save
    #: within a run's budget; the row says so instead of spending the budget to find out.
    scale_limit: ClassVar[tuple[int, str] | None] = None
    #: Node-wide paths (globs) the peer creates and leaves behind; those that were not
    #: there before its process started are removed after it ends, however it ended.
    leftovers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: BenchContext) -> None:
        self.ctx = ctx
        self.device = ctx.device
        self.note = ""

    def setup(self, state_dict: StateDict) -> None:  # noqa: B027 - optional hook
        """Allocate what the method keeps across checkpoints (not timed)."""

    @abstractmethod
    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        """Take one checkpoint of ``state_dict`` into the new ``directory``."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what ``setup`` allocated."""


@dataclass
class MethodResult:
    """Everything measured for one method; ``report`` turns a list of these into rows."""

    name: str
    kind: str
    description: str
    status: str = "ok"  # "ok", "error" or "skipped"
    note: str = ""
    error: str = ""
    traceback: str = ""
    first: Timing | None = None
    samples: list[Timing] = field(default_factory=list)
    fds_before: int | None = None
    fds_after: int | None = None
    #: Seconds its process ran, start to end (setup and clean-up included): what the
    #: budget's plan has to fit, kept in the JSON for the next plan's numbers.
    process_s: float | None = None

    def median(self, attr: str) -> float | None:
        """Median over the repeats (the first save is reported on its own)."""
        vals = [v for v in (getattr(s, attr) for s in self.samples) if v is not None]
        return statistics.median(vals) if vals else None

    def median_detail(self, key: str) -> float | None:
        vals = [s.detail[key] for s in self.samples if s.detail.get(key) is not None]
        return statistics.median(vals) if vals else None

    def max_detail(self, key: str) -> float | None:
        timings = [*self.samples, *([self.first] if self.first else [])]
        vals = [t.detail[key] for t in timings if t.detail.get(key) is not None]
        return max(vals) if vals else None


class SaveHung(Exception):
    """A save produced no result in time; the method is abandoned, its process ends."""


def _bounded(
    fn: Callable[..., Timing],
    state_dict: StateDict,
    directory: Path,
    timeout: float | None,
    why: str = "",
) -> Timing:
    """Run one save with a deadline, so that the rows measured before a hang survive it.

    The process this runs in is ended right after the result is handed back, so an
    abandoned thread costs nothing; the parent's deadline covers hangs elsewhere.
    """
    if timeout is None:
        return fn(state_dict, directory)
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append(fn(state_dict, directory))
        except BaseException as exc:  # handed to the caller's thread below
            outcome.append(exc)

    thread = threading.Thread(target=target, name="bench-save", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        if why:  # the budget's edge, not necessarily a hang
            raise SaveHung(f"no result after {timeout:.0f} s, when {why}: abandoned")
        raise SaveHung(f"no result after {timeout:.0f} s: the method hung (abandoned)")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _timed_save(
    method: Method, state_dict: StateDict, directory: Path, timeout: float | None, why: str = ""
) -> Timing:
    """One save, with the page cache sampled while it runs."""
    with PageCacheSampler() as sampler:
        timing = _bounded(method.run_once, state_dict, directory, timeout, why)
    if sampler.use is not None:
        timing.detail.update(sampler.use.detail())
    return timing


def measure(
    method: Method,
    state_dict: StateDict,
    repeats: int,
    log: Callable[[str], None] = lambda s: None,
    timeout: float | None = None,
    plan: RepeatPlan | None = None,
) -> MethodResult:
    """Run one method: a first save, then ``repeats`` more whose median is the result.

    The first save is kept apart because it pays one-off costs (allocating staging
    memory, spawning workers, registering layouts) that steady-state numbers must not
    hide and must not be polluted by. Every save goes to a new directory that is deleted
    once durable, so disk use stays at one checkpoint per method. With a ``plan`` (the
    method's share of ``--budget``) a repeat runs only while it still fits, and the
    row's note says how many of the asked repeats ran.
    """
    plan = plan or RepeatPlan(repeats)
    res = MethodResult(method.name, method.kind, method.description, fds_before=open_fds())
    abandoned = False
    cut = ""  # why a repeat was abandoned at the share's end
    try:
        try:
            method.setup(state_dict)
        except MethodUnavailable as e:
            res.status, res.note = "skipped", str(e)
            log(f"{method.name}: skipped ({e})")
            return res
        for i in range(repeats + 1):
            started = time.monotonic()
            if i > 0 and not plan.next_fits(started):
                break
            directory = method.ctx.root / f"{method.name}-{i}"
            shutil.rmtree(directory, ignore_errors=True)
            limit = plan.save_timeout(started, timeout)
            try:
                timing = _timed_save(
                    method, state_dict, directory, limit, plan.hung_reason(limit, timeout)
                )
            except MethodUnavailable as e:
                res.status, res.note = "skipped", str(e)
                log(f"{method.name}: skipped ({e})")
                break
            except SaveHung as e:
                abandoned = True
                if i > 0 and plan.hung_reason(limit, timeout):  # the plan's guess missed
                    cut = plan.abandoned_at_share_end()
                    break
                res.status, res.error = "error", f"save {i + 1}: {e}"
                log(f"{method.name}: {res.error}")
                break
            except Exception as e:
                res.status = "error"
                res.error = f"save {i + 1}: {describe_exception(e)}"
                res.traceback = traceback.format_exc(limit=-8)
                log(f"{method.name}: {res.error}")
                break
            finally:
                if not abandoned:
                    shutil.rmtree(directory, ignore_errors=True)
            plan.done(time.monotonic() - started, first=i == 0)
            if i == 0:
                res.first = timing
            else:
                res.samples.append(timing)
            log(
                f"{method.name}: save {i + 1}/{repeats + 1} stall={timing.stall_s} "
                f"durable={timing.durable_s}"
            )
        short = (cut or plan.cut_short()) if res.status == "ok" else ""
        if short:
            res.note = "; ".join(filter(None, [res.note, short]))
            log(f"{method.name}: {short}")
    except Exception as e:
        res.status = "error"
        res.error = f"setup: {describe_exception(e)}"
        res.traceback = traceback.format_exc(limit=-8)
        log(f"{method.name}: {res.error}")
    finally:
        try:
            if abandoned:
                raise RuntimeError("not closed: a save is still stuck inside it")
            method.close()
        except Exception as e:
            res.note = (
                res.note + "; " if res.note else ""
            ) + f"close failed: {describe_exception(e)}"
        res.note = "; ".join(dict.fromkeys(n for n in (method.note, res.note) if n))
        res.fds_after = open_fds()
    return res
