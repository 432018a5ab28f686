"""DeepSpeed 0.19.8 ranks (CPU, gloo) of a Megatron-like tensor-parallel model, saved by the
engine's own ``save_checkpoint`` with ``client_state={'universal_checkpoint_info': ...}`` as
Megatron-DeepSpeed passes it (:data:`UC_INFO`).

The model (:class:`TpModel`) holds on TP rank ``r`` slices of known global weights
(:func:`global_weights`, seed 0), cut as Megatron cuts them (:data:`SPEC`): a vocabulary-parallel
embedding padded to :data:`VOCAB_PADDED` rows, a replicated LayerNorm, a column-parallel Linear
(dim 0), a row-parallel Linear (dim 1, bias replicated), a SwiGLU ``h_to_4h`` whose slice is
``[gate_r; up_r]`` (2 sub-parameters on dim 0) and its row-parallel ``4h_to_h``. The forward is
Megatron's: identity / all-reduce pairs around the parallel layers, so the replicated parameters
get the same gradients on every TP rank. After the save each rank writes ``live-rank<r>.pt``: its
full fp32 masters and Adam states by DeepSpeed's own ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state``, and the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

H, FFN, VOCAB, VOCAB_PADDED = 8, 16, 30, 32
STEPS = 2
#: Parameter -> (global shape, how TP cuts it: "vocab", "rep", "col", "row" or "two").
SPEC: dict[str, tuple[tuple[int, ...], str]] = {
    "embed.weight": ((VOCAB_PADDED, H), "vocab"),
    "ln.weight": ((H,), "rep"),
    "ln.bias": ((H,), "rep"),
    "col.weight": ((FFN, H), "col"),
    "col.bias": ((FFN,), "col"),
    "row.weight": ((H, FFN), "row"),
    "row.bias": ((H,), "rep"),
    "h4.weight": ((2 * FFN, H), "two"),
    "h4.bias": ((2 * FFN,), "two"),
    "h4row.weight": ((H, FFN), "row"),
    "h4row.bias": ((H,), "rep"),
}
#: What Megatron-DeepSpeed's ``universal_checkpoint_info`` says of this model.
UC_INFO = {
    "universal_checkpoint_version": 0.2,
    "tp_replicated_parameter_patterns": [r"ln\.(weight|bias)$", r".*row\.bias$"],
    "parameter_with_row_parallelism_patterns": [r".*row\.weight$"],
    "vocabulary_parameter_patterns": [r"embed\.weight$"],
    "parameter_with_2_sub_params_cat_dim_0": [r"h4\.(weight|bias)$"],
    "original_vocab_size": VOCAB,
    "padded_vocab_size": VOCAB_PADDED,
}


def global_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) * 0.3 for name, (shape, _) in SPEC.items()}


def tp_slice(full: torch.Tensor, how: str, rank: int, tp: int) -> torch.Tensor:
    """TP rank ``rank``'s slice of a global tensor."""
    if how == "rep":
        return full.clone()
    if how == "row":
        return full.chunk(tp, dim=1)[rank].clone()
    if how == "two":
        return torch.cat([half.chunk(tp, dim=0)[rank] for half in full.chunk(2, dim=0)]).clone()
    return full.chunk(tp, dim=0)[rank].clone()  # col, vocab


def tp_join(slices: list[torch.Tensor], how: str) -> torch.Tensor:
    """The global tensor of the ranks' slices (the test's own knowledge of the cut; vocabulary
    padding dropped)."""
    if how == "rep":
        return slices[0]
    if how == "row":
        return torch.cat(slices, dim=1)
    if how == "two":
        halves = [s.chunk(2, dim=0) for s in slices]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    joined = torch.cat(slices, dim=0)
    return joined[:VOCAB] if how == "vocab" else joined


