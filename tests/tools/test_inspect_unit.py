"""``inspect`` building blocks on real checkpoints: the report (schema, counts, previews), the
streaming statistics (oracle: torch on the full tensors from ``dcp_to_torch_save``) and the layout
pictures (rendered to a recording rich Console).

The multi-rank checkpoints are the ones :mod:`test_detect` writes (one gloo world, cached for the
session); special dtypes come from a single-process ``dcp.save``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from converter.tools.inspect import (
    NEEDS_TRUST, axis_cells, build_report, key_matcher, render_layout, render_report, render_stats,
)
from converter.tools.stats import slabs, tensor_stats
from formats.base import Box
from formats.dcp import DCPReader
from formats.errors import ConfigError
from schemas import validation_errors

try:
    from test_detect import checkpoints
except ImportError:  # tests collected as a package
    from tests.plan.test_detect import checkpoints


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    return checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def readers(ckpts):
    out = {kind: DCPReader(path) for kind, path in ckpts.items()}
    yield out
    for r in out.values():
        r.close()


def _flat(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for i, item in enumerate(v):
                out.update(_flat(item, f"{key}.{i}."))
        else:
            out[key] = v
    return out


@pytest.fixture(scope="module")
def oracle(ckpts, tmp_path_factory) -> dict[str, dict]:
    """Every checkpoint loaded whole by torch (flattened keys, as DCP names them)."""
    out = {}
    for kind, path in ckpts.items():
        dst = tmp_path_factory.mktemp("oracle") / f"{kind}.pt"
        dcp_to_torch_save(str(path), str(dst))
        out[kind] = _flat(torch.load(dst, weights_only=False))
    return out


SPECIAL_KEYS = ("bf16", "fp8", "i64", "u8", "flag", "empty", "scalar", "cplx", "cube")


@pytest.fixture(scope="module")
def special(tmp_path_factory):
    """A single-process DCP checkpoint with NaN/Inf, bf16, fp8, ints, bool, empty, 0-d, complex."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g)
    x[0, 0], x[1, 1], x[2, 2], x[3, 3], x[3, 4] = math.nan, math.inf, -math.inf, 0.0, -0.0
    model = {
        "bf16": x.to(torch.bfloat16),
        "fp8": x.nan_to_num(0.0, 0.0, 0.0).to(torch.float8_e4m3fn),
        "i64": torch.randint(-2**40, 2**40, (9,), generator=g),
        "u8": torch.randint(0, 255, (3, 4), dtype=torch.uint8, generator=g),
        "flag": torch.rand(11, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3),
        "cplx": torch.randn(4, dtype=torch.complex64, generator=g),
        "cube": torch.randn(64, 3, 5, generator=g),
    }
    path = tmp_path_factory.mktemp("special")
    with pytest.warns(UserWarning):  # no process group: single-process save
        dcp.save({"model": model}, checkpoint_id=str(path))
    reader = DCPReader(path)
    yield reader, model
    reader.close()


# ---------------------------------------------------------------------------------------------
# report


def test_report_validates_and_counts(readers, ckpts, oracle):
    for kind, reader in readers.items():
        report = build_report(reader)
        assert validation_errors("inspect", report) == [], kind
        tensors = {k: v for k, v in oracle[kind].items() if isinstance(v, torch.Tensor)}
        assert report["num_tensors"] == len(tensors)
        assert report["num_objects"] == len(oracle[kind]) - len(tensors)
        assert report["parameters"] == sum(v.numel() for k, v in tensors.items() if k.startswith("model."))
        assert report["tensor_bytes"] == sum(v.numel() * v.element_size() for v in tensors.values())
        assert report["world_size"] == 4 and report["format"] == "dcp" and report["version"] == "1.0.0"
        on_disk = sorted(p for p in os.listdir(ckpts[kind]))
        assert [f["name"] for f in report["files"]] == on_disk
        assert all(f["size"] == (ckpts[kind] / f["name"]).stat().st_size for f in report["files"])
        assert report["file_bytes"] == sum(f["size"] for f in report["files"])
        for row in report["tensors"]:
            assert row["shape"] == list(tensors[row["key"]].shape)


