"""Issue 18.6: HSDP is named HSDP, not ``PP x FSDP``: a real HSDP save (torch's dedup often lets
whole replicas write whole tensors, so the writers form contiguous rank blocks like PP stages) and
ckptconv's own ``dp_replicate2,dp2`` output; a real PP x FSDP save stays PP. PP stages hold
disjoint modules, HSDP replicas the same ones."""

from __future__ import annotations

import json

from test_cli_readable import ckptconv


def _layout(path) -> dict:
    proc = ckptconv("inspect", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["layout"]


def _summary_line(path) -> str:
    proc = ckptconv("inspect", str(path))  # piped, COLUMNS=80
    assert proc.returncode == 0, proc.stderr
    return next(ln.strip("│ ") for ln in proc.stdout.splitlines() if "layout:" in ln)


def test_real_hsdp_save_is_hsdp(dcp_checkpoint):
    path = dcp_checkpoint("hsdp2x2")  # torchtitan's dp_replicate2 x dp_shard2, 4 gloo ranks
    lay = _layout(path)
    assert lay["summary"].startswith("HSDP: dim 0 over 2 shards x 2 replicas"), lay
    assert lay["mesh"] == {"dp_replicate": 2, "dp_shard": 2} and lay["stages"] == [[0, 1, 2, 3]]
    assert "PP" not in _summary_line(path)


def test_ckptconv_hsdp_output_is_hsdp(dcp_checkpoint, tmp_path):
    out = tmp_path / "hsdp"
    proc = ckptconv("from-universal", str(dcp_checkpoint("fsdp4")), str(out), "--mesh", "dp_replicate2,dp2")
    assert proc.returncode == 0, proc.stderr
    lay = _layout(out)
    assert lay["summary"].startswith("HSDP:") and lay["mesh"] == {"dp_replicate": 2, "dp_shard": 2}, lay
    assert "HSDP: dim 0 over 2 shards x 2 replicas" in _summary_line(out)


def test_real_pp_save_stays_pp(dcp_checkpoint, tmp_path):
    lay = _layout(dcp_checkpoint("pp2fsdp2"))
    assert lay["summary"].startswith("PP x FSDP: 2 stages (ranks 0-1 | 2-3)") and lay["mesh"] == {"pp": 2, "dp": 2}
    out = tmp_path / "pp"  # ckptconv's own PP output too
    proc = ckptconv("from-universal", str(dcp_checkpoint("fsdp4")), str(out), "--mesh", "pp2,dp2", "--plan", "llama")
    assert proc.returncode == 0, proc.stderr
    assert _layout(out)["summary"].startswith("PP x FSDP: 2 stages"), _layout(out)


def test_pp_of_hsdp_stages(dcp_checkpoint, tmp_path):
    """PP over HSDP: the replicas of one stage merge, the stages stay apart."""
    out = tmp_path / "pphsdp"
    proc = ckptconv("from-universal", str(dcp_checkpoint("fsdp4")), str(out), "--mesh", "pp2,dp_replicate2,dp2",
                    "--plan", "llama")
    assert proc.returncode == 0, proc.stderr
    lay = _layout(out)
    assert lay["summary"].startswith("PP x HSDP: 2 stages (ranks 0-3 | 4-7)"), lay
    assert lay["mesh"] == {"pp": 2, "dp_replicate": 2, "dp_shard": 2} and lay["stages"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
