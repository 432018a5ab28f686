"""export-hf --map megatron-gpt2 on a hand-made Megatron-core style torch_dist checkpoint (fast, no
megatron needed): Megatron's key names, layer-stacked ``decoder.layers.*`` tensors saved one chunk
per layer and TP2-split (``linear_qkv`` / ``linear_fc1`` by output rows, ``linear_proj`` /
``linear_fc2`` by input columns, the vocabulary in halves) by two gloo ranks through ``dcp.save``
with torch's ShardedTensor and no planner data, as megatron's torch_dist backend writes them.

The oracle is torch: the HF GPT-2 tensors computed from the saved weights with ``reshape`` /
``cat`` / ``.t()`` (c_attn is ``[all q; all k; all v]`` from megatron's per-head ``[q_h, k_h, v_h]``
rows, every Conv1D weight the transpose of megatron's Linear weight). The real megatron GPT-2 model
against transformers' ``GPT2LMHeadModel`` is ``tests/e2e/test_megatron_e2e.py`` (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_runner import run_cli
from ckpt_factory import run_world
from converter.plan.hf_export import plan_export
from converter.plan.key_maps import get_key_map
from converter.plan.mapped_view import Source, transposed_box
from converter.run.mapped_reader import MappedReader
from converter.run.sources import open_checkpoint
from formats.base import Box
from oracle import bits_equal

L, H, HEADS, FFN, V, P = 2, 16, 4, 64, 40, 24
_QKV = "decoder.layers.self_attention.linear_qkv."
_PROJ = "decoder.layers.self_attention.linear_proj."
_FC1 = "decoder.layers.mlp.linear_fc1."
_FC2 = "decoder.layers.mlp.linear_fc2."
#: key -> the dim TP splits (None: whole on rank 0)
_SPLIT = {
    "embedding.word_embeddings.weight": 0, "embedding.position_embeddings.weight": None,
    _QKV + "layer_norm_weight": None, _QKV + "layer_norm_bias": None, _QKV + "weight": 1, _QKV + "bias": 1,
    _PROJ + "weight": 2, _PROJ + "bias": None,
    _FC1 + "layer_norm_weight": None, _FC1 + "layer_norm_bias": None, _FC1 + "weight": 1, _FC1 + "bias": 1,
    _FC2 + "weight": 2, _FC2 + "bias": None,
    "decoder.final_layernorm.weight": None, "decoder.final_layernorm.bias": None, "output_layer.weight": 0,
}


def _weights(dtype: str, tied: bool) -> dict[str, torch.Tensor]:
    """The model weights (megatron names, stacked layers first) of the hand-made checkpoint."""
    g = torch.Generator().manual_seed(7)
    shapes = {
        "embedding.word_embeddings.weight": (V, H), "embedding.position_embeddings.weight": (P, H),
        _QKV + "layer_norm_weight": (L, H), _QKV + "layer_norm_bias": (L, H),
        _QKV + "weight": (L, 3 * H, H), _QKV + "bias": (L, 3 * H), _PROJ + "weight": (L, H, H), _PROJ + "bias": (L, H),
        _FC1 + "layer_norm_weight": (L, H), _FC1 + "layer_norm_bias": (L, H),
        _FC1 + "weight": (L, FFN, H), _FC1 + "bias": (L, FFN), _FC2 + "weight": (L, H, FFN), _FC2 + "bias": (L, H),
        "decoder.final_layernorm.weight": (H,), "decoder.final_layernorm.bias": (H,), "output_layer.weight": (V, H),
    }
    if tied:
        del shapes["output_layer.weight"]
    return {k: torch.randn(s, generator=g).to(getattr(torch, dtype)) for k, s in shapes.items()}


def _save(rank: int, world: int, dest: str, dtype: str, tied: bool) -> None:
    """Each rank's TP half of every split tensor (one chunk per layer of a stacked one)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
    from torch.distributed.checkpoint import DefaultSavePlanner

    sd = {}
    for key, t in _weights(dtype, tied).items():
        stacked = key.startswith("decoder.layers.")
        shards = []
        for layer in range(L) if stacked else [None]:
            piece, offsets = (t[layer: layer + 1], [layer] + [0] * (t.dim() - 1)) if stacked else (t, [0] * t.dim())
            dim = _SPLIT[key]
            if dim is None and rank:
                continue
            if dim is not None:
                n = piece.shape[dim] // world
                piece, offsets[dim] = piece.narrow(dim, rank * n, n), rank * n
            shards.append(Shard(piece.contiguous(), ShardMetadata(offsets, list(piece.shape), f"rank:{rank}/cpu")))
        sd[key] = init_from_local_shards(shards, *t.shape)
    dcp.save(sd, checkpoint_id=dest, planner=DefaultSavePlanner(flatten_state_dict=False))


