"""A parallelized model's DTensor placements read as plan rows (the subprocess side of
:mod:`converter.plan.from_code`: torch and the framework are imported only in the functions here).

Each parameter and ``state_dict`` entry becomes ``{"shape", "placements", "dims"}``: its
placements as text (``S(d)``, ``_S(d,k)``, ``R``) and the ``--mesh`` dims each DTensor mesh dim
spans, matched by the global ranks along it (:func:`mesh_dim_groups`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from converter.plan.mesh import EP_BLOCK, Mesh
from formats.errors import PlanError


def _placement_text(p: Any) -> str:
    from torch.distributed.tensor import Replicate as TReplicate, Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return f"_S({p.dim},{int(p.split_factor)})"
    if isinstance(p, TShard):
        return f"S({p.dim})"
    if isinstance(p, TReplicate):
        return "R"
    raise PlanError(f"placement {p!r} is not a parameter layout (Shard, _StridedShard or Replicate)")


def mesh_dim_groups(rank_grid: Any, mesh: Mesh) -> list[tuple[str, ...]]:
    """The ``--mesh`` dims each dim of a DTensor's device mesh spans, from the global ranks along it.

    ``rank_grid`` is the device mesh's tensor of global ranks. A DTensor dim of size n whose ranks
    step by s spans the consecutive ``--mesh`` dims whose sizes multiply to n and whose innermost
    stride is s (size-1 dims span nothing).
    """
    names, sizes = mesh.names, mesh.shape
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
    out = []
    for d in range(rank_grid.ndim):
        n = rank_grid.shape[d]
        if n == 1:
            out.append(())
            continue
        idx = [0] * rank_grid.ndim
        idx[d] = 1
        step = int(rank_grid[tuple(idx)]) - int(rank_grid[(0,) * rank_grid.ndim])
        try:
            out.append(_group(n, step, names, sizes, strides))
        except PlanError:
            hit = _derived_group(n, step, mesh, strides)
            if hit is None:
                raise
            out.append(hit)
    return out


def _derived_group(n: int, step: int, mesh: Mesh, strides: Sequence[int]) -> tuple[str, ...] | None:
    """``("ep",)`` or ``("efsdp",)`` when a model mesh dim is one of torchtitan's sparse-mesh dims
    (EP's ranks: the innermost ``ep`` of the ``dp_shard, cp, tp`` block; efsdp's: the rest)."""
    if mesh.ep <= 1:
        return None
    inner = [strides[i] for i, name in enumerate(mesh.names) if name in EP_BLOCK]
    if not inner:
        return None
    unit = min(inner)
    if (n, step) == (mesh.ep, unit):
        return ("ep",)
    if (n, step) == (mesh.size("efsdp"), unit * mesh.ep):
        return ("efsdp",)
    return None


def _group(n: int, step: int, names, sizes, strides) -> tuple[str, ...]:
    for last in range(len(names)):
        if strides[last] != step:
            continue
        prod, first = 1, last
        while first >= 0 and prod < n:
            prod *= sizes[first]
            first -= 1
        if prod == n:
            return tuple(x for x, s in zip(names[first + 1 : last + 1], sizes[first + 1 : last + 1]) if s > 1)
    raise PlanError(
        f"a model mesh dim of {n} ranks stepping by {step} matches no dims of the target mesh; "
        "the framework numbers ranks in another order than --mesh (check --mesh-order)"
    )


def _entry(t: Any, mesh: Mesh) -> dict:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return {"shape": list(t.shape), "placements": [], "dims": []}
    groups = mesh_dim_groups(t.device_mesh.mesh, mesh)
    placements, dims = [], []
    for p, g in zip(t.placements, groups):
        if not g:
            continue
        placements.append(_placement_text(p))
        dims.append(list(g))
    return {"shape": list(t.shape), "placements": placements, "dims": dims}


def read_model(parts: Sequence[Any], mesh: Mesh) -> dict[str, dict]:
    """FQN -> placements of every parameter and every ``state_dict`` entry of the model parts."""
    table: dict[str, dict] = {}
    for part in parts:
        for fqn, p in part.named_parameters():
            table[fqn] = _entry(p, mesh)
        for fqn, t in part.state_dict().items():
            if hasattr(t, "shape"):
                table.setdefault(fqn, _entry(t, mesh))
    return table


def init_fake_world(world: int) -> None:
    """A process group of ``world`` fake ranks in this (child) process: the model's parallelize
    code runs as rank 0 with no communication (torch's fake backend)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
