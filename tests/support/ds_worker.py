"""DeepSpeed 0.19 on CPU (gloo) for the DeepSpeed bridge tests: train-and-save, and universal load.

Ranks run under :func:`ckpt_factory.run_world`. Each builds the tests' Transformer
(:mod:`models`) with torch's AdamW (``foreach=False``, as the FSDP2 fixtures) under a DeepSpeed
ZeRO-1/2/3 engine. DeepSpeed's shared-memory allreduce op is switched off before the engine starts:
it is a JIT-compiled speed-up whose build lock, left by a killed run, makes every later start hang
(gloo does the collectives). Everything DeepSpeed holds is read back with its own accessors
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), never with our readers.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from models import LR, ModelArgs, build_model, make_batch, make_optimizer
from oracle import bits_equal

STATES = ("exp_avg", "exp_avg_sq")
MAX_ERRORS = 20


def _init_deepspeed(rank: int, world: int) -> Any:
    # one fixed directory per user (a fresh mkdtemp per rank left hundreds of empty dirs in /tmp)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), f"ckptconv-ds-ext-{os.getuid()}"))
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see the module docstring
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    if not torch.distributed.is_initialized():  # a world of 1 (run_world made no group): an in-process store, no port
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # takes torch's group
    return deepspeed


def grouped_optimizer(model: torch.nn.Module, groups: int) -> torch.optim.Optimizer:
    """The fixtures' AdamW (``groups`` 1), or the usual two groups: matrices with weight decay,
    vectors (norms, biases) without."""
    if groups == 1:
        return make_optimizer(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=LR, foreach=False)


def _engine(deepspeed: Any, args: ModelArgs, seed: int, stage: int, world: int, universal: bool,
            groups: int = 1) -> Any:
    model = build_model(args, seed)
    config = {
        "train_batch_size": 2 * world,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"load_universal": universal},
        "steps_per_print": 1 << 30,
    }
    if args.dtype in ("bfloat16", "float16"):  # DeepSpeed's mixed precision: fp32 master weights and states
        config["bf16" if args.dtype == "bfloat16" else "fp16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=grouped_optimizer(model, groups), config=config)
    return engine


def compare_state(live: dict[str, Any], expected: dict[str, Any], errors: list[str]) -> int:
    """Append a line to ``errors`` for each weight or optimizer state of ``expected`` that ``live``
    lacks or holds with other bits; the number compared."""
    checked = 0
    for key, want in expected.items():
        if not key.startswith(("model.", "optim.state.")):
            continue
        got = live.get(key)
        checked += 1
        if got is None or not bits_equal(got, want):
            errors.append(f"{key}: got {None if got is None else (got.dtype, tuple(got.shape))}, want "
                          f"{(want.dtype, tuple(want.shape))}{'' if got is None else ' (bits differ)'}")
    return checked


def full_state_of(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, Any]:
    """``model.<fqn>`` / ``optim.state.<fqn>.<state>`` of torch's full state dicts."""
    live: dict[str, Any] = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, states in optim_sd["state"].items():
        for name, value in states.items():
            live[f"optim.state.{fqn}.{name}"] = value
    return live


def live_state(engine: Any) -> dict[str, Any]:
    """DeepSpeed's full fp32 master weights and Adam states (collective under ZeRO-3), per FQN,
    plus each group's step and hyperparameters."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        out[f"model.{name}"] = safe_get_full_fp32_param(p).detach().clone()
        for state in STATES:
            try:
                out[f"optim.state.{name}.{state}"] = safe_get_full_optimizer_state(p, state).detach().clone()
            except ValueError:  # DeepSpeed 0.19's fragment map misses it (seen with 2 param groups)
                out.setdefault("unmapped", []).append(f"optim.state.{name}.{state}")
    inner = engine.optimizer.optimizer
    steps = [s["step"] for s in inner.state.values() if "step" in s]
    out["step"] = steps[0].detach().clone() if steps and torch.is_tensor(steps[0]) else steps[0] if steps else None
    out["steps_equal"] = all(bits_equal(s, steps[0]) if torch.is_tensor(s) else s == steps[0] for s in steps)
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return out


def train_and_save(rank: int, world: int, stage: int, args_json: dict, out_dir: str, steps: int,
                   groups: int = 1) -> None:
    """Train ``steps`` steps under ZeRO-``stage``, ``save_checkpoint(out_dir, tag="step<steps>")``,
    then rank 0 saves DeepSpeed's live state as ``out_dir/live.pt`` (the oracle)."""
    deepspeed = _init_deepspeed(rank, world)
    args = ModelArgs.from_json(args_json)
    engine = _engine(deepspeed, args, seed=0, stage=stage, world=world, universal=False, groups=groups)
    for step in range(steps):
        inputs, targets = make_batch(args, seed=rank, step=step, first_stage=True)
        loss = _loss(engine, inputs, targets)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out_dir, tag=f"step{steps}")
    live = live_state(engine)
    if rank == 0:
        torch.save(live, Path(out_dir) / "live.pt")


