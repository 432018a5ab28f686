"""Issue 18.1: ``from-universal --dry-run`` shows every key's placement per mesh dim, the box of
each rank and the source files each chunk is read from; ``--dry-run --json`` validates against
``schemas/target-plan.schema.json`` and matches the ``.metadata`` torch reads from the written
output; ``--dry-run --layout KEY`` draws the picture ``inspect --layout KEY`` draws afterwards."""

from __future__ import annotations

import json

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from schemas import validation_errors
from test_cli_readable import ckptconv

MESH = ("--mesh", "tp2,dp2", "--plan", "llama")


@pytest.fixture(scope="module")
def plan_doc(dcp_checkpoint, tmp_path_factory):
    src = dcp_checkpoint("fsdp4")
    out = tmp_path_factory.mktemp("preview") / "out"
    proc = ckptconv("from-universal", str(src), str(out), *MESH, "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    assert not out.exists()
    return src, out, json.loads(proc.stdout)


def test_json_validates_and_matches_torch_metadata(plan_doc):
    src, out, doc = plan_doc
    assert validation_errors("target-plan", doc) == []
    assert doc["mesh"]["world_size"] == 4 and [r["file"] for r in doc["ranks"]] == [f"__{r}_0.distcp" for r in range(4)]
    proc = ckptconv("from-universal", str(src), str(out), *MESH, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    md = FileSystemReader(str(out)).read_metadata()  # torch's own reader of what was written
    written = set()
    for idx, info in md.storage_data.items():
        entry = md.state_dict_metadata[idx.fqn]
        if isinstance(entry, TensorStorageMetadata):
            chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(idx.offset))
            written.add((idx.fqn, tuple(idx.offset), tuple(chunk.sizes), info.relative_path))
    planned = {(t["key"], tuple(c["offsets"]), tuple(c["sizes"]), c["file"]) for t in doc["tensors"] for c in t["chunks"]}
    assert planned == written
    assert sum(r["bytes"] for r in doc["ranks"]) == doc["totals"]["bytes"]


def test_json_placements_holders_and_sources(plan_doc):
    src, _, doc = plan_doc
    tensors = {t["key"]: t for t in doc["tensors"]}
    wq = tensors["model.layers.0.attention.wq.weight"]
    assert [p["mesh_dims"] for p in wq["placement"]] == [["dp_shard"], ["tp"]]
    assert [p["placement"] for p in wq["placement"]] == ["_StridedShard(dim=0, sf=2)", "Shard(0)"]
    assert all(c["holders"] == [c["rank"]] for c in wq["chunks"])  # sharded on both dims: one holder each
    files = {p.name for p in src.glob("*.distcp")}
    assert all(c["sources"] and set(c["sources"]) <= files for t in doc["tensors"] for c in t["chunks"])
    norm = next(t for k, t in tensors.items() if k.endswith("norm.weight") and len(t["shape"]) == 1)
    assert [p["placement"] for p in norm["placement"]] == ["Shard(0)", "Replicate()"]
    assert all(len(c["holders"]) == 2 and c["rank"] in c["holders"] for c in norm["chunks"])  # the tp pair


def test_text_per_key_view_80_columns(dcp_checkpoint, tmp_path):
    proc = ckptconv("from-universal", str(dcp_checkpoint("fsdp4")), str(tmp_path / "o"), *MESH, "--dry-run",
                    "--keys", "model.*")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.startswith("model.layers.0.attention.wq.weight  "))
    assert lines[i].endswith("4 chunks")
    assert lines[i + 1].startswith("    placement: dp_shard: _StridedShard(dim=0, sf=2)  tp: Shard(0)")
    assert all(ln.startswith("    rank ") and " <- __" in ln and "rows " in ln for ln in lines[i + 2:i + 6])
    assert any("(also on " in ln for ln in lines)  # replicated boxes name the other holders
    assert lines[0] == "# target mesh dp_shard2,tp2 (4 ranks)" and any(ln.startswith("# per key (plan llama)") for ln in lines)
    assert lines[-1].startswith("# dry run: ")


def test_dry_run_picture_is_the_inspect_picture(dcp_checkpoint, tmp_path):
    src, out = dcp_checkpoint("fsdp4"), tmp_path / "out"
    keys = "model.layers.0.*.weight"
    before = ckptconv("from-universal", str(src), str(out), *MESH, "--dry-run", "--layout", keys)
    assert before.returncode == 0, before.stderr
    assert ckptconv("from-universal", str(src), str(out), *MESH).returncode == 0
    after = ckptconv("inspect", str(out), "--layout", keys)
    assert after.returncode == 0, after.stderr
    assert before.stdout == after.stdout and before.stdout.count("rank 3  __3_0.distcp") >= 4


def test_json_and_layout_need_dry_run(dcp_checkpoint, tmp_path):
    for flag in (["--json"], ["--layout", "model.*"]):
        proc = ckptconv("from-universal", str(dcp_checkpoint("fsdp4")), str(tmp_path / "o"), *MESH, *flag)
        assert proc.returncode == 2 and proc.stderr.startswith("ckptconv: error: ") and "--dry-run" in proc.stderr
        assert not (tmp_path / "o").exists()


def test_text_dry_run_lists_few_chunks_and_says_the_same_as_the_whole_plan(dcp_checkpoint, tmp_path):
    """The text form builds entries only for the chunks it shows (a 1,024-rank plan has millions);
    what it prints is exactly what rendering the whole plan document prints."""
    from converter.api import from_universal
    from converter.config import RunOptions
    from converter.plan.dry_run import PREVIEW_CHUNK_LINES, render_preview

    src, out = dcp_checkpoint("fsdp4"), tmp_path / "out"
    kw = dict(plan="llama", options=RunOptions(dry_run=True))
    few = from_universal(src, out, "tp2,dp12", preview_chunks=PREVIEW_CHUNK_LINES, **kw)
    whole = from_universal(src, out, "tp2,dp12", **kw)
    assert few.plan == whole.plan == render_preview(whole.preview)
    assert "more chunks (--json lists every one)" in few.plan  # 24 chunks per matrix: some left out
    assert max(len(t["chunks"]) for t in few.preview["tensors"]) == PREVIEW_CHUNK_LINES
    assert [t["chunk_count"] for t in few.preview["tensors"]] == [len(t["chunks"]) for t in whole.preview["tensors"]]
    assert few.bytes == whole.bytes
    assert few.preview["ranks"] == [{k: v for k, v in r.items() if k != "loads"} for r in whole.preview["ranks"]]
    assert all(r["loads"][0] == ".metadata" for r in whole.preview["ranks"])  # --json only: what each rank opens
