"""``from-universal --format dcp-safetensors``: DCP's per-rank safetensors storage as a target,
and ``--consolidate``'s hub-shaped files, against torch's own files.

- The same job twice: torch's per-rank save on a mesh, converted by ckptconv to the same mesh,
  gives torch's files again (headers equal as JSON, torch's ``__metadata__`` key order being a
  hash map's; data bytes equal): the same chunks, the same owners as DCP's dedup, the same key
  order.
- ``--consolidate`` is byte for byte torch's ``consolidate_safetensors_files``: of torch's own
  save (its consolidated files, made by ``HuggingFaceStorageWriter(enable_consolidation=True)``),
  and of ckptconv's per-rank files with ckptconv's file split (``--max-shard-size``) or a hub
  index (``--fqn-index``), where torch runs. Where torch cannot (integer and bool tensors crash
  its consolidation, 0-d tensors come out as zeros) the files hold the values, read back by the
  safetensors library.
- Every dtype and edge shape round-trips bit for bit (torch's reader is the oracle); torchrun
  ranks write the same bytes as one process; ``--resume`` and ``--overwrite`` work on the form.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import hf_storage_factory as hfs
from cli_runner import run_cli
from converter.commands.from_universal import from_universal
from oracle import bits_equal


def _split(path: Path) -> tuple[dict, dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return header.pop("__metadata__", None), header, raw[8 + n:]


def _files(root: Path, pattern: str = "*.safetensors") -> list[str]:
    return sorted(p.name for p in root.glob(pattern))


@pytest.mark.parametrize("kind,mesh,plan", [("fsdp3", "dp3", "fsdp"), ("tp2dp2", "tp2,dp2", "llama")])
def test_same_job_gives_torchs_per_rank_files(tmp_path, kind, mesh, plan):
    src = hfs.shards(kind)
    from_universal(src, tmp_path / "out", mesh, plan=plan, format="dcp-safetensors")
    assert _files(tmp_path / "out") == _files(src)
    for name in _files(src):
        tm, th, td = _split(src / name)
        om, oh, od = _split(tmp_path / "out" / name)
        assert oh == th, name
        assert od == td, name
        assert om == tm, name  # the sharding JSON text itself (its keys in the rank's save order)
        header = (tmp_path / "out" / name).read_bytes()
        (n,) = struct.unpack("<Q", header[:8])
        assert n % 8 == 0 and n == struct.unpack("<Q", (src / name).read_bytes()[:8])[0], name


@pytest.mark.parametrize("via_store", [False, True])
def test_consolidated_is_torchs_consolidation_of_the_same_job(tmp_path, via_store):
    """torch saved with enable_consolidation=True on 2 ranks; ckptconv writes the same mesh from
    the per-rank files (or from a universal store of them): the hub-shaped files are torch's."""
    torch_out = hfs.get("dense2_float") / "ckpt"
    src = torch_out / "sharded"
    if via_store:
        assert run_cli("to-universal", str(src), str(tmp_path / "uni"))[0] == 0
        src = tmp_path / "uni"
    from_universal(src, tmp_path / "out", "dp2", format="dcp-safetensors", consolidate=True)
    for name in ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]:
        assert (tmp_path / "out" / name).read_bytes() == (torch_out / name).read_bytes(), name
    assert _files(tmp_path / "out" / "sharded") == _files(torch_out / "sharded")


def _torch_consolidate(sharded: Path, out: Path, mapping: dict[str, int]) -> None:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    out.mkdir()
    consolidate_safetensors_files(str(sharded), str(out), mapping)


def _mapping_of(index_json: Path) -> dict[str, int]:
    """torch's fqn_to_index_mapping from an index (file numbers), in the index's order."""
    wmap = json.loads(index_json.read_text())["weight_map"]
    return {k: int(v.split("-")[1]) for k, v in wmap.items()}


