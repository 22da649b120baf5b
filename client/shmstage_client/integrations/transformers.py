"""The Hugging Face ``Trainer`` (and TRL's trainers) checkpointing through shmstaged.

    from shmstage_client.integrations.transformers import ShmStageCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[ShmStageCallback()])
    trainer.train()                                 # checkpoint-N/ as args.save_* say
    trainer.train(resume_from_checkpoint=True)      # after a crash: from shmstaged's memory

Each checkpoint the Trainer decides to make (``save_strategy``, ``save_steps``, "best") is
one shmstage save of the model's state dict with the optimizer, the LR scheduler, the
gradient scaler and the random states beside it, and ``trainer_state.json``'s text in the
manifest's metadata. The step stalls only for the copy into shared memory (with
``overlap``, the optimizer's tensors are copied behind the next forward and backward); the
daemon writes ``checkpoint-N/`` in a hidden pending directory and renames it into place once
complete, so ``get_last_checkpoint`` — which takes the highest ``checkpoint-N`` and checks
nothing — never sees a partial one. ``save_total_limit`` rotation only ever lists published
checkpoints, so it cannot remove one still being written (a run holds at most one more
than the limit while the newest is written). ``train(resume_from_checkpoint=True)`` takes
the newest checkpoint of this run: from shmstaged's memory when it still holds it (after a
crash of the trainer, even while it is being written), else the newest complete one on
disk written by this user (``last_checkpoint``).

Why the callback installs a mixin rather than being a callback only (from the Trainer's
source, transformers 5.x): ``_save_checkpoint`` writes ``checkpoint-N/`` file by file
(model, optimizer, scheduler, scaler, RNG, ``trainer_state.json``) whenever
``control.should_save`` is set after ``on_step_end`` — a callback that clears it can save
instead, but only before the step's log entry and evaluation are in the state (so the saved
``trainer_state.json`` would differ from the Trainer's), never for ``save_strategy="best"``
(set after the last callback ran), and without the gradient scaler or the other callbacks'
states, which callbacks are not given. The loading side has no callback at all:
``train()`` reads ``trainer_state.json``, the weights, the optimizer, scheduler, scaler and
RNG files from the checkpoint path before ``on_train_begin``. So ``ShmStageCallback``, when
its Trainer is built (``on_init_end``), makes that Trainer an instance of a subclass with
``ShmStageTrainerMixin`` first — that Trainer only, its class name unchanged — which
replaces ``_save_checkpoint``, the loaders and ``_load_best_model``, and resolves
``resume_from_checkpoint``. ``class MyTrainer(ShmStageTrainerMixin, SFTTrainer)`` does the
same explicitly (then set ``trainer.shmstage = ShmStageOptions(...)`` or keep the defaults).

A checkpoint directory holds ``model.safetensors`` (every tensor: the model's under its own
names, readable by ``safetensors.torch.load_file`` and ``from_pretrained(dir,
config=...)`` — which warn about the extra ``hf_trainer.*`` keys — and the optimizer's
and RNG's under ``hf_trainer.``) and ``shmstage-manifest.json``. A stock Trainer cannot
resume from it: it finds no ``trainer_state.json`` and stops (it never half-resumes).

Not covered (each raises, or is left to the Trainer, as said): more than one process (DDP:
each rank's RNG would need a checkpoint of its own), DeepSpeed and FSDP (their engines
write sharded files; the callback raises), ``push_to_hub`` of each checkpoint, and what a
Trainer subclass adds in its own ``_save_checkpoint`` (TRL's model card per checkpoint:
the mixin replaces the method whole). A PEFT model is saved whole (base and adapters).

This module imports transformers only where it needs it: ``ShmStageCallback`` is built on
first access.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch

from shmstage import listing
from shmstage.checkpoint import CheckpointError
from shmstage.manifest import MANIFEST_NAME
from shmstage_client.errors import SaveError
from shmstage_client.integrations.accelerate import rng_state, set_rng_state
from shmstage_client.restore.restoring import Restored, latest, restore
from shmstage_client.save.handle import SaveHandle
from shmstage_client.save.stager import Stager

log = logging.getLogger("shmstage.client")

# ShmStageCallback subclasses transformers' TrainerCallback, so it is built on first access
# (the module's __getattr__), which ruff cannot see.
__all__ = ["ShmStageCallback", "ShmStageOptions", "ShmStageTrainerMixin", "last_checkpoint"]  # noqa: F822

#: Marks a checkpoint written by this integration; resuming refuses anything else.
FORMAT: Final = "shmstage-hf-trainer/1"
#: The top-level key holding everything but the model's own state dict.
TRAINER_KEY: Final = "hf_trainer"
_CHECKPOINT: Final = re.compile(r"^checkpoint-(\d+)$")
_TRAINER_STATE: Final = "trainer_state.json"


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint in ``output_dir`` that this user wrote, or None.

    For scripts, in place of ``transformers.trainer_utils.get_last_checkpoint``, which takes
    the highest ``checkpoint-N`` whatever it holds or whoever wrote it. Here a shmstage
    checkpoint counts once its manifest is there and it was written for this user
    (``shmstage.listing.not_written_for``: its directory and files are this user's and
    nobody else could change them); a stock Trainer checkpoint once it has its
    ``trainer_state.json`` and belongs to this user. Reads no tensor data.
    """
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return None
    steps = sorted(
        ((int(match.group(1)), name) for name in names if (match := _CHECKPOINT.match(name))),
        reverse=True,
    )
    for _, name in steps:
        path = os.path.join(output_dir, name)
        if _complete(Path(path)):
            return path
    return None


