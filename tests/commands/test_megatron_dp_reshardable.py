"""megatron's ``dp_reshardable`` DistributedOptimizer state (Megatron-LM's default torch_dist optimizer
format: flat per-bucket buffers, reshardable over DP only) converted offline to ``fully_reshardable``,
so the optimizer survives a TP / PP change (fast: the checked-in fixture).

``tests/data/megatron/legacy_tp2_pp2_vpp2/dp_reshardable`` is the run's state saved by megatron's
``dist_checkpointing.save`` with ``distrib_optim_sharding_type=dp_reshardable``; ``torch_dist/`` the same
state with ``fully_reshardable``: torch's reading of the latter is the oracle. megatron's own load of
conversions on other layouts is in ``tests/e2e/test_megatron_legacy_e2e.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from converter.plan.megatron_optim import layout_of_bucket_numels
from converter.run.optim_view import fully_reshardable
from converter.run.sources import open_checkpoint
from formats.errors import UnsupportedError
from oracle import bits_equal, torch_reference

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "megatron" / "legacy_tp2_pp2_vpp2"
DPR, FULL, LEGACY = FIXTURE / "dp_reshardable", FIXTURE / "torch_dist", FIXTURE / "legacy"


@pytest.fixture(scope="module")
def full_tensors():
    return {k: v for k, v in torch_reference(FULL).items() if isinstance(v, torch.Tensor) and "/shard_" not in k}


def _full(reader, entry) -> torch.Tensor:
    out = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
    for c in entry.chunks:
        out[c.box.slices()] = reader.read_region(entry.key, c, c.box)
    return out


def test_the_view_is_the_fully_reshardable_save(full_tensors):
    """Every fp32 main param and Adam moment cut out of the flat buckets (2 model chunks x 4 (tp, pp)
    groups) equals megatron's own fully_reshardable save of the same state; the buckets and their
    per-group objects are gone, the common state holds rank 0's param groups."""
    raw = open_checkpoint(DPR)
    assert any(k.startswith("optimizer.distributed.dp_group_idx_3.gbuf_idx_1.") for k in raw.index().tensors)
    view = fully_reshardable(raw)
    try:
        index = view.index()
        assert set(index.tensors) == set(full_tensors)
        assert not any(k.startswith("optimizer.distributed.") for k in index.objects)
        for key, entry in index.tensors.items():
            assert bits_equal(_full(view, entry), full_tensors[key]), key
        (common,) = view.load_object("common_state/shard_0_1", trust_pickle=True)
        with open_checkpoint(FULL) as r:
            (want,) = r.load_object("common_state/shard_0_1", trust_pickle=True)
        assert common["optimizer"] == want["optimizer"]
        assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    finally:
        view.close()


def test_the_optimizer_survives_a_tp_and_pp_change(tmp_path, full_tensors):
    store, out = tmp_path / "store", tmp_path / "out"
    code, _, err = run_cli("to-universal", str(DPR), str(store))
    assert code == 0, err
    code, _, err = run_cli("from-universal", str(store), str(out), "--mesh", "dp2")
    assert code == 0, err
    assert "dp_reshardable" not in err and "--no-load-optim" not in err  # nothing dropped: converted
    got = torch_reference(out)
    assert sum(k.startswith("optimizer.state.") for k in got) == 27
    for key, value in full_tensors.items():
        assert bits_equal(got[key], value), key


def test_straight_to_a_legacy_checkpoint(tmp_path):
    """dp_reshardable torch_dist -> legacy on the saved layout: each distrib_optim.pt is the one
    Megatron-LM wrote for the run."""
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(DPR), str(out), "--mesh", "tp2,pp2", "--vpp", "2", "--format",
                           "megatron-legacy")
    assert code == 0, err
    for path in sorted(LEGACY.rglob("distrib_optim.pt")):
        want = torch.load(path, weights_only=False)  # Megatron's own file: torch's reading, the oracle
        got = torch.load(out / path.relative_to(LEGACY), weights_only=False)
        for g in (0, 1):
            (dtype, w), = want[g].items()
            assert list(got[g]) == [dtype]
            for state in ("param", "exp_avg", "exp_avg_sq"):
                assert bits_equal(got[g][dtype][state], w[state]), (path, g, state)


def test_buckets_cut_where_their_sizes_say():
    params = [("a", 10), ("b", 100), ("c", 7)]  # laid out c, b, a
    placed = layout_of_bucket_numels(params, [164, 10])
    assert [(p.name, p.bucket, p.start, p.end) for p in placed] == [("c", 0, 0, 7), ("b", 0, 64, 164),
                                                                   ("a", 1, 164, 174)]
    assert [(p.name, p.bucket) for p in layout_of_bucket_numels(params, [202])] == [("c", 0), ("b", 0), ("a", 0)]
    with pytest.raises(UnsupportedError, match="ends at"):
        layout_of_bucket_numels(params, [100, 102])
    with pytest.raises(UnsupportedError, match="fill 1 of 2"):
        layout_of_bucket_numels(params, [202, 5])
