"""``--plan auto`` (converter/plan/auto_plan.py) as a value: which plan each checkpoint's names and
source layout call for, the reason, the unused-mesh-dim warnings, and its cost at scale."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from converter.plan.auto_plan import choose_plan, model_family, unused_dim_warnings, unused_dims
from converter.plan.mesh import parse_mesh
from converter.plan.placement_rules import FSDP_PLAN, MOE_PLAN, SourcePlan, plan_all
from converter.plan.placements import Replicate, Shard, StridedShard

from test_plans import titan030_params
from plan_cache import private_plan_cache  # noqa: F401 - autouse: this module's own plan cache


def titan022_moe_params(layers: int = 2, experts: int = 8, dim: int = 16, hidden: int = 32) -> dict[str, tuple]:
    """torchtitan 0.2.x MoE names (its wheel's models/moe/moe.py: GroupedExperts w1/w2/w3, the
    router's gate, the expert_bias buffer, shared experts) in a Llama-style decoder."""
    params = {"tok_embeddings.weight": (64, dim), "norm.weight": (dim,), "output.weight": (64, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        params |= {p + f"attention.w{x}.weight": (dim, dim) for x in "qkvo"}
        params |= {p + "attention_norm.weight": (dim,), p + "ffn_norm.weight": (dim,),
                   p + "moe.experts.w1": (experts, hidden, dim), p + "moe.experts.w2": (experts, dim, hidden),
                   p + "moe.experts.w3": (experts, hidden, dim), p + "moe.router.gate.weight": (experts, dim),
                   p + "moe.expert_bias": (experts,), p + "moe.shared_experts.w1.weight": (hidden, dim),
                   p + "moe.shared_experts.w2.weight": (dim, hidden), p + "moe.shared_experts.w3.weight": (hidden, dim)}
    return params


def titan030_moe_params(layers: int = 2, experts: int = 8, dim: int = 16, hidden: int = 32) -> dict[str, tuple]:
    params = {k: v for k, v in titan022_moe_params(layers, experts, dim, hidden).items() if ".moe." not in k}
    for i in range(layers):
        p = f"layers.{i}.moe."
        params |= {p + "routed_experts.inner_experts.w1_EFD": (experts, hidden, dim),
                   p + "routed_experts.inner_experts.w2_EDF": (experts, dim, hidden),
                   p + "routed_experts.inner_experts.w3_EFD": (experts, hidden, dim),
                   p + "router.gate.weight": (experts, dim), p + "expert_bias_E": (experts,)}
    return params


MEGATRON = {"embedding.word_embeddings.weight": (64, 32), "output_layer.weight": (64, 32),
            "decoder.final_layernorm.weight": (32,),
            "decoder.layers.self_attention.linear_qkv.weight": (2, 64, 32),
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 32),
            "decoder.layers.self_attention.linear_proj.weight": (2, 32, 32),
            "decoder.layers.mlp.linear_fc1.weight": (2, 96, 32),
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 32),
            "decoder.layers.mlp.linear_fc2.weight": (2, 32, 48)}


def tp_placement(p, mesh):
    groups = p.dims if p.dims is not None else tuple((n,) for n in mesh.names if n != "pp")
    return next((pl for pl, g in zip(p.placements, groups) if g == ("tp",)), None)


@pytest.mark.parametrize("params,plan", [
    (titan030_params(), "llama"), (titan030_moe_params(), "moe"), (titan022_moe_params(), "moe"),
])
def test_family_from_names(params, plan):
    choice = choose_plan(params, {})
    assert choice.name == plan and "source shows no TP layout" in choice.reason
    assert "\n" not in choice.reason


def test_mla_and_qk_norm_attention_are_moe_rules():
    params = titan030_params() | {"layers.0.attention.q_norm.weight": (2,), "layers.0.attention.k_norm.weight": (2,)}
    assert choose_plan(params, {}).name == "moe"
    assert model_family({"layers.0.attention.wkv_a.weight"}).plan == "moe"


def test_unknown_names_are_fsdp():
    choice = choose_plan({"net.0.weight": (8, 4), "net.2.weight": (4, 8)}, {"net.0.weight": None})
    assert choice.plan is FSDP_PLAN and "no model family" in choice.reason


def test_a_tp_source_keeps_its_splits_and_the_family_places_the_rest():
    """The source's own TP layout wins where it shows one; the family's rules place what it shows
    no TP split for (the experts of an EP source, whose TP dim without ep is not in the boxes)."""
    params = titan030_moe_params()
    splits = {k: (0 if k.endswith("attention.wq.weight") else None) for k in params}
    splits["layers.0.attention.wo.weight"] = 1
    choice = choose_plan(params, splits, source_mesh={"dp": 2, "tp": 2})
    assert isinstance(choice.plan, SourcePlan) and choice.name == "source+moe"
    assert "(dp2 x tp2)" in choice.reason and "3 of" in choice.reason
    mesh = parse_mesh("dp2,tp2")
    placed, warnings = plan_all(params, choice.plan, mesh)
    assert placed["layers.0.attention.wq.weight"].rule == "source"
    assert tp_placement(placed["layers.0.attention.wo.weight"], mesh) == Shard(1)
    # not split by the source: torchtitan's rules (w1 over its hidden dim without ep)
    assert tp_placement(placed["layers.0.moe.routed_experts.inner_experts.w1_EFD"], mesh) == Shard(1)
    assert placed["layers.0.moe.routed_experts.inner_experts.w1_EFD"].rule == "moe experts w1/w3"
    assert isinstance(tp_placement(placed["norm.weight"], mesh), Replicate) and not warnings


def test_torchtitan_022_expert_names_are_placed_like_030s():
    """``--plan moe`` places 0.2.x's moe.experts.w1/w2/w3 as 0.3.0's w1_EFD/w2_EDF/w3_EFD (same
    shapes), on every mesh: EP, TP, TP x EP."""
    old, new = titan022_moe_params(), titan030_moe_params()
    pairs = {"moe.experts.w1": "moe.routed_experts.inner_experts.w1_EFD",
             "moe.experts.w2": "moe.routed_experts.inner_experts.w2_EDF",
             "moe.experts.w3": "moe.routed_experts.inner_experts.w3_EFD", "moe.expert_bias": "moe.expert_bias_E"}
    for spec in ("dp2,ep2", "dp4,ep4", "tp2,dp2", "dp2,tp2,ep2", "dp2,tp2,ep4"):
        mesh = parse_mesh(spec)
        a, wa = plan_all(old, MOE_PLAN, mesh)
        b, _ = plan_all(new, MOE_PLAN, mesh)
        assert not wa, (spec, wa)
        for i in range(2):
            for o, n in pairs.items():
                fo, fn = f"layers.{i}.{o}", f"layers.{i}.{n}"
                assert a[fo].unique_boxes(old[fo], mesh) == b[fn].unique_boxes(new[fn], mesh), (spec, fo)


def test_megatron_names_get_megatrons_plan():
    choice = choose_plan(MEGATRON, {k: None for k in MEGATRON}, megatron=True)
    assert choice.name == "megatron" and "Megatron-core GPT names" in choice.reason
    mesh = parse_mesh("tp2,dp2")
    placed, warnings = plan_all(MEGATRON, choice.plan, mesh)
    assert not warnings
    want = {"embedding.word_embeddings.weight": Shard(0), "output_layer.weight": Shard(0),
            "decoder.layers.self_attention.linear_qkv.weight": Shard(1),
            "decoder.layers.self_attention.linear_proj.weight": Shard(2),
            "decoder.layers.mlp.linear_fc1.weight": StridedShard(1, 2),  # [gate; up], each half over tp
            "decoder.layers.mlp.linear_fc2.weight": Shard(2), "decoder.final_layernorm.weight": Replicate()}
    for fqn, tp in want.items():
        assert tp_placement(placed[fqn], mesh) == tp, fqn
        assert all(isinstance(p, Replicate) for p, g in zip(placed[fqn].placements, placed[fqn].dims) if g != ("tp",))
    # the gated fc1: each tp rank holds two row blocks, the same on both dp replicas
    boxes = placed["decoder.layers.mlp.linear_fc1.weight"].unique_boxes((2, 96, 32), mesh)
    assert [(b.offsets, b.sizes, h) for b, h in boxes] == [
        ((0, 0, 0), (2, 24, 32), (0, 2)), ((0, 48, 0), (2, 24, 32), (0, 2)),
        ((0, 24, 0), (2, 24, 32), (1, 3)), ((0, 72, 0), (2, 24, 32), (1, 3))]


def test_unused_mesh_dims_are_warned_naming_the_plan_that_would_use_them():
    params = titan030_moe_params()
    mesh = parse_mesh("dp2,tp2,ep2")
    placed, _ = plan_all(params, FSDP_PLAN, mesh)
    dims = unused_dims(placed, mesh)
    assert dims == ["tp", "ep"]
    family = model_family(params)
    text = unused_dim_warnings(dims, mesh, "fsdp", family, ["tp", "ep"])
    assert text[0].startswith("mesh dim tp2: plan fsdp splits no tensors over it") and "--plan moe" in text[0]
    assert text[1].startswith("mesh dim ep2: plan fsdp splits no grouped experts") and "--plan moe" in text[1]
    assert unused_dims(plan_all(params, MOE_PLAN, mesh)[0], mesh) == []
    dense = {"net.0.weight": (8, 4)}
    only = unused_dim_warnings(["tp"], parse_mesh("tp2"), "fsdp", model_family(dense), [])
    assert "no plan ckptconv knows" in only[0]


def test_choice_is_cheap_at_scale():
    """A 405B-sized name set (126 layers x 9 parameters, 10x) is classified in well under a
    second: one regex pass over the names, none over chunks."""
    params = {}
    for i in range(1260):
        params |= {f"layers.{i}.attention.w{x}.weight": (16, 16) for x in "qkvo"}
        params |= {f"layers.{i}.feed_forward.w{x}.weight": (16, 16) for x in "123"}
    splits = dict.fromkeys(params)
    t = time.process_time()
    for _ in range(5):
        choice = choose_plan(params, splits)
    assert choice.name == "llama" and (time.process_time() - t) / 5 < 0.5


TITAN022_VENV = Path(os.environ.get("TITAN022_VENV", "/work/venvs/titan022"))


@pytest.fixture(scope="module")
def titan022_models(tmp_path_factory) -> dict[str, dict[str, tuple]]:
    """torchtitan 0.2.2's own deepseek_v3 / qwen3 MoE models' state_dict names and shapes (built
    on meta in its venv by tests/support/titan022_names.py)."""
    python = TITAN022_VENV / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no torchtitan 0.2.2 venv at {TITAN022_VENV} (bash .ci/install_titan022.sh)")
    out = tmp_path_factory.mktemp("titan022") / "names.json"
    script = Path(__file__).resolve().parents[1] / "support" / "titan022_names.py"
    proc = subprocess.run([str(python), str(script), str(out)], capture_output=True, text=True, timeout=300)
    if proc.returncode:
        pytest.skip(f"torchtitan 0.2.2 does not build its models here: {proc.stderr.strip().splitlines()[-1:]}")
    return {m: {k: tuple(v) for k, v in sd.items()} for m, sd in json.loads(out.read_text()).items()}


@pytest.mark.slow  # builds torchtitan 0.2.2's models in its own venv (~15 s): runs in CI's framework step
@pytest.mark.framework("torchtitan")
@pytest.mark.parametrize("model", ["deepseek_v3/debugmodel", "qwen3/debugmodel_moe"])
def test_torchtitan_022_models_are_placed_by_auto(titan022_models, model):
    """torchtitan 0.2.2's own MoE models (their modules' state_dict, not names written here): no
    --plan chooses moe from their names, every parameter matches a rule, and the grouped experts
    go on ep (Shard(0)) with ep and on the hidden dim over tp without it."""
    params = titan022_models[model]
    choice = choose_plan(params, {})
    assert choice.name == "moe" and "moe.experts." in choice.reason
    experts = [k for k in params if ".moe.experts.w" in k]
    assert experts
    for spec in ("dp2,ep2", "dp2,tp2", "dp2,tp2,ep2"):
        mesh = parse_mesh(spec)
        placed, warnings = plan_all(params, choice.plan, mesh)
        assert not warnings and not unused_dims(placed, mesh), (spec, warnings)
        for k in experts:
            p = placed[k]
            if mesh.ep > 1:
                assert dict(zip(p.dims, p.placements))[("ep",)] == Shard(0), (spec, k)
            else:
                assert tp_placement(p, mesh) == (Shard(2) if k.endswith("w2") else Shard(1)), (spec, k)


# ----------------------------------------------------------------------------- torchtitan 0.3.0's own models

#: torchtitan 0.3.0's model families (the packages of torchtitan.models): the flavors whose meta model
#: the tests below place with no --plan, whether they are MoE (then checked on EP meshes too), and
#: whether ``--plan torchtitan:MODEL/FLAVOR`` (from_code, partial_dtensor backend) can read them.
TITAN030_MODELS = {  # "MODEL/FLAVOR": (moe, from_code reads it)
    "llama3/debugmodel": (False, True),
    "qwen3/debugmodel": (False, True),
    "qwen3/debugmodel_non_fused_qkv": (False, True),
    "qwen3/debugmodel_moe": (True, True),
    "deepseek_v3/debugmodel": (True, True),
    "gpt_oss/debugmodel": (True, True),
    "kimi_k2_7/debugmodel": (True, True),  # a MoE VLM: DeepSeek-V3 decoder + MoonViT3d vision encoder
    # spmd_types backend only (its parallelize refuses partial_dtensor): no from_code oracle
    "muse_glimmer/debugmodel": (False, False),
    "muse_glimmer/debugmodel_mm": (False, False),
}
#: the packages of torchtitan.models not placed here, and why
TITAN030_NOT_PLACED = {
    "flux": "a diffusion image model (FluxModel), not a decoder LLM; no ckptconv plan is for it",
    "common": "shared modules, no model",
    "qwen3_5": "does not import here: it needs flash-linear-attention (import fla), which torchtitan 0.3.0 does not "
               "depend on and this environment does not install",
}
TITAN030_MESHES = {False: ("dp2,tp2",), True: ("dp2,tp2", "dp2,ep2", "dp2,tp2,ep2")}


def titan030_model(target: str) -> dict[str, tuple]:
    """The state_dict and parameter names and shapes of torchtitan 0.3.0's ``MODEL/FLAVOR`` built on meta."""
    import importlib

    import titan_support
    import torch

    titan_support.apply_cpu_patches()
    model, _, flavor = target.partition("/")
    with torch.device("meta"):
        module = importlib.import_module(f"torchtitan.models.{model}").model_registry(flavor).model.build()
    named = dict(module.named_parameters()) | dict(module.state_dict())
    return {k: tuple(v.shape) for k, v in named.items()}


@pytest.mark.framework("torchtitan")
def test_every_torchtitan_030_model_family_is_listed():
    """Every package of torchtitan 0.3.0's torchtitan.models is either placed by the tests below or
    listed in TITAN030_NOT_PLACED with the reason."""
    import pkgutil

    import torchtitan.models

    families = {m.name for m in pkgutil.iter_modules(torchtitan.models.__path__) if m.ispkg}
    placed = {t.partition("/")[0] for t in TITAN030_MODELS}
    assert families == placed | set(TITAN030_NOT_PLACED), families ^ (placed | set(TITAN030_NOT_PLACED))


@pytest.mark.framework("torchtitan")
@pytest.mark.parametrize("target", list(TITAN030_MODELS))
def test_torchtitan_030_models_are_placed_by_auto(target):
    """torchtitan 0.3.0's own model (its meta module's state_dict and parameter names): no --plan
    chooses a plan from the names, every tensor matches one of its rules (no warning) and no tp/ep mesh
    dim is left unused, on TP and, for MoE models, EP and TP x EP meshes."""
    moe, _ = TITAN030_MODELS[target]
    params = titan030_model(target)
    choice = choose_plan(params, {})
    assert choice.name == ("moe" if moe or target.startswith("qwen3") else "llama"), choice.reason
    for spec in TITAN030_MESHES[moe]:
        mesh = parse_mesh(spec)
        placed, warnings = plan_all(params, choice.plan, mesh)
        assert not warnings and not unused_dims(placed, mesh), (spec, warnings)


def _gathered_by_save_hook(fqn: str, table) -> bool:
    """A fused-QKV model's state_dict wq/wk/wv: its save hook writes them gathered whole from the one
    ``wqkv`` parameter (the built-in plans split them, as they would the real parameters of
    ``fuse_qkv=False``; a source that shows them whole keeps them whole)."""
    head, _, leaf = fqn.rpartition(".qkv_linear.")
    return bool(head) and leaf[:3] in ("wq.", "wk.", "wv.") and f"{head}.qkv_linear.wqkv.weight" in table


CODE_CASES = [pytest.param(t, m, marks=pytest.mark.slow)  # 15 cases, ~85 s: CI's framework step runs them
              for t, (moe, code) in TITAN030_MODELS.items() if code for m in TITAN030_MESHES[moe]]


@pytest.mark.framework("torchtitan")
@pytest.mark.parametrize("target,mesh_text", CODE_CASES)
def test_auto_places_torchtitan_030_models_as_their_own_code(target, mesh_text):
    """The oracle: no --plan gives every parameter and state_dict entry of torchtitan 0.3.0's model the
    rank boxes that torchtitan's own parallelize_fn gives it (``--plan torchtitan:MODEL/FLAVOR``: meta
    model, fake world), but for the fused-QKV save hook's wq/wk/wv (see _gathered_by_save_hook)."""
    from converter.plan.plans import get_plan

    mesh = parse_mesh(mesh_text)
    code = get_plan(f"torchtitan:{target}", mesh=mesh)
    params = titan030_model(target)
    assert set(params) <= set(code.table), sorted(set(params) - set(code.table))[:5]
    got, warnings = plan_all(params, choose_plan(params, {}).plan, mesh)
    want, _ = plan_all(params, code, mesh)
    assert not warnings
    compared = 0
    for fqn, shape in params.items():
        if _gathered_by_save_hook(fqn, code.table):
            continue
        assert got[fqn].rank_boxes(shape, mesh) == want[fqn].rank_boxes(shape, mesh), (fqn, str(got[fqn]), str(want[fqn]))
        compared += 1
    assert compared > 40
