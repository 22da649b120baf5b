"""Accelerate's ``save_state``/``load_state`` through shmstaged, for loops written with
Accelerate alone.

    from shmstage_client.integrations.accelerate import load_state, save_state

    save_state(accelerator, f"ckpt/step-{step}")    # instead of accelerator.save_state(...)
    load_state(accelerator, "ckpt/step-500")        # from shmstaged's memory when it holds it
    load_state(accelerator, under="ckpt")           # after a crash: this user's newest there

Why functions and not Accelerate's hooks: ``register_save_state_pre_hook`` lets a hook drop
the models' weights from what ``Accelerator.save_state`` writes, but the optimizers, the
schedulers, the scaler and the random states are still written by ``torch.save`` into the
directory, on the caller's thread, and the directory exists while they are — the slow part
and the torn directory both stay. A function pair owns the whole save: one checkpoint
directory, published by shmstaged (renamed from a hidden pending directory) only once it is
complete, holding what ``save_state`` holds — every prepared model, optimizer and
scheduler, the gradient scaler, the random states (Python, NumPy, torch CPU and CUDA), the
registered custom objects (``register_for_checkpointing``) and ``accelerator.step``.

Not covered: DeepSpeed and FSDP engines (their own sharded formats), the dataloaders'
sampler states (Accelerate's ``SeedableRandomSampler`` file), ``total_limit`` rotation of
automatically named checkpoints, and more than one process (each rank would need a
checkpoint of its own): these raise or are left to Accelerate's own ``save_state``.

This module imports Accelerate only inside the functions that need it; the random-state
helpers here are shared with the Hugging Face Trainer integration.
"""

from __future__ import annotations

import os
import random
import weakref
from collections.abc import Mapping
from typing import Any, Final

import torch

from shmstage_client.restore.restoring import Restored, latest, restore
from shmstage_client.save.handle import SaveHandle
from shmstage_client.save.stager import Stager

#: Marks a checkpoint written by ``save_state``; ``load_state`` refuses anything else.
FORMAT: Final = "shmstage-accelerate/1"

#: One Stager per Accelerator (its layouts and slots outlive each save).
_STAGERS: weakref.WeakKeyDictionary[Any, Stager] = weakref.WeakKeyDictionary()


