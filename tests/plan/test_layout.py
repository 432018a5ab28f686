"""Layout boxes against torch itself.

1. Pure: ``local_box`` equals torch's ``_compute_local_shape_and_global_offset`` for random shapes,
   meshes and placements (``_StridedShard`` included), and unique boxes tile a tensor exactly once.
2. Real: gloo worlds of 4 and 6 ranks (one spawn each; 1-D meshes of 3 run on sub-meshes of 6) build DTensors with ``distribute_tensor``
   and a tiny torchtitan-named model with real ``parallelize_module`` + ``fully_shard`` on odd sizes;
   every rank's ``compute_local_shape_and_global_offset`` and the data its ``_local_tensor`` holds
   are compared with our boxes (the parent process does the comparison).
"""

from __future__ import annotations

import itertools
import math
import os
import pickle
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from converter.plan.placements import (
    Replicate,
    Shard,
    StridedShard,
    compose_fsdp_tp,
    dtensor_coord,
    fsdp_tp_mismatch,
    local_box,
    local_intervals,
    rank_boxes,
    unique_boxes,
)
from converter.plan.mesh import parse_mesh
from converter.plan.placement_rules import FSDP_PLAN, LLAMA_PLAN, RulePlan
from formats.base import Box
from formats.errors import PlanError
from worlds import run_world

# ----------------------------------------------------------------------------- pure oracle


def _torch_placement(p):
    from torch.distributed.tensor import placement_types as T

    if isinstance(p, Shard):
        return T.Shard(p.dim)
    if isinstance(p, StridedShard):
        return T._StridedShard(p.dim, split_factor=p.split_factor)
    return T.Replicate()


def _ours(p) -> tuple:
    """Our placement from a torch one."""
    from torch.distributed.tensor import placement_types as T

    if isinstance(p, T._StridedShard):
        return StridedShard(p.dim, int(p.split_factor))
    if isinstance(p, T.Shard):
        return Shard(p.dim)
    return Replicate()


@st.composite
def _cases(draw, strided: bool = True):
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    kinds = ["R", "S", "SS"] if strided else ["R", "S"]
    placements = []
    for _ in mesh:
        kind = draw(st.sampled_from(kinds))
        dim = draw(st.integers(0, len(shape) - 1))
        if kind == "R":
            placements.append(Replicate())
        elif kind == "S":
            placements.append(Shard(dim))
        else:
            placements.append(StridedShard(dim, draw(st.integers(1, 4))))
    return shape, mesh, tuple(placements)


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_local_box_equals_torch(case):
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, mesh, placements = case
    torch_pl = [_torch_placement(p) for p in placements]
    for coord in itertools.product(*(range(n) for n in mesh)):
        sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh, list(coord), torch_pl)
        box = local_box(shape, mesh, placements, coord, strict=False)
        assert (box.sizes, box.offsets) == (tuple(sizes), tuple(offsets))


def _assert_tiles(shape, pieces):
    """Non-empty boxes are disjoint and cover ``shape`` exactly; every rank is in one piece."""
    boxes = [b for b, _ in pieces if b.numel]
    assert sum(b.numel for b in boxes) == math.prod(shape)
    for a, b in itertools.combinations(boxes, 2):
        assert a.intersect(b) is None, (a, b)
    ranks = [r for _, owners in pieces for r in owners]
    assert len(ranks) == len(set(ranks))


@settings(max_examples=200, deadline=None)
@given(_cases(strided=False), st.data())
def test_unique_boxes_tile_exactly(case, data):
    shape, sizes, placements = case
    names = ("dp_replicate", "dp_shard", "tp")[: len(sizes)]
    mesh = parse_mesh(",".join(f"{n}{s}" for n, s in zip(names, sizes)))
    pieces = unique_boxes(shape, mesh, placements)
    _assert_tiles(shape, pieces)
    assert sorted(r for _, o in pieces for r in o) == list(range(mesh.world_size))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(1, 5), st.integers(1, 5), st.integers(0, 1))
