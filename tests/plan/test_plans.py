"""Placement plans as values: built-ins on torchtitan names, PP split, plan files and their schema.

That these placements give exactly the boxes real FSDP2 / TP runs save is checked against torch in
test_layout.py; here the plans themselves are checked.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from converter.plan.placements import Replicate, Shard, StridedShard
from converter.plan.mesh import parse_mesh
from converter.plan.placement_rules import (
    SCHEMA_PATH,
    PipelineSplit,
    SourceSplits,
    TensorPlacement,
    generate_fqn_per_model_part,
    load_plan_file,
    plan_all,
    plan_from_doc,
)
from converter.plan.plans import get_plan
from formats.errors import ConfigError, PlanError

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def llama_params(n_layers=2, dim=8, hidden=12, vocab=50, kv=8) -> dict[str, tuple[int, ...]]:
    """torchtitan Llama 3 parameter FQNs and shapes."""
    params = {"tok_embeddings.weight": (vocab, dim)}
    for i in range(n_layers):
        p = f"layers.{i}."
        params |= {
            p + "attention.wq.weight": (dim, dim),
            p + "attention.wk.weight": (kv, dim),
            p + "attention.wv.weight": (kv, dim),
            p + "attention.wo.weight": (dim, dim),
            p + "feed_forward.w1.weight": (hidden, dim),
            p + "feed_forward.w2.weight": (dim, hidden),
            p + "feed_forward.w3.weight": (hidden, dim),
            p + "attention_norm.weight": (dim,),
            p + "ffn_norm.weight": (dim,),
        }
    params |= {"norm.weight": (dim,), "output.weight": (vocab, dim)}
    return params


LLAMA_2D = {  # (FSDP, TP) placements torch gives each kind of parameter under FSDP2 x TP
    "tok_embeddings.weight": (StridedShard(0, 2), S0),
    "layers.0.attention.wq.weight": (StridedShard(0, 2), S0),
    "layers.0.attention.wk.weight": (StridedShard(0, 2), S0),
    "layers.1.attention.wv.weight": (StridedShard(0, 2), S0),
    "layers.0.attention.wo.weight": (S0, S1),
    "layers.0.feed_forward.w1.weight": (StridedShard(0, 2), S0),
    "layers.1.feed_forward.w3.weight": (StridedShard(0, 2), S0),
    "layers.0.feed_forward.w2.weight": (S0, S1),
    "layers.0.attention_norm.weight": (S0, R),
    "layers.1.ffn_norm.weight": (S0, R),
    "norm.weight": (S0, R),
    "output.weight": (StridedShard(0, 2), S0),
}


def test_llama_on_fsdp_x_tp():
    mesh = parse_mesh("tp2,dp2")
    out, warnings = plan_all(llama_params(), get_plan("llama"), mesh)
    assert warnings == []
    for fqn, want in LLAMA_2D.items():
        assert out[fqn].placements == want, fqn
        assert out[fqn].dims == (("dp_shard",), ("tp",))
        assert out[fqn].pp_stage is None


def test_llama_tp_only_hsdp_and_cp():
    params = llama_params()
    tp_only, _ = plan_all(params, get_plan("llama"), parse_mesh("tp2"))
    assert tp_only["layers.0.attention.wq.weight"] == TensorPlacement((S0,), None, (("tp",),), "attention.wq/wk/wv")
    assert tp_only["layers.0.attention.wo.weight"].placements == (S1,)
    assert tp_only["tok_embeddings.weight"].placements == (S0,)
    hsdp, _ = plan_all(params, get_plan("llama"), parse_mesh("dp_replicate2,dp2,tp2"))
    assert hsdp["output.weight"].placements == (R, StridedShard(0, 2), S0)
    assert hsdp["norm.weight"].placements == (R, S0, R)
    cp, _ = plan_all(params, get_plan("llama"), parse_mesh("dp2,cp2,tp2"))
    assert cp["layers.0.feed_forward.w2.weight"].dims == (("dp_shard", "cp"), ("tp",))
    assert cp["layers.0.feed_forward.w2.weight"].placements == (S0, S1)


def test_fsdp_plan_and_zero_dim():
    mesh = parse_mesh("dp_replicate2,dp4,tp2")
    out, warnings = plan_all({"w": (10, 3), "scale": ()}, get_plan("fsdp"), mesh)
    assert out["w"].placements == (R, S0, R)
    assert out["scale"].placements == (R, R, R)
    assert warnings == []
    boxes = out["w"].unique_boxes((10, 3), mesh)
    assert [b.sizes[0] for b, _ in boxes] == [3, 3, 3, 1]
    assert boxes[0][1] == (0, 1, 8, 9)  # both replicas and both tp ranks of dp_shard 0


def test_fallback_and_unused_rules_warn():
    params = llama_params(n_layers=1) | {"freqs_cis": (16, 4)}
    out, warnings = plan_all(params, get_plan("llama"), parse_mesh("dp2,tp2"))
    assert out["freqs_cis"].placements == (R, R) and out["freqs_cis"].rule is None
    assert any("freqs_cis" in w and "replicated" in w for w in warnings)
    doc = {"version": 1, "rules": [{"name": "embed", "match": r"tok_embeddings\..*", "tp": "shard(0)"},
                                   {"name": "moe", "match": r".*experts.*", "tp": "shard(0)"}]}
    out, warnings = plan_all(params, plan_from_doc(doc), parse_mesh("dp2,tp2"))
    assert any("'moe' matched no tensor" in w for w in warnings)
    assert not any("'embed'" in w for w in warnings)
    assert sum("replicated" in w for w in warnings) == 1  # one line for all fallbacks


def test_refusals_name_key_and_dim():
    params = llama_params(dim=6)
    with pytest.raises(PlanError, match=r"layers\.0\.attention\.wq\.weight: dim 0 of size 6 is not divisible by tp4"):
        plan_all(params, get_plan("llama"), parse_mesh("tp4"))
    # 7 rows colwise on tp2 x dp3: torch would save the data under the wrong boxes
    with pytest.raises(PlanError, match=r"layers\.0\.feed_forward\.w1\.weight: dim 0 of size 7"):
        plan_all(llama_params(hidden=7, dim=6), get_plan("llama"), parse_mesh("dp3,tp2"))
    doc = {"version": 1, "rules": [{"match": "w", "dp_shard": "shard(1)"}]}
    with pytest.raises(PlanError, match=r"w: FSDP cannot shard dim 1"):
        plan_all({"w": (4, 5)}, plan_from_doc(doc), parse_mesh("dp2"))
    assert plan_all({"w": (4, 6)}, plan_from_doc(doc), parse_mesh("dp2"))[0]["w"].placements == (S1,)
    doc = {"version": 1, "rules": [{"match": "w", "tp": "shard(2)"}]}
    with pytest.raises(PlanError, match=r"w: tp shards dim 2"):
        plan_all({"w": (4, 5)}, plan_from_doc(doc), parse_mesh("tp2"))
    doc = {"version": 1, "rules": [{"match": "w", "tp": "shard(-1)"}]}
    assert plan_all({"w": (4, 5)}, plan_from_doc(doc), parse_mesh("tp2"))[0]["w"].placements == (S1,)


def test_source_plan():
    splits = SourceSplits({"a": 0, "b": 1, "c": None}, fsdp_dim={"c": None})
    mesh = parse_mesh("dp2,tp4")
    params = {"a": (8, 4), "b": (8, 4), "c": (8,), "d": (3,)}
    out, warnings = plan_all(params, get_plan("source", splits), mesh)
    assert out["a"].placements == (StridedShard(0, 4), S0)
    assert out["b"].placements == (S0, S1)
    assert out["c"].placements == (R, R)
    assert out["d"].placements == (R, R) and any("d" in w for w in warnings)
    assert get_plan("source", {"a": 1}).place("a", (8, 4), mesh).placements == (S0, S1)
    with pytest.raises(ConfigError, match="source"):
        get_plan("source")


# ----------------------------------------------------------------------------- pipeline split


@pytest.mark.parametrize(
    "stages, layers, want",
    [  # worked through torchtitan's generate_llm_fqn_per_model_part (weights 1 and 1)
        (1, 2, [["tok_embeddings", "layers.0", "layers.1", "norm", "output"]]),
        (2, 3, [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "norm", "output"]]),
        (2, 4, [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]),
        (3, 1, [["tok_embeddings"], ["layers.0"], ["norm", "output"]]),
        (
            4,
            8,
            [
                ["tok_embeddings", "layers.0", "layers.1"],
                ["layers.2", "layers.3", "layers.4"],
                ["layers.5", "layers.6"],
                ["layers.7", "norm", "output"],
            ],
        ),
    ],
)
def test_torchtitan_split(stages, layers, want):
    assert generate_fqn_per_model_part(stages, layers) == want


def test_torchtitan_split_weights_and_errors():
    # the docstring example of torchtitan: embeddings and norm+output count as 2 layers each
    assert generate_fqn_per_model_part(2, 3, 2, 2) == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "norm", "output"]]
    with pytest.raises(PlanError, match="empty stages"):
        generate_fqn_per_model_part(5, 2)
    with pytest.raises(PlanError, match="weights"):
        generate_fqn_per_model_part(3, 2, 2, 1)


def test_pp_assignment_in_plan_all():
    mesh = parse_mesh("pp2,dp2")
    out, warnings = plan_all(llama_params(n_layers=3) | {"freqs_cis": (4, 2)}, get_plan("llama"), mesh)
    assert out["tok_embeddings.weight"].pp_stage == 0
    assert out["layers.1.attention.wq.weight"].pp_stage == 0
    assert out["layers.2.attention.wq.weight"].pp_stage == 1
    assert out["norm.weight"].pp_stage == 1 and out["output.weight"].pp_stage == 1
    assert out["freqs_cis"].pp_stage is None and any("no stage" in w for w in warnings)
    assert sorted(out["norm.weight"].rank_boxes((8,), mesh)) == [2, 3]  # only stage 1 ranks
    assert out["layers.0.ffn_norm.weight"].placements == (S0,)  # pp is not a DTensor dim


def test_virtual_stages_and_gaps():
    fqns = [f"layers.{i}.w" for i in range(6)] + ["tok_embeddings.weight", "norm.weight", "output.weight"]
    loop, _ = PipelineSplit(stages_per_rank=2).assign(fqns, 2)
    # 4 stages over 8 effective layers: [emb,0] [1,2] [3,4] [5,norm,output]; stage s on rank s % 2
    assert [loop[f"layers.{i}.w"] for i in range(6)] == [0, 1, 1, 0, 0, 1]
    v, _ = PipelineSplit(stages_per_rank=2, style="v").assign(fqns, 2)
    assert [v[f"layers.{i}.w"] for i in range(6)] == [0, 1, 1, 1, 1, 0]
    assert v["output.weight"] == 0
    with pytest.raises(PlanError, match="gaps"):
        PipelineSplit().assign(["layers.0.w", "layers.2.w"], 2)


# ----------------------------------------------------------------------------- plan files


def test_schema_is_valid_draft_2020_12():
    schema = json.loads(SCHEMA_PATH.read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["additionalProperties"] is False


PLAN_DOC = {
    "version": 1,
    "description": "colwise attention, everything else FSDP",
    "rules": [
        {"name": "qkv", "match": r"layers\.\d+\.attention\.w[qkv]\.weight", "tp": "shard(0)", "tp_divisible": True},
        {"name": "wo", "match": r"layers\.\d+\.attention\.wo\.weight", "tp": "shard(1)"},
        {"name": "norms", "match": r".*norm\.weight", "dp_shard": "replicate"},
        {"name": "rest", "match": r".*"},
    ],
    "pp": {"module_fqns_per_model_part": [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]},
}


def test_json_plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN_DOC))
    plan = get_plan(str(path))
    out, warnings = plan_all(llama_params(), plan, parse_mesh("pp2,dp2,tp2"))
    assert warnings == []
    assert out["layers.0.attention.wq.weight"].placements == (StridedShard(0, 2), S0)
    assert out["layers.0.attention.wo.weight"].placements == (S0, S1)
    assert out["norm.weight"].placements == (R, R) and out["norm.weight"].rule == "norms"
    assert out["layers.0.feed_forward.w1.weight"].placements == (S0, R)
    assert [out[f].pp_stage for f in ("tok_embeddings.weight", "layers.0.ffn_norm.weight", "layers.1.attention.wq.weight", "output.weight")] == [0, 0, 1, 1]


def test_yaml_plan_file(tmp_path):
    yaml = pytest.importorskip("yaml")
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(PLAN_DOC))
    assert load_plan_file(path).rules == plan_from_doc(PLAN_DOC).rules


@pytest.mark.parametrize(
    "change, match",
    [
        ({"extra": 1}, "Additional properties"),
        ({"version": 2}, "at version"),
        ({"rules": [{"match": "x", "tp": "shard"}]}, "at rules/0/tp"),
        ({"rules": [{"match": "x", "tp": "_S(0,2)"}]}, "at rules/0/tp"),
        ({"rules": [{"match": "x", "colour": "red"}]}, "at rules/0"),
        ({"rules": [{"tp": "replicate"}]}, "'match' is a required property"),
        ({"rules": [{"match": "("}]}, "bad regex"),
        ({"rules": [{"name": "a", "match": "x"}, {"name": "a", "match": "y"}]}, "used twice"),
        ({"pp": {"module_fqns_per_model_part": [["a"]], "layers_prefix": "blocks"}}, "at pp"),
        ({"pp": {"style": "zigzag"}}, "at pp/style"),
    ],
)
def test_invalid_plan_files(tmp_path, change, match):
    doc = {**PLAN_DOC, **change}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=match) as info:
        load_plan_file(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_bad_plan_names_and_files(tmp_path):
    with pytest.raises(ConfigError, match="unknown plan"):
        get_plan("megatron-lm")
    with pytest.raises(ConfigError, match="does not exist"):
        get_plan(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        get_plan(str(bad))


def titan030_params(n_layers=2, dim=8, hidden=12, vocab=50, kv_heads=2, head_dim=2, heads=4):
    """torchtitan 0.3.0 Llama 3 parameters: fused ``qkv_linear.wqkv`` and ``lm_head``."""
    params = {"tok_embeddings.weight": (vocab, dim)}
    rows = kv_heads * (heads // kv_heads + 2) * head_dim
    for i in range(n_layers):
        p = f"layers.{i}."
        params |= {
            p + "attention.qkv_linear.wqkv.weight": (rows, dim),
            p + "attention.wo.weight": (dim, heads * head_dim),
            p + "feed_forward.w1.weight": (hidden, dim),
            p + "feed_forward.w2.weight": (dim, hidden),
            p + "feed_forward.w3.weight": (hidden, dim),
            p + "attention_norm.weight": (dim,),
            p + "ffn_norm.weight": (dim,),
        }
    return params | {"norm.weight": (dim,), "lm_head.weight": (vocab, dim)}


def test_llama_covers_torchtitan_030_names():
    """0.3.0's lm_head and fused wqkv are colwise like output / wq; older names keep working."""
    out, warnings = plan_all(titan030_params(), get_plan("llama"), parse_mesh("tp2,dp2"))
    assert warnings == []
    assert out["lm_head.weight"].placements == (StridedShard(0, 2), S0)
    assert out["layers.1.attention.qkv_linear.wqkv.weight"].placements == (StridedShard(0, 2), S0)
    assert out["layers.0.attention.wo.weight"].placements == (S0, S1)
    split = {"layers.0.attention.qkv_linear.wq.weight": (8, 8), "layers.0.attention.qkv_linear.wk.weight": (4, 8)}
    out, warnings = plan_all(split, get_plan("llama"), parse_mesh("tp2"))
    assert warnings == [] and out["layers.0.attention.qkv_linear.wk.weight"].placements == (S0,)
    with pytest.raises(PlanError, match="not divisible by tp4"):
        plan_all({"layers.0.attention.qkv_linear.wqkv.weight": (6, 8)}, get_plan("llama"), parse_mesh("tp4"))


