"""Megatron-core torch_dist checkpoints, on a small one saved by megatron-core 0.19.2 itself (fast).

``tests/data/megatron/gpt_tp2_dp2`` (and ``gpt_pp2_dp2``, the same model at PP2 x DP2): a real ``GPTModel`` (local layer spec, Llama-like: RMSNorm,
SwiGLU, GQA 4 heads / 2 query groups, bf16 weights) with its DistributedOptimizer (fp32 main params and
Adam states, ``fully_reshardable``) after 2 steps at TP2 x DP2 on gloo, saved by
``dist_checkpointing.save`` (torch_dist) with Megatron-LM's common state (``args`` Namespace,
``iteration``, ``rng_state`` over the (pp, tp) grid); regenerate with
``python tests/support/megatron_support.py tests/data/megatron/gpt_tp2_dp2 --tp 2 --dp 2`` (``--tp 1 --pp 2``).

The oracle is torch's own reading of the checkpoints (``dcp_to_torch_save``); megatron's own load of
the conversions is in ``tests/e2e/test_megatron_e2e.py`` (slow).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_runner import run_cli
from converter.plan.atoms import AtomRef, group_atoms
from converter.plan.megatron import layout_bound_objects, plan_layout_bound, stacked_layers
from converter.plan.mesh import parse_mesh
from converter.run.sources import open_checkpoint
from formats.errors import ConfigError, UnsafePickleError
from formats.objects import load_torch_object
from oracle import bits_equal, torch_reference

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "megatron" / "gpt_tp2_dp2"
PP_FIXTURE = FIXTURE.parent / "gpt_pp2_dp2"  # the same model saved at PP2 x DP2 (layer 0 on stage 0, layer 1 on 1)
STACKED = ("decoder.layers.self_attention.linear_qkv.weight", "decoder.layers.mlp.linear_fc1.weight")


def _index(path: Path = FIXTURE):
    reader = open_checkpoint(path)
    try:
        return reader.index()
    finally:
        reader.close()


def _paths(index) -> dict:
    return {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}


# ------------------------------------------------------------------------------------------------
# formats: .metadata allowlist, argparse.Namespace, refusals


def test_metadata_with_all_local_plans_parses_like_torch():
    """megatron's .metadata (torch's planner dataclasses in all_local_plans) parses; keys, shapes and
    dtypes are torch's own."""
    with open(FIXTURE / ".metadata", "rb") as f:
        theirs = pickle.load(f)  # our own test fixture: torch's reading, for comparison only
    assert getattr(theirs, "all_local_plans", None) and theirs.planner_data is None
    index = _index()
    for key, md in theirs.state_dict_metadata.items():
        if hasattr(md, "size"):
            assert index.tensors[key].shape == tuple(md.size)
            assert index.tensors[key].dtype == str(md.properties.dtype).removeprefix("torch.")
        else:
            assert key in index.objects


def test_planner_allowlist_is_only_torchs_plain_dataclasses(tmp_path):
    """The allowlist takes SavePlan/WriteItem/WriteItemType/TensorWriteData as inert records; any
    other name of torch's planner module (a class with code: SavePlanner) is still refused."""
    src = (FIXTURE / ".metadata").read_bytes()
    bad = src.replace(b"TensorWriteData", b"SavePlannerXXXX"[: len(b"TensorWriteData")])
    assert bad != src
    ckpt = tmp_path / "bad"
    shutil.copytree(FIXTURE, ckpt)
    (ckpt / ".metadata").write_bytes(bad)
    code, _, err = run_cli("inspect", str(ckpt))
    assert code == 2 and "not on the allowlist" in err and "SavePlannerXXXX" in err


def test_namespace_in_common_state_is_plain_data():
    """argparse.Namespace loads without --trust-pickle (nothing run but building it)."""
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=2, params_dtype=torch.bfloat16, lr=0.1)}, buf)
    value = load_torch_object(buf.getvalue(), "common_state")
    assert value["args"] == argparse.Namespace(tensor_model_parallel_size=2, params_dtype=torch.bfloat16, lr=0.1)


class _Hook:
    def __reduce__(self):
        return (os.getcwd, ())