def test_report_rows(readers):
    report = build_report(readers["tp2dp2"])
    rows = {t["key"]: t for t in report["tensors"]}
    w1 = rows["model.w1.weight"]
    assert w1["layout"] == "tp_colwise" and w1["tp_dim"] == 0 and w1["split"] == {"0": 4}
    assert w1["ranks"] == [0, 1, 2, 3] and w1["chunks"] == 4
    assert w1["files"] == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    assert rows["model.w2.weight"]["split"] == {"0": 2, "1": 2}
    # FSDP2 over column-wise TP is named as such, not "tp_colwise d0/4" (issue 24, point 4)
    assert w1["placement"] == "tp_colwise x fsdp d0/4 (tp2 x dp2, strided)"
    assert rows["model.w2.weight"]["placement"] == "tp_rowwise d1/2 x fsdp d0/2"
    assert {r["placement"] for r in rows.values() if r["layout"] == "fsdp"} == {"fsdp d0/2"}  # TP-replicated
    assert build_report(readers["fsdp4"])["tensors"][0]["placement"].startswith("fsdp d0/4")
    assert report["layout"]["mesh"] == {"dp": 2, "tp": 2}
    assert [t["key"] for t in report["tensors"]] == sorted(rows)


def test_object_previews(readers):
    objects = {o["key"]: o for o in build_report(readers["fsdp4"])["objects"]}
    assert objects["extra.frac"]["preview"] == NEEDS_TRUST  # fractions.Fraction is not allowlisted
    assert objects["extra.note"]["preview"] == "'hello'"
    assert objects["extra.step"]["preview"] == "3"
    assert objects["optim.param_groups.0.lr"]["preview"] == "0.01"
    assert all(o["bytes"] > 0 and o["file"].endswith(".distcp") for o in objects.values())
    quiet = build_report(readers["fsdp4"], previews=False)
    assert {o["preview"] for o in quiet["objects"]} == {None}


def test_key_pattern(readers):
    glob = build_report(readers["fsdp4"], "model.w*.weight")
    assert [t["key"] for t in glob["tensors"]] == ["model.w1.weight", "model.w2.weight"]
    assert glob["objects"] == [] and glob["num_tensors"] > 2 and glob["key_pattern"] == "model.w*.weight"
    rx = build_report(readers["fsdp4"], r"re:^extra\.")
    assert rx["tensors"] == [] and [o["key"] for o in rx["objects"]] == ["extra.frac", "extra.note", "extra.step"]
    assert key_matcher(None)("anything")
    assert not key_matcher("model.*")("optim.state.model.x")
    with pytest.raises(ConfigError, match="bad key pattern"):
        key_matcher("re:(")


def test_render_report_and_stats(readers):
    console = Console(record=True, width=120)
    report = build_report(readers["tp2dp2"])
    render_report(report, console)
    render_stats([tensor_stats(readers["tp2dp2"], "model.w1.weight")], console)
    text = console.export_text()
    assert "layout: 2-D: TP x FSDP (dp2 x tp2)" in text
    for key in ("model.w1.weight", "extra.frac", NEEDS_TRUST, "statistics"):
        assert key in text


# ---------------------------------------------------------------------------------------------
# stats


def _expect(t: torch.Tensor) -> dict:
    """The oracle, computed by torch on the whole tensor."""
    if t.is_complex():
        t = t.abs()
    x = t.to(torch.float64).reshape(-1)
    fin = x[torch.isfinite(x)]
    return {
        "count": t.numel(), "finite": fin.numel(), "nan": int(torch.isnan(x).sum()),
        "posinf": int((x == math.inf).sum()), "neginf": int((x == -math.inf).sum()),
        "zeros": int((x == 0).sum()),
        "mean": float(fin.mean()) if fin.numel() else None,
        "std": float(fin.std(correction=0)) if fin.numel() else None,
        "min": float(fin.min()) if fin.numel() else None,
        "max": float(fin.max()) if fin.numel() else None,
    }


