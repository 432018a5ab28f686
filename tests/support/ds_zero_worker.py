"""DeepSpeed 0.19 ranks (CPU, gloo) for the direct ZeRO-folder tests: train and save with
``engine.save_checkpoint`` as written, load into DeepSpeed engines and FSDP2, report.

A case (:class:`ds_zero_support.Case`, passed as JSON) picks the ZeRO stage, dtype, world size,
param groups and the model: ``pad`` (the tiny Transformer with sizes that make DeepSpeed pad its
partitions: vocab 25 and a (1,)-shaped parameter), or ``rich`` (``pad`` plus persistent buffers of
every dtype, the output projection tied to the embedding, and a frozen norm). Everything DeepSpeed
holds is read back with its own accessors (``safe_get_full_*``) or its optimizer's own tensors,
never with ckptconv's readers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ds_worker import STATES, _init_deepspeed, _loss, compare_state, full_state_of, grouped_optimizer
from models import ModelArgs, build_model, make_batch
from oracle import bits_equal

#: The model of every case: sizes that make each ZeRO stage pad (odd numels, a (1,) parameter).
PAD = ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=25, out_scale=True)
FROZEN = "layers.0.ffn_norm.weight"
MAX_ERRORS = 20
#: The batch whose loss is compared across runs (the same on every rank).
NEXT_SEED, NEXT_STEP = 0, 99


def args_of(case: dict) -> ModelArgs:
    from dataclasses import replace

    return replace(PAD, dtype=case["dtype"])


def build(case: dict, seed: int) -> torch.nn.Module:
    """The case's model with deterministic weights (``rich``: buffers, tie, frozen norm; ``hf``:
    the Trainer runs' Llama)."""
    if case["model"] == "hf":  # fp32, as the Trainer hands it to DeepSpeed (which keeps RoPE's inv_freq fp32)
        from ds_trainer_run import llama

        return llama()
    model = build_model(args_of(case), seed)
    if case["model"] == "rich":
        from ckpt_factory import add_special_buffers

        add_special_buffers(model)
        model.output.weight = model.tok_embeddings.weight
        model.get_parameter(FROZEN).requires_grad_(False)
    return model


def ds_config(case: dict, world: int, universal: bool) -> dict:
    config = {
        "train_batch_size": 2 * world,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": case["stage"]},
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"load_universal": universal},
        "steps_per_print": 1 << 30,
    }
    if case["dtype"] == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif case["dtype"] == "float16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if case.get("bf16_optimizer"):  # DeepSpeed's BF16_Optimizer (bf16 params, fp32 gradients, ZeRO-1)
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def optimizer_of(model: torch.nn.Module, case: dict) -> torch.optim.Optimizer:
    """The case's AdamW; ``hf``: the Trainer's two groups (transformers' own decay rule)."""
    if case["model"] != "hf":
        return grouped_optimizer(model, case["groups"])
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
                              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], lr=1e-2)


