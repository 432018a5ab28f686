"""Issue 18.3: ``diff --map NAME|FILE`` compares a checkpoint with its Hugging Face export (the
same map names and files as export-hf); without it the names do not meet and diff says why.

The HF side of the built-in map is made without ckptconv's map code (issue 25): torchtitan
0.3.0's own ``Llama3StateDictAdapter.to_hf`` (its names and its RoPE permutation) of the demo's
weights as torch reads them, saved by safetensors; so a wrong name or permutation in the map
shows as a difference instead of agreeing with itself.
"""

from __future__ import annotations

import json
import types

import pytest
from safetensors.torch import load_file, save_file

import titan_support
from converter.tools.demo import demo_checkpoint
from converter.run.sources import open_checkpoint
from test_cli_readable import ckptconv

HEADS = '{"num_attention_heads": 4, "num_key_value_heads": 2}'
needs_titan = pytest.mark.framework("torchtitan")  # its adapter: skips (fails under CI) without torchtitan
#: The demo's (older torchtitan) names -> torchtitan 0.3.0's, which its adapter takes: q/k/v under
#: ``qkv_linear``, ``output`` as ``lm_head``. Everything else is named alike.
TO_030 = {".attention.wq.": ".attention.qkv_linear.wq.", ".attention.wk.": ".attention.qkv_linear.wk.",
          ".attention.wv.": ".attention.qkv_linear.wv.", "output.weight": "lm_head.weight"}


def _export(tmp_path, *args):
    hf = tmp_path / "hf"
    proc = ckptconv("export-hf", str(demo_checkpoint()), str(hf), *args, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return hf


def _titan_hf(tmp_path):
    """The demo's model weights (torch's own reading: dcp_to_torch_save) as torchtitan's adapter
    writes them to HF (demo: dim 32, 4 heads, 2 KV heads, untied), saved by safetensors."""
    from oracle import torch_reference

    titan_support.apply_cpu_patches()
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    native = {}
    for key, value in torch_reference(demo_checkpoint()).items():
        if key.startswith("model."):
            name = key[len("model."):]
            for old, new in TO_030.items():
                name = name.replace(old, new)
            native[name] = value
    attn = types.SimpleNamespace(n_heads=4, n_kv_heads=2, head_dim=None)
    config = types.SimpleNamespace(layers=[types.SimpleNamespace(attention=attn)], dim=32, enable_weight_tying=False)
    hf = Llama3StateDictAdapter(config, None).to_hf(native)
    assert len(hf) == len(native) == 21
    out = tmp_path / "hf"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in hf.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(HEADS)
    return out


@needs_titan
def test_diff_map_builtin(tmp_path):
    hf = _titan_hf(tmp_path)
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


@needs_titan
def test_export_hf_equals_torchtitans_adapter(tmp_path):
    """The export with the same map is the adapter's files, tensor for tensor (names, shapes, bits)."""
    want = load_file(_titan_hf(tmp_path) / "model.safetensors")
    proc = ckptconv("export-hf", str(demo_checkpoint()), str(tmp_path / "ours"), "--map", "torchtitan-llama",
                    "--config", HEADS, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    got = load_file(tmp_path / "ours" / "model.safetensors")
    assert set(got) == set(want)
    assert all(got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and got[k].equal(want[k]) for k in want)


@needs_titan
def test_diff_map_finds_a_changed_head_row(tmp_path):
    hf = _titan_hf(tmp_path)
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