def _check(stats, t: torch.Tensor) -> None:
    want = _expect(t)
    for name in ("count", "finite", "nan", "posinf", "neginf", "zeros"):
        assert getattr(stats, name) == want[name], (stats.key, name)
    for name in ("mean", "std", "min", "max"):
        got = getattr(stats, name)
        if want[name] is None:
            assert got is None
        else:
            assert got == pytest.approx(want[name], rel=1e-9, abs=1e-12), (stats.key, name)


def test_stats_match_torch_on_sharded_checkpoints(readers, oracle):
    for kind in ("fsdp4", "tp2dp2"):
        for key in readers[kind].index().tensors:
            stats = tensor_stats(readers[kind], key, piece_bytes=64)  # 8 elements per slab
            _check(stats, oracle[kind][key])


def test_stats_special_dtypes(special):
    reader, model = special
    for name in SPECIAL_KEYS:
        stats = tensor_stats(reader, f"model.{name}", piece_bytes=40)
        _check(stats, model[name])
        assert stats.dtype == str(model[name].dtype).removeprefix("torch.")
    i64 = tensor_stats(reader, "model.i64")
    assert (i64.min, i64.max) == (int(model["i64"].min()), int(model["i64"].max()))  # exact ints
    assert isinstance(i64.min, int)
    assert tensor_stats(reader, "model.cplx").of == "abs"
    doc = {**build_report(reader), "stats": [tensor_stats(reader, f"model.{n}").to_json() for n in SPECIAL_KEYS]}
    assert validation_errors("inspect", doc) == []
    empty = tensor_stats(reader, "model.empty")
    assert empty.count == 0 and empty.mean is None and empty.min is None
    assert tensor_stats(reader, "model.scalar").to_json()["shape"] == []


class _Spy:
    """A reader that records the size of every region read."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def index(self):
        return self.inner.index()

    def read_region(self, key, chunk, region):
        self.sizes.append(region.numel)
        return self.inner.read_region(key, chunk, region)


def test_stats_never_read_more_than_a_piece(special, readers):
    spy = _Spy(special[0])
    tensor_stats(spy, "model.cube", piece_bytes=8 * 4)  # 4 float64 per slab: rows of 5 get split
    assert max(spy.sizes) <= 4 and sum(spy.sizes) == 64 * 3 * 5
    spy = _Spy(readers["fsdp4"])
    tensor_stats(spy, "model.tok.weight", piece_bytes=8 * 32)
    assert max(spy.sizes) <= 32 and sum(spy.sizes) == 50 * 16


def test_slabs_tile_the_box():
    box = Box((3, 0, 2), (5, 4, 6))
    for max_elems in (1, 5, 6, 24, 25, 1000):
        parts = list(slabs(box, max_elems))
        assert all(p.numel <= max(max_elems, 1) for p in parts)
        assert sum(p.numel for p in parts) == box.numel
        assert all(box.contains(p) for p in parts)
        seen = set()
        for p in parts:
            cells = {(a, b, c) for a in range(p.offsets[0], p.ends[0]) for b in range(p.offsets[1], p.ends[1])
                     for c in range(p.offsets[2], p.ends[2])}
            assert not cells & seen
            seen |= cells
    assert list(slabs(Box((), ()), 1)) == [Box((), ())]


# ---------------------------------------------------------------------------------------------
# layout pictures


def _picture(index, key: str, **kw) -> tuple[list[str], list[str]]:
    """(grid lines without the row labels, legend lines) of render_layout's output."""
    console = Console(record=True, width=80)
    render_layout(index, key, console, **kw)
    lines = console.export_text().splitlines()
    grid = [ln.split("|", 1)[1] for ln in lines if "|" in ln]
    legend = [ln for ln in lines[1:] if " rank " in ln or " chunk " in ln]  # lines[0]: the head ("1 chunk")
    return grid, legend


