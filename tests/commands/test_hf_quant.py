"""Block-scaled quantized HF checkpoints: FP8 (DeepSeek-V3) and MXFP4 (gpt-oss).

Oracles: torch's ``QuantizedHuggingFaceStorageReader`` under a real ``dcp.load`` (FP8 and MXFP4
dequantization), transformers' ``convert_moe_packed_tensors`` (MXFP4) and ``Fp8Quantize`` (FP8
quantization), the safetensors library (every file read back), and a per-block loop written out
in ``tests/support/hub_quant.py`` (how the fixtures are quantized).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

from converter import api, knobs
from converter.config import RunOptions
from formats.errors import ConfigError, InvalidCheckpointError
from hub_quant import quantize_blocks, write_fp8_hub, write_mxfp4_hub, write_shards
from oracle import bits_equal, read_safetensors_dir

OPTS = RunOptions(workers=2)


read_hf = read_safetensors_dir


def torch_dequantized(hub: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, block: int) -> dict[str, torch.Tensor]:
    """What torch's own QuantizedHuggingFaceStorageReader loads (dcp.load into ``dtype`` tensors)."""
    sd = {}
    for k, v in tensors.items():
        if k.endswith(("_scale_inv", "_scales")):
            continue
        if k.endswith("_blocks"):
            sd[k] = torch.empty(*v.shape[:-2], v.shape[-2] * v.shape[-1] * 2, dtype=dtype)
        else:
            sd[k] = torch.empty(v.shape, dtype=dtype if v.dtype == torch.float8_e4m3fn else v.dtype)
    dcp.load(sd, storage_reader=QuantizedHuggingFaceStorageReader(str(hub), target_dtype=dtype, block_size=block))
    return sd


@pytest.fixture(scope="module")
def fp8_hub(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8-hub") / "hub"
    return out, write_fp8_hub(out)


# ------------------------------------------------------------------------------------- FP8 import


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_dequantize_equals_torch_quantized_reader(fp8_hub, tmp_path, monkeypatch, dtype):
    hub, tensors = fp8_hub
    monkeypatch.setattr(knobs, "QUANT_SLAB_BYTES", 4096)  # many slabs per region, crossing blocks
    api.import_hf(hub, tmp_path / "uni", dequantize=dtype, options=OPTS, chunk_bytes=8192)
    api.export_hf(tmp_path / "uni", tmp_path / "hf", options=OPTS)
    got = read_hf(tmp_path / "hf")
    ref = torch_dequantized(hub, tensors, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype], 128)
    assert sorted(got) == sorted(ref)  # the scales are gone
    for k, v in ref.items():
        assert bits_equal(got[k], v), k
    assert any(k.endswith("kv_a_proj_with_mqa.weight") for k in ref)  # partial edge blocks (80 of 128 rows)


def test_without_dequantize_both_tensors_are_kept(fp8_hub, tmp_path):
    hub, tensors = fp8_hub
    api.import_hf(hub, tmp_path / "uni", options=OPTS)
    api.export_hf(tmp_path / "uni", tmp_path / "hf", options=OPTS)
    got = read_hf(tmp_path / "hf")
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert bits_equal(got[k], v), k


def test_block_size_comes_from_the_config(tmp_path):
    hub = tmp_path / "hub"
    shapes = {"model.layers.0.mlp.up_proj.weight": (40, 70), "model.layers.0.mlp.down_proj.weight": (70, 40)}
    tensors = write_fp8_hub(hub, block=(16, 32), shapes=shapes, files=1)
    api.import_hf(hub, tmp_path / "uni", dequantize="fp32", options=OPTS)
    api.export_hf(tmp_path / "uni", tmp_path / "hf", options=OPTS)
    got = read_hf(tmp_path / "hf")
    for name in shapes:  # the reference: every element times its own block's scale
        w, inv = tensors[name].to(torch.float32), tensors[name.replace(".weight", ".weight_scale_inv")]
        full = inv.repeat_interleave(16, 0).repeat_interleave(32, 1)[: w.shape[0], : w.shape[1]]
        assert bits_equal(got[name], w * full), name


