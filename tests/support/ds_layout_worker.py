"""DeepSpeed 0.19.8 ranks (CPU, gloo) that save the layouts ckptconv's ZeRO reader refuses, each
with DeepSpeed's own engine and ``save_checkpoint``:

* ``tp``: a 2-way model-parallel engine (``deepspeed.initialize(mpu=...)``, the interface
  Megatron-DeepSpeed hands its tensor-parallel groups through) writes ``mp_rank_00`` and
  ``mp_rank_01`` files;
* ``pipe``: a :class:`deepspeed.pipe.PipelineModule` of two stages writes
  ``layer_XX-model_00-model_states.pt`` per layer.
(MoE saves: :mod:`ds_moe_worker`.)

Only the layout matters to these tests (the refusals name the files); the models are tiny.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ds_worker import _init_deepspeed

DIM = 8
STEPS = 2


def _config(world_dp: int, stage: int, **extra: Any) -> dict:
    return {"train_batch_size": 2 * world_dp, "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30, **extra}


class ModelParallel:
    """The ``mpu`` DeepSpeed asks a model-parallel framework for (Megatron-DeepSpeed's
    ``megatron.core.parallel_state`` answers these): every rank a tensor-parallel rank of one
    model-parallel group, data parallelism of 1."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.mp_group = dist.new_group(list(range(self.world)))
        for r in range(self.world):  # new_group is collective: every rank makes every dp group
            group = dist.new_group([r])
            if r == self.rank:
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return self.rank

    def get_model_parallel_world_size(self) -> int:
        return self.world

    def get_model_parallel_group(self) -> Any:
        return self.mp_group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_group(self) -> Any:
        return self.dp_group


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ReLU(), torch.nn.Linear(DIM, DIM))


def _step(engine: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, DIM, generator=g)
    out = engine(x)
    loss = (out[0] if isinstance(out, tuple) else out).square().mean()
    engine.backward(loss)
    engine.step()


def save_tp(rank: int, world: int, out_dir: str, stage: int) -> None:
    """ZeRO-``stage`` under a ``world``-way model-parallel mpu: ``mp_rank_00`` .. ``mp_rank_<world-1>``."""
    deepspeed = _init_deepspeed(rank, world)
    mpu = ModelParallel()
    model = _mlp(rank)  # each tensor-parallel rank its own shard's values
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, mpu=mpu, config=_config(1, stage))
    for step in range(STEPS):
        _step(engine, step)
    engine.save_checkpoint(out_dir)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


def save_pipe(rank: int, world: int, out_dir: str, stage: int, model_axis: bool = False, stages: int = 2,
              bf16: bool = False, tp: int = 1) -> None:
    """A :class:`PipelineModule` of ``stages`` stages over ``world`` ranks (``world // stages``
    data-parallel replicas) trained and saved: the engine writes ``layer_<l>-model_states.pt`` per
    layer (``model_axis``: on Megatron-DeepSpeed's pipe x model x data topology,
    ``layer_<l>-model_<t>-model_states.pt``, ``tp`` model-parallel ranks per stage) beside one ``mp_rank_<stage>_model_states.pt`` per
    stage (``bf16``: DeepSpeed's bf16 training, its BF16_Optimizer's ``bf16_*`` optimizer files); under ZeRO each rank then writes ``live-rank<r>.pt``, DeepSpeed's full state of its stage."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    deepspeed = _init_deepspeed(rank, world)
    torch.manual_seed(0)
    layers = [LayerSpec(torch.nn.Linear, DIM, DIM), LayerSpec(torch.nn.ReLU), LayerSpec(torch.nn.Linear, DIM, DIM)]
    dp = world // stages // tp
    topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=dp) if model_axis else None
    model = PipelineModule(layers=layers, num_stages=None if model_axis else stages, topology=topology,
                           loss_fn=_mse, partition_method="uniform")
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim,
                                      config=_config(dp, stage, gradient_accumulation_steps=1,
                                                     **({"bf16": {"enabled": True}} if bf16 else {})))
    g = torch.Generator().manual_seed(1 + rank)  # the data-parallel replicas' batches differ
    dtype = torch.bfloat16 if bf16 else torch.float32
    batches = [(torch.randn(2, DIM, generator=g, dtype=dtype), torch.randn(2, DIM, generator=g, dtype=dtype))
               for _ in range(STEPS)]
    it = iter(batches * world)
    for _ in range(STEPS):
        engine.train_batch(data_iter=it)
    engine.save_checkpoint(out_dir)
    if stage:  # (ZeRO-0: DeepSpeed's accessors have no ZeRO mapping to read)
        torch.save(_live_pipe(engine), Path(out_dir) / f"live-rank{rank}.pt")


def _live_pipe(engine: Any) -> dict[str, Any]:
    """This stage's full fp32 masters, Adam states and step, gathered by DeepSpeed's own
    ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (ZeRO-1: each partition's
    fragment over the stage's data-parallel group), by the parameter names of the checkpoint."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        out[f"model.{name}"] = safe_get_full_fp32_param(p).detach().clone()
        for state in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{name}.{state}"] = safe_get_full_optimizer_state(p, state).detach().clone()
    steps = [st["step"] for st in engine.optimizer.optimizer.state.values() if "step" in st]
    out["step"] = steps[0].detach().clone()
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.optimizer.param_groups]
    return out


