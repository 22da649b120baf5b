"""The methods the bench compares, behind one small interface.

Every method — the physical limits, the peers and shmstage itself — is driven the same
way: ``setup(state_dict)`` once, ``run_once(state_dict, directory)`` per checkpoint into a
directory that does not exist yet, ``close()`` at the end. ``run_once`` returns two times
measured from the moment the trainer asks for a checkpoint:

* ``stall_s``: until the trainer may modify its tensors again (what a training step pays);
* ``durable_s``: until the checkpoint is on storage and fsynced (what a crash tolerates).

A method that cannot run here raises :class:`MethodUnavailable` from ``setup`` (a
"skipped" row); anything else it raises becomes an "error" row with the exception text —
peers do fail (DCP's ``DefaultStager`` raises on its second CUDA save on torch 2.11) and
such a failure is a result to report, never a reason to lose the other rows.

Peers are driven through their public APIs only; none of their code is copied here.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import inspect
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch

from .synthetic import ALIGN, state_dict_bytes

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
    """What methods share: the device, the shmstage daemon, the directory checkpoints go to."""

    device: torch.device
    root: Path
    socket: str | None = None
    slots: int = 2
    daemon: ShmstageDaemon | None = None
    owns_process_group: bool = False

    def ensure_process_group(self) -> None:
        """Create the one-rank process group some peers need, remembering that we did."""
        self.owns_process_group |= ensure_process_group(self.device)

    def shmstage_socket(self) -> str:
        """The socket to talk to: ``--socket`` if given, else a daemon this bench starts once."""
        if self.socket:
            return self.socket
        if self.daemon is None:
            self.daemon = ShmstageDaemon()
        return self.daemon.start()

    def close(self) -> None:
        """Stop the daemon this bench started (never one it was pointed at)."""
        if self.daemon is not None:
            self.daemon.stop()
        if self.owns_process_group:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self.owns_process_group = False


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


def _host_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor, without needing numpy."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _fsync_dir(path: Path) -> None:
    """fsync a directory so that the new entries in it survive a crash too."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (for writers that do not do it)."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))
    _fsync_dir(path.parent)


class Method(ABC):
    """One way of taking a checkpoint."""

    name: ClassVar[str]
    kind: ClassVar[str] = "peer"  # "limit", "peer" or "shmstage"
    description: ClassVar[str]

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


# --------------------------------------------------------------------------- limits