def _complete(path: Path) -> bool:
    uid = os.geteuid()
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    if not path.is_dir() or path.is_symlink():
        return False
    if (path / MANIFEST_NAME).exists():
        return listing.inspect(path, uid=uid).state == listing.COMPLETE
    return st.st_uid == uid and (path / _TRAINER_STATE).is_file()


def _is_shmstage(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


@dataclasses.dataclass
class ShmStageOptions:
    """How a Trainer saves through shmstaged.

    ``socket``: the daemon's, when not the default. ``slots``: staging buffers (default:
    the daemon's ``default_slots``); with 2, a checkpoint is copied while the previous one
    is still written. ``overlap``: copy the optimizer's parameters and state behind the
    next forward and backward (``Stager.guard`` + ``save(block=False)``); the optimizer's
    step waits for the copy. ``restore_device``: where a resume reads the checkpoint before
    loading it into the model and optimizer (CPU, as the Trainer does, to spare the
    device's memory).
    """

    socket: str | os.PathLike[str] | None = None
    slots: int | None = None
    overlap: bool = True
    restore_device: str = "cpu"


@dataclasses.dataclass
class _Resume:
    """A checkpoint read for ``train(resume_from_checkpoint=...)``, handed out by the
    loaders the Trainer calls; ``where`` is the path the Trainer was given."""

    restored: Restored
    where: str
    model_loaded: bool = False

    @property
    def trainer(self) -> Mapping[str, Any]:
        return self.restored.state.get(TRAINER_KEY) or {}

    def model_state(self) -> dict[str, Any]:
        return {key: value for key, value in self.restored.state.items() if key != TRAINER_KEY}


class _Session:
    """One Trainer's shmstage state: its options, its Stager (made at the first save,
    closed when ``train()`` ends) and the saves not known to be durable yet."""

    def __init__(self, options: ShmStageOptions) -> None:
        self.options = options
        self.stager: Stager | None = None
        self.guarded: set[int] = set()
        self.in_flight: dict[str, SaveHandle] = {}
        self.last_save: SaveHandle | None = None
        self.resume: _Resume | None = None
        self.restored: Restored | None = None

    def stager_for(self, optimizer: Any) -> Stager:
        if self.stager is None:
            self.stager = Stager(self.options.socket, slots=self.options.slots)
            self.guarded = set()
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
        overlap = self.options.overlap and isinstance(inner, torch.optim.Optimizer)
        if overlap and id(inner) not in self.guarded:
            self.stager.guard(inner)
            self.guarded.add(id(inner))
        return self.stager

    def settle(self, *, wait: bool) -> None:
        """Forget the saves that are durable; raise the first that failed. ``wait``: for
        all of them first (at the end of ``train``, or before reading one back)."""
        for path, handle in list(self.in_flight.items()):
            if not (wait or handle.done()):
                continue
            del self.in_flight[path]
            try:
                handle.wait()
            except SaveError as exc:
                raise SaveError(f"the Trainer's checkpoint {path} was not saved: {exc}") from exc

    def close(self, *, retain: bool = False) -> None:
        """After ``train()``: wait for the saves (unless it failed: then the daemon keeps
        the newest in memory for the restart), release the Stager."""
        stager, self.stager = self.stager, None
        try:
            if not retain:
                self.settle(wait=True)
        finally:
            self.in_flight.clear()
            if stager is not None:
                stager.close(retain=retain)


class ShmStageTrainerMixin:
    """The Trainer's checkpoint writer and readers, through shmstaged. Put it first:
    ``class MyTrainer(ShmStageTrainerMixin, Trainer)``; ``ShmStageCallback`` does so for
    you. Single process only (one GPU, or CPU)."""

    shmstage: ShmStageOptions = ShmStageOptions()

    # -- the session ----------------------------------------------------------------

    @property
    def _shm(self) -> _Session:
        session = self.__dict__.get("_shmstage_session")
        if session is None:
            session = self.__dict__["_shmstage_session"] = _Session(self.shmstage)
        return session

    def _shmstage_check_supported(self) -> None:
        args = self.args  # type: ignore[attr-defined]
        if args.world_size > 1:
            raise NotImplementedError(
                f"ShmStageCallback covers one process; this run has {args.world_size}: "
                "remove the callback (the Trainer's own checkpoints) for DDP"
            )
        for engine in ("is_deepspeed_enabled", "is_fsdp_enabled"):
            if getattr(self, engine, False):
                raise NotImplementedError(
                    f"ShmStageCallback does not cover {engine[3:-8]}: its checkpoints are "
                    "sharded engine files; remove the callback for this run"
                )

    # -- saving ---------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """What ``Trainer._save_checkpoint`` saves, as one shmstage save; returns after the
        copy (see the module's docstring)."""
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import SaveStrategy

        self._shmstage_check_supported()
        session = self._shm
        session.settle(wait=False)
        state = self.state  # type: ignore[attr-defined]
        args = self.args  # type: ignore[attr-defined]
        if self.hp_search_backend is None and trial is None:  # type: ignore[attr-defined]
            self.store_flos()  # type: ignore[attr-defined]
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        output_dir = os.path.join(run_dir, f"checkpoint-{state.global_step}")

        if (
            args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
            and state.best_global_step
        ):
            best = os.path.join(run_dir, f"checkpoint-{state.best_global_step}")
            if best == output_dir or best in session.in_flight or os.path.exists(best):
                state.best_model_checkpoint = best

        # As the Trainer does: the stateful callbacks' and the control's state into the
        # TrainerState, which is then saved whole.
        handler = self.callback_handler  # type: ignore[attr-defined]
        for callback in [*handler.callbacks, self.control]:  # type: ignore[attr-defined]
            if isinstance(callback, ExportableState):
                name = callback.__class__.__name__
                if isinstance(state.stateful_callbacks[name], list):
                    state.stateful_callbacks[name].append(callback.state())
                else:
                    state.stateful_callbacks[name] = callback.state()
        trainer_state = self._shmstage_trainer_state()

        stager = session.stager_for(self.optimizer)  # type: ignore[attr-defined]
        handle = stager.save(
            self._shmstage_state_dict(),
            output_dir,
            metadata={"format": FORMAT, "step": state.global_step, "trainer_state": trainer_state},
            block=not session.options.overlap,
        )
        session.in_flight[output_dir] = handle
        session.last_save = handle
        self._shmstage_rotate(run_dir)

    def _shmstage_rotate(self, run_dir: str) -> None:
        """``save_total_limit``, as the Trainer applies it, over the published checkpoints
        only: one still being written is not listed until it is complete."""
        from transformers.trainer_utils import rotate_checkpoints

        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,  # type: ignore[attr-defined]
            best_model_checkpoint=self.state.best_model_checkpoint,  # type: ignore[attr-defined]
            use_mtime=False,
        )

    def _shmstage_trainer_state(self) -> str:
        """``trainer_state.json``'s text, exactly as ``TrainerState.save_to_json`` writes it
        (a string: it may hold NaN, which metadata as JSON values may not)."""
        import json

        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"  # type: ignore[attr-defined]

    def _shmstage_state_dict(self) -> dict[str, Any]:
        """The model's state dict under its own names, and the rest under ``TRAINER_KEY``
        (nothing but the model with ``save_only_model``, as the Trainer saves)."""
        model = self.model  # type: ignore[attr-defined]
        state: dict[str, Any] = dict(model.state_dict())
        if TRAINER_KEY in state:
            raise ValueError(
                f"the model has a parameter or buffer named {TRAINER_KEY!r}, the key shmstage "
                "keeps the optimizer's state under; rename it"
            )
        if self.args.save_only_model:  # type: ignore[attr-defined]
            return state
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        state[TRAINER_KEY] = {
            "optimizer": self.optimizer.state_dict(),  # type: ignore[attr-defined]
            "scheduler": self.lr_scheduler.state_dict(),  # type: ignore[attr-defined]
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng_state(),
        }
        return state

    # -- resuming -------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``, resuming from a shmstage checkpoint when given one (or, with
        True, when the newest of this run is one). The Trainer is handed a private
        directory holding only that checkpoint's ``trainer_state.json``; the model,
        optimizer, scheduler, scaler and RNG come from the restored checkpoint through the
        loaders below."""
        session = self._shm
        self._shmstage_check_supported()  # before training, not at the first save
        with contextlib.ExitStack() as stack:
            if resume_from_checkpoint not in (None, False):
                found = self._shmstage_resolve(resume_from_checkpoint)
                if isinstance(found, Restored):
                    where = stack.enter_context(tempfile.TemporaryDirectory(prefix="shmstage-hf-"))
                    text = found.metadata["trainer_state"]
                    Path(where, _TRAINER_STATE).write_text(text)
                    session.resume = _Resume(found, where)
                    session.restored = found
                    log.info(
                        "resuming from %s (from %s, %.2f s)", found.path, found.source,
                        found.seconds,
                    )
                    resume_from_checkpoint = where
                else:
                    resume_from_checkpoint = found
            try:
                result = super().train(  # type: ignore[misc]
                    resume_from_checkpoint=resume_from_checkpoint,
                    trial=trial,
                    ignore_keys_for_eval=ignore_keys_for_eval,
                    **kwargs,
                )
            except BaseException:
                session.resume = None
                session.close(retain=True)
                raise
            session.resume = None
            session.close()
            if self.args.save_total_limit:  # type: ignore[attr-defined]
                self._shmstage_rotate(self.args.output_dir)  # type: ignore[attr-defined]
            return result

    def _shmstage_resolve(self, given: str | bool | os.PathLike[str]) -> Restored | str:
        """The checkpoint to resume from: restored, when it is shmstage's; else its path."""
        options = self._shm.options
        if given is True:
            run_dir = self.args.output_dir  # type: ignore[attr-defined]
            newest = last_checkpoint(run_dir)
            try:
                held = latest(
                    options.restore_device, under=run_dir, source="memory", socket=options.socket
                )
            except CheckpointError as exc:
                log.debug("no checkpoint of %s in shmstaged's memory: %s", run_dir, exc)
                held = None
            if (
                held is not None
                and held.metadata.get("format") == FORMAT
                and (newest is None or held.metadata.get("step", -1) >= _step(newest))
            ):
                return held
            if newest is None:
                raise ValueError(f"No valid checkpoint found in output directory ({run_dir})")
            given = newest
        path = os.fspath(given)  # type: ignore[arg-type]
        if not _is_shmstage(path):
            return path  # a stock Trainer checkpoint: the Trainer's own loaders read it
        restored = restore(path, options.restore_device, socket=options.socket)
        if restored.metadata.get("format") != FORMAT:
            raise ValueError(
                f"{path} is a shmstage checkpoint but not one of a Trainer (metadata format "
                f"{restored.metadata.get('format')!r}); load it with shmstage_client.load"
            )
        return restored

    def _shmstage_resuming(self, checkpoint: Any) -> _Resume | None:
        resume = self._shm.resume
        return resume if resume is not None and checkpoint == resume.where else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        resume = self._shmstage_resuming(resume_from_checkpoint)
        if resume is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        model = self.model if model is None else model  # type: ignore[attr-defined]
        result = model.load_state_dict(resume.model_state(), strict=False)
        self._issue_warnings_after_load(result)  # type: ignore[attr-defined]
        resume.model_loaded = True

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        resume = self._shmstage_resuming(checkpoint)
        if resume is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        saved = resume.trainer
        if "optimizer" not in saved:
            log.warning(
                "%s holds no optimizer state (saved with save_only_model): the optimizer and "
                "scheduler start afresh", resume.restored.path,
            )
            return
        self.optimizer.load_state_dict(saved["optimizer"])  # type: ignore[attr-defined]
        self.lr_scheduler.load_state_dict(saved["scheduler"])  # type: ignore[attr-defined]

    def _load_scaler(self, checkpoint: str | None) -> None:
        resume = self._shmstage_resuming(checkpoint)
        if resume is None:
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        saved = resume.trainer.get("scaler")
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if saved is not None and scaler is not None:
            scaler.load_state_dict(saved)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        resume = self._shmstage_resuming(checkpoint)
        if resume is None:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        if "rng" in resume.trainer:
            set_rng_state(resume.trainer["rng"])

    def _load_best_model(self) -> None:
        """The best checkpoint may still be being written: wait, then read it (from
        memory when the daemon holds it)."""
        self._shm.settle(wait=True)
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        if best is None or not _is_shmstage(best):
            return super()._load_best_model()  # type: ignore[misc]
        options = self._shm.options
        restored = restore(best, options.restore_device, socket=options.socket)
        log.info("loading the best model from %s (from %s)", best, restored.source)
        state = {k: v for k, v in restored.state.items() if k != TRAINER_KEY}
        result = self.model.load_state_dict(state, strict=False)  # type: ignore[attr-defined]
        self._issue_warnings_after_load(result)  # type: ignore[attr-defined]


