"""Small torchtitan 0.3.0-named training checkpoints and the torch transforms that give their
expected HF-named weights and optimizer states (HF's RoPE permutation of
``convert_llama_weights_to_hf``, torchtitan's ``FusedQKVLinear`` split/merge), computed with torch,
never with ckptconv's planning: shared by tests/plan/test_cross_map.py and
tests/commands/test_cross_map_cli.py."""

from __future__ import annotations

import torch

from mem_checkpoint import MemCheckpoint

DIM, HEADS, KV, HD, FFN, VOCAB, LAYERS = 16, 4, 2, 4, 24, 10, 2
HPK = HEADS // KV
CFG = {"num_attention_heads": HEADS, "num_key_value_heads": KV}
STATES = ("exp_avg", "exp_avg_sq")
HPARAMS = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "initial_lr": 1e-3}


# ---------------------------------------------------------------- the transforms, in torch


def rope_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's convert_llama_weights_to_hf permutation (interleaved pairs -> rotate-half)."""
    hd = w.shape[0] // heads
    return w.view(heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    hd = w.shape[0] // heads
    return w.view(heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def split_qkv(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's FusedQKVLinear._split_qkv_on_save (rows grouped per KV head)."""
    v = w.view(KV, HPK + 2, HD, *w.shape[1:])
    return (v[:, :HPK].reshape(-1, *w.shape[1:]), v[:, HPK].reshape(-1, *w.shape[1:]),
            v[:, HPK + 1].reshape(-1, *w.shape[1:]))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torchtitan's FusedQKVLinear._merge_qkv_on_load."""
    rest = q.shape[1:]
    return torch.cat([q.view(KV, HPK, HD, *rest), k.view(KV, 1, HD, *rest), v.view(KV, 1, HD, *rest)], 1).reshape(-1, *rest)


# ---------------------------------------------------------------- checkpoints


def titan_model(g: torch.Generator) -> dict[str, torch.Tensor]:
    """torchtitan 0.3.0 Llama weights as its model saves them (split q/k/v)."""
    sd = {"tok_embeddings.weight": torch.randn(VOCAB, DIM, generator=g), "norm.weight": torch.randn(DIM, generator=g),
          "lm_head.weight": torch.randn(VOCAB, DIM, generator=g)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        for name, shape in (("attention.qkv_linear.wq.weight", (HEADS * HD, DIM)),
                            ("attention.qkv_linear.wk.weight", (KV * HD, DIM)),
                            ("attention.qkv_linear.wv.weight", (KV * HD, DIM)), ("attention.wo.weight", (DIM, DIM)),
                            ("feed_forward.w1.weight", (FFN, DIM)), ("feed_forward.w2.weight", (DIM, FFN)),
                            ("feed_forward.w3.weight", (FFN, DIM)), ("attention_norm.weight", (DIM,)),
                            ("ffn_norm.weight", (DIM,))):
            sd[p + name] = torch.randn(*shape, generator=g)
    return sd


def optimizer_fqns(model: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """torchtitan 0.3.0's optimizer names: the fused wqkv instead of its parts."""
    out = {}
    for k, t in model.items():
        if ".qkv_linear.wk." in k or ".qkv_linear.wv." in k:
            continue
        if ".qkv_linear.wq." in k:
            out[k.replace("wq.weight", "wqkv.weight")] = (HEADS * HD + 2 * KV * HD, DIM)
        else:
            out[k] = tuple(t.shape)
    return out


def titan_checkpoint(seed: int = 0, **extra_states: tuple) -> tuple[MemCheckpoint, dict, dict]:
    """A torchtitan 0.3.0 training checkpoint (flattened optimizer, per-parameter hyperparameters)."""
    g = torch.Generator().manual_seed(seed)
    model = titan_model(g)
    states = {fqn: {s: torch.randn(*shape, generator=g) for s in STATES} | {"step": torch.tensor(7.0)}
              for fqn, shape in optimizer_fqns(model).items()}
    for fqn, (name, shape) in extra_states.items():
        states[fqn][name] = torch.randn(*shape, generator=g)
    tensors = {k: (t, (k,)) for k, t in model.items()}
    objects = {"train_state.step": (7, ("train_state", "step"))}
    for fqn, st in states.items():
        for name, t in st.items():
            tensors[f"optimizer.state.{fqn}.{name}"] = (t, ("optimizer", f"state.{fqn}.{name}"))
        for name, v in HPARAMS.items():
            objects[f"optimizer.param_groups.{fqn}.{name}"] = (v, ("optimizer", f"param_groups.{fqn}.{name}"))
    return MemCheckpoint(tensors, objects), model, states


def hf_of_titan(model: dict, states: dict) -> tuple[dict, dict]:
    """The HF-named weights and states of a torchtitan checkpoint, by torch ops."""
    ren = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    lay = {"attention.wo.weight": "self_attn.o_proj.weight", "feed_forward.w1.weight": "mlp.gate_proj.weight",
           "feed_forward.w2.weight": "mlp.down_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
           "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
    weights, st = {}, {}
    for i in range(LAYERS):
        for a, b in lay.items():
            ren[f"layers.{i}.{a}"] = f"model.layers.{i}.{b}"
    for k, t in model.items():
        if ".qkv_linear." in k:
            i, part = k.split(".")[1], k.split(".")[-2]
            name = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj"}[part]
            heads = {"wq": HEADS, "wk": KV}.get(part)
            weights[f"model.layers.{i}.self_attn.{name}.weight"] = t if heads is None else rope_to_hf(t, heads)
        else:
            weights[ren[k]] = t
    for fqn, s in states.items():
        if ".wqkv." in fqn:
            i = fqn.split(".")[1]
            parts = {r: split_qkv(s[r]) for r in STATES}
            for j, (name, heads) in enumerate((("q_proj", HEADS), ("k_proj", KV), ("v_proj", None))):
                hf = f"model.layers.{i}.self_attn.{name}.weight"
                st[hf] = {r: parts[r][j] if heads is None else rope_to_hf(parts[r][j], heads) for r in STATES}
                st[hf]["step"] = s["step"]
        else:
            st[ren[fqn]] = s
    return weights, st
