"""DCPReader against real checkpoints written by ``dcp.save``; torch is the oracle.

Every region read is compared bit for bit (NaN payloads included) with the tensors that
``dcp_to_torch_save`` (torch's own DCP loader) produces from the same checkpoint.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from formats.base import Box, CheckpointReader
from formats.dcp import DCPReader, is_dcp_checkpoint
from formats.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidCheckpointError,
    UnsafePickleError,
    UnsupportedError,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@dataclass
class Custom:
    """A class outside torch's weights-only allowlist."""

    name: str
    value: int


# ------------------------------------------------------------------------------------------------
# Helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's exact bytes (so NaN payloads and -0.0 compare exactly)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
    assert got.is_contiguous()
    assert torch.equal(bits(got), bits(want))


def nested_get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def torch_oracle(ckpt: Path, out: Path) -> dict:
    """The whole checkpoint as torch's own loader returns it (nested state dict)."""
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=False)


def random_subbox(rng: random.Random, box: Box) -> Box:
    offsets, sizes = [], []
    for o, s in zip(box.offsets, box.sizes):
        a = rng.randint(0, s)
        b = rng.randint(a, s)
        offsets.append(o + a)
        sizes.append(b - a)
    return Box(tuple(offsets), tuple(sizes))


def check_against_oracle(reader: DCPReader, oracle: dict, seed: int = 0) -> int:
    """Read every chunk whole and in random sub-regions; compare with the oracle. Returns reads."""
    rng, reads = random.Random(seed), 0
    for key, entry in reader.index().tensors.items():
        full = nested_get(oracle, entry.path)
        assert isinstance(full, torch.Tensor), key
        assert full.dtype == getattr(torch, entry.dtype) and tuple(full.shape) == entry.shape
        for chunk in entry.chunks:
            regions = [chunk.box] + [random_subbox(rng, chunk.box) for _ in range(4)]
            for region in regions:
                got = reader.read_region(key, chunk, region)
                assert_bit_equal(got, full[region.slices()])
                reads += 1
            reader.verify_chunk_crc(key, chunk)
    return reads


def rewrite_metadata(ckpt: Path, edit, name: str = ".metadata") -> None:
    """Hand-craft a checkpoint: load torch's own metadata (trusted), edit it, pickle it back."""
    path = ckpt / name
    md = pickle.loads(path.read_bytes())
    edit(md)
    path.write_bytes(pickle.dumps(md))


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------------
# Single-process checkpoints


def single_state_dict() -> dict:
    g = torch.Generator().manual_seed(0)
    nan32 = torch.tensor([0x7FC00001, -0x3E000000, 0x7F800001, 0], dtype=torch.int32)
    nan16 = torch.tensor([0x7FC1, -0x7F, 0x7F81, 0], dtype=torch.int16)
    return {
        "model": {
            "w32": torch.randn(6, 5, generator=g),
            "wbf16": torch.randn(4, 7, generator=g).to(torch.bfloat16),
            "wf16": torch.randn(3, 2, 2, generator=g).to(torch.float16),
            "f8": torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn),
            "i64": torch.arange(-5, 7, dtype=torch.int64).view(3, 4),
            "mask": torch.rand(9, generator=g) > 0.5,
            "scalar": torch.tensor(3.5),
            "t32": torch.randn(5, 3, generator=g).t(),  # saved non-contiguous: stride (1, 3)
            "tbf16": torch.randn(2, 6, generator=g).to(torch.bfloat16).t(),
            "empty": torch.empty(0, 4),
            "nan32": nan32.view(torch.float32),
            "nanbf16": nan16.view(torch.bfloat16),
        },
        "extra": {
            "step": 17,
            "name": "run-a",
            "none": None,
            "history": [1.5, 2.5, "x"],
            "nested": {"flag": True, "ratio": 0.25},
            "custom": Custom("c", 3),
        },
    }


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """(plain checkpoint, zstd checkpoint, oracle state dict, original state dict)."""
    base = tmp_path_factory.mktemp("single")
    sd = single_state_dict()
    dcp.save(sd, checkpoint_id=base / "plain")
    dcp.save(sd, storage_writer=FileSystemWriter(base / "zstd", _extensions=[ZStandard()]))
    oracle = torch_oracle(base / "plain", base / "oracle.pt")
    return base / "plain", base / "zstd", oracle, sd