def allow_cpu_fp16() -> None:
    """Let DeepSpeed's CPU accelerator run fp16 on any CPU. It calls fp16 supported only where
    oneDNN has fp16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or
    AMX-FP16), and ``DeepSpeedEngine`` refuses fp16 elsewhere ("Type fp16 is not supported on your
    device"), although torch's CPU fp16 ops run the tiny models. Only that capability answer
    changes: the fp16 optimizer, loss scaler and the files they save are DeepSpeed's own."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # type: ignore[method-assign]


def engine_of(deepspeed: Any, case: dict, world: int, seed: int, universal: bool) -> Any:
    if case["dtype"] == "float16":
        allow_cpu_fp16()
    model = build(case, seed)
    optim = optimizer_of(model, case)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=ds_config(case, world, universal))
    return engine


def live_state(engine: Any, stage: int) -> dict[str, Any]:
    """DeepSpeed's full fp32 masters and optimizer states per FQN (its own accessors; ZeRO-0:
    its optimizer's own tensors), each group's step and hyperparameters, frozen weights."""
    out: dict[str, Any] = {}
    if stage == 0:
        _live_zero0(engine, out)
    else:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                continue
            if stage == 3:
                out[f"model.{name}"] = safe_get_full_fp32_param(p).detach().clone()
                for state in STATES:
                    out[f"optim.state.{name}.{state}"] = safe_get_full_optimizer_state(p, state).detach().clone()
            else:
                out[f"model.{name}"] = _full_hp(engine, p, None)
                for state in STATES:
                    out[f"optim.state.{name}.{state}"] = _full_hp(engine, p, state)
    inner = engine.optimizer if stage == 0 and not hasattr(engine.optimizer, "optimizer") else engine.optimizer.optimizer
    steps = [s["step"] for s in inner.state.values() if "step" in s]
    out["step"] = steps[0].detach().clone() if steps and torch.is_tensor(steps[0]) else None
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return out


def _full_hp(engine: Any, p: torch.nn.Parameter, state: str | None) -> torch.Tensor:
    """ZeRO-1/2: the full fp32 master (``state`` None) or optimizer state of ``p``, as DeepSpeed's
    ``get_full_hp_param`` gathers it (each rank's fragment at its ``lp_fragment_address``), every
    rank always joining the gather. A fragment its
    optimizer-state map lacks (DeepSpeed 0.19.8, a second param group: ``safe_get_full_optimizer_state``
    raises on that rank only, and the others then hang) is taken from the optimizer's own state of
    the partition at the fragment's ``hp_fragment_address``."""
    import torch.distributed as dist

    mine = []
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is not None:
        if state is None:
            frag = mapping.hp_fragment
        else:
            try:
                frag = mapping.get_hp_fragment(state)
            except ValueError:
                opt = engine.optimizer
                flat = opt.single_partition_of_fp32_groups[mapping.param_group_index]
                addr = mapping.hp_fragment_address
                frag = opt.optimizer.state[flat][state].narrow(0, addr.start, addr.numel)
        mine.append((mapping.lp_fragment_address.start, frag.detach().reshape(-1).clone()))
    gathered = [mine]
    if dist.is_initialized():  # gathered, not summed: x + 0.0 would turn a -0.0 into 0.0
        gathered = [None] * dist.get_world_size(p._dp_group)
        dist.all_gather_object(gathered, mine, group=p._dp_group)
    buf = torch.zeros(p.numel(), dtype=torch.float32)
    for start, frag in (piece for pieces in gathered for piece in pieces):
        buf.narrow(0, start, frag.numel()).copy_(frag)
    return buf.reshape(p.shape)


def _live_zero0(engine: Any, out: dict[str, Any]) -> None:
    names = {p: n for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    if hasattr(opt, "fp32_groups"):  # DeepSpeed's unfused fp16/bf16 optimizer: fp32 masters beside
        pairs = [(lp, hp) for lps, hps in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lps, hps)]
        inner = opt.optimizer
    else:
        pairs = [(p, p) for g in opt.param_groups for p in g["params"]]
        inner = opt
    for lp, hp in pairs:
        out[f"model.{names[lp]}"] = hp.detach().clone()
        for state in STATES:
            if state in inner.state.get(hp, {}):
                out[f"optim.state.{names[lp]}.{state}"] = inner.state[hp][state].detach().clone()


def _next_loss(engine: Any, case: dict) -> float:
    """The loss of the fixed next batch (forward only)."""
    with torch.no_grad():
        if case["model"] == "hf":
            from ds_trainer_run import next_batch

            return float(engine(**next_batch()).loss)
        inputs, targets = make_batch(args_of(case), seed=NEXT_SEED, step=NEXT_STEP, first_stage=True)
        return float(_loss(engine, inputs, targets))


def _train_step(model: Any, optim: Any, case: dict, seed: int) -> float:
    """One more training step (an engine steps itself when ``optim`` is None)."""
    if case["model"] == "hf":
        ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(seed))
        loss = model(input_ids=ids, labels=ids).loss
    else:
        inputs, targets = make_batch(args_of(case), seed=seed, step=NEXT_STEP + 1, first_stage=True)
        loss = _loss(model, inputs, targets)
    if optim is None:
        model.backward(loss)
        model.step()
    else:
        loss.backward()
        optim.step()
        optim.zero_grad()
    return float(loss.detach())