def test_scales_that_do_not_fit_the_block_are_one_error(tmp_path):
    hub = tmp_path / "hub"
    write_fp8_hub(hub, block=(16, 16), shapes={"model.layers.0.mlp.up_proj.weight": (40, 70)}, files=1)
    with pytest.raises(InvalidCheckpointError, match=r"up_proj.weight_scale_inv: \[3, 5\] scales do not fit .* 128x128"):
        api.import_hf(hub, tmp_path / "uni", dequantize="bf16", config={}, options=OPTS)


def test_dequantize_without_quantized_tensors_warns(tmp_path):
    hub = tmp_path / "hub"
    write_shards(hub, {"a.weight": torch.ones(3, 4, dtype=torch.bfloat16)}, 1, {})
    result = api.import_hf(hub, tmp_path / "uni", dequantize="bf16", options=OPTS)
    assert any("no block-scaled FP8 or MXFP4" in w for w in result.warnings)


# ------------------------------------------------------------------------------------- FP8 export


def test_quantize_round_trip_of_an_fp8_import_is_exact(fp8_hub, tmp_path):
    hub, tensors = fp8_hub
    api.import_hf(hub, tmp_path / "uni", options=OPTS)
    api.export_hf(tmp_path / "uni", tmp_path / "hf", quantize="fp8-block", options=OPTS)
    got = read_hf(tmp_path / "hf")
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert bits_equal(got[k], v), k


def transformers_quantize(value: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own FineGrainedFP8 quantizer (Fp8Quantize) on one weight."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    qc = types.SimpleNamespace(weight_block_size=list(block), scale_fmt=None)
    out = fp8.Fp8Quantize(types.SimpleNamespace(quantization_config=qc))._quantize_one("x.weight", value)
    return out["x.weight"], out["x.weight_scale_inv"]


@pytest.mark.parametrize("memo", [True, False])
def test_quantize_equals_transformers_fp8_quantizer(dcp_checkpoint, tmp_path, monkeypatch, memo):
    """A bf16 FSDP checkpoint (weights split over 2 ranks) exported as FP8 in 16 x 16 blocks: every
    quantized weight and scale equals transformers' quantizer (whole blocks) or the per-block loop
    (partial edge blocks, which transformers leaves unquantized); the rest is copied."""
    if not memo:
        monkeypatch.setattr(knobs, "QUANT_SCALE_MEMO_BYTES", 0)
    src = dcp_checkpoint("bf16_fsdp2")
    cfg = {"quantization_config": {"weight_block_size": [16, 16]}}
    api.export_hf(src, tmp_path / "hf", quantize="fp8-block", config=cfg, options=RunOptions(workers=2, piece_bytes=512))
    got = read_hf(tmp_path / "hf")
    api.export_hf(src, tmp_path / "plain", options=OPTS)
    plain = read_hf(tmp_path / "plain")
    quantized = [k for k in plain if k.endswith(".weight") and plain[k].ndim == 2 and "norm" not in k
                 and "embed" not in k and "output" not in k]
    assert quantized
    whole = 0
    for k in quantized:
        w = plain[k]
        if w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0:
            q, inv = transformers_quantize(w, (16, 16))
            whole += 1
        else:
            q, inv = quantize_blocks(w, (16, 16))
        assert bits_equal(got[k], q), k
        assert bits_equal(got[k.replace(".weight", ".weight_scale_inv")], inv), k
    assert whole
    for k in set(plain) - set(quantized):
        assert bits_equal(got[k], plain[k]), k
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["quantization_config"]["weight_block_size"] == [16, 16]


def test_quantized_export_loads_through_torch_reader(dcp_checkpoint, tmp_path):
    """torch's own FP8 reader dequantizes the export back to values within FP8's precision."""
    src = dcp_checkpoint("bf16_fsdp2")
    out = tmp_path / "hf"
    api.export_hf(src, out, quantize="fp8-block", max_shard_size="4KB", options=OPTS)
    api.export_hf(src, tmp_path / "plain", options=OPTS)
    plain = read_hf(tmp_path / "plain")
    back = torch_dequantized(out, read_hf(out), torch.float32, 128)
    for k, v in back.items():
        assert torch.allclose(v.float(), plain[k].float(), rtol=0.07, atol=1e-6), k


def test_unknown_quantize_kind_is_refused(dcp_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="--quantize int4: unknown"):
        api.export_hf(dcp_checkpoint("bf16_fsdp2"), tmp_path / "hf", quantize="int4", options=OPTS)


class SpyReader:
    """An HFReader recording every (key, box) read through it."""

    def __init__(self, reader):
        self.reader, self.reads = reader, []

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def read_region_into(self, key, chunk, region, out):
        self.reads.append((key, region))
        self.reader.read_region_into(key, chunk, region, out)


def test_dequantized_region_reads_only_its_blocks(tmp_path, monkeypatch):
    from converter.run.quant_reader import DequantizedReader
    from formats.base import Box
    from formats.hf import HFReader

    hub = tmp_path / "hub"
    name, scale = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv"
    tensors = write_fp8_hub(hub, block=(16, 16), shapes={name: (64, 96)}, files=1)
    monkeypatch.setattr(knobs, "QUANT_SLAB_BYTES", 1 << 20)
    spy = SpyReader(HFReader(hub))
    view = DequantizedReader(spy, "float32", (16, 16))
    entry = view.index().tensors[name]
    got = view.read_region(name, entry.chunks[0], Box((20, 40), (10, 30)))  # rows 20-29, cols 40-69
    assert spy.reads == [(name, Box((20, 40), (10, 30))), (scale, Box((1, 2), (1, 3)))]
    w, inv = tensors[name].to(torch.float32), tensors[scale]
    full = inv.repeat_interleave(16, 0).repeat_interleave(16, 1)
    assert bits_equal(got, (w * full)[20:30, 40:70])


# ------------------------------------------------------------------------------------- MXFP4

GPT_OSS = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 4,
           "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"]}