def test_namespace_holding_a_foreign_class_is_refused_in_whole_words():
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(hook=_Hook())}, buf)
    with pytest.raises(UnsafePickleError) as e:
        load_torch_object(buf.getvalue(), "x/common.pt")
    msg = str(e.value)
    assert "posix.getcwd" in msg and msg.endswith("pass --trust-pickle only if you trust this checkpoint")
    assert "argparse.Namespace" not in msg  # the Namespace itself is fine: only the foreign global is named


# ------------------------------------------------------------------------------------------------
# plan: atoms, stacked layers, layout-bound objects


def test_atoms_put_the_state_name_before_the_key():
    refs, atoms = group_atoms(_paths(_index()))
    w = "decoder.layers.self_attention.linear_qkv.weight"
    assert refs[w] == AtomRef(w, "param")
    assert refs[f"optimizer.state.exp_avg.{w}"] == AtomRef(w, "exp_avg")
    assert refs[f"optimizer.state.exp_avg_sq.{w}"] == AtomRef(w, "exp_avg_sq")
    assert refs[f"optimizer.state.param.{w}"] == AtomRef(w, "main_param")
    assert set(atoms[w]) == {"param", "exp_avg", "exp_avg_sq", "main_param"}
    for top in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"):
        assert refs[top] == AtomRef(top, "param")
    assert refs["rng_state/shard_0.1_1.2"].role == "value" and refs["common_state/shard_0_1"].role == "value"


def test_layer_stacked_tensors_are_not_tp_splits():
    index = _index()
    stacked = stacked_layers(index)
    assert all(stacked[k] == 2 for k in STACKED) and "embedding.word_embeddings.weight" not in stacked
    code, out, err = run_cli("inspect", str(FIXTURE), "--json")
    assert code == 0, err
    doc = json.loads(out)
    rows = {t["key"]: t for t in doc["tensors"]}
    qkv, fc1, proj = (rows[f"decoder.layers.{n}.weight"] for n in
                      ("self_attention.linear_qkv", "mlp.linear_fc1", "self_attention.linear_proj"))
    assert qkv["layers"] == fc1["layers"] == proj["layers"] == 2
    assert (qkv["layout"], qkv["tp_dim"]) == ("tp_colwise", 1)  # column-parallel: dim 1 of (L, out, in)
    assert (fc1["layout"], fc1["tp_dim"]) == ("tp_colwise", 1)  # [gate; up], each split over TP
    assert (proj["layout"], proj["tp_dim"]) == ("tp_rowwise", 2)
    assert fc1["placement"] == "layers=2 tp_colwise d1/4 (2 fused halves, each over tp2)"
    assert (qkv["placement"], proj["placement"]) == ("layers=2 tp_colwise d1/2", "layers=2 tp_rowwise d2/2")
    assert rows["decoder.layers.mlp.linear_fc1.layer_norm_weight"]["layout"] == "whole"
    assert doc["layout"]["mesh"] == {"tp": 2}
    objs = {o["key"] for o in doc["objects"]}
    assert {"rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2", "common_state/shard_0_1"} <= objs
    assert any(n.startswith("layout-bound Megatron entries (load only on pp1 x tp2") and "rng_state (2 entries)" in n
               for n in doc["layout"]["notes"]), doc["layout"]["notes"]


def test_layout_bound_objects_follow_pp_and_tp():
    keys = list(_index().objects)
    assert [b.key for b in layout_bound_objects(keys)] == ["rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2"]
    for mesh in ("tp2,dp2", "tp2", "tp2,dp8"):  # DP changes keep them: megatron asks for (pp_rank, tp_rank)
        assert plan_layout_bound(keys, parse_mesh(mesh, None)) == (set(), [])
    dropped, warnings = plan_layout_bound(keys, parse_mesh("tp1,dp4", None))
    assert dropped == {"rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2"} and "tp 2 -> 1" in warnings[0]
    assert plan_layout_bound(keys, parse_mesh("pp2,tp2", None), "keep")[0] == set()
    with pytest.raises(ConfigError, match="pp 1 -> 2"):
        plan_layout_bound(keys, parse_mesh("pp2,tp2", None), "refuse")


# ------------------------------------------------------------------------------------------------
# commands: verify, to-universal, from-universal, export-hf