def train_and_save(rank: int, world: int, case: dict, out_dir: str, steps: int = 3) -> None:
    """Train ``steps`` steps, ``engine.save_checkpoint(out_dir)`` (default tag ``global_step<N>``,
    ``latest``); rank 0 then writes ``live.pt`` (DeepSpeed's full state) and ``next.json`` (the
    loss of the fixed next batch, forward only, from the saved state)."""
    deepspeed = _init_deepspeed(rank, world)
    args = args_of(case)
    engine = engine_of(deepspeed, case, world, seed=0, universal=False)
    for step in range(steps):
        inputs, targets = make_batch(args, seed=rank, step=step, first_stage=True)
        loss = _loss(engine, inputs, targets)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out_dir)
    live = live_state(engine, case["stage"])
    loss = _next_loss(engine, case)
    if rank == 0:
        torch.save(live, Path(out_dir) / "live.pt")
        (Path(out_dir) / "next.json").write_text(json.dumps({"loss": loss}))


def load_and_check(rank: int, world: int, case: dict, load_dir: str, expected_path: str, report_dir: str) -> None:
    """A ZeRO engine of ``case`` (its stage, ``world`` ranks) loads the universal checkpoint
    ``load_dir``; its full state must equal ``expected_path`` bit for bit; the report holds the
    loss of the fixed next batch (forward only, before any step) and of one more training step."""
    deepspeed = _init_deepspeed(rank, world)
    engine = engine_of(deepspeed, case, world, seed=0, universal=True)  # frozen weights never trained
    path, _ = engine.load_checkpoint(load_dir, load_optimizer_states=True, load_lr_scheduler_states=False)
    live = live_state(engine, case["stage"])
    expected = torch.load(expected_path, weights_only=False)
    errors = [] if path is not None else [f"load_checkpoint({load_dir}) returned None"]
    checked = compare_state(live, expected, errors)
    want_step = expected.get("step")
    if want_step is not None and not bits_equal(torch.as_tensor(live["step"]), torch.as_tensor(want_step)):
        errors.append(f"step: got {live['step']!r}, want {want_step!r}")
    next_loss = _next_loss(engine, case)
    _train_step(engine, None, case, seed=rank)
    report = {"rank": rank, "checked": checked, "errors": errors[:MAX_ERRORS], "next_loss": next_loss,
              "param_groups": live["param_groups"]}
    (Path(report_dir) / f"rank{rank}.json").write_text(json.dumps(report, default=repr))


def fsdp2_load_and_check(rank: int, world: int, case: dict, ckpt_dir: str, expected_path: str,
                         report_dir: str) -> None:
    """FSDP2 (``dp<world>``, fp32, other weights) ``dcp.load`` s ``ckpt_dir`` through
    ``get_state_dict``/``set_state_dict``; torch's own full state must equal ``expected_path``
    bit for bit; then one more training step runs."""
    from dataclasses import replace

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from ckpt_factory import FixtureSpec, load_into, make_mesh
    from models import apply_fsdp

    fp32 = {**case, "dtype": "float32"}  # the masters are fp32 whatever DeepSpeed trained in
    args = replace(args_of(case), dtype="float32")
    model = build(fp32, seed=1234)
    if world > 1:
        mesh = make_mesh({"dp": world})["dp"]
        if case["model"] == "hf":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            apply_fsdp(model, mesh)
    optim = optimizer_of(model, case)
    _train_step(model, optim, case, seed=7)  # optimizer state exists, with other values: the load must win
    load_into(FixtureSpec("deepspeed", (("dp", world),), args), model, optim, ckpt_dir)
    live = full_state_of(*get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True)))
    expected = torch.load(expected_path, weights_only=False)
    errors: list[str] = []
    checked = compare_state(live, expected, errors)
    want_step = expected.get("step")
    steps = [v for k, v in live.items() if k.endswith(".step")]
    if want_step is not None and not (steps and all(bits_equal(s, want_step) for s in steps)):
        errors.append(f"step: got {steps[:1]}, want {want_step!r}")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
    loss = _train_step(model, optim, case, seed=8)
    report = {"rank": rank, "checked": checked, "errors": errors[:MAX_ERRORS], "loss": loss,
              "param_groups": groups}
    (Path(report_dir) / f"rank{rank}.json").write_text(json.dumps(report, default=repr))
