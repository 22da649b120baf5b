"""The methods the peers scenario compares: PyTorch's and NVIDIA's checkpointing, and shmstage.

The limits they are divided by live in ``limits``; the interface and how a method is
measured in ``method``. Peers are driven through their public APIs only; none of their
code is copied here. Each method runs in its own process (``run_method`` is what that
process runs), so that the descriptors a peer leaks, a hang or a crash stay there.
"""

from __future__ import annotations

import inspect
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .compute import ComputeLoop, median
from .daemon import PrivateDaemon
from .limits import DirectWrite, RawCopy, RawWrite
from .method import (
    BenchContext,
    Method,
    MethodResult,
    MethodUnavailable,
    StateDict,
    Timing,
    fsync_dir,
    measure,
)
from .saves import save_parts
from .synthetic import SyntheticSpec

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
        fsync_dir(directory)
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


def import_stager() -> Any:
    """The client's public ``Stager``; a missing client is an error row, not a skip."""
    from shmstage_client import Stager

    return Stager


def _result_detail(handle: Any, result: Any) -> dict[str, Any]:
    """The client's own breakdown of a save, kept in the JSON next to the bench's times."""
    detail: dict[str, Any] = {k: v for k, v in save_parts(handle, result).items() if v is not None}
    nbytes = getattr(result, "bytes", None)
    if nbytes is not None:
        detail["bytes"] = nbytes
    return detail


class ShmstageFirst(Method):
    """shmstage's first save: a new ``Stager`` (connect, layout registration) every time."""

    name = "shmstage-first"
    kind = "shmstage"
    description = "shmstage, first save: new Stager + layout registration + save"

    def setup(self, state_dict: StateDict) -> None:
        self.stager_cls = import_stager()
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
        return Timing(stall, durable, _result_detail(handle, result))


class ShmstageSteady(Method):
    """shmstage in steady state: one ``Stager`` whose segments are already registered."""

    name = "shmstage-steady"
    kind = "shmstage"
    description = "shmstage, steady state: persistent Stager, registered layout"

    def setup(self, state_dict: StateDict) -> None:
        stager_cls = import_stager()
        self.stager = stager_cls(socket=self.ctx.shmstage_socket(), slots=self.ctx.slots)

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        t0 = time.perf_counter()
        handle = self.stager.save(state_dict, str(directory))
        stall = time.perf_counter() - t0
        result = handle.wait(timeout=600)
        return Timing(stall, time.perf_counter() - t0, _result_detail(handle, result))

    def close(self) -> None:
        stager = getattr(self, "stager", None)
        if stager is not None:
            stager.close()


class ShmstageBusy(ShmstageSteady):
    """shmstage steady state while the trainer computes: what the write costs a step.

    Each checkpoint first times a fixed compute step with nothing in flight, then saves and
    keeps stepping until the checkpoint is durable; the two medians (and their ratio) show
    the writer's CPU and memory-bandwidth cost on the trainer.
    """

    name = "shmstage-busy"
    description = "shmstage, steady state, trainer computing while the daemon persists"

    def setup(self, state_dict: StateDict) -> None:
        super().setup(state_dict)
        self.loop = ComputeLoop(self.device)
        # The first save registers the layout; it is not what this row is about.
        warmup = self.ctx.root / "busy-warmup"
        self.stager.save(state_dict, str(warmup)).wait(timeout=600)
        shutil.rmtree(warmup, ignore_errors=True)
        self.note = (
            "step = 8 bf16 8192x8192 matmuls"
            if self.device.type == "cuda"
            else "step = 8 fp32 256x256 matmuls + a 32 MiB sweep (no CUDA)"
        )

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        idle = self.loop.steps_for(0.5)
        t0 = time.perf_counter()
        handle = self.stager.save(state_dict, str(directory))
        stall = time.perf_counter() - t0
        busy = self.loop.steps_while(lambda: not handle.done())
        result = handle.wait(timeout=600)
        durable = time.perf_counter() - t0
        detail = _result_detail(handle, result)
        idle_s, busy_s = median(idle), median(busy)
        detail.update(
            idle_step_s=idle_s,
            busy_step_s=busy_s,
            busy_steps=len(busy),
            step_slowdown=busy_s / idle_s if busy_s and idle_s else None,
        )
        return Timing(stall, durable, detail)


METHODS: list[type[Method]] = [
    RawCopy,
    RawWrite,
    DirectWrite,
    ShmstageFirst,
    ShmstageSteady,
    ShmstageBusy,
    TorchSave,
    DcpSave,
    DcpAsyncSave,
    DcpAsyncDefaultStager,
    NvrxShmCached,
    NvrxTorchAsync,
]
METHOD_NAMES = [m.name for m in METHODS]

#: The name ``scripts/dcp_gpu_bench.py`` imports (a daemon on a private socket).
ShmstageDaemon = PrivateDaemon

#: Deliberately broken methods for the isolation test, offered only when this is set.
TEST_METHODS_ENV = "SHMSTAGE_BENCH_TEST_METHODS"


def available_methods() -> dict[str, type[Method]]:
    """The methods by name; with ``SHMSTAGE_BENCH_TEST_METHODS=1`` also the broken ones."""
    methods = {m.name: m for m in METHODS}
    if os.environ.get(TEST_METHODS_ENV) == "1":
        from .faulty import FAULTY_METHODS

        methods.update({m.name: m for m in FAULTY_METHODS})
    return methods


@dataclass(frozen=True)
class MethodJob:
    """What a method's process needs: which method, which bytes, where, how often."""

    method: str
    spec: SyntheticSpec
    ctx: BenchContext
    repeats: int
    save_timeout: float | None


def run_method(job: MethodJob) -> MethodResult:
    """In the method's own process: build the same state dict, measure, hand back the rows.

    The state dict is rebuilt here from the same spec and seed, so every method moves the
    very same bytes without any tensor crossing a process boundary.
    """
    cls = available_methods()[job.method]
    job.ctx.root.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    state_dict = job.spec.build()
    # No teardown: the process ends right after, which also ends what a peer left behind.
    return measure(cls(job.ctx), state_dict, job.repeats, log, job.save_timeout)
