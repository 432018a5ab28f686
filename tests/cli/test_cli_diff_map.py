"""Issue 18.3: ``diff --map NAME|FILE`` compares a checkpoint with its Hugging Face export (the
same map names and files as export-hf); without it the names do not meet and diff says why."""

from __future__ import annotations

import json

from safetensors.torch import load_file, save_file

from converter.tools.demo import demo_checkpoint
from converter.run.sources import open_checkpoint
from test_cli_readable import ckptconv

HEADS = '{"num_attention_heads": 4, "num_key_value_heads": 2}'


def _export(tmp_path, *args):
    hf = tmp_path / "hf"
    proc = ckptconv("export-hf", str(demo_checkpoint()), str(hf), *args, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return hf


def test_diff_map_builtin(tmp_path):
    hf = _export(tmp_path, "--map", "torchtitan-llama", "--config", HEADS)
    ckpt = str(demo_checkpoint())
    proc = ckptconv("diff", ckpt, str(hf), "--model")
    assert proc.returncode == 1 and "0 of 0 common tensors" in proc.stdout
    assert "--map torchtitan-llama" in proc.stdout  # the hint
    proc = ckptconv("diff", ckpt, str(hf), "--model", "--map", "torchtitan-llama")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("same: 21 of 21 common tensors bitwise equal")
    proc = ckptconv("diff", str(hf), ckpt, "--map", "torchtitan-llama", "--json")  # either order; implies --model
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0 and len(doc["tensors"]) == 21 and not doc["only_a"] and not doc["only_b"]


def test_diff_map_finds_a_changed_head_row(tmp_path):
    hf = _export(tmp_path, "--map", "torchtitan-llama", "--config", HEADS)
    f = hf / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] += 1
    save_file(tensors, f, metadata={"format": "pt"})
    proc = ckptconv("diff", str(demo_checkpoint()), str(hf), "--map", "torchtitan-llama")
    assert proc.returncode == 1, proc.stderr
    assert f"{name}: 1 elements outside tolerance" in proc.stdout and "first at [3, 5]" in proc.stdout


def test_diff_map_file_and_config_option(tmp_path):
    fqns = [k[len("model."):] for k in open_checkpoint(demo_checkpoint()).index().tensors if k.startswith("model.")]
    mapping = {("embed.{}" if f.startswith("tok_") else "blocks.{}" if ".wq." in f else "other.{}").format(f): f
               for f in fqns}
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps({"map": mapping}))
    hf = _export(tmp_path, "--map", str(map_file))
    proc = ckptconv("diff", str(demo_checkpoint()), str(hf), "--map", str(map_file), "--key", "re:embed|blocks")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same: 3 of 3 common tensors" in proc.stdout
    proc = ckptconv("diff", str(demo_checkpoint()), str(hf), "--map", "no-such-map")
    assert proc.returncode == 2 and proc.stderr.startswith("ckptconv: error: --map 'no-such-map'")
