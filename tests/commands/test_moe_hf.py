"""HF export/import of torchtitan 0.3.0's MoE models (issue 17, point 3) against torchtitan's own
state-dict adapters (``DeepSeekV3StateDictAdapter``, ``Qwen3StateDictAdapter``) as the oracle.

Grouped experts ``[E, ...]`` export as one HF tensor per expert
(``model.layers.{}.mlp.experts.{}.{gate,up,down}_proj.weight``), the router as ``mlp.gate.weight``,
deepseek's shared experts as ``mlp.shared_experts.*`` and its ``expert_bias_E`` as
``mlp.gate.e_score_correction_bias``; qwen3's adapter writes no ``expert_bias_E``. Import stacks the
experts back. An expert is a region read of the grouped tensor (its slice ``[e]``), never the
whole tensor.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import titan_support
from cli_runner import run_cli

pytestmark = pytest.mark.framework("torchtitan")  # skips (fails under CI) without torchtitan

MODELS = {  # model -> (built-in map, experts in the test state, layers kept)
    "deepseek_v3/debugmodel": ("torchtitan-deepseek-v3", 8, 3),
    "qwen3/debugmodel_moe": ("torchtitan-qwen3", 4, 2),
}


def _config(model: str):
    """torchtitan's model config of ``model``, cut to a few layers and experts (CPU-sized)."""
    titan_support.apply_cpu_patches()
    import importlib

    name, _, flavor = model.partition("/")
    cfg = importlib.import_module(f"torchtitan.models.{name}").model_registry(flavor).model
    _, experts, layers = MODELS[model]
    cfg.layers = cfg.layers[:layers]
    for layer in cfg.layers:
        if getattr(layer, "moe", None) is not None:
            _set_experts(layer.moe, experts, layer.moe.router.top_k)
    return cfg


def _set_experts(moe, experts: int, top_k: int) -> None:
    """Every field of an MoE config that holds the expert count or top-k."""
    moe.num_experts = moe.router.num_experts = moe.router.gate.out_features = experts
    moe.routed_experts.inner_experts.num_experts = moe.routed_experts.token_dispatcher.num_experts = experts
    moe.router.top_k = moe.routed_experts.token_dispatcher.top_k = top_k


def _adapter(model: str):
    cfg = _config(model)
    name = model.partition("/")[0]
    if name == "deepseek_v3":
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter as A
    else:
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as A
    return A(cfg, None)