def test_llama_pp_puts_lm_head_last():
    out, _ = plan_all(titan030_params(n_layers=4), get_plan("llama"), parse_mesh("pp2,dp2"))
    assert out["lm_head.weight"].pp_stage == 1 and out["norm.weight"].pp_stage == 1
    assert out["tok_embeddings.weight"].pp_stage == 0


def test_fused_optimizer_states_follow_their_parameter():
    """An atom with optimizer states but no model value (0.3.0's fused wqkv: the save hook writes
    wq/wk/wv) is placed like its parameter, not written whole."""
    from converter.plan.atoms import AtomRef
    from converter.plan.target_layout import stateful_atoms, target_layout
    from formats.base import Box, ChunkRef, CheckpointIndex, TensorEntry

    def entry(key, shape):
        return TensorEntry(key, "float32", shape, (ChunkRef(Box((0,) * len(shape), shape), "f", 0, 0),), (key,))

    fused = "layers.0.attention.qkv_linear.wqkv.weight"
    keys = {f"optimizer.state.{fused}.exp_avg": ((12, 8), AtomRef(fused, "exp_avg")),
            f"optimizer.state.{fused}.step": ((), AtomRef(fused, "step")),
            "layers.0.attention.qkv_linear.wq.weight": ((4, 8), AtomRef("layers.0.attention.qkv_linear.wq.weight", "param"))}
    index = CheckpointIndex("dcp", "ckpt", {k: entry(k, s) for k, (s, _) in keys.items()}, {})
    refs = {k: r for k, (_, r) in keys.items()}
    assert stateful_atoms(index, refs, {}, set()) == {fused: (12, 8)}
    assert stateful_atoms(index, refs, {}, {f"optimizer.state.{fused}.exp_avg"}) == {}
    layout = target_layout(index, refs, parse_mesh("tp2,dp2"), "llama", {}, {"layers.0.attention.qkv_linear.wq.weight"})
    boxes = {c.box for c in layout.chunks if c.key.endswith("exp_avg")}
    assert len(boxes) == 4 and all(b.sizes == (3, 8) for b in boxes)
    assert layout.warnings == ()