@pytest.fixture(scope="module", params=[("float32", False), ("bfloat16", True)], ids=["fp32-untied", "bf16-tied"])
def ckpt(request, tmp_path_factory) -> tuple[Path, str, bool]:
    dtype, tied = request.param
    dest = tmp_path_factory.mktemp("mgpt2") / "ckpt"
    run_world(_save, 2, (str(dest), dtype, tied))
    return dest, dtype, tied


def hf_reference(w: dict[str, torch.Tensor], heads: int = HEADS, regroup: bool = True) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors from megatron's, computed with torch (``regroup=False``: c_attn without the
    per-head reordering, the negative control)."""
    hidden = w["embedding.word_embeddings.weight"].shape[1]
    hd = hidden // heads
    out = {"transformer.wte.weight": w["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": w["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": w["decoder.final_layernorm.weight"],
           "transformer.ln_f.bias": w["decoder.final_layernorm.bias"]}
    if "output_layer.weight" in w:
        out["lm_head.weight"] = w["output_layer.weight"]
    for i in range(w[_QKV + "weight"].shape[0]):
        qkv, qkv_b = w[_QKV + "weight"][i], w[_QKV + "bias"][i]
        if regroup:  # rows [head, (q, k, v), head_dim] -> [(q, k, v), head, head_dim]
            qkv = qkv.reshape(heads, 3, hd, hidden).transpose(0, 1).reshape(3 * hidden, hidden)
            qkv_b = qkv_b.reshape(heads, 3, hd).transpose(0, 1).reshape(3 * hidden)
        p = f"transformer.h.{i}."
        out |= {p + "ln_1.weight": w[_QKV + "layer_norm_weight"][i], p + "ln_1.bias": w[_QKV + "layer_norm_bias"][i],
                p + "attn.c_attn.weight": qkv.t(), p + "attn.c_attn.bias": qkv_b,
                p + "attn.c_proj.weight": w[_PROJ + "weight"][i].t(), p + "attn.c_proj.bias": w[_PROJ + "bias"][i],
                p + "ln_2.weight": w[_FC1 + "layer_norm_weight"][i], p + "ln_2.bias": w[_FC1 + "layer_norm_bias"][i],
                p + "mlp.c_fc.weight": w[_FC1 + "weight"][i].t(), p + "mlp.c_fc.bias": w[_FC1 + "bias"][i],
                p + "mlp.c_proj.weight": w[_FC2 + "weight"][i].t(), p + "mlp.c_proj.bias": w[_FC2 + "bias"][i]}
    return {k: v.contiguous() for k, v in out.items()}


def _saved(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint as torch reads it (dcp.load of full tensors)."""
    from oracle import torch_reference

    return torch_reference(path)


@pytest.mark.framework("transformers")  # GPT2LMHeadModel takes the exported state dict
@pytest.mark.parametrize("via_store", [False, True])
def test_export_hf_megatron_gpt2_matches_torch(ckpt, tmp_path, via_store):
    """Every HF GPT-2 tensor bit for bit as torch's reshape / transpose of the saved weights; the
    config from the shapes (n_head from --config); transformers' GPT2LMHeadModel takes the state
    dict with nothing unexpected; the un-regrouped c_attn (negative control) differs."""
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    src, dtype, tied = ckpt
    if via_store:
        assert run_cli("to-universal", str(ckpt[0]), str(tmp_path / "store"))[0] == 0
        src = tmp_path / "store"
    code, _, err = run_cli("export-hf", str(src), str(tmp_path / "hf"), "--map", "megatron-gpt2",
                           "--config", json.dumps({"n_head": HEADS}))
    assert code == 0, err
    got = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        got |= load_file(f)
    saved = _saved(ckpt[0])
    want = hf_reference(saved)
    assert set(got) == set(want)
    for k, v in want.items():
        assert bits_equal(v, got[k]), k
    wrong = hf_reference(saved, regroup=False)
    assert not torch.equal(wrong["transformer.h.0.attn.c_attn.weight"], got["transformer.h.0.attn.c_attn.weight"])
    assert not torch.equal(wrong["transformer.h.1.attn.c_attn.bias"], got["transformer.h.1.attn.c_attn.bias"])
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["n_head"], cfg["n_embd"], cfg["n_layer"], cfg["n_positions"], cfg["vocab_size"], cfg["n_inner"]) == \
        (HEADS, H, L, P, V, FFN)
    assert cfg["tie_word_embeddings"] is tied and cfg["architectures"] == ["GPT2LMHeadModel"]
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(tmp_path / "hf"))
    missing, unexpected = model.load_state_dict(got, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set()), (missing, unexpected)


