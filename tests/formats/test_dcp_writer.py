"""The streaming DCP writer, checked against torch itself.

- Archives: bytes equal ``torch.save``'s for many dtypes and shapes, and load with
  ``torch.load(weights_only=True)`` bit for bit; a >4 GiB archive (zip64) in the slow suite.
- Checkpoints: written from one process with uneven 2-D boxes, several ranks' files and pieces of
  random sizes from several threads; ``dcp.load`` (no process group) and ``dcp_to_torch_save``
  must return exactly what was written. The same state dict written by ``dcp.save`` gives a
  byte-identical ``.distcp`` and equal metadata.
- A gloo world of 2 with ``fully_shard`` loads a checkpoint laid out as FSDP2's boxes and each rank
  reads only its own ``__<rank>_0.distcp``.
- ``.metadata`` appears only at commit; abort leaves none.
"""

from __future__ import annotations

import io
import os
import pickle
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from formats.base import Box, full_box
from formats.dcp.archive_writer import TensorArchiveWriter, archive_size
from formats.dcp.writer import ChunkSpec, DCPWriter, ObjectSpec
from formats.errors import (
    ConfigError,
    DestinationError,
    IncompleteCheckpointError,
    InvalidCheckpointError,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DTYPES = [
    torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.int64, torch.int32, torch.int8, torch.uint8, torch.uint16,
    torch.uint32, torch.uint64, torch.bool, torch.complex64,
]
SHAPES = [(), (0,), (3, 0, 2), (1,), (5,), (3, 4), (2, 3, 5), (65, 7)]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _random(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of any dtype (float8 NaN patterns included)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, nbytes), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if shape else raw.view(dtype)[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _write_pieces(sink, t: torch.Tensor, rng: random.Random) -> None:
    """Feed ``t`` to ``sink`` in C order as pieces of random sizes, then close."""
    flat = t.contiguous().reshape(-1)
    i = 0
    while i < flat.numel():
        n = rng.randint(1, max(1, flat.numel() // 3))
        sink.write(flat[i : i + n])
        i += n
    sink.close()


def _archive_bytes(t: torch.Tensor, tmp_path: Path, offset: int = 0, seed: int = 0) -> bytes:
    path = tmp_path / "archive.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        w = TensorArchiveWriter(fd, offset, _name(t.dtype), tuple(t.shape))
        _write_pieces(w, t, random.Random(seed))
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


def _torch_save_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ----------------------------------------------------------------------------- archives


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_archive_is_torch_save_byte_for_byte(dtype, tmp_path):
    for i, shape in enumerate(SHAPES):
        t = _random(shape, dtype, seed=i)
        ours = _archive_bytes(t, tmp_path, seed=i)
        assert ours == _torch_save_bytes(t), (dtype, shape)
        assert len(ours) == archive_size(_name(dtype), shape)
        back = torch.load(io.BytesIO(ours), weights_only=True)
        assert _same(back, t)


def test_archive_serialization_id_quirk(tmp_path):
    """torch folds a data/0 payload starting with 'PK\\x07\\x08' into the serialization id."""
    t = torch.tensor([0x08074B50, 1234, 5], dtype=torch.int32)
    assert _archive_bytes(t, tmp_path) == _torch_save_bytes(t)


def test_archive_at_offset_beyond_4gib(tmp_path):
    """Offsets are absolute (pwrite); the archive itself stays relative to its start."""
    t = _random((33, 3), torch.bfloat16, seed=5)
    assert _archive_bytes(t, tmp_path, offset=(5 << 30) + 7) == _torch_save_bytes(t)


def test_concurrent_archives_share_one_fd(tmp_path):
    tensors = [_random((50 + i, 9), torch.float32, seed=i) for i in range(8)]
    offsets, cursor = [], 0
    for t in tensors:
        offsets.append(cursor)
        cursor += archive_size("float32", tuple(t.shape))
    path = tmp_path / "many.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, cursor)

    def work(i):
        w = TensorArchiveWriter(fd, offsets[i], "float32", tuple(tensors[i].shape))
        _write_pieces(w, tensors[i], random.Random(i))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(len(tensors))))
    os.close(fd)
    data = path.read_bytes()
    for t, off in zip(tensors, offsets):
        assert data[off : off + archive_size("float32", tuple(t.shape))] == _torch_save_bytes(t)


def test_archive_rejects_bad_pieces(tmp_path):
    fd = os.open(tmp_path / "x", os.O_RDWR | os.O_CREAT)
    try:
        w = TensorArchiveWriter(fd, 0, "float32", (4,))
        with pytest.raises(InvalidCheckpointError):
            w.write(torch.zeros(2, dtype=torch.float16))
        with pytest.raises(InvalidCheckpointError):
            w.write(torch.zeros(4, 2)[:, 0])
        w.write(torch.zeros(3))
        with pytest.raises(InvalidCheckpointError):
            w.write(torch.zeros(2))
        with pytest.raises(IncompleteCheckpointError):
            w.close()
        w.write(torch.zeros(1))
        w.close()
        assert w.closed
    finally:
        os.close(fd)


@pytest.mark.slow
def test_zip64_archive_matches_torch_save(tmp_path):
    """A >4 GiB chunk: zip64 extra fields and 24-byte descriptors, as torch.save writes them."""
    import hashlib

    n = (1 << 32) + 100
    t = torch.empty(n, dtype=torch.uint8)
    t[: 1 << 20] = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    t[-1000:] = 7
    ref = tmp_path / "ref.pt"
    with open(ref, "wb") as f:
        torch.save(t, f)
    ours = tmp_path / "ours.bin"
    fd = os.open(ours, os.O_RDWR | os.O_CREAT)
    w = TensorArchiveWriter(fd, 0, "uint8", (n,))
    for i in range(0, n, 256 << 20):
        w.write(t[i : i + (256 << 20)])
    w.close()
    os.close(fd)
    del t
    assert ref.stat().st_size == ours.stat().st_size == archive_size("uint8", (n,))

    def digest(p: Path) -> str:
        h = hashlib.sha1()
        with open(p, "rb") as f:
            while b := f.read(64 << 20):
                h.update(b)
        return h.hexdigest()

    assert digest(ref) == digest(ours)


# ----------------------------------------------------------------------------- checkpoints


def _chunk_dim0(n: int, world: int) -> list[tuple[int, int]]:
    """(offset, size) per rank by torch.chunk's rule (what FSDP2 uses), empty shards at n."""
    step = -(-n // world) if n else 0
    out = []
    for r in range(world):
        off = min(r * step, n)
        out.append((off, max(0, min(step, n - off))))
    return out


def _spec(key: str, t: torch.Tensor, offsets, sizes, rank: int) -> ChunkSpec:
    return ChunkSpec(key, _name(t.dtype), tuple(t.shape), Box(tuple(offsets), tuple(sizes)), rank)


def _mixed_state():
    """(tensors, objects, planner_data, chunk specs): several dtypes, uneven 2-D boxes, 3 ranks."""
    tensors = {
        "model.w_fp32": _random((10, 7), torch.float32, 1),
        "model.w_bf16": _random((9, 5), torch.bfloat16, 2),
        "model.w_fp16": _random((4, 6, 3), torch.float16, 3),
        "model.w_e4m3": _random((8, 8), torch.float8_e4m3fn, 4),
        "model.w_e5m2": _random((5,), torch.float8_e5m2, 5),
        "model.ids": _random((7, 3), torch.int64, 6),
        "model.mask": _random((6, 5), torch.bool, 7),
        "model.scale": _random((1, 4), torch.float32, 8),
        "model.nothing": torch.zeros(0, 3),
        "optim.step": _random((), torch.float32, 9),
        "lst.0": _random((3,), torch.float32, 10),
    }
    T = tensors
    chunks = [
        # uneven 2-D boxes across 3 ranks
        _spec("model.w_fp32", T["model.w_fp32"], (0, 0), (3, 2), 0),
        _spec("model.w_fp32", T["model.w_fp32"], (0, 2), (3, 5), 1),
        _spec("model.w_fp32", T["model.w_fp32"], (3, 0), (7, 4), 2),
        _spec("model.w_fp32", T["model.w_fp32"], (3, 4), (7, 3), 0),
        _spec("model.w_bf16", T["model.w_bf16"], (0, 0), (9, 1), 2),
        _spec("model.w_bf16", T["model.w_bf16"], (0, 1), (4, 4), 1),
        _spec("model.w_bf16", T["model.w_bf16"], (4, 1), (5, 4), 0),
        _spec("model.w_fp16", T["model.w_fp16"], (0, 0, 0), (2, 6, 3), 0),
        _spec("model.w_fp16", T["model.w_fp16"], (2, 0, 0), (2, 3, 3), 1),
        _spec("model.w_fp16", T["model.w_fp16"], (2, 3, 0), (2, 3, 1), 2),
        _spec("model.w_fp16", T["model.w_fp16"], (2, 3, 1), (2, 3, 2), 0),
        _spec("model.w_e4m3", T["model.w_e4m3"], (0, 0), (5, 8), 1),
        _spec("model.w_e4m3", T["model.w_e4m3"], (5, 0), (3, 8), 2),
        _spec("model.w_e5m2", T["model.w_e5m2"], (0,), (5,), 2),
        _spec("model.ids", T["model.ids"], (0, 0), (7, 1), 0),
        _spec("model.ids", T["model.ids"], (0, 1), (7, 2), 1),
        _spec("model.mask", T["model.mask"], (0, 0), (2, 5), 1),
        _spec("model.mask", T["model.mask"], (2, 0), (4, 5), 0),
        # FSDP-style: rank 1's shard of a 1-row tensor is empty
        _spec("model.scale", T["model.scale"], (0, 0), (1, 4), 0),
        _spec("model.scale", T["model.scale"], (1, 0), (0, 4), 1),
        _spec("model.nothing", T["model.nothing"], (0, 0), (0, 3), 2),
        _spec("optim.step", T["optim.step"], (), (), 1),
        _spec("lst.0", T["lst.0"], (0,), (3,), 2),
    ]
    objects = {
        "extra.name": "hello",
        "extra.count": 42,
        "extra.none": None,
        "extra.nested": [1, [2, [3, "x"]], {"k": (4, 5)}],
        "extra.cfg": {"lr": 0.1, "betas": [0.9, 0.95], "flags": {"a": True}},
        "lst.1": 3,
    }
    object_ranks = {"extra.name": 0, "extra.count": 1, "extra.none": 2, "extra.nested": 0, "extra.cfg": 2, "lst.1": 1}
    planner = {k: tuple(k.split(".")) for k in [*tensors, *objects]}
    planner["lst.0"], planner["lst.1"] = ("lst", 0), ("lst", 1)
    obj_specs = [ObjectSpec(k, _torch_save_bytes(v), object_ranks[k]) for k, v in objects.items()]
    return tensors, objects, planner, chunks, obj_specs


def _write_threaded(writer: DCPWriter, chunks, tensors, workers: int = 4) -> None:
    def work(i_spec):
        i, spec = i_spec
        region = tensors[spec.key][spec.box.slices()] if spec.box.ndim else tensors[spec.key]
        _write_pieces(writer.open_chunk(spec), region, random.Random(i))

    items = list(enumerate(chunks))
    random.Random(0).shuffle(items)
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(work, items))


def _nest(flat: dict, planner: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        path = planner[key]
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = path[i + 1]
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = [] if isinstance(nxt, int) else {}
                node = node[part]
            else:
                node = node.setdefault(part, [] if isinstance(nxt, int) else {})
        if isinstance(node, list):
            while len(node) <= path[-1]:
                node.append(None)
        node[path[-1]] = value
    return out


def _assert_nested_equal(got, want, where="") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and _same(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            _assert_nested_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list) and any(isinstance(v, (torch.Tensor, dict)) for v in want):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_nested_equal(g, w, f"{where}.{i}")
    else:
        assert got == want, where


def test_checkpoint_loads_with_dcp_and_dcp_to_torch_save(tmp_path):
    tensors, objects, planner, chunks, obj_specs = _mixed_state()
    root = tmp_path / "ckpt"
    writer = DCPWriter(root, chunks, obj_specs, planner, world_size=3)
    assert sorted(writer.layout()) == [0, 1, 2]
    writer.write_objects()
    _write_threaded(writer, chunks, tensors)
    writer.commit()
    assert sorted(p.name for p in root.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    for rank, size in writer.layout().items():
        assert (root / f"__{rank}_0.distcp").stat().st_size == size

    # dcp.load into a plain nested state dict, one process, no process group
    target = {k: torch.zeros_like(v) if v.numel() else torch.empty_like(v) for k, v in tensors.items()}
    target.update({k: None for k in objects})
    nested = _nest(target, planner)
    dcp.load(nested, checkpoint_id=root)
    expected = _nest({**tensors, **objects}, planner)
    _assert_nested_equal(nested, expected)

    # dcp_to_torch_save rebuilds the same nested state dict
    out = tmp_path / "full.pt"
    dcp_to_torch_save(root, out)
    _assert_nested_equal(torch.load(out, weights_only=False), expected)


def _read_order(root: Path, state: dict) -> dict[str, list[tuple[int, int]]]:
    """The (offset, length) of every item torch's ``FileSystemReader`` reads while ``dcp.load``
    fills ``state``, per file, in the order it reads them (grouped by file, then plan order, as
    torch 2.13's ``read_data`` serves a plan)."""
    from torch.distributed.checkpoint import FileSystemReader

    order: dict[str, list[tuple[int, int]]] = {}

    class Recording(FileSystemReader):
        def read_data(self, plan, planner):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                order.setdefault(info.relative_path, []).append((info.offset, info.length))
            return super().read_data(plan, planner)

    dcp.load(state, storage_reader=Recording(root))
    return order


@pytest.mark.parametrize("item_order", ["load", "save"])
def test_each_file_is_read_front_to_back(tmp_path, item_order):
    """dcp.load walks the state dict with its top-level keys sorted and each subtree in the
    saving job's order (an AdamW ``step`` before its ``exp_avg``): the default layout puts every
    file's items in that order, so the loader reads each file front to back, never seeking back
    (issue 29: a layout in ``.metadata`` key order, every 0-d ``step`` after all the moments, made
    the loader jump to the file's end and back twice per parameter). ``item_order="save"``
    (dcp.save's own layout, objects first) is read with seeks back: the planted regression."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    sd = {
        "model": {"w": _random((4, 3), torch.float32, 1), "v": _random((5,), torch.bfloat16, 2)},
        "optim": {"state": {name: {"step": torch.tensor(7.0), "exp_avg": _random(shape, torch.float32, 3),
                                   "exp_avg_sq": _random(shape, torch.float32, 4)}
                            for name, shape in (("w", (4, 3)), ("v", (5,)))},
                  "param_groups": [{"lr": 0.1, "params": ["w", "v"]}]},
        "extra": {"step": 3},
    }
    flat, planner = flatten_state_dict(sd)
    # the chunks in .metadata's order of a dcp.save whose replicated steps trail the moments (the
    # layout's order); planner_data in the job's flattening order, as dcp.save records it
    keys = sorted(flat, key=lambda k: k.endswith(".step") and k.startswith("optim"))
    chunks = [ChunkSpec(k, _name(flat[k].dtype), tuple(flat[k].shape), full_box(tuple(flat[k].shape)), 0)
              for k in keys if isinstance(flat[k], torch.Tensor)]
    objs = [ObjectSpec(k, _torch_save_bytes(flat[k]), 0) for k in keys if not isinstance(flat[k], torch.Tensor)]
    root = tmp_path / "ckpt"
    writer = DCPWriter(root, chunks, objs, planner, world_size=1, item_order=item_order)
    _write_threaded(writer, chunks, flat)
    writer.commit()

    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
              "optim": {"state": {n: {k: torch.zeros_like(v) for k, v in st.items()}
                                  for n, st in sd["optim"]["state"].items()},
                        "param_groups": [{"lr": 0.0, "params": []}]},
              "extra": {"step": 0}}
    reads = _read_order(root, target)
    _assert_nested_equal(target, sd)  # the layout changes where items lie, never what loads
    backward = sum(b[0] < a[0] + a[1] for items in reads.values() for a, b in zip(items, items[1:]))
    gaps = sum(b[0] != a[0] + a[1] for items in reads.values() for a, b in zip(items, items[1:]))
    if item_order == "load":
        assert (backward, gaps) == (0, 0) and reads["__0_0.distcp"][0][0] == 0
    else:
        assert backward >= 3  # extra (an object, first in the file) read first; each step behind its moments


def test_matches_a_real_dcp_save(tmp_path):
    """Same state dict through dcp.save and DCPWriter: identical .distcp bytes and metadata."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    sd = {
        "a": torch.arange(6.0).view(2, 3),
        "s": torch.tensor(3.0),
        "b": _random((3, 5), torch.bfloat16, 1),
        "f8": _random((4,), torch.float8_e4m3fn, 2),
        "obj": {"x": 1, "l": [1, "a"], "n": None},
        "st": "hello",
        "lst": [torch.ones(2), 3],
    }
    dcp.save(sd, checkpoint_id=tmp_path / "ref")
    flat, planner = flatten_state_dict(sd)
    chunks, objs = [], []
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            chunks.append(ChunkSpec(k, _name(v.dtype), tuple(v.shape), full_box(tuple(v.shape)), 0))
        else:
            objs.append(ObjectSpec(k, _torch_save_bytes(v), 0))
    writer = DCPWriter(tmp_path / "ours", chunks, objs, planner, world_size=1, item_order="save")
    _write_threaded(writer, chunks, flat)
    writer.commit()

    assert (tmp_path / "ours/__0_0.distcp").read_bytes() == (tmp_path / "ref/__0_0.distcp").read_bytes()
    ref = pickle.loads((tmp_path / "ref/.metadata").read_bytes())
    ours = pickle.loads((tmp_path / "ours/.metadata").read_bytes())
    assert ours.state_dict_metadata == ref.state_dict_metadata
    assert list(ours.state_dict_metadata) == list(ref.state_dict_metadata)
    assert ours.planner_data == ref.planner_data
    assert list(ours.storage_data.items()) == list(ref.storage_data.items())
    assert [k.index for k in ours.storage_data] == [k.index for k in ref.storage_data]
    assert ours.version == ref.version
    assert ours.storage_meta.checkpoint_id == tmp_path / "ours"
    assert (ours.storage_meta.load_id, ours.storage_meta.modules) == (None, [])
    assert type(ours.storage_meta.save_id) is str


# ----------------------------------------------------------------------------- validation


def _one(shape=(4, 2), dtype="float32"):
    t = torch.zeros(shape, dtype=getattr(torch, dtype))
    return t, {"w": ("w",)}


@pytest.mark.parametrize(
    "boxes, why",
    [
        ([((0, 0), (2, 2)), ((1, 0), (3, 2))], "overlap"),
        ([((0, 0), (2, 2))], "gap"),
        ([((0, 0), (2, 2)), ((2, 0), (3, 2))], "out of bounds"),
        ([((0,), (4,))], "wrong rank"),
    ],
)
def test_rejects_bad_coverage(tmp_path, boxes, why):
    t, planner = _one()
    chunks = [_spec("w", t, o, s, 0) for o, s in boxes]
    with pytest.raises(ConfigError):
        DCPWriter(tmp_path / why.replace(" ", "_"), chunks, [], planner, 1)
    assert not (tmp_path / why.replace(" ", "_")).exists()  # rejected before any I/O


def test_rejects_bad_names_and_ranks(tmp_path):
    t, planner = _one()
    ok = [_spec("w", t, (0, 0), (4, 2), 0)]
    with pytest.raises(ConfigError):
        DCPWriter(tmp_path, ok, [], {"w": ("w",), "extra": ("extra",)}, 1)
    with pytest.raises(ConfigError):
        DCPWriter(tmp_path, [_spec("w", t, (0, 0), (4, 2), 2)], [], planner, 2)
    with pytest.raises(ConfigError):
        DCPWriter(tmp_path, ok, [ObjectSpec("w", b"x", 0)], planner, 1)
    with pytest.raises(ConfigError):
        DCPWriter(tmp_path, ok, [], planner, 2, file_name=lambda r: "same.distcp")
    with pytest.raises(ConfigError):
        DCPWriter(tmp_path, [_spec("z", torch.zeros(()), (), (), 0)] * 2, [], {"z": ("z",)}, 1)


def test_duplicate_empty_shards_are_stored_once(tmp_path):
    """FSDP over 4 ranks of a 2-row tensor: ranks 2 and 3 both hold the empty box at row 2."""
    t = _random((2, 3), torch.float32, 0)
    chunks = [_spec("w", t, (o, 0), (s, 3), r) for r, (o, s) in enumerate(_chunk_dim0(2, 4))]
    writer = DCPWriter(tmp_path / "c", chunks, [], {"w": ("w",)}, 4)
    _write_threaded(writer, chunks, {"w": t})
    writer.commit()
    md = pickle.loads((tmp_path / "c/.metadata").read_bytes())
    assert [tuple(c.offsets) for c in md.state_dict_metadata["w"].chunks] == [(0, 0), (1, 0), (2, 0)]
    got = {"w": torch.zeros(2, 3)}
    dcp.load(got, checkpoint_id=tmp_path / "c")
    assert _same(got["w"], t)


# ----------------------------------------------------------------------------- commit


def test_metadata_only_at_commit_and_abort_leaves_none(tmp_path):
    tensors, objects, planner, chunks, obj_specs = _mixed_state()
    root = tmp_path / "ckpt"
    writer = DCPWriter(root, chunks, obj_specs, planner, world_size=3)
    _write_threaded(writer, chunks[:-1], tensors)
    writer.write_objects()
    with pytest.raises(IncompleteCheckpointError):
        writer.commit()  # the last chunk was never written
    assert not any(p.name.endswith("metadata") for p in root.iterdir())
    _write_pieces(writer.open_chunk(chunks[-1]), tensors[chunks[-1].key], random.Random(0))
    assert not (root / ".metadata").exists()
    writer.commit()
    assert (root / ".metadata").exists()
    with pytest.raises(ConfigError):
        writer.open_chunk(chunks[0])

    # a fresh writer refuses a directory that holds a checkpoint
    with pytest.raises(DestinationError):
        DCPWriter(root, chunks, obj_specs, planner, world_size=3).prepare()

    other = tmp_path / "aborted"
    with pytest.raises(RuntimeError, match="boom"):
        with DCPWriter(other, chunks, obj_specs, planner, world_size=3) as w:
            _write_threaded(w, chunks, tensors)
            raise RuntimeError("boom")
    assert list(other.iterdir()) == []
    with pytest.raises(CheckpointException, match="metadata"):
        dcp.load({"model": {"scale": torch.zeros(1, 4)}}, checkpoint_id=other)


# ----------------------------------------------------------------------------- FSDP2 world


def _fsdp_model():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 1))


def _fsdp_load_worker(rank: int, world: int, root: str, expected: dict) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class RecordingReader(FileSystemReader):
        files: set = set()

        def read_data(self, plan, planner):
            for item in plan.items:
                self.files.add(self.storage_data[item.storage_index].relative_path)
            return super().read_data(plan, planner)

    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp_model()
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    reader = RecordingReader(root)
    dcp.load(sd, storage_reader=reader)
    model.load_state_dict(sd)
    for key, param in model.state_dict().items():
        (off, size) = _chunk_dim0(param.shape[0], world)[rank]
        assert _same(param.to_local(), expected[key][off : off + size]), (rank, key)
        assert _same(param.full_tensor(), expected[key]), (rank, key)
    assert reader.files == {f"__{rank}_0.distcp"}, (rank, reader.files)


def test_fsdp2_world_loads_own_files(tmp_path):
    from ckpt_factory import run_world

    world = 2
    shapes = {k: tuple(v.shape) for k, v in _fsdp_model().state_dict().items()}
    expected = {k: _random(s, torch.float32, i + 100) for i, (k, s) in enumerate(shapes.items())}
    chunks = []
    for key, t in expected.items():
        for rank, (off, size) in enumerate(_chunk_dim0(t.shape[0], world)):
            rest = tuple(t.shape[1:])
            chunks.append(_spec(key, t, (off, *[0] * len(rest)), (size, *rest), rank))
    assert any(c.box.numel == 0 for c in chunks)  # the (1, 3) weight leaves rank 1 empty
    writer = DCPWriter(tmp_path / "ckpt", chunks, [], {k: (k,) for k in expected}, world)
    _write_threaded(writer, chunks, expected)
    writer.commit()
    run_world(_fsdp_load_worker, world, args=(str(tmp_path / "ckpt"), expected), timeout=240)


# ----------------------------------------------------------------------------- rank-local metadata


def _local_state(rank: int, world: int, mesh) -> dict:
    """A state dict with a sharded, a replicated and a 0-d tensor and an object (the same values
    on every rank; DTensors over ``mesh``)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w, b = _random((5, 3), torch.float32, 1), _random((4,), torch.bfloat16, 2)
    return {"model": {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": distribute_tensor(b, mesh, [Replicate()])},
            "step": _random((), torch.int64, 3), "extra": {"lr": 0.25, "name": "x"}}


def _torch_rank_local_worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    dcp.save(_local_state(rank, world, mesh), checkpoint_id=root, use_collectives=False)


def _local_specs(world: int) -> tuple[dict, list, list, list, list, dict]:
    """The same state as :func:`_local_state`, laid out as ``--local-files rank`` stores it: every
    item each rank holds in its own file, read by that rank only."""
    w, b, step = _random((5, 3), torch.float32, 1), _random((4,), torch.bfloat16, 2), _random((), torch.int64, 3)
    tensors = {"model.w": w, "model.b": b, "step": step}
    chunks, readers = [], []
    for rank, (off, size) in enumerate(_chunk_dim0(5, world)):
        for spec in (_spec("model.w", w, (off, 0), (size, 3), rank), _spec("model.b", b, (0,), (4,), rank),
                     _spec("step", step, (), (), rank)):
            chunks.append(spec)
            readers.append((rank,))
    objects, object_readers = [], []
    for key, value in (("extra.lr", 0.25), ("extra.name", "x")):
        buf = io.BytesIO()
        torch.save(value, buf)
        for rank in range(world):
            objects.append(ObjectSpec(key, buf.getvalue(), rank))
            object_readers.append((rank,))
    planner = {"model.w": ("model", "w"), "model.b": ("model", "b"), "step": ("step",),
               "extra.lr": ("extra", "lr"), "extra.name": ("extra", "name")}
    return tensors, chunks, readers, objects, object_readers, planner


def test_rank_local_metadata_is_what_dcp_save_without_collectives_writes(tmp_path):
    """Each rank's ``__<r>.metadata`` names what ``dcp.save(use_collectives=False)`` of the same
    state names on that rank (keys, boxes, item lengths); torch's own loader reads it back; a
    writer of some ranks writes only theirs."""
    from ckpt_factory import run_world
    from formats.dcp.metadata import load_metadata_file

    world = 2
    run_world(_torch_rank_local_worker, world, args=(str(tmp_path / "torch"),), timeout=240)
    tensors, chunks, readers, objects, object_readers, planner = _local_specs(world)
    with pytest.raises(ConfigError, match="stored twice in rank 0"):
        DCPWriter(tmp_path / "bad", chunks + chunks[:1], objects, planner, world, readers=readers + readers[:1],
                  object_readers=object_readers)
    with pytest.raises(ConfigError, match="overlap"):  # without readers a box is stored once
        DCPWriter(tmp_path / "bad", chunks, objects[::2], planner, world)
    writer = DCPWriter(tmp_path / "ours", chunks, objects, planner, world, readers=readers,
                       object_readers=object_readers)
    assert writer.metadata_names() == ["__0.metadata", "__1.metadata"]
    _write_threaded(writer, chunks, tensors)
    from converter.run.output_check import PlannedOutput, check_output

    planned = PlannedOutput.of(((k, str(t.dtype).removeprefix("torch."), t.shape) for k, t in tensors.items()),
                               ["extra.lr", "extra.name"])
    m = writer.manifest()  # what commit publishes: every rank's metadata, each entry once, each copy once
    assert sorted(m.keys) == sorted(tensors) and sorted(m.objects) == ["extra.lr", "extra.name"]
    assert len(m.files) == len(chunks) + len(objects)
    check_output("from-universal", planned, m)
    writer.commit()
    assert not (tmp_path / "ours" / ".metadata").exists()
    for rank in range(world):
        theirs = load_metadata_file(tmp_path / "torch" / f"__{rank}.metadata")
        ours = load_metadata_file(tmp_path / "ours" / f"__{rank}.metadata")
        assert dict(ours.entries) == dict(theirs.entries), rank
        assert {k: (v.relative_path, v.length) for k, v in ours.storage.items()} == \
            {k: (v.relative_path, v.length) for k, v in theirs.storage.items()}, rank
        assert dict(ours.planner_data) == dict(theirs.planner_data)
    got = {"model": {"w": torch.zeros(5, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, "step": torch.zeros((), dtype=torch.int64),
           "extra": {"lr": None, "name": None}}
    dcp.load(got, checkpoint_id=tmp_path / "ours", no_dist=True)  # rank 0's own view: its metadata only
    assert _same(got["model"]["b"], tensors["model.b"]) and _same(got["step"], tensors["step"])
    assert got["extra"] == {"lr": 0.25, "name": "x"}
    one = DCPWriter(tmp_path / "node1", chunks, objects, planner, world, readers=readers,
                    object_readers=object_readers, ranks=[1])
    _write_threaded(one, [c for c in chunks if c.rank == 1], tensors)
    with pytest.raises(ConfigError, match="does not write"):
        one.open_chunk(chunks[0])
    one.commit()
    assert sorted(p.name for p in (tmp_path / "node1").iterdir()) == ["__1.metadata", "__1_0.distcp"]
    assert (tmp_path / "node1" / "__1_0.distcp").read_bytes() == (tmp_path / "ours" / "__1_0.distcp").read_bytes()


def test_rank_local_manifest_names_a_rank_whose_metadata_lost_a_chunk(tmp_path):
    """Planted: rank 1's metadata loses a storage entry of ``model.w``: the manifest (what the
    output check reads) says so, naming the rank."""
    tensors, chunks, readers, objects, object_readers, planner = _local_specs(2)
    writer = DCPWriter(tmp_path / "ours", chunks, objects, planner, 2, readers=readers, object_readers=object_readers)
    _write_threaded(writer, chunks, tensors)
    writer.manifest()
    storage = writer._final[1].storage_data
    del storage[next(k for k in storage if k.fqn == "model.w")]
    assert any("'model.w'" in p and "rank 1's metadata" in p for p in writer.manifest().problems)


def test_many_rank_files_written_tensor_by_tensor_are_written_in_whole_blocks(tmp_path):
    """A conversion to many ranks writes each tensor's chunk into every rank's file, then the next
    tensor's: every file keeps a partly filled block open. With 48 files none is pushed out half
    filled (with 1 MiB blocks and a 32 MiB cap, nearly all were: written in pieces), and the
    checkpoint loads bit-exact."""
    world, rows = 48, 48 * 64
    tensors = {f"model.w{i}": _random((rows, 96), torch.float32, i) for i in range(24)}
    planner = {k: tuple(k.split(".")) for k in tensors}
    chunks = [ChunkSpec.of(k, "float32", (rows, 96), Box((r * 64, 0), (64, 96)), r)
              for k in tensors for r in range(world)]  # tensor by tensor, as the copy tasks come
    root = tmp_path / "ckpt"
    writer = DCPWriter(root, chunks, [], planner, world_size=world)
    for i, spec in enumerate(chunks):
        _write_pieces(writer.open_chunk(spec), tensors[spec.key][spec.box.slices()], random.Random(i))
    writer.commit()
    assert writer._combiner.evicted == 0 and writer._combiner.full_blocks > 0
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    nested = _nest(target, planner)
    dcp.load(nested, checkpoint_id=root)
    _assert_nested_equal(nested, _nest(tensors, planner))


def test_a_chunk_is_reserved_under_the_lock_and_its_first_bytes_written_outside(tmp_path, monkeypatch):
    """Opening a chunk writes its archive's first bytes, which may complete a block: a write to
    the disk. Other threads' chunks must not wait on it behind the writer's lock. A chunk whose
    opening failed can be opened again; one opened is refused a second time."""
    from formats.dcp import archive_writer

    tensors, _, planner, chunks, obj_specs = _mixed_state()
    writer = DCPWriter(tmp_path / "ckpt", chunks, obj_specs, planner, world_size=3)
    held, real = [], archive_writer.TensorArchiveWriter._write_prefix
    fail = {"once": True}

    def prefix(self):
        held.append(writer._lock.locked())
        if fail.pop("once", False):
            raise OSError(5, "planted")
        return real(self)

    monkeypatch.setattr(archive_writer.TensorArchiveWriter, "_write_prefix", prefix)
    spec = chunks[0]
    with pytest.raises(OSError, match="planted"):
        writer.open_chunk(spec)
    sink = writer.open_chunk(spec)  # the failed opening left no reservation behind
    with pytest.raises(ConfigError, match="opened twice"):
        writer.open_chunk(spec)
    assert held == [False, False]
    _write_pieces(sink, tensors[spec.key][spec.box.slices()] if spec.box.ndim else tensors[spec.key], random.Random(0))
    writer.abort()


def test_few_rank_files_are_written_behind_many_by_the_workers(tmp_path):
    """Large blocks (few rank files) go to the combiner's writer thread; the small blocks of many
    files stay with the workers, which keep several small writes in flight."""
    from formats import fsutil
    from formats.dcp.writer import DCPWriter

    for world, behind in ((3, True), (64, False)):
        w = DCPWriter(tmp_path / f"w{world}", [], [], {}, world, memory_budget=512 << 20)
        assert w._combiner.behind is behind, world
        assert (w._combiner.block >= fsutil.WRITE_BEHIND_MIN_BLOCK) is behind


def test_the_write_behind_queue_is_a_small_part_of_the_memory_budget(tmp_path):
    """The full blocks queued for the disk: WRITE_BEHIND_BYTES at the default budget, at most
    1/WRITE_BEHIND_PER_BUDGET of a smaller one (never under two blocks)."""
    from formats import fsutil
    from formats.dcp.writer import DCPWriter

    mib = 1 << 20
    for budget in (512 * mib, 64 * mib, 32 * mib, 4 * mib):
        w = DCPWriter(tmp_path / f"b{budget}", [], [], {}, 3, memory_budget=budget)
        queue = w._combiner.queue_bytes
        assert queue <= max(budget // fsutil.WRITE_BEHIND_PER_BUDGET, 2 * w._combiner.block), budget
        assert queue <= fsutil.WRITE_BEHIND_BYTES and queue >= 2 * w._combiner.block
    assert DCPWriter(tmp_path / "d", [], [], {}, 3, memory_budget=512 * mib)._combiner.queue_bytes == fsutil.WRITE_BEHIND_BYTES
