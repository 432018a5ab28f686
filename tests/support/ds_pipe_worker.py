"""DeepSpeed 0.19.8 ranks (CPU, gloo) that train and save ``PipelineModule`` s of the layouts
Megatron-DeepSpeed runs, with DeepSpeed's own ``PipelineEngine`` and ``save_checkpoint``:

* :func:`save_pipe_tp`: 2 stages x ``tp`` tensor-parallel ranks x ``dp`` data-parallel ranks on
  ``PipeModelDataParallelTopology`` (BLOOM's 3D layout): a vocabulary-parallel embedding tied
  (``TiedLayerSpec``) between the first and the last stage (Megatron's way: the last one a
  ``forward_fn``, so only the first stage writes its layer file), a block of a replicated
  LayerNorm, a column-parallel Linear whose bias is frozen and a row-parallel Linear, and a SwiGLU
  block (2 sub-parameters) with a row-parallel output; identity / all-reduce pairs around the
  parallel layers as Megatron's (:mod:`ds_tp_worker`), so replicated parameters stay equal on
  every TP rank. Saved with Megatron-DeepSpeed's ``universal_checkpoint_info`` (:data:`UC_INFO`).
* :func:`save_pipe_tied`: 2 stages x ``dp`` ranks, an embedding (with a frozen shift) tied
  between the first and last stage with no ``forward_fn`` (both stages write its layer file), a
  Linear whose bias is frozen beside a persistent buffer, and a wholly frozen Linear.

After the save each rank writes ``live-rank<r>.pt``: its stage's fp32 masters and Adam states by
DeepSpeed's own ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (its TP slice,
gathered over its data-parallel group), ``frozen.<name>`` / ``buffer.<name>`` the module's own
tensors of the others, the step and the param groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ds_tp_worker import FFN, H, VOCAB, VOCAB_PADDED, _Copy, _Reduce, tp_slice
from ds_tp_worker import UC_INFO as TP_UC_INFO

STEPS = 2
#: The TP (slice) group of this rank, set once the PipelineModule made it (the layers use it in forward).
GROUP: list[Any] = [None]
#: Pipeline x TP parameter -> (global shape, how TP cuts it, as in ds_tp_worker.tp_slice).
TP_SPEC: dict[str, tuple[tuple[int, ...], str]] = {
    "tied_modules.embed.weight": ((VOCAB_PADDED, H), "vocab"),
    **{f"{layer}.{name}": spec for layer in (1, 3) for name, spec in {
        "ln.weight": ((H,), "rep"),
        "ln.bias": ((H,), "rep"),
        "col.weight": ((FFN, H), "col"),
        "col.bias": ((FFN,), "col"),  # frozen
        "row.weight": ((H, FFN), "row"),
        "row.bias": ((H,), "rep")}.items()},
    "2.h4.weight": ((2 * FFN, H), "two"),
    "2.h4.bias": ((2 * FFN,), "two"),
    "2.h4row.weight": ((H, FFN), "row"),
    "2.h4row.bias": ((H,), "rep"),
    "4.norm.weight": ((H,), "rep"),
    "4.norm.bias": ((H,), "rep"),
}
FROZEN_TP = ("1.col.bias", "3.col.bias")
TIED_PATTERN = r"tied_modules\.embed\.weight$"
#: Megatron-DeepSpeed's universal_checkpoint_info of this model: ds_tp_worker's (row-parallel
#: weights, vocabulary sizes) with the pipeline's names, the tied embedding replicated over the stages.
UC_INFO = {**TP_UC_INFO,
           "tp_replicated_parameter_patterns": [r"\d+\.(ln|norm)\.(weight|bias)$", r".*row\.bias$"],
           "vocabulary_parameter_patterns": [TIED_PATTERN], "pipeline_replicated_parameter_patterns": [TIED_PATTERN],
           "parameter_with_2_sub_params_cat_dim_0": [r"2\.h4\.(weight|bias)$"]}


def _global(name: str) -> torch.Tensor:
    """The global value of ``name`` (its own seed, so every rank cuts the same tensor)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(TP_SPEC[name][0], generator=g) * 0.3


def _cut(module: torch.nn.Module, prefix: str, rank: int, tp: int) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(tp_slice(_global(prefix + name), TP_SPEC[prefix + name][1], rank, tp))


