"""The universal store on its own, both backends (one suite): chunk files that stock zarr (zarr
backend) or safetensors.safe_open (safetensors backend) reads, exact dtypes, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zarr

from formats.base import Box, ChunkRef, TensorEntry
from formats.errors import CorruptCheckpointError, IncompleteCheckpointError
from formats.universal import (BACKENDS, UniversalReader, UniversalWriter, array_name, chunk_shape_for,
                               plan_store)
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


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Every test of the store's contract runs against each backend."""
    return request.param


def _write_store(root, tensors: dict, chunk_bytes=64, backend="zarr"):
    w = UniversalWriter(root, chunk_bytes, backend=backend)
    for key, t in tensors.items():
        entry = TensorEntry(key, str(t.dtype).removeprefix("torch."), tuple(t.shape), (), ("model", key))
        w.add_tensor(entry, key, "param")
    w.prepare()
    for key, t in tensors.items():
        for idx, box in w.chunks(key):
            w.write_chunk(key, idx, t[box.slices()].clone())
    w.commit(SourceInfo("test"), "0", {k: {"param": k} for k in tensors}, "now")


def _stock_read(root, key: str, backend: str) -> torch.Tensor:
    """A tensor read back by the backend's own library alone: stock zarr, or safetensors.safe_open
    over the files ckptconv.json maps (no ckptconv code)."""
    from safetensors import safe_open

    if backend == "zarr":
        arr = zarr.open_group(root, mode="r", zarr_format=3)["tensors"][array_name(key)]
        assert arr.attrs["key"] == key
        return torch.from_numpy(np.array(arr[...], order="C"))
    record = json.loads((root / "ckptconv.json").read_text())["tensors"][key]
    out = None
    for cid, file in record["files"].items():
        with safe_open(root / file, "pt") as f:
            part = f.get_tensor(record["tensor"])
            offsets = json.loads(f.metadata()["offsets"])
        if out is None:
            out = torch.empty(record["shape"], dtype=part.dtype)
        out[tuple(slice(o, o + n) for o, n in zip(offsets, part.shape))] = part
    return out if out is not None else torch.empty(record["shape"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_bit_exact_and_stock_library_opens(tmp_path, dtype, backend):
    tensors = {"a.weight": _tensor(dtype, (7, 5)), "scalar": _tensor(dtype, ()), "vec": _tensor(dtype, (13,)),
               "empty": _tensor(dtype, (0, 3)), "cube": _tensor(dtype, (3, 4, 5))}
    _write_store(tmp_path / "u", tensors, backend=backend)
    reader = UniversalReader(tmp_path / "u")
    index = reader.index()
    assert index.info["backend"] == backend
    for key, t in tensors.items():
        entry = index.tensors[key]
        assert entry.dtype == str(dtype).removeprefix("torch.") and entry.shape == tuple(t.shape)
        out = torch.empty_like(t)
        for chunk in entry.chunks:
            out[chunk.box.slices()] = reader.read_region(key, chunk, chunk.box)
        assert torch.equal(bits(out), bits(t))
        # the backend's own library, no registration: the stored bits equal the tensor's bits
        stored = _stock_read(tmp_path / "u", key, backend)
        assert torch.equal(bits(stored), bits(t)) and tuple(stored.shape) == tuple(t.shape)


def test_every_dtype_round_trips(tmp_path, backend):
    """Every dtype of formats.dtypes (complex, unsigned, every float8) back bit for bit through
    ckptconv's reader, including those safetensors' Python side does not map (C128, F8_E8M0)."""
    from formats.dtypes import BY_NAME

    tensors = {}
    for i, (name, d) in enumerate(sorted(BY_NAME.items())):
        raw = torch.randint(0, 256, (5, 3, d.itemsize), generator=torch.Generator().manual_seed(i), dtype=torch.uint8)
        if name == "bool":
            raw = raw % 2
        tensors[name] = raw.view(d.torch_dtype).reshape(5, 3)
    _write_store(tmp_path / "u", tensors, chunk_bytes=16, backend=backend)
    reader = UniversalReader(tmp_path / "u", verify=True)
    for key, t in tensors.items():
        entry = reader.index().tensors[key]
        out = torch.empty_like(t)
        for chunk in entry.chunks:
            out[chunk.box.slices()] = reader.read_region(key, chunk, chunk.box)
        assert entry.dtype == key and torch.equal(bits(out), bits(t)), key


def test_odd_keys_round_trip(tmp_path, backend):
    """Keys that are unsafe as paths or clash with a format's own names (safetensors' header key
    '__metadata__', zarr's 'zarr.json', the empty key, overlong keys) read back exactly, through
    ckptconv and through the backend's own library."""
    keys = ["", "__metadata__", "a/b", "../x", "é", "zarr.json", "x" * 300]
    tensors = {k: torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i, k in enumerate(keys)}
    _write_store(tmp_path / "u", tensors, backend=backend)
    reader = UniversalReader(tmp_path / "u", verify=True)
    for key, t in tensors.items():
        [chunk] = reader.index().tensors[key].chunks
        assert torch.equal(reader.read_region(key, chunk, chunk.box), t), key
        assert torch.equal(_stock_read(tmp_path / "u", key, backend), t), key


def test_backends_record_the_same_chunks_and_checksums(tmp_path):
    """One plan, two backends: the same grid, the same checksums; only where the bytes are differs."""
    tensors = {"w": _tensor(torch.bfloat16, (9, 7)), "s": _tensor(torch.float32, ()), "b": _tensor(torch.bool, (5, 3))}
    docs = {}
    for backend in BACKENDS:
        _write_store(tmp_path / backend, tensors, chunk_bytes=40, backend=backend)
        docs[backend] = json.loads((tmp_path / backend / "ckptconv.json").read_text())
    z, s = docs["zarr"], docs["safetensors"]
    assert "backend" not in z and s["backend"] == "safetensors"
    for key in tensors:
        assert z["tensors"][key]["checksums"] == s["tensors"][key]["checksums"]
        assert z["tensors"][key]["chunk_shape"] == s["tensors"][key]["chunk_shape"]
        assert set(s["tensors"][key]["files"]) == set(s["tensors"][key]["checksums"])
    assert not list((tmp_path / "safetensors").rglob("zarr.json"))


def test_plan_is_pure_and_is_what_the_writer_lays_out(tmp_path, backend):
    """The planner touches nothing; the writer's grid is the plan's; no I/O before prepare()."""
    entries = [("a", "float32", (130, 10)), ("b", "bfloat16", (4, 2000)), ("a/b", "int8", ())]
    plan = plan_store(entries, 4000, backend)
    assert [p.chunk_shape for p in plan.arrays.values()] == [(65, 10), (1, 2000), ()]
    w = UniversalWriter(tmp_path / "u", 4000, backend=backend)
    for key, dtype, shape in entries:
        w.add_tensor(TensorEntry(key, dtype, shape, (), (key,)), key, "param", plan=plan.arrays[key])
        assert w.chunks(key) == plan.arrays[key].grid()
    assert not (tmp_path / "u").exists()
    w.prepare()
    assert (tmp_path / "u" / "tensors").is_dir()


def test_sub_regions_read_exactly(tmp_path, backend):
    t = _tensor(torch.float32, (9, 6))
    _write_store(tmp_path / "u", {"w": t}, chunk_bytes=2 * 6 * 4, backend=backend)
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


def test_sub_regions_of_column_split_chunks(tmp_path, backend):
    """A row over the chunk size splits dim 1 too (``<i>.<j>`` chunks); any region reads exactly."""
    t = _tensor(torch.bfloat16, (5, 40))
    _write_store(tmp_path / "u", {"w": t}, chunk_bytes=24, backend=backend)
    reader = UniversalReader(tmp_path / "u", verify=True)
    entry = reader.index().tensors["w"]
    assert len(entry.chunks) == 5 * 4
    for chunk in entry.chunks:
        o, s = chunk.box.offsets, chunk.box.sizes
        region = Box((o[0], o[1] + 1), (1, s[1] - 2))
        assert torch.equal(bits(reader.read_region("w", chunk, region)), bits(t[region.slices()]))
        out = bytearray(chunk.box.numel * 2)
        reader.read_region_into("w", chunk, chunk.box, memoryview(out))
        assert bytes(out) == bytes(bits(t[chunk.box.slices()]).numpy())


def test_incomplete_store_is_refused(tmp_path, backend):
    w = UniversalWriter(tmp_path / "u", 64, backend=backend)
    w.add_tensor(TensorEntry("w", "float32", (2,), (), ("w",)), "w", "param")
    assert not (tmp_path / "u").exists()  # planned, nothing written before prepare()
    w.prepare()
    with pytest.raises(IncompleteCheckpointError, match="incomplete universal store"):
        UniversalReader(tmp_path / "u")


def test_tampered_metadata_and_chunks_are_refused(tmp_path, backend):
    _write_store(tmp_path / "u", {"w": _tensor(torch.float32, (4, 4))}, backend=backend)
    meta = tmp_path / "u" / "ckptconv.json"
    doc = json.loads(meta.read_text())
    doc["format_version"] = 99
    meta.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="ckptconv.json"):
        UniversalReader(tmp_path / "u")
    _write_store(tmp_path / "v", {"w": _tensor(torch.float32, (4, 4))}, backend=backend)
    reader = UniversalReader(tmp_path / "v")
    chunk = reader.index().tensors["w"].chunks[0]
    (tmp_path / "v" / chunk.file).write_bytes(b"\x00" * 3)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        reader.read_region("w", chunk, chunk.box)
    with pytest.raises(CorruptCheckpointError, match="has 3 bytes"):  # checked on open, before any plan
        UniversalReader(tmp_path / "v")


def test_damaged_chunk_is_caught_by_its_checksum(tmp_path, backend):
    _write_store(tmp_path / "u", {"w": _tensor(torch.float32, (4, 4))}, backend=backend)
    reader = UniversalReader(tmp_path / "u", verify=True)
    chunk = reader.index().tensors["w"].chunks[0]
    path = tmp_path / "u" / chunk.file
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the last data byte (no padding in a 4x4 float32 chunk of 64 bytes)
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="xxh3_64"):
        reader.read_region("w", chunk, chunk.box)


def test_safetensors_file_mapping_is_checked(tmp_path):
    """A safetensors store's record may only name the chunk files the writer names (no way out)."""
    _write_store(tmp_path / "u", {"w": _tensor(torch.float32, (4, 4))}, backend="safetensors")
    meta = tmp_path / "u" / "ckptconv.json"
    doc = json.loads(meta.read_text())
    doc["tensors"]["w"]["files"]["0.0"] = "tensors/../../etc/passwd"
    meta.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="names the file"):
        UniversalReader(tmp_path / "u")
