"""The universal store on its own: chunk files that stock zarr reads, exact dtypes, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zarr

from formats.base import Box, ChunkRef, TensorEntry
from formats.errors import CorruptCheckpointError, IncompleteCheckpointError
from formats.universal import UniversalReader, UniversalWriter, array_name, chunk_shape_for
from formats.universal_meta import SourceInfo

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int64, torch.bool, torch.int8, torch.float64]


def _tensor(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    t = (torch.randn(shape, generator=g) * 3).to(dtype)
    if t.numel() > 2 and dtype in (torch.float32, torch.bfloat16, torch.float16):
        t.view(-1)[0] = float("nan")
        t.view(-1)[1] = float("-inf")
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _write_store(root, tensors: dict, chunk_bytes=64):
    w = UniversalWriter(root, chunk_bytes)
    for key, t in tensors.items():
        entry = TensorEntry(key, str(t.dtype).removeprefix("torch."), tuple(t.shape), (), ("model", key))
        w.add_tensor(entry, key, "param")
    w.prepare()
    for key, t in tensors.items():
        for idx, box in w.chunks(key):
            w.write_chunk(key, idx, t[box.slices()].clone())
    w.commit(SourceInfo("test"), "0", {k: {"param": k} for k in tensors}, "now")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_bit_exact_and_zarr_opens(tmp_path, dtype):
    tensors = {"a.weight": _tensor(dtype, (7, 5)), "scalar": _tensor(dtype, ()), "vec": _tensor(dtype, (13,)),
               "empty": _tensor(dtype, (0, 3)), "cube": _tensor(dtype, (3, 4, 5))}
    _write_store(tmp_path / "u", tensors)
    reader = UniversalReader(tmp_path / "u")
    index = reader.index()
    group = zarr.open_group(tmp_path / "u", mode="r", zarr_format=3)
    for key, t in tensors.items():
        entry = index.tensors[key]
        assert entry.dtype == str(dtype).removeprefix("torch.") and entry.shape == tuple(t.shape)
        out = torch.empty_like(t)
        for chunk in entry.chunks:
            out[chunk.box.slices()] = reader.read_region(key, chunk, chunk.box)
        assert torch.equal(bits(out), bits(t))
        # stock zarr, no registration: the stored bits equal the tensor's bits
        arr = group["tensors"][array_name(key)]
        assert arr.attrs["torch_dtype"] == entry.dtype and arr.attrs["key"] == key
        stored = torch.from_numpy(np.ascontiguousarray(arr[...]))
        assert torch.equal(bits(stored), bits(t))


def test_sub_regions_read_exactly(tmp_path):
    t = _tensor(torch.float32, (9, 6))
    _write_store(tmp_path / "u", {"w": t}, chunk_bytes=2 * 6 * 4)
    reader = UniversalReader(tmp_path / "u")
    for chunk in reader.index().tensors["w"].chunks:
        o, s = chunk.box.offsets, chunk.box.sizes
        region = Box((o[0] + s[0] - 1, 2), (1, 3))
        assert torch.equal(reader.read_region("w", chunk, region).view(torch.int32), t[region.slices()].view(torch.int32))


def test_chunk_shape_balances_blocks():
    assert chunk_shape_for((100, 10), 4, 4000) == (100, 10)
    assert chunk_shape_for((130, 10), 4, 4000) == (65, 10)
    assert chunk_shape_for((4, 2000), 4, 4000) == (1, 1000)
    assert chunk_shape_for((), 4, 4) == ()
    assert chunk_shape_for((0, 5), 4, 4) == (1, 1)


def test_array_names_never_escape():
    for key in ["../x", "/abs", "a/b", ".hidden", "__zarr", "x\x00y", "é"]:
        name = array_name(key)
        assert "/" not in name and not name.startswith(".") and not name.startswith("__") and "\x00" not in name


def test_incomplete_store_is_refused(tmp_path):
    w = UniversalWriter(tmp_path / "u", 64)
    w.add_tensor(TensorEntry("w", "float32", (2,), (), ("w",)), "w", "param")
    assert not (tmp_path / "u").exists()  # planned, nothing written before prepare()
    w.prepare()
    with pytest.raises(IncompleteCheckpointError, match="incomplete universal store"):
        UniversalReader(tmp_path / "u")


def test_tampered_metadata_and_chunks_are_refused(tmp_path):
    _write_store(tmp_path / "u", {"w": _tensor(torch.float32, (4, 4))})
    meta = tmp_path / "u" / "ckptconv.json"
    doc = json.loads(meta.read_text())
    doc["format_version"] = 99
    meta.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="ckptconv.json"):
        UniversalReader(tmp_path / "u")
    _write_store(tmp_path / "v", {"w": _tensor(torch.float32, (4, 4))})
    reader = UniversalReader(tmp_path / "v")
    chunk = reader.index().tensors["w"].chunks[0]
    (tmp_path / "v" / chunk.file).write_bytes(b"\x00" * 3)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        reader.read_region("w", chunk, chunk.box)
