"""Mixture-of-experts layouts (issue 17, point 1): ``--mesh ...,epN`` and torchtitan 0.3.0's MoE
placements, built-in (``--plan moe``) and read from its own code (``--plan torchtitan:deepseek_v3/...``).

torchtitan 0.3.0 (``ParallelDims.build_mesh``) unflattens one world into a dense mesh
``(pp, dp_replicate, fsdp=dp_shard*cp, tp)`` and a sparse mesh ``(pp, dp_replicate, efsdp, ep)``
with ``efsdp = dp_shard*cp*tp / ep``: EP borrows ranks, it adds none. Routed experts
``[num_experts, ...]`` live on the sparse mesh (``apply_fsdp_to_decoder``): ``Shard(0)`` over ep and
FSDP over efsdp on dim 0 (``_StridedShard(0, ep)``) or dim 1 when ``dp_shard*cp*tp`` exceeds the
expert count. The oracle for boxes is torch's ``_compute_local_shape_and_global_offset`` at the
coordinates torchtitan's row-major unflatten gives each rank.
"""

from __future__ import annotations

import itertools

import pytest

from converter.plan.placements import Replicate, Shard, StridedShard
from converter.plan.mesh import parse_mesh
from converter.plan.placement_rules import MOE_PLAN, plan_all
from converter.plan.plans import get_plan
from formats.errors import ConfigError, PlanError, UnsupportedError

import titan_support

needs_titan = pytest.mark.framework("torchtitan")  # skips (fails under CI) without torchtitan
W1 = "layers.1.moe.routed_experts.inner_experts.w1_EFD"
W2 = "layers.1.moe.routed_experts.inner_experts.w2_EDF"


from plan_cache import private_plan_cache  # noqa: E402,F401 - autouse: this module's own plan cache


# ----------------------------------------------------------------------------- --mesh with ep


def test_mesh_ep_borrows_ranks():
    m = parse_mesh("ep2,dp4")
    assert (m.world_size, m.ep, m.size("efsdp"), m.size("ep"), str(m)) == (4, 2, 2, 2, "dp_shard4,ep2")
    m = parse_mesh("dp_replicate2,dp2,tp2,ep4")
    assert (m.world_size, m.size("efsdp"), str(m)) == (8, 1, "dp_replicate2,dp_shard2,tp2,ep4")
    assert parse_mesh("dp4,ep1") == parse_mesh("dp4") and parse_mesh("dp4").size("efsdp") == 1


@pytest.mark.parametrize("text,order,err,match", [
    ("dp3,ep2", None, ConfigError, "ep2 does not divide dp_shard\\*cp\\*tp = 3"),
    ("dp4,efsdp2", None, UnsupportedError, "efsdp is derived"),
    ("ep2", None, ConfigError, "give those too"),
    ("dp4,ep2", "ep,dp_shard", ConfigError, "leave ep and etp out"),
])
def test_mesh_ep_errors(text, order, err, match):
    with pytest.raises(err, match=match):
        parse_mesh(text, order)


