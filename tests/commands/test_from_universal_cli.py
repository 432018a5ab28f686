"""``ckptconv from-universal`` through the real entry point: what it writes (checked by torch's own
``dcp_to_torch_save`` against the source) and every bad input as ONE line on stderr, exit status 2,
nothing written outside the output directory, the store untouched.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from converter import api
from converter.config import RunOptions
from oracle import assert_same_value, torch_reference

STORE_CHUNK_BYTES = 4096


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``ckptconv ARGS`` in this process through ``converter.cli.main`` (exit status, streams)."""
    from converter.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def tree(root: Path, skip: Path | None = None) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root`` (except under ``skip``) with its size and bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not (skip is not None and (p == skip or skip in p.parents)):
            out[p.relative_to(root).as_posix()] = (p.stat().st_size, p.read_bytes())
    return out


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def boxes(ckpt: Path) -> dict[str, list[tuple]]:
    md = FileSystemReader(str(ckpt)).read_metadata()
    return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
            for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


@pytest.fixture(scope="module")
def store(dcp_checkpoint, tmp_path_factory) -> Path:
    """fsdp4 fixture -> universal store (small zarr chunks), shared READ-ONLY by this module."""
    dst = tmp_path_factory.mktemp("fu-cli") / "uni"
    api.to_universal(dcp_checkpoint("fsdp4"), dst, RunOptions(workers=2), chunk_bytes=STORE_CHUNK_BYTES)
    return dst


@pytest.fixture(scope="module")
def source_ref(dcp_checkpoint) -> dict:
    return torch_reference(dcp_checkpoint("fsdp4"))


@pytest.fixture()
def store_copy(store, tmp_path) -> Path:
    """A private copy of the store to damage."""
    dst = tmp_path / "uni"
    shutil.copytree(store, dst)
    return dst


# ----------------------------------------------------------------------------- what it writes