def _bands(grid: list[str]) -> list[tuple[str, int]]:
    """Consecutive runs of identical lines: (line, height)."""
    out: list[tuple[str, int]] = []
    for ln in grid:
        if out and out[-1][0] == ln:
            out[-1] = (ln, out[-1][1] + 1)
        else:
            out.append((ln, 1))
    return out


def test_picture_fsdp4_four_bands_last_smaller(readers):
    grid, legend = _picture(readers["fsdp4"].index(), "model.tok.weight")
    bands = _bands(grid)
    assert [set(ln) for ln, _ in bands] == [{"0"}, {"1"}, {"2"}, {"3"}]
    heights = [h for _, h in bands]
    assert heights[0] == heights[1] == heights[2] > heights[3]  # 13, 13, 13, 11 rows
    assert all(len(ln) == len(grid[0]) > 40 for ln in grid)  # scaled to the width
    assert len(legend) == 4 and "__3_0.distcp" in legend[3] and "rows 39-49" in legend[3]


def test_picture_colwise_tp_major_bands(readers):
    grid, legend = _picture(readers["tp2dp2"].index(), "model.w1.weight")
    bands = _bands(grid)
    assert [set(ln) for ln, _ in bands] == [{"0"}, {"2"}, {"1"}, {"3"}]  # TP-major row blocks
    assert len({h for _, h in bands}) == 1  # 9 rows each
    assert "rows 9-17" in legend[1] and "rank 2" in legend[1]


def test_picture_rowwise_blocks(readers):
    grid, _ = _picture(readers["tp2dp2"].index(), "model.w2.weight")
    bands = _bands(grid)
    assert len(bands) == 2 and bands[0][1] == bands[1][1]
    (top, _), (bottom, _) = bands
    half = len(top) // 2
    assert set(top[:half]) == {"0"} and set(top[half:]) == {"1"}
    assert set(bottom[:half]) == {"2"} and set(bottom[half:]) == {"3"}


def test_picture_1d_0d_and_nd(readers, special):
    grid, legend = _picture(readers["tp2dp2"].index(), "model.norm.weight")
    assert len(grid) == 1  # one bar
    runs = [c for i, c in enumerate(grid[0]) if i == 0 or grid[0][i - 1] != c]
    assert len(runs) == 2 and len(legend) == 2
    grid, legend = _picture(readers["fsdp4"].index(), "optim.state.w1.weight.step")
    assert len(grid) == 1 and len(grid[0].strip()) == 1 and len(legend) == 1
    grid, _ = _picture(special[0].index(), "model.cube")  # 3-D, one chunk: projected
    assert grid and all(set(ln) == {"0"} for ln in grid)
    console = Console(record=True, width=80)
    render_layout(special[0].index(), "model.empty", console)
    assert "empty tensor" in console.export_text()
    with pytest.raises(ConfigError):
        render_layout(special[0].index(), "model.nope", console)


def test_axis_cells():
    assert axis_cells(4, [2], 8) == [0, 0, 1, 1, 2, 2, 3, 3]  # exact: 2 cells per index
    cells = axis_cells(50, [13, 26, 39], 20)
    runs = [sum(1 for c in cells if lo <= c < hi) for lo, hi in ((0, 13), (13, 26), (26, 39), (39, 50))]
    assert runs[0] == runs[1] == runs[2] > runs[3] and len(cells) <= 20
    many = axis_cells(1000, list(range(10, 1000, 10)), 20)  # 100 intervals, 20 cells: sampled
    assert len(many) == 20 and many == sorted(many)
    assert axis_cells(0, [], 10) == []