def test_single_process_regions_match_torch(single):
    plain, _, oracle, original = single
    with DCPReader(plain) as reader:
        assert isinstance(reader, CheckpointReader)
        assert check_against_oracle(reader, oracle) > 50
        # the oracle is itself faithful to what was saved
        for key, entry in reader.index().tensors.items():
            assert_bit_equal(nested_get(oracle, entry.path), nested_get(original, entry.path))


def test_single_process_index(single):
    plain, _, _, original = single
    index = DCPReader(plain).index()
    assert index.format == "dcp" and index.root == str(plain)
    t = index.tensors
    assert t["model.wbf16"].dtype == "bfloat16" and t["model.f8"].dtype == "float8_e4m3fn"
    assert t["model.mask"].dtype == "bool" and t["model.i64"].dtype == "int64"
    assert t["model.scalar"].shape == () and t["model.scalar"].chunks[0].box == Box((), ())
    assert t["model.t32"].shape == (3, 5) and t["model.empty"].shape == (0, 4)
    assert t["model.w32"].path == ("model", "w32")
    assert all(c.rank == 0 and c.file == "__0_0.distcp" for e in t.values() for c in e.chunks)
    names = {"step", "name", "none", "history", "nested.flag", "nested.ratio", "custom"}
    assert set(index.objects) == {f"extra.{k}" for k in names}
    assert index.objects["extra.nested.flag"].path == ("extra", "nested", "flag")
    info = index.info
    assert info["world_size"] == 1 and info["version"] == "1.0.0"
    assert info["metadata_files"] == [".metadata"] and info["transforms"] == []
    assert info["files"] == {"__0_0.distcp": (plain / "__0_0.distcp").stat().st_size}
    assert is_dcp_checkpoint(plain) and not is_dcp_checkpoint(plain / "__0_0.distcp")


def test_transposed_chunk_keeps_stored_strides(single):
    plain, _, _, original = single
    reader = DCPReader(plain)
    entry = reader.index().tensors["model.t32"]
    chunk = entry.chunks[0]
    assert reader.chunk_archive(entry.key, chunk).stride == (1, 3)
    col = reader.read_region(entry.key, chunk, Box((0, 2), (3, 2)))
    assert_bit_equal(col, original["model"]["t32"][:, 2:4])


def test_empty_regions_and_scalar(single):
    plain, _, _, original = single
    reader = DCPReader(plain)
    e = reader.index().tensors["model.empty"]
    got = reader.read_region(e.key, e.chunks[0], e.chunks[0].box)
    assert got.shape == (0, 4) and got.dtype == torch.float32
    w = reader.index().tensors["model.w32"]
    assert reader.read_region(w.key, w.chunks[0], Box((2, 1), (0, 3))).shape == (0, 3)
    s = reader.index().tensors["model.scalar"]
    assert_bit_equal(reader.read_region(s.key, s.chunks[0], Box((), ())), original["model"]["scalar"])


def test_objects_load_equal(single):
    plain, zstd, oracle, original = single
    for ckpt in (plain, zstd):
        reader = DCPReader(ckpt)
        for key, obj in reader.index().objects.items():
            if key == "extra.custom":
                continue
            assert ".".join(obj.path) == key
            assert reader.load_object(key) == nested_get(original, obj.path)
            assert reader.load_object(key) == nested_get(oracle, obj.path)
            data = reader.read_object_bytes(key)
            assert torch.load(io.BytesIO(data), weights_only=True) == nested_get(oracle, obj.path)


