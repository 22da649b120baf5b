"""The methods the peers scenario compares: PyTorch's, NVIDIA's, DLRover's and Google's
(ML Flashpoint) checkpointing, and shmstage.

The limits they are divided by live in ``limits``; the interface and how a method is
measured in ``method``. Peers are driven through their public APIs only; none of their
code is copied here. Each method runs in its own process (``run_method`` is what that
process runs), so that the descriptors a peer leaks, a hang or a crash stay there.
"""

from __future__ import annotations

import contextlib
import glob
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

from .budget import RepeatPlan
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
    synchronize,
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

    Some torch versions (2.11 on the GPU machine) close the stager's ``StateDictStager``
    at the end of every stage, to break a reference cycle: that drops its cached buffers
    and empties its copy table, so the same stager's next stage fails with ``KeyError:
    <class 'type'>`` (the table's entry for classes, reached through a dict's
    ``__reduce_ex__``). There the bench gives the stager a new ``StateDictStager`` before
    each save (``_reopen_state_dict_stager``): what that torch's stager would cost if it
    worked, buffers allocated anew every save, and the row's note says so.
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

        reopened = _reopen_state_dict_stager(self.stager)
        if reopened and REOPENED_NOTE not in self.note:
            self.note = "; ".join(
                filter(None, [self.note, f"{REOPENED_NOTE} (torch {torch.__version__})"])
            )
        t0 = time.perf_counter()
        resp = dcp.async_save(
            state_dict, checkpoint_id=str(directory), async_stager=self.stager, **self.kwargs
        )
        return _await_async_save(resp, t0)

    def close(self) -> None:
        stager = getattr(self, "stager", None)
        if stager is not None:
            stager.close()


REOPENED_NOTE = (
    "this torch closes the stager's StateDictStager after each stage (its buffers are not "
    "kept; reused, it fails with KeyError: <class 'type'>): a new one per save"
)


def _reopen_state_dict_stager(stager: Any) -> bool:
    """Give a ``DefaultStager`` whose ``StateDictStager`` was closed (its copy table is
    empty) a new one with the same options; whether it had to."""
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is None or getattr(inner, "_deepcopy_dispatch", True):
        return False
    options = {"pin_memory": inner.pin_memory, "share_memory": inner.share_memory}
    if hasattr(inner, "pin_memory_min_bytes"):
        options["pin_memory_min_bytes"] = inner.pin_memory_min_bytes
    stager._state_dict_stager = type(inner)(**options)
    return True


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


#: Both nvidia-resiliency-ext methods hung in their first save at 10,000 tensors on an H100
#: (abandoned after 90 s each; ``docs/performance.md``, 1 GiB / 10,000 tensors).
NVRX_SCALE = (
    10_000,
    "nvidia-resiliency-ext hung in its first save at 10,000 tensors on an H100 (no result "
    "after 90 s, 2026-11-23), so more would only spend its share of the budget",
)


class NvrxShmCached(Method):
    """nvidia-resiliency-ext async checkpointing, CPU shared-memory mode, cached structure.

    This is the mode that the MNNVL fix introduced: per-tensor shared-memory snapshots in
    the trainer, reused while the structure stays the same, handed to a persistent worker
    process. The stall ends when the request is scheduled (its D2H copy and the preload
    hand-off are done); durable when the blocking finalize returns.
    """

    name = "nvrx-shm-cached"
    description = "nvidia-resiliency-ext FileSystemWriterAsync, CPU shm + cached structure"
    scale_limit = NVRX_SCALE

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
    scale_limit = NVRX_SCALE

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