def _titan_coords(mesh, rank: int) -> dict[str, int]:
    """torchtitan's coordinates of ``rank``: the world unflattened row-major into the dense mesh
    ``(pp, dp_replicate, dp_shard, cp, tp)`` and the sparse mesh ``(pp, dp_replicate, efsdp, ep)``."""
    import torch

    sizes = {n: mesh.size(n) for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "efsdp", "ep")}
    dense = torch.arange(mesh.world_size).view(*(sizes[n] for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp")))
    sparse = torch.arange(mesh.world_size).view(*(sizes[n] for n in ("pp", "dp_replicate", "efsdp", "ep")))
    out = {}
    for names, grid in ((("pp", "dp_replicate", "dp_shard", "cp", "tp"), dense), (("pp", "dp_replicate", "efsdp", "ep"), sparse)):
        where = (grid == rank).nonzero()[0].tolist()
        out |= dict(zip(names, where))
    return out


def _torch_boxes(shape, mesh, placement):
    """Every rank's box by torch's own ``_compute_local_shape_and_global_offset`` at torchtitan's
    coordinates (flattened groups row-major)."""
    from torch.distributed.tensor import placement_types as T
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    def tp(p):
        if isinstance(p, StridedShard):
            return T._StridedShard(p.dim, split_factor=p.split_factor)
        return T.Shard(p.dim) if isinstance(p, Shard) else T.Replicate()

    out = {}
    for rank in range(mesh.world_size):
        c = _titan_coords(mesh, rank)
        sizes, coord = [], []
        for group in placement.dims:
            n, k = 1, 0
            for name in group:
                n, k = n * mesh.size(name), k * mesh.size(name) + c[name]
            sizes.append(n)
            coord.append(k)
        local, offset = _compute_local_shape_and_global_offset(shape, sizes, coord, [tp(p) for p in placement.placements])
        out[rank] = (tuple(offset), tuple(local))
    return out


CASES = [  # mesh, experts, (FSDP placement, ep placement) torchtitan gives w1 (torchtitan's code, probed)
    ("dp4,ep2", 8, (StridedShard(0, 2), Shard(0))),
    ("dp4,ep4", 8, (StridedShard(0, 4), Shard(0))),
    ("dp2,tp2,ep2", 8, (StridedShard(0, 2), Shard(0))),
    ("dp2,tp2,ep4", 8, (StridedShard(0, 4), Shard(0))),
    ("dp4,ep2", 6, (StridedShard(0, 2), Shard(0))),  # 3 local experts over efsdp2: 2 + 1 (uneven, as FSDP2)
    ("dp6,ep2", 8, (StridedShard(0, 2), Shard(0))),  # 4 local experts over efsdp3: 2 + 2 + 0
    ("dp4,ep2", 2, (Shard(1), Shard(0))),  # efsdp*ep = 4 > 2 experts: FSDP on dim 1
]


@pytest.mark.parametrize("mesh_text,experts,want", CASES, ids=[f"{m}-E{e}" for m, e, _ in CASES])
def test_expert_boxes_equal_torch_at_torchtitan_coordinates(mesh_text, experts, want):
    pytest.importorskip("torch")
    mesh = parse_mesh(mesh_text)
    for fqn, shape in ((W1, (experts, 12, 8)), (W2, (experts, 8, 12))):
        p = MOE_PLAN.place(fqn, shape, mesh)
        assert p.placements == want and p.dims == (("efsdp",), ("ep",)), (fqn, str(p))
        ours = {r: (b.offsets, b.sizes) for r, b in p.rank_boxes(shape, mesh).items()}
        assert ours == _torch_boxes(shape, mesh, p)
        boxes = p.unique_boxes(shape, mesh)
        assert sum(b.numel for b, _ in boxes) == experts * 96  # the boxes tile the tensor once


def test_expert_placements_without_ep():
    """EP off: the dense mesh; TP on the hidden dim (w1/w3 Shard(1), w2 Shard(2)), FSDP on dim 0, or
    on dim 1 when the whole data-parallel mesh (dp_replicate too) exceeds the experts."""
    m = parse_mesh("dp2,tp2")
    assert MOE_PLAN.place(W1, (8, 12, 8), m).placements == (Shard(0), Shard(1))
    assert MOE_PLAN.place(W2, (8, 8, 12), m).placements == (Shard(0), Shard(2))
    assert MOE_PLAN.place(W1, (1, 12, 8), m).placements == (StridedShard(1, 2), Shard(1))
    assert MOE_PLAN.place(W2, (1, 8, 12), m).placements == (Shard(1), Shard(2))
    m = parse_mesh("dp_replicate2,dp2")
    assert MOE_PLAN.place(W1, (3, 12, 8), m).placements == (Replicate(), Shard(1))


def test_ep_refusals_are_one_line():
    with pytest.raises(PlanError, match="9 experts do not divide by ep2.*view\\(ep, -1\\)") as e:
        MOE_PLAN.place(W1, (9, 12, 8), parse_mesh("dp2,ep2"))
    assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match="fully_shard refuses uneven shards"):
        MOE_PLAN.place(W1, (2, 7, 8), parse_mesh("dp4,ep2"))


def test_dense_parts_and_buffers_of_an_ep_mesh():
    m = parse_mesh("dp2,tp2,ep2")
    place = {k: MOE_PLAN.place(k, s, m) for k, s in {
        "layers.1.moe.router.gate.weight": (8, 256), "layers.1.moe.expert_bias_E": (8,),
        "layers.1.moe.shared_experts.w1.weight": (512, 256), "layers.1.moe.shared_experts.w2.weight": (256, 512),
        "layers.1.attention.wkv_b.weight": (4096, 512), "layers.1.attention.wkv_a.weight": (576, 256),
        "layers.1.attention.kv_norm.weight": (512,)}.items()}
    assert place["layers.1.moe.router.gate.weight"].placements == (Shard(0), Replicate())
    assert place["layers.1.moe.expert_bias_E"].placements == (Replicate(), Replicate())
    assert place["layers.1.moe.shared_experts.w1.weight"].placements == (StridedShard(0, 2), Shard(0))
    assert place["layers.1.moe.shared_experts.w2.weight"].placements == (Shard(0), Shard(1))
    assert place["layers.1.attention.wkv_b.weight"].placements == (StridedShard(0, 2), Shard(0))
    assert place["layers.1.attention.wkv_a.weight"].placements == (Shard(0), Replicate())
    assert place["layers.1.attention.kv_norm.weight"].placements == (Shard(0), Replicate())


# ----------------------------------------------------------------------------- read from torchtitan's code


def _code_vs_builtin(model: str, mesh_text: str) -> int:
    mesh = parse_mesh(mesh_text)
    code = get_plan(f"torchtitan:{model}", mesh=mesh)
    params = {fqn: shape for fqn, (shape, _) in code.table.items()}
    got, warnings = plan_all(params, code, mesh)
    want, _ = plan_all(params, MOE_PLAN, mesh)
    for fqn, shape in params.items():
        if ".qkv_linear.w" in fqn and "wqkv" not in fqn:
            continue  # qwen3's save hook writes wq/wk/wv gathered whole
        assert got[fqn].rank_boxes(shape, mesh) == want[fqn].rank_boxes(shape, mesh), (fqn, str(got[fqn]), str(want[fqn]))
    return len(params)


@needs_titan
@pytest.mark.parametrize("model,mesh", [
    ("deepseek_v3/debugmodel", "dp4,ep2"),
    pytest.param("deepseek_v3/debugmodel", "dp_replicate2,dp2,tp2,ep4", marks=pytest.mark.slow),
    pytest.param("deepseek_v3/debugmodel", "dp2,tp2", marks=pytest.mark.slow),
    pytest.param("qwen3/debugmodel_moe", "dp2,tp2,ep2", marks=pytest.mark.slow),
    pytest.param("qwen3/debugmodel_moe", "dp_replicate2,dp2", marks=pytest.mark.slow),
])
def test_torchtitan_moe_plan_equals_builtin_moe(model, mesh):
    """torchtitan's own parallelize_fn (meta model, fake world) places every parameter and buffer of
    its MoE models as the built-in ``moe`` plan does."""
    assert _code_vs_builtin(model, mesh) > 50


def test_detect_reports_ep_not_tp():
    """A dp4,ep2 save (experts on torchtitan's sparse mesh, TP-major block order) is FSDP4 with ep2,
    not 'TP x FSDP dp2 x tp2' (the real save: test_titan_moe_trainer.py)."""
    from converter.plan.source_layout import EXPERTS, FSDP, detect_layout
    from formats.base import CheckpointIndex, ChunkRef, TensorEntry

    mesh = parse_mesh("dp4,ep2")

    def entry(key, shape):
        p = MOE_PLAN.place(key, shape, mesh)
        chunks = tuple(ChunkRef(box, f"__{ranks[0]}_0.distcp", None, ranks[0]) for box, ranks in p.unique_boxes(shape, mesh))
        return TensorEntry(key, "float32", shape, chunks, (key,))

    tensors = {k: entry(k, s) for k, s in ((W1, (8, 12, 8)), (W2, (8, 8, 12)), ("layers.1.attention.wo.weight", (16, 8)),
                                           ("tok_embeddings.weight", (32, 8)))}
    rep = detect_layout(CheckpointIndex("dcp", "x", tensors, {}, {"world_size": 4}))
    assert rep.tensors[W1].kind == EXPERTS and rep.tensors["tok_embeddings.weight"].kind == FSDP
    assert rep.summary == "FSDP: dim 0 over 4 ranks; grouped experts: 2 tensors split on dim 0, ep2"
    assert dict(rep.mesh) == {"dp": 4, "ep": 2}


def test_plan_file_marks_grouped_experts(tmp_path):
    import json

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"version": 1, "rules": [
        {"name": "experts", "match": r"blocks\.\d+\.experts\.w_in", "tp": "shard(1)", "experts": True}]}))
    plan = get_plan(str(path))
    assert plan.place("blocks.0.experts.w_in", (8, 12, 8), parse_mesh("dp4,ep2")).placements == (StridedShard(0, 2), Shard(0))
    assert plan.place("blocks.0.experts.w_in", (8, 12, 8), parse_mesh("dp2,tp2")).placements == (Shard(0), Shard(1))


def test_rank_coords_name_the_sparse_mesh():
    m = parse_mesh("dp2,tp2,ep4")
    assert m.rank_coords(3) == {"dp_shard": 1, "tp": 1, "efsdp": 0, "ep": 3}
    assert parse_mesh("dp2").rank_coords(1) == {"dp_shard": 1}


def test_source_plan_places_grouped_experts_as_routed_experts():
    """--plan source: a grouped-experts tensor goes on the sparse mesh when the target has ep, and
    keeps the source's TP dim (e.g. Shard(2) of w2) without ep."""
    plan = get_plan("source", source_splits={W2: 2, "layers.1.moe.shared_experts.w1.weight": 0})
    assert plan.place(W2, (8, 8, 12), parse_mesh("dp4,ep2")).placements == (StridedShard(0, 2), Shard(0))
    assert plan.place(W2, (8, 8, 12), parse_mesh("dp2,tp2")).placements == (Shard(0), Shard(2))
    shared = plan.place("layers.1.moe.shared_experts.w1.weight", (16, 8), parse_mesh("dp2,tp2,ep2"))
    assert shared.placements == (StridedShard(0, 2), Shard(0))
