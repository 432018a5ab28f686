"""to-universal on real multi-process checkpoints; the oracle is torch's own dcp_to_torch_save, and
the store is read by stock zarr / the safetensors library and torch.load (tests/support/store_oracle.py),
not by ckptconv's reader."""

from __future__ import annotations

import pytest
import torch
import zarr

from converter import api
from converter.config import RunOptions
from formats.universal import BACKENDS, UniversalReader, array_name
from oracle import assert_same_value, bits_equal, torch_reference
from store_oracle import read_store

KINDS = ["fsdp4", "tp2dp2", "hsdp2x2", "pp2fsdp2", "single", "bf16_fsdp2", "special_dtypes", "titan_flat"]


def read_whole(reader, key: str) -> torch.Tensor:
    """A whole tensor assembled from a store's chunks (test helper; tensors here are tiny)."""
    entry = reader.index().tensors[key]
    from formats.dtypes import by_name

    out = torch.empty(entry.shape, dtype=by_name(entry.dtype).torch_dtype)
    for chunk in entry.chunks:
        out[chunk.box.slices()] = reader.read_region(key, chunk, chunk.box)
    return out


@pytest.fixture(scope="module")
def converted(dcp_checkpoint, tmp_path_factory):
    """(kind, backend) -> (source path, universal store path), converted once per module."""
    cache = {}

    def get(kind, backend="zarr"):
        if (kind, backend) not in cache:
            src = dcp_checkpoint(kind)
            dst = tmp_path_factory.mktemp(f"uni-{kind}-{backend}")
            api.to_universal(src, dst, RunOptions(workers=2, overwrite=True), chunk_bytes=4096, backend=backend)
            cache[kind, backend] = (src, dst)
        return cache[kind, backend]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_entry_matches_torch(converted, kind, backend):
    src, dst = converted(kind, backend)
    ref = torch_reference(src)
    got = read_store(dst)
    assert set(got) == set(ref)
    for key, value in got.items():
        if isinstance(ref[key], torch.Tensor):
            assert bits_equal(value, ref[key]), key
        else:
            assert_same_value(value, ref[key])


@pytest.mark.parametrize("kind", ["fsdp4", "titan_flat"])
def test_atoms_group_params_with_optimizer_state(converted, kind):
    _, dst = converted(kind)
    meta = UniversalReader(dst).meta
    atom = meta.atoms["tok_embeddings.weight"]
    assert {"param", "exp_avg", "exp_avg_sq", "step"} <= set(atom)
    assert meta.tensors[atom["exp_avg"]].shape == meta.tensors[atom["param"]].shape
    assert meta.source.format == "dcp" and meta.source.world_size


def test_stock_zarr_reads_bf16_store(converted):
    _, dst = converted("bf16_fsdp2")
    reader = UniversalReader(dst)
    group = zarr.open_group(dst, mode="r", zarr_format=3)
    key = next(k for k, r in reader.meta.tensors.items() if r.dtype == "bfloat16")
    arr = group["tensors"][array_name(key)]
    assert arr.dtype == "uint16" and arr.attrs["torch_dtype"] == "bfloat16"
    assert torch.equal(torch.from_numpy(arr[...]).view(torch.bfloat16).view(torch.uint16),
                       read_whole(reader, key).view(torch.uint16))


def test_source_is_never_modified(dcp_checkpoint, tmp_path):
    src = dcp_checkpoint("fsdp4")
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in src.iterdir()}
    api.to_universal(src, tmp_path / "u", RunOptions(workers=2))
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in src.iterdir()} == before
