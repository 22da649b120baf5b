"""torchtitan checkpoints through shmstaged: one override on the command line.

torchtitan (0.3) builds its checkpointer from ``Trainer.Config.checkpoint`` — whichever
``Config`` sits there builds its own class — and has no setting that swaps DCP's stager.
``ShmStageCheckpointManager`` is torchtitan's DCP ``CheckpointManager`` with shmstage's DCP
writer and reader underneath; selecting it is replacing that one config node, which
torchtitan's override mechanism does from the command line::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b --checkpoint.enable \\
        --override.imports shmstage_client.integrations.torchtitan.shmstage_checkpoint

(``'...shmstage_checkpoint={"socket": "/run/shmstage/shmstaged.sock"}'`` passes settings), or
in a config function: ``config.checkpoint = ShmStageCheckpointManager.Config(enable=True)``.

What changes against torchtitan's own manager, per ``async_mode`` (ours defaults to
``async_with_pinned_mem``, the mode torchtitan names for "copy behind the next step"):

``async_with_pinned_mem``
    ``save()`` returns once everything but the optimizers' parameters and state is copied
    (buffers, the dataloader's and the scheduler's state: usually milliseconds); their copy
    runs behind the next forward and backward, and each optimizer's ``step()`` waits for it
    (the guard's step pre-hooks, ``shmstage_client.save.guard``: on CUDA a wait on the
    device), so ``maybe_wait_for_staging`` — torchtitan's call right before the optimizer
    step — has nothing to block on. torchtitan's own mode stages into pinned shared memory
    of its own on a thread and writes from a separate process; here both are the daemon's.
``async``
    ``save()`` returns once everything is copied into the daemon's shared memory.
``disabled``
    ``save()`` returns once the checkpoint is durable (still written by the daemon).

Every checkpoint is published atomically (``step-N/`` appears complete or not at all), so
``keep_latest_k`` counts and deletes only published checkpoints, never the one being
written; a restart finds the newest published one and reads each rank file from the node
daemon's memory when it still holds it (after a crash), else from the files. A model-only
export at the last step (``last_save_model_only``, torchtitan's default) and HF-format
saves and loads stay torchtitan's own: they are exports for other tools, with no training
step to overlap.

torchtitan is imported on first use of ``ShmStageCheckpointManager`` (built then, since it
subclasses torchtitan's class), so importing this module never needs it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, Literal

__all__ = [  # ShmStageCheckpointManager is built on first access (module __getattr__)
    "INSTALL_HINT",
    "OVERRIDE_TARGET",
    "ShmStageCheckpointManager",  # noqa: F822
    "shmstage_checkpoint",
]

log = logging.getLogger("shmstage.torchtitan")

INSTALL_HINT: Final = "pip install 'shmstage-client[torchtitan]'"
#: What ``--override.imports`` names: this module and the override's function.
OVERRIDE_TARGET: Final = f"{__name__}.shmstage_checkpoint"
#: torchtitan's manager members this subclass calls or replaces; a torchtitan without one of
#: them is a version this integration does not know, refused rather than half-working.
_RELIED_ON: Final = (
    "_save",
    "_load",
    "_maybe_wait_for_staging",
    "_wait_for_saving",
    "_close",
    "_should_save",
    "_should_purge",
    "_create_checkpoint_id",
    "_flattened_model_states_sd",
    "_save_last_step",
    "_find_load_step",
    "_purge_stale_checkpoints",
    "dcp_save",
    "dcp_load",
)
#: A checkpoint directory, exactly: shmstage's pending directories (``.step-N.ID.shmstage-
#: pending``) contain the same words and must never count as a checkpoint.
_STEP_DIR: Final = re.compile(r"step-(\d+)")
#: Files that make a step directory a complete checkpoint: shmstage's commit marker, DCP's
#: metadata, or an HF export's index (torchtitan's own test, for its own formats).
_COMPLETE_MARKERS: Final = ("shmstage-dcp.json", ".metadata", "model.safetensors.index.json")


def shmstage_checkpoint(config: Any, **settings: Any) -> Any:
    """torchtitan override: the run's ``CheckpointManager.Config`` -> ours, same settings.

    Every field the user set (``--checkpoint.interval``, ``keep_latest_k``...) carries over;
    ``settings`` (the JSON after ``=`` in ``--override.imports``) sets ours: ``socket``,
    ``async_mode`` (default ``async_with_pinned_mem``), ``slots``, ``pin``,
    ``save_timeout``, ``request_timeout``, ``restore_source``, ``verify_on_load``.
    """
    manager = _manager_class()
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.config.override import derive

    if not settings.get("enable", config.enable):
        log.warning(
            "%s: checkpointing is off in this run (add --checkpoint.enable): nothing is saved "
            "or loaded, through shmstage or otherwise", OVERRIDE_TARGET,
        )
    if isinstance(config, manager.Config):
        return dataclasses.replace(config, **settings)
    if type(config) is not CheckpointManager.Config:
        raise TypeError(
            f"{OVERRIDE_TARGET} replaces torchtitan's DCP CheckpointManager, but this run's "
            f"checkpoint config is {type(config).__qualname__} (another manager, whose behaviour "
            "it would drop): leave the override out, or use torchtitan's CheckpointManager"
        )
    return derive(config, manager.Config, **{"async_mode": "async_with_pinned_mem", **settings})


def __getattr__(name: str) -> Any:
    if name == "ShmStageCheckpointManager":
        return _manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _register_override() -> None:
    """Make ``shmstage_checkpoint`` a torchtitan override (its registry is by import path)."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.config.override import override

    with contextlib.suppress(ValueError):  # registered already: the registry keeps the first
        override(
            target=CheckpointManager.Config,
            description="checkpoints through shmstaged (shmstage-client)",
        )(shmstage_checkpoint)


