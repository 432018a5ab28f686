"""HF export/import of torchtitan 0.3.0 Llama against torchtitan's own ``Llama3StateDictAdapter``.

Fast: a DCP holding one layer with the fused ``qkv_linear.wqkv`` (built by torchtitan's own
``FusedQKVLinear`` load hook) and one with the split ``qkv_linear.wq/wk/wv`` (what its save hook
writes) exports tensor for tensor as the adapter's ``to_hf`` of the split weights; import-hf with
``--map torchtitan-llama3`` gives back 0.3.0's names bit for bit. Slow: the Trainer's real save,
byte-identical to the adapter's output saved by safetensors, and the import loaded back by
torchtitan's own Trainer.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

import titan_support
from cli_runner import run_cli

pytestmark = pytest.mark.framework("torchtitan")  # skips (fails under CI) without torchtitan
HEADS = {"num_attention_heads": 16}


def _adapter():
    titan_support.apply_cpu_patches()
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Llama3StateDictAdapter(model_registry("debugmodel").model, None)


def _model_state(seed: int = 0, n_layers: int = 2) -> dict[str, torch.Tensor]:
    """debugmodel-shaped weights of ``n_layers`` layers in 0.3.0's saved names (split q/k/v)."""
    g = torch.Generator().manual_seed(seed)
    sd = {"tok_embeddings.weight": torch.randn(2048, 256, generator=g), "norm.weight": torch.randn(256, generator=g),
          "lm_head.weight": torch.randn(2048, 256, generator=g)}
    for i in range(n_layers):
        p = f"layers.{i}."
        for name, shape in (("attention.qkv_linear.wq.weight", (256, 256)), ("attention.qkv_linear.wk.weight", (256, 256)),
                            ("attention.qkv_linear.wv.weight", (256, 256)), ("attention.wo.weight", (256, 256)),
                            ("feed_forward.w1.weight", (768, 256)), ("feed_forward.w2.weight", (256, 768)),
                            ("feed_forward.w3.weight", (768, 256)), ("attention_norm.weight", (256,)),
                            ("ffn_norm.weight", (256,))):
            sd[p + name] = torch.randn(*shape, generator=g)
    return sd


def _fuse_layer0(sd: dict) -> dict:
    """Layer 0 as the live model holds it: torchtitan's own FusedQKVLinear load hook fuses wq/wk/wv."""
    titan_support.apply_cpu_patches()
    from torchtitan.models.common.attention import FusedQKVLinear

    out = dict(sd)
    module = types.SimpleNamespace(head_dim=16, heads_per_kv=1)
    FusedQKVLinear._merge_qkv_on_load(module, out, "layers.0.attention.qkv_linear.")
    assert "layers.0.attention.qkv_linear.wqkv.weight" in out
    return out


def test_export_fused_and_split_equals_torchtitans_adapter(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    split = _model_state()
    dcp.save(_fuse_layer0(split), checkpoint_id=str(tmp_path / "ckpt"))
    code, _, err = run_cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--map", "torchtitan-llama",
                           "--config", json.dumps(HEADS))
    assert code == 0, err
    want = _adapter().to_hf(split)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["num_key_value_heads"] == 16
    # back: 0.3.0's own names, bit for bit (the fused layer comes back split, as its save hook writes it)
    code, _, err = run_cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "uni"), "--map", "torchtitan-llama3")
    assert code == 0, err
    code, _, err = run_cli("export-hf", str(tmp_path / "uni"), str(tmp_path / "native"))
    assert code == 0, err
    back = load_file(tmp_path / "native" / "model.safetensors")
    assert set(back) == set(split)
    assert all(torch.equal(back[k], split[k]) for k in split)


def test_export_fused_needs_head_counts(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save(_fuse_layer0(_model_state()), checkpoint_id=str(tmp_path / "ckpt"))
    code, _, err = run_cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--map", "torchtitan-llama")
    assert code == 2 and "num_attention_heads" in err and "--config" in err
    code, _, err = run_cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--map", "torchtitan-llama",
                           "--config", '{"num_attention_heads": 16, "num_key_value_heads": 3}')
    assert code == 2 and "do not split" in err


@pytest.mark.slow
@pytest.mark.parametrize("mesh, key_map", [("tp2,dp2", "torchtitan-llama"), ("dp_replicate2,dp2", "torchtitan-llama"),
                                           ("tp2,dp2", "torchtitan:llama3")])
