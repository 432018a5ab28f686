"""``--plan auto`` (the default): the plan a checkpoint calls for, from its index alone (pure).

The choice, in order:

1. **Megatron-core names** (``decoder.layers.*`` layer-stacked tensors, ``embedding.word_embeddings``,
   ``output_layer``: :func:`converter.plan.atoms.is_megatron`): Megatron's own TP plan
   (:mod:`converter.plan.megatron_plan`), whatever the source's layout. (Before this pure choice,
   ``from-universal`` tries megatron-core's own plan, :mod:`converter.plan.megatron_code`, where the
   checkpoint's training args build megatron's model; this is the fallback.)
2. **The source's own TP layout**, where the chunk boxes show one (any parameter split by TP): each
   parameter keeps the dim TP split it on (:class:`~converter.plan.placement_rules.SourcePlan`), and
   the model family's rules (3.) place the tensors the source shows no TP split for (norms, the
   router, grouped experts, whose EP layout does not tell their TP dim).
3. **The model family from its names**: torchtitan's MoE decoders (0.3.0's
   ``moe.routed_experts.inner_experts.w1_EFD`` and gpt_oss's ``mlp1_weight_EGD``, 0.2.x's
   ``moe.experts.w1``; DeepSeek-V3, Qwen3-MoE, gpt_oss, Kimi, Llama 4) and its MLA / q-k-norm
   attention (DeepSeek-V3 and Qwen3 dense) -> ``moe``; torchtitan's Llama names (``tok_embeddings``,
   ``layers.N.attention.*``, ``layers.N.feed_forward.*``) and Hugging Face's
   (``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj``: an FSDP2 job on transformers'
   ``LlamaForCausalLM``) -> ``llama``.
4. ``fsdp`` otherwise.

:func:`choose_plan` returns the plan with a one-line reason (printed by the conversion and in its dry
run). :func:`unused_dim_warnings` is the warning for a mesh dim a plan (chosen or given) leaves
unused. Everything here is a pass over the parameter names: no chunk is looked at.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from converter.plan.mesh import Mesh
from converter.plan.placement_rules import (
    FSDP_PLAN,
    LLAMA_PLAN,
    MOE_PLAN,
    PlacementPlan,
    SourcePlan,
    SourceSplits,
    TensorPlacement,
)
from converter.plan.placements import Replicate
from formats.base import Shape

#: torchtitan's routed experts: 0.3.0 (``w1_EFD``..., gpt_oss's ``mlp1_weight_EGD``...) and 0.2.x
#: (``moe.experts.w1``) names.
_TITAN_EXPERTS = re.compile(r"(?:^|.*\.)layers\.\d+\.moe\.(?:routed_experts\.inner_experts\."
                            r"(?:w[123]_E[DF]{2}|mlp[12]_(?:weight|bias)_E[DFG]+)|experts\.w[123])")
#: torchtitan attention beyond Llama's: MLA projections and norms (DeepSeek-V3), q/k norms (Qwen3).
_TITAN_ATTENTION_EXTRA = re.compile(r"(?:^|.*\.)layers\.\d+\.attention\.(?:wq_[ab]|wkv_[ab]|q_norm|k_norm|kv_norm)\.weight")
#: torchtitan's Llama decoder (0.3.0's fused ``qkv_linear.wqkv`` and older ``wq``/``wk``/``wv``).
_TITAN_DENSE = re.compile(r"(?:^|.*\.)layers\.\d+\.(?:attention\.(?:qkv_linear\.)?w(?:qkv|[qkvo])|feed_forward\.w[123])\.weight")
#: Hugging Face's Llama decoder (``LlamaForCausalLM``: an FSDP2 job on transformers' models).
_HF_DENSE = re.compile(r"model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight")


@dataclass(frozen=True)
class Family:
    """A model family known from parameter names: the plan for it and what showed it."""

    plan: str  # a built-in plan name
    label: str  # e.g. "torchtitan MoE names"
    example: str  # one parameter name that showed it


@dataclass(frozen=True)
class PlanChoice:
    """What ``--plan auto`` chose: the plan, its name and why (one line)."""

    plan: PlacementPlan
    name: str
    reason: str


def model_family(params: Collection[str], megatron: bool = False) -> Family | None:
    """The model family the parameter FQNs ``params`` show (None: none ckptconv knows)."""
    if megatron:
        example = next((p for p in params if p.startswith("decoder.")), next(iter(params), ""))
        return Family("megatron", "Megatron-core GPT names", example)
    dense = attention = hf = None
    for p in params:
        if _TITAN_EXPERTS.match(p):  # the strongest sign: named first
            return Family("moe", "torchtitan MoE names", p)
        if attention is None and _TITAN_ATTENTION_EXTRA.match(p):
            attention = p
        if dense is None and _TITAN_DENSE.match(p):
            dense = p
        if hf is None and _HF_DENSE.fullmatch(p):
            hf = p
    if attention is not None:
        return Family("moe", "torchtitan MLA / q-k-norm attention names", attention)
    if dense is not None:
        return Family("llama", "torchtitan Llama names", dense)
    return Family("llama", "Hugging Face Llama names", hf) if hf is not None else None


def family_plan(family: Family, params: Mapping[str, Shape]) -> PlacementPlan:
    """The built-in plan of ``family`` for ``params`` (FQN -> shape)."""
    if family.plan == "megatron":
        from converter.plan.megatron_plan import megatron_plan

        return megatron_plan(params)
    return {"moe": MOE_PLAN, "llama": LLAMA_PLAN}[family.plan]


def choose_plan(params: Mapping[str, Shape], source_splits: Mapping[str, int | None], megatron: bool = False,
                source_mesh: Mapping[str, int] | None = None) -> PlanChoice:
    """The plan for a checkpoint whose parameters are ``params`` (FQN -> shape), whose source showed
    ``source_splits`` (parameter -> the dim TP split it on, None: not split by TP) and whose
    detected mesh is ``source_mesh`` (only named in the reason); see the module docstring."""
    family = model_family(params, megatron)
    if family is not None and family.plan == "megatron":
        return PlanChoice(family_plan(family, params), "megatron",
                          f"{family.label} ({family.example}): Megatron's own TP plan, data parallelism replicated")
    split = sum(1 for p in params if source_splits.get(p) is not None)
    if split:
        seen = f" ({_mesh_text(source_mesh)})" if source_mesh else ""
        rest = (f"; {family.plan} rules ({family.label}) for the tensors it shows no TP split for" if family
                else "; the tensors it shows no TP split for replicated over tp")
        plan = SourcePlan(SourceSplits(dict(source_splits)), fallback=family_plan(family, params) if family else None,
                          name="source" + (f"+{family.plan}" if family else ""))
        return PlanChoice(plan, plan.name, f"the source's own TP layout{seen}: {split} of {len(params)} parameters "
                                           f"keep the dim TP split them on{rest}")
    if family is not None:
        return PlanChoice(family_plan(family, params), family.plan,
                          f"{family.label} ({family.example}); the source shows no TP layout")
    return PlanChoice(FSDP_PLAN, "fsdp", "the source shows no TP layout and no model family ckptconv knows from its "
                                         "names: FSDP on dim 0, replicated over tp")


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return " x ".join(f"{k}{v}" for k, v in mesh.items())


# ---------------------------------------------------------------------------------------------
# a mesh dim left unused


def _uses(placements: Mapping[str, TensorPlacement], mesh: Mesh, dim: str) -> bool:
    """Whether any placement splits a tensor over mesh dim ``dim``."""
    for p in placements.values():
        groups = p.dims if p.dims is not None else tuple((n,) for n in mesh.names if n != "pp")
        if any(dim in g and not isinstance(pl, Replicate) for pl, g in zip(p.placements, groups)):
            return True
    return False


def unused_dims(placements: Mapping[str, TensorPlacement], mesh: Mesh) -> list[str]:
    """The mesh dims ``tp`` and ``ep`` (size > 1) that no placement splits a tensor over."""
    sizes = {"tp": mesh.size("tp"), "ep": mesh.ep}
    return [d for d, n in sizes.items() if n > 1 and not _uses(placements, mesh, d)]


def unused_dim_warnings(dims: Collection[str], mesh: Mesh, plan_name: str, family: Family | None,
                        family_uses: Collection[str]) -> list[str]:
    """One warning per mesh dim in ``dims`` the plan ``plan_name`` leaves unused, naming the plan
    that would use it (``family``'s, when it splits tensors over that dim: ``family_uses``)."""
    out = []
    for d in dims:
        size = mesh.size("tp") if d == "tp" else mesh.ep
        what = "tensors" if d == "tp" else "grouped experts"
        if family is not None and family.plan != plan_name and d in family_uses:
            hint = f"--plan {family.plan} would split them ({family.label}, e.g. {family.example})"
        elif d == "ep":
            hint = "no plan ckptconv knows splits these names over ep; give a plan file with experts rules, or drop ep"
        else:
            hint = ("no plan ckptconv knows splits these names over tp; give a plan file, torchtitan:MODEL/FLAVOR or "
                    "python:MODULE:FUNCTION, or drop tp from --mesh")
        out.append(f"mesh dim {d}{size}: plan {plan_name} splits no {what} over it (every {d} rank holds them whole); "
                   f"{hint}")
    return out
