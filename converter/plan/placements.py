"""Pure layout: (global shape, mesh, placements) -> the box each rank owns.

The boxes are exactly what ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
(torch 2.13) returns, i.e. what ``dcp.save`` records as chunk metadata and what ``dcp.load`` reads
into each rank's local tensor:

- placements are applied left to right over the DTensor's mesh dims;
- ``Shard`` splits the current local extent like ``torch.chunk`` (uneven shards, the last ones may
  be empty); an empty shard has offset == the dim's global size and size 0;
- ``StridedShard(dim, split_factor)`` (torch's ``_StridedShard``, what FSDP2 uses on top of TP)
  first chunks the extent into ``split_factor`` pieces, chunks each piece over the mesh dim, and
  keeps piece ``coord`` of each.

A DTensor mesh dim may span several target mesh dims flattened row-major (torchtitan's
``dp_shard_cp``); ``dims`` says which. Mesh dims outside ``dims`` replicate the tensor, except ``pp``
where ``pp_stage`` selects the ranks that hold it at all. ``dims`` may name the derived dims ``efsdp``
and ``ep`` (torchtitan's sparse mesh for routed experts, :mod:`converter.mesh`).
"""

from __future__ import annotations

import itertools
import math
import re
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from converter.plan.mesh import DERIVED, Mesh, derived_coord
from formats.base import Box, Shape
from formats.errors import ConfigError, PlanError


@dataclass(frozen=True)
class Shard:
    """Split tensor dim ``dim`` over a mesh dim, ``torch.chunk`` style."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class StridedShard:
    """torch's ``_StridedShard(dim, split_factor)``: right-to-left sharding expressed left to right."""

    dim: int
    split_factor: int

    def __str__(self) -> str:
        return f"_S({self.dim},{self.split_factor})"


@dataclass(frozen=True)
class Replicate:
    """Every rank of the mesh dim holds the whole extent."""

    def __str__(self) -> str:
        return "R"


Placement = Shard | StridedShard | Replicate
Intervals = tuple[tuple[int, int], ...]  # ordered global index ranges [start, stop)

_PLACEMENT = re.compile(
    r"^\s*(?:(r|replicate)(?:\(\))?|(?:s|shard)\(\s*(-?\d+)\s*\)"
    r"|(?:_s|_?stridedshard)\(\s*(-?\d+)\s*,\s*(?:sf=|split_factor=)?(\d+)\s*\))\s*$",
    re.IGNORECASE,
)


def parse_placement(text: str) -> Placement:
    """``"R"``/``"replicate"``, ``"S(0)"``/``"shard(0)"`` or ``"_S(0,2)"`` -> a placement."""
    m = _PLACEMENT.match(text)
    if not m:
        raise ConfigError(f"placement {text!r} is not understood; write replicate, shard(N) or _S(N,SF)")
    if m.group(1):
        return Replicate()
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    return StridedShard(int(m.group(3)), int(m.group(4)))


