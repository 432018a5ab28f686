"""DeepSpeed 0.19.8 ranks (CPU, gloo) that train and save a model with two
:class:`deepspeed.moe.layer.MoE` layers of different ``ep_size`` with DeepSpeed's own engine and
``save_checkpoint`` (MoE layout: ``layer_<l>_expert_<e>_mp_rank_00_model_states.pt`` per global
expert; ZeRO-1/2: ``zero_pp_rank_<r>_*`` with the expert groups partitioned over the
expert-data-parallel group; no ZeRO: ``expp_rank_<r>_*``), then write the oracle:
``live-rank<r>.pt``, each rank's full fp32 masters, Adam states and step by DeepSpeed's own
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (ZeRO-0: the engine's parameters
and its optimizer's state), the rank's local experts renamed to their global ids as DeepSpeed's
``_save_moe_checkpoint`` does (``expp_rank * num_local_experts + local``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ds_worker import _init_deepspeed

DIM = 8
STEPS = 2
STATES = ("exp_avg", "exp_avg_sq")
EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


class MoENet(torch.nn.Module):
    """Linear, MoE (``ep_a``, ``experts_a`` experts of Linear-ReLU-Linear), Linear, MoE (``ep_b``,
    ``experts_b`` Linear experts), Linear."""

    def __init__(self, ep_a: int, experts_a: int, ep_b: int, experts_b: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.inp = torch.nn.Linear(DIM, DIM)
        mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.ReLU(), torch.nn.Linear(2 * DIM, DIM))
        self.moe1 = MoE(hidden_size=DIM, expert=mlp, num_experts=experts_a, ep_size=ep_a, k=1, min_capacity=8,
                        capacity_factor=8.0)
        self.mid = torch.nn.Linear(DIM, DIM)
        self.moe2 = MoE(hidden_size=DIM, expert=torch.nn.Linear(DIM, DIM), num_experts=experts_b, ep_size=ep_b, k=1,
                        min_capacity=8, capacity_factor=8.0)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _, _ = self.moe1(self.inp(x))
        h, _, _ = self.moe2(self.mid(h))
        return self.out(h)


def global_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> the name DeepSpeed's expert files give it (global expert id)."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    out = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        ep_rank = groups._get_expert_parallel_rank(module.expert_group_name)
        for name, _ in module.named_parameters(prefix=prefix):
            m = re.match(f"(.*{re.escape(EXPERTS)})([0-9]+)(\\..*)", name)
            if m:
                out[name] = f"{m[1]}{ep_rank * module.num_local_experts + int(m[2])}{m[3]}"
    return out


def live_moe(engine: Any) -> dict[str, Any]:
    """This rank's full fp32 masters, Adam states and step, by global names."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    rename = global_names(engine.module)
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8's ZeRO-1/2 links the fragments' optimizer states once, after the FIRST
        # group's first step, when the later groups have no state yet (their fragments stay
        # empty: "exp_avg not found in optimizer state fragment"); its own linking, run again now
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    # ZeRO-0 fp16/bf16 (FP16_UnfusedOptimizer): the optimizer steps fp32 copies of the parameters
    masters = {id(lp): hp for lps, hps in zip(getattr(engine.optimizer, "fp16_groups", []),
                                              getattr(engine.optimizer, "fp32_groups", [])) for lp, hp in zip(lps, hps)}
    out: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        key = rename.get(name, name)
        master = safe_get_full_fp32_param(p)
        hp = masters.get(id(p), p)
        out[f"model.{key}"] = (hp if master is None else master).detach().clone()
        for state in STATES:
            value = safe_get_full_optimizer_state(p, state)
            out[f"optim.state.{key}.{state}"] = (inner.state[hp][state] if value is None else value).detach().clone()
    steps = [s["step"] for s in inner.state.values() if "step" in s]
    out["step"] = steps[0].detach().clone()
    out["steps_equal"] = all(torch.equal(s, steps[0]) for s in steps)
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return out


def _config(world: int, stage: int, dtype: str, **extra: Any) -> dict:
    return {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30, **({"bf16": {"enabled": True}} if dtype == "bf16" else {}), **extra}


def engine_of(deepspeed: Any, world: int, stage: int, dtype: str, shape: tuple[int, int, int, int], seed: int,
              **extra: Any) -> Any:
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(seed)
    model = MoENet(*shape)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "params"}])
    optim = torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=_config(world, stage, dtype, **extra))
    return engine


def _train_step(engine: Any, rank: int, step: int, dtype: str) -> float:
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(2, 4, DIM, generator=g).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    loss = engine(x).float().square().mean()
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def save_moe(rank: int, world: int, out_dir: str, stage: int, dtype: str, shape: list[int],
             data_first: bool = False) -> None:
    """Train ``STEPS`` steps, ``save_checkpoint(out_dir)``, write ``live-rank<r>.pt``
    (``data_first``: ``use_data_before_expert_parallelism``, DeepSpeed's data-then-expert ranks)."""
    deepspeed = _init_deepspeed(rank, world)
    extra = {"use_data_before_expert_parallelism": True} if data_first else {}
    engine = engine_of(deepspeed, world, stage, dtype, tuple(shape), seed=0, **extra)
    for step in range(STEPS):
        _train_step(engine, rank, step, dtype)
    engine.save_checkpoint(out_dir)
    torch.save(live_moe(engine), Path(out_dir) / f"live-rank{rank}.pt")


def dcp_load_and_check(rank: int, world: int, ckpt_dir: str, expected_path: str, report_dir: str) -> None:
    """``dcp.load`` (torch's default planner) of every weight and Adam state of ``ckpt_dir`` into
    DTensors sharded on dim 0 over a ``world``-rank mesh (other initial values); each gathered
    tensor and step must equal ``expected_path`` (the DeepSpeed run's live state) bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    expected = torch.load(expected_path, weights_only=False)
    mesh = init_device_mesh("cpu", (world,))

    def fresh(want: torch.Tensor) -> Any:
        return distribute_tensor(torch.full_like(want, 7.0), mesh, [Shard(0)])

    model = {k[len("model."):]: fresh(v) for k, v in expected.items() if k.startswith("model.")}
    state: dict[str, dict] = {}
    for key, value in expected.items():
        if key.startswith("optim.state."):
            fqn, name = key[len("optim.state."):].rsplit(".", 1)
            state.setdefault(fqn, {})[name] = fresh(value)
    for fqn in state:
        state[fqn]["step"] = torch.tensor(0.0)
    sd = {"model": model, "optim": {"state": state}}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    errors, checked = [], 0
    for fqn, t in model.items():
        checked += 1
        if not torch.equal(t.full_tensor().view(torch.int32), expected[f"model.{fqn}"].view(torch.int32)):
            errors.append(f"model.{fqn}")
    for fqn, states in state.items():
        for name, t in states.items():
            want = expected["step"] if name == "step" else expected[f"optim.state.{fqn}.{name}"]
            have = t if name == "step" else t.full_tensor()
            checked += 1
            if not torch.equal(have.float().view(torch.int32), want.float().view(torch.int32)):
                errors.append(f"optim.state.{fqn}.{name}")
    (Path(report_dir) / f"rank{rank}.json").write_text(json.dumps({"checked": checked, "errors": errors[:20]}))