class VocabEmbed(torch.nn.Module):
    """A vocabulary-parallel embedding (rows ``rank * V/tp ..``); its ``forward`` looks tokens up."""

    def __init__(self, rank: int, tp: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(VOCAB_PADDED // tp, H))
        self.lo = rank * VOCAB_PADDED // tp
        _cut(self, "tied_modules.embed.", rank, tp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.lo
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside.unsqueeze(-1)
        return _Reduce.apply(out, GROUP[0])


def logits(embed: VocabEmbed, x: torch.Tensor) -> torch.Tensor:
    """The last stage's use of the tied embedding: this rank's vocabulary slice of the logits."""
    return F.linear(_Copy.apply(x, GROUP[0]), embed.weight)


class _Row(torch.nn.Module):
    def __init__(self, cols: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(H, cols))
        self.bias = torch.nn.Parameter(torch.empty(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Reduce.apply(F.linear(x, self.weight), GROUP[0]) + self.bias


class Block(torch.nn.Module):
    """LayerNorm (replicated), column-parallel Linear (bias frozen), row-parallel Linear."""

    def __init__(self, rank: int, tp: int, layer: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(H)
        self.col = torch.nn.Linear(H, FFN // tp)
        self.row = _Row(FFN // tp)
        _cut(self, f"{layer}.", rank, tp)
        self.col.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.row(F.gelu(self.col(_Copy.apply(self.ln(x), GROUP[0]))))


class Glu(torch.nn.Module):
    """SwiGLU: ``h4``'s slice is ``[gate_r; up_r]``; row-parallel ``h4row``."""

    def __init__(self, rank: int, tp: int) -> None:
        super().__init__()
        self.h4 = torch.nn.Linear(H, 2 * FFN // tp)
        self.h4row = _Row(FFN // tp)
        _cut(self, "2.", rank, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.h4(_Copy.apply(x, GROUP[0])).chunk(2, dim=-1)
        return x + self.h4row(F.silu(gate) * up)


class FinalNorm(torch.nn.Module):
    """The final LayerNorm (replicated)."""

    def __init__(self, rank: int, tp: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        _cut(self, "4.", rank, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def _tp_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _Reduce.apply(out.float().square().sum(), GROUP[0]) / out.numel()


def _train_and_save(engine: Any, rank: int, out_dir: str, batches: list, client_state: dict) -> None:
    it = iter(batches)
    for _ in range(STEPS):
        engine.train_batch(data_iter=it)
    engine.save_checkpoint(out_dir, client_state=client_state)
    torch.save(live_stage(engine), Path(out_dir) / f"live-rank{rank}.pt")


def save_pipe_tp(rank: int, world: int, out_dir: str, tp: int, dp: int) -> None:
    """ZeRO-1 fp32, 2 stages x ``tp`` x ``dp`` (``world`` = 2 * tp * dp), ``STEPS`` batches."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from ds_layout_worker import _config
    from ds_worker import _init_deepspeed

    deepspeed = _init_deepspeed(rank, world)
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=tp, num_dp=dp)
    coord = topology.get_coord(rank)
    t = coord.model
    layers = [TiedLayerSpec("embed", VocabEmbed, t, tp), LayerSpec(Block, t, tp, 1), LayerSpec(Glu, t, tp),
              LayerSpec(Block, t, tp, 3), LayerSpec(FinalNorm, t, tp),
              TiedLayerSpec("embed", VocabEmbed, t, tp, forward_fn=logits)]
    model = PipelineModule(layers=layers, topology=topology, loss_fn=_tp_loss, partition_method="uniform")
    GROUP[0] = model.mpu().get_slice_parallel_group()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim,
                                      config=_config(dp, 1, gradient_accumulation_steps=1))
    g = torch.Generator().manual_seed(1 + coord.data)  # the same batches on a data-parallel replica's ranks
    batches = [(torch.randint(0, VOCAB, (2, 5), generator=g), torch.zeros(2)) for _ in range(STEPS)]
    _train_and_save(engine, rank, out_dir, batches, {"universal_checkpoint_info": UC_INFO})


DIM, TIED_VOCAB = 8, 12


class TiedEmbed(torch.nn.Module):
    """An embedding whose ``forward`` looks tokens up (plus a frozen shift, the same on every
    stage), or gives the logits of hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(TIED_VOCAB, DIM) * 0.3)
        self.shift = torch.nn.Parameter(torch.linspace(-1.0, 1.0, DIM), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) if x.is_floating_point() else F.embedding(x, self.weight) + self.shift


class Scaled(torch.nn.Module):
    """A Linear whose bias is frozen, times a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)
        self.lin.bias.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale.to(x.dtype)


class FrozenLinear(torch.nn.Linear):
    """A Linear outside the optimizer (weight and bias frozen)."""

    def __init__(self) -> None:
        super().__init__(DIM, DIM)
        self.requires_grad_(False)


def _mean_square(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def save_pipe_tied(rank: int, world: int, out_dir: str, bf16: bool) -> None:
    """ZeRO-1, 2 stages x ``world // 2`` data-parallel ranks: layers [tied embedding, Scaled,
    frozen Linear, tied embedding (logits)], ``bf16``: DeepSpeed's bf16 training."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    from ds_layout_worker import _config
    from ds_worker import _init_deepspeed

    deepspeed = _init_deepspeed(rank, world)
    torch.manual_seed(0)
    layers = [TiedLayerSpec("embed", TiedEmbed), LayerSpec(Scaled), LayerSpec(FrozenLinear),
              TiedLayerSpec("embed", TiedEmbed)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=_mean_square, partition_method="uniform")
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    dp = world // 2
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=_config(
        dp, 1, gradient_accumulation_steps=1, **({"bf16": {"enabled": True}} if bf16 else {})))
    g = torch.Generator().manual_seed(1 + model.mpu().get_data_parallel_rank())
    batches = [(torch.randint(0, TIED_VOCAB, (2, 3), generator=g), torch.zeros(2)) for _ in range(STEPS)]
    _train_and_save(engine, rank, out_dir, batches, {})


def live_stage(engine: Any) -> dict[str, Any]:
    """This rank's stage by DeepSpeed's own accessors (trainable parameters) and the module's
    own tensors (frozen parameters, buffers), by the checkpoint's parameter names."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            out[f"frozen.{name}"] = p.detach().clone()
            continue
        out[f"model.{name}"] = safe_get_full_fp32_param(p).detach().clone()
        for state in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{name}.{state}"] = safe_get_full_optimizer_state(p, state).detach().clone()
    for name, buf in engine.module.named_buffers():
        out[f"buffer.{name}"] = buf.detach().clone()
    steps = [st["step"] for st in engine.optimizer.optimizer.state.values() if "step" in st]
    out["step"] = torch.as_tensor(steps[0]).detach().clone()
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.optimizer.param_groups]
    return out
