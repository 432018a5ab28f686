"""Megatron-core 0.19.2's own ``dist_checkpointing.load`` of ckptconv's conversions into a real GPTModel
with its DistributedOptimizer on the target layout, bit-exact (``-m slow``: multi-process gloo runs).

Sources: ``tests/data/megatron/gpt_tp2_dp2`` (saved by megatron at TP2 x DP2) and a PP2 x DP2 save made
here. Each case converts (through the universal store, or DCP to DCP) to the target mesh, then
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

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "megatron" / "gpt_tp2_dp2"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    reason = ms.skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("megatron")
    pp2 = root / "pp2_dp2"
    ms.save_checkpoint(pp2, tp=1, pp=2, dp=2, work=root / "pp2.run")
    return {"tp2,dp2": FIXTURE, "pp2,dp2": pp2}


CASES = [  # (source, via the store, target mesh, (tp, pp, dp) megatron loads with, rng_state kept)
    ("tp2,dp2", True, "dp2", (1, 1, 2), False),  # TP2 -> TP1
    ("tp2,dp2", False, "tp2,dp2", (2, 1, 2), True),  # same layout, DCP -> DCP
    ("tp2,dp2", True, "tp2", (2, 1, 1), True),  # DP change
    ("tp2,dp2", True, "pp2,tp2", (2, 2, 1), False),  # PP1 -> PP2
    ("pp2,dp2", True, "tp2,dp2", (2, 1, 2), False),  # PP2 -> TP2
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
    reports = ms.load_and_compare(source, out, tp=tp, pp=pp, dp=dp, work=tmp_path / "load", rng=rng)
    for rep in reports:
        assert rep["mismatch"] == [], (rep["rank"], rep["mismatch"][:5])
        assert rep["compared"] >= 20 and rep["iteration"] == 2
    print(f"\n{src} -> {mesh}: convert {t1 - t0:.1f} s, megatron load+compare {time.time() - t1:.1f} s, "
          f"{len(reports)} ranks, {sum(r['compared'] for r in reports)} values compared")
