"""The proof of the Llama map: transformers loads what export-hf writes and computes the same
logits as the torchtitan-style Llama loaded from the original DCP checkpoint; and what transformers
writes goes through import-hf -> from-universal (TP2 x FSDP2, llama plan) -> dcp.load into the
parallelized torchtitan model and gives transformers' logits again.

Needs ``transformers`` (the ``test`` extra); skipped without it (a failure under CI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

try:
    import transformers
except ImportError:  # the framework marker skips every test (fails them under CI)
    transformers = None

pytestmark = pytest.mark.framework("transformers")

from ckpt_factory import build_parallel_model, fixture_info, make_mesh, run_world  # noqa: E402
from models import ModelArgs, build_model  # noqa: E402

from converter import api  # noqa: E402
from converter.config import RunOptions  # noqa: E402
from oracle import bits_equal  # noqa: E402

OPTS = RunOptions(workers=2)
TOL = 1e-5


def hf_config(args: ModelArgs) -> dict:
    """What the torchtitan model's hyperparameters are in HF LlamaConfig terms (the rest of the
    config comes from the weights' shapes)."""
    return {
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len * 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def tokens_for(args: ModelArgs) -> torch.Tensor:
    g = torch.Generator().manual_seed(42)
    return torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=g)


def titan_logits_from_dcp(src: Path, args: ModelArgs, tokens: torch.Tensor) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    model = build_model(args, seed=999)  # other weights: the load must win
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(src))
    with torch.no_grad():
        return model(tokens)


def hf_logits(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits, model


@pytest.fixture(scope="module")
def llama_export(dcp_checkpoint, tmp_path_factory):
    src = dcp_checkpoint("fsdp4")
    args = ModelArgs.from_json(fixture_info(src)["model_args"])
    out = tmp_path_factory.mktemp("hf-llama")
    api.export_hf(src, out, key_map="torchtitan-llama", config=hf_config(args), options=OPTS)
    return src, args, out


def test_transformers_logits_match_torchtitan(llama_export, tmp_path):
    src, args, out = llama_export
    tokens = tokens_for(args)
    ref = titan_logits_from_dcp(src, args, tokens)
    got, model = hf_logits(out, tokens)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= TOL
    # transformers' own writer produces the very same file
    model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def _load_worker(rank: int, world: int, layout: dict, args_json: dict, ckpt: str, tokens_path: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    args = ModelArgs.from_json(args_json)
    model = build_parallel_model(layout, args, make_mesh(layout), seed=777)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state)
    tokens = torch.load(tokens_path)
    with torch.no_grad():
        logits = model(tokens)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    if rank == 0:
        torch.save(logits, out)


@pytest.mark.slow  # ~20 s: runs in CI's framework step
def test_transformers_checkpoint_trains_on_tp2_dp2(llama_export, tmp_path):
    _, args, out = llama_export
    tokens = tokens_for(args)
    ref, model = hf_logits(out, tokens)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir, max_shard_size="40KB")  # a sharded checkpoint written by transformers
    assert (hf_dir / "model.safetensors.index.json").is_file()
    api.import_hf(hf_dir, tmp_path / "uni", key_map="torchtitan-llama", options=OPTS)  # heads from its config.json
    api.from_universal(tmp_path / "uni", tmp_path / "dcp", "tp2,dp2", plan="llama", options=OPTS)
    torch.save(tokens, tmp_path / "tokens.pt")
    layout = {"dp": 2, "tp": 2}
    run_world(_load_worker, 4, (layout, args.to_json(), str(tmp_path / "dcp"), str(tmp_path / "tokens.pt"),
                                str(tmp_path / "logits.pt")), timeout=240)
    got = torch.load(tmp_path / "logits.pt")
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= TOL
    # and the weights themselves went through unchanged: export them back, compare with the source
    api.export_hf(tmp_path / "dcp", tmp_path / "back", key_map="torchtitan-llama",
                  config=json.loads((hf_dir / "config.json").read_text()), options=OPTS)
    from safetensors.torch import load_file

    back, orig = load_file(tmp_path / "back" / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(back) == sorted(orig) and all(bits_equal(back[k], orig[k]) for k in orig)
