"""``ckptconv diff``: any two checkpoints of any formats, streaming, checked against torch.

The oracle computes every statistic with torch on whole tensors read by torch itself
(``dcp_to_torch_save``); diff must agree while reading only chunk-aligned slabs.
"""

from __future__ import annotations

import importlib
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from converter.api import diff, export_hf, from_universal, to_universal
from formats.base import Box, ChunkRef
from formats.errors import CheckpointNotFoundError, ConfigError
from schemas import validation_errors
from oracle import torch_reference

diff_module = importlib.import_module("converter.tools.diff")  # the module (converter.tools.diff is the function)
from cli_runner import run_cli


def quiet_save(sd: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        dcp.save(sd, checkpoint_id=path)
    return path


def nan_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


def pair() -> tuple[dict, dict]:
    """Two state dicts: equal keys, small and large differences, NaN payloads, signed zeros,
    infinities, integer and bf16 changes, a dtype change, a shape change, missing/extra keys."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(9, 6, generator=g)
    noisy = w + 1e-4 * torch.randn(9, 6, generator=g)
    big = w.clone()
    big[4, 2] += 3.0
    a = {
        "model": {
            "same": w, "noisy": w, "big": w,
            "nan": nan_bits([0x7FC00000, 0x7FC00001, 0x3F800000, 0x00000000, 0x7F800000, 0xFF800000 - 2**32]),
            "bf": w.to(torch.bfloat16), "ids": torch.arange(12, dtype=torch.int64).view(3, 4),
            "cast": w[:4], "reshaped": torch.arange(12.0), "gone": torch.ones(2), "step": torch.tensor(5.0),
        },
        "extra": {"step": 3, "name": "a"},
    }
    ids = a["model"]["ids"].clone()
    ids[2, 1] = -1
    bf = a["model"]["bf"].clone()
    bf[0, 0] = -bf[0, 0]
    b = {
        "model": {
            "same": w.clone(), "noisy": noisy, "big": big,
            # other NaN payload, -0.0 for 0.0, +inf for -inf
            "nan": nan_bits([0x7FC00000, 0x7FC00002, 0x3F800000, 0x80000000 - 2**32, 0x7F800000, 0x7F800000]),
            "bf": bf, "ids": ids, "cast": w[:4].to(torch.bfloat16), "reshaped": torch.arange(12.0).view(3, 4),
            "new": torch.zeros(3), "step": torch.tensor(5.0),
        },
        "extra": {"step": 4, "name": "a"},
    }
    return a, b


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("diff")
    sd_a, sd_b = pair()
    out = {"a": quiet_save(sd_a, root / "a"), "b": quiet_save(sd_b, root / "b")}
    # B again, as a universal store with 40-byte chunks and as a 3-rank reshard of it: its chunks
    # cut A's single chunks at other places
    to_universal(out["b"], root / "b_uni", chunk_bytes=40)
    from_universal(root / "b_uni", root / "b_dp3", "dp3")
    out.update(b_uni=root / "b_uni", b_dp3=root / "b_dp3")
    return out


def oracle(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> dict:
    """Every statistic diff reports, computed with torch on whole tensors."""
    x, y = a.double(), b.double()
    same = (x == y) | (x.isnan() & y.isnan())
    d = (x - y).abs().nan_to_num(nan=math.inf, posinf=math.inf)
    d[same] = 0
    rel = torch.where(d == 0, torch.zeros_like(d), d / y.abs()).nan_to_num(nan=math.inf, posinf=math.inf)
    close = torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    if a.dtype == b.dtype:
        size = a.element_size()
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        mismatch = a.contiguous().view(bits) != b.contiguous().view(bits)
    else:
        mismatch = ~same
    bad = ~close if (~close).any() else mismatch
    first = tuple(int(i) for i in torch.nonzero(bad)[0]) if bad.any() else None
    return {"mismatched": int(mismatch.sum()), "not_close": int((~close).sum()),
            "max_abs": float(d.max()), "max_rel": float(rel.max()), "first": first}


@pytest.mark.parametrize("b_name", ["b", "b_uni", "b_dp3"])
@pytest.mark.parametrize("atol,rtol", [(0.0, 0.0), (1e-3, 0.0), (0.0, 1e-2), (1e-3, 1e-2)])
def test_statistics_match_torch(ckpts, b_name, atol, rtol):
    report = diff(ckpts["a"], ckpts[b_name], atol=atol, rtol=rtol, slab_elements=13)
    ref_a, ref_b = torch_reference(ckpts["a"]), torch_reference(ckpts["b"])
    assert report.only_a == ("model.gone",) and report.only_b == ("model.new",)
    by_key = {t.key: t for t in report.tensors}
    assert set(by_key) == {k for k in ref_a if k in ref_b and isinstance(ref_a[k], torch.Tensor)}
    for key, t in by_key.items():
        a, b = ref_a[key], ref_b[key]
        if a.shape != b.shape:
            assert t.status == "shape" and key == "model.reshaped"
            continue
        want = oracle(a, b, atol, rtol)
        got = {"mismatched": t.mismatched, "not_close": t.not_close, "max_abs": t.max_abs,
               "max_rel": t.max_rel, "first": t.first}
        assert got == want, key
        expected_status = ("dtype" if a.dtype != b.dtype else "equal" if not want["mismatched"]
                           else "close" if not want["not_close"] else "different")
        assert t.status == expected_status, key
    assert by_key["model.same"].status == "equal" and by_key["model.cast"].status == "dtype"
    assert by_key["model.nan"].first == (3,) or by_key["model.nan"].first == (5,)
    objects = {o.key: o.status for o in report.objects}
    assert objects == {"extra.step": "different", "extra.name": "equal"}
    assert not report.same
    assert validation_errors("diff", report.to_json()) == []


def test_nan_payloads_and_signed_zero(ckpts):
    t = {t.key: t for t in diff(ckpts["a"], ckpts["b"]).tensors}["model.nan"]
    # bits differ at the second NaN (other payload), at 0.0 / -0.0, and at -inf / +inf
    assert t.mismatched == 3 and t.not_close == 1 and t.max_abs == math.inf and t.first == (5,)


def test_same_checkpoint_across_formats_and_layouts(dcp_checkpoint, tmp_path):
    src = dcp_checkpoint("tp2dp2")
    to_universal(src, tmp_path / "u")
    from_universal(tmp_path / "u", tmp_path / "dp3", "dp3")
    export_hf(tmp_path / "u", tmp_path / "hf", max_shard_size=20_000)
    for other in (tmp_path / "u", tmp_path / "dp3"):
        report = diff(src, other)
        assert report.same and report.tensors and all(t.status == "equal" for t in report.tensors)
        assert all(o.status == "equal" for o in report.objects) and report.bytes_compared > 0
    report = diff(src, tmp_path / "hf", model_only=True)
    assert report.same and len(report.tensors) > 5 and not report.objects
    plain = diff(src, tmp_path / "hf")
    assert not plain.same and plain.only_a and plain.only_b  # names differ without --model


def test_streams_bounded_slabs(ckpts, monkeypatch):
    """No read is larger than the slab, whatever the tensor; results do not depend on the slab."""
    biggest = []

    class Spy:
        def __init__(self, reader):
            self._r = reader

        def read_region(self, key, chunk, region):
            biggest.append(region.numel)
            return self._r.read_region(key, chunk, region)

        def __getattr__(self, name):
            return getattr(self._r, name)

    real = diff_module.open_checkpoint
    monkeypatch.setattr(diff_module, "open_checkpoint", lambda p, **kw: Spy(real(p, **kw)))
    small = diff(ckpts["a"], ckpts["b_dp3"], atol=1e-3, slab_elements=5)
    assert max(biggest) <= 5 and len(biggest) > 40
    monkeypatch.undo()
    whole = diff(ckpts["a"], ckpts["b_dp3"], atol=1e-3)
    assert [t.to_json() for t in small.tensors] == [t.to_json() for t in whole.tensors]


boxes_1d = st.lists(st.integers(1, 6), min_size=1, max_size=5)


def partition(sizes: list[int], tag: str) -> list[ChunkRef]:
    out, at = [], 0
    for i, s in enumerate(sizes):
        out.append(ChunkRef(Box((at, 0), (s, 3)), f"{tag}{i}", (tag, i)))
        at += s
    return out


@settings(max_examples=200, deadline=None, database=None)
@given(a=boxes_1d, b=boxes_1d)
def test_aligned_regions_cover_exactly_once(a, b):
    total = sum(a)
    b = b[:-1] + [b[-1] + total - sum(b)] if sum(b) < total else None
    if b is None or b[-1] <= 0:
        return
    regions = diff_module.aligned_regions(partition(a, "a"), partition(b, "b"))
    covered = torch.zeros(total, 3, dtype=torch.int32)
    for ca, cb, r in regions:
        assert ca.box.contains(r) and cb.box.contains(r)
        covered[r.slices()] += 1
    assert bool((covered == 1).all())


def test_bad_tolerances_and_paths(ckpts, tmp_path):
    with pytest.raises(ConfigError, match="atol"):
        diff(ckpts["a"], ckpts["b"], atol=-1)
    with pytest.raises(CheckpointNotFoundError):
        diff(ckpts["a"], tmp_path / "nope")


def test_key_filter(ckpts):
    report = diff(ckpts["a"], ckpts["b"], key_pattern="model.n*")
    assert [t.key for t in report.tensors] == ["model.noisy", "model.nan"] or \
        sorted(t.key for t in report.tensors) == ["model.nan", "model.noisy"]
    assert report.only_a == () and report.only_b == ("model.new",)


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli(ckpts, tmp_path):
    code, out, _ = run_cli("diff", str(ckpts["b"]), str(ckpts["b_dp3"]))
    assert code == 0 and "same:" in out
    code, out, _ = run_cli("diff", str(ckpts["a"]), str(ckpts["b_uni"]))
    assert code == 1 and "only in A (1):" in out and "model.gone" in out and "DIFFERENT" in out
    assert "model.big: 1 elements outside tolerance" in out
    code, out, _ = run_cli("diff", "--json", "--key", "model.noisy", "--atol", "1e-3", str(ckpts["a"]), str(ckpts["b"]))
    doc = json.loads(out)
    assert code == 0 and doc["same"] and doc["tensors"][0]["status"] == "close"
    assert validation_errors("diff", doc) == []
    code, out, _ = run_cli("diff", "--json", str(ckpts["a"]), str(ckpts["b"]))
    assert code == 1 and validation_errors("diff", json.loads(out)) == []
    code, _, err = run_cli("diff", str(ckpts["a"]), str(tmp_path / "missing"))
    assert code == 2 and err.startswith("ckptconv: error: ") and len(err.strip().splitlines()) == 1
