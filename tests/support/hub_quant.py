"""Hub-shaped quantized checkpoints, written here with the safetensors library (no ckptconv code).

- :func:`write_fp8_hub`: DeepSeek-V3's FP8 layout (names, sharding with an index, config.json with
  ``quantization_config``): every linear ``*.weight`` of the layers in ``float8_e4m3fn`` with a
  float32 ``*.weight_scale_inv`` per block (edge blocks partial, as the hub's 576-row
  ``kv_a_proj_with_mqa``), quantized by a per-block loop written out below; embeddings, norms,
  router, ``e_score_correction_bias`` and ``lm_head`` in bf16 / float32.
- :func:`write_mxfp4_hub`: gpt-oss's MXFP4 layout: ``mlp.experts.{gate_up,down}_proj_blocks``
  (uint8 ``[E, rows, cols / 32, 16]``) and ``_scales`` (uint8 e8m0 ``[E, rows, cols / 32]``), the
  rest in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv) of a 2-d float tensor, one block at a time: scale = 448 /
    amax (1 for a zero block), q = clamp(w * scale), scale_inv = 1 / scale."""
    rows, cols = w.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    inv = torch.empty(nr, nc, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            x = w[r, c].to(torch.float32)
            amax = x.abs().amax()
            scale = FP8_MAX / amax if amax > 0 else torch.tensor(1.0)
            q[r, c] = torch.clamp(x * scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            inv[i, j] = (1.0 / scale).to(torch.float32)
    return q, inv


def deepseek_shapes(hidden: int = 192, layers: int = 2, experts: int = 4, vocab: int = 300) -> dict[str, tuple]:
    """HF name -> shape of a small DeepSeek-V3 (MLA with q LoRA, one dense then MoE layers)."""
    out: dict[str, tuple] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_a_proj.weight": (96, hidden), p + "self_attn.q_a_layernorm.weight": (96,),
                p + "self_attn.q_b_proj.weight": (4 * 48, 96), p + "self_attn.kv_a_proj_with_mqa.weight": (80, hidden),
                p + "self_attn.kv_a_layernorm.weight": (64,), p + "self_attn.kv_b_proj.weight": (4 * 64, 64),
                p + "self_attn.o_proj.weight": (hidden, 4 * 32), p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,)}
        if i == 0:
            out |= {p + "mlp.gate_proj.weight": (320, hidden), p + "mlp.up_proj.weight": (320, hidden),
                    p + "mlp.down_proj.weight": (hidden, 320)}
            continue
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out |= {q + "gate_proj.weight": (96, hidden), q + "up_proj.weight": (96, hidden), q + "down_proj.weight": (hidden, 96)}
        out |= {p + "mlp.gate.weight": (experts, hidden), p + "mlp.gate.e_score_correction_bias": (experts,),
                p + "mlp.shared_experts.gate_proj.weight": (96, hidden), p + "mlp.shared_experts.up_proj.weight": (96, hidden),
                p + "mlp.shared_experts.down_proj.weight": (hidden, 96)}
    return out | {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}


def _is_quantized(name: str, shape: tuple) -> bool:
    return (len(shape) == 2 and name.startswith("model.layers.") and "norm" not in name
            and not name.endswith("mlp.gate.weight"))


def write_shards(out: Path, tensors: dict[str, torch.Tensor], files: int, config: dict) -> None:
    """``tensors`` in ``files`` shards (round robin by name) with the index and config.json."""
    out.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(files)]
    wmap = {}
    for n, (k, v) in enumerate(tensors.items()):
        groups[n % files][k] = v
        wmap[k] = names[n % files]
    for name, group in zip(names, groups):
        save_file(group, out / name, metadata={"format": "pt"})
    size = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": size}, "weight_map": wmap}  # formatted as transformers writes it
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(config))


def write_fp8_hub(out: Path, block: tuple[int, int] = (128, 128), seed: int = 0, files: int = 3,
                  shapes: dict[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-shaped FP8 checkpoint in ``out``; returns its tensors as written."""
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in (shapes or deepseek_shapes()).items():
        w = torch.randn(shape, generator=g) * 0.05
        if _is_quantized(name, shape):
            q, inv = quantize_blocks(w, block)
            tensors[name], tensors[name[: -len(".weight")] + ".weight_scale_inv"] = q, inv
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = w.to(torch.float32)
        else:
            tensors[name] = w.to(torch.bfloat16)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": list(block)}}
    write_shards(out, tensors, files, config)
    return tensors


def write_mxfp4_hub(out: Path, hidden: int = 64, inter: int = 64, experts: int = 4, layers: int = 2,
                    vocab: int = 100, seed: int = 0, files: int = 2, config: dict | None = None) -> dict[str, torch.Tensor]:
    """A gpt-oss-shaped MXFP4 checkpoint in ``out`` (``config`` defaults to the names only);
    returns its tensors as written."""
    g = torch.Generator().manual_seed(seed)
    heads, kv, hd = 4, 2, 16

    def bf16(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)

    def blocks(e: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
        s = torch.randint(118, 130, (e, rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
        return b, s

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": bf16(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": bf16(heads * hd, hidden), p + "self_attn.q_proj.bias": bf16(heads * hd),
              p + "self_attn.k_proj.weight": bf16(kv * hd, hidden), p + "self_attn.k_proj.bias": bf16(kv * hd),
              p + "self_attn.v_proj.weight": bf16(kv * hd, hidden), p + "self_attn.v_proj.bias": bf16(kv * hd),
              p + "self_attn.o_proj.weight": bf16(hidden, heads * hd), p + "self_attn.o_proj.bias": bf16(hidden),
              p + "self_attn.sinks": bf16(heads), p + "input_layernorm.weight": bf16(hidden),
              p + "post_attention_layernorm.weight": bf16(hidden), p + "mlp.router.weight": bf16(experts, hidden),
              p + "mlp.router.bias": bf16(experts), p + "mlp.experts.gate_up_proj_bias": bf16(experts, 2 * inter),
              p + "mlp.experts.down_proj_bias": bf16(experts, hidden)}
        t[p + "mlp.experts.gate_up_proj_blocks"], t[p + "mlp.experts.gate_up_proj_scales"] = blocks(experts, 2 * inter, hidden)
        t[p + "mlp.experts.down_proj_blocks"], t[p + "mlp.experts.down_proj_scales"] = blocks(experts, hidden, inter)
    t |= {"model.norm.weight": bf16(hidden), "lm_head.weight": bf16(vocab, hidden)}
    cfg = config or {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                     "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                         "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    write_shards(out, t, files, cfg)
    return t
