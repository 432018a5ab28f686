"""Plans read from code (``--plan torchtitan:MODEL/FLAVOR``, ``--plan python:MODULE:FUNCTION``):
the framework's own parallelize function on a meta model over a fake world of any size, in one
process. That these placements are torch's real ones is checked against torchtitan's own saves in
test_titan_trainer.py (``-m slow``) and, here, against the built-in plan that matches them."""

from __future__ import annotations

import time

import pytest

from converter.plan.from_code import is_code_plan
from converter.plan.model_placements import mesh_dim_groups
from converter.plan.placements import Replicate, Shard, StridedShard
from converter.plan.mesh import parse_mesh
from converter.plan.placement_rules import plan_all
from converter.plan.plans import get_plan
from formats.errors import ConfigError, PlanError

import titan_support

R, S0, S1 = Replicate(), Shard(0), Shard(1)
needs_titan = pytest.mark.framework("torchtitan")  # skips (fails under CI) without torchtitan


from plan_cache import private_plan_cache  # noqa: E402,F401 - autouse: this module's own plan cache


def test_is_code_plan():
    assert is_code_plan("torchtitan:llama3/debugmodel") and is_code_plan("python:m:f")
    assert not is_code_plan("llama") and not is_code_plan("plan.json")


def test_mesh_dim_groups_by_ranks():
    torch = pytest.importorskip("torch")
    mesh = parse_mesh("pp2,dp2,cp2,tp2")
    grid = torch.arange(16).view(2, 2, 2, 2)[0]  # the dense mesh of pp coordinate 0
    assert mesh_dim_groups(grid, mesh) == [("dp_shard",), ("cp",), ("tp",)]
    flat = grid.reshape(4, 2)  # torchtitan's fsdp = dp_shard x cp flattened
    assert mesh_dim_groups(flat, mesh) == [("dp_shard", "cp"), ("tp",)]
    assert mesh_dim_groups(torch.arange(16).view(1, 16), mesh) == [(), ("pp", "dp_shard", "cp", "tp")]
    with pytest.raises(PlanError, match="another order"):
        mesh_dim_groups(torch.tensor([0, 3]), mesh)


def _params():
    return {"0.weight": (32, 16), "0.bias": (32,), "2.weight": (16, 32), "2.bias": (16,), "3.weight": (16,)}


def test_python_hook_reads_fsdp_x_tp():
    mesh = parse_mesh("tp2,dp2")
    plan = get_plan("python:tests.support.titan_plan_fn:fsdp_tp_mlp", mesh=mesh)
    out, warnings = plan_all(_params(), plan, mesh)
    assert warnings == []
    assert out["0.weight"].placements == (StridedShard(0, 2), S0)  # colwise, FSDP on top
    assert out["0.weight"].dims == (("dp_shard",), ("tp",))
    assert out["2.weight"].placements == (S0, S1)  # rowwise
    assert out["2.bias"].placements == (S0, R)
    assert out["3.weight"].placements == (S0,) and out["3.weight"].dims == (("dp_shard",),)  # FSDP only
    boxes = out["0.weight"].rank_boxes((32, 16), mesh)
    assert {r: b.offsets[0] for r, b in boxes.items()} == {0: 0, 1: 16, 2: 8, 3: 24}


def test_python_hook_errors():
    mesh = parse_mesh("tp2,dp2")
    with pytest.raises(PlanError, match="always fails"):
        get_plan("python:tests.support.titan_plan_fn:not_a_model", mesh=mesh)
    with pytest.raises(PlanError, match="no function"):
        get_plan("python:tests.support.titan_plan_fn:missing", mesh=mesh)
    with pytest.raises(ConfigError, match="needs the target mesh"):
        get_plan("python:tests.support.titan_plan_fn:fsdp_tp_mlp")
    with pytest.raises(PlanError, match="shape"):
        plan_all({"0.weight": (8, 8)}, get_plan("python:tests.support.titan_plan_fn:fsdp_tp_mlp", mesh=mesh), mesh)


def _titan030(n_layers=6):
    params = {"tok_embeddings.weight": (2048, 256), "norm.weight": (256,), "lm_head.weight": (2048, 256)}
    for i in range(n_layers):
        p = f"layers.{i}."
        params |= {p + "attention.qkv_linear.wqkv.weight": (768, 256), p + "attention.wo.weight": (256, 256),
                   p + "feed_forward.w1.weight": (768, 256), p + "feed_forward.w2.weight": (256, 768),
                   p + "feed_forward.w3.weight": (768, 256), p + "attention_norm.weight": (256,),
                   p + "ffn_norm.weight": (256,)}
        params |= {p + f"attention.qkv_linear.w{x}.weight": (256, 256) for x in "qkv"}  # the save hook's
    return params


@needs_titan
@pytest.mark.parametrize("mesh", ["dp_replicate2,dp2,cp2,tp2", pytest.param("tp2,dp2", marks=pytest.mark.slow),
                                  pytest.param("dp4", marks=pytest.mark.slow), pytest.param("pp2,dp2", marks=pytest.mark.slow)])
