"""A tiny Hugging Face training run in a process of its own, for the integration tests.

A Llama of a few thousand parameters built from its config (nothing downloaded), an
in-memory dataset, CPU. Prints one JSON line per event on stdout: ``restored`` (how a
resume came back), ``log`` (the whole ``log_history`` at the end). ``--kill-at N``
SIGKILLs the process at the end of step N, once the newest save is acknowledged by the
daemon — a crash with a checkpoint in memory, for real.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
from shmstage_client.integrations.transformers import ShmStageCallback
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

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
    )
    return LlamaForCausalLM(config)


def dataset(n: int = 32, length: int = 12) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (n, length), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


class KillAt(TrainerCallback):
    """SIGKILL at the end of a step, once the newest save is in the daemon's hands."""

    def __init__(self, step: int, shm: object) -> None:
        self.step, self.shm = step, shm

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            self.shm.last_save.staged(60)  # type: ignore[attr-defined]
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    core = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stock", action="store_true", help="no ShmStageCallback, no saves")
    parser.add_argument("--trl", action="store_true", help="TRL's SFTTrainer")
    opts = parser.parse_args()

    common = dict(
        output_dir=opts.out,
        max_steps=opts.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no" if opts.stock else "steps",
        save_steps=opts.save_steps,
        save_total_limit=opts.save_total_limit,
        seed=0,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    callbacks: list[TrainerCallback] = []
    shm = None
    if not opts.stock:
        shm = ShmStageCallback(socket=opts.socket)
        callbacks.append(shm)
    if opts.kill_at:
        callbacks.append(KillAt(opts.kill_at, shm))
    if opts.trl:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        rows = [" ".join(f"w{int(t) % (VOCAB - 2)}" for t in r["input_ids"]) for r in dataset()]
        trainer: Trainer = SFTTrainer(
            model=tiny_model(),
            args=SFTConfig(**common, max_length=16, dataset_text_field="text"),
            train_dataset=Dataset.from_dict({"text": rows}),
            processing_class=tokenizer(),
            callbacks=callbacks,
        )
    else:
        trainer = Trainer(
            model=tiny_model(),
            args=TrainingArguments(**common),
            train_dataset=dataset(),
            callbacks=callbacks,
        )
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    if shm is not None and shm.restored is not None:
        restored = {"source": shm.restored.source, "path": str(shm.restored.path)}
        print(json.dumps({"event": "restored", **restored}))
    print(json.dumps({"event": "class", "name": type(trainer).__name__}))
    print(json.dumps({"event": "log", "history": trainer.state.log_history}), flush=True)


if __name__ == "__main__":
    main()