def chunk_span(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``size`` is split ``torch.chunk`` style (empty
    trailing chunks included, as torch's ``Shard._custom_chunk``)."""
    step = -(-size // num_chunks)
    start = min(step * index, size)
    return start, min(step * (index + 1), size) - start


def _take(held: Intervals, positions: Sequence[tuple[int, int]]) -> Intervals:
    """The global ranges at local ``positions`` of the index sequence ``held``."""
    starts, acc = [], 0
    for a, b in held:
        starts.append(acc)
        acc += b - a
    out: list[tuple[int, int]] = []
    for lo, hi in positions:
        while lo < hi:
            i = bisect_right(starts, lo) - 1
            a, b = held[i]
            g = a + lo - starts[i]
            n = min(hi - lo, b - g)
            if out and out[-1][1] == g:
                out[-1] = (out[-1][0], g + n)
            else:
                out.append((g, g + n))
            lo += n
    return tuple(out)


def _positions(p: Shard | StridedShard, size: int, k: int, c: int) -> list[tuple[int, int]]:
    if isinstance(p, Shard):
        s, n = chunk_span(size, k, c)
        return [(s, s + n)] if n else []
    out = []
    for j in range(p.split_factor):
        s1, n1 = chunk_span(size, p.split_factor, j)
        s2, n2 = chunk_span(n1, k, c)
        if n2:
            out.append((s1 + s2, s1 + s2 + n2))
    return out


def _check(shape: Shape, mesh_sizes: Sequence[int], placements: Sequence[Placement], coord: Sequence[int]):
    if not len(mesh_sizes) == len(placements) == len(coord):
        raise PlanError(
            f"placements {_fmt(placements)} do not match mesh sizes {tuple(mesh_sizes)} / coordinate {tuple(coord)}; give one per mesh dim"
        )
    for p in placements:
        if not isinstance(p, Replicate) and not 0 <= p.dim < len(shape):
            raise PlanError(f"placement {p} does not fit a tensor of shape {tuple(shape)}; shard an existing dim")
        if isinstance(p, StridedShard) and p.split_factor < 1:
            raise PlanError(f"placement {p}: split_factor must be >= 1")


@lru_cache(maxsize=1 << 18)
def local_intervals(
    shape: Shape, mesh_sizes: tuple[int, ...], placements: tuple[Placement, ...], coord: tuple[int, ...]
) -> tuple[Intervals | None, ...]:
    """Per tensor dim, the global index ranges a coordinate holds (None: dim not sharded).

    This is the index set torch computes before reducing it to a first offset and a length.
    Arguments are tuples (the result is cached).
    """
    _check(shape, mesh_sizes, placements, coord)
    held: list[Intervals | None] = [None] * len(shape)
    for p, k, c in zip(placements, mesh_sizes, coord):
        if isinstance(p, Replicate):
            continue
        cur = held[p.dim] if held[p.dim] is not None else ((0, shape[p.dim]),)
        size = sum(b - a for a, b in cur)
        held[p.dim] = _take(cur, _positions(p, size, k, c))
    return tuple(held)


def local_box(
    shape: Shape,
    mesh_sizes: tuple[int, ...],
    placements: tuple[Placement, ...],
    coord: tuple[int, ...],
    *,
    strict: bool = True,
) -> Box:
    """The box at mesh ``coord``, as torch's ``compute_local_shape_and_global_offset`` gives it.

    ``strict`` raises PlanError when the coordinate's index set is not one contiguous range (torch
    then still reports first offset and length, a box that does not describe the data).
    """
    return _local_box(tuple(shape), tuple(mesh_sizes), tuple(placements), tuple(coord), strict)


@lru_cache(maxsize=1 << 18)
def _local_box(shape: Shape, mesh_sizes, placements, coord, strict: bool) -> Box:
    held = local_intervals(shape, mesh_sizes, placements, coord)
    offsets, sizes = [], []
    for dim, (n, iv) in enumerate(zip(shape, held)):
        if iv is None:
            start, length = 0, n
        elif not iv:
            start, length = n, 0
        else:
            if strict and len(iv) > 1:
                raise PlanError(
                    f"placements {_fmt(placements)} on mesh {tuple(mesh_sizes)} give coordinate {tuple(coord)} "
                    f"a non-contiguous part of dim {dim} (size {n}); use placements that give each rank one block"
                )
            start, length = iv[0][0], sum(b - a for a, b in iv)
        offsets.append(start)
        sizes.append(length)
    return Box(tuple(offsets), tuple(sizes))


def default_dims(mesh: Mesh) -> tuple[tuple[str, ...], ...]:
    """One DTensor mesh dim per target mesh dim, ``pp`` excluded."""
    return tuple((n,) for n in mesh.names if n != "pp")


def dtensor_coord(mesh: Mesh, rank: int, dims: Sequence[Sequence[str]]) -> tuple[int, ...]:
    """The coordinate of ``rank`` on the DTensor mesh whose dims flatten ``dims`` row-major."""
    coords = dict(zip(mesh.names, mesh.coords(rank)))
    out = []
    for group in dims:
        c = 0
        for name in group:
            here = derived_coord(mesh, coords, name) if name in DERIVED else coords.get(name, 0)
            c = c * mesh.size(name) + here
        out.append(c)
    return tuple(out)


@lru_cache(maxsize=256)
def _rank_table(mesh: Mesh, dims: tuple[tuple[str, ...], ...]) -> tuple[tuple[int, tuple[int, ...], int], ...]:
    """``(rank, DTensor coordinate, pp coordinate)`` of every rank."""
    pp_index = mesh.names.index("pp") if "pp" in mesh.names else None
    return tuple(
        (r, dtensor_coord(mesh, r, dims), 0 if pp_index is None else mesh.coords(r)[pp_index])
        for r in range(mesh.world_size)
    )


def _dims_and_sizes(mesh: Mesh, placements, dims):
    dims = default_dims(mesh) if dims is None else tuple(tuple(g) for g in dims)
    if len(dims) != len(placements):
        raise PlanError(f"{len(placements)} placements {_fmt(placements)} for {len(dims)} mesh dims {dims} of mesh {mesh}")
    for name in (n for g in dims for n in g):
        if not mesh.has(name):
            raise PlanError(f"placement dim {name!r} is not in mesh {mesh}")
    return dims, tuple(math.prod(mesh.size(n) for n in g) for g in dims)


def rank_boxes(
    shape: Shape,
    mesh: Mesh,
    placements: Sequence[Placement],
    dims: Sequence[Sequence[str]] | None = None,
    pp_stage: int | None = None,
) -> dict[int, Box]:
    """Every rank's box (only ranks with pp coordinate ``pp_stage`` when it is given).

    ``placements`` go with ``dims`` (default: one per mesh dim, ``pp`` excluded).
    """
    placements, shape = tuple(placements), tuple(shape)
    dims, sizes = _dims_and_sizes(mesh, placements, dims)
    by_coord: dict[tuple[int, ...], Box] = {}
    out = {}
    for rank, coord, pp in _rank_table(mesh, dims):
        if pp_stage is not None and pp != pp_stage:
            continue
        box = by_coord.get(coord)
        if box is None:
            box = by_coord[coord] = local_box(shape, sizes, placements, coord)
        out[rank] = box
    return out


def unique_boxes(
    shape: Shape,
    mesh: Mesh,
    placements: Sequence[Placement],
    dims: Sequence[Sequence[str]] | None = None,
    pp_stage: int | None = None,
) -> list[tuple[Box, tuple[int, ...]]]:
    """Distinct boxes with the ranks holding each, in order of their first owner.

    Replicated boxes appear once. Empty boxes (uneven shards) are kept, as ``dcp.save`` keeps them.
    """
    key_dims = None if dims is None else tuple(tuple(g) for g in dims)
    return list(_unique_boxes(tuple(shape), mesh, tuple(placements), key_dims, pp_stage))


@lru_cache(maxsize=4096)
def _unique_boxes(shape: Shape, mesh: Mesh, placements: tuple[Placement, ...],
                  dims: tuple[tuple[str, ...], ...] | None, pp_stage: int | None
                  ) -> tuple[tuple[Box, tuple[int, ...]], ...]:
    """:func:`unique_boxes`, cached: a model's tensors repeat a few shapes (every layer's, and a
    parameter's optimizer states), so a large mesh is walked once per distinct shape. A rank whose
    index set is not one block (a lone ``StridedShard``: Megatron's gated ``linear_fc1``, each half
    over tp) holds one box per block."""
    dims_, sizes = _dims_and_sizes(mesh, placements, dims)
    owners: dict[Box, list[int]] = {}
    by_coord: dict[tuple[int, ...], tuple[Box, ...]] = {}
    for rank, coord, pp in _rank_table(mesh, dims_):
        if pp_stage is not None and pp != pp_stage:
            continue
        boxes = by_coord.get(coord)
        if boxes is None:
            boxes = by_coord[coord] = _blocks(shape, local_intervals(shape, sizes, placements, coord))
        for box in boxes:
            owners.setdefault(box, []).append(rank)
    return tuple((box, tuple(ranks)) for box, ranks in owners.items())


def _blocks(shape: Shape, held: tuple[Intervals | None, ...]) -> tuple[Box, ...]:
    """The boxes of an index set (per dim: ranges, None for the whole dim, () for none): one per
    combination of ranges; one box, as torch's, when every dim holds one range."""
    axes = []
    for n, iv in zip(shape, held):
        axes.append(((0, n),) if iv is None else ((n, 0),) if not iv else tuple((a, b - a) for a, b in iv))
    if all(len(a) == 1 for a in axes):
        return (Box(tuple(a[0][0] for a in axes), tuple(a[0][1] for a in axes)),)
    return tuple(Box(tuple(o for o, _ in combo), tuple(n for _, n in combo)) for combo in itertools.product(*axes))


def compose_fsdp_tp(fsdp_dim: int | None, tp: Placement, tp_size: int) -> tuple[Placement, Placement]:
    """The (FSDP, TP) placements FSDP2 gives a TP DTensor it shards on ``fsdp_dim``.

    Colwise (TP ``Shard(0)``) -> ``(_StridedShard(0, tp), Shard(0))``; rowwise -> ``(Shard(0),
    Shard(1))``; TP-replicated -> ``(Shard(0), Replicate())``; ``fsdp_dim=None`` -> not sharded.
    """
    if fsdp_dim is None:
        return Replicate(), tp
    if isinstance(tp, (Shard, StridedShard)) and tp.dim == fsdp_dim and tp_size > 1:
        return StridedShard(fsdp_dim, tp_size), tp
    return Shard(fsdp_dim), tp


@lru_cache(maxsize=4096)
def fsdp_tp_mismatch(size: int, fsdp_size: int, tp_size: int) -> tuple[int, int] | None:
    """First ``(fsdp, tp)`` coordinate whose data differs from its checkpoint box, else None.

    When FSDP2 shards a dim TP already split, a rank holds chunk ``f`` of TP chunk ``t``; torch
    records ``(_StridedShard(sf=tp), Shard)`` whose box differs from that data for some uneven sizes
    (e.g. 7 rows on tp2 x dp3), so ``dcp.save`` writes data under the wrong box (torch 2.13).
    """
    placements = (StridedShard(0, tp_size), Shard(0))
    for t in range(tp_size):
        t_start, t_len = chunk_span(size, tp_size, t)
        for f in range(fsdp_size):
            f_start, f_len = chunk_span(t_len, fsdp_size, f)
            iv = local_intervals((size,), (fsdp_size, tp_size), placements, (f, t))[0]
            want = ((t_start + f_start, t_start + f_start + f_len),) if f_len else ()
            if iv != want:
                return f, t
    return None


def _fmt(placements: Sequence[Placement]) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"
