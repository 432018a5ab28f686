"""Placement plans: which placement each parameter gets on each mesh dim, and which PP stage holds it.

Built-ins (``--plan``):

- ``auto`` (default): chosen from the checkpoint (:mod:`converter.plan.auto_plan`).
- ``fsdp``: every parameter ``Shard(0)`` over the FSDP dim (``torch.chunk`` sizes, as
  ``fully_shard`` does), replicated over ``dp_replicate`` and ``tp``.
- ``llama``: torchtitan's Llama 3 tensor-parallel plan by module name, FSDP on top (FSDP2's
  ``_StridedShard`` where FSDP shards a dim TP already split).
- ``moe``: ``llama`` plus torchtitan 0.3.0's MoE decoders (deepseek_v3, qwen3 MoE, gpt_oss,
  kimi_k2_7): MLA attention, router, shared experts, and routed experts on the EP sparse mesh
  (:func:`compose_experts`).
- ``megatron``: Megatron-core's GPT TP plan by module name (:mod:`converter.plan.megatron_plan`).
- ``source``: the TP split dim the source layout shows for each tensor (:class:`SourceSplits`), with
  the new degrees.
- a plan file (JSON, or YAML when pyyaml is installed; ``schemas/plan.schema.json``): ordered regex
  rules over parameter FQNs, and how to split the model into pipeline stages.

Each parameter's DTensor mesh is the one FSDP2 builds: ``dp_replicate`` (HSDP, replicated), then the
FSDP dim (``dp_shard`` and ``cp`` flattened row-major, torchtitan's ``dp_shard_cp``), then ``tp``;
mesh dims absent from ``--mesh`` are left out. Optimizer states share their parameter's placement
(the caller applies that); 0-d tensors are always replicated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from converter.plan.placements import (
    Placement,
    Replicate,
    Shard,
    StridedShard,
    chunk_span,
    compose_fsdp_tp,
    fsdp_tp_mismatch,
    parse_placement,
    rank_boxes,
    unique_boxes,
)
from converter.plan.mesh import Mesh
from formats.base import Box, Shape
from formats.errors import ConfigError, PlanError

BUILTIN_PLANS = ("auto", "fsdp", "llama", "moe", "megatron", "source")
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "plan.schema.json"
_FSDP_DIMS = ("dp_shard", "cp")  # flattened into one FSDP dim, as torchtitan's dp_shard_cp
_MAX_NAMES = 5  # tensor names quoted in one warning


@dataclass(frozen=True)
class TensorPlacement:
    """Where one tensor lives on the target mesh.

    ``placements[i]`` applies to DTensor mesh dim ``dims[i]``, a tuple of target mesh dim names
    flattened row-major (``("dp_shard", "cp")`` for torchtitan's FSDP over ``dp_shard_cp``); ``dims``
    None means one DTensor dim per target mesh dim, ``pp`` excluded. ``pp_stage`` is the ``pp``
    coordinate of the ranks that hold the tensor (None: every rank, or no ``pp`` in the mesh).
    ``rule`` names what decided the placement (None: no rule matched, replicated).
    """

    placements: tuple[Placement, ...]
    pp_stage: int | None = None
    dims: tuple[tuple[str, ...], ...] | None = None
    rule: str | None = None

    def rank_boxes(self, shape: Shape, mesh: Mesh) -> dict[int, Box]:
        """The box of every rank that holds the tensor."""
        return rank_boxes(shape, mesh, self.placements, self.dims, self.pp_stage)

    def unique_boxes(self, shape: Shape, mesh: Mesh) -> list[tuple[Box, tuple[int, ...]]]:
        """Distinct boxes with their owner ranks (replicated boxes once)."""
        return unique_boxes(shape, mesh, self.placements, self.dims, self.pp_stage)

    def __str__(self) -> str:
        dims = self.dims if self.dims is not None else tuple((f"#{i}",) for i in range(len(self.placements)))
        parts = [f"{p}@{'+'.join(d)}" for p, d in zip(self.placements, dims)]
        stage = "" if self.pp_stage is None else f" pp={self.pp_stage}"
        return (", ".join(parts) or "R") + stage


@dataclass(frozen=True)
class Rule:
    """One plan rule: parameters whose FQN fully matches ``pattern`` get these placements.

    ``tp``: placement over ``tp``; ``fsdp_dim``: tensor dim FSDP shards (None: not sharded by FSDP);
    ``tp_divisible``: refuse a TP split that is not even (attention heads must divide by tp);
    ``experts``: a grouped-experts tensor ``[num_experts, ...]`` placed as torchtitan 0.3.0 places
    routed experts (:func:`compose_experts`; ``tp`` is then its placement when ep is off).
    """

    name: str
    pattern: str
    tp: Placement = Replicate()
    fsdp_dim: int | None = 0
    tp_divisible: bool = False
    experts: bool = False

    def matches(self, fqn: str) -> bool:
        return re.fullmatch(self.pattern, fqn, re.DOTALL) is not None  # "." also matches a newline in a key


@dataclass(frozen=True)
class SourceSplits:
    """What the source layout shows per parameter FQN: the tensor dim TP split (None: not split)
    and, optionally, the dim FSDP split (missing: 0)."""

    tp_dim: Mapping[str, int | None]
    fsdp_dim: Mapping[str, int | None] = field(default_factory=dict)


class PlacementPlan(Protocol):
    """What every plan provides."""

    name: str

    def place(self, param_fqn: str, shape: Shape, mesh: Mesh) -> TensorPlacement:
        """The placement of one parameter (``pp_stage`` is filled in by :func:`plan_all`)."""
        ...

    def assign_stages(self, fqns: Sequence[str], pp: int) -> tuple[dict[str, int | None], list[str]]:
        """The ``pp`` coordinate holding each FQN, and warnings."""
        ...

    def unused_rule_warnings(self, used: set[str]) -> list[str]:
        """Warnings for rules that matched no tensor (``used``: the rule names that did)."""
        ...


# ---------------------------------------------------------------- pipeline split (torchtitan's)


@dataclass(frozen=True)
class PipelineSplit:
    """How layers go to pipeline stages, as torchtitan's ``generate_llm_fqn_per_model_part``:
    the ``first`` modules count as ``first_stage_less_layers`` layers on stage 0, the ``last``
    modules as ``last_stage_less_layers`` on the last stage; the layers ``<layers_prefix>.<i>`` are
    spread evenly in order, earlier stages taking the extra ones. ``module_fqns_per_model_part``
    lists the modules of every stage explicitly instead. Stage ``s`` runs on pp rank ``s % pp``
    (``style="loop"``) or in V pairs (``style="v"``, two stages per rank)."""

    layers_prefix: str = "layers"
    first: tuple[str, ...] = ("tok_embeddings",)
    last: tuple[str, ...] = ("norm", "output", "lm_head")
    first_stage_less_layers: int = 1
    last_stage_less_layers: int = 1
    stages_per_rank: int = 1
    style: str = "loop"
    module_fqns_per_model_part: tuple[tuple[str, ...], ...] | None = None

    def num_layers(self, fqns: Iterable[str]) -> int:
        """Number of layers ``<prefix>.<i>`` among ``fqns`` (PlanError when indices have gaps)."""
        pat = re.compile(re.escape(self.layers_prefix) + r"\.(\d+)(?:\.|$)")
        found = {int(m.group(1)) for f in fqns if (m := pat.match(f))}
        if found and found != set(range(len(found))):
            missing = sorted(set(range(max(found) + 1)) - found)[:3]
            raise PlanError(
                f"pipeline split: {self.layers_prefix}.N has gaps (missing {missing}); give the stages explicitly in a plan file"
            )
        return len(found)

    def modules_per_stage(self, num_layers: int, pp: int) -> list[list[str]]:
        """Module FQNs of each (virtual) stage."""
        if self.module_fqns_per_model_part is not None:
            parts = [list(p) for p in self.module_fqns_per_model_part]
            if len(parts) % pp:
                raise PlanError(f"pipeline split: {len(parts)} model parts cannot go evenly to pp{pp}; give a multiple of {pp}")
            return parts
        return generate_fqn_per_model_part(
            pp * self.stages_per_rank,
            num_layers,
            self.first_stage_less_layers,
            self.last_stage_less_layers,
            self.layers_prefix,
            self.first,
            self.last,
        )

    def stage_ranks(self, num_stages: int, pp: int) -> list[int]:
        """The pp rank of each stage (torchtitan's ``pipeline_module_split``)."""
        if self.style == "v":
            if num_stages != 2 * pp:
                raise PlanError(f"pipeline split: V schedules need 2 stages per rank, got {num_stages} stages for pp{pp}")
            ranks = [0] * num_stages
            for r in range(pp):
                ranks[r], ranks[num_stages - 1 - r] = r, r
            return ranks
        return [s % pp for s in range(num_stages)]

    def assign(self, fqns: Sequence[str], pp: int) -> tuple[dict[str, int | None], list[str]]:
        """The pp coordinate holding each FQN; FQNs in no stage get None, with a warning."""
        stages = self.modules_per_stage(self.num_layers(fqns), pp)
        ranks = self.stage_ranks(len(stages), pp)
        owner = {m: ranks[s] for s, mods in enumerate(stages) for m in mods}
        out = {f: module_owner(f, owner) for f in fqns}
        lost = [f for f, r in out.items() if r is None]
        warnings = []
        if lost:
            warnings.append(
                f"pipeline split: {len(lost)} tensors belong to no stage ({_names(lost)}); they are written for every stage"
            )
        return out, warnings


def module_owner(fqn: str, owner: Mapping[str, int]) -> int | None:
    """The value of the longest dotted prefix of ``fqn`` in ``owner`` (a module's pipeline stage)."""
    parts = fqn.split(".")
    for i in range(len(parts), 0, -1):
        hit = owner.get(".".join(parts[:i]))
        if hit is not None:
            return hit
    return None


def generate_fqn_per_model_part(
    num_stages: int,
    num_layers: int,
    input_weight: int = 1,
    output_weight: int = 1,
    layers_prefix: str = "layers",
    first: Sequence[str] = ("tok_embeddings",),
    last: Sequence[str] = ("norm", "output"),
) -> list[list[str]]:
    """torchtitan's ``generate_llm_fqn_per_model_part`` with configurable module names."""
    if num_stages < 1:
        raise PlanError("pipeline split: the number of stages must be at least 1")
    layers = [f"{layers_prefix}.{i}" for i in range(num_layers)]
    if num_stages == 1:
        return [list(first) + layers + list(last)]
    effective = num_layers + input_weight + output_weight
    per_stage, extra = divmod(effective, num_stages)
    if num_stages > effective or per_stage == 0:
        raise PlanError(
            f"pipeline split: {num_stages} stages for {num_layers} layers (+{input_weight}+{output_weight}) leaves empty stages; use a smaller pp"
        )
    if input_weight > per_stage or output_weight > per_stage:
        raise PlanError(
            f"pipeline split: first/last stage weights ({input_weight}/{output_weight}) exceed {per_stage} layers per stage; lower them or pp"
        )
    out, nxt = [], 0
    for s in range(num_stages):
        count = per_stage + (1 if s < extra else 0)
        count -= input_weight if s == 0 else output_weight if s == num_stages - 1 else 0
        take = layers[nxt : nxt + max(count, 0)]
        nxt += len(take)
        out.append((list(first) if s == 0 else []) + take + (list(last) if s == num_stages - 1 else []))
    return out


# ---------------------------------------------------------------- composing placements


def _norm_dim(dim: int, ndim: int, fqn: str, what: str) -> int:
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < ndim:
        raise PlanError(f"{fqn}: {what} shards dim {dim}, but the tensor has {ndim} dims; fix the plan rule for this key")
    return d


def _check_fsdp(fqn: str, shape: Shape, fsdp_dim: int, tp: Placement, tp_size: int, fsdp_size: int) -> None:
    n = shape[fsdp_dim]
    split_by_tp = isinstance(tp, Shard) and tp.dim == fsdp_dim and tp_size > 1
    if fsdp_dim > 0 and fsdp_size > 1:
        sizes = [chunk_span(n, tp_size, t)[1] for t in range(tp_size)] if split_by_tp else [n]
        if any(s % fsdp_size for s in sizes):
            raise PlanError(
                f"{fqn}: FSDP cannot shard dim {fsdp_dim} (local size {sizes}) evenly over {fsdp_size} ranks; "
                "fully_shard refuses uneven shards on dims other than 0: shard dim 0 instead"
            )
    if split_by_tp and fsdp_size > 1 and fsdp_tp_mismatch(n, fsdp_size, tp_size):
        raise PlanError(
            f"{fqn}: dim {fsdp_dim} of size {n} split tp{tp_size} x fsdp{fsdp_size} is a layout torch saves under wrong boxes "
            "(uneven _StridedShard); change the degrees or replicate this tensor over tp in a plan file"
        )


def compose(fqn: str, shape: Shape, mesh: Mesh, rule: Rule) -> TensorPlacement:
    """The placement ``rule`` gives ``fqn`` on ``mesh``, built as FSDP2 x TP builds it."""
    if rule.experts and shape:
        return compose_experts(fqn, shape, mesh, rule)
    dims = []
    if "dp_replicate" in mesh.names:
        dims.append((("dp_replicate",), Replicate()))
    fsdp_group = tuple(n for n in _FSDP_DIMS if n in mesh.names)
    tp_size, fsdp_size = mesh.size("tp"), mesh.size("dp_shard") * mesh.size("cp")
    if not shape:  # 0-d: always replicated
        dims += [(fsdp_group, Replicate())] if fsdp_group else []
        dims += [(("tp",), Replicate())] if "tp" in mesh.names else []
        return _placement(dims, rule.name)
    tp = rule.tp
    if not isinstance(tp, Replicate):
        tp = Shard(_norm_dim(tp.dim, len(shape), fqn, "tp"))
        if rule.tp_divisible and shape[tp.dim] % tp_size:
            raise PlanError(
                f"{fqn}: dim {tp.dim} of size {shape[tp.dim]} is not divisible by tp{tp_size} "
                f"(rule {rule.name!r}: heads must split evenly); pick a tp that divides it"
            )
    fsdp_pl: Placement = Replicate()
    if rule.fsdp_dim is not None:
        fsdp_dim = _norm_dim(rule.fsdp_dim, len(shape), fqn, "FSDP")
        if fsdp_group:
            _check_fsdp(fqn, shape, fsdp_dim, tp, tp_size, fsdp_size)
        fsdp_pl, tp = compose_fsdp_tp(fsdp_dim, tp, tp_size)
    dims += [(fsdp_group, fsdp_pl)] if fsdp_group else []
    dims += [(("tp",), tp)] if "tp" in mesh.names else []
    return _placement(dims, rule.name)


def compose_experts(fqn: str, shape: Shape, mesh: Mesh, rule: Rule) -> TensorPlacement:
    """torchtitan 0.3.0's placement of a grouped-experts tensor ``[num_experts, ...]``
    (``apply_fsdp_to_decoder`` and ``moe_sharding``), optimizer states included.

    With ep > 1 it lives on the sparse mesh ``(dp_replicate, efsdp, ep)``: ``Shard(0)`` over ``ep``,
    FSDP over ``efsdp`` on dim 0 (``_StridedShard(0, ep)``), or on dim 1 when ``efsdp * ep`` (=
    ``dp_shard * cp * tp``) exceeds the expert count; never split over ``tp``. Without ep it lives
    on the dense mesh: ``rule.tp`` over ``tp`` (``Shard(1)`` for w1/w3, ``Shard(2)`` for w2) and
    FSDP on dim 0, or dim 1 when the FSDP mesh (``dp_replicate * dp_shard * cp``: torchtitan
    compares the whole data-parallel mesh) holds more ranks than experts.
    """
    experts = shape[0]
    if mesh.ep > 1:
        if experts % mesh.ep:
            raise PlanError(
                f"{fqn}: {experts} experts do not divide by ep{mesh.ep}; torchtitan 0.3.0's token dispatcher splits the "
                "experts into ep equal groups (num_tokens_per_expert.view(ep, -1)) and cannot run it: pick an ep that "
                "divides the expert count"
            )
        fsdp_dim = 1 if mesh.ep_block_size > experts else 0
        if len(shape) < 2 and fsdp_dim == 1:
            fsdp_dim = 0
        efsdp = mesh.size("efsdp")
        if fsdp_dim and efsdp > 1 and shape[1] % efsdp:
            raise PlanError(
                f"{fqn}: FSDP shards dim 1 (size {shape[1]}) over efsdp{efsdp} (more ranks than {experts} experts), "
                "but fully_shard refuses uneven shards on dims other than 0: change the degrees"
            )
        fsdp_pl = StridedShard(0, mesh.ep) if fsdp_dim == 0 else Shard(1)
        dims = [(("dp_replicate",), Replicate())] if "dp_replicate" in mesh.names else []
        dims += [(("efsdp",), fsdp_pl), (("ep",), Shard(0))]
        return _placement(dims, rule.name)
    dp_total = mesh.size("dp_replicate") * mesh.size("dp_shard") * mesh.size("cp")
    fsdp_dim = 1 if dp_total > experts and len(shape) > 1 else 0
    return compose(fqn, shape, mesh, replace(rule, experts=False, fsdp_dim=fsdp_dim))


def _placement(dims: list[tuple[tuple[str, ...], Placement]], rule: str | None) -> TensorPlacement:
    return TensorPlacement(tuple(p for _, p in dims), None, tuple(g for g, _ in dims), rule)


def replicated(mesh: Mesh) -> TensorPlacement:
    """Replicated on every mesh dim (written once), decided by no rule."""
    return replace(compose("", (), mesh, Rule("", ".*")), rule=None)


# ---------------------------------------------------------------- plans


@dataclass(frozen=True)
class RulePlan:
    """Ordered rules (first full match wins) and a pipeline split."""

    name: str
    rules: tuple[Rule, ...]
    pipeline: PipelineSplit = PipelineSplit()
    warn_unused: bool = False

    def place(self, param_fqn: str, shape: Shape, mesh: Mesh) -> TensorPlacement:
        for rule in self.rules:
            if rule.matches(param_fqn):
                return compose(param_fqn, tuple(shape), mesh, rule)
        return replicated(mesh)

    def assign_stages(self, fqns: Sequence[str], pp: int) -> tuple[dict[str, int | None], list[str]]:
        return self.pipeline.assign(fqns, pp)

    def unused_rule_warnings(self, used: set[str]) -> list[str]:
        if not self.warn_unused:
            return []
        return [
            f"plan {self.name}: rule {r.name!r} matched no tensor; check its pattern {r.pattern!r}"
            for r in self.rules
            if r.name not in used
        ]


@dataclass(frozen=True)
class SourcePlan:
    """Keep the source's TP split dim per tensor, FSDP on top; tensors it does not know replicate.
    A grouped-experts tensor (3-D or more, a name with ``experts``) is placed as routed experts
    (:func:`compose_experts`: EP when the target mesh has ep, else the source's TP dim).

    ``fallback`` (``--plan auto``): the plan that places the tensors the source shows no TP split
    for (not split, or unknown), where one of its rules matches them."""

    splits: SourceSplits
    pipeline: PipelineSplit = PipelineSplit()
    name: str = "source"
    fallback: PlacementPlan | None = None

    def place(self, param_fqn: str, shape: Shape, mesh: Mesh) -> TensorPlacement:
        tp_dim = self.splits.tp_dim.get(param_fqn)
        if tp_dim is None and self.fallback is not None:
            placed = self.fallback.place(param_fqn, shape, mesh)
            if placed.rule is not None:
                return placed
        if param_fqn not in self.splits.tp_dim:
            return replicated(mesh)
        tp = Replicate() if tp_dim is None else Shard(tp_dim)
        experts = len(shape) >= 3 and "experts" in param_fqn
        rule = Rule("source", re.escape(param_fqn), tp, self.splits.fsdp_dim.get(param_fqn, 0), experts=experts)
        return compose(param_fqn, tuple(shape), mesh, rule)

    def assign_stages(self, fqns: Sequence[str], pp: int) -> tuple[dict[str, int | None], list[str]]:
        return self.pipeline.assign(fqns, pp)

    def unused_rule_warnings(self, used: set[str]) -> list[str]:
        return []


_L = r"layers\.\d+\."
_V = r"vision_encoder\.layers\.\d+\."  # torchtitan 0.3.0's vision encoder blocks
_HF = r"model\.layers\.\d+\."  # Hugging Face decoder layers
FSDP_PLAN = RulePlan("fsdp", (Rule("fsdp", r".*"),))
LLAMA_PLAN = RulePlan(
    "llama",
    (
        Rule("tok_embeddings", r"tok_embeddings\.weight", Shard(0)),  # RowwiseParallel on nn.Embedding
        Rule("attention.wq/wk/wv", _L + r"attention\.w[qkv]\.(weight|bias)", Shard(0), tp_divisible=True),
        # torchtitan 0.3.0: FusedQKVLinear's one colwise parameter (rows grouped per KV head, so a TP
        # split that divides the KV heads keeps whole groups) ...
        Rule("attention.qkv_linear.wqkv", _L + r"attention\.qkv_linear\.wqkv\.(weight|bias)", Shard(0), tp_divisible=True),
        # ... or QKVLinear's three (fuse_qkv=False). With the fused module, the model's save hook
        # writes wq/wk/wv gathered whole; a sharded source shows that and they stay whole.
        Rule("attention.qkv_linear.wq/wk/wv", _L + r"attention\.qkv_linear\.w[qkv]\.(weight|bias)", Shard(0),
             tp_divisible=True),
        Rule("attention.wo", _L + r"attention\.wo\.weight", Shard(1), tp_divisible=True),
        Rule("attention.wo.bias", _L + r"attention\.wo\.bias", Replicate()),
        Rule("feed_forward.w1/w3", _L + r"feed_forward\.w[13]\.(weight|bias)", Shard(0)),
        Rule("feed_forward.w2", _L + r"feed_forward\.w2\.weight", Shard(1)),
        Rule("feed_forward.w2.bias", _L + r"feed_forward\.w2\.bias", Replicate()),
        Rule("norms", r"(" + _L + r"(attention_norm|ffn_norm|post_attention_norm|post_ffn_norm)|norm)\.(weight|bias)",
             Replicate()),  # (muse_glimmer's post-attention / post-FFN norms too)
        Rule("output", r"(output|lm_head)\.(weight|bias)", Shard(0)),  # ColwiseParallel (lm_head: 0.3.0)
        # torchtitan 0.3.0's muse_glimmer (models/muse_glimmer/sharding.py): the embedding inside its
        # EmbeddingWithNorm, vocab-parallel as tok_embeddings; the attention output gate colwise
        Rule("tok_embeddings.embedding (muse_glimmer)", r"tok_embeddings\.embedding\.weight", Shard(0)),
        Rule("attention.o_gate (muse_glimmer)", _L + r"attention\.o_gate\.(weight|bias)", Shard(0)),
        # torchtitan 0.3.0's vision encoders (kimi_k2_7's MoonViT3d, muse_glimmer's;
        # models/common/vision_encoder_sharding.py): per block q/k/v and fc1 colwise, proj and fc2
        # rowwise (bias replicated), norms whole; kimi's projector colwise then rowwise; patch
        # embeddings, position tables, final norms and muse's adapter and projection whole over tp
        Rule("vision attn.wq/wk/wv", _V + r"attn\.w[qkv]\.(weight|bias)", Shard(0), tp_divisible=True),
        Rule("vision attn.proj", _V + r"attn\.proj\.weight", Shard(1), tp_divisible=True),
        Rule("vision mlp.linear_fc1", _V + r"mlp\.linear_fc1\.(weight|bias)", Shard(0)),
        Rule("vision mlp.linear_fc2", _V + r"mlp\.linear_fc2\.weight", Shard(1)),
        Rule("vision row biases, norms", _V + r"(attn\.proj\.bias|mlp\.linear_fc2\.bias|norm[12]\.(weight|bias))",
             Replicate()),
        Rule("vision projector.linear_1 (kimi)", r"vision_encoder\.projector\.linear_1\.(weight|bias)", Shard(0)),
        Rule("vision projector.linear_2 (kimi)", r"vision_encoder\.projector\.linear_2\.weight", Shard(1)),
        Rule("vision whole over tp", r"vision_encoder\.(pos_embed|positional_embedding_vlm|projector\.linear_2\.bias|"
             r"(patch_embed|conv1_linear|final_norm|projector\.pre_norm|ln_pre|ln_post)\.(weight|bias))"
             r"|vision_projection\.(weight|bias)|vision_adapter\.(c_fc|c_proj)\.(weight|bias)", Replicate()),
        # Hugging Face Llama names (an FSDP2 job on transformers' LlamaForCausalLM; its tp_plan is
        # torchtitan's: q/k/v and gate/up colwise, o/down rowwise, the embedding rowwise)
        Rule("embed_tokens (HF)", r"model\.embed_tokens\.weight", Shard(0)),
        Rule("self_attn.q/k/v_proj (HF)", _HF + r"self_attn\.[qkv]_proj\.(weight|bias)", Shard(0), tp_divisible=True),
        Rule("self_attn.o_proj (HF)", _HF + r"self_attn\.o_proj\.weight", Shard(1), tp_divisible=True),
        Rule("self_attn.o_proj.bias (HF)", _HF + r"self_attn\.o_proj\.bias", Replicate()),
        Rule("mlp.gate/up_proj (HF)", _HF + r"mlp\.(gate|up)_proj\.(weight|bias)", Shard(0)),
        Rule("mlp.down_proj (HF)", _HF + r"mlp\.down_proj\.weight", Shard(1)),
        Rule("mlp.down_proj.bias (HF)", _HF + r"mlp\.down_proj\.bias", Replicate()),
        Rule("norms (HF)", r"(" + _HF + r"(input_layernorm|post_attention_layernorm)|model\.norm)\.(weight|bias)",
             Replicate()),
    ),
)


#: torchtitan's MoE decoders (0.3.0 and 0.2.x names; deepseek_v3, qwen3 MoE, gpt_oss) on top of the Llama rules: MLA
#: attention (low-rank projections and their norms replicated over tp, up-projections colwise), q/k
#: norms, the router gate (replicated over tp), shared experts (a colwise/rowwise FFN) and the routed
#: grouped experts ``[num_experts, ...]`` (:func:`compose_experts`: EP on dim 0, efsdp, or TP on the
#: hidden dim without EP). ``expert_bias_E`` (a load-balancing buffer) stays whole.
MOE_PLAN = RulePlan(
    "moe",
    LLAMA_PLAN.rules + (
        Rule("attention.wq/wq_b/wkv_b (MLA)", _L + r"attention\.(wq_b|wkv_b)\.(weight|bias)", Shard(0), tp_divisible=True),
        Rule("attention low-rank (MLA)", _L + r"attention\.(wq_a|wkv_a)\.(weight|bias)", Replicate()),
        Rule("attention norms", _L + r"attention\.(q_norm|k_norm|kv_norm)\.(weight|bias)", Replicate()),
        Rule("moe.router.gate", _L + r"moe\.router\.gate\.(weight|bias)", Replicate()),
        Rule("moe.shared_experts.w1/w3", _L + r"moe\.shared_experts\.w[13]\.(weight|bias)", Shard(0)),
        Rule("moe.shared_experts.w2", _L + r"moe\.shared_experts\.w2\.weight", Shard(1)),
        Rule("moe.shared_experts.w2.bias", _L + r"moe\.shared_experts\.w2\.bias", Replicate()),
        Rule("moe experts w1/w3", _L + r"moe\.routed_experts\.inner_experts\.w[13]_EFD", Shard(1), experts=True),
        Rule("moe experts w2", _L + r"moe\.routed_experts\.inner_experts\.w2_EDF", Shard(2), experts=True),
        Rule("moe.expert_bias", _L + r"moe\.expert_bias_E", Replicate(), fsdp_dim=None),
        # gpt_oss (models/gpt_oss/sharding.py): attention sinks, one per head, split over tp with the
        # heads; GptOssGroupedExperts' fused mlp1 (gate and up, colwise) and mlp2 (rowwise), with
        # biases (_GPT_OSS_EXPERTS_PARAM_LAYOUT: mlp1 S(1), mlp2 S(2), mlp2_bias replicated over tp)
        Rule("attention.sinks (gpt_oss)", _L + r"attention\.sinks", Shard(0), tp_divisible=True),
        Rule("moe experts mlp1 (gpt_oss)", _L + r"moe\.routed_experts\.inner_experts\.mlp1_(weight_EGD|bias_EG)", Shard(1),
             experts=True),
        Rule("moe experts mlp2 (gpt_oss)", _L + r"moe\.routed_experts\.inner_experts\.mlp2_weight_EDF", Shard(2),
             experts=True),
        Rule("moe experts mlp2 bias (gpt_oss)", _L + r"moe\.routed_experts\.inner_experts\.mlp2_bias_ED", Replicate(),
             experts=True),
        # torchtitan 0.2.x's names for the same tensors (GroupedExperts w1/w3 [E, hidden, dim], w2 [E,
        # dim, hidden]; TensorParallel Shard(1)/Shard(2) without EP; the expert_bias buffer)
        Rule("moe experts w1/w3 (0.2.x)", _L + r"moe\.experts\.w[13]", Shard(1), experts=True),
        Rule("moe experts w2 (0.2.x)", _L + r"moe\.experts\.w2", Shard(2), experts=True),
        Rule("moe.expert_bias (0.2.x)", _L + r"moe\.expert_bias", Replicate(), fsdp_dim=None),
    ),
)


def plan_all(
    params: Mapping[str, Shape], plan: PlacementPlan, mesh: Mesh
) -> tuple[dict[str, TensorPlacement], list[str]]:
    """Place every parameter, assign PP stages, and collect warnings (never printed here)."""
    out = {fqn: plan.place(fqn, tuple(shape), mesh) for fqn, shape in params.items()}
    warnings: list[str] = []
    fallback = [f for f, p in out.items() if p.rule is None]
    if fallback:
        warnings.append(f"plan {plan.name}: {len(fallback)} tensors matched no rule and are replicated ({_names(fallback)})")
    warnings += plan.unused_rule_warnings({p.rule for p in out.values() if p.rule is not None})
    pp = mesh.size("pp")
    if pp > 1:
        stages, stage_warnings = plan.assign_stages(list(out), pp)
        warnings += stage_warnings
        out = {f: replace(p, pp_stage=stages[f]) for f, p in out.items()}
    return out, warnings


def _names(fqns: Sequence[str]) -> str:
    more = f", ... {len(fqns) - _MAX_NAMES} more" if len(fqns) > _MAX_NAMES else ""
    return ", ".join(f if f.isprintable() else repr(f) for f in fqns[:_MAX_NAMES]) + more  # one line


# ---------------------------------------------------------------- plan files


def _read_plan_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"plan file {path} does not exist; give a JSON or YAML plan file or a built-in plan name")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"plan file {path} is YAML but pyyaml is not installed; pip install pyyaml or write JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"plan file {path}: not valid YAML ({str(e).splitlines()[0]}); fix the syntax") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"plan file {path}: not valid JSON ({e}); fix the syntax") from None


def validate_plan_doc(doc: Any, where: str = "plan") -> None:
    """Check a plan document against ``schemas/plan.schema.json`` (ConfigError on the first error)."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        at = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ConfigError(f"{where}: at {at}: {e.message}; see schemas/plan.schema.json")


def _rule_from_doc(i: int, doc: Mapping[str, Any], where: str) -> Rule:
    name = doc.get("name") or f"#{i} {doc['match']}"
    try:
        re.compile(doc["match"])
    except re.error as e:
        raise ConfigError(f"{where}: rule {name!r}: bad regex {doc['match']!r} ({e}); fix the pattern") from None
    tp = parse_placement(doc.get("tp", "replicate"))
    fsdp = parse_placement(doc.get("dp_shard", "shard(0)"))
    if isinstance(tp, StridedShard) or isinstance(fsdp, StridedShard):
        raise ConfigError(f"{where}: rule {name!r}: write shard(N); _StridedShard is derived automatically")
    fsdp_dim = None if isinstance(fsdp, Replicate) else fsdp.dim
    return Rule(name, doc["match"], tp, fsdp_dim, bool(doc.get("tp_divisible", False)), bool(doc.get("experts", False)))


def _pipeline_from_doc(doc: Mapping[str, Any]) -> PipelineSplit:
    parts = doc.get("module_fqns_per_model_part")
    return PipelineSplit(
        layers_prefix=doc.get("layers_prefix", "layers"),
        first=tuple(doc.get("first", ("tok_embeddings",))),
        last=tuple(doc.get("last", ("norm", "output", "lm_head"))),
        first_stage_less_layers=doc.get("first_stage_less_layers", 1),
        last_stage_less_layers=doc.get("last_stage_less_layers", 1),
        stages_per_rank=doc.get("stages_per_rank", 1),
        style=doc.get("style", "loop"),
        module_fqns_per_model_part=None if parts is None else tuple(tuple(p) for p in parts),
    )


def plan_from_doc(doc: Any, name: str = "plan") -> RulePlan:
    """A :class:`RulePlan` from a parsed plan document (validated against the schema)."""
    validate_plan_doc(doc, name)
    rules = tuple(_rule_from_doc(i, r, name) for i, r in enumerate(doc["rules"]))
    names = [r.name for r in rules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{name}: rule name {dup[0]!r} is used twice; give each rule its own name")
    return RulePlan(name, rules, _pipeline_from_doc(doc.get("pp", {})), warn_unused=True)


def load_plan_file(path: str | Path) -> RulePlan:
    """Read, validate and compile a plan file (JSON, or YAML with pyyaml)."""
    path = Path(path)
    return plan_from_doc(_read_plan_file(path), f"plan file {path}")


# ---------------------------------------------------------------------------------------------
# attention head counts: a TP split must keep whole heads


@dataclass(frozen=True)
class HeadCounts:
    """Attention (query) and KV head counts of the model, and where they came from."""

    heads: int
    kv_heads: int
    source: str


#: Attention projections by FQN -> which head counts their TP split divides (q/o: query heads,
#: k/v: KV heads, fused qkv: both); torchtitan and HF names.
_HEAD_PARAMS = re.compile(r"(?:^|\.)(?:attention|self_attn)\.(?:qkv_linear\.)?"
                          r"(?P<p>wqkv|wq|wk|wv|wo|q_proj|k_proj|v_proj|o_proj)\.(?:weight|bias)$")
_HEAD_KIND = {"wq": ("heads",), "q_proj": ("heads",), "wo": ("heads",), "o_proj": ("heads",),
              "wk": ("kv_heads",), "k_proj": ("kv_heads",), "wv": ("kv_heads",), "v_proj": ("kv_heads",),
              "wqkv": ("heads", "kv_heads")}


def head_counts(config: Mapping[str, Any] | None, where: str) -> HeadCounts | None:
    """Head counts from a model config (HF ``num_attention_heads`` / ``num_key_value_heads`` or
    torchtitan ``n_heads`` / ``n_kv_heads``; KV heads default to the heads); None when absent."""
    if not config:
        return None
    heads = config.get("num_attention_heads", config.get("n_heads"))
    kv = config.get("num_key_value_heads", config.get("n_kv_heads")) or heads
    if heads is None:
        return None
    for name, v in (("attention heads", heads), ("KV heads", kv)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{where}: {name} must be a positive integer (got {v!r})")
    return HeadCounts(heads, kv, where)


def _tp_placement(p: TensorPlacement, mesh: Mesh) -> Placement | None:
    groups = p.dims if p.dims is not None else tuple((n,) for n in mesh.names if n != "pp")
    return next((pl for pl, g in zip(p.placements, groups) if "tp" in g), None)


def check_head_split(placements: Mapping[str, TensorPlacement], mesh: Mesh, heads: HeadCounts | None) -> None:
    """Refuse a TP degree that does not divide the head counts of a TP-split attention projection
    (the job could not run it: each rank must hold whole heads)."""
    tp = mesh.size("tp")
    if heads is None or tp <= 1:
        return
    for fqn, p in placements.items():
        m = _HEAD_PARAMS.search(fqn)
        if m is None or isinstance(_tp_placement(p, mesh), (Replicate, type(None))):
            continue
        for kind in _HEAD_KIND[m.group("p")]:
            n = getattr(heads, kind)
            if n % tp:
                label = "attention heads" if kind == "heads" else "KV heads"
                raise PlanError(
                    f"{fqn}: its {n} {label} are not divisible by tp{tp} (rule {p.rule!r}: heads must split "
                    f"evenly; head counts from {heads.source}); pick a tp that divides it"
                )