def test_writes_a_dcp_checkpoint_torch_reads_as_the_source(store, source_ref, tmp_path):
    before = tree(store)
    out = tmp_path / "dp3"
    proc = run_cli("from-universal", store, out, "--mesh", "dp3", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out}")
    # stderr: only the one line naming the plan --plan auto chose, and why
    assert proc.stderr.startswith("ckptconv: plan llama (--plan auto): torchtitan Llama names (") \
        and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [".ckptconv-loads.json", ".metadata", ".written-by-ckptconv.json", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert_same_value(torch_reference(out), source_ref)  # every tensor bit for bit, every object
    b = boxes(out)
    assert b["model.tok_embeddings.weight"] == [((0, 0), (17, 32)), ((17, 0), (17, 32)), ((34, 0), (16, 32))]
    assert b["optim.state.output.weight.exp_avg"] == b["model.output.weight"]
    assert b["optim.state.norm.weight.step"] == [((), ())]
    assert tree(store) == before


def test_llama_plan_writes_the_boxes_torchtitan_saves(store, dcp_checkpoint, tmp_path):
    out = tmp_path / "tp"
    proc = run_cli("from-universal", store, out, "--mesh", "tp2,dp2", "--plan", "llama")
    assert proc.returncode == 0, proc.stderr
    assert boxes(out) == boxes(dcp_checkpoint("tp2dp2"))  # a real TP2 x FSDP2 save of the same model


def test_mesh_order_renumbers_ranks(store, tmp_path):
    """--mesh-order tp,dp_shard puts dp innermost: rank 1 is (tp=0, dp=1)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli("from-universal", store, a, "--mesh", "tp2,dp2", "--plan", "llama").returncode == 0
    assert run_cli("from-universal", store, b, "--mesh", "tp2,dp2", "--plan", "llama",
                   "--mesh-order", "tp,dp_shard").returncode == 0
    key = "model.layers.0.attention.wq.weight"

    def by_file(ckpt):
        md = FileSystemReader(str(ckpt)).read_metadata()
        return {md.storage_data[i].relative_path: tuple(c.offsets)
                for c in md.state_dict_metadata[key].chunks
                for i in md.storage_data if i.fqn == key and tuple(i.offset) == tuple(c.offsets)}

    # default (dp, tp): rank = dp*2 + tp; reordered (tp, dp): rank = tp*2 + dp
    assert by_file(a)["__1_0.distcp"] == by_file(b)["__2_0.distcp"]
    assert by_file(a)["__2_0.distcp"] == by_file(b)["__1_0.distcp"]


def test_dry_run_prints_per_rank_plan_and_writes_nothing(store, tmp_path):
    out = tmp_path / "never"
    proc = run_cli("from-universal", store, out, "--mesh", "pp2,dp2", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "# target mesh pp2,dp_shard2 (4 ranks)"
    assert lines[1].startswith("# plan llama (--plan auto): torchtitan Llama names (")
    assert [ln.split(":")[0] for ln in lines[2:6]] == [
        "rank 0 (pp=0,dp_shard=0)", "rank 1 (pp=0,dp_shard=1)", "rank 2 (pp=1,dp_shard=0)", "rank 3 (pp=1,dp_shard=1)"
    ]
    assert not out.exists()


def test_overwrite_replaces_a_previous_output_only(store, source_ref, tmp_path):
    out = tmp_path / "o"
    assert run_cli("from-universal", store, out, "--mesh", "dp4").returncode == 0
    assert run_cli("from-universal", store, out, "--mesh", "dp2", "--overwrite").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == [".ckptconv-loads.json", ".metadata", ".written-by-ckptconv.json", "__0_0.distcp", "__1_0.distcp"]
    assert_same_value(torch_reference(out), source_ref)
    (out / "old.txt").write_text("x")  # not ckptconv's: refused, nothing removed
    proc = run_cli("from-universal", store, out, "--mesh", "dp2", "--overwrite")
    assert proc.returncode == 2 and "old.txt" in proc.stderr and (out / "old.txt").read_text() == "x"
    assert (out / ".metadata").is_file()


# ----------------------------------------------------------------------------- bad input


def _bad(src: Path, tmp_path: Path, *args: str, needles: tuple[str, ...] = (), out: Path | None = None) -> str:
    """Run a failing conversion; assert one line, nothing written outside ``out``, no .metadata."""
    out = out or tmp_path / "out"
    before = tree(tmp_path, skip=out)
    line = assert_one_line_error(run_cli("from-universal", src, out, *args), *needles)
    print("[error]", line)
    assert tree(tmp_path, skip=out) == before, "something was written outside the output directory"
    assert not (out / ".metadata").exists()
    return line


def test_incomplete_store(store_copy, tmp_path):
    (store_copy / "ckptconv.json").unlink()
    _bad(store_copy, tmp_path, "--mesh", "dp2", needles=("incomplete", str(store_copy)))


def test_corrupt_store_metadata(store_copy, tmp_path):
    (store_copy / "ckptconv.json").write_text('{"format": "ckptconv-universal", ')
    _bad(store_copy, tmp_path, "--mesh", "dp2", needles=("ckptconv.json",))


def test_store_metadata_fails_schema(store_copy, tmp_path):
    doc = json.loads((store_copy / "ckptconv.json").read_text())
    doc.pop("tensors", None)
    (store_copy / "ckptconv.json").write_text(json.dumps(doc))
    _bad(store_copy, tmp_path, "--mesh", "dp2", needles=("ckptconv.json",))


def _a_chunk_file(store: Path, key_part: str) -> Path:
    files = sorted(p for p in (store / "tensors").rglob("*") if p.is_file() and p.name != "zarr.json"
                   and key_part in p.as_posix())
    assert files, key_part
    return files[0]


def test_truncated_chunk_file(store_copy, tmp_path):
    f = _a_chunk_file(store_copy, "tok_embeddings.weight")
    f.write_bytes(f.read_bytes()[:-100])
    _bad(store_copy, tmp_path, "--mesh", "dp2", needles=("truncated",))


def test_missing_chunk_file(store_copy, tmp_path):
    _a_chunk_file(store_copy, "layers.1.feed_forward.w2.weight").unlink()
    _bad(store_copy, tmp_path, "--mesh", "dp2", needles=("missing",))


def test_object_checksum_mismatch(store_copy, tmp_path):
    obj = sorted((store_copy / "objects").iterdir())[0]
    data = bytearray(obj.read_bytes())
    data[-1] ^= 0xFF
    obj.write_bytes(bytes(data))
    _bad(store_copy, tmp_path, "--mesh", "dp2", needles=("checksum",))


def test_flipped_tensor_byte_is_refused(store_copy, tmp_path):
    f = _a_chunk_file(store_copy, "norm.weight")
    data = bytearray(f.read_bytes())
    data[0] ^= 0x01
    f.write_bytes(bytes(data))
    _bad(store_copy, tmp_path, "--mesh", "dp2", needles=("xxh3", str(f), "norm.weight"))
    out = tmp_path / "skipped"  # the skip flag copies the damaged byte, as asked
    proc = run_cli("from-universal", store_copy, out, "--mesh", "dp2", "--no-verify-source")
    assert proc.returncode == 0, proc.stderr
    assert (out / ".metadata").is_file()


def test_unknown_plan(store, tmp_path):
    _bad(store, tmp_path, "--mesh", "dp2", "--plan", "megatron-lm", needles=("unknown plan", "megatron-lm", "auto"))
    assert not (tmp_path / "out").exists()


def test_missing_plan_file(store, tmp_path):
    _bad(store, tmp_path, "--mesh", "dp2", "--plan", str(tmp_path / "nope.json"), needles=("does not exist",))


def test_invalid_plan_file(store, tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"version": 1, "rules": [{"match": ".*", "tp": "shard(x)"}]}))
    _bad(store, tmp_path, "--mesh", "tp2", "--plan", str(plan), needles=(str(plan),))


def test_non_divisible_tp_dim(store, tmp_path):
    # wq has 32 rows (4 heads x 8): tp3 cannot split heads evenly
    _bad(store, tmp_path, "--mesh", "tp3", "--plan", "llama", needles=("not divisible by tp3", "attention.wq"))
    assert not (tmp_path / "out").exists()


def test_non_empty_output_dir(store, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _bad(store, tmp_path, "--mesh", "dp2", needles=("not empty", "--overwrite"), out=out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_output_inside_the_store(store_copy, tmp_path):
    _bad(store_copy, tmp_path, "--mesh", "dp2", needles=("inside the source",), out=store_copy / "dcp")


@pytest.mark.parametrize("args, needle", [
    (("--mesh", "dp0"), "size"),
    (("--mesh", "xx2"), "unknown dim"),
    (("--mesh", "dp2", "--dtype", "int8"), "floating-point"),
    (("--mesh", "dp2", "--dtype", "float8_e4m3fn"), "floating-point"),  # a cast to fp8 would clip to NaN
    (("--mesh", "dp2", "--dtype", "float99"), "float99"),
    (("--mesh", "tp2,dp2", "--mesh-order", "tp"), "--mesh-order"),
])
def test_bad_mesh_and_dtype(store, tmp_path, args, needle):
    _bad(store, tmp_path, *args, needles=(needle,))
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- plan warnings


def _warnings(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("ckptconv: warning: ")]


def test_plan_rule_matching_no_key_warns(store, source_ref, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "rules": [
        {"name": "experts", "match": r"layers\.\d+\.moe\.experts\..*", "tp": "shard(0)"},
        {"name": "everything", "match": ".*"},
    ]}))
    out = tmp_path / "out"
    proc = run_cli("from-universal", store, out, "--mesh", "dp2", "--plan", plan)
    assert proc.returncode == 0, proc.stderr
    warnings = _warnings(proc)
    assert len(warnings) == 1 and "'experts' matched no tensor" in warnings[0], proc.stderr
    assert proc.stderr.strip().splitlines() == warnings
    assert_same_value(torch_reference(out), source_ref)


def test_tensor_without_rule_is_replicated_with_a_warning(store, source_ref, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "rules": [{"name": "layers", "match": r"layers\..*"}]}))
    out = tmp_path / "out"
    proc = run_cli("from-universal", store, out, "--mesh", "dp2", "--plan", plan)
    assert proc.returncode == 0, proc.stderr
    warnings = _warnings(proc)
    assert len(warnings) == 1, proc.stderr
    assert "3 tensors matched no rule and are replicated" in warnings[0]
    assert all(n in warnings[0] for n in ("tok_embeddings.weight", "norm.weight", "output.weight"))
    b = boxes(out)
    assert b["model.tok_embeddings.weight"] == [((0, 0), (50, 32))]  # whole, stored once
    assert b["optim.state.tok_embeddings.weight.exp_avg"] == [((0, 0), (50, 32))]  # states follow
    assert b["model.layers.0.attention.wq.weight"] == [((0, 0), (16, 32)), ((16, 0), (16, 32))]
    assert_same_value(torch_reference(out), source_ref)


def test_dry_run_shows_warnings(store, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "rules": [{"name": "none", "match": "nothing"}]}))
    proc = run_cli("from-universal", store, tmp_path / "out", "--mesh", "dp2", "--plan", plan, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert any(ln.startswith("warning: plan") and "matched no rule" in ln for ln in proc.stdout.splitlines())
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- --dtype


def test_dtype_casts_parameters_only(store, source_ref, tmp_path):
    out = tmp_path / "bf16"
    proc = run_cli("from-universal", store, out, "--mesh", "dp2", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    got = torch_reference(out)
    assert set(got) == set(source_ref)
    for key, want in source_ref.items():
        if key.startswith("model.") and isinstance(want, torch.Tensor):
            want = want.to(torch.bfloat16)  # round to nearest even, as torch casts
        assert_same_value(got[key], want, key)  # optimizer states keep their dtype


def _chunk_bytes_per_file(ckpt: Path) -> dict[str, int]:
    md = FileSystemReader(str(ckpt)).read_metadata()
    out: dict[str, int] = {}
    for index, info in md.storage_data.items():
        entry = md.state_dict_metadata[index.fqn]
        if isinstance(entry, TensorStorageMetadata):
            chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
            n = torch.Size(chunk.sizes).numel() * torch.empty((), dtype=entry.properties.dtype).element_size()
            out[info.relative_path] = out.get(info.relative_path, 0) + n
    return out


def test_dtype_cast_reports_target_bytes(store, tmp_path):
    """With --dtype the dry-run per-rank bytes and the bytes written are those of the cast tensors
    (they were counted in the source dtype)."""
    out = tmp_path / "bf16"
    result = api.from_universal(store, out, "dp2", dtype="bfloat16", options=RunOptions(workers=2))
    per_file = _chunk_bytes_per_file(out)
    plan = api.from_universal(store, tmp_path / "dry", "dp2", dtype="bfloat16",
                              options=RunOptions(workers=2, dry_run=True)).plan
    planned = {ln.split(": ")[1].split()[0]: int(ln.split("(")[-1].split()[0]) for ln in plan.splitlines()
               if ln.startswith("rank ")}  # '... 42.3 KiB (43310 bytes)'
    assert planned == per_file
    assert result.bytes == sum(per_file.values())