def _assert_tensors_equal(src: Path, out: Path) -> None:
    want, got = torch_reference(src), torch_reference(out)
    tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor) and "/shard_" not in k]
    assert len(tensors) == 36  # (rng_state's torch RNG tensors live inside an object)
    for k in tensors:
        assert bits_equal(want[k], got[k]), k


def test_verify_accepts_it():
    code, out, err = run_cli("verify", str(FIXTURE))
    assert code == 0 and out.startswith("ok:"), out + err


@pytest.mark.parametrize("mesh,kept_rng", [("tp2,dp2", True), ("dp2", False)])
def test_round_trip_through_the_store_carries_metadata_json(tmp_path, mesh, kept_rng):
    store, out = tmp_path / "store", tmp_path / "out"
    code, _, err = run_cli("to-universal", str(FIXTURE), str(store))
    assert code == 0, err
    assert (store / "metadata.json").read_bytes() == (FIXTURE / "metadata.json").read_bytes()
    code, _, err = run_cli("from-universal", str(store), str(out), "--mesh", mesh)
    assert code == 0, err
    assert (out / "metadata.json").read_bytes() == (FIXTURE / "metadata.json").read_bytes()
    assert ("dropped layout-bound Megatron objects" in err) is not kept_rng
    _assert_tensors_equal(FIXTURE, out)
    names = set(_index(out).objects)
    assert ("rng_state/shard_0.1_1.2" in names) is kept_rng
    assert "common_state/shard_0_1" in names and "decoder.layers.mlp.linear_fc1._extra_state/shard_1_2" in names
    src_reader, out_reader = open_checkpoint(FIXTURE), open_checkpoint(out)
    try:
        for key in names:  # every object byte for byte
            assert out_reader.read_object_bytes(key) == src_reader.read_object_bytes(key), key
    finally:
        src_reader.close()
        out_reader.close()


def test_refuse_layout_change_and_legacy_common_pt(tmp_path):
    ckpt = tmp_path / "legacy"
    shutil.copytree(FIXTURE, ckpt)
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=2), "iteration": 2}, buf)
    (ckpt / "common.pt").write_bytes(buf.getvalue())
    code, _, err = run_cli("from-universal", str(ckpt), str(tmp_path / "no"), "--mesh", "dp4",
                           "--layout-bound-objects", "refuse")
    assert code == 2 and "rng_state" in err and not (tmp_path / "no" / ".metadata").exists()
    code, _, err = run_cli("from-universal", str(ckpt), str(tmp_path / "out"), "--mesh", "tp2,dp2")
    assert code == 0, err
    assert (tmp_path / "out" / "common.pt").read_bytes() == buf.getvalue()
    bad = io.BytesIO()
    torch.save({"args": argparse.Namespace(hook=_Hook())}, bad)
    (ckpt / "common.pt").write_bytes(bad.getvalue())
    code, _, err = run_cli("to-universal", str(ckpt), str(tmp_path / "store"))
    assert code == 2 and "common.pt" in err and "--trust-pickle" in err