@functools.cache
def _manager_class() -> type:
    try:
        import torchtitan.components.checkpointer
        import torchtitan.config.override  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"shmstage's torchtitan integration needs torchtitan 0.3 or newer ({INSTALL_HINT}); "
            f"importing it failed: {exc}"
        ) from exc
    cls = _build_manager_class()
    globals()["ShmStageCheckpointManager"] = cls
    _register_override()
    return cls


def _build_manager_class() -> type:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    from torchtitan.components.checkpointer import MODEL, OPTIMIZER, AsyncMode, CheckpointManager
    from torchtitan.tools import filesystem

    from shmstage_client.connection import DaemonConnection
    from shmstage_client.dcp import ShmStageReader, ShmStageWriter
    from shmstage_client.errors import DaemonUnavailable, SaveError, SaveTimeout

    missing = [name for name in _RELIED_ON if not hasattr(CheckpointManager, name)]
    if missing:
        import torchtitan

        version = getattr(torchtitan, "__version__", "unknown")
        raise ImportError(
            f"torchtitan {version}'s CheckpointManager lacks {missing}: shmstage's integration "
            f"follows torchtitan 0.3's checkpointer ({INSTALL_HINT} installs a known one)"
        )

    class ShmStageCheckpointManager(CheckpointManager):
        """torchtitan's DCP ``CheckpointManager``, saving and loading through shmstaged.

        Built by torchtitan from ``ShmStageCheckpointManager.Config`` (or the
        ``shmstage_checkpoint`` override) with the trainer's model parts, optimizers, LR
        schedulers, dataloader and train state, like the manager it replaces. One
        ``ShmStageWriter`` per rank for the whole run: its staging layout, and so the node
        daemon's shared memory, is reused by every save of the same structure. Saves go to
        ``{dump_folder}/{folder}/step-N`` on a local or shared POSIX filesystem.
        """

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            """torchtitan's checkpoint settings, plus where and how shmstaged stages them."""

            async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = (
                "async_with_pinned_mem"
            )
            """"async_with_pinned_mem": the optimizers' state is copied behind the next
            forward and backward, each optimizer step waiting for it; "async": save() returns
            once everything is copied; "disabled": save() returns once it is durable."""

            socket: str | None = None
            """This node's shmstaged socket (default: $SHMSTAGE_SOCKET, else the system's)."""

            slots: int | None = None
            """Staging buffers per rank (default: the daemon's default_slots); 2 lets a save
            start while the previous one is still being written."""

            pin: bool | None = None
            """Page-lock the staging memory for CUDA copies (default: when there are CUDA
            tensors)."""

            save_timeout: float = 3600.0
            """Seconds a checkpoint may take to become durable before the wait for it fails."""

            request_timeout: float = 600.0
            """Seconds any one daemon request, and a step waiting for a copy, may take."""

            restore_source: Literal["auto", "files", "memory"] = "auto"
            """Where a load reads each rank file: "auto" (the daemon's memory when it still
            holds it, else the file), "files", or "memory" (fail if it is not there)."""

            verify_on_load: bool = True
            """Check every tensor and object read against its recorded CRC-32C."""

            def __post_init__(self) -> None:
                CheckpointManager.Config.__post_init__(self)
                if self.restore_source not in ("auto", "files", "memory"):
                    raise ValueError(
                        f"restore_source={self.restore_source!r}: use auto, files or memory"
                    )
                for name in ("save_timeout", "request_timeout"):
                    if getattr(self, name) <= 0:
                        raise ValueError(f"{name} must be positive, not {getattr(self, name)}")

        def __init__(self, config: Config, **components: Any) -> None:
            if config.enable:  # refusals before torchtitan starts its purge thread
                folder = filesystem.join(components.get("base_folder", ""), config.folder)
                if filesystem.is_remote(folder):
                    raise ValueError(
                        f"checkpoint folder {folder!r} is remote: shmstaged writes to a POSIX "
                        "filesystem of its node (local disk or a shared mount)"
                    )
                if not config.load_only:
                    _check_daemon(config.socket)
            super().__init__(config, **components)
            if not self.enable:
                return
            self.socket = config.socket
            self.save_timeout = config.save_timeout
            self.restore_source = config.restore_source
            self.verify_on_load = config.verify_on_load
            #: The directory of the save in flight, for messages; None when none is.
            self.saving: str | None = None
            #: After each load from shmstage: rank -> "memory" or "files".
            self.last_load_sources: dict[int, str] = {}
            self._stock_writer = False
            guarded = self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
            self.writer = ShmStageWriter(
                socket=config.socket,
                slots=config.slots,
                pin="auto" if config.pin is None else config.pin,
                request_timeout=config.request_timeout,
                timeout=config.save_timeout,
                guard=_optimizers_of(self.states[OPTIMIZER]) if guarded else None,
            )

        # -- saving -----------------------------------------------------------------

        @torch.no_grad()
        def _save(self, curr_step: int, last_step: bool = False) -> bool:
            """torchtitan's save policy (interval, last step, purge) with one writer that is
            its own stager: no DefaultStager, no pinned copy of the state in this process."""
            if not self._should_save(curr_step, last_step):
                return False
            self.maybe_wait_for_saving()  # one save in flight per writer
            begin = time.monotonic()
            if last_step:
                self._save_last_step(curr_step)
                log.info("shmstage: last-step checkpoint %d done in %.2f s", curr_step,
                         time.monotonic() - begin)
                return True
            checkpoint_id = self._create_checkpoint_id(curr_step)
            result = self.dcp_save(
                self._flattened_model_states_sd(),
                checkpoint_id=checkpoint_id,
                async_mode=self.async_mode,
            )
            if isinstance(result, AsyncSaveResponse):
                self.staging_future = result.staging_completion
                self.save_future = result.upload_completion
            elif result is not None:
                self.save_future = result
            if self.save_future is not None:
                self.saving = checkpoint_id
                self.save_future.add_done_callback(_report_failure(checkpoint_id))
            self._purge_stale_checkpoints()
            log.info(
                "shmstage: checkpoint %s: save() returned in %.3f s%s", checkpoint_id,
                time.monotonic() - begin, "" if result is None else ", written in the background",
            )
            return True

        def _save_last_step(self, curr_step: int) -> None:
            """A full last-step checkpoint goes through shmstage like any other; a model-only
            export (torchtitan's default) is written by torchtitan's own DCP writer, in the
            format its conversion tools read — there is no next step to overlap it with."""
            if not self.last_save_model_only:
                super()._save_last_step(curr_step)
                return
            self._stock_writer = True
            try:
                super()._save_last_step(curr_step)
            finally:
                self._stock_writer = False

        def dcp_save(
            self,
            state_dict: dict[str, Any],
            checkpoint_id: str,
            async_mode: Any,
            enable_garbage_collection: bool = False,
            to_hf: bool = False,
        ) -> Any:
            """``dcp.save``/``dcp.async_save`` with the shmstage writer; HF-format saves and
            the model-only export stay torchtitan's."""
            if to_hf or self._stock_writer:
                return super().dcp_save(
                    state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
                )
            if async_mode == AsyncMode.DISABLED:
                dcp.save(
                    state_dict,
                    checkpoint_id=checkpoint_id,
                    storage_writer=self.writer,
                    process_group=self.pg,
                )
                return None
            return dcp.async_save(
                state_dict,
                checkpoint_id=checkpoint_id,
                storage_writer=self.writer,
                process_group=self.pg,  # torchtitan's gloo group for asynchronous saves
            )

        def _maybe_wait_for_staging(self) -> None:
            """Right before the optimizer step. The copy of the optimizers' parameters and
            state may still be running: each optimizer's step pre-hook (the guard) holds its
            step until that copy has landed — on CUDA by making the step's stream wait, with
            no host wait — so blocking the host here would only add a bubble. Staging
            failures reach every rank through the save's completion (``_wait_for_saving``)."""
            if self.staging_future is not None and self.staging_future.done():
                self.staging_future = None

        def _wait_for_saving(self) -> None:
            """Wait (bounded by ``save_timeout``) until the save in flight is published; a
            failure is a ``SaveError`` naming it (DCP's ``CheckpointException`` is a
            ``BaseException``, which torchtitan's ``except Exception`` cleanup would miss)."""
            future, self.save_future = self.save_future, None
            saving, self.saving = self.saving, None
            self.staging_future = None
            if future is None:
                return
            try:
                future.result(timeout=self.save_timeout)
            except concurrent.futures.TimeoutError:
                raise SaveTimeout(
                    f"checkpoint {saving} was not durable within save_timeout="
                    f"{self.save_timeout} s; see shmstaged's log for its write, or raise "
                    "--checkpoint.save_timeout"
                ) from None
            except (Exception, CheckpointException) as exc:
                raise SaveError(
                    f"checkpoint {saving} failed and was not published (earlier checkpoints "
                    f"are untouched): {_reason(exc)}"
                ) from exc

        def _purge_stale_checkpoints(self) -> None:
            """Keep the ``keep_latest_k`` newest *published* checkpoints: the save in flight
            is not one of them, so it never pushes a durable one out, nor is deleted."""
            if not self._should_purge():
                return
            steps = sorted(_published_steps(self.folder).items())
            for _, path in steps[: -self.keep_latest_k]:
                self.purge_queue.put(path)

        # -- loading ----------------------------------------------------------------

        def _find_load_step(self, folder: str = "") -> int:
            """The newest complete checkpoint's step (-1 if none): a directory named exactly
            ``step-N`` holding a commit marker (ours, DCP's, or an HF index)."""
            steps = _published_steps(folder or self.folder)
            return max(steps) if steps else -1

        def dcp_load(
            self,
            state_dict: dict[str, Any],
            checkpoint_id: str,
            from_hf: bool,
            from_quantized: bool,
        ) -> None:
            """Load a shmstage checkpoint with ``ShmStageReader`` (each rank file from the
            daemon's memory when it still holds it); any other through torchtitan's own."""
            if from_hf or not _is_shmstage_checkpoint(checkpoint_id):
                super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
                return
            reader = ShmStageReader(
                checkpoint_id,
                verify=self.verify_on_load,
                source=self.restore_source,
                socket=self.socket,
            )
            dcp.load(state_dict, storage_reader=reader, process_group=self.pg)
            if MODEL in self.states:  # the model's entries were flattened into state_dict
                self.states[MODEL].load_state_dict(state_dict)
            self.last_load_sources = dict(reader.sources)
            from_memory = sorted(r for r, s in reader.sources.items() if s == "memory")
            log.info(
                "shmstage: loaded %s; rank files from shmstaged's memory: %s, from files: %s",
                checkpoint_id, from_memory or "none",
                sorted(set(reader.sources) - set(from_memory)) or "none",
            )

        # -- closing ----------------------------------------------------------------

        def _close(self) -> None:
            """Wait (bounded) for the save in flight, release the writer's slots and its
            connection, then torchtitan's own cleanup; a failed last save is raised."""
            writer = self.__dict__.pop("writer", None)
            try:
                if writer is not None and self.save_future is not None:
                    self._wait_for_saving()
            finally:
                if writer is not None:
                    writer.close()
                super()._close()

    def _report_failure(checkpoint_id: str) -> Callable[[concurrent.futures.Future[Any]], None]:
        """Log a failed asynchronous save when it fails; torchtitan raises it at the next
        save (``_wait_for_saving``) or at close."""

        def report(future: concurrent.futures.Future[Any]) -> None:
            error = future.exception()
            if error is not None:
                log.error(
                    "shmstage: checkpoint %s failed and was not published: %s; training goes "
                    "on, the next save or close raises it", checkpoint_id, _reason(error),
                )

        return report

    def _check_daemon(socket: str | None) -> None:
        """Fail before the first step, not at the first checkpoint, when no daemon answers."""
        try:
            DaemonConnection(socket, client_name=f"shmstage torchtitan pid {os.getpid()}").close()
        except DaemonUnavailable as exc:
            raise DaemonUnavailable(
                f"{exc} — start shmstaged on this node, or name its socket with "
                '--checkpoint.socket (or the override\'s {"socket": ...}) or $SHMSTAGE_SOCKET'
            ) from None

    def _optimizers_of(container: Any) -> list[torch.optim.Optimizer]:
        """The optimizers whose ``step()`` mutates the state: an ``OptimizersContainer``'s
        members (they hold the per-parameter state; the container holds none)."""
        members = getattr(container, "optimizers", None)
        if isinstance(members, list) and members and all(
            isinstance(m, torch.optim.Optimizer) for m in members
        ):
            return members
        if isinstance(container, torch.optim.Optimizer):
            return [container]
        raise TypeError(
            f"async_mode=async_with_pinned_mem guards the optimizers' steps, but the "
            f"trainer's optimizer is a {type(container).__qualname__} with no torch "
            "optimizers in .optimizers: use async_mode=async"
        )

    for cls in (ShmStageCheckpointManager, ShmStageCheckpointManager.Config):
        cls.__module__ = __name__  # found (and pickled) as this module's attribute
        cls.__qualname__ = cls.__qualname__.rsplit("<locals>.", 1)[-1]
    return ShmStageCheckpointManager


