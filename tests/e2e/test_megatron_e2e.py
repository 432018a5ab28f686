"""Megatron-core 0.19.2's own ``dist_checkpointing.load`` of ckptconv's conversions into a real GPTModel
with its DistributedOptimizer on the target layout, bit-exact (``-m slow``: multi-process gloo runs).

Sources: ``tests/data/megatron/gpt_tp2_dp2`` (saved by megatron at TP2 x DP2), a PP2 x DP2 save and a
TP2 x DP2 save with Megatron-LM's default ``dp_reshardable`` optimizer format and one with megatron's
plain (non-distributed) mixed-precision optimizer, made here. Each case converts (through the universal store, or DCP to DCP) to the target mesh, then
megatron loads both the SOURCE and the conversion into two GPTModels on the target layout (megatron
reshards its own checkpoints on load, so the source's load is the oracle) and every model parameter,
fp32 main param, Adam state and step, param group and common-state value (args, iteration; rng_state
where the layout is unchanged) must be equal bit for bit on every rank.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import megatron_support as ms
from cli_runner import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.framework("megatron")]

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "megatron" / "gpt_tp2_dp2"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    reason = ms.skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("megatron")
    out = {"tp2,dp2": FIXTURE}
    return _Lazy(out, root)


class _Lazy(dict):
    """Sources saved by megatron on first use (each save is a minute of gloo ranks)."""

    def __init__(self, known: dict, root: Path) -> None:
        super().__init__(known)
        self.root = root

    def __missing__(self, name: str) -> Path:
        path = self.root / name.replace(",", "_")
        if name == "pp2,dp2":
            ms.save_checkpoint(path, tp=1, pp=2, dp=2, work=self.root / "pp2.run")
        elif name == "tp2,dp2,plain_optimizer":
            ms.save_checkpoint(path, tp=2, pp=1, dp=2, spec=ms.GPTSpec(distributed_optimizer=False),
                               work=self.root / "plain.run")
        elif name == "tp2,dp2,dp_reshardable":
            ms.save_checkpoint(path, tp=2, pp=1, dp=2, spec=ms.GPTSpec(sharding="dp_reshardable"),
                               work=self.root / "dpr.run")
        else:
            raise KeyError(name)
        self[name] = path
        return path


CASES = [  # (source, via the store, target mesh, (tp, pp, dp) megatron loads with, rng_state kept)
    ("tp2,dp2", True, "dp2", (1, 1, 2), False),  # TP2 -> TP1
    ("tp2,dp2", False, "tp2,dp2", (2, 1, 2), True),  # same layout, DCP -> DCP
    ("tp2,dp2", True, "tp2", (2, 1, 1), True),  # DP change
    ("tp2,dp2", True, "pp2,tp2", (2, 2, 1), False),  # PP1 -> PP2
    ("pp2,dp2", True, "tp2,dp2", (2, 1, 2), False),  # PP2 -> TP2
    # (Megatron-LM's default dp_reshardable optimizer format converts to fully_reshardable: megatron's
    # load of that differs from its dp_reshardable load in the per-parameter Adam step tensors, so its
    # oracle is the same state saved fully_reshardable: tests/e2e/test_megatron_legacy_e2e.py)
    # megatron's plain mixed-precision optimizer (optimizer.state.fp32_param.<key>): TP2 -> TP1
    ("tp2,dp2,plain_optimizer", True, "dp2", (1, 1, 2), False),
]


@pytest.mark.parametrize("src,via_store,mesh,load,rng", CASES,
                         ids=[f"{s}-to-{m}{'-store' if v else ''}" for s, v, m, _, _ in CASES])
def test_megatron_loads_the_conversion_bit_exact(sources, tmp_path, src, via_store, mesh, load, rng):
    source = sources[src]
    t0 = time.time()
    if via_store:
        code, _, err = run_cli("to-universal", str(source), str(tmp_path / "store"))
        assert code == 0, err
        source_for_target = tmp_path / "store"
    else:
        source_for_target = source
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(source_for_target), str(out), "--mesh", mesh)
    assert code == 0, err
    assert ("rng_state" in err) is not rng
    assert (out / "metadata.json").read_bytes() == (source / "metadata.json").read_bytes()
    t1 = time.time()
    tp, pp, dp = load
    spec = ms.GPTSpec(sharding="dp_reshardable") if src.endswith("dp_reshardable") else \
        ms.GPTSpec(distributed_optimizer=False) if src.endswith("plain_optimizer") else ms.GPTSpec()
    reports = ms.load_and_compare(source, out, tp=tp, pp=pp, dp=dp, work=tmp_path / "load", rng=rng, spec=spec)
    for rep in reports:
        assert rep["mismatch"] == [], (rep["rank"], rep["mismatch"][:5])
        assert rep["compared"] >= 20 and rep["iteration"] == 2
    print(f"\n{src} -> {mesh}: convert {t1 - t0:.1f} s, megatron load+compare {time.time() - t1:.1f} s, "
          f"{len(reports)} ranks, {sum(r['compared'] for r in reports)} values compared")


@pytest.mark.framework("transformers")  # and megatron (the module's mark)
def test_hf_export_runs_like_megatron(tmp_path):
    """export-hf --map megatron-llama, loaded by transformers' LlamaForCausalLM, gives megatron's own
    logits (GPTModel loaded by megatron from the source checkpoint) on the same tokens: the q/k/v
    split per query group and the gate/up halves are megatron's (bf16 weights: compared to bf16
    rounding; swapping gate and up of one layer already moves them 0.010, k and v 0.35)."""
    reason = ms.skip_reason()
    if reason:
        pytest.skip(reason)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from safetensors.torch import load_file

    tokens = [[1, 5, 9, 2, 33, 60, 7, 7, 12, 40, 3, 18, 25, 63, 0, 11]]
    code, _, err = run_cli("export-hf", str(FIXTURE), str(tmp_path / "hf"), "--map", "megatron-llama",
                           "--config", '{"rms_norm_eps": 1e-05, "rope_theta": 10000.0}')
    assert code == 0, err
    want = ms.forward_logits(FIXTURE, tokens, tmp_path / "fwd")
    cfg = LlamaConfig.from_pretrained(tmp_path / "hf")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    missing, unexpected = model.load_state_dict(load_file(tmp_path / "hf" / "model.safetensors"), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    with torch.no_grad():
        got = model(torch.tensor(tokens)).logits.float()
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    # bf16 on both sides: within 2 bf16 ulps of the largest logit (a gate/up or k/v swap is 2.5x / 90x that)
    assert err <= 2 * 2.0 ** -8 * max(1.0, scale), (err, scale)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    print(f"\nHF vs megatron logits: max abs diff {err:.4g} (max |logit| {scale:.4g})")


def _gpt2_logits(hf: dict, cfg, tokens):
    """transformers' GPT2LMHeadModel (bf16) on ``tokens`` with the state dict ``hf``."""
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(cfg).to(torch.bfloat16).eval()
    missing, unexpected = model.load_state_dict(hf, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float()


@pytest.mark.framework("transformers")  # and megatron (the module's mark)
def test_hf_export_gpt2_runs_like_megatron(tmp_path):
    """export-hf --map megatron-gpt2 of a real megatron-core GPTModel built GPT-2 style (learned
    absolute positions, LayerNorm with bias, GELU MLP, linear biases, tied embeddings; saved by
    megatron at TP2 after 2 steps), loaded by transformers' GPT2LMHeadModel, gives megatron's own
    logits on the same tokens (bf16: within 2 bf16 ulps of the largest logit); negative controls:
    c_attn without the per-head regrouping, or one c_proj not transposed, miss by far more."""
    reason = ms.skip_reason()
    if reason:
        pytest.skip(reason)
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2Config

    spec = ms.GPTSpec(style="gpt2", num_query_groups=4)
    src = tmp_path / "gpt2"
    t0 = time.time()
    ms.save_checkpoint(src, 2, 1, 1, spec, work=tmp_path / "save")
    tokens = [[1, 5, 9, 2, 33, 60, 7, 7, 12, 40, 3, 18, 25, 63, 0, 11]]
    code, _, err = run_cli("export-hf", str(src), str(tmp_path / "hf"), "--map", "megatron-gpt2")
    assert code == 0, err
    want = ms.forward_logits(src, tokens, tmp_path / "fwd", spec)
    cfg = GPT2Config.from_pretrained(tmp_path / "hf")
    assert (cfg.n_head, cfg.n_layer, cfg.n_embd, cfg.activation_function, cfg.tie_word_embeddings) == \
        (4, 2, 32, "gelu", True)
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    got = _gpt2_logits(hf, cfg, tokens)
    assert got.shape == want.shape
    scale = want.abs().max().item()
    tol = 2 * 2.0 ** -8 * max(1.0, scale)
    err = (got - want).abs().max().item()
    assert err <= tol, (err, scale)
    top2 = want.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * tol  # positions whose best token is not a bf16 near-tie
    assert clear.any() and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    heads, hd = 4, 8
    unregrouped = dict(hf)  # c_attn back in megatron's per-head [q_h, k_h, v_h] order: a wrong ordering
    w = hf["transformer.h.0.attn.c_attn.weight"]
    unregrouped["transformer.h.0.attn.c_attn.weight"] = \
        w.t().reshape(3, heads, hd, -1).transpose(0, 1).reshape(3 * heads * hd, -1).t().contiguous()
    untransposed = dict(hf)  # one square Conv1D weight left as megatron's Linear [out, in]: a missed transpose
    untransposed["transformer.h.1.attn.c_proj.weight"] = hf["transformer.h.1.attn.c_proj.weight"].t().contiguous()
    misses = {name: (_gpt2_logits(bad, cfg, tokens) - want).abs().max().item()
              for name, bad in (("ordering", unregrouped), ("transpose", untransposed))}
    assert all(m > 4 * tol for m in misses.values()), (misses, tol)
    print(f"\nHF GPT-2 vs megatron logits: max abs diff {err:.4g} (max |logit| {scale:.4g}, tol {tol:.3g}); "
          f"wrong ordering {misses['ordering']:.3g}, missed transpose {misses['transpose']:.3g}; "
          f"{time.time() - t0:.0f} s")
