"""``--plan megatron``: Megatron-core's own tensor-parallel layout of a GPT model, by module name (pure).

What ``dist_checkpointing.load`` asks each rank for (megatron-core 0.19, local and Transformer
Engine layer specs; names as ``GPTModel.sharded_state_dict`` writes them, layer-stacked
``decoder.layers.<name>`` of shape ``(L, ...)`` or per layer ``decoder.layers.<i>.<name>``):

- ``embedding.word_embeddings.weight``: ``VocabParallelEmbedding``, rows over tp;
  ``output_layer.weight``: ``ColumnParallelLinear``, rows over tp;
- ``self_attention.linear_qkv``: column-parallel (query groups are contiguous rows, so a TP split
  keeps whole groups), weight and bias; ``linear_proj``: row-parallel (its bias whole);
- ``mlp.linear_fc1``: column-parallel; gated (SwiGLU: ``[gate; up]`` stacked, rows twice
  ``linear_fc2``'s input dim) each half over tp, so a rank holds two row blocks
  (``_StridedShard(rows, 2)``, megatron's ``apply_swiglu_sharded_factory``); ``linear_fc2``: row-parallel;
- layer norms (``input_layernorm``, ``pre_mlp_layernorm``, TE's fused ``*.layer_norm_weight``/``_bias``,
  ``final_layernorm``) and ``position_embeddings``: whole on every rank.

Every tensor is whole over the data-parallel dims: megatron's DistributedOptimizer (``fully_reshardable``)
saves each parameter's TP shard and its fp32 main copy and Adam states through the main replica, and
every DP rank loads the whole TP shard. Ranks are numbered as megatron numbers them (tp fastest, then
cp, dp, pp: ``--mesh``'s canonical order). The layer axis of a stacked tensor is never split
(megatron's pipeline stages split it by layers; here it is written for every stage, and the load is
still exact). Grouped MoE experts and the legacy per-rank format are not planned here yet.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from converter.plan.mesh import Mesh
from converter.plan.placement_rules import PipelineSplit, Rule, TensorPlacement, compose, replicated
from converter.plan.placements import Placement, Replicate, Shard, StridedShard
from formats.base import Shape

_LAYER = r"(?:decoder|encoder|mtp)\.layers\.(?:\d+\.)?"
#: (rule name, pattern, TP placement on a negative dim: the same rule fits (L, ...) and per-layer shapes).
RULES: tuple[tuple[str, str, Placement], ...] = (
    ("word_embeddings", r"embedding\.word_embeddings\.weight", Shard(0)),
    ("position_embeddings", r"embedding\.position_embeddings\.weight", Replicate()),
    ("output_layer", r"output_layer\.weight", Shard(-2)),
    ("linear_qkv", _LAYER + r"self_attention\.linear_qkv\.weight", Shard(-2)),
    ("linear_qkv.bias", _LAYER + r"self_attention\.linear_qkv\.bias", Shard(-1)),
    ("linear_proj", _LAYER + r"self_attention\.linear_proj\.weight", Shard(-1)),
    ("linear_proj.bias", _LAYER + r"self_attention\.linear_proj\.bias", Replicate()),
    ("linear_fc1", _LAYER + r"mlp\.linear_fc1\.weight", Shard(-2)),
    ("linear_fc1.bias", _LAYER + r"mlp\.linear_fc1\.bias", Shard(-1)),
    ("linear_fc2", _LAYER + r"mlp\.linear_fc2\.weight", Shard(-1)),
    ("linear_fc2.bias", _LAYER + r"mlp\.linear_fc2\.bias", Replicate()),
    ("layer norms", r"(?:" + _LAYER + r"(?:input_layernorm|pre_mlp_layernorm|self_attention\.(?:q|k)_layernorm"
     r"|self_attention\.linear_qkv\.layer_norm_(?:weight|bias)|mlp\.linear_fc1\.layer_norm_(?:weight|bias))"
     r"|(?:decoder|encoder)\.final_layernorm)(?:\.weight|\.bias)?", Replicate()),
)
_COMPILED = tuple((name, re.compile(pat, re.DOTALL), tp) for name, pat, tp in RULES)
_FC1 = re.compile(r"(.*)mlp\.linear_fc1\.(weight|bias)")


def gated_fc1(params: Mapping[str, Shape]) -> frozenset[str]:
    """The ``linear_fc1`` weights and biases that are gated (``[gate; up]``): twice as many rows as
    their ``linear_fc2`` has inputs."""
    out = set()
    for fqn, shape in params.items():
        m = _FC1.fullmatch(fqn)
        fc2 = params.get(f"{m.group(1)}mlp.linear_fc2.weight") if m else None
        if m and fc2 and len(shape) >= 1 and len(shape) - (m.group(2) == "weight") >= 1 \
                and shape[-2 if m.group(2) == "weight" else -1] == 2 * fc2[-1]:
            out.add(fqn)
    return frozenset(out)


@dataclass(frozen=True)
class MegatronPlan:
    """Megatron-core's GPT TP plan (see the module docstring); ``glu``: the gated ``linear_fc1``
    parameters (:func:`gated_fc1`)."""

    glu: frozenset[str] = frozenset()
    name: str = "megatron"
    pipeline: PipelineSplit = PipelineSplit(layers_prefix="decoder.layers", first=("embedding",),
                                            last=("decoder.final_layernorm", "output_layer"))

    def place(self, param_fqn: str, shape: Shape, mesh: Mesh) -> TensorPlacement:
        for name, pattern, tp in _COMPILED:
            if pattern.fullmatch(param_fqn):
                break
        else:
            return replicated(mesh)
        placed = compose(param_fqn, tuple(shape), mesh, Rule(name, pattern.pattern, tp, fsdp_dim=None))
        if param_fqn in self.glu and mesh.size("tp") > 1:  # each half over tp: two row blocks per rank
            placed = replace(placed, placements=tuple(
                StridedShard(p.dim, 2) if isinstance(p, Shard) and g == ("tp",) else p
                for p, g in zip(placed.placements, placed.dims or ())), rule=name + " (gated: 2 halves)")
        return placed

    def assign_stages(self, fqns: Sequence[str], pp: int) -> tuple[dict[str, int | None], list[str]]:
        # layer-stacked tensors span every stage: written for all of them (no per-tensor stage)
        return {f: None for f in fqns}, []

    def unused_rule_warnings(self, used: set[str]) -> list[str]:
        return []


def megatron_plan(params: Mapping[str, Shape]) -> MegatronPlan:
    """The Megatron plan for a model whose parameters are ``params`` (FQN -> shape)."""
    return MegatronPlan(gated_fc1(params))
