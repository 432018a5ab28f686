"""The one conversion pipeline (converter/run/pipeline.py), on real multi-process checkpoints:

- every command's dry run is the run's own plan: same entries and bytes, every planned box and
  file is the written one (as torch, zarr and safetensors read the output), and the destination
  is never touched;
- ``--resume`` is the pipeline's, so every command has it: an interrupted import-hf continues
  from the CLI, bit-identical to an uninterrupted run;
- commands never import each other (what they share lives in plan/ and run/).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest

from converter import api
from converter.config import RunOptions
from formats.errors import DestinationError

from test_destination import ckptconv, command, convert, interrupted, output_files

ROOT = Path(__file__).resolve().parents[2]
OPS = ["to-universal", "from-universal", "export-hf", "import-hf"]


@pytest.fixture(scope="module")
def work(dcp_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """A real 4-rank FSDP checkpoint, a store and an HF export of it."""
    root = tmp_path_factory.mktemp("pipeline")
    src = dcp_checkpoint("fsdp4")
    api.to_universal(src, root / "uni", RunOptions(workers=2), chunk_bytes=16 << 10)
    api.export_hf(root / "uni", root / "hf", max_shard_size="100KB", options=RunOptions(workers=2))
    return {"src": src, "uni": root / "uni", "hf": root / "hf", "root": root}


def _result(op: str, work: dict, dst: Path, options: RunOptions):
    if op == "to-universal":
        return api.to_universal(work["src"], dst, options, chunk_bytes=16 << 10)
    if op == "from-universal":
        return api.from_universal(work["uni"], dst, "dp2", dtype="bf16", options=options)
    if op == "export-hf":
        return api.export_hf(work["uni"], dst, max_shard_size="10KB", dtype="bfloat16", options=options)  # 3 shards
    return api.import_hf(work["hf"], dst, options=options, chunk_bytes=16 << 10)


@pytest.mark.parametrize("op", OPS)
def test_dry_run_is_the_runs_plan_and_touches_nothing(work, tmp_path, op):
    dst = tmp_path / "out"
    dry = _result(op, work, dst, RunOptions(dry_run=True))
    assert not dst.exists()
    assert dry.plan and dry.seconds == 0.0
    real = _result(op, work, dst, RunOptions(workers=2))
    assert real.plan is None and Path(real.dst) == dst.resolve()
    assert (dry.tensors, dry.objects, dry.bytes) == (real.tensors, real.objects, real.bytes)
    planned, written = PLANNED[op](dry), WRITTEN[op](dst)
    assert planned == written
    assert len(planned["tensors"]) == real.tensors


def _task_lines(text: str) -> list[tuple[str, str, Any, tuple, tuple]]:
    """The dry run's task lines (``converter.plan.copy_tasks.describe``): (key, dtype, target,
    offsets, sizes)."""
    out = []
    for line in text.splitlines():
        m = re.fullmatch(r"(\S+) (\S+) target=(.+?) box=(\[[^]]*\])\+(\[[^]]*\]) bytes=\d+ pieces=\d+ from=.*", line)
        if m:
            target = ast.literal_eval(m[3]) if m[3].startswith("(") else m[3]
            out.append((m[1], m[2], target, tuple(ast.literal_eval(m[4])), tuple(ast.literal_eval(m[5]))))
    return out


def _planned_store(dry) -> dict:
    """A store's plan: each key's dtype and its chunks (grid index, box), from the dry run's text."""
    tensors: dict[str, dict] = {}
    for key, dtype, index, offsets, sizes in _task_lines(dry.plan):
        t = tensors.setdefault(key, {"dtype": dtype, "chunks": set()})
        t["chunks"].add((index, offsets, sizes))
    return {"tensors": tensors}