def test_torchtitan_plan_equals_builtin_llama(mesh):
    """torchtitan's own parallelize_llama gives every parameter the placements of the built-in llama
    plan (checked against torchtitan's real saves), and the save hook's wq/wk/wv stay whole."""
    m = parse_mesh(mesh)
    params = _titan030()
    got, warnings = plan_all(params, get_plan("torchtitan:llama3/debugmodel", mesh=m), m)
    assert warnings == []
    want, _ = plan_all(params, get_plan("llama"), m)
    for fqn, shape in params.items():
        if ".qkv_linear.w" in fqn and "wqkv" not in fqn:
            assert len(got[fqn].unique_boxes(shape, m)) == 1, fqn  # gathered whole by the hook
            continue
        assert got[fqn].unique_boxes(shape, m) == want[fqn].unique_boxes(shape, m), fqn


@pytest.mark.slow  # ~12 s: runs in CI's framework step
@needs_titan
def test_torchtitan_plan_1024_ranks_one_process():
    m = parse_mesh("pp2,dp64,tp8")
    t0 = time.monotonic()
    plan = get_plan("torchtitan:llama3/debugmodel", mesh=m)
    first = time.monotonic() - t0
    out, warnings = plan_all(_titan030(), plan, m)
    assert warnings == []
    assert out["layers.0.attention.qkv_linear.wqkv.weight"].placements == (StridedShard(0, 8), S0)
    assert out["layers.0.feed_forward.w2.weight"].placements == (S0, S1)
    assert out["tok_embeddings.weight"].pp_stage == 0 and out["lm_head.weight"].pp_stage == 1
    assert out["layers.2.attention.wo.weight"].pp_stage == 0 and out["layers.3.attention.wo.weight"].pp_stage == 1
    boxes = out["lm_head.weight"].unique_boxes((2048, 256), m)
    assert len(boxes) == 512 and sum(b.numel for b, _ in boxes) == 2048 * 256
    from converter.plan import from_code as code_plans

    code_plans._load.cache_clear()
    t0 = time.monotonic()
    get_plan("torchtitan:llama3/debugmodel", mesh=m)  # from the disk cache now
    assert time.monotonic() - t0 < first


@needs_titan
def test_torchtitan_plan_errors():
    m = parse_mesh("dp2")
    with pytest.raises(PlanError, match="no flavor"):
        get_plan("torchtitan:llama3/nosuchflavor", mesh=m)
    with pytest.raises(PlanError, match="MODEL/FLAVOR"):
        get_plan("torchtitan:llama3", mesh=m)


def test_code_plan_stages_and_unknown_names():
    """PP owners come from the framework's stage split (module prefixes); a name the model does not
    have is replicated with a warning, a wrong shape is an error."""
    from converter.plan.from_code import CodePlan, plan_from_json

    mesh = parse_mesh("pp2,dp2")
    doc = {"name": "t", "table": {"layers.1.w": {"shape": [4, 2], "placements": ["S(0)"], "dims": [["dp_shard"]]}},
           "pp": {"modules": [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]], "ranks": [0, 1]}}
    plan = plan_from_json(doc, mesh)
    assert isinstance(plan, CodePlan)
    out, warnings = plan_all({"layers.1.w": (4, 2), "tok_embeddings.weight": (8, 2), "extra": (3,)}, plan, mesh)
    assert out["layers.1.w"].placements == (S0,) and out["layers.1.w"].pp_stage == 1
    assert out["tok_embeddings.weight"].pp_stage == 0 and out["tok_embeddings.weight"].rule is None
    assert any("matched no rule" in w for w in warnings) and any("no pipeline stage (extra)" in w for w in warnings)
    with pytest.raises(PlanError, match="flavor"):
        plan_all({"layers.1.w": (5, 2)}, plan, mesh)


@needs_titan
@pytest.mark.slow
@pytest.mark.parametrize("flavor,mesh", [("1B", "tp2,dp2"), ("1B", "dp_replicate2,dp2,tp4")])
def test_torchtitan_plan_other_flavor_equals_builtin_llama(flavor, mesh):
    """Another flavor (1B: GQA with 8 k/v heads of 32, weight tying), shapes from torchtitan's own meta
    model: its parallelize_llama agrees with the built-in llama plan on every parameter but the save
    hook's whole wq/wk/wv."""
    import torch

    titan_support.apply_cpu_patches()
    from torchtitan.models.llama3 import model_registry

    with torch.device("meta"):
        model = model_registry(flavor).model.build()
    params = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    m = parse_mesh(mesh)
    got, warnings = plan_all(params, get_plan(f"torchtitan:llama3/{flavor}", mesh=m), m)
    assert warnings == []
    want, _ = plan_all(params, get_plan("llama"), m)
    for fqn, shape in params.items():
        if ".qkv_linear.w" in fqn and "wqkv" not in fqn:
            assert len(got[fqn].unique_boxes(shape, m)) == 1, fqn
            continue
        assert got[fqn].unique_boxes(shape, m) == want[fqn].unique_boxes(shape, m), fqn