def _hf_reference() -> dict[str, torch.Tensor]:
    """HF Llama tensors computed with torch from torch's own reading of the source (the model's
    sizes: 4 heads, 2 query groups, head dim 8, ffn 48)."""
    ref = torch_reference(FIXTURE)
    heads, groups, hd = 4, 2, 8
    out = {"model.embed_tokens.weight": ref["embedding.word_embeddings.weight"],
           "lm_head.weight": ref["output_layer.weight"], "model.norm.weight": ref["decoder.final_layernorm.weight"]}
    for i in range(2):
        qkv = ref["decoder.layers.self_attention.linear_qkv.weight"][i].view(groups, heads // groups + 2, hd, -1)
        gate, up = ref["decoder.layers.mlp.linear_fc1.weight"][i].chunk(2)
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": qkv[:, : heads // groups].reshape(heads * hd, -1),
                p + "self_attn.k_proj.weight": qkv[:, -2].reshape(groups * hd, -1),
                p + "self_attn.v_proj.weight": qkv[:, -1].reshape(groups * hd, -1),
                p + "self_attn.o_proj.weight": ref["decoder.layers.self_attention.linear_proj.weight"][i],
                p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": ref["decoder.layers.mlp.linear_fc2.weight"][i],
                p + "input_layernorm.weight": ref["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
                p + "post_attention_layernorm.weight": ref["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i]}
    return out


@pytest.mark.parametrize("via_store", [False, True])
def test_export_hf_megatron_llama(tmp_path, via_store):
    """Unstacked layers, linear_qkv split per query group, linear_fc1 into gate/up, head counts from
    the checkpoint's own args; every tensor bit for bit."""
    from safetensors.torch import load_file

    src = FIXTURE
    if via_store:
        src = tmp_path / "store"
        assert run_cli("to-universal", str(FIXTURE), str(src))[0] == 0
    code, _, err = run_cli("export-hf", str(src), str(tmp_path / "hf"), "--map", "megatron-llama")
    assert code == 0, err
    got = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        got |= load_file(f)
    want = _hf_reference()
    assert set(got) == set(want)
    for k, v in want.items():
        assert bits_equal(v.contiguous(), got[k]), k
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]) == (4, 2, 2)
    assert (cfg["intermediate_size"], cfg["hidden_size"], cfg["vocab_size"]) == (48, 32, 64)
    assert cfg["tie_word_embeddings"] is False


def test_export_hf_identity_keeps_the_stacked_tensors(tmp_path):
    from safetensors.torch import load_file

    code, _, err = run_cli("export-hf", str(FIXTURE), str(tmp_path / "hf"))
    assert code == 0, err
    got = load_file(tmp_path / "hf" / "model.safetensors")
    ref = torch_reference(FIXTURE)
    assert len(got) == 9 and not any(k.startswith("optimizer.") for k in got)
    for k, v in got.items():
        assert bits_equal(ref[k], v), k


def test_pipeline_stages_show_as_runs_of_layers():
    code, out, err = run_cli("inspect", str(PP_FIXTURE), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["layout"]["mesh"] == {"pp": 2}
    assert "PP: 2 stages (layers 0-0 on ranks 0 | layers 1-1 on ranks 2)" in doc["layout"]["summary"]


def test_pp_source_round_trip_and_export(tmp_path):
    """A PP2 save (each stage wrote its own layers of the stacked tensors) to TP2 and to HF."""
    from safetensors.torch import load_file

    code, _, err = run_cli("from-universal", str(PP_FIXTURE), str(tmp_path / "out"), "--mesh", "tp2,dp2")
    assert code == 0 and "pp 1 -> 1" not in err, err
    _assert_tensors_equal(PP_FIXTURE, tmp_path / "out")
    code, _, err = run_cli("export-hf", str(PP_FIXTURE), str(tmp_path / "hf"), "--map", "megatron-llama")
    assert code == 0, err
    got = load_file(tmp_path / "hf" / "model.safetensors")
    ref = torch_reference(PP_FIXTURE)
    assert bits_equal(ref["decoder.layers.self_attention.linear_proj.weight"][1],
                      got["model.layers.1.self_attn.o_proj.weight"])


def test_megatron_llama_is_export_only(tmp_path):
    (tmp_path / "hf").mkdir()
    code, _, err = run_cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "uni"), "--map", "megatron-llama")
    assert code == 2 and "export only" in err


def test_dp_reshardable_optimizer_state_is_bound_to_pp_and_tp():
    """Megatron-LM's default optimizer format keeps flat per-(pp, tp)-group buffers (tensors) and
    objects: kept for a DP change, dropped (with the --no-load-optim hint) for a TP change."""
    group = "optimizer.distributed.dp_group_idx_0"
    keys = [f"{group}.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.exp_avg",
            f"{group}.optimizer/shard_0_1", "rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2",
            "decoder.layers.mlp.linear_fc1.weight"]
    assert plan_layout_bound(keys, parse_mesh("tp2,dp4", None)) == (set(), [])
    dropped, warnings = plan_layout_bound(keys, parse_mesh("dp2", None))
    assert dropped == set(keys[:4]) and "--no-load-optim" in warnings[0]