@pytest.mark.parametrize("kind,mesh,extra", [
    ("dense2_float", "dp3", ["--max-shard-size", "600B"]),
    ("fsdp3", "tp2,dp2", ["--plan", "llama", "--model-only", "--max-shard-size", "40KB"]),
    ("tp2dp2", "dp2", ["--model-only"]),
])
def test_consolidated_is_torchs_consolidation_of_our_shards(tmp_path, kind, mesh, extra):
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(hfs.shards(kind)), str(out), "--mesh", mesh, "--format",
                           "dcp-safetensors", "--consolidate", *extra)
    assert code == 0, err
    mapping = _mapping_of(out / "model.safetensors.index.json")
    _torch_consolidate(out / "sharded", tmp_path / "torch", mapping)
    names = _files(out, "model*")
    assert names == _files(tmp_path / "torch", "model*") and len(names) >= 2
    for name in names:
        assert (out / name).read_bytes() == (tmp_path / "torch" / name).read_bytes(), name


def test_fqn_index_splits_and_orders_as_torchtitan_passes_it(tmp_path):
    """A hub index (its weight_map sorted by name, as transformers writes it) is the
    fqn_to_index_mapping: file of each key and the order; torch's consolidation agrees."""
    ref = hfs.reference("fsdp3")
    keys = sorted(k for k in ref if k.startswith("model."))
    hub = {"metadata": {}, "weight_map": {k: f"model-{1 + i % 3:05d}-of-00003.safetensors" for i, k in enumerate(keys)}}
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "model.safetensors.index.json").write_text(json.dumps(hub))
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(hfs.shards("fsdp3")), str(out), "--mesh", "dp2", "--format",
                           "dcp-safetensors", "--consolidate", "--model-only", "--fqn-index", str(tmp_path / "hub"))
    assert code == 0, err
    assert _files(out / "sharded") == [f"shard-{r:05d}-model-{f:05d}-of-00003.safetensors" for r in (1, 2)
                                       for f in (1, 2, 3)]
    mapping = {k: int(v.split("-")[1]) for k, v in hub["weight_map"].items()}
    _torch_consolidate(out / "sharded", tmp_path / "torch", mapping)
    for name in _files(out, "model*"):
        assert (out / name).read_bytes() == (tmp_path / "torch" / name).read_bytes(), name
    code, _, err = run_cli("from-universal", str(hfs.shards("fsdp3")), str(tmp_path / "bad"), "--mesh", "dp2",
                           "--format", "dcp-safetensors", "--fqn-index", str(tmp_path / "hub"))
    assert code == 2 and "names no file for" in err and err.count("\n") == 1, err


def test_every_dtype_and_edge_shape_round_trips(tmp_path):
    """fp32/64/16, bf16, fp8 e4m3/e5m2 (inf/NaN bits), int8..64, uint8, bool; rows, columns, an
    empty shard, 0-d, empty, 3-d: torch's reader loads the per-rank output bit for bit, and the
    consolidated files (which torch's consolidation cannot write for ints, bool and 0-d) hold the
    same bits for the safetensors library."""
    from safetensors.torch import load_file

    ref = hfs.reference("dtypes3")
    out = tmp_path / "out"
    from_universal(hfs.shards("dtypes3"), out, "dp2", format="dcp-safetensors", consolidate=True, max_shard_size="2KB")
    for got in (hfs.torch_hf_read(out / "sharded"), hfs.torch_hf_read(out),
                {k: v for f in sorted(out.glob("model-*.safetensors")) for k, v in load_file(str(f)).items()}):
        assert set(got) == set(ref)
        bad = [k for k in ref if not bits_equal(got[k], ref[k])]
        assert not bad, bad[:5]


def test_non_tensor_entries_are_left_out_with_a_warning(dcp_checkpoint, tmp_path):
    code, out, err = run_cli("from-universal", str(dcp_checkpoint("fsdp4")), str(tmp_path / "out"), "--mesh", "dp2",
                             "--format", "dcp-safetensors")
    assert code == 0, err
    assert "non-tensor entr" in err and "tensors only" in err, err
    from oracle import torch_reference

    ref = torch_reference(dcp_checkpoint("fsdp4"))
    got = hfs.torch_hf_read(tmp_path / "out")
    assert set(got) == {k for k, v in ref.items() if isinstance(v, torch.Tensor)}
    assert all(bits_equal(got[k], ref[k]) for k in got)


def test_options_are_refused_before_any_io(tmp_path):
    src = str(hfs.shards("fsdp3"))
    for args, words in ((["--consolidate"], "is for --format dcp-safetensors"),
                        (["--format", "dcp-safetensors", "--max-shard-size", "0"], "must be positive"),
                        (["--format", "dcp-safetensors", "--fqn-index", str(tmp_path / "none.json")], "cannot read")):
        code, _, err = run_cli("from-universal", src, str(tmp_path / "o"), "--mesh", "dp2", *args)
        assert code == 2 and words in err and err.count("\n") == 1, (args, err)
        assert not (tmp_path / "o").exists()


