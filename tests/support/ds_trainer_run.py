"""A Hugging Face ``transformers.Trainer`` run with a DeepSpeed config, as users launch it
(``torchrun --nproc_per_node W ds_trainer_run.py OUT STAGE``; CPU, gloo): a tiny Llama with tied
embeddings, the Trainer's own AdamW with its two param groups (weight decay off for norms), 3
steps, one save. The save is the Trainer's: ``OUT/checkpoint-3/`` with DeepSpeed's
``global_step3/`` and ``latest`` (no ``universal_checkpoint_info``). Rank 0 then writes
``OUT/live.pt`` (DeepSpeed's own full state) and ``OUT/next.json`` (the loss of a fixed batch).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

VOCAB = 37
TRAINER_TAG = "checkpoint-3"


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def next_batch() -> dict:
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(99))
    return {"input_ids": ids, "labels": ids}


def ds_config(stage: int) -> dict:
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": stage},
            "bf16": {"enabled": "auto"}, "zero_allow_untested_optimizer": True}


def main(out: str, stage: int) -> None:
    # one fixed directory per user (a fresh mkdtemp per rank left hundreds of empty dirs in /tmp)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), f"ckptconv-ds-ext-{os.getuid()}"))
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see ds_worker's docstring
    from transformers import Trainer, TrainingArguments

    from ds_zero_worker import live_state

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=3, save_steps=3,
                             save_strategy="steps", learning_rate=1e-2, weight_decay=0.1, bf16=True,
                             deepspeed=ds_config(stage), report_to=[], use_cpu=True, dataloader_num_workers=0,
                             seed=0, data_seed=0)
    trainer = Trainer(model=llama(), args=args, train_dataset=Tokens())
    trainer.train()
    engine = trainer.model_wrapped
    live = live_state(engine, stage)
    with torch.no_grad():
        loss = float(engine(**next_batch()).loss)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(live, Path(out) / "live.pt")
        (Path(out) / "next.json").write_text(json.dumps({"loss": loss}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