def test_transposed_view_reads_sub_regions_like_torch(ckpt):
    """MappedReader with ``transpose`` (and a row permutation of one layer of a stacked tensor): the
    view's chunks are the source's transposed, and any sub-region of a chunk reads as torch's
    ``source[layer][perm].t()`` of that region."""
    src, _, _ = ckpt
    saved = _saved(src)
    key = _QKV + "weight"
    perm = np.random.default_rng(3).permutation(3 * H)
    reader = open_checkpoint(src)
    try:
        view = MappedReader(reader, {"t": Source(key, perm, index=1, transpose=True),
                                     "p": Source(_PROJ + "weight", index=0, transpose=True)})
        wants = {"t": saved[key][1][torch.from_numpy(perm)].t(), "p": saved[_PROJ + "weight"][0].t()}
        for name, want in wants.items():
            entry = view.index().tensors[name]
            assert tuple(entry.shape) == tuple(want.shape)
            covered = torch.zeros(want.shape, dtype=torch.bool)
            for chunk in entry.chunks:
                b = chunk.box
                covered[b.offsets[0]: b.ends[0], b.offsets[1]: b.ends[1]] = True
                for region in (b, Box(b.offsets, (max(1, b.sizes[0] // 2), b.sizes[1])),
                               Box((b.ends[0] - 1, b.ends[1] - max(1, b.sizes[1] - 1)), (1, max(1, b.sizes[1] - 1)))):
                    sl = tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes))
                    part = torch.empty(region.sizes, dtype=want.dtype).copy_(want[sl])
                    assert bits_equal(part, view.read_region(name, chunk, region)), (name, region)
                    out = torch.empty(region.sizes, dtype=want.dtype)
                    view.read_region_into(name, chunk, region, memoryview(out.view(torch.uint8).numpy()).cast("B"))
                    assert bits_equal(part, out), (name, region)
            assert bool(covered.all())
    finally:
        reader.close()
    assert transposed_box(Box((1, 2), (3, 4))) == Box((2, 1), (4, 3))


def test_megatron_gpt2_plan_and_refusals(ckpt):
    """Plan: Conv1D weights transposed ([in, out]), c_attn whole; no head count: one-line refusal;
    a GQA checkpoint's args are refused for GPT-2; the map is export only."""
    from converter.plan.key_maps import megatron_gpt2_args_config
    from formats.errors import ConfigError

    reader = open_checkpoint(ckpt[0])
    try:
        index = reader.index()
    finally:
        reader.close()
    plan = plan_export(index, get_key_map("megatron-gpt2"), None, {"n_head": HEADS})
    specs = {s.name: s.shape for s in plan.specs}
    assert specs["transformer.h.0.attn.c_attn.weight"] == (H, 3 * H)
    assert specs["transformer.h.1.mlp.c_fc.weight"] == (H, FFN)
    assert specs["transformer.h.1.mlp.c_proj.weight"] == (FFN, H)
    assert plan.sources["transformer.h.1.mlp.c_fc.weight"].transpose
    assert not plan.sources["transformer.h.1.mlp.c_fc.bias"].transpose
    with pytest.raises(ConfigError, match="n_head|num_attention_heads"):
        plan_export(index, get_key_map("megatron-gpt2"), None, {})
    with pytest.raises(ConfigError, match="grouped-query"):
        megatron_gpt2_args_config({"num_attention_heads": 4, "num_query_groups": 2, "group_query_attention": True})
    assert megatron_gpt2_args_config({"num_attention_heads": 4, "max_position_embeddings": 32, "norm_epsilon": 1e-5,
                                      "openai_gelu": False, "group_query_attention": False, "num_query_groups": 1}) == \
        {"n_head": 4, "n_positions": 32, "layer_norm_epsilon": 1e-5, "activation_function": "gelu"}


def test_megatron_gpt2_is_export_only(tmp_path):
    (tmp_path / "hf").mkdir()
    code, _, err = run_cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "uni"), "--map", "megatron-gpt2")
    assert code == 2 and "export only" in err