def test_resume_and_overwrite(tmp_path, monkeypatch):
    """An interrupted run resumes to the same bytes; --overwrite replaces ckptconv's own output but
    never a per-rank save torch wrote."""
    import shutil

    src, args = str(hfs.shards("fsdp3")), ["--mesh", "dp2", "--format", "dcp-safetensors", "--consolidate"]
    assert run_cli("from-universal", src, str(tmp_path / "whole"), *args)[0] == 0
    from converter.run import sinks

    seen = {"n": 0}
    real_open = sinks.ShardFilesSink.open

    def flaky(self, task):
        seen["n"] += 1
        if seen["n"] == 40:
            raise KeyboardInterrupt
        return real_open(self, task)

    monkeypatch.setattr(sinks.ShardFilesSink, "open", flaky)
    code, _, err = run_cli("from-universal", src, str(tmp_path / "out"), *args, "--workers", "1")
    assert code != 0 and "--resume" in err, err
    assert not (tmp_path / "out" / ".ckptconv-complete.json").exists()
    code, _, err = run_cli("inspect", str(tmp_path / "out"))
    assert code == 2 and "--resume" in err, err
    monkeypatch.setattr(sinks.ShardFilesSink, "open", real_open)
    assert run_cli("from-universal", src, str(tmp_path / "out"), *args, "--resume")[0] == 0
    for p in sorted((tmp_path / "whole").rglob("*.safetensors")) + [tmp_path / "whole" / "model.safetensors.index.json"]:
        rel = p.relative_to(tmp_path / "whole")
        assert (tmp_path / "out" / rel).read_bytes() == p.read_bytes(), rel
    code, _, err = run_cli("from-universal", src, str(tmp_path / "out"), *args)
    assert code == 2 and "--overwrite" in err, err
    assert run_cli("from-universal", src, str(tmp_path / "out"), "--mesh", "dp3", "--format", "dcp-safetensors",
                   "--overwrite")[0] == 0
    assert not (tmp_path / "out" / "sharded").exists() and len(_files(tmp_path / "out")) == 3
    theirs = tmp_path / "theirs"
    shutil.copytree(hfs.get("dense2_float") / "ckpt", theirs)
    code, _, err = run_cli("from-universal", src, str(theirs), *args, "--overwrite")
    assert code == 2 and ("did not write" in err or "not a ckptconv output" in err), err
    assert (theirs / "sharded").is_dir()
    shutil.copytree(hfs.shards("fsdp3"), tmp_path / "theirs2")
    code, _, err = run_cli("from-universal", src, str(tmp_path / "theirs2"), *args, "--overwrite")
    assert code == 2 and "did not write" in err, err


def test_dry_run_names_the_files_and_json_validates(tmp_path):
    import jsonschema

    src = str(hfs.shards("tp2dp2"))
    code, out, err = run_cli("from-universal", src, str(tmp_path / "o"), "--mesh", "dp2", "--format", "dcp-safetensors",
                             "--consolidate", "--dry-run")
    assert code == 0, err
    assert "rank 1 (dp_shard=1): sharded/shard-00002-model-00001-of-00001.safetensors" in out, out
    assert "model-00001-of-00001.safetensors" in out and "model.safetensors.index.json" in out
    code, out, err = run_cli("from-universal", src, str(tmp_path / "o"), "--mesh", "dp2", "--format", "dcp-safetensors",
                             "--dry-run", "--json")
    schema = json.loads((Path(__file__).resolve().parents[2] / "schemas" / "target-plan.schema.json").read_text())
    jsonschema.validate(json.loads(out), schema)
    assert not (tmp_path / "o").exists()


