"""A tiny Hugging Face training run, for the integration tests to run in processes of their own.

A Llama of a few thousand parameters built from its config (nothing downloaded), an
in-memory dataset, the CPU. The tests fork runs from a forkserver that imported this module
(and with it transformers and TRL) once. ``train`` writes what the test checks to
``result-<pid>.json`` in its work directory: the whole ``log_history``, how a resume came
back, the Trainer's class name, what ``get_last_checkpoint`` and ``last_checkpoint``
returned before training and, with ``watch``, what ``output_dir`` showed at each step.
``kill_at=N`` SIGKILLs the process at the end of step N, once the newest save is
acknowledged by the daemon: a crash with a checkpoint in the daemon's memory, for real.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import trl
from shmstage_client.integrations.transformers import ShmStageCallback, last_checkpoint
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from shmstage import listing

VOCAB = 32


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=0.1,  # training draws on the RNG: a resume must restore it
    )
    return LlamaForCausalLM(config)


def rows(n: int = 32, length: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB - 2, (n, length), generator=torch.Generator().manual_seed(1))


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer made here: TRL wants one, and nothing may be downloaded."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    core = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


class KillAt(TrainerCallback):
    """SIGKILL at the end of a step, once the newest save is in the daemon's hands."""

    def __init__(self, step: int, shm: Any) -> None:
        self.step, self.shm = step, shm

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            self.shm.last_save.staged(60)
            os.kill(os.getpid(), signal.SIGKILL)


class Watch(TrainerCallback):
    """What ``output_dir`` shows at the end of each step: each ``checkpoint-N`` and
    whether it is complete, whether the one ``get_last_checkpoint`` takes is, and what
    ``last_checkpoint`` returns."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.seen: list[dict[str, Any]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        visible = {
            name: listing.inspect(Path(self.out, name)).state
            for name in sorted(os.listdir(self.out))
            if name.startswith("checkpoint-")
        }
        stock_last = get_last_checkpoint(self.out)  # the daemon may publish meanwhile
        self.seen.append(
            {
                "step": state.global_step,
                "visible": visible,
                "stock_last": stock_last and listing.inspect(Path(stock_last)).state,
                "last": last_checkpoint(self.out),
            }
        )


def train(
    workdir: str,
    socket: str,
    *,
    steps: int = 12,
    save_steps: int = 4,
    save_total_limit: int | None = None,
    kill_at: int = 0,
    resume: bool = False,
    stock: bool = False,
    use_trl: bool = False,
    watch: bool = False,
    best: bool = False,
) -> None:
    """One run into ``workdir/out``; ``stock``: no ShmStageCallback and no checkpoints (the
    uninterrupted reference run)."""
    torch.set_num_threads(1)
    out = os.path.join(workdir, "out")
    common: dict[str, Any] = dict(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no" if stock else "steps",
        save_steps=save_steps,
        save_total_limit=save_total_limit,
        seed=0,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    if best:  # evaluate at each save, keep the best, load it at the end
        common |= dict(
            eval_strategy="steps", eval_steps=save_steps, load_best_model_at_end=True,
            metric_for_best_model="loss", greater_is_better=False,
        )
    callbacks: list[Any] = []
    shm = None
    if not stock:
        shm = ShmStageCallback(socket=socket)
        callbacks.append(shm)
    if kill_at:
        callbacks.append(KillAt(kill_at, shm))
    watcher = Watch(out) if watch else None
    if watcher is not None:
        callbacks.append(watcher)
    if use_trl:
        from datasets import Dataset

        text = [" ".join(f"w{int(t)}" for t in row) for row in rows()]
        trainer: Trainer = trl.SFTTrainer(
            model=tiny_model(),
            args=trl.SFTConfig(**common, max_length=16),
            train_dataset=Dataset.from_dict({"text": text}),
            processing_class=tokenizer(),
            callbacks=callbacks,
        )
    else:
        data = [{"input_ids": row, "labels": row.clone()} for row in rows()]
        trainer = Trainer(
            model=tiny_model(), args=TrainingArguments(**common), train_dataset=data,
            eval_dataset=data[:8] if best else None, callbacks=callbacks,
        )
    before = {
        "stock_last": get_last_checkpoint(out) if os.path.isdir(out) else None,
        "last": last_checkpoint(out),
    }
    trainer.train(resume_from_checkpoint=True if resume else None)
    result: dict[str, Any] = {
        "before": before,
        "class": type(trainer).__name__,
        "losses": [entry for entry in trainer.state.log_history if "loss" in entry],
        "seen": watcher.seen if watcher is not None else [],
    }
    if best:
        result["best"] = trainer.state.best_model_checkpoint
        model = {key: value.tolist() for key, value in trainer.model.state_dict().items()}
        Path(workdir, "final-model.json").write_text(json.dumps(model))
    if shm is not None and shm.restored is not None:
        result["restored"] = {"source": shm.restored.source, "path": str(shm.restored.path)}
    Path(workdir, f"result-{os.getpid()}.json").write_text(json.dumps(result))
