"""DeepSpeed 0.19.8 ZeRO-2 ranks (CPU, gloo) training transformers' ``LlamaForCausalLM`` with
``torch.optim.AdamW``, for the DeepSpeed -> torchtitan resume (issue 32.3).

:func:`train_save_step` trains ``JOB["steps"]`` steps on random token batches, saves with
``engine.save_checkpoint`` as written (``JOB["save"]/global_step<N>``, ``latest``), then takes one
more step whose gradients are those of ``JOB["grads"]`` (a ``torch.save`` of full tensors by HF
FQN): its loss is ``sum((p * g).sum())``, whose gradient is exactly ``g`` on every rank, so
DeepSpeed's own backward, ZeRO-2 gradient reduce-scatter (averaging identical values), gradient
clipping (DeepSpeed's default ``gradient_clipping`` 1.0: the caller keeps the norm below it) and
optimizer step run unchanged. Rank 0 writes ``JOB["out"]``: the full fp32 masters, ``exp_avg``,
``exp_avg_sq`` after that step (DeepSpeed's own fragments, gathered as ``get_full_hp_param``
does), the step count and the param group's hyperparameters.
"""

from __future__ import annotations

import json
from typing import Any

import torch

#: torchtitan 0.3.0's ``default_adamw(lr=8e-4)`` hyperparameters (one group, decay everywhere).
ADAMW = {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _engine(deepspeed: Any, config: dict, world: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).float()
    optim = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)  # torchtitan's implementation="fused"
    ds_config = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2,
                 "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=ds_config)
    return engine


def train_save_step(rank: int, world: int, job_json: str) -> None:
    from ds_worker import _init_deepspeed
    from ds_zero_worker import _full_hp

    job = json.loads(job_json)
    deepspeed = _init_deepspeed(rank, world)
    engine = _engine(deepspeed, job["config"], world)
    vocab = job["config"]["vocab_size"]
    losses = []
    for step in range(job["steps"]):
        ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.save_checkpoint(job["save"])

    grads = torch.load(job["grads"], weights_only=True)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    missing = [n for n, _ in named if n not in grads]
    if missing:
        raise SystemExit(f"no gradient for {missing[:3]}")
    loss = sum((p * grads[n].to(p.dtype)).sum() for n, p in named)
    engine.backward(loss)
    engine.step()

    got: dict = {"after": {}, "exp_avg": {}, "exp_avg_sq": {}, "losses": losses}
    for name, p in named:
        got["after"][name] = _full_hp(engine, p, None)
        for state in ("exp_avg", "exp_avg_sq"):
            got[state][name] = _full_hp(engine, p, state)
    inner = engine.optimizer.optimizer
    got["step"] = [float(s["step"]) for s in inner.state.values()]
    got["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    if rank == 0:
        torch.save(got, job["out"])