def test_fsdp_over_tp_tiles_when_consistent(n, fsdp, tp, tp_dim):
    """FSDP2 x TP boxes tile the tensor, and equal the data FSDP holds unless flagged."""
    shape = (n, 3) if tp_dim == 0 else (3, n)
    mesh = parse_mesh(f"dp{fsdp},tp{tp}")
    placements = compose_fsdp_tp(0, Shard(tp_dim), tp)
    bad = fsdp_tp_mismatch(n, fsdp, tp) if tp_dim == 0 else None
    if tp_dim == 0 and tp > 1:
        assert placements == (StridedShard(0, tp), Shard(0))
    try:
        pieces = unique_boxes(shape, mesh, placements)
    except PlanError:
        assert bad is not None  # non-contiguous only happens in the flagged uneven cases
        return
    if bad is None:
        _assert_tiles(shape, pieces)


def test_known_boxes():
    # vocab 50 on 4 FSDP ranks: 13/13/13/11; 3 rows on 4 ranks: an empty shard at offset == size
    mesh = parse_mesh("dp4")
    assert [b.sizes[0] for b in rank_boxes((50, 6), mesh, (Shard(0),)).values()] == [13, 13, 13, 11]
    assert rank_boxes((3,), mesh, (Shard(0),))[3] == Box((3,), (0,))
    # 36 rows colwise on dp2 x tp2: TP-major blocks (dcp-format.md, "Layouts seen")
    boxes = rank_boxes((36, 4), parse_mesh("dp2,tp2"), (StridedShard(0, 2), Shard(0)))
    assert [b.offsets[0] for b in boxes.values()] == [0, 18, 9, 27]
    # replicated over tp: one box per dp coordinate, owned by both tp ranks
    pieces = unique_boxes((6,), parse_mesh("dp2,tp2"), (Shard(0), Replicate()))
    assert pieces == [(Box((0,), (3,)), (0, 1)), (Box((3,), (3,)), (2, 3))]
    # 7 rows tp2 x dp3: torch's box for (dp2, tp0) is 1 row at 6, but FSDP holds nothing there
    assert fsdp_tp_mismatch(7, 3, 2) == (2, 0)
    assert fsdp_tp_mismatch(128256, 64, 8) is None


def test_pp_stage_and_flattened_dims():
    mesh = parse_mesh("pp2,dp2,cp2")
    boxes = rank_boxes((8,), mesh, (Shard(0),), dims=(("dp_shard", "cp"),), pp_stage=1)
    assert sorted(boxes) == [4, 5, 6, 7]
    assert [boxes[r].offsets[0] for r in (4, 5, 6, 7)] == [0, 2, 4, 6]
    assert dtensor_coord(mesh, 6, (("dp_shard", "cp"),)) == (2,)


def test_errors():
    with pytest.raises(PlanError, match="shape"):
        local_box((4,), (2,), (Shard(1),), (0,))
    with pytest.raises(PlanError, match="one per mesh dim"):
        local_box((4,), (2, 2), (Shard(0),), (0, 0))
    with pytest.raises(PlanError, match="non-contiguous"):
        local_box((8,), (2,), (StridedShard(0, 2),), (0,))  # rows 0-1 and 4-5
    assert local_intervals((8,), (2,), (StridedShard(0, 2),), (0,)) == (((0, 2), (4, 6)),)


# ----------------------------------------------------------------------------- real torch worlds