def _published_steps(folder: str) -> dict[int, str]:
    """Step -> directory of every complete checkpoint directly in ``folder``."""
    steps: dict[int, str] = {}
    for name, path in _entries(folder):
        match = _STEP_DIR.fullmatch(name)
        if match and any(os.path.isfile(os.path.join(path, m)) for m in _COMPLETE_MARKERS):
            steps[int(match.group(1))] = path
    return steps


def _entries(folder: str) -> Iterator[tuple[str, str]]:
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        yield name, os.path.join(folder, name)


def _is_shmstage_checkpoint(path: str) -> bool:
    from shmstage_client.dcp import MARKER_NAME

    return os.path.isfile(os.path.join(path, MARKER_NAME))


def _reason(error: BaseException) -> str:
    """DCP's CheckpointException holds each rank's failure; the first one says why."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, first = min(failures.items(), key=lambda item: item[0])
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            first = first[0]  # DCP keeps (exception, stack summary)
        return f"rank {rank}: {type(first).__name__}: {first}" + (
            f" (and {len(failures) - 1} more ranks)" if len(failures) > 1 else ""
        )
    return f"{type(error).__name__}: {error}"


if "torchtitan.config.override" in sys.modules:
    # torchtitan is importing this module for --override.imports: register the override
    # now, which builds the class (torchtitan is loaded anyway).
    _manager_class()
