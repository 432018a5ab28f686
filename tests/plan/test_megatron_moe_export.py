"""export-hf --map megatron-mixtral planned on megatron-core's MoE keys (pure): each HF expert tensor
reads one (layer, expert) slice of the layer- and expert-stacked tensors, ``linear_fc1``'s halves as
``w1`` (gate) / ``w3`` (up); the Mixtral config from the shapes and the args. megatron's own forward
against transformers' Mixtral is in ``tests/e2e/test_megatron_legacy_e2e.py`` (slow)."""

from __future__ import annotations

import numpy as np
import torch

from converter.plan.hf_export import plan_export
from converter.plan.key_maps import MEGATRON_MIXTRAL, megatron_moe_args_config
from converter.plan.mapped_view import Source, mapped_index
from formats.base import Box, CheckpointIndex, ChunkRef, TensorEntry
from formats.dcp.reader import guess_path

L, E, F, H, V = 2, 4, 6, 8, 16
SHAPES = {  # megatron-core's sharded keys of a 2-layer MoE GPT (local spec's norm names)
    "embedding.word_embeddings.weight": (V, H),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
    "decoder.layers.self_attention.linear_qkv.weight": (L, 2 * H, H),
    "decoder.layers.self_attention.linear_proj.weight": (L, H, H),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, H),
    "decoder.layers.mlp.router.weight": (L, E, H),
    "decoder.layers.mlp.experts.experts.linear_fc1.weight": (L, E, 2 * F, H),
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": (L, E, H, F),
    "decoder.final_layernorm.weight": (H,),
    "output_layer.weight": (V, H),
}


def _index() -> CheckpointIndex:
    tensors = {}
    for key, shape in SHAPES.items():
        if key.startswith("decoder.layers."):  # one chunk per layer (and expert), as megatron saves them
            lead = [(l, e) for l in range(L) for e in range(E)] if ".experts." in key else [(l,) for l in range(L)]
            chunks = tuple(ChunkRef(Box((*i, *(0 for _ in shape[len(i):])), (*(1 for _ in i), *shape[len(i):])),
                                    "f", (key, i), 0) for i in lead)
        else:
            chunks = (ChunkRef(Box((0,) * len(shape), shape), "f", (key, ()), 0),)
        tensors[key] = TensorEntry(key, "bfloat16", shape, chunks, guess_path(key))  # (no planner data: megatron's)
    return CheckpointIndex("dcp", "/x", tensors, {}, {})


def test_experts_read_one_layer_and_expert_each():
    config = megatron_moe_args_config({"num_attention_heads": 2, "num_query_groups": 1, "moe_router_topk": 2})
    plan = plan_export(_index(), MEGATRON_MIXTRAL, None, config)
    w1 = plan.sources["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    w3 = plan.sources["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    w2 = plan.sources["model.layers.0.block_sparse_moe.experts.2.w2.weight"]
    assert w1.key == w3.key == "decoder.layers.mlp.experts.experts.linear_fc1.weight" and w1.index == w3.index == (1, 3)
    assert np.array_equal(w1.perm, np.arange(F)) and np.array_equal(w3.perm, np.arange(F, 2 * F))
    assert w2 == Source("decoder.layers.mlp.experts.experts.linear_fc2.weight", None, (0, 2))
    assert plan.sources["model.layers.0.block_sparse_moe.gate.weight"].index == 0
    assert plan.sources["model.layers.1.post_attention_layernorm.weight"].key == \
        "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    specs = {s.name: s.shape for s in plan.specs}
    assert specs["model.layers.1.block_sparse_moe.experts.3.w1.weight"] == (F, H)
    assert specs["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == (H, F)
    assert len(specs) == 3 + L * (7 + 3 * E)  # embed, norm, head; per layer 2 norms, q k v o, gate, experts
    cfg = plan.config
    assert (cfg["model_type"], cfg["num_local_experts"], cfg["intermediate_size"], cfg["num_experts_per_tok"],
            cfg["num_key_value_heads"], cfg["num_hidden_layers"]) == ("mixtral", E, F, 2, 1, L)


def test_the_view_of_an_expert_half_is_its_rows():
    """The mapped view's chunks and region reads of one expert's w3: rows F..2F of [layer, expert]."""
    index = _index()
    plan = plan_export(index, MEGATRON_MIXTRAL, None, {"num_attention_heads": 2, "num_key_value_heads": 1})
    view = mapped_index(index, plan.sources)
    w3 = view.tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    assert w3.shape == (F, H) and len(w3.chunks) == 1
    assert w3.chunks[0].locator.chunk.box == Box((1, 3, 0, 0), (1, 1, 2 * F, H))
    from converter.plan.mapped_view import source_region

    assert source_region(plan.sources[w3.key], Box((2, 0), (3, H))) == Box((1, 3, 2, 0), (1, 1, 3, H))
    assert torch  # (torch is the e2e test's)
