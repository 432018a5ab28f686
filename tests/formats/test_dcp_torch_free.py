"""The DCP copy path needs no torch (issue 5: ``import torch`` costs ~2 s of every command).

- Importing every module of ``formats.dcp`` leaves torch unimported.
- A checkpoint written by ``dcp.save`` (bf16, float8, uint16, int, bool, a transposed tensor, a 0-d
  scalar, an empty tensor, non-tensor entries) is read region by region into numpy buffers and
  written again, resharded, from numpy pieces, in a subprocess that never imports torch; torch
  (``dcp.load``, ``dcp_to_torch_save``) then finds the original bits.
- What stands in for torch when pickling is torch's own: the static name tables equal the installed
  torch's, ``data.pkl`` and ``.metadata`` are byte-identical to ``torch.save`` / ``dcp.save``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from formats.base import full_box
from formats.dcp import torch_globals as tg
from formats.dcp.archive_writer import TensorArchiveWriter, data_pkl
from formats.dcp.writer import ChunkSpec, DCPWriter, ObjectSpec
from formats.dtypes import BY_NAME, by_name
from formats.errors import InvalidCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REPO = Path(__file__).resolve().parents[2]
MODULES = ["formats.dcp.reader", "formats.dcp.writer", "formats.dcp.archive", "formats.dcp.archive_writer",
           "formats.dcp.metadata", "formats.dcp.safe_pickle", "formats.dcp.metadata_pickle",
           "formats.dcp.torch_globals"]


def _run(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _random(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of any dtype (NaN payloads included); bool as 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    n = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, n), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


# ------------------------------------------------------------------------------------------------
# Imports


def test_importing_formats_dcp_does_not_import_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in MODULES) + (
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded\n"
    )
    _run(code)


# ------------------------------------------------------------------------------------------------
# Read and write a real checkpoint without torch

_COPY = r"""
import json, sys
import numpy as np
from formats.base import Box
from formats.dcp.reader import DCPReader
from formats.dcp.writer import ChunkSpec, DCPWriter, ObjectSpec
from formats.dtypes import by_name

src, dst, npz = sys.argv[1:4]
arrays, chunks, pieces, objects, planner = {}, [], {}, [], {}
with DCPReader(src) as reader:
    index = reader.index()
    for key, entry in index.tensors.items():
        storage = by_name(entry.dtype).numpy_dtype
        full = np.empty(entry.shape, dtype=storage)
        for chunk in entry.chunks:
            reader.verify_chunk_crc(key, chunk)
            buf = np.empty(chunk.box.sizes, dtype=storage)
            reader.read_region_into(key, chunk, chunk.box, memoryview(buf.reshape(-1).view(np.uint8)))
            same = reader.read_region_array(key, chunk, chunk.box)
            assert same.dtype == storage and same.shape == buf.shape and same.tobytes() == buf.tobytes()
            full[chunk.box.slices()] = buf
            if entry.shape and len(entry.shape) == 2 and min(entry.shape) > 1:  # a non-dense region
                sub = Box((1, 1), (entry.shape[0] - 1, entry.shape[1] - 1))
                out = np.empty(sub.sizes, dtype=storage)
                reader.read_region_into(key, chunk, sub, memoryview(out.reshape(-1).view(np.uint8)))
                arrays[key + "@sub"] = out
        arrays[key] = full
        planner[key] = entry.path
        halves = [Box((0,) * len(entry.shape), entry.shape)]
        if entry.shape and entry.shape[0] > 1:  # reshard: split dim 0 over two ranks
            h = entry.shape[0] // 2
            halves = [Box((0,) * len(entry.shape), (h, *entry.shape[1:])),
                      Box((h,) + (0,) * (len(entry.shape) - 1), (entry.shape[0] - h, *entry.shape[1:]))]
        for rank, box in enumerate(halves):
            spec = ChunkSpec(key, entry.dtype, entry.shape, box, rank)
            chunks.append(spec)
            pieces[spec] = np.ascontiguousarray(full[box.slices()])
    for key, entry in index.objects.items():
        objects.append(ObjectSpec(key, reader.read_object_bytes(key), 1))
        planner[key] = entry.path