def _model_state(model: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's saved state dict (its own names, from the model built on meta), random values;
    experts in bf16, the rest fp32 (each dtype must come back bit for bit)."""
    with torch.device("meta"):
        module = _config(model).build()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in module.state_dict().items():
        dtype = torch.bfloat16 if "inner_experts" in k else torch.float32
        out[k] = torch.randn(tuple(v.shape), generator=g).to(dtype)
    return out


def _read_hf(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].contiguous().view(torch.uint8), want[k].contiguous().view(torch.uint8)), k


@pytest.mark.parametrize("model", list(MODELS))
def test_export_equals_adapter_and_import_stacks_back(model, tmp_path):
    import torch.distributed.checkpoint as dcp

    kmap = MODELS[model][0]
    sd = _model_state(model)
    dcp.save({k: v.clone() for k, v in sd.items()}, checkpoint_id=str(tmp_path / "dcp"))
    code, out, err = run_cli("export-hf", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--map", kmap,
                             "--max-shard-size", "2MB")
    assert code == 0, out + err
    got = _read_hf(tmp_path / "hf")
    want = _adapter(model).to_hf(dict(sd))
    _assert_same(got, want)
    assert any(re.fullmatch(r"model\.layers\.1\.mlp\.experts\.\d+\.down_proj\.weight", k) for k in got)
    if model.startswith("deepseek"):
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in got
        assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in got
    else:
        assert not any("expert_bias" in k or "e_score" in k for k in got)

    code, out, err = run_cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "uni"), "--map", kmap)
    assert code == 0, out + err
    code, out, err = run_cli("from-universal", str(tmp_path / "uni"), str(tmp_path / "back"), "--mesh", "dp1")
    assert code == 0, out + err
    back = _adapter(model).from_hf(_read_hf(tmp_path / "hf"))  # torchtitan's own import (torch.stack)
    loaded = {k: torch.zeros_like(v) for k, v in back.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "back"))  # torch's own loader
    _assert_same(loaded, back)
    expected_native = {k for k in sd if not (model.startswith("qwen3") and "expert_bias" in k)}
    assert set(back) == expected_native


def test_expert_is_a_region_read(tmp_path):
    """Exporting expert e reads the box ``[e:e+1, ...]`` of the grouped tensor's chunk, never the
    whole tensor; importing reads each HF expert once into its slot of the stack."""
    import torch.distributed.checkpoint as dcp

    from converter.plan.hf_export import plan_export
    from converter.run.mapped_reader import MappedReader
    from converter.plan.key_maps import get_key_map
    from converter.run.sources import open_checkpoint

    key = "layers.1.moe.routed_experts.inner_experts.w1_EFD"
    dcp.save({key: torch.arange(4 * 6 * 5, dtype=torch.float32).view(4, 6, 5)}, checkpoint_id=str(tmp_path / "dcp"))
    reader = open_checkpoint(str(tmp_path / "dcp"))
    seen = []
    real = reader.read_region_into

    def spy(k, chunk, region, out):
        seen.append((k, region.offsets, region.sizes))
        return real(k, chunk, region, out)

    reader.read_region_into = spy
    plan = plan_export(reader.index(), get_key_map("torchtitan-deepseek-v3"), None, None)
    view = MappedReader(reader, plan.sources)
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    entry = view.index().tensors[name]
    assert entry.shape == (6, 5) and len(entry.chunks) == 1
    region = entry.chunks[0].box
    buf = bytearray(6 * 5 * 4)
    view.read_region_into(name, entry.chunks[0], region, memoryview(buf))
    assert seen == [(key, (2, 0, 0), (1, 6, 5))]
    assert torch.equal(torch.frombuffer(buf, dtype=torch.float32).view(6, 5), torch.arange(60.0, 90.0).view(6, 5))
    reader.close()


def test_missing_expert_and_mixed_shapes_are_one_line_errors(tmp_path):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    t = {f"model.layers.1.mlp.experts.{e}.gate_proj.weight": torch.zeros(4, 2) for e in (0, 1, 3)}
    save_file(t, str(hf / "model.safetensors"))
    code, _, err = run_cli("import-hf", str(hf), str(tmp_path / "uni"), "--map", "torchtitan-deepseek-v3")
    assert code != 0 and "expert 2 of layers.1.moe.routed_experts.inner_experts.w1_EFD is missing" in err
    assert len(err.strip().splitlines()) == 1
    t = {"model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(4, 2),
         "model.layers.1.mlp.experts.1.gate_proj.weight": torch.zeros(4, 3)}
    save_file(t, str(hf / "model.safetensors"))
    code, _, err = run_cli("import-hf", str(hf), str(tmp_path / "uni2"), "--map", "torchtitan-deepseek-v3")
    assert code != 0 and "must all have one dtype and shape" in err and len(err.strip().splitlines()) == 1


def test_map_file_with_experts(tmp_path):
    from converter.plan.key_maps import get_key_map

    path = tmp_path / "map.json"
    path.write_text(json.dumps({"map": {"model.embed_tokens.weight": "emb.weight"},
                                "experts": {"m.{}.e.{}.w": "blocks.{}.experts.w"}}))
    km = get_key_map(str(path))
    assert km.expert_names("blocks.3.experts.w", 2) == ["m.3.e.0.w", "m.3.e.1.w"]
    assert km.expert_of("m.3.e.1.w") == ("blocks.3.experts.w", 1)


QWEN3_MOE_HF = {  # what the weights do not say of torchtitan's qwen3 MoE (the rest is derived from the shapes)
    "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 4096, "intermediate_size": 768,
}
QWEN3_MOE_DERIVED = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 2048,
                     "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 8,
                     "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 8, "tie_word_embeddings": False}


@pytest.mark.slow  # ~16 s: runs in CI's framework step
@pytest.mark.framework("transformers")
def test_transformers_qwen3_moe_logits_equal_torchtitans_model(tmp_path):
    """The export, loaded by transformers' Qwen3MoeForCausalLM, computes the logits of torchtitan's own
    qwen3 MoE model holding the same weights. torchtitan runs its grouped experts in bf16
    (GroupedExperts casts to bf16 for torch._grouped_mm) and HF in fp32: the logits agree to bf16
    rounding, and a wrong expert order (experts 0 and 1 swapped) is far outside it."""
    import torch.distributed.checkpoint as dcp

    transformers = pytest.importorskip("transformers")
    cfg = _config("qwen3/debugmodel_moe")
    for layer in cfg.layers:
        _set_experts(layer.moe, 8, 2)
    torch.manual_seed(0)
    model = cfg.build()
    sd = {k: torch.randn(v.shape) * (0.05 if v.ndim >= 2 else 1.0) for k, v in model.state_dict().items()}
    sd = {k: (v.abs() + 0.5 if k.endswith("norm.weight") else v) for k, v in sd.items()}
    sd = {k: (torch.zeros_like(v) if "expert_bias" in k else v) for k, v in sd.items()}  # HF has no bias
    model.load_state_dict(sd)
    model.eval()
    dcp.save({k: v.clone() for k, v in sd.items()}, checkpoint_id=str(tmp_path / "ckpt"))
    code, out, err = run_cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--map", "torchtitan-qwen3",
                             "--config", json.dumps(QWEN3_MOE_HF))
    assert code == 0, out + err
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: written[k] for k in QWEN3_MOE_DERIVED} == QWEN3_MOE_DERIVED
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(2, 32)
    with torch.no_grad():
        want = model(tokens, positions, model.get_attention_masks(positions))
        got = hf(tokens).logits
    err_ok = (got - want).abs().max().item()
    scale = want.abs().max().item()
    print(f"qwen3 MoE logits: max |HF - torchtitan| {err_ok:.3g} (max |logit| {scale:.3g})")
    assert err_ok < 0.02 * scale, (err_ok, scale)
    with torch.no_grad():  # the same check with two experts swapped in HF fails
        experts = hf.model.layers[0].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name, None)
            if p is not None:
                p.data[[0, 1]] = p.data[[1, 0]]
        bad = (hf(tokens).logits - want).abs().max().item()
    print(f"experts 0 and 1 swapped: {bad:.3g}")
    assert bad > 5 * err_ok, (bad, err_ok)


@pytest.mark.framework("transformers")
def test_deepseek_v3_config_from_shapes(tmp_path):
    """export-hf --config completes DeepSeek-V3's config.json from the weights (the per-head sizes
    from num_attention_heads), and transformers reads it as DeepseekV3Config."""
    import torch.distributed.checkpoint as dcp

    sd = _model_state("deepseek_v3/debugmodel")
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"))
    code, out, err = run_cli("export-hf", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--map", "torchtitan-deepseek-v3",
                             "--config", json.dumps({"num_attention_heads": 16}))
    assert code == 0, out + err
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    want = {"model_type": "deepseek_v3", "vocab_size": 2048, "hidden_size": 256, "num_hidden_layers": 3,
            "n_routed_experts": 8, "moe_intermediate_size": 256, "n_shared_experts": 2, "first_k_dense_replace": 1,
            "intermediate_size": 1024, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "q_lora_rank": None,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "tie_word_embeddings": False}
    assert {k: cfg[k] for k in want} == want
    code, _, err = run_cli("export-hf", str(tmp_path / "dcp"), str(tmp_path / "hf2"), "--map", "torchtitan-deepseek-v3",
                           "--config", json.dumps({"n_routed_experts": 4}))
    assert code == 2 and "n_routed_experts=4 but the weights give 8" in err
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert type(hf_cfg).__name__ == "DeepseekV3Config" and hf_cfg.n_routed_experts == 8