def test_torchrun_ranks_split_the_work_and_write_the_same_bytes(tmp_path):
    """Two torchrun ranks share the per-rank and the consolidated tasks: every file is byte for
    byte the one-process output."""
    import os
    import subprocess
    import sys

    src = str(hfs.shards("fsdp3"))
    args = ["--mesh", "tp2,dp2", "--plan", "llama", "--format", "dcp-safetensors", "--consolidate",
            "--max-shard-size", "100KB"]
    assert run_cli("from-universal", src, str(tmp_path / "one"), *args)[0] == 0
    worker = Path(__file__).resolve().parents[1] / "support" / "dist_worker.py"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(worker), str(tmp_path / "rep"), "--", "from-universal", src, str(tmp_path / "two"), *args],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(Path(f"{tmp_path / 'rep'}.{r}").read_text()) for r in range(2)]
    assert all(r["results"][0]["ok"] for r in reports), reports
    one = {p.relative_to(tmp_path / "one"): p.read_bytes() for p in (tmp_path / "one").rglob("*") if p.is_file()}
    two = {p.relative_to(tmp_path / "two"): p.read_bytes() for p in (tmp_path / "two").rglob("*") if p.is_file()}
    assert one.keys() == two.keys()
    assert [k for k in one if one[k] != two[k]] == []


def test_consolidate_command_is_torchs_consolidation(tmp_path):
    """``ckptconv consolidate sharded/ OUT``: torch's own consolidated files of that save, byte for
    byte (the key order recovered from the per-rank files); with a split, torch's consolidation of
    the same files with the same mapping."""
    torch_out = hfs.get("dense2_float") / "ckpt"
    code, _, err = run_cli("consolidate", str(torch_out / "sharded"), str(tmp_path / "one"))
    assert code == 0, err
    for name in ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]:
        assert (tmp_path / "one" / name).read_bytes() == (torch_out / name).read_bytes(), name
    code, _, err = run_cli("consolidate", str(hfs.shards("tp2dp2")), str(tmp_path / "split"), "--max-shard-size", "50KB")
    assert code == 0, err
    mapping = _mapping_of(tmp_path / "split" / "model.safetensors.index.json")
    src = tmp_path / "src"
    import shutil

    shutil.copytree(hfs.shards("tp2dp2"), src)  # torch writes 0-d tensors as zeros: compare the rest
    _torch_consolidate(src, tmp_path / "torch", mapping)
    for name in _files(tmp_path / "split", "model*"):
        if name.endswith(".json"):
            assert (tmp_path / "split" / name).read_bytes() == (tmp_path / "torch" / name).read_bytes()
            continue
        ours, theirs = (tmp_path / "split" / name).read_bytes(), (tmp_path / "torch" / name).read_bytes()
        (n,) = struct.unpack("<Q", ours[:8])
        assert ours[:8 + n] == theirs[:8 + n], name  # the same header, byte for byte
        header = json.loads(ours[8:8 + n])
        data_o, data_t = bytearray(ours[8 + n:]), bytearray(theirs[8 + n:])
        for k in [k for k, v in header.items() if v["shape"] == []]:  # torch writes zeros where the value is
            b, e = header[k]["data_offsets"]
            assert data_t[b:e] == bytes(e - b)
            data_t[b:e] = data_o[b:e]
        assert data_o == data_t, name


def test_url_destination_and_source(s3_bucket, tmp_path):
    """Spooled to an S3-compatible server (marker last) and read back from it as a source."""
    src = str(hfs.shards("tp2dp2"))
    url = f"{s3_bucket}/st"
    code, _, err = run_cli("from-universal", src, url, "--mesh", "dp2", "--format", "dcp-safetensors", "--consolidate")
    assert code == 0, err
    code, out, err = run_cli("inspect", f"{url}/sharded")
    assert code == 0 and "dcp-safetensors" in out, out + err
    for side in (f"{url}/sharded", url):
        code, out, err = run_cli("diff", src, side)
        assert code == 0 and "same:" in out, out + err


def test_dtype_cast_in_both_file_kinds(tmp_path):
    """--dtype bf16 casts the parameters in the per-rank and the consolidated files alike (torch's
    Tensor.to bits); optimizer states keep their dtype."""
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(hfs.shards("fsdp3")), str(out), "--mesh", "dp2", "--format",
                           "dcp-safetensors", "--consolidate", "--dtype", "bf16")
    assert code == 0, err
    ref = hfs.reference("fsdp3")
    for got in (hfs.torch_hf_read(out / "sharded"), hfs.torch_hf_read(out)):
        for k, v in ref.items():
            want = v.to(torch.bfloat16) if k.startswith("model.") else v
            assert bits_equal(got[k], want), k