VOCAB, DIM, KV, HIDDEN = 50, 6, 9, 7
#: mesh text -> (plan, how the FSDP mesh is taken from the device mesh)
#: (a mesh smaller than its world runs on a sub-mesh: the world of 6 holds two 1-D worlds of 3)
WORLDS: dict[int, list[tuple[str, str]]] = {
    4: [("dp4", "fsdp"), ("dp2,tp2", "llama"), ("dp_replicate2,dp2", "fsdp"), ("dp2,cp2", "fsdp")],
    6: [("dp3", "fsdp"), ("dp2,tp3", "llama"), ("dp3,tp2", "llama")],
}
#: distribute_tensor cases per mesh rank count: (shape, placements)
DIRECT_1D = [((50, 6), (Shard(0),)), ((7,), (Shard(0),)), ((2, 9), (Shard(1),)), ((3,), (Shard(0),)), ((5, 3), (Replicate(),))]
DIRECT_2D = [
    ((9, 7), (Shard(0), Shard(0))),
    ((9, 7), (Shard(0), Shard(1))),
    ((7, 9), (Shard(1), Shard(0))),
    ((50, 6), (Replicate(), Shard(0))),
    ((12, 5), (StridedShard(0, 2), Shard(0))),
    ((12, 5), (StridedShard(0, 3), Shard(0))),
    ((9, 4), (StridedShard(0, 2), Shard(0))),
    ((10,), (StridedShard(0, 2), Replicate())),
]


def _model():
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wo = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
            self.wk, self.wv = nn.Linear(DIM, KV, bias=False), nn.Linear(DIM, KV, bias=False)

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
            self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.feed_forward = Attention(), FeedForward()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleDict({"0": Block()})
            self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    model = Model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view(p.shape))
    return model


def _apply_llama_tp(model, tp_mesh):
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=R(), output_layouts=S(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=S(1), output_layouts=R()),
        },
    )
    for block in model.layers.values():
        plan = {name: ColwiseParallel() for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")}
        plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, tp_mesh, plan)


def _fsdp_mesh(dm, names):
    if "cp" in names:
        return dm["dp_shard", "cp"]._flatten("dp_shard_cp")
    if "dp_replicate" in names:
        return dm["dp_replicate", "dp_shard"]
    return dm["dp_shard"]


def _record(case, mesh_rank, name, tensor, ours=None) -> dict:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor._local_tensor
    return {
        "case": case,
        "mesh_rank": mesh_rank,
        "name": name,
        "shape": tuple(tensor.shape),
        "placements": tuple(_ours(p) for p in tensor.placements),
        "ours": ours,
        "dtensor_mesh": tuple(tensor.device_mesh.shape),
        "coord": tuple(tensor.device_mesh.get_coordinate()),
        "torch_box": Box(tuple(offsets), tuple(sizes)),
        "local_shape": tuple(local.shape),
        "values": [int(v) for v in local.flatten().tolist()],
    }