def _written_store(dst: Path) -> dict:
    """What a zarr-backend store holds, as stock zarr opens it: each array's dtype (its
    ``torch_dtype`` attribute) and, for every chunk file on disk, its grid index and box (from
    the array's own shape and chunk grid); no other chunk files."""
    import zarr

    meta = json.loads((dst / "ckptconv.json").read_text())
    tensors: dict[str, dict] = {}
    for key, rec in meta["tensors"].items():
        arr = zarr.open_array(str(dst / rec["array"]), mode="r")
        assert arr.attrs["key"] == key
        chunks = set()
        for f in sorted((dst / rec["array"] / "c").rglob("*")) if arr.shape else []:
            if f.is_file():
                index = tuple(int(p) for p in f.relative_to(dst / rec["array"] / "c").parts)
                offsets = tuple(i * c for i, c in zip(index, arr.chunks))
                chunks.add((index, offsets, tuple(min(c, n - o) for c, n, o in zip(arr.chunks, arr.shape, offsets))))
        if not arr.shape:
            chunks.add(((), (), ()))
        tensors[key] = {"dtype": arr.attrs["torch_dtype"], "chunks": chunks}
    return {"tensors": tensors}


def _planned_dcp(dry) -> dict:
    """from-universal's plan document: each key's dtype, shape and chunks (box, the file holding it)."""
    doc = dry.preview
    tensors = {t["key"]: {"dtype": t["dtype"], "shape": tuple(t["shape"]),
                          "chunks": {(tuple(c["offsets"]), tuple(c["sizes"]), c["file"]) for c in t["chunks"]}}
               for t in doc["tensors"]}
    return {"tensors": tensors, "objects": {o["key"] for o in doc["objects"]}}


def _written_dcp(dst: Path) -> dict:
    """What torch's own reader (``FileSystemReader.read_metadata``) says the written DCP holds."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    md = FileSystemReader(str(dst)).read_metadata()
    tensors, objects = {}, set()
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            objects.add(key)
            continue
        chunks = {(tuple(c.offsets), tuple(c.sizes), md.storage_data[MetadataIndex(key, c.offsets)].relative_path)
                  for c in entry.chunks}
        tensors[key] = {"dtype": str(entry.properties.dtype).removeprefix("torch."), "shape": tuple(entry.size),
                        "chunks": chunks}
    return {"tensors": tensors, "objects": objects}


def _planned_hf(dry) -> dict:
    """export-hf's plan: each file's tensor count and size (its summary lines: sizes in the target
    dtype), each tensor's shape (its task line: one box, the whole tensor; the line's dtype is
    the source's, which --dtype casts)."""
    files = {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(
        r"^# (\S+\.safetensors): (\d+) tensors?, .*\((\d+) bytes\)$", dry.plan, re.M)}
    tensors = {}
    for key, dtype, target, offsets, sizes in _task_lines(dry.plan):
        assert target == key and not any(offsets), key
        tensors[key] = {"shape": sizes}
    return {"tensors": tensors, "files": files}


def _written_hf(dst: Path) -> dict:
    """What the safetensors library reads from the written files (and the index's weight map)."""
    from safetensors import safe_open

    files, tensors = {}, {}
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())["weight_map"] if index_file.is_file() else None
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            names = list(st.keys())
            for name in names:
                assert (index or {name: "model.safetensors"})[name] == f.name
                tensors[name] = {"shape": tuple(st.get_slice(name).get_shape())}
        files[f.name] = (len(names), f.stat().st_size)
    assert index is None or set(index) == set(tensors)
    return {"tensors": tensors, "files": files}


PLANNED = {"to-universal": _planned_store, "import-hf": _planned_store, "from-universal": _planned_dcp,
           "export-hf": _planned_hf}
WRITTEN = {"to-universal": _written_store, "import-hf": _written_store, "from-universal": _written_dcp,
           "export-hf": _written_hf}


def test_import_hf_resumes_from_the_cli(work, tmp_path, monkeypatch):
    ref, dst = tmp_path / "ref", tmp_path / "out"
    convert("import-hf", work, ref, RunOptions(workers=2))
    interrupted("import-hf", work, dst, monkeypatch)
    refused = ckptconv(*command("import-hf", work, dst))
    assert refused.returncode == 2 and "--resume" in refused.stderr
    done = ckptconv(*command("import-hf", work, dst, "--resume"))
    assert done.returncode == 0, done.stderr
    assert output_files(dst) == output_files(ref)
    assert convert("import-hf", work, dst, RunOptions(resume=True)).already_complete  # done: nothing to resume


def test_commands_do_not_import_each_other():
    wrong = []
    for path in sorted((ROOT / "converter" / "commands").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.name}:{node.lineno}: {n}" for n in names if n.startswith("converter.commands")]
    assert not wrong, "commands import commands:\n" + "\n".join(wrong)