def test_custom_class_needs_trust_pickle(single):
    plain, _, _, original = single
    reader = DCPReader(plain)
    with pytest.raises(UnsafePickleError, match="--trust-pickle"):
        reader.load_object("extra.custom")
    assert reader.load_object("extra.custom", trust_pickle=True) == original["extra"]["custom"]
    assert DCPReader(plain, trust_pickle=True).load_object("extra.custom") == Custom("c", 3)


def test_zstd_checkpoint_matches_torch(single, tmp_path):
    _, zstd, _, _ = single
    oracle = torch_oracle(zstd, tmp_path / "zstd.pt")
    reader = DCPReader(zstd)
    assert reader.index().info["transforms"] == ["stream.zstd/1"]
    assert all(c.locator.transforms == ("stream.zstd/1",)
               for e in reader.index().tensors.values() for c in e.chunks)
    assert check_against_oracle(reader, oracle, seed=1) > 50


def test_concurrent_reads(single):
    plain, _, oracle, _ = single
    reader = DCPReader(plain)
    jobs = [(e, c) for e in reader.index().tensors.values() for c in e.chunks] * 20

    def read(job):
        entry, chunk = job
        got = reader.read_region(entry.key, chunk, chunk.box)
        return torch.equal(bits(got), bits(nested_get(oracle, entry.path)[chunk.box.slices()]))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, jobs))
    reader.close()


def test_index_lists_keys_in_the_saving_jobs_order(single, tmp_path):
    """The index follows ``planner_data``'s order (dcp.save's flattening of the job's state dict,
    the order a resumed job's ``dcp.load`` walks), not ``state_dict_metadata``'s, which trails
    the replicated items (a multi-rank save's AdamW steps) after the rest: from-universal lays
    its files out in the index's order (issue 29)."""
    plain, _, oracle, _ = single
    moved = copy_ckpt(plain, tmp_path / "moved")
    first = next(iter(pickle.loads((plain / ".metadata").read_bytes()).state_dict_metadata))

    def trail_the_first(md):
        md.state_dict_metadata[first] = md.state_dict_metadata.pop(first)

    rewrite_metadata(moved, trail_the_first)
    md = pickle.loads((moved / ".metadata").read_bytes())
    assert list(md.state_dict_metadata)[-1] == first and list(md.planner_data)[0] == first
    index = DCPReader(moved).index()
    saved = [k for k in md.planner_data if k in {*index.tensors, *index.objects}]
    assert [k for k in saved if k in index.tensors] == list(index.tensors)
    assert [k for k in saved if k in index.objects] == list(index.objects)
    check_against_oracle(DCPReader(moved), oracle, seed=3)


def test_old_metadata_without_version_and_storage_meta(single, tmp_path):
    plain, _, oracle, _ = single
    old = copy_ckpt(plain, tmp_path / "old")

    def strip(md):
        del md.__dict__["version"], md.__dict__["storage_meta"]

    rewrite_metadata(old, strip)
    reader = DCPReader(old)
    assert reader.index().info["version"] is None
    assert reader.index().info["layout_version"] == "torch<=2.3"
    assert reader.index().info["storage_meta"] is None
    check_against_oracle(reader, oracle, seed=2)


# ------------------------------------------------------------------------------------------------
# A 2-rank gloo world: FSDP2 + AdamW, saved three ways


def _world_worker(rank: int, world: int, base: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{base}/store", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 5), torch.nn.Linear(5, 1)
    )
    for layer in model:
        fully_shard(layer)  # Linear(5, 1): rank 1 holds an empty shard
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    mesh = init_device_mesh("cpu", (world,))
    cols = torch.arange(15, dtype=torch.float32).view(3, 5).to(torch.bfloat16)
    sd = {
        "model": msd,
        "optim": osd,
        "extra": {
            "cols": distribute_tensor(cols, mesh, [Shard(1)]),  # 2-D boxes offset in dim 1
            "rank": rank,
            "tag": "w2",
        },
    }
    dcp.save(sd, checkpoint_id=f"{base}/collective")
    dcp.save(sd, checkpoint_id=f"{base}/per_rank", use_collectives=False)
    dcp.save(sd, storage_writer=FileSystemWriter(f"{base}/zstd", _extensions=[ZStandard()]))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    base = tmp_path_factory.mktemp("world2")
    mp.spawn(_world_worker, args=(2, str(base)), nprocs=2, join=True)
    oracle = torch_oracle(base / "collective", base / "oracle.pt")
    return base, oracle