def test_trainer_save_exports_byte_identical_to_adapter(titan_checkpoint, tmp_path, mesh, key_map):
    """The hand-written map, and torchtitan's own adapter as the map (run on probes)."""
    from safetensors.torch import save_file

    src = titan_checkpoint(mesh)
    extra = () if key_map.startswith("torchtitan:") else ("--config", json.dumps(HEADS))
    code, _, err = run_cli("export-hf", str(src / "ckpt"), str(tmp_path / "hf"), "--map", key_map, *extra)
    assert code == 0, err
    ref = torch.load(src / "reference.pt", weights_only=False)
    want = _adapter().to_hf({k: v for k, v in ref.items() if isinstance(v, torch.Tensor)})
    save_file({k: v.contiguous() for k, v in want.items()}, tmp_path / "adapter.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "adapter.safetensors").read_bytes()
    if extra:
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is False


@pytest.mark.slow
@pytest.mark.parametrize("export_map, import_map", [("torchtitan-llama", "torchtitan-llama3"),
                                                    ("torchtitan:llama3", "torchtitan:llama3")])
def test_import_hf_loads_in_torchtitan_trainer(titan_checkpoint, tmp_path, export_map, import_map):
    """export-hf, import-hf --map torchtitan-llama3 (or torchtitan's own adapter both ways),
    from-universal to dp2 as torchtitan's step-0 (model-only) checkpoint: its own Trainer loads it
    and every model weight equals the source."""
    src = titan_checkpoint("dp4")
    extra = () if export_map.startswith("torchtitan:") else ("--config", json.dumps(HEADS))
    for args in (("export-hf", str(src / "ckpt"), str(tmp_path / "hf"), "--map", export_map, *extra),
                 ("import-hf", str(tmp_path / "hf"), str(tmp_path / "uni"), "--map", import_map),
                 ("from-universal", str(tmp_path / "uni"), str(tmp_path / "job" / "checkpoint" / "step-0"), "--mesh", "dp2",
                  "--plan", "torchtitan:llama3/debugmodel")):
        code, _, err = run_cli(*args)
        assert code == 0, err
    job = {"mesh": "dp2", "dump": str(tmp_path / "job"), "steps": 1, "reference": str(src / "reference.pt"),
           "skip_compare": ["optimizer", "lr_scheduler", "dataloader", "train_state"]}
    for rep in titan_support.run_job(job, tmp_path / "run"):
        assert rep["loaded"] and rep["loaded_step"] == 0
        assert rep["mismatch"] == [] and rep["compared"] >= 57


LLAMA3_DEBUG_HF = {  # debugmodel's RoPE (ComplexRoPE, llama scaling) and RMSNorm in HF LlamaConfig terms
    "num_attention_heads": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


@pytest.mark.framework("transformers")
def test_transformers_logits_equal_torchtitans_model(tmp_path):
    """The export, loaded by transformers' LlamaForCausalLM, computes the logits of torchtitan's own
    Llama3 model holding the same weights (fused wqkv filled by its load hook)."""
    import torch.distributed.checkpoint as dcp

    transformers = pytest.importorskip("transformers")
    titan_support.apply_cpu_patches()
    from torchtitan.models.llama3 import model_registry

    sd = {k: v * (0.05 if v.ndim == 2 else 1.0) for k, v in _model_state(n_layers=6).items()}
    dcp.save(_fuse_layer0(sd), checkpoint_id=str(tmp_path / "ckpt"))
    code, _, err = run_cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--map", "torchtitan-llama",
                           "--config", json.dumps(LLAMA3_DEBUG_HF))
    assert code == 0, err
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model = model_registry("debugmodel").model.build()
    assert not model.load_state_dict(sd, strict=False).missing_keys
    model.eval()
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(2, 32)
    with torch.no_grad():
        want = model(tokens, positions, model.get_attention_masks(positions))
        got = hf(tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def _gqa_state(n_kv: int = 4) -> dict[str, torch.Tensor]:
    """Layer weights of a GQA Llama (16 heads of 16, ``n_kv`` k/v heads) in 0.3.0's saved names."""
    sd = _model_state(seed=1, n_layers=1)
    g = torch.Generator().manual_seed(2)
    for name in ("wk", "wv"):
        sd[f"layers.0.attention.qkv_linear.{name}.weight"] = torch.randn(16 * n_kv, 256, generator=g)
    return sd


def test_export_fused_gqa_derives_kv_heads_from_the_shapes(tmp_path):
    """Fused wqkv of a GQA model with only num_attention_heads given (as for the split names): the
    k/v head count comes from the fused rows, never the MHA default (which also divides them)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    titan_support.apply_cpu_patches()
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    split = _gqa_state()
    fused = dict(split)
    FusedQKVLinear._merge_qkv_on_load(types.SimpleNamespace(head_dim=16, heads_per_kv=4), fused,
                                      "layers.0.attention.qkv_linear.")
    assert fused["layers.0.attention.qkv_linear.wqkv.weight"].shape == (384, 256)
    dcp.save(fused, checkpoint_id=str(tmp_path / "ckpt"))
    code, _, err = run_cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--map", "torchtitan-llama",
                           "--config", json.dumps(HEADS))
    assert code == 0, err
    attn = types.SimpleNamespace(n_heads=16, n_kv_heads=4, head_dim=None)
    adapter = Llama3StateDictAdapter(types.SimpleNamespace(layers=[types.SimpleNamespace(attention=attn)], dim=256,
                                                            enable_weight_tying=False), None)
    want = adapter.to_hf(split)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == set(want)
    assert all(got[k].shape == want[k].shape and torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_key_value_heads"] == 4
