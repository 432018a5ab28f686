"""The one conversion pipeline (converter/run/pipeline.py), on real multi-process checkpoints:

- every command's dry run is the run's own plan: same entries and bytes, and the destination is
  never touched;
- ``--resume`` is the pipeline's, so every command has it: an interrupted import-hf continues
  from the CLI, bit-identical to an uninterrupted run;
- commands never import each other (what they share lives in plan/ and run/).
"""

from __future__ import annotations

import ast
from pathlib import Path

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
        return api.export_hf(work["uni"], dst, max_shard_size="100KB", dtype="bfloat16", options=options)
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