def rng_state() -> dict[str, Any]:
    """The process's random states, as values a checkpoint can hold (no pickles):
    Python's and NumPy's as plain numbers, torch's as byte tensors."""
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what ``rng_state`` took (CUDA: as many devices as both sides have).

    The states are cloned first: a restored checkpoint's tensors are views into one
    buffer, and torch's ``set_rng_state`` reads a view's storage from its start (it
    crashed the process with a segmentation fault on torch 2.13)."""
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.random.set_rng_state(state["cpu"].clone())
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.clone(), device)


def save_state(
    accelerator: Any,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    stager: Stager | None = None,
    block: bool = True,
    metadata: Mapping[str, Any] | None = None,
) -> SaveHandle:
    """What ``accelerator.save_state(output_dir)`` saves, as one shmstage checkpoint.

    Returns once the tensors are copied into shared memory (``block=False``: once the copy
    of the guarded optimizers' tensors has started, see ``Stager.save``; call
    ``stager.guard(optimizer)`` first); ``SaveHandle.wait()`` says when it is durable.
    ``output_dir`` must be a new directory (or an empty one); with a
    ``ProjectConfiguration(automatic_checkpoint_naming=True)`` it may be left out, and the
    checkpoint goes to ``project_dir/checkpoints/checkpoint_<iteration>`` as Accelerate
    names it. ``stager``: one of your own (socket, slots...); by default one per
    Accelerator, made on first use.
    """
    _check_supported(accelerator, "save_state")
    if output_dir is None:
        output_dir = _automatic_dir(accelerator)
    stager = stager if stager is not None else _stager(accelerator)
    handle = stager.save(
        _state_of(accelerator),
        output_dir,
        metadata={**(metadata or {}), "format": FORMAT, "step": int(accelerator.step)},
        block=block,
    )
    if accelerator.project_configuration.automatic_checkpoint_naming:
        accelerator.project_configuration.iteration += 1
    return handle


def load_state(
    accelerator: Any,
    input_dir: str | os.PathLike[str] | None = None,
    *,
    under: str | os.PathLike[str] | None = None,
    socket: str | os.PathLike[str] | None = None,
) -> Restored:
    """Load a checkpoint ``save_state`` wrote into the prepared objects, as
    ``accelerator.load_state`` does; returns the ``Restored`` (``.source`` says "memory" or
    "files", ``.path`` which checkpoint).

    ``input_dir``: that checkpoint, from shmstaged's memory when the daemon holds exactly
    it, else from its files. Without it: this user's newest checkpoint whose directory is
    in ``under`` (default: Accelerate's ``project_dir/checkpoints``), from memory even
    while it is still being written — the restart after a crash.
    """
    _check_supported(accelerator, "load_state")
    if input_dir is not None:
        restored = restore(input_dir, socket=socket)
    else:
        if under is None:
            if not accelerator.project_configuration.automatic_checkpoint_naming:
                raise ValueError(
                    "load_state(accelerator) without input_dir needs under= (the directory "
                    "holding the checkpoints) or ProjectConfiguration(automatic_checkpoint_"
                    "naming=True)"
                )
            under = os.path.join(accelerator.project_dir, "checkpoints")
        restored = latest(under=under, socket=socket)
    if restored.metadata.get("format") != FORMAT:
        raise ValueError(
            f"{restored.path} is not a checkpoint of shmstage's save_state (its metadata "
            f"format is {restored.metadata.get('format')!r}); load it with shmstage_client.load"
        )
    _apply(accelerator, restored.state)
    return restored


def _state_of(accelerator: Any) -> dict[str, Any]:
    """Everything ``save_state`` saves, as one state dict."""
    return {
        "models": [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models],
        "optimizers": [optimizer.state_dict() for optimizer in accelerator._optimizers],
        "schedulers": [scheduler.state_dict() for scheduler in accelerator._schedulers],
        "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        "custom": [obj.state_dict() for obj in accelerator._custom_objects],
        "rng": rng_state(),
        "step": int(accelerator.step),
    }


def _apply(accelerator: Any, state: Mapping[str, Any]) -> None:
    """Load a saved state into the accelerator's objects, checking the counts match first:
    a checkpoint of another setup fails here, naming what differs, before anything changed."""
    for what, objects in (
        ("models", accelerator._models),
        ("optimizers", accelerator._optimizers),
        ("schedulers", accelerator._schedulers),
        ("custom", accelerator._custom_objects),
    ):
        if len(state[what]) != len(objects):
            raise ValueError(
                f"the checkpoint holds {len(state[what])} {what}, the accelerator has "
                f"{len(objects)} prepared: prepare (or register_for_checkpointing) the same "
                "objects as the run that saved it"
            )
    for model, saved in zip(accelerator._models, state["models"], strict=True):
        accelerator.unwrap_model(model).load_state_dict(saved)
    for optimizer, saved in zip(accelerator._optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    for scheduler, saved in zip(accelerator._schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    if state["scaler"] is not None and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    for obj, saved in zip(accelerator._custom_objects, state["custom"], strict=True):
        obj.load_state_dict(saved)
    set_rng_state(state["rng"])
    accelerator.step = state["step"]


def _check_supported(accelerator: Any, what: str) -> None:
    from accelerate.utils import DistributedType

    if accelerator.num_processes > 1:
        raise NotImplementedError(
            f"shmstage's {what} covers one process; with {accelerator.num_processes} use "
            "accelerator's own, or shmstage_client.dcp for sharded state"
        )
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise NotImplementedError(
            f"shmstage's {what} does not cover {accelerator.distributed_type.value}: use "
            "accelerator's own, or shmstage_client.dcp (ShmStageWriter) for FSDP"
        )


def _automatic_dir(accelerator: Any) -> str:
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        raise ValueError(
            "save_state(accelerator) without output_dir needs "
            "ProjectConfiguration(automatic_checkpoint_naming=True); pass the directory"
        )
    return os.path.join(accelerator.project_dir, "checkpoints", f"checkpoint_{config.iteration}")


def _stager(accelerator: Any) -> Stager:
    stager = _STAGERS.get(accelerator)
    if stager is None:
        stager = _STAGERS[accelerator] = Stager()
    return stager
