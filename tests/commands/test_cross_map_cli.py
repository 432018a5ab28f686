"""``--map`` on from-universal / to-universal through the CLI (issue 32.1, 32.2, 32.4): a torchtitan
0.3.0-named training checkpoint written by torch's ``dcp.save``, converted, and read back with torch's
own ``dcp_to_torch_save`` (never ckptconv's reader). The expected values are the torch transforms of
tests/plan/test_cross_map.py (HF's RoPE permutation, torchtitan's ``FusedQKVLinear`` split)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from cli_runner import run_cli
from schemas import validation_errors
from cross_map_support import CFG, HPARAMS, hf_of_titan, titan_checkpoint

FQN = "layers.0.attention.qkv_linear.wqkv.weight"


def _save_titan(path, **extra) -> tuple[dict, dict]:
    """``dcp.save`` of the plan test's torchtitan checkpoint, in torchtitan's own nesting
    (weights at the top level, ``optimizer`` flattened, ``train_state``)."""
    reader, model, states = titan_checkpoint(**extra)
    sd: dict = dict(model)
    optim: dict = {}
    for fqn, st in states.items():
        for role, t in st.items():
            optim[f"state.{fqn}.{role}"] = t
        for name, v in HPARAMS.items():
            optim[f"param_groups.{fqn}.{name}"] = v
    sd["optimizer"] = optim
    sd["train_state"] = {"step": 7}
    dcp.save(sd, checkpoint_id=str(path))
    return model, states


def _torch_read(path, tmp_path) -> dict:
    dcp_to_torch_save(str(path), str(tmp_path / "full.pt"))
    return torch.load(tmp_path / "full.pt", weights_only=False)


@pytest.mark.parametrize("mesh", ["dp1", "dp2"])
def test_from_universal_map_moves_weights_states_and_groups_to_hf_names(tmp_path, mesh):
    src, out = tmp_path / "src", tmp_path / "out"
    model, states = _save_titan(src)
    code, stdout, stderr = run_cli("from-universal", str(src), str(out), "--mesh", mesh, "--map", "torchtitan-llama",
                                   "--config", json.dumps(CFG))
    assert code == 0, stdout + stderr
    got = _torch_read(out, tmp_path)
    weights, hf_states = hf_of_titan(model, states)
    assert set(got["model"]) == set(weights)
    for k, t in weights.items():
        assert torch.equal(got["model"][k], t), k
    assert set(got["optim"]["state"]) == set(hf_states)
    for fqn, st in hf_states.items():
        assert set(got["optim"]["state"][fqn]) == set(st), fqn
        for role, t in st.items():
            assert torch.equal(got["optim"]["state"][fqn][role], t), (fqn, role)
    (group,) = got["optim"]["param_groups"]
    assert group.pop("params") == list(hf_states)
    assert {k: tuple(v) if k == "betas" else v for k, v in group.items()} == HPARAMS
    assert got["train_state"] == {"step": 7}
    assert not any(k.startswith("optimizer") for k in got)


def test_dry_run_lists_every_source_and_target_key_with_its_transform(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    _save_titan(src)
    args = ["from-universal", str(src), str(out), "--mesh", "dp2", "--map", "torchtitan-llama", "--config",
            json.dumps(CFG), "--dry-run"]
    code, stdout, stderr = run_cli(*args)
    assert code == 0, stdout + stderr
    assert not out.exists()
    assert (f"optimizer.state.{FQN}.exp_avg -> optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg  "
            "[state: 16 of 32 rows, reordered]") in stdout
    assert (f"optimizer.state.{FQN}.exp_avg_sq -> optim.state.model.layers.0.self_attn.k_proj.weight.exp_avg_sq  "
            "[state: 8 of 32 rows, reordered]") in stdout
    assert f"optimizer.state.{FQN}.step -> optim.state.model.layers.0.self_attn.k_proj.weight.step  [state: copied]" in stdout
    assert ("layers.1.attention.qkv_linear.wq.weight -> model.model.layers.1.self_attn.q_proj.weight  "
            "[weight: rows permuted]") in stdout
    assert "layers.0.feed_forward.w1.weight -> model.model.layers.0.mlp.gate_proj.weight  [weight: renamed]" in stdout
    code, stdout, stderr = run_cli(*args, "--json")
    assert code == 0, stdout + stderr
    doc = json.loads(stdout)
    km = doc["key_map"]
    assert validation_errors("key-map", {"schema": "ckptconv.key-map/1", **km}) == []
    by_target = {e["target"]: e for e in km["entries"]}
    e = by_target["optim.state.model.layers.1.self_attn.v_proj.weight.exp_avg"]
    assert e["sources"] == [f"optimizer.state.layers.1.attention.qkv_linear.wqkv.weight.exp_avg"] and e["kind"] == "state"
    assert by_target["optim.param_groups.0.lr"]["kind"] == "hparam"


def test_to_universal_map_dry_run_json_is_the_key_map_document(tmp_path):
    src = tmp_path / "src"
    _save_titan(src)
    code, stdout, stderr = run_cli("to-universal", str(src), str(tmp_path / "u"), "--map", "torchtitan-llama",
                                   "--config", json.dumps(CFG), "--dry-run", "--json")
    assert code == 0, stdout + stderr
    doc = json.loads(stdout)
    assert validation_errors("key-map", doc) == [], validation_errors("key-map", doc)
    assert doc["direction"] == "to-hf" and doc["key_style"] == "dcp"


def test_a_state_that_is_not_elementwise_safe_is_refused_in_one_line(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    _save_titan(src, **{FQN: ("exp_avg_sq_row", (32,))})  # Adafactor-like factored state of the fused qkv
    code, stdout, stderr = run_cli("from-universal", str(src), str(out), "--mesh", "dp2", "--map", "torchtitan-llama",
                                   "--config", json.dumps(CFG))
    assert code == 2, stdout + stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert f"optimizer.state.{FQN}.exp_avg_sq_row" in lines[0] and "not elementwise-safe" in lines[0]
    assert not out.exists()


def test_export_ds_map_writes_hf_named_atoms_and_import_ds_maps_them_back(tmp_path):
    """torchtitan -> export-ds --map torchtitan-llama (a DeepSpeed universal checkpoint of the HF model:
    each atom file torch.loads to the torch-transformed weight or state) -> import-ds --map
    torchtitan-llama3 -> from-universal: torch's reading equals the source, bit for bit."""
    src = tmp_path / "src"
    model, states = _save_titan(src)
    code, stdout, stderr = run_cli("export-ds", str(src), str(tmp_path / "ds"), "--tag", "t", "--map",
                                   "torchtitan-llama", "--config", json.dumps(CFG))
    assert code == 0, stdout + stderr
    weights, hf_states = hf_of_titan(model, states)
    zero = tmp_path / "ds" / "t" / "zero"
    assert {p.name for p in zero.iterdir() if p.is_dir()} == set(weights)
    for fqn, t in weights.items():
        assert torch.equal(torch.load(zero / fqn / "fp32.pt", weights_only=True)["param"], t), fqn
        for role in ("exp_avg", "exp_avg_sq"):
            got = torch.load(zero / fqn / f"{role}.pt", weights_only=True)["param"]
            assert torch.equal(got, hf_states[fqn][role]), (fqn, role)
    opt = torch.load(zero / "optimizer_state.pt", weights_only=True)
    assert {k: tuple(v) if k == "betas" else v for k, v in opt["param_groups"][0].items() if k != "params"} == HPARAMS

    code, stdout, stderr = run_cli("import-ds", str(tmp_path / "ds" / "t"), str(tmp_path / "uni"), "--map",
                                   "torchtitan-llama3", "--config", json.dumps(CFG))
    assert code == 0, stdout + stderr
    code, stdout, stderr = run_cli("from-universal", str(tmp_path / "uni"), str(tmp_path / "back"), "--mesh", "dp2")
    assert code == 0, stdout + stderr
    got = _torch_read(tmp_path / "back", tmp_path)
    for k, t in model.items():
        assert torch.equal(got[k], t), k
    for fqn, st in states.items():
        for role, t in st.items():
            assert torch.equal(got["optimizer"][f"state.{fqn}.{role}"].reshape(t.shape), t.to(torch.float32)), (fqn, role)
        assert got["optimizer"][f"param_groups.{fqn}.lr"] == HPARAMS["lr"]