def _loss(engine: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = engine(inputs)
    return torch.nn.functional.cross_entropy(out.float().flatten(0, 1), targets.flatten())


def load_and_check(rank: int, world: int, stage: int, args_json: dict, load_dir: str, expected_path: str,
                   report_dir: str, groups: int = 1) -> None:
    """Start a ZeRO-``stage`` engine from other weights, ``load_checkpoint(load_dir)`` with
    ``load_universal``, compare DeepSpeed's live state bit for bit with ``expected_path`` (full
    tensors by key, ``step``, ``param_groups``), train one more step; a JSON report per rank."""
    deepspeed = _init_deepspeed(rank, world)
    args = ModelArgs.from_json(args_json)
    engine = _engine(deepspeed, args, seed=1234, stage=stage, world=world, universal=True, groups=groups)
    path, _ = engine.load_checkpoint(load_dir, load_optimizer_states=True, load_lr_scheduler_states=False)
    live = live_state(engine)
    expected = torch.load(expected_path, weights_only=False)
    errors = [] if path is not None else [f"load_checkpoint({load_dir}) returned None"]
    checked = compare_state(live, expected, errors)
    want_step = expected.get("step")
    if want_step is not None and not (live["steps_equal"] and bits_equal(torch.as_tensor(live["step"]),
                                                                           torch.as_tensor(want_step))):
        errors.append(f"step: got {live['step']!r} (all equal: {live['steps_equal']}), want {want_step!r}")
    for i, group in enumerate(expected.get("param_groups", [])):
        got = live["param_groups"][i] if i < len(live["param_groups"]) else {}
        for k, v in group.items():
            if got.get(k) != v:
                errors.append(f"param_groups[{i}][{k!r}]: got {got.get(k)!r}, want {v!r}")
    inputs, targets = make_batch(args, seed=rank, step=99, first_stage=True)
    loss = _loss(engine, inputs, targets)
    engine.backward(loss)
    engine.step()
    report = {"rank": rank, "checked": checked, "errors": errors[:MAX_ERRORS], "loss": float(loss.detach())}
    (Path(report_dir) / f"rank{rank}.json").write_text(json.dumps(report))


def expected_from_store_reference(ref: dict[str, Any], groups: list[dict]) -> dict[str, Any]:
    """The expected dict of :func:`load_and_check` from torch's reading of a DCP checkpoint
    (:func:`oracle.torch_reference`): fp32 master weights, Adam states, step, hyperparameters."""
    out: dict[str, Any] = {}
    step = None
    for key, value in ref.items():
        if key.startswith("model.") and torch.is_tensor(value):
            out[key] = value.float() if value.dtype != torch.float32 else value
        elif key.startswith("optim.state.") and key.rsplit(".", 1)[1] in STATES:
            out[key] = value.float() if value.dtype != torch.float32 else value  # DeepSpeed's states are fp32
        elif key.startswith("optim.state.") and key.endswith(".step"):
            step = value
    out["step"] = step
    out["param_groups"] = groups
    return out


def fsdp2_load_and_check(rank: int, world: int, args_json: dict, ckpt_dir: str, expected_path: str,
                         report_dir: str, groups: int = 1) -> None:
    """FSDP2 on a ``dp<world>`` mesh (other weights) ``dcp.load``s ``ckpt_dir`` through
    ``get_state_dict``/``set_state_dict``; its full state (torch's own gather) must equal
    ``expected_path`` bit for bit; then one more training step runs. A JSON report per rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from ckpt_factory import FixtureSpec, build_parallel_model, load_into, make_mesh
    from models import train_steps

    args = ModelArgs.from_json(args_json)
    layout = {"dp": world}
    model = build_parallel_model(layout, args, make_mesh(layout), seed=1234)
    optim = grouped_optimizer(model, groups)
    train_steps(model, optim, 1, seed=7)  # optimizer state exists, with other values: the load must win
    load_into(FixtureSpec("deepspeed", tuple(layout.items()), args), model, optim, ckpt_dir)
    live = full_state_of(*get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True)))
    expected = torch.load(expected_path, weights_only=False)
    errors: list[str] = []
    checked = compare_state(live, expected, errors)
    want_step = expected.get("step")
    steps = [v for k, v in live.items() if k.endswith(".step")]
    if want_step is not None and not (steps and all(bits_equal(s, want_step) for s in steps)):
        errors.append(f"step: got {steps[:1]}, want {want_step!r}")
    for i, group in enumerate(expected.get("param_groups", [])):
        got = optim.param_groups[i] if i < len(optim.param_groups) else {}
        errors += [f"param_groups[{i}][{k!r}]: got {got.get(k)!r}, want {v!r}" for k, v in group.items()
                   if got.get(k) != v]
    losses = train_steps(model, optim, 1, seed=8)
    report = {"rank": rank, "checked": checked, "errors": errors[:MAX_ERRORS], "loss": losses[0]}
    (Path(report_dir) / f"rank{rank}.json").write_text(json.dumps(report))