class RawCopy(Method):
    """The stall floor: one copy of the same bytes into a preallocated (pinned) host buffer."""

    name = "raw-copy"
    kind = "limit"
    description = "limit: copy into a preallocated pinned host buffer (CPU: plain host buffer)"

    def setup(self, state_dict: StateDict) -> None:
        pin = self.device.type == "cuda"
        total = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in state_dict.values())
        self.buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        self.buf.zero_()  # touch every page now, so page faults are not timed
        self.views: list[torch.Tensor] = []
        off = 0
        for t in state_dict.values():
            n = t.numel() * t.element_size()
            self.views.append(self.buf[off : off + n].view(t.dtype).view(t.shape))
            off += -(-n // ALIGN) * ALIGN
        if not pin:
            self.note = "no CUDA: host-to-host copy"

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        synchronize(self.device)
        t0 = time.perf_counter()
        for dst, src in zip(self.views, state_dict.values(), strict=True):
            dst.copy_(src, non_blocking=True)
        synchronize(self.device)
        return Timing(time.perf_counter() - t0, None)

    def close(self) -> None:
        self.views = []
        self.buf = torch.empty(0)


class RawWrite(Method):
    """The durability floor: the same bytes written once to one file and fsynced."""

    name = "raw-write-fsync"
    kind = "limit"
    description = "limit: write the same bytes to one file in the same directory + fsync"
    chunk = 64 << 20

    def setup(self, state_dict: StateDict) -> None:
        total = state_dict_bytes(state_dict)
        self.buf = torch.empty(total, dtype=torch.uint8)
        off = 0
        for t in state_dict.values():
            n = t.numel() * t.element_size()
            self.buf[off : off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            off += n

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        view = _host_view(self.buf)
        t0 = time.perf_counter()
        directory.mkdir(parents=True)
        fd = os.open(directory / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done : done + self.chunk])
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(directory)
        return Timing(None, time.perf_counter() - t0)

    def close(self) -> None:
        self.buf = torch.empty(0)


# ---------------------------------------------------------------------------- peers


class TorchSave(Method):
    """The naive baseline: ``torch.save`` blocks until the file is written and fsynced."""

    name = "torch-save"
    description = "torch.save to one file + fsync (synchronous: stall = durable)"

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        t0 = time.perf_counter()
        directory.mkdir(parents=True)
        with open(directory / "model.pt", "wb") as f:
            torch.save(state_dict, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(directory)
        dt = time.perf_counter() - t0
        return Timing(dt, dt)


class DcpSave(Method):
    """PyTorch DCP's synchronous ``save`` (its ``FileSystemWriter`` fsyncs by default)."""

    name = "dcp-save"
    description = "torch.distributed.checkpoint.save (synchronous)"

    def setup(self, state_dict: StateDict) -> None:
        import torch.distributed.checkpoint as dcp

        self.kwargs = _dcp_single_process(dcp.save, self.ctx)

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.save(state_dict, checkpoint_id=str(directory), **self.kwargs)
        dt = time.perf_counter() - t0
        return Timing(dt, dt)


def _dcp_single_process(fn: Callable[..., Any], ctx: BenchContext) -> dict[str, Any]:
    """Keyword arguments that make a DCP call run as one process without collectives.

    With one rank there is nothing to coordinate, and DCP's ``no_dist`` skips the
    ``gather_object`` round trips (which also need numpy, absent from lean installs).
    A torch whose function lacks ``no_dist`` gets a one-rank process group instead.
    """
    if "no_dist" in inspect.signature(fn).parameters:
        # Some versions warn on every save that they "assume" single-process intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return {"no_dist": True}
    ctx.ensure_process_group()
    return {}


def _await_async_save(response: Any, t0: float) -> Timing:
    """Times of a DCP ``async_save`` response, whichever shape this torch version returns.

    With a stager that stages asynchronously it is an ``AsyncSaveResponse`` whose
    ``staging_completion`` marks the end of the stall; otherwise a plain future, and the
    stall ended when ``async_save`` returned.
    """
    if hasattr(response, "staging_completion"):
        response.staging_completion.result()
        stall = time.perf_counter() - t0
        response.upload_completion.result()
    else:
        stall = time.perf_counter() - t0
        response.result()
    return Timing(stall, time.perf_counter() - t0)


class DcpAsyncSave(Method):
    """DCP ``async_save`` with the staging it picks itself."""

    name = "dcp-async"
    description = "torch.distributed.checkpoint.async_save, default staging"

    def setup(self, state_dict: StateDict) -> None:
        import torch.distributed.checkpoint as dcp

        self.kwargs = _dcp_single_process(dcp.async_save, self.ctx)

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        resp = dcp.async_save(state_dict, checkpoint_id=str(directory), **self.kwargs)
        return _await_async_save(resp, t0)


class DcpAsyncDefaultStager(Method):
    """DCP ``async_save`` with a persistent ``DefaultStager`` (pinned, shared, async, non-blocking).

    The stager lives across saves — that is how it caches its pinned buffers — and the
    stall ends when its staging future resolves.
    """

    name = "dcp-async-stager"
    description = "DCP async_save + DefaultStager(pinned, shared, async, non-blocking)"

    def setup(self, state_dict: StateDict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.kwargs = _dcp_single_process(dcp.async_save, self.ctx)

        if self.device.type == "cuda":
            opts = StagingOptions(
                use_pinned_memory=True,
                use_shared_memory=True,
                use_async_staging=True,
                use_non_blocking_copy=True,
            )
        else:
            # Pinned memory and non-blocking copies need an accelerator (DefaultStager
            # raises without one); keep the shared-memory, background-thread staging.
            opts = StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=True,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
            self.note = "no CUDA: pinned memory and non-blocking copy off"
        self.stager = DefaultStager(opts)

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        resp = dcp.async_save(
            state_dict, checkpoint_id=str(directory), async_stager=self.stager, **self.kwargs
        )
        return _await_async_save(resp, t0)

    def close(self) -> None:
        stager = getattr(self, "stager", None)
        if stager is not None:
            stager.close()


def _import_nvrx(device: torch.device) -> Any:
    """nvidia-resiliency-ext's async checkpoint modules, or skip when they cannot run.

    Its completion check all-reduces a CUDA tensor (and ``TorchAsyncCheckpoint`` calls
    ``torch.cuda.synchronize``), so it is GPU-only: on CPU it is skipped, not an error.
    """
    if device.type != "cuda":
        raise MethodUnavailable("nvidia-resiliency-ext async checkpointing needs CUDA")
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt import (
            core,
            filesystem_async,
            state_dict_saver,
        )
    except Exception as e:  # not installed, or a build that does not match this torch
        raise MethodUnavailable(f"nvidia-resiliency-ext not importable: {e!r}") from None
    return core, filesystem_async, state_dict_saver


class NvrxShmCached(Method):
    """nvidia-resiliency-ext async checkpointing, CPU shared-memory mode, cached structure.

    This is the mode that the MNNVL fix introduced: per-tensor shared-memory snapshots in
    the trainer, reused while the structure stays the same, handed to a persistent worker
    process. The stall ends when the request is scheduled (its D2H copy and the preload
    hand-off are done); durable when the blocking finalize returns.
    """

    name = "nvrx-shm-cached"
    description = "nvidia-resiliency-ext FileSystemWriterAsync, CPU shm + cached structure"

    def setup(self, state_dict: StateDict) -> None:
        self.core, self.fsa, self.saver = _import_nvrx(self.device)
        self.ctx.ensure_process_group()
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        self.planner_cls = DefaultSavePlanner
        self.queue = self.core.AsyncCallsQueue(persistent=True, cpu_shm_mode=True)

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        t0 = time.perf_counter()
        directory.mkdir(parents=True)
        writer = self.fsa.FileSystemWriterAsync(
            str(directory), use_cached_data_structure=True, use_cpu_shm_for_gpu_tensors=True
        )
        writer, metadata, dist_wrapper = self.saver.save_state_dict_async_plan(
            state_dict, writer, None, planner=self.planner_cls()
        )
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        finalize = partial(
            self.saver.save_state_dict_async_finalize, writer, metadata, dist_wrapper
        )
        request = self.core.AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload_fn)
        self.queue.schedule_async_request(request)
        stall = time.perf_counter() - t0
        self.queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        return Timing(stall, time.perf_counter() - t0)

    def close(self) -> None:
        queue = getattr(self, "queue", None)
        if queue is not None:
            queue.close()
            self.fsa.FileSystemWriterAsync.cleanup_tensor_caches()


class NvrxTorchAsync(Method):
    """nvidia-resiliency-ext ``TorchAsyncCheckpoint``: pinned preload, torch.save in a worker.

    Its worker does not fsync, so "durable" here is "written to the page cache": the
    row's note says so rather than the bench adding an fsync the peer does not do.
    """

    name = "nvrx-torch-async"
    description = "nvidia-resiliency-ext TorchAsyncCheckpoint (torch.save in a persistent worker)"

    def setup(self, state_dict: StateDict) -> None:
        _import_nvrx(self.device)
        self.ctx.ensure_process_group()
        from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import (
            TorchAsyncCheckpoint,
        )

        self.ckpt = TorchAsyncCheckpoint(persistent_queue=True)
        self.note = "its worker does not fsync: durable = written to page cache"

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        t0 = time.perf_counter()
        directory.mkdir(parents=True)
        self.ckpt.async_save(state_dict, str(directory / "model.pt"))
        stall = time.perf_counter() - t0
        self.ckpt.finalize_async_save(blocking=True, no_dist=True)
        return Timing(stall, time.perf_counter() - t0)

    def close(self) -> None:
        ckpt = getattr(self, "ckpt", None)
        if ckpt is not None:
            ckpt.close()


# ------------------------------------------------------------------------- shmstage


class ShmstageDaemon:
    """A ``shmstaged`` this bench starts in a temp dir and always stops with SIGTERM."""

    ready_timeout_s = 60.0

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp: str | None = None
        self.socket: str | None = None
        self.log_path: str | None = None

    def _command(self, socket_path: str) -> list[str]:
        """Run the daemon with this interpreter when it is importable, else the console script."""
        if importlib.util.find_spec("shmstage_daemon") is not None:
            code = "import sys; from shmstage_daemon.main import main; sys.exit(main())"
            return [sys.executable, "-c", code, "--socket", socket_path]
        exe = shutil.which("shmstaged")
        if exe is None:
            raise RuntimeError("shmstaged not found (neither shmstage_daemon nor the script)")
        return [exe, "--socket", socket_path]

    def log_tail(self, n: int = 2000) -> str:
        """The end of the daemon's stderr, for error rows."""
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def start(self) -> str:
        """Start once and wait for the socket file; raise with the daemon's log if it dies."""
        if self.socket is not None:
            return self.socket
        self.tmp = tempfile.mkdtemp(prefix="shmstage-bench-daemon-", dir=_runtime_dir())
        sock = os.path.join(self.tmp, "shmstaged.sock")
        self.log_path = os.path.join(self.tmp, "shmstaged.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self._command(sock), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while not os.path.exists(sock):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"shmstaged exited with {self.proc.returncode}: {self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"shmstaged not ready after {self.ready_timeout_s:.0f}s")
            time.sleep(0.02)
        self.socket = sock
        return sock

    def stop(self) -> None:
        """SIGTERM, then SIGKILL only if it ignores that; remove the temp dir."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        self.socket = None


def _runtime_dir() -> str | None:
    """A tmpfs directory for the bench's own daemon, as the packaged service has.

    The daemon journals each commit next to its socket before acknowledging it; the
    service's socket is in /run/shmstage (tmpfs: a journal that lives as long as the
    segments do). Under /tmp on a disk, every save would wait for a disk fsync that the
    service never pays. None: no tmpfs found, the default temp dir.
    """
    candidates = [os.environ.get("XDG_RUNTIME_DIR", ""), "/run", "/dev/shm"]
    try:
        with open("/proc/mounts") as mounts:
            tmpfs = {line.split()[1] for line in mounts if line.split()[2] == "tmpfs"}
    except OSError:
        return None
    for path in candidates:
        if path in tmpfs and os.access(path, os.W_OK | os.X_OK):
            return path
    return None


def _import_stager() -> Any:
    """The client's public ``Stager``; a missing client is an error row, not a skip."""
    from shmstage_client import Stager

    return Stager


def _result_detail(result: Any) -> dict[str, Any]:
    """The daemon's own breakdown of a save, kept in the JSON next to the bench's times."""
    keys = (
        "bytes",
        "stall_seconds",
        "prepare_seconds",
        "setup_seconds",
        "slot_wait_seconds",
        "copy_seconds",
        "commit_seconds",
        "persist_seconds",
        "path",
    )
    return {k: getattr(result, k) for k in keys if getattr(result, k, None) is not None}


class ShmstageFirst(Method):
    """shmstage's first save: a new ``Stager`` (connect, layout registration) every time."""

    name = "shmstage-first"
    kind = "shmstage"
    description = "shmstage, first save: new Stager + layout registration + save"

    def setup(self, state_dict: StateDict) -> None:
        self.stager_cls = _import_stager()
        self.socket = self.ctx.shmstage_socket()

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        t0 = time.perf_counter()
        st = self.stager_cls(socket=self.socket, slots=self.ctx.slots)
        try:
            handle = st.save(state_dict, str(directory))
            stall = time.perf_counter() - t0
            result = handle.wait(timeout=600)
            durable = time.perf_counter() - t0
        finally:
            st.close()
        return Timing(stall, durable, _result_detail(result))


class ShmstageSteady(Method):
    """shmstage in steady state: one ``Stager`` whose segments are already registered."""

    name = "shmstage-steady"
    kind = "shmstage"
    description = "shmstage, steady state: persistent Stager, registered layout"

    def setup(self, state_dict: StateDict) -> None:
        stager_cls = _import_stager()
        self.stager = stager_cls(socket=self.ctx.shmstage_socket(), slots=self.ctx.slots)

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        t0 = time.perf_counter()
        handle = self.stager.save(state_dict, str(directory))
        stall = time.perf_counter() - t0
        result = handle.wait(timeout=600)
        return Timing(stall, time.perf_counter() - t0, _result_detail(result))

    def close(self) -> None:
        stager = getattr(self, "stager", None)
        if stager is not None:
            stager.close()


METHODS: list[type[Method]] = [
    RawCopy,
    RawWrite,
    # shmstage before the peers: at 10,000 tensors some peers leak descriptors (DCP's
    # shared-memory stager keeps one per tensor; nvrx's queue feeder dies with EMFILE and
    # hangs), and whatever runs after them in this process inherits an exhausted fd table.
    ShmstageFirst,
    ShmstageSteady,
    TorchSave,
    DcpSave,
    DcpAsyncSave,
    DcpAsyncDefaultStager,
    NvrxShmCached,
    NvrxTorchAsync,
]
METHOD_NAMES = [m.name for m in METHODS]


# --------------------------------------------------------------------------- runner


@dataclass
class MethodResult:
    """Everything measured for one method; ``report`` turns a list of these into output."""

    name: str
    kind: str
    description: str
    status: str = "ok"  # "ok", "error" or "skipped"
    note: str = ""
    error: str = ""
    traceback: str = ""
    first: Timing | None = None
    samples: list[Timing] = field(default_factory=list)

    def median(self, attr: str) -> float | None:
        """Median over the repeats (the first save is reported on its own)."""
        vals = [v for v in (getattr(s, attr) for s in self.samples) if v is not None]
        return statistics.median(vals) if vals else None


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if str(e) else repr(e)
    return text if len(text) <= 600 else text[:600] + "…"


class SaveHung(Exception):
    """A save produced no result in time; the method is abandoned, the bench goes on."""


#: Set once any save had to be abandoned: the process must then exit without joining it.
HUNG_THREADS: list[threading.Thread] = []


def _bounded(
    fn: Callable[..., Timing], state_dict: StateDict, directory: Path, timeout: float | None
) -> Timing:
    """Run one save with a deadline, so a peer that hangs becomes a row, not a stuck run.

    Peers do hang: at 10,000 tensors nvidia-resiliency-ext's queue feeder thread dies with
    EMFILE and its completion wait never returns.
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
        HUNG_THREADS.append(thread)
        raise SaveHung(f"no result after {timeout:.0f} s: the method hung (abandoned)")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def measure(
    method: Method,
    state_dict: StateDict,
    repeats: int,
    log: Callable[[str], None] = lambda s: None,
    timeout: float | None = None,
) -> MethodResult:
    """Run one method: a first save, then ``repeats`` more whose median is the result.

    The first save is kept apart because it pays one-off costs (allocating staging
    memory, spawning workers, registering layouts) that steady-state numbers must not
    hide and must not be polluted by. Every save goes to a new directory that is deleted
    once durable, so disk use stays at one checkpoint per method.
    """
    res = MethodResult(method.name, method.kind, method.description)
    abandoned = False
    try:
        try:
            method.setup(state_dict)
        except MethodUnavailable as e:
            res.status, res.note = "skipped", str(e)
            log(f"{method.name}: skipped ({e})")
            return res
        for i in range(repeats + 1):
            directory = method.ctx.root / f"{method.name}-{i}"
            shutil.rmtree(directory, ignore_errors=True)
            try:
                timing = _bounded(method.run_once, state_dict, directory, timeout)
            except SaveHung as e:
                res.status, res.error, abandoned = "error", f"save {i + 1}: {e}", True
                log(f"{method.name}: {res.error}")
                break
            except Exception as e:
                res.status = "error"
                res.error = f"save {i + 1}: {_describe(e)}"
                res.traceback = traceback.format_exc(limit=-8)
                log(f"{method.name}: {res.error}")
                break
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            if i == 0:
                res.first = timing
            else:
                res.samples.append(timing)
            log(
                f"{method.name}: save {i + 1}/{repeats + 1} stall={timing.stall_s} "
                f"durable={timing.durable_s}"
            )
    except Exception as e:
        res.status = "error"
        res.error = f"setup: {_describe(e)}"
        res.traceback = traceback.format_exc(limit=-8)
        log(f"{method.name}: {res.error}")
    finally:
        try:
            if abandoned:
                raise RuntimeError("not closed: a save is still stuck inside it")
            method.close()
        except Exception as e:
            res.note = (res.note + "; " if res.note else "") + f"close failed: {_describe(e)}"
        res.note = "; ".join(dict.fromkeys(n for n in (method.note, res.note) if n))
        gc.collect()
        if torch.cuda.is_available():
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    return res