@pytest.fixture(scope="module")
def mx_hub(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GptOssConfig(**GPT_OSS).to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    out = tmp_path_factory.mktemp("mx-hub") / "hub"
    return out, write_mxfp4_hub(out, config=cfg)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_mxfp4_dequantize_equals_transformers(mx_hub, tmp_path, monkeypatch, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hub, tensors = mx_hub
    monkeypatch.setattr(knobs, "QUANT_SLAB_BYTES", 2048)
    api.import_hf(hub, tmp_path / "uni", dequantize=dtype, options=OPTS, chunk_bytes=4096)
    api.export_hf(tmp_path / "uni", tmp_path / "hf", options=OPTS)
    got = read_hf(tmp_path / "hf")
    tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    blocks = [k for k in tensors if k.endswith("_blocks")]
    assert sorted(got) == sorted([k for k in tensors if not k.endswith(("_blocks", "_scales"))]
                                 + [k.removesuffix("_blocks") for k in blocks])
    for k in blocks:
        ref = convert_moe_packed_tensors(tensors[k], tensors[k.replace("_blocks", "_scales")], dtype=tdtype)
        assert bits_equal(got[k.removesuffix("_blocks")], ref), k
    for k in got:
        if k in tensors:
            assert bits_equal(got[k], tensors[k]), k


def test_mxfp4_export_loads_in_transformers_like_its_own_dequantization(mx_hub, tmp_path):
    """transformers itself loads the MXFP4 hub checkpoint dequantized (CPU): the same state and
    logits as from_pretrained of import-hf --dequantize bf16 exported back."""
    transformers = pytest.importorskip("transformers")
    hub, _ = mx_hub
    api.import_hf(hub, tmp_path / "uni", dequantize="bf16", options=OPTS)
    api.export_hf(tmp_path / "uni", tmp_path / "hf", config=transformers.GptOssConfig(**GPT_OSS).to_dict(), options=OPTS)
    ref = transformers.GptOssForCausalLM.from_pretrained(hub, dtype=torch.bfloat16,
                                                         quantization_config=transformers.Mxfp4Config(dequantize=True))
    ours = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    a, b = ref.state_dict(), ours.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert bits_equal(a[k], b[k]), k
    tokens = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(ref(tokens).logits, ours(tokens).logits)


def test_mxfp4_torch_layout_equals_torch_quantized_reader_kernel(mx_hub):
    """With torch's layout (what torchtitan's gpt_oss loads) the view equals the MXFP4 kernel of
    torch's QuantizedHuggingFaceStorageReader run on each whole tensor. (A dcp.load through that
    reader is broken in torch 2.13: its metadata keeps the packed chunk sizes, so the planner
    reads only the first G values of each row.)"""
    from converter.run.quant_reader import DequantizedReader
    from formats.base import full_box
    from formats.hf import HFReader

    hub, tensors = mx_hub
    kernel = QuantizedHuggingFaceStorageReader.__new__(QuantizedHuggingFaceStorageReader)
    kernel.target_dtype = torch.bfloat16
    view = DequantizedReader(HFReader(hub), "bfloat16", (128, 128), "torch")
    index = view.index()
    blocks = [k for k in tensors if k.endswith("_blocks")]
    assert blocks and set(blocks) <= set(index.tensors)
    for k in blocks:
        b, s = tensors[k], tensors[k.replace("_blocks", "_scales")]
        req = types.SimpleNamespace(storage_offsets=[0, 0, 0], lengths=[*b.shape[:2], b.shape[2] * b.shape[3] * 2])
        ref = kernel._dequantize_tensor_mxfp4(b, s, req, 0, 0)
        e = index.tensors[k]
        assert bits_equal(view.read_region(k, e.chunks[0], full_box(e.shape)), ref), k


def test_a_map_naming_blocks_gets_the_torch_layout():
    from converter.commands.import_hf import mx_layout
    from converter.plan.key_maps import IDENTITY, key_map_from_doc

    assert mx_layout(IDENTITY) == "transformers"
    titan_like = key_map_from_doc({"model.layers.{}.mlp.experts.gate_up_proj_blocks": "layers.{}.mlp1_weight"})
    assert mx_layout(titan_like) == "torch"


def test_inspect_shows_logical_shapes(mx_hub, fp8_hub):
    from converter.run.sources import open_checkpoint
    from converter.tools.inspect import build_report
    import jsonschema
    from schemas import load_schema

    hub, _ = mx_hub
    report = build_report(open_checkpoint(hub))
    jsonschema.validate(report, load_schema("inspect"))
    rows = {t["key"]: t for t in report["tensors"]}
    q = rows["model.layers.0.mlp.experts.gate_up_proj_blocks"]["quant"]
    assert q == {"kind": "mxfp4", "role": "data", "logical_name": "model.layers.0.mlp.experts.gate_up_proj",
                 "logical_shape": [4, 64, 128], "block": [32],
                 "partner": "model.layers.0.mlp.experts.gate_up_proj_scales"}
    assert rows["model.layers.0.mlp.experts.gate_up_proj_scales"]["quant"]["role"] == "scales"
    fp8 = {t["key"]: t for t in build_report(open_checkpoint(fp8_hub[0]))["tensors"]}
    assert fp8["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]["quant"]["logical_shape"] == [80, 192]
    assert "quant" not in fp8["model.norm.weight"]


def test_scale_tasks_come_after_their_weights():
    from converter.plan.hf_quant import plan_quantize, scales_after_weights
    from formats.hf import TensorSpec

    specs = [TensorSpec(f"l{i}.weight", "bfloat16", (256, 256)) for i in range(5)]
    q = plan_quantize(specs, (128, 128), only={s.name for s in specs})
    order = [s.name for s in scales_after_weights(q.specs, q.targets, 2)]
    assert order == ["l0.weight", "l1.weight", "l2.weight", "l0.weight_scale_inv", "l3.weight", "l1.weight_scale_inv",
                     "l4.weight", "l2.weight_scale_inv", "l3.weight_scale_inv", "l4.weight_scale_inv"]