_FP32_OF = """
import contextlib, io, sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
with contextlib.redirect_stdout(io.StringIO()):
    sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1], tag=sys.argv[2])
torch.save({k: v.contiguous() for k, v in sd.items()}, sys.argv[3])
"""


def save_twice(rank: int, world: int, out_dir: str, stage: int, case_name: str) -> None:
    """The ds_zero_support case ``case_name`` (its model, optimizer and batches) trained 4 steps
    by one engine, saved after step 3 (``global_step3``) and after step 4 (``global_step4``,
    ``latest``)."""
    from ds_zero_support import Case
    from ds_zero_worker import args_of, engine_of
    from ds_worker import _loss
    from models import make_batch

    case = Case.parse(case_name).to_json()
    assert case["stage"] == stage and case["world"] == world
    deepspeed = _init_deepspeed(rank, world)
    engine = engine_of(deepspeed, case, world, seed=0, universal=False)
    for step in range(4):
        inputs, targets = make_batch(args_of(case), seed=rank, step=step, first_stage=True)
        engine.backward(_loss(engine, inputs, targets))
        engine.step()
        if step >= 2:
            engine.save_checkpoint(out_dir)


def consolidate(out_dir: str, tag: str, dst: str) -> None:
    """DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` of ``out_dir``'s ``tag``, saved to
    ``dst`` (a fresh interpreter: it runs on no process group)."""
    import subprocess
    import sys

    from ds_zero_support import deepspeed_env

    proc = subprocess.run([sys.executable, "-c", _FP32_OF, out_dir, tag, dst], capture_output=True, text=True,
                          timeout=300, env=deepspeed_env())
    assert proc.returncode == 0, proc.stderr[-3000:]


def load_flat(rank: int, world: int, load_dir: str, stage: int, expected_path: str, report_dir: str) -> None:
    """The pipeline's model as a plain ``torch.nn.Sequential`` (the same parameter names
    ``0.*``, ``2.*``) under a ZeRO-``stage`` engine of ``world`` ranks (no pipeline) loads the
    universal checkpoint ``load_dir`` (``load_universal``); its full state, by DeepSpeed's own
    accessors, must equal ``expected_path`` bit for bit; a JSON report per rank."""
    import json

    from ds_worker import compare_state, live_state
    from oracle import bits_equal

    deepspeed = _init_deepspeed(rank, world)
    model = _mlp(1234)  # other weights: the load must win
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    config = _config(world, stage, checkpoint={"load_universal": True})
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=config)
    path, _ = engine.load_checkpoint(load_dir, load_optimizer_states=True, load_lr_scheduler_states=False)
    live = live_state(engine)
    expected = torch.load(expected_path, weights_only=False)
    errors = [] if path is not None else [f"load_checkpoint({load_dir}) returned None"]
    checked = compare_state(live, expected, errors)
    if not bits_equal(torch.as_tensor(live["step"]), torch.as_tensor(expected["step"])):
        errors.append(f"step: got {live['step']!r}, want {expected['step']!r}")
    if live.get("unmapped"):
        errors.append(f"unmapped: {live['unmapped']}")
    _step(engine, 0)  # it trains on
    report = {"rank": rank, "checked": checked, "errors": errors[:20]}
    (Path(report_dir) / f"rank{rank}.json").write_text(json.dumps(report, default=repr))