def test_plain_optimizer_and_model_only_keys_are_atoms():
    """megatron's non-distributed optimizer names its fp32 copy fp32_param; a model-only save (no
    optimizer) is still recognised by its top-level module names."""
    from formats.dcp.reader import guess_path

    w = "decoder.layers.mlp.linear_fc2.weight"
    keys = [w, "embedding.word_embeddings.weight", f"optimizer.state.fp32_param.{w}", f"optimizer.state.exp_avg.{w}"]
    refs, atoms = group_atoms({k: guess_path(k) for k in keys})
    assert atoms[w] == {"param": w, "fp32_param": keys[2], "exp_avg": keys[3]}
    refs, _ = group_atoms({k: guess_path(k) for k in keys[:2]})
    assert all(r.role == "param" for r in refs.values())


def _layer_boxes(chunks, stacked: bool) -> set:
    """A tensor's chunk boxes, a stacked tensor's cut into one box per layer (megatron writes and
    loads one per layer; a converted box may hold several)."""
    out = set()
    for off, size in chunks:
        if stacked:
            out |= {((layer, *off[1:]), (1, *size[1:])) for layer in range(off[0], off[0] + size[0])}
        else:
            out.add((tuple(off), tuple(size)))
    return out


def test_no_plan_writes_megatrons_own_rank_boxes(tmp_path):
    """No --plan on megatron's own TP2 x DP2 save, to the same layout: the plan is megatron's
    (one line says so) and each rank's file holds exactly the boxes megatron saved for its TP
    coordinate (the boxes its dist_checkpointing.load asks for; tp is the fastest rank dim in both),
    the gated linear_fc1's two [gate; up] halves included, nothing split over dp."""
    from torch.distributed.checkpoint import FileSystemReader

    code, out, err = run_cli("from-universal", str(FIXTURE), str(tmp_path / "out"), "--mesh", "tp2,dp2",
                             "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan"] == "megatron" and "Megatron-core GPT names" in doc["plan_reason"]
    assert not [w for w in doc["warnings"] if "mesh dim" in w]
    md = FileSystemReader(str(FIXTURE)).read_metadata()
    writer = {}  # (key, offsets) -> the rank whose file holds it in megatron's save
    for idx, info in md.storage_data.items():
        if idx.offset is not None:  # (bytes entries have none)
            writer[(idx.fqn, tuple(idx.offset))] = int(info.relative_path.split("_")[2])
    stacked = stacked_layers(_index())
    for t in doc["tensors"]:
        key = t["key"]
        saved = md.state_dict_metadata[key]
        lead = 1 if key in stacked else 0
        if all(tuple(c.sizes)[lead:] == tuple(saved.size)[lead:] for c in saved.chunks):  # whole over tp
            assert all(sorted(c["holders"]) == [0, 1, 2, 3] for c in t["chunks"]), key
            continue
        for tp in range(2):
            want = _layer_boxes([(tuple(c.offsets), tuple(c.sizes)) for c in saved.chunks
                                 if writer[(key, tuple(c.offsets))] % 2 == tp], key in stacked)
            got = _layer_boxes([(c["offsets"], c["sizes"]) for c in t["chunks"] if c["rank"] % 2 == tp],
                               key in stacked)
            assert got == want, (key, tp)
        for c in t["chunks"]:  # every box held by the ranks of one tp coordinate, on both dp replicas
            assert sorted(c["holders"]) == [c["rank"] % 2, c["rank"] % 2 + 2], (key, c)


def test_a_megatron_plan_output_reads_back_layer_stacked(tmp_path):
    """--plan megatron keeps the layer axis whole in a box; read back, the output is still
    layer-stacked (so export-hf --map megatron-llama unstacks it exactly as from the source)."""
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(FIXTURE), str(out), "--mesh", "tp2,dp2")
    assert code == 0 and "plan megatron (--plan auto)" in err, err
    assert stacked_layers(_index(out)) == stacked_layers(_index())
    hf = {}
    for name, src in (("src", FIXTURE), ("out", out)):
        code, _, err = run_cli("export-hf", str(src), str(tmp_path / f"hf-{name}"), "--map", "megatron-llama")
        assert code == 0, err
        from safetensors.torch import load_file

        hf[name] = {}
        for f in sorted((tmp_path / f"hf-{name}").glob("*.safetensors")):
            hf[name] |= load_file(str(f))
    assert sorted(hf["src"]) == sorted(hf["out"]) and len(hf["src"]) > 9
    assert all(bits_equal(hf["src"][k], hf["out"][k]) for k in hf["src"])