class _Copy(torch.autograd.Function):  # Megatron's copy_to_tensor_model_parallel_region
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):  # reduce_from_tensor_model_parallel_region
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _Embedding(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, lo: int, group: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.lo, self.group = lo, group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.lo
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside.unsqueeze(-1)
        return _Reduce.apply(out, self.group)


class _Row(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group: Any) -> None:
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Reduce.apply(F.linear(x, self.weight), self.group) + self.bias


class TpModel(torch.nn.Module):
    """TP rank ``rank`` of ``tp`` of the model, its parameters cut from :func:`global_weights`."""

    def __init__(self, rank: int, tp: int, group: Any) -> None:
        super().__init__()
        w = {n: tp_slice(t, SPEC[n][1], rank, tp) for n, t in global_weights().items()}
        self.group = group
        self.embed = _Embedding(w["embed.weight"], rank * VOCAB_PADDED // tp, group)
        self.ln = torch.nn.LayerNorm(H)
        self.col = torch.nn.Linear(H, FFN // tp)
        self.row = _Row(w["row.weight"], w["row.bias"], group)
        self.h4 = torch.nn.Linear(H, 2 * FFN // tp)
        self.h4row = _Row(w["h4row.weight"], w["h4row.bias"], group)
        with torch.no_grad():
            for name in ("ln.weight", "ln.bias", "col.weight", "col.bias", "h4.weight", "h4.bias"):
                self.get_parameter(name).copy_(w[name])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.embed(tokens))
        y = self.row(F.gelu(self.col(_Copy.apply(x, self.group))))
        gate, up = self.h4(_Copy.apply(y, self.group)).chunk(2, dim=-1)
        return self.h4row(F.silu(gate) * up)


class Mpu:
    """Megatron's ``parallel_state`` as DeepSpeed asks it: ``tp`` tensor-parallel ranks fastest
    (global rank = dp rank * tp + tp rank), data-parallel groups across them."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        for d in range(self.dp):  # new_group is collective: every rank makes every group
            group = dist.new_group([d * tp + t for t in range(tp)])
            if d == self.dp_rank:
                self.mp_group = group
        for t in range(tp):
            group = dist.new_group([d * tp + t for d in range(self.dp)])
            if t == self.tp_rank:
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self) -> Any:
        return self.mp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self) -> Any:
        return self.dp_group


def save_tp_megatron(rank: int, world: int, out_dir: str, stage: int, bf16: bool, tp: int = 2) -> None:
    """ZeRO-``stage`` over a ``tp``-way TP mpu x ``world // tp`` data-parallel ranks, ``STEPS``
    AdamW steps, saved with Megatron-DeepSpeed's ``universal_checkpoint_info``; then
    ``live-rank<r>.pt`` (ranks ``0 .. tp-1`` hold data-parallel rank 0's TP ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from ds_layout_worker import _config
    from ds_worker import _init_deepspeed

    deepspeed = _init_deepspeed(rank, world)
    mpu = Mpu(tp)
    model = TpModel(mpu.tp_rank, tp, mpu.mp_group)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    config = _config(mpu.dp, stage, **({"bf16": {"enabled": True}} if bf16 else {}))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, mpu=mpu, config=config)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * mpu.dp_rank + step)  # the same batch on every TP rank
        tokens = torch.randint(0, VOCAB, (2, 5), generator=g)
        out = engine(tokens)
        engine.backward(out.float().square().mean())
        engine.step()
    engine.save_checkpoint(out_dir, client_state={"universal_checkpoint_info": UC_INFO})
    live: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        live[f"model.{name}"] = safe_get_full_fp32_param(p).detach().clone()
        for state in ("exp_avg", "exp_avg_sq"):
            live[f"optim.state.{name}.{state}"] = safe_get_full_optimizer_state(p, state).detach().clone()
    steps = [st["step"] for st in engine.optimizer.optimizer.state.values() if "step" in st]
    live["step"] = torch.as_tensor(steps[0]).detach().clone() if steps else None
    torch.save(live, Path(out_dir) / f"live-rank{rank}.pt")


class _Holder(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        if bias is not None:
            self.bias = torch.nn.Parameter(bias)


def global_model() -> torch.nn.Module:
    """The TP 1 model: the same parameter names at their global shapes (vocabulary unpadded)."""
    model = torch.nn.Module()
    shapes = {n: s for n, (s, _) in SPEC.items()}
    z = {n: torch.full((VOCAB, H) if n == "embed.weight" else s, 7.0) for n, s in shapes.items()}
    model.embed = _Holder(z["embed.weight"])
    for name in ("ln", "col", "row", "h4", "h4row"):
        setattr(model, name, _Holder(z[f"{name}.weight"], z[f"{name}.bias"]))
    return model


def fsdp2_load(rank: int, world: int, ckpt_dir: str, expected_path: str, report_dir: str) -> None:
    """The TP 1 model under FSDP2 (``dp<world>``, other values, an AdamW step taken) ``dcp.load`` s
    ``ckpt_dir`` through ``get_state_dict`` / ``set_state_dict``; torch's own full state must equal
    ``expected_path`` bit for bit (a JSON report per rank)."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = global_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sum(p.sum() for p in model.parameters()).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    live = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            live[f"optim.state.{fqn}.{name}"] = v
    expected = torch.load(expected_path, weights_only=False)
    errors, checked = [], 0
    for key, want in expected.items():
        if key == "step":
            continue
        got = live.get(key)
        checked += 1
        if got is None or got.shape != want.shape or not torch.equal(got.view(-1).view(torch.int32),
                                                                     want.float().contiguous().view(-1).view(torch.int32)):
            errors.append(f"{key}: differs")
    steps = [v for k, v in live.items() if k.endswith(".step")]
    if not steps or any(float(s) != float(expected["step"]) for s in steps):
        errors.append(f"step: {steps[:1]} != {expected['step']}")
    (Path(report_dir) / f"rank{rank}.json").write_text(json.dumps({"checked": checked, "errors": errors[:20]}))


def ds_load(rank: int, world: int, load_dir: str, stage: int, expected_path: str, report_dir: str) -> None:
    """The TP 1 model under a plain DeepSpeed ZeRO-``stage`` engine of ``world`` ranks (no mpu)
    loads the universal checkpoint ``load_dir`` (``load_universal``); every fp32 master and Adam
    state by DeepSpeed's ``safe_get_full_*`` must equal ``expected_path`` bit for bit."""
    import json

    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from ds_layout_worker import _config
    from ds_worker import _init_deepspeed

    deepspeed = _init_deepspeed(rank, world)
    model = global_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim,
                                      config=_config(world, stage, checkpoint={"load_universal": True}))
    path, _ = engine.load_checkpoint(load_dir, load_optimizer_states=True, load_lr_scheduler_states=False)
    expected = torch.load(expected_path, weights_only=False)
    errors = [] if path is not None else ["load_checkpoint returned None"]
    checked = 0
    for name, p in engine.module.named_parameters():
        got = {f"model.{name}": safe_get_full_fp32_param(p)}
        for state in ("exp_avg", "exp_avg_sq"):
            got[f"optim.state.{name}.{state}"] = safe_get_full_optimizer_state(p, state)
        for key, value in got.items():
            checked += 1
            want = expected[key].float()
            if value is None or value.shape != want.shape or not torch.equal(value.view(torch.int32), want.view(torch.int32)):
                errors.append(f"{key}: differs")
    (Path(report_dir) / f"rank{rank}.json").write_text(json.dumps({"checked": checked, "errors": errors[:20]}))
