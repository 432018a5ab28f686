"""The universal store's safetensors backend end to end: what reads it and what it converts to.

The oracle is torch: ``dcp_to_torch_save`` (torch's own DCP load) of the source checkpoint, and
``safetensors.safe_open`` in a process that imports neither ckptconv nor zarr. Every command reads
both backends the same way, so outputs converted from a safetensors store equal, byte for byte,
those converted from a zarr store of the same source.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from converter import api
from converter.config import RunOptions
from formats.universal import BACKENDS, UniversalReader
from oracle import assert_same_value, bits_equal, torch_reference

KINDS = ["special_dtypes", "tp2dp2", "titan_flat"]
CHUNK = 4096


@pytest.fixture(scope="module")
def stores(dcp_checkpoint, tmp_path_factory):
    """(kind, backend) -> (source, store), converted once per module."""
    cache: dict = {}

    def get(kind: str, backend: str) -> tuple[Path, Path]:
        if (kind, backend) not in cache:
            src = dcp_checkpoint(kind)
            dst = tmp_path_factory.mktemp(f"st-{kind}-{backend}")
            api.to_universal(src, dst, RunOptions(workers=2, overwrite=True), chunk_bytes=CHUNK, backend=backend)
            cache[kind, backend] = (src, dst)
        return cache[kind, backend]

    return get


def tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file's bytes but ckptconv's output record (it names the source store, which differs)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (*skip, ".written-by-ckptconv.json")}


# ------------------------------------------------------------------------------ safe_open alone

#: Reads every atom of a store with json, torch.load (object entries) and safetensors.safe_open
#: only, then proves that neither ckptconv nor zarr was imported.
STANDALONE = r'''
import io, json, sys
from pathlib import Path
import torch
from safetensors import safe_open

root, out = Path(sys.argv[1]), sys.argv[2]
doc = json.loads((root / "ckptconv.json").read_text())
assert doc["backend"] == "safetensors"
values = {}
for atom in doc["atoms"].values():
    for key in atom["members"].values():
        if key in doc["objects"]:
            values[key] = torch.load(io.BytesIO((root / doc["objects"][key]["file"]).read_bytes()), weights_only=False)
            continue
        record = doc["tensors"][key]
        whole = torch.empty(record["shape"], dtype=getattr(torch, record["dtype"]))
        for file in record["files"].values():
            with safe_open(root / file, "pt") as f:
                part = f.get_tensor(record["tensor"])
                offsets = json.loads(f.metadata()["offsets"])
            whole[tuple(slice(o, o + n) for o, n in zip(offsets, part.shape))] = part
        values[key] = whole
mods = [m for m in sys.modules if m == "zarr" or m.split(".")[0] in ("formats", "converter", "ckptconv")]
assert not mods, mods
torch.save(values, out)
'''


@pytest.mark.parametrize("kind", KINDS)
def test_safe_open_alone_reads_every_atom_as_dcp_load_does(stores, kind, tmp_path):
    src, store = stores(kind, "safetensors")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "values.pt"
    proc = subprocess.run([sys.executable, "-c", STANDALONE, str(store), str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    ref = torch_reference(src)
    assert set(got) == set(ref)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and bits_equal(got[key], value), key
        else:
            assert_same_value(got[key], value, key)


# ------------------------------------------------------------------------------ every reader, both backends


@pytest.mark.parametrize("kind", ["special_dtypes", "tp2dp2"])
def test_conversions_from_either_backend_are_byte_identical(stores, kind, tmp_path):
    """from-universal, export-hf and diff read a safetensors store exactly as a zarr one."""
    out = {}
    for backend in BACKENDS:
        src, store = stores(kind, backend)
        dcp_dir, hf_dir = tmp_path / f"dcp-{backend}", tmp_path / f"hf-{backend}"
        api.from_universal(store, dcp_dir, "tp2,dp2", options=RunOptions(workers=2, memory_budget=1 << 20))
        api.export_hf(store, hf_dir, max_shard_size="20KB")
        out[backend] = (tree(dcp_dir, skip=(".metadata",)), tree(hf_dir))
        assert_same_value(torch_reference(dcp_dir), torch_reference(src))
    assert out["zarr"] == out["safetensors"]
    zarr_store, st_store = stores(kind, "zarr")[1], stores(kind, "safetensors")[1]
    assert api.diff(zarr_store, st_store).same
    z = json.loads((zarr_store / "ckptconv.json").read_text())
    s = json.loads((st_store / "ckptconv.json").read_text())
    assert {k: r["checksums"] for k, r in z["tensors"].items()} == {k: r["checksums"] for k, r in s["tensors"].items()}


def test_dcp_load_through_the_storage_reader(stores):
    """``dcp.load`` (torch's planner) reads a safetensors store through UniversalStorageReader."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from formats.universal_dcp import UniversalStorageReader

    src, store = stores("special_dtypes", "safetensors")
    loaded = _load_state_dict_from_keys(storage_reader=UniversalStorageReader(store))
    ref = torch_reference(src)
    flat: dict = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, (dict, list, tuple)) and not (prefix and prefix in ref):
            for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = node

    walk("", loaded)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert bits_equal(flat[key], value), key


def test_import_hf_to_either_backend(stores, tmp_path):
    _, store = stores("tp2dp2", "zarr")
    api.export_hf(store, tmp_path / "hf", max_shard_size="20KB")
    for backend in BACKENDS:
        api.import_hf(tmp_path / "hf", tmp_path / f"uni-{backend}", chunk_bytes=CHUNK, backend=backend)
    assert api.diff(tmp_path / "uni-zarr", tmp_path / "uni-safetensors").same
    assert api.verify(tmp_path / "uni-safetensors").ok
    for backend in BACKENDS:
        api.export_hf(tmp_path / f"uni-{backend}", tmp_path / f"hf-{backend}", max_shard_size="20KB")
    assert tree(tmp_path / "hf-zarr") == tree(tmp_path / "hf-safetensors")


