"""A torchtitan config registry for ``titan_ranks.py``: what ``--module``/``--config`` load.

``RunConfig`` is the part of torchtitan's ``Trainer.Config`` the ranks use, field for field
(names, types, defaults): importing ``torchtitan.trainer`` itself needs triton and a CUDA
device, which this CPU machine lacks. torchtitan's ``ConfigManager`` parses the command line
onto it with tyro, and ``apply_overrides`` swaps its nodes, exactly as for a real trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config import Configurable, TrainingConfig
from torchtitan.config.override import OverrideConfig


@dataclass(kw_only=True, slots=True)
class RunConfig(Configurable.Config):
    hf_assets_path: str = "."
    dump_folder: str = "./outputs"
    optimizer: OptimizersContainer.Config = field(default_factory=OptimizersContainer.Config)
    lr_scheduler: LRSchedulersContainer.Config = field(
        default_factory=LRSchedulersContainer.Config
    )
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)
    override: OverrideConfig = field(default_factory=OverrideConfig)


def tiny() -> RunConfig:
    """Two optimizers in one container (Adam for the embedding, AdamW for the rest), as
    torchtitan builds for mixed param groups; torchtitan's own checkpoint config."""
    return RunConfig(
        optimizer=OptimizersContainer.Config(
            implementation="foreach",
            param_groups=[
                ParamGroupConfig(
                    pattern=r"^tok\.", optimizer_name="Adam", optimizer_kwargs={"lr": 2e-2}
                ),
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
                ),
            ],
        ),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5),
        training=TrainingConfig(local_batch_size=2, seq_len=8, steps=10),
        checkpoint=CheckpointManager.Config(interval=2, keep_latest_k=2),
    )