def _device_mesh(mesh, world):
    from torch.distributed.device_mesh import init_device_mesh

    if mesh.world_size == world:
        return init_device_mesh("cpu", mesh.shape, mesh_dim_names=mesh.names)
    parent = init_device_mesh("cpu", (world // mesh.world_size, *mesh.shape), mesh_dim_names=("outer", *mesh.names))
    return parent[mesh.names] if len(mesh.names) > 1 else parent[mesh.names[0]]


def _run_mesh(text, plan, world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    mesh = parse_mesh(text)
    dm = _device_mesh(mesh, world)
    mesh_rank = mesh.rank_of(tuple(dm.get_coordinate()))
    out = []
    direct = DIRECT_1D if len(mesh.shape) == 1 else DIRECT_2D
    for i, (shape, placements) in enumerate(direct):
        full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
        dt = distribute_tensor(full, dm, [_torch_placement(p) for p in placements], src_data_rank=None)
        out.append(_record(text, mesh_rank, f"direct{i}", dt, placements))
    model = _model()
    if plan == "llama":
        _apply_llama_tp(model, dm["tp"])
    fsdp_mesh = _fsdp_mesh(dm, mesh.names)
    for block in model.layers.values():
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    for name, param in model.named_parameters():
        out.append(_record(text, mesh_rank, name, param))
    return out


def _worker(rank: int, world: int, outdir: str) -> None:
    """One rank of a world (worlds.run_world): its records of every mesh of that world size."""
    records = [r for text, plan in WORLDS[world] for r in _run_mesh(text, plan, world)]
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(records, f)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """rank records per world size (one world per size)."""
    results = {}
    for world in WORLDS:
        outdir = tmp_path_factory.mktemp(f"world{world}")
        run_world(_worker, world, (str(outdir),), timeout=240)
        results[world] = {}
        for r in range(world):
            with open(outdir / f"{r}.pkl", "rb") as f:
                results[world][r] = pickle.load(f)
    return results


def _actual_box(rec) -> Box | None:
    """The box the local tensor's data really comes from (None: not one box of the global)."""
    shape, local_shape, values = rec["shape"], rec["local_shape"], rec["values"]
    if not values:
        return Box(tuple(shape[d] if local_shape[d] == 0 else 0 for d in range(len(shape))), local_shape)
    first = torch.tensor(values[0])
    offsets = tuple(int(i) for i in torch.unravel_index(first, shape))
    box = Box(offsets, local_shape)
    if any(e > n for e, n in zip(box.ends, shape)):
        return None
    want = torch.arange(math.prod(shape)).view(shape)[box.slices()].flatten().tolist()
    return box if want == values else None


def _same_data(a: Box | None, b: Box) -> bool:
    if a is None:
        return False
    return a.sizes == b.sizes and (a.numel == 0 or a.offsets == b.offsets)


def _no_divisibility(plan: RulePlan) -> RulePlan:
    return replace(plan, rules=tuple(replace(r, tp_divisible=False) for r in plan.rules))


def _check_direct(rec, mesh) -> None:
    shape, ours = rec["shape"], rec["ours"]
    assert rec["placements"] == ours
    coord = mesh.coords(rec["mesh_rank"])
    assert local_box(shape, mesh.shape, ours, coord, strict=False) == rec["torch_box"]
    intervals = local_intervals(shape, mesh.shape, ours, coord)
    contiguous = all(iv is None or len(iv) <= 1 for iv in intervals)
    assert contiguous == (_actual_box(rec) is not None)
    if contiguous:
        assert local_box(shape, mesh.shape, ours, coord) == rec["torch_box"]
        assert _same_data(_actual_box(rec), rec["torch_box"])


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_real_worlds_match_our_boxes(worlds, world):
    """Every rank: torch's checkpoint box == ours, and the data it holds is that box, except for the
    parameters our plans refuse, which are exactly those where torch's data and box disagree."""
    refused, disagree, checked = set(), set(), 0
    for records in worlds[world].values():
        for rec in records:
            mesh, shape, key = parse_mesh(rec["case"]), rec["shape"], (rec["case"], rec["name"])
            rank = rec["mesh_rank"]
            if rec["ours"] is not None:  # distribute_tensor on the whole mesh
                _check_direct(rec, mesh)
                checked += 1
                continue
            if not _same_data(_actual_box(rec), rec["torch_box"]):
                disagree.add(key)
            plan = _no_divisibility(LLAMA_PLAN if dict(WORLDS[world])[rec["case"]] == "llama" else FSDP_PLAN)
            try:
                tp = plan.place(rec["name"], shape, mesh)
            except PlanError as e:
                assert "_StridedShard" in str(e)
                refused.add(key)
                continue
            assert tp.placements == rec["placements"], (key, tp)
            assert dtensor_coord(mesh, rank, tp.dims) == rec["coord"]
            assert tp.rank_boxes(shape, mesh)[rank] == rec["torch_box"], key
            checked += 1
    assert refused == disagree
    assert checked > 0
    if world == 6:  # dp3 x tp2 on 7 hidden rows: torch's own checkpoint boxes are wrong there
        assert ("dp3,tp2", "layers.0.feed_forward.w1.weight") in refused