def _step(path: str) -> int:
    match = _CHECKPOINT.match(os.path.basename(path))
    return int(match.group(1)) if match else -1


_WITH_MIXIN: dict[type, type] = {}


def _with_mixin(cls: type) -> type:
    """``cls`` with ``ShmStageTrainerMixin`` first, under ``cls``'s own name."""
    if issubclass(cls, ShmStageTrainerMixin):
        return cls
    made = _WITH_MIXIN.get(cls)
    if made is None:
        made = _WITH_MIXIN[cls] = type(
            cls.__name__,
            (ShmStageTrainerMixin, cls),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return made


def _calling_trainer(callback: Any) -> Any:
    """The Trainer whose callback handler is calling ``callback`` now: the nearest frame
    up the stack whose ``self`` is a Trainer holding this very callback."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and any(
            cb is callback for cb in candidate.callback_handler.callbacks
        ):
            return candidate
        frame = frame.f_back
    raise RuntimeError(
        "ShmStageCallback could not find the Trainer calling it; pass it in "
        "Trainer(callbacks=[ShmStageCallback()]) or subclass with ShmStageTrainerMixin"
    )


def _build_callback() -> type:
    from transformers import TrainerCallback

    class ShmStageCallback(TrainerCallback):  # type: ignore[misc]
        """``Trainer(..., callbacks=[ShmStageCallback()])``: the Trainer's checkpoints go
        through shmstaged (see the module's docstring for what that changes and why the
        callback installs ``ShmStageTrainerMixin`` on its Trainer).

        Options as ``ShmStageOptions``. ``last_save``: the newest save's ``SaveHandle``
        (``.wait()`` for durable); ``restored``: how the last resume came back
        (``.source``, ``.path``, ``.seconds``).
        """

        def __init__(
            self,
            *,
            socket: str | os.PathLike[str] | None = None,
            slots: int | None = None,
            overlap: bool = True,
            restore_device: str = "cpu",
        ) -> None:
            self.options = ShmStageOptions(socket, slots, overlap, restore_device)
            self.trainer: Any = None
            self.late = False

        def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._bind(_calling_trainer(self))

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.trainer is None:  # added with add_callback after the Trainer was built
                self._bind(_calling_trainer(self))
                self.late = True
                log.warning(
                    "ShmStageCallback was added after the Trainer was built: this train() "
                    "call resumed through the Trainer's own loaders; pass it in "
                    "Trainer(callbacks=[...]) to resume through shmstage"
                )

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.late:  # the mixin's train() did not start this call: end it here
                self.late = False
                self.trainer._shm.close()

        def _bind(self, trainer: Any) -> None:
            trainer.__class__ = _with_mixin(type(trainer))
            trainer.shmstage = self.options
            trainer.__dict__.pop("_shmstage_session", None)
            self.trainer = trainer

        @property
        def last_save(self) -> SaveHandle | None:
            return None if self.trainer is None else self.trainer._shm.last_save

        @property
        def restored(self) -> Restored | None:
            return None if self.trainer is None else self.trainer._shm.restored

    ShmStageCallback.__module__ = __name__
    return ShmStageCallback


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "ShmStageCallback":
        if name not in _BUILT:
            _BUILT[name] = _build_callback()
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