def test_store_to_store_switches_backend_and_back_byte_identical(stores, tmp_path):
    """zarr store -> safetensors store -> zarr store: the same bytes as the first (the source's
    record and layout hints carried over, so --plan source still follows the original checkpoint)."""
    _, zarr_store = stores("tp2dp2", "zarr")
    api.to_universal(zarr_store, tmp_path / "st", chunk_bytes=CHUNK, backend="safetensors")
    api.to_universal(tmp_path / "st", tmp_path / "back", chunk_bytes=CHUNK)
    first, st = (json.loads((p / "ckptconv.json").read_text()) for p in (zarr_store, tmp_path / "st"))
    assert st["source"] == first["source"] and st["atoms"] == first["atoms"]
    skip = ("ckptconv.json",)
    assert tree(tmp_path / "back", skip) == tree(zarr_store, skip)
    back = json.loads((tmp_path / "back" / "ckptconv.json").read_text())
    assert {k: v for k, v in back.items() if k != "created"} == {k: v for k, v in first.items() if k != "created"}


# ------------------------------------------------------------------------------ the CLI


def test_cli_backend_verify_inspect_and_damage(dcp_checkpoint, tmp_path):
    src = dcp_checkpoint("fsdp4")
    uni = tmp_path / "uni"
    code, out, err = run_cli("to-universal", "--backend", "safetensors", "--chunk-size", "4KB", str(src), str(uni))
    assert code == 0, err
    assert not list(uni.rglob("zarr.json")) and list(uni.rglob("*.safetensors"))
    assert "safetensors backend" in run_cli("inspect", str(uni))[1]
    code, out, err = run_cli("verify", str(uni))
    assert code == 0 and out.startswith("ok"), out + err
    code, out, err = run_cli("to-universal", "--backend", "safetensors", "--dry-run", "--chunk-size", "4KB",
                             str(src), str(tmp_path / "dry"))
    assert code == 0 and not (tmp_path / "dry").exists()
    # a header that no longer matches its record: verify names the file
    victim = sorted(uni.rglob("*.safetensors"))[3]
    raw = bytearray(victim.read_bytes())
    raw[raw.index(b'"shape":[') + 9] ^= 1
    victim.write_bytes(bytes(raw))
    code, out, err = run_cli("verify", str(uni))
    assert code != 0 and victim.relative_to(uni).as_posix() in out + err and "header" in out + err
    # --overwrite replaces a safetensors store (every file is one ckptconv writes)
    code, out, err = run_cli("to-universal", "--backend", "safetensors", "--overwrite", str(src), str(uni))
    assert code == 0, err
    assert run_cli("verify", str(uni))[0] == 0


def test_interrupted_safetensors_store_resumes_to_the_same_bytes(dcp_checkpoint, tmp_path, monkeypatch):
    from formats.universal import UniversalWriter

    src = dcp_checkpoint("tp2dp2")
    api.to_universal(src, tmp_path / "ref", RunOptions(workers=2), chunk_bytes=CHUNK, backend="safetensors")
    monkeypatch.setenv("CKPTCONV_JOURNAL_FLUSH_SECONDS", "0")
    with monkeypatch.context() as m:
        m.setattr(UniversalWriter, "commit", lambda self, *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            api.to_universal(src, tmp_path / "out", RunOptions(workers=2), chunk_bytes=CHUNK, backend="safetensors")
    assert not (tmp_path / "out" / "ckptconv.json").exists()
    with pytest.raises(Exception, match="--backend|header|journal|resume"):  # another layout: not this run's journal
        api.to_universal(src, tmp_path / "out", RunOptions(resume=True), chunk_bytes=CHUNK)
    api.to_universal(src, tmp_path / "out", RunOptions(resume=True), chunk_bytes=CHUNK, backend="safetensors")
    skip = ("ckptconv.json",)
    assert tree(tmp_path / "out", skip) == tree(tmp_path / "ref", skip)
    meta = UniversalReader(tmp_path / "out").meta
    assert meta.backend == "safetensors"


@pytest.mark.parametrize("whole_chunks", [True, False])
def test_a_damaged_chunk_header_is_refused_while_copying(dcp_checkpoint, tmp_path, whole_chunks):
    """Conversions check each safetensors chunk file's header against ckptconv.json as they read
    it (whole-chunk reads and partial reads alike): a header edited to another dtype (data bytes
    intact, so every checksum still matches) is refused in one line naming the file; with
    --no-verify-source the data is copied anyway, bit-exact (offsets come from the record)."""
    uni = tmp_path / "uni"
    api.to_universal(dcp_checkpoint("fsdp4"), uni, chunk_bytes=4096, backend="safetensors")
    victim = next(p for p in sorted(uni.rglob("*.safetensors")) if b'"F32"' in p.read_bytes()[:400])
    victim.chmod(0o644)
    raw = victim.read_bytes()
    victim.write_bytes(raw.replace(b'"F32"', b'"I32"', 1))
    mesh = "dp1" if whole_chunks else "dp3"
    code, out, err = run_cli("from-universal", str(uni), str(tmp_path / "out"), "--mesh", mesh)
    assert code == 2 and victim.relative_to(uni).as_posix() in err and "header" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out" / ".metadata").exists()
    code, out, err = run_cli("from-universal", str(uni), str(tmp_path / "anyway"), "--mesh", mesh, "--no-verify-source")
    assert code == 0, err
    assert_same_value(torch_reference(tmp_path / "anyway"), torch_reference(dcp_checkpoint("fsdp4")))
