"""Issue 18.8: ``inspect --layout KEY --svg FILE`` (``--vs OTHER``: side by side) and
``from-universal --dry-run --layout KEY --svg FILE`` (source | planned target) draw which rank and
file hold which block; the rectangles are checked against torch's own reading of the metadata."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from test_cli_readable import REPO, ckptconv

NS = "{http://www.w3.org/2000/svg}"
KEY = "model.layers.0.attention.wo.weight"


def _torch_chunks(path, key) -> set[tuple]:
    """(offsets, sizes, file) of every chunk of ``key`` as torch reads the .metadata."""
    md = FileSystemReader(str(path)).read_metadata()
    entry = md.state_dict_metadata[key]
    assert isinstance(entry, TensorStorageMetadata)
    out = set()
    for idx, info in md.storage_data.items():
        if idx.fqn == key:
            chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(idx.offset))
            out.add((tuple(idx.offset), tuple(chunk.sizes), info.relative_path))
    return out


def _panels(svg_path) -> list[list[dict]]:
    """Per panel (left to right): its chunk rectangles with geometry, fill and tooltip."""
    root = ET.parse(svg_path).getroot()
    rects = [r for r in root.iter(f"{NS}rect") if r.find(f"{NS}title") is not None]
    panels: dict[float, list[dict]] = {}
    frames = sorted(float(r.get("x")) for r in root.iter(f"{NS}rect") if r.get("fill") == "#f4f4f4")
    for r in rects:
        x = float(r.get("x"))
        left = max(f for f in frames if f <= x + 1e-6)
        panels.setdefault(left, []).append({"x": x - left, "y": float(r.get("y")), "w": float(r.get("width")),
                                            "h": float(r.get("height")), "fill": r.get("fill"),
                                            "title": r.find(f"{NS}title").text})
    return [panels[k] for k in sorted(panels)]


def _boxes(panel: list[dict], rows: int, cols: int, width: float) -> set[tuple]:
    """(offsets, sizes, file) recovered from the rectangles (the drawing is to scale)."""
    sx = width / cols
    top = min(r["y"] for r in panel)
    sy = max(r["y"] + r["h"] for r in panel) - top
    out = set()
    for r in panel:
        file = re.search(r"(__\d+_0\.distcp)", r["title"]).group(1)
        off = (round((r["y"] - top) / sy * rows), round(r["x"] / sx))
        out.add((off, (round(r["h"] / sy * rows), round(r["w"] / sx)), file))
    return out


def test_inspect_svg_side_by_side(dcp_checkpoint, tmp_path):
    src, out, svg = dcp_checkpoint("fsdp4"), tmp_path / "out", tmp_path / "wo.svg"
    assert ckptconv("from-universal", str(src), str(out), "--mesh", "tp2,dp2", "--plan", "llama").returncode == 0
    proc = ckptconv("inspect", str(src), "--layout", KEY, "--vs", str(out), "--svg", str(svg))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {svg}: 1 tensor x 2 checkpoints"
    left, right = _panels(svg)
    assert _boxes(left, 32, 32, 420) == _torch_chunks(src, KEY)  # FSDP: 4 row blocks
    assert _boxes(right, 32, 32, 420) == _torch_chunks(out, KEY)  # rowwise TP x FSDP: a 2 x 2 grid
    fills = {}
    for r in left + right:  # one colour per rank in both panels
        rank = re.match(r"rank (\d+)", r["title"]).group(1)
        assert fills.setdefault(rank, r["fill"]) == r["fill"]
    assert len(fills) == 4
    text = svg.read_text()
    assert str(src) in text and str(out) in text and "tp_rowwise" in text


def test_dry_run_svg_source_and_target(dcp_checkpoint, tmp_path):
    src, svg = dcp_checkpoint("fsdp4"), tmp_path / "plan.svg"
    proc = ckptconv("from-universal", str(src), str(tmp_path / "o"), "--mesh", "tp2,dp2", "--plan", "llama",
                    "--dry-run", "--layout", "model.layers.*.attention.wq.weight", "--svg", str(svg))
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "o").exists()
    assert "2 tensors x 2 checkpoints" in proc.stdout
    text = svg.read_text()
    assert "(planned, mesh dp_shard2,tp2)" in text and text.count("tp_colwise") == 2 and text.count("(fsdp)") == 2
    ET.fromstring(text)  # well-formed


def test_svg_needs_layout(dcp_checkpoint, tmp_path):
    for cmd in (["inspect", str(dcp_checkpoint("fsdp4")), "--svg", str(tmp_path / "x.svg")],
                ["from-universal", str(dcp_checkpoint("fsdp4")), str(tmp_path / "o"), "--mesh", "dp2", "--svg",
                 str(tmp_path / "x.svg")]):
        proc = ckptconv(*cmd)
        assert proc.returncode == 2 and proc.stderr.startswith("ckptconv: error: ") and "--layout" in proc.stderr
        assert not (tmp_path / "x.svg").exists()


def test_readme_shows_the_picture():
    readme = (REPO / "README.md").read_text()
    for name in ("docs/layout-fsdp2-to-tp2dp2.png", "docs/layout-fsdp2-to-tp2dp2.svg"):
        assert (REPO / name).is_file()
    assert "](docs/layout-fsdp2-to-tp2dp2.png)" in readme and "--svg" in readme
