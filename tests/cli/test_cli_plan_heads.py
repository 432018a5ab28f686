"""Issue 18.7: when the head counts are known (``--config``, or a config.json beside the
checkpoint), a TP degree that does not divide them is refused with the message the row-count case
gives: ``tp3`` with 4 heads (48 rows: divisible by 3) and ``tp4`` with 2 KV heads (24 rows)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from test_cli_readable import ckptconv

HEADS, KV_HEADS, HEAD_DIM, DIM = 4, 2, 12, 48


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Llama-shaped torchtitan state dict (4 heads of 12, 2 KV heads) saved by dcp.save."""
    g = torch.Generator().manual_seed(0)
    sd = {"tok_embeddings.weight": torch.randn(64, DIM, generator=g), "norm.weight": torch.ones(DIM),
          "output.weight": torch.randn(64, DIM, generator=g)}
    for i in range(2):
        p = f"layers.{i}."
        sd |= {p + "attention.wq.weight": torch.randn(HEADS * HEAD_DIM, DIM, generator=g),
               p + "attention.wk.weight": torch.randn(KV_HEADS * HEAD_DIM, DIM, generator=g),
               p + "attention.wv.weight": torch.randn(KV_HEADS * HEAD_DIM, DIM, generator=g),
               p + "attention.wo.weight": torch.randn(DIM, HEADS * HEAD_DIM, generator=g),
               p + "feed_forward.w1.weight": torch.randn(96, DIM, generator=g),
               p + "feed_forward.w2.weight": torch.randn(DIM, 96, generator=g),
               p + "feed_forward.w3.weight": torch.randn(96, DIM, generator=g),
               p + "attention_norm.weight": torch.ones(DIM), p + "ffn_norm.weight": torch.ones(DIM)}
    path = tmp_path_factory.mktemp("heads") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path))
    return path


CONFIG = json.dumps({"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})


def _plan(ckpt, tmp_path, mesh, *extra):
    return ckptconv("from-universal", str(ckpt), str(tmp_path / "out"), "--mesh", mesh, "--plan", "llama",
                    "--dry-run", *extra)


def test_unknown_heads_only_rows_are_checked(ckpt, tmp_path):
    assert _plan(ckpt, tmp_path, "tp3").returncode == 0  # 48 rows split by 3: nothing says it is wrong
    proc = _plan(ckpt, tmp_path, "tp5")
    assert proc.returncode == 2 and "is not divisible by tp5" in proc.stderr and "pick a tp that divides it" in proc.stderr


@pytest.mark.parametrize("mesh,needle", [
    ("tp3", "layers.0.attention.wq.weight: its 4 attention heads are not divisible by tp3"),
    ("tp4,dp2", "layers.0.attention.wk.weight: its 2 KV heads are not divisible by tp4"),
])
def test_config_option_refuses_head_splits(ckpt, tmp_path, mesh, needle):
    proc = _plan(ckpt, tmp_path, mesh, "--config", CONFIG)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ckptconv: error: {needle}"), lines
    assert "heads must split evenly" in lines[0] and lines[0].endswith("pick a tp that divides it")
    assert not (tmp_path / "out").exists()


def test_config_beside_the_checkpoint(ckpt, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in ckpt.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "config.json").write_text(json.dumps({"n_heads": HEADS, "n_kv_heads": KV_HEADS}))  # torchtitan names
    proc = _plan(src, tmp_path, "tp4")
    assert proc.returncode == 2 and "its 2 KV heads are not divisible by tp4" in proc.stderr
    assert "config.json" in proc.stderr
    proc = _plan(src, tmp_path, "tp2,dp2")
    assert proc.returncode == 0, proc.stderr


def test_dividing_tp_converts_and_loads(ckpt, tmp_path):
    out = tmp_path / "out"
    proc = ckptconv("from-universal", str(ckpt), str(out), "--mesh", "tp2", "--plan", "llama", "--config", CONFIG)
    assert proc.returncode == 0, proc.stderr
    from converter.tools.demo import load_with_torch
    from converter.run.sources import open_checkpoint

    got = load_with_torch(out, open_checkpoint(out).index())
    ref = load_with_torch(ckpt, open_checkpoint(ckpt).index())
    assert all(torch.equal(got[k], ref[k]) for k in ref)
