"""Layout detection on real checkpoints saved by a spawned gloo world of 4 ranks.

One spawn writes four checkpoints (FSDP2 over 4 ranks, 2-D dp2 x tp2 with column- and row-wise
TP, PP2 x FSDP2, HSDP 2 x 2); the indexes come from ckptconv's DCP reader when present, else from
torch's own ``.metadata`` (``FileSystemReader.read_metadata``). The expected boxes are torch's.
"""

from __future__ import annotations

import fractions
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from formats.base import Box, CheckpointIndex, ChunkRef, ObjectEntry, TensorEntry
from worlds import run_world

KINDS = ("fsdp4", "tp2dp2", "pp2fsdp2", "hsdp2x2")
VOCAB, DIM, HIDDEN = 50, 16, 36


class Tiny(nn.Module):
    """Embedding (vocab 50), LayerNorm, a column-wise and a row-wise Linear, a (2,)-shaped scale."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The loss; a PP stage (some modules deleted) runs the part it holds."""
        h = self.norm(self.tok(x)) if hasattr(self, "tok") else x
        if not hasattr(self, "w1"):
            return h.sum()
        return self.w2(torch.relu(self.w1(h))).sum() * self.scale.sum()


def _loss(m: Tiny, kind: str, stage: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind == "pp2fsdp2" and stage == 1:
        return m(torch.randn(2, 5, DIM, generator=g))
    return m(torch.randint(0, VOCAB, (2, 5), generator=g))


def _parallelize(m: Tiny, kind: str, rank: int) -> tuple[Tiny, int]:
    stage = 0
    if kind == "fsdp4":
        mesh = init_device_mesh("cpu", (4,))
        mods = [m.tok, m.norm, m.w1, m.w2]
    elif kind == "hsdp2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        mods = [m.tok, m.norm, m.w1, m.w2]
    elif kind == "tp2dp2":
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(m, mesh2["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        mesh = mesh2["dp"]
        mods = [m.tok, m.norm, m.w1, m.w2]
    else:  # pp2fsdp2: stage 0 keeps tok + norm, stage 1 keeps w1 + w2 + scale
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        mesh, stage = mesh2["dp"], rank // 2
        if stage == 0:
            del m.w1, m.w2, m.scale
            mods = [m.tok, m.norm]
        else:
            del m.tok, m.norm
            mods = [m.w1, m.w2]
    for mod in mods:
        fully_shard(mod, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, stage


def _world(rank: int, world: int, root: str) -> None:
    """One rank of the 4-rank world (worlds.run_world) saving every kind."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    for kind in KINDS:
        torch.manual_seed(0)
        m, stage = _parallelize(Tiny(), kind, rank)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        _loss(m, kind, stage).backward()
        opt.step()
        msd, osd = get_state_dict(m, opt)
        extra = {"step": 3, "note": "hello", "frac": fractions.Fraction(1, 3)}
        dcp.save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=os.path.join(root, kind))
        dist.barrier()


def make_checkpoints(root: Path) -> dict[str, Path]:
    """Write the four checkpoints under ``root`` once (reused when already complete)."""
    paths = {k: root / k for k in KINDS}
    if not all((p / ".metadata").is_file() for p in paths.values()):
        root.mkdir(parents=True, exist_ok=True)
        run_world(_world, 4, (str(root),), timeout=600)  # forkserver: ranks fork from one torch import
    return paths


def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The four checkpoints, shared by every test module of the session."""
    return make_checkpoints(tmp_path_factory.getbasetemp() / "detect_ckpts")


def torch_index(path: Path) -> CheckpointIndex:
    """A CheckpointIndex built from torch's own reading of ``.metadata`` (rank from file names)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata()
    tensors, objects = {}, {}
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            info = md.storage_data[MetadataIndex(key)]
            objects[key] = ObjectEntry(key, md.planner_data[key], info.relative_path, key, info.length)
            continue
        chunks = []
        for c in meta.chunks:
            info = md.storage_data[MetadataIndex(key, c.offsets)]
            rank = int(re.match(r"__(\d+)_", info.relative_path).group(1))
            box = Box(tuple(c.offsets), tuple(c.sizes))
            chunks.append(ChunkRef(box, info.relative_path, (key, tuple(c.offsets)), rank))
        dtype = str(meta.properties.dtype).removeprefix("torch.")
        tensors[key] = TensorEntry(key, dtype, tuple(meta.size), tuple(chunks), md.planner_data[key])
    return CheckpointIndex("dcp", str(path), tensors, objects, {})


# ---------------------------------------------------------------------------------------------
# fixtures

from converter.plan.source_layout import (  # noqa: E402
    CHUNKED, FSDP, TP_COLWISE, TP_ROWWISE, WHOLE, detect_layout, tp_major_factor, tp_split_dims,
)
from formats.dcp import DCPReader  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    return checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def indexes(ckpts) -> dict[str, CheckpointIndex]:
    out = {}
    for kind, path in ckpts.items():
        reader = DCPReader(path)
        out[kind] = reader.index()
        reader.close()
    return out


@pytest.fixture(scope="module")
def layouts(indexes):
    return {kind: detect_layout(index) for kind, index in indexes.items()}


def _torch_owners(path: Path, key: str) -> list[tuple[int, tuple, tuple]]:
    """(rank, offsets, sizes) per chunk, in offset order, as torch's own metadata says."""
    entry = torch_index(path).tensors[key]
    return sorted(((c.rank, c.box.offsets, c.box.sizes) for c in entry.chunks), key=lambda x: (x[1], x[2]))


def _owners(layouts, kind: str, key: str) -> list[tuple[int, tuple, tuple]]:
    return [(r, b.offsets, b.sizes) for r, b in layouts[kind].tensors[key].owners]


# ---------------------------------------------------------------------------------------------
# the four real layouts


def test_owners_match_torch_metadata(ckpts, layouts):
    for kind, path in ckpts.items():
        for key in torch_index(path).tensors:
            assert _owners(layouts, kind, key) == _torch_owners(path, key), (kind, key)


def test_fsdp4(layouts):
    rep = layouts["fsdp4"]
    assert rep.summary == "FSDP: dim 0 over 4 ranks"
    assert rep.world_size == 4 and dict(rep.mesh) == {"dp": 4} and rep.stages == ((0, 1, 2, 3),)
    tok = rep.tensors["model.tok.weight"]
    assert tok.kind == FSDP and dict(tok.split_dims) == {0: 4} and tok.tp_dim is None
    sizes = [len(c) for c in torch.arange(VOCAB).chunk(4)]  # torch.chunk: 13, 13, 13, 11
    assert [(r, b.sizes[0]) for r, b in tok.owners] == list(enumerate(sizes))
    step = rep.tensors["optim.state.tok.weight.step"]
    assert step.kind == WHOLE and dict(step.split_dims) == {}
    assert set(tp_split_dims_of(rep).values()) == {None}


def tp_split_dims_of(rep) -> dict[str, int | None]:
    return {k: t.tp_dim for k, t in rep.tensors.items()}


def test_fsdp4_empty_shard_is_deduplicated(layouts):
    # scale has 2 elements on 4 ranks: shards 1, 1, 0, 0; the two empty boxes share offset (2,)
    # and DCP keeps one of them.
    scale = layouts["fsdp4"].tensors["model.scale"]
    assert [b.sizes for _, b in scale.owners] == [(1,), (1,), (0,)]
    assert scale.kind == FSDP and scale.tiles


def test_tp2dp2(indexes, layouts):
    rep = layouts["tp2dp2"]
    assert rep.summary.startswith("2-D: TP x FSDP (dp2 x tp2)")
    assert dict(rep.mesh) == {"dp": 2, "tp": 2} and rep.world_size == 4
    w1 = rep.tensors["model.w1.weight"]
    assert w1.kind == TP_COLWISE and w1.tp_dim == 0 and dict(w1.split_dims) == {0: 4}
    assert [r for r, _ in w1.owners] == [0, 2, 1, 3]  # TP-major row blocks
    w2 = rep.tensors["model.w2.weight"]
    assert w2.kind == TP_ROWWISE and w2.tp_dim == 1 and dict(w2.split_dims) == {0: 2, 1: 2}
    for key in ("model.norm.weight", "model.w2.bias", "model.tok.weight"):  # TP-replicated
        assert rep.tensors[key].kind == FSDP and rep.tensors[key].tp_dim is None
        assert dict(rep.tensors[key].split_dims) == {0: 2}
    dims = tp_split_dims(indexes["tp2dp2"])
    assert dims["model.w1.bias"] == 0 and dims["model.w2.weight"] == 1 and dims["model.w2.bias"] is None
    assert dims["optim.state.w1.weight.exp_avg"] == 0 and dims["optim.state.w2.weight.exp_avg_sq"] == 1
    assert dims["optim.state.w1.weight.step"] is None


def test_pp2fsdp2(layouts):
    rep = layouts["pp2fsdp2"]
    assert rep.stages == ((0, 1), (2, 3))
    assert dict(rep.mesh) == {"pp": 2, "dp": 2}
    assert rep.summary.startswith("PP x FSDP: 2 stages (ranks 0-1 | 2-3)")
    assert {r for r, _ in rep.tensors["model.tok.weight"].owners} == {0, 1}
    assert {r for r, _ in rep.tensors["model.w2.weight"].owners} == {2, 3}


def test_hsdp_reports_shards_and_writers(layouts):
    # dedup lets either replica write a shard: writers {0, 3} and {1, 2} mix the replicas, so no
    # PP is claimed; what the boxes tell is 2 shards written by 4 ranks.
    rep = layouts["hsdp2x2"]
    assert rep.stages == ((0, 1, 2, 3),)
    assert "dim 0 over 2 shards" in rep.summary and "4 ranks wrote files" in rep.summary
    assert "HSDP" in rep.summary
    assert dict(rep.mesh) == {"dp_replicate": 2, "dp_shard": 2}
    assert all(t.tp_dim is None for t in rep.tensors.values())


def test_single_process_checkpoint(tmp_path):
    sd = {"model": {"w": torch.randn(5, 3), "b": torch.zeros(3)}, "step": torch.tensor(7)}
    with pytest.warns(UserWarning):
        dcp.save(sd, checkpoint_id=str(tmp_path))
    rep = detect_layout(DCPReader(tmp_path).index())
    assert rep.summary == "single process: every tensor whole"
    assert all(t.kind == WHOLE for t in rep.tensors.values())
    assert rep.world_size == 1


def _moe_world(rank: int, world: int, root: str) -> None:
    """dp2 x tp2: torchtitan's MoE TP puts grouped experts' w1 [experts, dim, hidden] on Shard(2)
    (under FSDP's Shard(0), 5 experts over 2), a Linear weight on Shard(1), a norm TP-replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    full = {"experts.w1": torch.randn(5, 4, 6, generator=g), "proj": torch.randn(9, 8, generator=g),
            "norm": torch.randn(7, generator=g)}
    places = {"experts.w1": [Shard(0), Shard(2)], "proj": [Shard(0), Shard(1)], "norm": [Shard(0), Replicate()]}
    dcp.save({"model": {k: distribute_tensor(v, mesh, places[k]) for k, v in full.items()}}, checkpoint_id=root)


def test_tp_on_dim_2_is_counted_as_dim_2(tmp_path):
    """A 3-D MoE expert weight TP-split on dim 2 is TP row-wise on dim 2 (not counted as dim 1)."""
    run_world(_moe_world, 4, (str(tmp_path),), timeout=600)
    rep = detect_layout(DCPReader(tmp_path).index())
    assert rep.tensors["model.experts.w1"].tp_dim == 2 and rep.tensors["model.proj"].tp_dim == 1
    assert "(dp2 x tp2); TP dim 0: 0 tensors, TP dim 1: 1, TP dim 2: 1, TP-replicated: 1" in rep.summary


# ---------------------------------------------------------------------------------------------
# pure helpers


def test_tp_major_factor():
    assert tp_major_factor([0, 2, 1, 3]) == 2
    assert tp_major_factor([0, 3, 1, 4, 2, 5]) == 3  # dp2 x tp3
    assert tp_major_factor([0, 2, 4, 1, 3, 5]) == 2  # dp3 x tp2
    assert tp_major_factor([0, 1, 2, 3]) is None  # FSDP order
    assert tp_major_factor([1, 0, 3, 2]) is None


def test_rankless_chunks_are_storage_chunks(indexes):
    # a universal store has chunks but no ranks: no training layout is claimed
    src = indexes["fsdp4"]
    tensors = {
        k: TensorEntry(k, t.dtype, t.shape, tuple(ChunkRef(c.box, c.file, c.locator, None) for c in t.chunks), t.path)
        for k, t in src.tensors.items()
    }
    index = CheckpointIndex("universal", src.root, tensors, {}, {"source": {"layout": "FSDP: dim 0 over 4 ranks"}})
    rep = detect_layout(index)
    assert rep.summary.startswith("no rank information: universal storage chunks")
    assert rep.summary.endswith("source layout: FSDP: dim 0 over 4 ranks")
    assert rep.tensors["model.tok.weight"].kind == CHUNKED
    assert rep.world_size is None


def test_rankless_whole_tensors(indexes):
    # one file per tensor, no ranks (a Hugging Face directory): no training layout is claimed
    src = indexes["fsdp4"]
    whole = {
        k: TensorEntry(k, t.dtype, t.shape, (ChunkRef(Box((0,) * len(t.shape), t.shape), "model.safetensors", k),), t.path)
        for k, t in src.tensors.items()
    }
    rep = detect_layout(CheckpointIndex("hf", src.root, whole, {}, {}))
    assert rep.summary == "every tensor whole (no rank information in this hf checkpoint)"
    assert {t.kind for t in rep.tensors.values()} == {WHOLE}