writer = DCPWriter(dst, chunks, objects, planner, world_size=2)
writer.write_objects()
for spec in chunks:
    sink = writer.open_chunk(spec)
    flat = pieces[spec].reshape(-1)
    for part in (flat[: flat.size // 2], flat[flat.size // 2:]):  # numpy bit arrays, several writes
        sink.write(part)
    sink.close()
writer.commit()
np.savez(npz, **{k.replace(".", "/"): v for k, v in arrays.items()})
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded
print(json.dumps(sorted(arrays)))
"""


def _state_dict() -> dict:
    return {
        "model": {
            "w_bf16": _random((6, 5), torch.bfloat16, 1),
            "w_t": torch.randn(5, 4, generator=torch.Generator().manual_seed(2)).t(),  # stride (1, 4)
            "w_e4m3": _random((4, 4), torch.float8_e4m3fn, 3),
            "w_e5m2": _random((7,), torch.float8_e5m2, 4),
            "w_f16": _random((3, 2, 2), torch.float16, 5),
            "u16": _random((3,), torch.uint16, 6),
            "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "i32": _random((2, 3), torch.int32, 7),
            "mask": _random((5, 3), torch.bool, 8),
            "empty": torch.zeros(0, 3),
        },
        "step": torch.tensor(7.5),
        "extra": {"note": "hello", "cfg": {"lr": 0.1, "betas": [0.9, 0.95]}},
    }


def _target(obj):
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj) if obj.numel() else torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: _target(v) for k, v in obj.items()}
    return None


def _assert_same(got, want, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert tuple(got.shape) == tuple(want.shape) and _bits(got) == _bits(want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    else:
        assert got == want, where


def test_read_and_reshard_a_dcp_save_checkpoint_without_torch(tmp_path):
    sd = _state_dict()
    dcp.save(sd, checkpoint_id=tmp_path / "src")
    keys = json.loads(_run(_COPY, str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "a.npz")))

    flat, _ = flatten_state_dict(sd)
    with np.load(tmp_path / "a.npz") as got:
        for key in keys:
            base, _, sub = key.partition("@")
            want = flat[base][1:, 1:] if sub else flat[base]
            arr = got[key.replace(".", "/")]
            assert arr.dtype == by_name(str(want.dtype).removeprefix("torch.")).numpy_dtype, key
            assert arr.shape == tuple(want.shape) and arr.tobytes() == _bits(want), key
    assert {k for k in keys if "@" not in k} == {k for k, v in flat.items() if isinstance(v, torch.Tensor)}

    target = _target(sd)
    dcp.load(target, checkpoint_id=tmp_path / "dst")
    _assert_same(target, sd)
    dcp_to_torch_save(tmp_path / "dst", tmp_path / "full.pt")
    _assert_same(torch.load(tmp_path / "full.pt", weights_only=False), sd)


# ------------------------------------------------------------------------------------------------
# The stand-ins are torch's names


def _torch_names(kind: type) -> set[str]:
    return {n for n in dir(torch) if isinstance(getattr(torch, n, None), kind)}


def _torch_is_2_13() -> bool:
    return torch.__version__.startswith("2.13.")


def test_static_dtype_and_layout_names_match_torch():
    dtypes, layouts = _torch_names(torch.dtype), _torch_names(torch.layout)
    assert dtypes <= tg.DTYPE_NAMES and layouts <= tg.LAYOUT_NAMES
    if _torch_is_2_13():
        assert dtypes == tg.DTYPE_NAMES and layouts == tg.LAYOUT_NAMES
    for name in dtypes:
        assert tg.canonical_dtype_name(name) == str(getattr(torch, name)).removeprefix("torch.")
    for name in BY_NAME:
        assert tg.canonical_dtype_name(name) == name


def test_static_storage_tables_match_torch():
    storage_map = {str(d).removeprefix("torch."): n for d, n in torch.storage._dtype_to_storage_type_map().items()}
    new = {str(d).removeprefix("torch.") for d in torch.storage._new_dtypes()}
    assert storage_map.items() <= tg.STORAGE_TYPE_BY_DTYPE.items() and new <= tg.NEW_DTYPES
    if _torch_is_2_13():
        assert storage_map == tg.STORAGE_TYPE_BY_DTYPE and new == tg.NEW_DTYPES
    for cls in tg.STORAGE_TYPE_BY_DTYPE.values():
        assert getattr(torch, cls).__module__ == "torch"
    assert torch.UntypedStorage.__module__ == "torch.storage"
    assert torch._utils._rebuild_tensor_v2.__module__ == torch._utils._rebuild_tensor_v3.__module__ == "torch._utils"
    assert torch.Size.__module__ == "torch" and torch.serialization._get_layout.__module__ == "torch.serialization"


def test_torch_fields_reads_the_version_without_torch():
    code = ("import json, sys\nfrom formats.dcp.metadata_pickle import torch_fields\nprint(json.dumps(torch_fields()))\n"
            "assert 'torch' not in sys.modules\n")
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert json.loads(_run(code)) == [(major, minor) >= (2, 4), (major, minor) >= (2, 9)]


def _torch_data_pkl(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return z.read("archive/data.pkl")


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_data_pkl_is_torch_saves(name):
    for shape in [(), (0,), (1,), (3, 4), (2, 0, 5), (300, 2), (70000,), (70000, 0, 300)]:
        t = torch.empty(shape, dtype=BY_NAME[name].torch_dtype)
        assert data_pkl(name, shape) == _torch_data_pkl(t), shape


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "bool", "complex128", "uint64", "int16"])
def test_archive_from_numpy_pieces_is_torch_save(name, tmp_path):
    t = _random((5, 7), BY_NAME[name].torch_dtype, 11)
    bits = t.view(getattr(torch, BY_NAME[name].storage)).numpy()
    fd = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT)
    try:
        w = TensorArchiveWriter(fd, 0, name, (5, 7))
        w.write(bits[:2])
        w.write(np.ascontiguousarray(bits[2:]).reshape(-1))
        w.close()
    finally:
        os.close(fd)
    buf = io.BytesIO()
    torch.save(t, buf)
    assert (tmp_path / "a").read_bytes() == buf.getvalue()


def test_numpy_pieces_of_another_dtype_or_layout_are_refused(tmp_path):
    fd = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT)
    try:
        w = TensorArchiveWriter(fd, 0, "bfloat16", (4, 2))
        with pytest.raises(InvalidCheckpointError, match="uint16"):
            w.write(np.zeros(2, dtype=np.float32))  # same width, wrong dtype
        with pytest.raises(InvalidCheckpointError, match="C-contiguous"):
            w.write(np.zeros((2, 4), dtype=np.uint16)[:, 0])
        with pytest.raises(InvalidCheckpointError, match="numpy array or a torch tensor"):
            w.write(b"\0\0")
        w.write(np.zeros((4, 2), dtype=np.uint16))
        w.close()
    finally:
        os.close(fd)


def test_metadata_is_byte_identical_to_dcp_save(tmp_path):
    """Same state dict: our ``.metadata`` (same checkpoint path and save id) is ``dcp.save``'s."""
    sd = _state_dict()
    sd["model"]["again_bf16"] = _random((2,), torch.bfloat16, 9)  # a dtype seen before: memoized
    dcp.save(sd, checkpoint_id=tmp_path / "ref")
    flat, planner = flatten_state_dict(sd)
    chunks, objs = [], []
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            chunks.append(ChunkSpec(k, str(v.dtype).removeprefix("torch."), tuple(v.shape), full_box(tuple(v.shape)), 0))
        else:
            buf = io.BytesIO()
            torch.save(v, buf)
            objs.append(ObjectSpec(k, buf.getvalue(), 0))
    ref = (tmp_path / "ref/.metadata").read_bytes()
    save_id = pickle.loads(ref).storage_meta.save_id
    ours = DCPWriter(tmp_path / "ref", chunks, objs, planner, world_size=1).metadata_bytes(save_id=save_id)
    assert ours == ref
