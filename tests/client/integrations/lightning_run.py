"""A tiny Lightning run for test_lightning.py, in processes of their own.

The tests fork these functions from a forkserver that imported Lightning once (an import
costs ~7 CPU-seconds here): each run is a real process, which a test may SIGKILL, with
none of the start-up. The batch of step ``n`` is made from ``n`` alone, so an interrupted
run resumed at any step sees the data an uninterrupted run saw there.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from shmstage_client.integrations.lightning import ShmStageCheckpointIO
from torch.utils.data import DataLoader

BATCH, WIDTH = 8, 16


class Model(pl.LightningModule):
    def __init__(self, width: int = WIDTH, betas: tuple[float, float] = (0.9, 0.95)) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Tanh(),
            torch.nn.Linear(width, 1),
        )  # fmt: skip
        self.losses: list[tuple[int, str]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.global_step)
        x = torch.randn(BATCH, self.hparams.width, generator=generator)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append((self.global_step, loss.item().hex()))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, betas=self.hparams.betas)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(list(range(5)), batch_size=1)  # 5 steps per epoch


class KillAt(Callback):
    """SIGKILL this process once ``step`` optimizer steps are done: no handler, no
    teardown, as the OOM killer does it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(
    workdir: str,
    socket: str,
    steps: int,
    *,
    kill_at: int | None = None,
    ckpt_path: str | None = None,
    every: int = 3,
    top_k: int = 2,
    plugin: bool = True,
    block: bool = True,
    slots: int = 3,
) -> None:
    """Train for ``steps`` steps, checkpointing every ``every``; write the losses (and how
    a resume restored) to ``workdir/result-<pid>.json``."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    os.environ["SHMSTAGE_SOCKET"] = socket
    model = Model()
    io = ShmStageCheckpointIO(socket, slots=slots, block=block) if plugin else None
    callbacks: list[Callback] = [
        ModelCheckpoint(
            dirpath=Path(workdir) / "ckpt", every_n_train_steps=every, save_top_k=top_k,
            monitor="step", mode="max", save_last=True,
        )
    ]  # fmt: skip
    if kill_at is not None:
        callbacks.append(KillAt(kill_at))
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, deterministic=True,
        plugins=[io] if io is not None else None, default_root_dir=workdir,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt_path)
    restored = io.last_restored if io is not None else None
    saved = io.last_save if io is not None else None
    result = {
        "deferred": bool(saved and saved.timings.deferred_copy_seconds > 0),
        "losses": model.losses,
        "source": restored.source if restored else None,
        "reason": restored.reason if restored else None,
        "path": str(restored.path) if restored else None,
    }
    Path(workdir, f"result-{os.getpid()}.json").write_text(json.dumps(result))


class ShardedModel(Model):
    """``Model`` sharded with FSDP2 over the data-parallel ranks; each rank its own data."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.global_step * 10 + self.global_rank)
        x = torch.randn(BATCH, self.hparams.width, generator=generator)
        loss = torch.nn.functional.mse_loss(self.net(x), x.sum(dim=1, keepdim=True).sin())
        self.losses.append((self.global_step, loss.item().hex()))
        return loss


def sharded_fit(
    rank: int, port: int, workdir: str, socket: str, steps: int, ckpt_path: str | None = None
) -> None:
    """One of 2 gloo ranks training ``ShardedModel`` with ``ShmStageModelParallelStrategy``
    for ``steps`` steps, checkpointing every 4; losses and how a resume restored go to
    ``workdir/sharded-<rank>-<pid>.json``."""
    from shmstage_client.integrations.lightning import ShmStageModelParallelStrategy

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0", SHMSTAGE_SOCKET=socket,
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = ShardedModel()
    strategy = ShmStageModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, socket=socket
    )
    checkpoints = ModelCheckpoint(
        dirpath=Path(workdir) / "ckpt", every_n_train_steps=4, save_top_k=-1, save_last=True
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, max_steps=steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[checkpoints], deterministic=True,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt_path)
    result = {"losses": model.losses, "sources": sorted(set(strategy.last_sources.values()))}
    Path(workdir, f"sharded-{rank}-{os.getpid()}.json").write_text(json.dumps(result))