def test_fsdp2_world_matches_torch(world2):
    base, oracle = world2
    reader = DCPReader(base / "collective")
    index = reader.index()
    assert index.info["world_size"] == 2
    assert set(index.info["files"]) == {"__0_0.distcp", "__1_0.distcp"}
    w = index.tensors["model.0.weight"]
    assert [c.box for c in w.chunks] == [Box((0, 0), (2, 4)), Box((2, 0), (1, 4))]
    empty = index.tensors["model.3.weight"]
    assert [c.box for c in empty.chunks] == [Box((0, 0), (1, 5)), Box((1, 0), (0, 5))]
    cols = index.tensors["extra.cols"]
    assert [c.box for c in cols.chunks] == [Box((0, 0), (3, 3)), Box((0, 3), (3, 2))]
    assert index.tensors["optim.state.0.weight.exp_avg"].path == (
        "optim", "state", "0.weight", "exp_avg")
    assert index.tensors["optim.state.0.weight.step"].shape == ()
    check_against_oracle(reader, oracle, seed=3)
    for key, obj in index.objects.items():
        assert reader.load_object(key) == nested_get(oracle, obj.path)


def test_per_rank_metadata_merge(world2):
    base, oracle = world2
    ckpt = base / "per_rank"
    assert not (ckpt / ".metadata").exists()
    assert sorted(p.name for p in ckpt.glob("*.metadata")) == ["__0.metadata", "__1.metadata"]
    reader = DCPReader(ckpt)
    index = reader.index()
    assert index.info["metadata_files"] == ["__0.metadata", "__1.metadata"]
    assert index.info["per_rank_metadata"] and index.info["world_size"] == 2
    assert set(index.tensors) == set(DCPReader(base / "collective").index().tensors)
    step = index.tensors["optim.state.0.weight.step"]
    assert len(step.chunks) == 1 and step.chunks[0].rank == 0  # replicated: lowest rank's copy
    check_against_oracle(reader, oracle, seed=4)
    assert reader.load_object("extra.rank") == 0  # a key saved by every rank: rank 0's value
    assert reader.load_object("extra.tag") == "w2"
    assert reader.load_object("optim.param_groups.0.lr") == 0.1