def _peer_import(pip_name: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` (a peer's imports), or a skip naming what to install and what was missing."""
    try:
        return fn()
    except ImportError as e:
        top = (e.name or "").partition(".")[0]
        if top and top != pip_name.replace("-", "_"):  # the peer is there, a dependency not
            raise MethodUnavailable(
                f"{pip_name} is installed but its import needs the module {top!r}, which is "
                f"not (pip install {pip_name} installs it; see scripts/fetch_peer_wheels.sh)"
            ) from None
        raise MethodUnavailable(f"not installed: pip install {pip_name}") from None
    except Exception as e:  # installed, but a build that does not import here
        raise MethodUnavailable(f"{pip_name} not importable: {e!r}") from None


def _restore_into(loaded: StateDict, state_dict: StateDict, device: torch.device) -> None:
    """Copy a peer's restored tensors back into the trainer's (as ``load_state_dict`` would):
    a restore is over when the bytes are where training needs them."""
    for key, dst in state_dict.items():
        dst.copy_(loaded[key], non_blocking=True)
    synchronize(device)


#: DLRover names its shared memory and sockets after TORCHELASTIC_RUN_ID and the shard; the
#: bench gives each process a run id of its own, so that nothing it finds or leaves is another
#: job's.
DLROVER_RUN_ID = "shmstage-bench-{pid}"
DLROVER_SHM = "/dev/shm/shmstage-bench-*_ckpt_shm_*"
DLROVER_SOCKETS = "/tmp/ckpt_sock/shmstage-bench-*"


class DlroverFlash(Method):
    """DLRover Flash Checkpoint: the trainer copies into shared memory, a saver process persists.

    Used on one node, one rank, without ``dlrover-run``: the bench starts DLRover's own
    saver process as that launcher's agent would (see ``_start_dlrover_saver``), then a
    ``DdpCheckpointer``. The stall is ``save_checkpoint`` (the copy into its
    shared memory and the event to the saver); durable when the saver has written the step
    into its tracker file. Its saver ``torch.save``s the state without fsync (only the tracker
    is fsynced), so "durable" is the page cache for the data, as the row's note says.
    """

    name = "dlrover-flash"
    description = "DLRover Flash Checkpoint: DdpCheckpointer → shm → its saver process (disk)"
    leftovers = (DLROVER_SHM, DLROVER_SOCKETS)

    def setup(self, state_dict: StateDict) -> None:
        def imports() -> Any:
            from dlrover.python.common.multi_process import SharedQueue
            from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
            from dlrover.trainer.torch.flash_checkpoint.engine import start_async_save

            return DdpCheckpointer, StorageType, SharedQueue, start_async_save

        checkpointer_cls, self.storage_type, queue_cls, start_saver = _peer_import(
            "dlrover", imports
        )
        os.environ["TORCHELASTIC_RUN_ID"] = DLROVER_RUN_ID.format(pid=os.getpid())
        self.saver = _start_dlrover_saver(queue_cls, start_saver)
        self.root = self.ctx.root / "dlrover"
        self.ckpt = checkpointer_cls(str(self.root))
        self.tracker = self.root / "dlrover_latest.txt"
        self.step = 0
        self.note = (
            "durable = its tracker file names the step (the saver torch.saves the data "
            "without fsync; the tracker is fsynced)"
        )

    def _persisted(self, step: int) -> bool:
        try:
            return self.tracker.read_text().strip() == str(step)
        except FileNotFoundError:
            return False

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        self.step += 1
        step = self.step
        path = self.root / str(step) / "rank_0.pt"
        t0 = time.perf_counter()
        self.ckpt.save_checkpoint(step, state_dict, str(path), storage_type=self.storage_type.DISK)
        stall = time.perf_counter() - t0
        while not self._persisted(step):  # the bench's save timeout bounds this wait
            time.sleep(0.002)
        durable = time.perf_counter() - t0
        detail: dict[str, Any] = {}
        if step == 2:  # once (the first repeat): restoring from its shared memory
            t1 = time.perf_counter()
            _restore_into(self.ckpt.load_checkpoint(), state_dict, self.device)
            detail["restore_s"] = restore_s = time.perf_counter() - t1
            self.note += f"; restore from its shm to the {self.device.type}: {restore_s:.3f} s"
        shutil.rmtree(path.parent, ignore_errors=True)  # one checkpoint on disk at a time
        return Timing(stall, durable, detail)

    def close(self) -> None:
        engine = getattr(getattr(self, "ckpt", None), "_engine", None)
        if engine is not None:
            engine.close()
        saver = getattr(self, "saver", None)
        if saver is not None:
            saver.kill()
            saver.join(timeout=10)
        shutil.rmtree(getattr(self, "root", self.ctx.root / "dlrover"), ignore_errors=True)


#: How long DLRover's saver process may take to answer on its factory queue.
DLROVER_SAVER_START_S = 120.0


def _start_dlrover_saver(queue_cls: Any, start_async_save: Callable[[], None]) -> Any:
    """Start DLRover's saver process as ``dlrover-run``'s agent does, before the trainer's
    checkpointer, and wait until its factory queue answers.

    Left to ``DdpCheckpointer``, the saver starts as the checkpointer's first request is
    sent, and DLRover's ``SharedQueue`` serves requests before it has created its queue: a
    request that comes in between gets an error its client ignores, and the checkpointer
    then waits 60 s for a saver that was never asked for (1 setup in 2 on a loaded machine
    here). With ``ROLE_NAME=dlrover-trainer`` the checkpointer leaves the saver to the agent.
    """
    import multiprocessing

    os.environ["ROLE_NAME"] = "dlrover-trainer"
    saver = multiprocessing.Process(target=start_async_save, name="dlrover-saver", daemon=True)
    saver.start()
    deadline = time.monotonic() + DLROVER_SAVER_START_S
    factory = queue_cls(name="factory")

    def answers() -> bool:
        try:
            return factory.is_available() and factory.qsize() >= 0
        except Exception:  # its socket exists but does not listen yet
            return False

    while not answers():
        if not saver.is_alive():
            raise RuntimeError(f"DLRover's saver process exited ({saver.exitcode}) at its start")
        if time.monotonic() > deadline:
            saver.kill()
            raise RuntimeError(
                f"DLRover's saver process did not answer on its factory queue within "
                f"{DLROVER_SAVER_START_S:.0f} s"
            )
        time.sleep(0.05)
    return saver


#: Where ML Flashpoint's checkpoints go: tmpfs, as its docs have it (its buffers are files
#: mmapped there), one base container per bench process.
FLASHPOINT_BASE = "/dev/shm/shmstage-bench-mlf-{pid}"


class MlFlashpoint(Method):
    """Google ML Flashpoint: DCP ``save`` through its ``MemoryStorageWriter`` into tmpfs.

    Set up as its user guide's "PyTorch DCP" section does, on one node: a
    ``CheckpointObjectManager``, a ``ReplicationManager`` (with one node its pairwise strategy
    replicates to nobody; the bench passes a strategy that says so, because the default one
    divides by ``torch.cuda.device_count()`` and fails without a GPU) and the writer. The
    stall is the synchronous ``dcp.save`` (as its guide's sync save). Its checkpoints live
    in memory only — on no disk, and across nodes only by replication — so the row has no
    durable time; restoring is a ``dcp.load`` through its ``MemoryStorageReader``.

    Its loader (0.0.10) takes a checkpoint as complete only if it holds Megatron's
    ``common.pt``, which a plain DCP save never writes, so its guide's recovery found no
    checkpoint after any save: the bench writes an empty one into each checkpoint, as its
    Megatron adapter writes the common state, before finalizing it.
    """

    name = "ml-flashpoint"
    description = "Google ML Flashpoint: dcp.save → MemoryStorageWriter (tmpfs, memory only)"
    leftovers = (FLASHPOINT_BASE.format(pid="*"),)

    def setup(self, state_dict: StateDict) -> None:
        def imports() -> Any:
            from ml_flashpoint.adapter.pytorch import memory_storage_reader, memory_storage_writer
            from ml_flashpoint.checkpoint_object_manager import checkpoint_object_manager
            from ml_flashpoint.core import (
                checkpoint_id_types,
                checkpoint_loader,
                checkpoint_saver,
                defaults,
            )
            from ml_flashpoint.replication import replication_manager

            return (
                memory_storage_writer,
                memory_storage_reader,
                checkpoint_object_manager,
                checkpoint_id_types,
                checkpoint_loader,
                checkpoint_saver,
                defaults,
                replication_manager,
            )

        os.environ.setdefault("MLFLASHPOINT_LOG_LEVEL", "WARNING")  # DEBUG by default
        # One node: else its loader counts nodes as world size / torch.cuda.device_count(),
        # which fails without a GPU.
        os.environ.setdefault("NNODES", "1")
        (writer_mod, reader_mod, objects, ids, loading, saving, defaults, replication) = (
            _peer_import("ml-flashpoint", imports)
        )
        import concurrent.futures

        import torch.distributed as dist
        from torch import multiprocessing as torch_mp

        self.ctx.ensure_process_group()

        class OneNode(replication.ReplicationStrategy):
            def get_destination_addresses(self, global_rank: int) -> list[str]:
                return []  # what its pairwise strategy answers on one node

        manager = objects.CheckpointObjectManager()
        self.replication = replication.ReplicationManager()
        self.replication.initialize(manager, repl_strategy=OneNode([]))
        self.mp_manager = torch_mp.Manager()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_result(self.mp_manager)
        nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        self.writer = writer_mod.MemoryStorageWriter(
            checkpoint_saver=saving.DefaultMLFlashpointCheckpointSaver(
                global_rank_getter=dist.get_rank,
                local_rank_getter=lambda: 0,
                global_barrier_func=dist.barrier,
                ckpt_obj_manager=manager,
                replication_manager=self.replication,
                initial_buffer_size_bytes=nbytes + nbytes // 16 + (64 << 20),
            ),
            mp_manager_future=future,
        )
        self.loader = loading.DefaultMLFlashpointCheckpointLoader(
            manager,
            self.replication,
            global_rank_getter=dist.get_rank,
            local_rank_getter=lambda: 0,
            broadcast_object_list_func=dist.broadcast_object_list,
            all_gather_object_func=dist.all_gather_object,
            world_size_getter=dist.get_world_size,
        )
        self.reader_cls = reader_mod.MemoryStorageReader
        self.ids = ids.CheckpointContainerId
        self.common_name = defaults.COMMON_STATE_FNAME
        self.base = Path(FLASHPOINT_BASE.format(pid=os.getpid()))
        self.step = 0
        self.note = (
            f"memory only: checkpoints in tmpfs ({self.base.parent}), on no disk, so no "
            "durable time (multi-node jobs replicate them to a peer node's memory)"
        )

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        import torch.distributed.checkpoint as dcp

        self.step += 1
        checkpoint = self.ids.create_child(
            self.ids(str(self.base)), self.ids.format_version_container(self.step)
        )
        t0 = time.perf_counter()
        dcp.save(state_dict, checkpoint_id=str(checkpoint), storage_writer=self.writer)
        # what its Megatron adapter does: the common state next to the shards (its loader
        # needs the file), then mark the checkpoint complete (its loader finds no other) and
        # start removing the older ones
        torch.save({}, Path(checkpoint.data) / self.common_name)
        cleaner = self.writer.checkpoint_saver.finalize_checkpoint(checkpoint)
        stall = time.perf_counter() - t0
        if cleaner is not None:
            cleaner.wait(timeout=600)
        detail: dict[str, Any] = {}
        if self.step == 2:  # once (the first repeat): a restart's restore from its memory
            t1 = time.perf_counter()
            latest = self.loader.get_latest_complete_checkpoint(self.ids(str(self.base)))
            if latest is None:
                raise RuntimeError(f"ML Flashpoint found no complete checkpoint in {self.base}")
            reader = self.reader_cls(path=str(latest), checkpoint_loader=self.loader)
            dcp.load(state_dict, checkpoint_id=str(latest), storage_reader=reader)
            synchronize(self.device)
            detail["restore_s"] = restore_s = time.perf_counter() - t1
            self.note += f"; restore (latest complete, dcp.load from its memory): {restore_s:.3f} s"
        return Timing(stall, None, detail)

    def close(self) -> None:
        for name in ("mp_manager", "replication"):
            thing = getattr(self, name, None)
            if thing is not None:
                thing.shutdown()
        if hasattr(self, "base"):
            shutil.rmtree(self.base, ignore_errors=True)


def leftovers(cls: type[Method]) -> set[str]:
    """What matches a method's ``leftovers`` globs now (before its process starts)."""
    return {path for pattern in cls.leftovers for path in glob.glob(pattern)}


def remove_leftovers(cls: type[Method], before: set[str]) -> None:
    """Remove what a method's process left behind that was not there before it started."""
    for path in leftovers(cls) - before:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


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
    """shmstage in steady state: one ``Stager`` whose layout and every slot are set up.

    ``reserve()`` sets them up before the first timed save, as a training loop would. Before
    it existed, the row's first repeat was the first fill of the Stager's second slot, which
    registers and pins it (0.55 s more on an H100 at 8 GiB): a first save, not a steady one.
    A client without ``reserve()`` gets that first fill untimed instead (``warm_up``)."""

    name = "shmstage-steady"
    kind = "shmstage"
    description = "shmstage, steady state: persistent Stager, every slot set up (reserve())"
    #: Whether each save follows a sample of the direct-I/O limit (``BenchContext.
    #: paired_limit``): on the H100 VM the limit's own samples spread by 13% within one run
    #: (4.92-5.56 s for 8 GiB), more than the 10% a durable save may take beyond it, so a
    #: save is also compared with the limit measured just before it, on the same disk pace.
    pairs_limit: bool = True

    def setup(self, state_dict: StateDict) -> None:
        stager_cls = import_stager()
        self.stager = stager_cls(socket=self.ctx.shmstage_socket(), slots=self.ctx.slots)
        if hasattr(self.stager, "reserve"):
            self.stager.reserve(state_dict)
        else:
            self.warm_up(state_dict, self.ctx.slots)
        self.limit: DirectWrite | None = None
        if self.pairs_limit and self.ctx.paired_limit:
            limit = DirectWrite(self.ctx)
            try:
                limit.setup(state_dict)
            except MethodUnavailable as exc:
                limit.close()
                self.note = f"no paired limit: {exc}"
            else:
                self.limit = limit

    def warm_up(self, state_dict: StateDict, saves: int) -> None:
        """``saves`` untimed saves, each durable before the next."""
        for index in range(saves):
            warmup = self.ctx.root / f"{self.name}-warmup-{index}"
            self.stager.save(state_dict, str(warmup)).wait(timeout=600)
            shutil.rmtree(warmup, ignore_errors=True)

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        paired = None
        if self.limit is not None:
            beside = directory.with_name(f"{directory.name}-limit")
            try:
                paired = self.limit.run_once(state_dict, beside).durable_s
            finally:
                shutil.rmtree(beside, ignore_errors=True)
        t0 = time.perf_counter()
        handle = self.stager.save(state_dict, str(directory))
        stall = time.perf_counter() - t0
        result = handle.wait(timeout=600)
        durable = time.perf_counter() - t0
        detail = _result_detail(handle, result)
        if paired is not None:
            detail.update(paired_limit_s=paired, durable_vs_paired_limit=durable / paired)
        return Timing(stall, durable, detail)

    def close(self) -> None:
        stager = getattr(self, "stager", None)
        if stager is not None:
            stager.close()
        limit = getattr(self, "limit", None)
        if limit is not None:
            limit.close()


class ShmstageBusy(ShmstageSteady):
    """shmstage steady state while the trainer computes: what the write costs a step.

    Each checkpoint first times a fixed compute step with nothing in flight, then saves and
    keeps stepping until the checkpoint is durable; the two medians (and their ratio) show
    the writer's CPU and memory-bandwidth cost on the trainer.
    """

    name = "shmstage-busy"
    description = "shmstage, steady state, trainer computing while the daemon persists"
    pairs_limit = False  # its subject is the trainer's step, not the disk

    def setup(self, state_dict: StateDict) -> None:
        super().setup(state_dict)
        self.loop = ComputeLoop(self.device)
        self.warm_up(state_dict, 1)  # the first copy of the process: not this row's subject
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
    # the peers whose rows are new first, torch.save and DCP (in every earlier run) after
    # them: when a slow disk leaves too little for every repeat, the last get first saves
    DlroverFlash,
    MlFlashpoint,
    NvrxShmCached,
    NvrxTorchAsync,
    TorchSave,
    DcpSave,
    DcpAsyncSave,
    DcpAsyncDefaultStager,
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
    #: Seconds this process may spend from its start (its share of ``--budget``), or None;
    #: and how far its first repeat may overrun that.
    share_s: float | None = None
    stretch_s: float = 0.0


def run_method(job: MethodJob) -> MethodResult:
    """In the method's own process: build the same state dict, measure, hand back the rows.

    The state dict is rebuilt here from the same spec and seed, so every method moves the
    very same bytes without any tensor crossing a process boundary. The budget's share
    counts from here, so building the state dict and the method's setup spend it too.
    """
    plan = RepeatPlan.starting_now(job.repeats, job.share_s, job.stretch_s)
    cls = available_methods()[job.method]
    job.ctx.root.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    state_dict = job.spec.build()
    # No teardown: the process ends right after, which also ends what a peer left behind.
    return measure(cls(job.ctx), state_dict, job.repeats, log, job.save_timeout, plan)