def test_per_rank_metadata_missing_rank(world2, tmp_path):
    base, _ = world2
    ckpt = copy_ckpt(base / "per_rank", tmp_path / "pr")
    (ckpt / "__1.metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match="__1.metadata"):
        DCPReader(ckpt)


def test_fsdp2_zstd_matches_torch(world2, tmp_path):
    base, oracle = world2
    reader = DCPReader(base / "zstd")
    assert reader.index().info["transforms"] == ["stream.zstd/1"]
    check_against_oracle(reader, torch_oracle(base / "zstd", tmp_path / "z.pt"), seed=5)
    check_against_oracle(reader, oracle, seed=6)


# ------------------------------------------------------------------------------------------------
# Bad input


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_metadata_is_never_executed(tmp_path):
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    marker = tmp_path / "MARKER"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(UnsafePickleError, match=r"\.metadata.*system"):
        DCPReader(ckpt)
    assert not marker.exists()
    pickle.loads((ckpt / ".metadata").read_bytes())  # the payload is live: plain pickle runs it
    assert marker.exists()


def test_malicious_chunk_archive_is_never_executed(single, tmp_path):
    plain, _, _, _ = single
    ckpt = copy_ckpt(plain, tmp_path / "evil")
    marker = tmp_path / "MARKER"
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    data_file = ckpt / "__0_0.distcp"
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(buf.getvalue())

    def point_at_evil(md):
        for index in md.storage_data:
            if index.fqn == "model.w32":
                md.storage_data[index] = _StorageInfo("__0_0.distcp", offset, len(buf.getvalue()))

    rewrite_metadata(ckpt, point_at_evil)
    reader = DCPReader(ckpt)
    entry = reader.index().tensors["model.w32"]
    with pytest.raises(UnsafePickleError, match="system"):
        reader.read_region(entry.key, entry.chunks[0], entry.chunks[0].box)
    assert not marker.exists()


def _last_item(ckpt, name):
    """(key, end) of the item that ends last in file ``name`` (the first such chunk in index order)."""
    index = DCPReader(ckpt).index()
    ends = [(c.locator.offset + c.locator.length, k) for k, t in index.tensors.items() for c in t.chunks
            if c.file == name]
    end = max(e for e, _ in ends)
    return next(k for e, k in ends if e == end), end


def test_truncated_distcp(single, tmp_path):
    ckpt = copy_ckpt(single[0], tmp_path / "t")
    key, end = _last_item(ckpt, "__0_0.distcp")
    f = ckpt / "__0_0.distcp"
    os.truncate(f, f.stat().st_size - 100)
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp.*truncated") as e:
        DCPReader(ckpt)
    assert f"key {key!r} needs {end}" in str(e.value)  # the key of the file's last item


def test_missing_distcp(world2, tmp_path):
    ckpt = copy_ckpt(world2[0] / "collective", tmp_path / "m")
    key, _ = _last_item(ckpt, "__1_0.distcp")
    (ckpt / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"__1_0\.distcp") as e:
        DCPReader(ckpt)
    assert f"needed by key {key!r}" in str(e.value)


@pytest.mark.parametrize("damage", ["random", "truncated", "empty"])
def test_corrupted_metadata(single, tmp_path, damage):
    ckpt = copy_ckpt(single[0], tmp_path / "c")
    md = ckpt / ".metadata"
    raw = md.read_bytes()
    if damage == "random":
        md.write_bytes(b"\x80\x04" + random.Random(0).randbytes(len(raw)))
    elif damage == "empty":
        md.write_bytes(b"")
    else:
        for cut in range(1, len(raw), 37):
            md.write_bytes(raw[:cut])
            with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
                DCPReader(ckpt)
        return
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
        DCPReader(ckpt)


def test_damaged_chunk_archive_and_crc(single, tmp_path):
    ckpt = copy_ckpt(single[0], tmp_path / "d")
    reader = DCPReader(ckpt)
    entry = reader.index().tensors["model.w32"]
    chunk = entry.chunks[0]
    at = reader.chunk_archive(entry.key, chunk)
    reader.close()
    loc = chunk.locator
    with open(ckpt / chunk.file, "r+b") as f:  # flip one data byte: torch.load would not notice
        f.seek(loc.offset + at.data_start + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    reader = DCPReader(ckpt)
    with pytest.raises(CorruptCheckpointError, match="CRC-32.*model.w32|model.w32.*CRC-32"):
        reader.verify_chunk_crc(entry.key, chunk)
    with open(ckpt / chunk.file, "r+b") as f:  # wreck the zip central directory of that item
        f.seek(loc.offset + loc.length - 60)
        f.write(b"\x00" * 60)
    reader = DCPReader(ckpt)
    with pytest.raises(CorruptCheckpointError, match="model.w32"):
        reader.read_region(entry.key, chunk, chunk.box)


def test_dtype_and_shape_mismatch(single, tmp_path):
    ckpt = copy_ckpt(single[0], tmp_path / "mm")

    def lie(md):
        md.state_dict_metadata["model.w32"].properties.dtype = torch.float16
        md.state_dict_metadata["model.i64"].size = torch.Size([4, 3])
        md.state_dict_metadata["model.i64"].chunks[0].sizes = torch.Size([4, 3])

    rewrite_metadata(ckpt, lie)
    reader = DCPReader(ckpt)
    for key, pattern in (("model.w32", "float32"), ("model.i64", "shape")):
        entry = reader.index().tensors[key]
        with pytest.raises(CorruptCheckpointError, match=pattern):
            reader.read_region(key, entry.chunks[0], entry.chunks[0].box)


def test_bad_chunk_layouts(world2, tmp_path):
    src = world2[0] / "collective"
    key = "model.0.weight"

    def gap(md):
        md.state_dict_metadata[key].chunks.pop()

    def overlap(md):
        md.state_dict_metadata[key].chunks[1].offsets = torch.Size([1, 0])
        md.state_dict_metadata[key].chunks[1].sizes = torch.Size([2, 4])

    def outside(md):
        md.state_dict_metadata[key].chunks[1].sizes = torch.Size([2, 4])

    def no_storage(md):
        md.state_dict_metadata[key].chunks.append(
            ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([0, 4])))

    def escape(md):
        for index in md.storage_data:
            if index.fqn == key:
                md.storage_data[index] = _StorageInfo("../outside.distcp", 0, 10)

    cases = [(gap, "cover 8 of 12"), (overlap, "overlap"), (outside, "outside its shape"),
             (no_storage, "no storage entry"), (escape, "outside the checkpoint")]
    for i, (edit, pattern) in enumerate(cases):
        ckpt = copy_ckpt(src, tmp_path / f"c{i}")
        rewrite_metadata(ckpt, edit)
        with pytest.raises(CorruptCheckpointError, match=pattern) as info:
            DCPReader(ckpt)
        assert key in str(info.value)


def test_unknown_transform(single, tmp_path):
    ckpt = copy_ckpt(single[0], tmp_path / "u")

    def add_transform(md):
        for index, info in md.storage_data.items():
            if index.fqn == "model.w32":
                info.transform_descriptors = ["stream.rot13/1"]

    rewrite_metadata(ckpt, add_transform)
    reader = DCPReader(ckpt)
    entry = reader.index().tensors["model.w32"]
    with pytest.raises(UnsupportedError, match="rot13"):
        reader.read_region(entry.key, entry.chunks[0], entry.chunks[0].box)


def test_damaged_zstd_item(single, tmp_path):
    ckpt = copy_ckpt(single[1], tmp_path / "z")
    entry = DCPReader(ckpt).index().tensors["model.w32"]
    loc = entry.chunks[0].locator
    with open(ckpt / loc.relative_path, "r+b") as f:
        f.seek(loc.offset + loc.length // 2)
        f.write(b"\xde\xad\xbe\xef" * 4)
    with pytest.raises(CorruptCheckpointError, match="model.w32"):
        reader = DCPReader(ckpt)
        reader.read_region(entry.key, entry.chunks[0], entry.chunks[0].box)


def test_not_a_checkpoint(tmp_path, single):
    with pytest.raises(CheckpointNotFoundError):
        DCPReader(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidCheckpointError, match="not a DCP checkpoint: no .metadata.*empty"):
        DCPReader(empty)
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"{}")
    with pytest.raises(InvalidCheckpointError, match="not a DCP checkpoint"):
        DCPReader(other)
    assert not is_dcp_checkpoint(other) and not is_dcp_checkpoint(tmp_path / "nope")
    with pytest.raises(InvalidCheckpointError, match="is a file"):
        DCPReader(other / "model.safetensors")
    unfinished = copy_ckpt(single[0], tmp_path / "unfinished")
    (unfinished / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match="did not finish"):
        DCPReader(unfinished)


def test_unflattened_objects_load_whole(tmp_path):
    """Like torch <= 2.3 flattening: a whole dict of non-tensors is one bytes entry."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    sd = {"w": torch.arange(6.0).view(2, 3), "extra": {"pos": 7, "hist": [1, 2], "s": "x"}}
    dcp.save(sd, checkpoint_id=tmp_path / "c", planner=DefaultSavePlanner(flatten_state_dict=False))
    reader = DCPReader(tmp_path / "c")
    assert set(reader.index().objects) == {"extra"}
    assert reader.index().objects["extra"].path == ("extra",)
    assert reader.load_object("extra") == sd["extra"]
    oracle = torch_oracle(tmp_path / "c", tmp_path / "o.pt")
    assert oracle["extra"] == sd["extra"]
    check_against_oracle(reader, oracle, seed=7)


def _only_our_errors(action) -> bool:
    """Run ``action``; True if it succeeded, False if it raised one of ckptconv's errors."""
    from formats.errors import CkptConvError

    try:
        action()
        return True
    except CkptConvError:
        return False


_FUZZ_METADATA = r"""
import pathlib, random, resource, sys
# a damaged memo index can make CPython's C unpickler reserve a huge memo table: cap memory so
# that this shows up as MemoryError (-> CorruptCheckpointError), never as the OOM killer
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from formats.dcp import DCPReader
from formats.errors import CkptConvError
ckpt, seed, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
md = ckpt / ".metadata"
raw = md.read_bytes()
rng = random.Random(seed)
for _ in range(rounds):
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    md.write_bytes(bytes(data))
    try:
        DCPReader(ckpt)
    except CkptConvError:
        pass
print("fuzz done")
"""


def test_fuzzed_metadata_raises_only_our_errors(single, tmp_path):
    import subprocess
    import sys

    ckpt = copy_ckpt(single[0], tmp_path / "f")
    proc = subprocess.run([sys.executable, "-c", _FUZZ_METADATA, str(ckpt), "11", "400"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "fuzz done" in proc.stdout, proc.stderr[-3000:]


def test_fuzzed_chunk_archive_raises_only_our_errors(single, tmp_path):
    ckpt = copy_ckpt(single[0], tmp_path / "f")
    entry = DCPReader(ckpt).index().tensors["model.wbf16"]
    chunk = entry.chunks[0]
    loc = chunk.locator
    path = ckpt / loc.relative_path
    pristine = path.read_bytes()
    rng = random.Random(12)
    ok = 0
    for _ in range(300):
        data = bytearray(pristine)
        data[loc.offset + rng.randrange(loc.length)] = rng.randrange(256)
        path.write_bytes(bytes(data))
        with DCPReader(ckpt) as reader:
            ok += _only_our_errors(lambda: reader.read_region(entry.key, chunk, chunk.box))
    assert 0 < ok < 300  # flips in padding and data read fine; header damage is refused


def test_dtype_of_a_newer_torch_is_named_not_called_unsafe(tmp_path):
    """A ``.metadata`` naming a torch dtype this table lacks (a newer torch's) parses as data;
    opening it then fails with one line naming the key and the dtype (not "unsafe pickle");
    a non-dtype torch global is still refused as unsafe."""
    from cli_runner import run_cli

    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(4.0), "i": torch.arange(3)}, checkpoint_id=str(ckpt), no_dist=True)
    raw = (ckpt / ".metadata").read_bytes()
    assert raw.count(b"\x8c\x07float32") == 1  # memoized: one string for every float32 reference
    (ckpt / ".metadata").write_bytes(raw.replace(b"\x8c\x07float32", b"\x8c\x07float9x"))
    with pytest.raises(UnsupportedError, match="key 'w' has dtype 'float9x'.*upgrade ckptconv"):
        DCPReader(ckpt).index()
    code, _, err = run_cli("to-universal", str(ckpt), str(tmp_path / "uni"))
    assert code == 2 and "'w'" in err and "float9x" in err and "upgrade ckptconv" in err, err
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1
    (ckpt / ".metadata").write_bytes(raw.replace(b"\x8c\x07float32", b"\x8c\x07system_"))
    with pytest.raises(UnsafePickleError):
        DCPReader(ckpt).index()
