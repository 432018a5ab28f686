"""Detect the parallel layout a checkpoint was saved with, from its index alone (no tensor data).

What the metadata tells: every chunk's box in global coordinates and, for DCP, the rank whose file
holds it (``ChunkRef.rank``). What it does not tell: the mesh. DCP deduplicates replicated data
(a replicated chunk is written once, by whichever rank was least loaded), so the layout is a best
guess from these facts (see ``/work/shared/notes/dcp-format.md``, "Layouts seen"):

- FSDP2 ``Shard(0)``: one tensor split along dim 0 in ``torch.chunk`` sizes (the last shards may be
  smaller or empty), rank ``r`` holding the ``r``-th block: rank order == offset order.
- 2-D (mesh ``("dp", "tp")``), column-wise TP: placements ``(_StridedShard(0, sf=tp), Shard(0))``
  give ``dp * tp`` contiguous row blocks in TP-major order: the block at position ``t * dp + d``
  belongs to rank ``d * tp + t``. So rank order != offset order, which tells TP apart from FSDP.
- 2-D row-wise TP: ``(Shard(0), Shard(1))``: a ``dp x tp`` grid of boxes, split on dim 1.
- TP-replicated parameters (norms, row-wise biases): only the ``dp`` blocks survive dedup, written by
  arbitrary ranks of the replica group.
- PP: different tensors are sharded over disjoint rank sets (one per stage).

- HSDP (replicate x shard): the boxes of FSDP over the shard group, each written by one replica's
  rank at the shard's dp_shard position; told from PP by what the rank groups hold (PP stages:
  disjoint modules; replicas: the same modules, see :func:`find_stages`).

- Expert parallelism (torchtitan's sparse mesh ``(efsdp, ep)``): a grouped-experts tensor
  (``[num_experts, ...]``, a key naming ``experts``) split on dim 0 alone in TP-major block order
  is EP x efsdp, not column-wise TP (torchtitan never TP-splits experts on dim 0); such tensors are
  left out of the dense mesh guess and reported as ``experts`` with their ep degree.

Ambiguities, stated rather than guessed: pure TP column-wise
with no FSDP has rank order == offset order, exactly like FSDP, and is only recognized as TP when
another tensor of the same stage is split on dim 1; without rank information (universal store, HF)
chunks are storage chunks, not a training layout.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from formats.base import Box, CheckpointIndex, ChunkRef, TensorEntry

#: Per-tensor kinds.
WHOLE = "whole"  # one chunk holding the whole tensor (replicated, single process, 0-d)
FSDP = "fsdp"  # split on dim 0 only, rank order == offset order (or TP-replicated in a 2-D run)
TP_COLWISE = "tp_colwise"  # split on dim 0 by TP (TP-major block order), possibly x FSDP
TP_ROWWISE = "tp_rowwise"  # split on one dim >= 1 by TP (dim 1: row-wise Linear), and dim 0 by FSDP
EXPERTS = "experts"  # grouped experts split on dim 0 by EP (x efsdp): torchtitan's sparse mesh
CHUNKED = "chunked"  # storage chunks without rank information (universal store, HF)
IRREGULAR = "irregular"  # boxes that match none of the above (or do not tile the tensor)
ZERO_FLAT = "zero_flat"  # DeepSpeed ZeRO: ranges of flat partitions (index.info["partitioning"])


@dataclass(frozen=True)
class TensorLayout:
    """How one tensor is split.

    ``split_dims`` maps each split dim to its number of distinct intervals (parts); ``owners`` lists
    ``(rank, box)`` per chunk in offset order (rank None where the format does not know it);
    ``tp_dim`` is the dim TP split, when detected.
    """

    key: str
    split_dims: Mapping[int, int]
    kind: str
    owners: tuple[tuple[int | None, Box], ...] = ()
    tp_dim: int | None = None
    tiles: bool = True  # boxes cover the tensor exactly once
    layers: int = 0  # Megatron layer-stacked tensor: dim 0 holds this many layers (not a split)
    tp: int = 1  # the TP degree on ``tp_dim`` (TP kinds)
    form: str = ""  # TP_COLWISE: "strided" (FSDP2 over TP: _StridedShard x Shard), "halves" (Megatron's GLU fc1)


@dataclass(frozen=True)
class LayoutReport:
    """The whole checkpoint's detected layout."""

    summary: str
    world_size: int | None
    tensors: Mapping[str, TensorLayout]
    mesh: Mapping[str, int] = field(default_factory=dict)  # best guess, e.g. {"pp": 2, "dp": 2}
    stages: tuple[tuple[int, ...], ...] = ()  # rank sets of PP stages (one when no PP)
    notes: tuple[str, ...] = ()  # ambiguities and oddities, one line each


# ---------------------------------------------------------------------------------------------
# per-tensor facts


_BOX_KEY = operator.attrgetter("box.offsets", "box.sizes")
_BOX, _RANK = operator.attrgetter("box"), operator.attrgetter("rank")
_CHUNK_OFFSETS, _CHUNK_SIZES = operator.attrgetter("box.offsets"), operator.attrgetter("box.sizes")

#: What :func:`_facts` depends on: (shape, every chunk's offsets, every chunk's sizes).
FactsKey = tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


def _order(chunks: Sequence[ChunkRef]) -> list[ChunkRef]:
    return sorted(chunks, key=_BOX_KEY)


def split_dims(entry: TensorEntry) -> dict[int, int]:
    """Dims with more than one distinct ``(offset, size)`` interval among the chunks -> count."""
    return _facts(entry)[0]


def tiles(entry: TensorEntry) -> bool:
    """True when the chunks cover the tensor exactly once.

    Exact for product grids (every layout torch writes, and zarr chunk grids); for other box sets
    it checks bounds and that the element counts add up (overlap plus an equal gap would pass).
    """
    return _facts(entry)[1]


def _facts(entry: TensorEntry) -> tuple[dict[int, int], bool]:
    """(:func:`split_dims`, :func:`tiles`) of one tensor in one pass over its chunks, with the
    per-chunk work done by C-level iteration (columns of offsets and sizes per dim)."""
    shape = tuple(entry.shape)
    ndim = len(shape)
    boxes = [c.box for c in entry.chunks]
    offs = list(zip(*(b.offsets for b in boxes))) if ndim else []
    sizes = list(zip(*(b.sizes for b in boxes))) if ndim else []
    dims = {}
    for d in range(min(ndim, len(offs))):
        parts = len(set(zip(offs[d], sizes[d])))
        if parts > 1:
            dims[d] = parts
    return dims, _tiles(entry, shape, boxes)


def _facts_cached(entry: TensorEntry, cache: dict[FactsKey, tuple[dict[int, int], bool, list[int] | None]]
                  ) -> tuple[tuple[dict[int, int], bool], Sequence[ChunkRef]]:
    """(:func:`_facts`, the chunks in :func:`_order`), computed once per distinct (shape, boxes):
    a model repeats a few layouts over thousands of tensors (every layer's, and a parameter's
    optimizer states), and the order of the chunks depends on their boxes alone. The key is built
    by C-level iteration; the dims dict is a copy (callers may keep it)."""
    chunks = entry.chunks
    offsets, sizes = tuple(map(_CHUNK_OFFSETS, chunks)), tuple(map(_CHUNK_SIZES, chunks))
    key = (tuple(entry.shape), offsets, sizes)
    found = cache.get(key)
    if found is None:
        boxes = list(zip(offsets, sizes))
        perm = sorted(range(len(boxes)), key=boxes.__getitem__)  # stable, as sorting the chunks
        found = cache[key] = (*_facts(entry), None if perm == list(range(len(boxes))) else perm)
    dims, tiled, perm = found
    return (dict(dims), tiled), (chunks if perm is None else list(map(chunks.__getitem__, perm)))


def _tiles(entry: TensorEntry, shape: tuple[int, ...], boxes: list[Box]) -> bool:
    live = [b for b in boxes if 0 not in b.sizes]  # non-empty (a 0-d box has sizes ())
    ndim = len(shape)
    if any(len(b.offsets) != ndim or len(b.sizes) != ndim for b in live):
        return False
    if ndim and live:
        offs = list(zip(*(b.offsets for b in live)))
        sizes = list(zip(*(b.sizes for b in live)))
        for d in range(ndim):
            if min(offs[d]) < 0 or max(map(operator.add, offs[d], sizes[d])) > shape[d]:
                return False
    if sum(map(math.prod, (b.sizes for b in live))) != entry.numel:
        return False
    if entry.numel == 0:  # an empty tensor (a dim of size 0) has nothing to cover
        return True
    axes = [sorted(set(zip(offs[d], sizes[d]))) for d in range(ndim)] if ndim else []
    grid = 1
    for ivs in axes:
        grid *= len(ivs)
    if grid == len(live) and len({(b.offsets, b.sizes) for b in live}) == len(live):
        return all(_contiguous(ivs, size) for ivs, size in zip(axes, shape))
    return True


def _contiguous(intervals: list[tuple[int, int]], size: int) -> bool:
    pos = 0
    for off, n in intervals:
        if off != pos:
            return False
        pos += n
    return pos == size


def tp_major_factor(ranks: Sequence[int]) -> int | None:
    """``tp`` when ``ranks`` (block owners in offset order, stage-local) are in TP-major order.

    Position ``t * dp + d`` holds rank ``d * tp + t`` (``(_StridedShard(0, sf=tp), Shard(0))``).
    Returns None for the identity order (FSDP, or pure TP: indistinguishable) and for anything else.
    """
    k = len(ranks)
    if tuple(ranks) == tuple(range(k)):  # FSDP (or pure TP): the identity order
        return None
    return _tp_major_factor(tuple(ranks))


@lru_cache(maxsize=1024)
def _tp_major_factor(ranks: tuple[int, ...]) -> int | None:
    k = len(ranks)
    for tp in range(2, k):
        if k % tp:
            continue
        dp = k // tp
        if list(ranks) == [d * tp + t for t in range(tp) for d in range(dp)]:
            return tp
    return None


# ---------------------------------------------------------------------------------------------
# stages (PP) and their meshes


def _sharded(index: CheckpointIndex) -> list[TensorEntry]:
    return [
        t for t in index.tensors.values()
        if len(t.chunks) > 1 and None not in map(_RANK, t.chunks)
    ]


def rank_groups(index: CheckpointIndex) -> tuple[tuple[int, ...], ...]:
    """Connected components of the sharded tensors' rank sets (ranks that shard tensors together).

    Tensors with a single chunk say nothing (replicated data is written by one arbitrary rank).
    """
    parent: dict[int, int] = {}

    def root(r: int) -> int:
        while parent.setdefault(r, r) != r:
            r = parent[r]
        return r

    seen: set[tuple[int, ...]] = set()
    for t in _sharded(index):
        ranks = tuple(map(_RANK, t.chunks))
        if ranks in seen:  # tensors of one shape share their writers: union each set once
            continue
        seen.add(ranks)
        for r in ranks[1:]:
            parent[root(r)] = root(ranks[0])
    groups: dict[int, set[int]] = {}
    for r in list(parent):
        groups.setdefault(root(r), set()).add(r)
    return tuple(sorted(tuple(sorted(g)) for g in groups.values()))


def find_stages(index: CheckpointIndex) -> tuple[tuple[int, ...], ...]:
    """Pipeline stages: rank groups that are equal, contiguous blocks (``pp`` is the outer dim)
    and hold disjoint modules.

    Several groups that are not such blocks come from dedup, not PP: under HSDP a shard is written
    by whichever replica was least loaded, so tensors land on mixed rank sets ({0, 3} and {1, 2}
    for 2 x 2); they are merged into one stage. Dedup often picks whole replicas ({0, 1} for one
    tensor, {2, 3} for the next: equal shards keep a replica's ranks equally loaded), which gives
    contiguous blocks too; what tells them apart is what the groups hold: PP stages hold disjoint
    modules (``layers.3`` and all its optimizer state on one stage), HSDP replicas hold the same
    modules (``layers.0.attention.wq`` on one replica, ``layers.0.attention.wk`` on the other).
    """
    groups = rank_groups(index)
    if len(groups) < 2:
        return groups
    stages = merge_replica_groups(index, groups)  # PP x HSDP: each stage's replicas are one stage
    n = len(stages[0])
    blocks = all(g == tuple(range(g[0], g[0] + n)) and g[0] % n == 0 for g in stages)
    if len(stages) > 1 and blocks:
        return stages
    return (tuple(sorted(r for g in groups for r in g)),)


def module_of(atom: str) -> str:
    """The module a parameter belongs to at PP granularity: up to its first numeric component
    (``layers.3.attention.wq.weight`` -> ``layers.3``), else its first component (``tok_embeddings``)."""
    parts = atom.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def merge_replica_groups(index: CheckpointIndex, groups: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """``groups`` with every two that hold tensors of one module (parameters with their optimizer
    states, see :func:`module_of`) merged: such groups are replicas of one another, not PP stages."""
    from converter.plan.atoms import group_atoms

    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    refs = group_atoms(paths)[0]
    group_of = {r: i for i, g in enumerate(groups) for r in g}
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for t in _sharded(index):
        g = group_of.get(t.chunks[0].rank)
        if g is None:
            continue
        other = first.setdefault(module_of(refs[t.key].atom), g)
        parent[root(g)] = root(other)
    merged: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        merged.setdefault(root(i), []).extend(g)
    return tuple(sorted(tuple(sorted(rs)) for rs in merged.values()))


@dataclass(frozen=True)
class _Mesh:
    """What one stage looks like: ranks, detected tp and dp (None when unknown)."""

    ranks: tuple[int, ...]
    tp: int
    dp: int  # ranks per TP group (FSDP shards x HSDP replicas) when tp > 1, else ``shards``
    shards: int  # largest number of dim-0 parts among the stage's tensors
    fsdp: int = 0  # FSDP shards of an HSDP x TP stage (0: not HSDP x TP)
    hsdp: bool = False  # no TP; every shard written by a rank of its dp_shard position (HSDP's signature)

    @property
    def replicas(self) -> int:
        """HSDP replicas under TP: ranks per TP group that are not FSDP shards (1 when unknown)."""
        if self.tp > 1 and self.fsdp and self.dp % self.fsdp == 0:
            return self.dp // self.fsdp
        return 1


def _stage_mesh(ranks: tuple[int, ...], entries: list[TensorEntry],
                facts: Mapping[str, tuple[dict[int, int], bool]] | None = None,
                ordered: Mapping[str, Sequence[ChunkRef]] | None = None) -> _Mesh:
    """tp from a dim-1 split (row-wise grid) or a TP-major block order (column-wise); dp = rest.
    ``facts`` and ``ordered``: per key, its :func:`_facts` and :func:`_order` when computed."""
    local = {r: i for i, r in enumerate(ranks)}
    tp, shards, fsdp = 1, 1, 0
    only0: set[int] = set()  # dim-0 part counts of tensors split on dim 0 alone
    for t in entries:
        dims = facts[t.key][0] if facts is not None and t.key in facts else split_dims(t)
        if is_grouped_experts(t, dims):
            continue  # the sparse (EP) mesh, not the dense one
        shards = max(shards, dims.get(0, 1))
        if set(dims) == {0}:
            only0.add(dims[0])
        if (d := _tp_inner_dim(dims)) is not None:
            tp = max(tp, dims[d])
            fsdp = max(fsdp, dims.get(0, 1))
        elif set(dims) == {0} and len(t.chunks) == len(ranks):
            in_order = ordered[t.key] if ordered is not None and t.key in ordered else _order(t.chunks)
            seq = list(map(local.__getitem__, map(_RANK, in_order)))
            tp = max(tp, tp_major_factor(seq) or 1)
    dp = max(1, len(ranks) // tp) if tp > 1 else shards
    replicas = tp == 1 and 1 < shards < len(ranks) and len(ranks) % shards == 0 and _shard_positions_match(ranks, entries, shards)
    if replicas:
        return _Mesh(ranks, tp, dp, shards, 0, True)
    # HSDP x TP: fewer FSDP shards than ranks per TP group, and every dim-0-only tensor is either
    # FSDP-sharded (fsdp parts) or column-wise TP x FSDP (fsdp * tp parts)
    hsdp = tp > 1 and 0 < fsdp < dp and dp % fsdp == 0 and only0 <= {fsdp, fsdp * tp}
    return _Mesh(ranks, tp, dp, shards, fsdp if hsdp else 0)


def _shard_positions_match(ranks: tuple[int, ...], entries: list[TensorEntry], shards: int) -> bool:
    """HSDP (dp_replicate outer, dp_shard inner): the i-th dim-0 shard of every tensor split in
    ``shards`` parts was written by a rank at dp_shard position i (stage-local rank % shards == i),
    whichever replica dedup picked; every tensor sharded is split on dim 0 alone."""
    local = {r: i for i, r in enumerate(ranks)}
    for t in entries:
        dims = split_dims(t)
        if is_grouped_experts(t, dims):
            continue
        if set(dims) != {0}:
            return False
        if dims[0] != shards:
            continue
        live = [c for c in _order(t.chunks)]
        if any(local[c.rank] % shards != i for i, c in enumerate(live)):
            return False
    return True


def is_grouped_experts(entry: TensorEntry, dims: Mapping[int, int]) -> bool:
    """A grouped-experts tensor ``[num_experts, ...]`` (3-D or more, a key naming ``experts``) split
    on dim 0 alone: EP's layout, kept out of the dense mesh guess."""
    return len(entry.shape) >= 3 and "experts" in entry.key and set(dims) == {0}


def expert_parallel_degree(entry: TensorEntry) -> int:
    """ep of a grouped-experts tensor from its block order (``(_StridedShard(0, ep), Shard(0))`` over
    ``(efsdp, ep)`` is TP-major with factor ep); the number of parts when the order is the identity
    (efsdp 1, or EP off and FSDP on dim 0: the same boxes)."""
    live = [c for c in _order(entry.chunks) if c.box.numel]
    ranks = sorted({c.rank for c in live})
    local = {r: i for i, r in enumerate(ranks)}
    seq = [local[c.rank] for c in live]
    return tp_major_factor(seq) or len(live)
def _fused_halves(entry: TensorEntry) -> bool:
    """Megatron's fused GLU ``linear_fc1`` under TP: ``[gate; up]`` each split over the TP ranks, so
    each rank holds two row blocks; in offset order the owners run through the TP ranks twice."""
    ranks = [c.rank for c in _order(entry.chunks)]
    half = len(ranks) // 2
    return len(ranks) % 2 == 0 and ranks[:half] == ranks[half:] and len(set(ranks[:half])) == half


def _tp_inner_dim(dims: Mapping[int, int]) -> int | None:
    """The one dim >= 1 a tensor is split on (TP ``Shard(d)``, possibly x FSDP on dim 0), or None."""
    inner = [d for d in dims if d != 0]
    return inner[0] if len(inner) == 1 else None


def _classify(entry: TensorEntry, mesh: _Mesh | None,
              facts: tuple[dict[int, int], bool] | None = None) -> tuple[str, int | None, str]:
    """(kind, tp_dim, form) of one tensor given its stage's mesh (None: no rank information);
    ``facts``: its :func:`_facts` when already computed; ``form``: see :attr:`TensorLayout.form`."""
    if len(entry.chunks) == 1 and entry.chunks[0].box.sizes == entry.shape:
        return WHOLE, None, ""
    if mesh is None:
        return CHUNKED, None, ""
    dims, tiled = facts or _facts(entry)
    if not tiled:
        return IRREGULAR, None, ""
    if is_grouped_experts(entry, dims) and None not in {c.rank for c in entry.chunks}:
        return EXPERTS, None, ""
    if set(dims) == {0}:
        n = dims[0]
        if mesh.tp > 1 and n in (mesh.dp * mesh.tp, mesh.fsdp * mesh.tp):  # the latter: HSDP x TP
            return TP_COLWISE, 0, "strided" if n > mesh.tp else ""
        if mesh.tp > 1 and n == 2 * mesh.tp and _fused_halves(entry):
            return TP_COLWISE, 0, "halves"
        return FSDP, None, ""
    d = _tp_inner_dim(dims)
    if d is not None and mesh.tp > 1 and dims[d] == mesh.tp:
        return TP_ROWWISE, d, ""
    return IRREGULAR, None, ""


# ---------------------------------------------------------------------------------------------
# the report


def placement_label(lay: TensorLayout) -> str:
    """How ``lay`` is placed, in words and split dims: ``fsdp d0/4``, ``tp_colwise d0/2``,
    ``tp_colwise x fsdp d0/4 (tp2 x dp2, strided)`` (FSDP2 over column-wise TP:
    ``(_StridedShard(0, tp), Shard(0))``), ``tp_rowwise d1/2 x fsdp d0/2``, Megatron's
    ``layers=L`` axis and fused GLU halves."""
    split = " ".join(f"d{d}/{n}" for d, n in sorted(lay.split_dims.items()))
    layers = f"layers={lay.layers} " if lay.layers else ""
    d, tp = lay.tp_dim, lay.tp
    if lay.kind == TP_COLWISE and d is not None:
        n = lay.split_dims.get(d, tp)
        if lay.form == "strided":
            return f"{layers}tp_colwise x fsdp d{d}/{n} (tp{tp} x dp{n // tp}, strided)"
        if lay.form == "halves":
            return f"{layers}tp_colwise d{d}/{n} (2 fused halves, each over tp{tp})"
        return f"{layers}tp_colwise d{d}/{n}"
    if lay.kind == TP_ROWWISE and d is not None:
        rest = " ".join(f"d{e}/{n}" for e, n in sorted(lay.split_dims.items()) if e != d)
        return f"{layers}tp_rowwise d{d}/{tp}" + (f" x fsdp {rest}" if rest else "")
    return f"{lay.kind} {layers}{split}".strip()


def world_size(index: CheckpointIndex) -> int | None:
    """``index.info["world_size"]`` when the format records it, else 1 + the largest chunk rank."""
    ws = index.info.get("world_size")
    if isinstance(ws, int) and ws > 0:
        return ws
    ranks = [c.rank for t in index.tensors.values() for c in t.chunks if c.rank is not None]
    return max(ranks) + 1 if ranks else None


def detect_layout(index: CheckpointIndex, owners: bool = True) -> LayoutReport:
    """The detected layout of ``index``: a one-line summary, a mesh guess and per-tensor layouts.

    Pure: reads metadata only. See the module docstring for the rules and their limits.
    ``owners=False`` leaves every :attr:`TensorLayout.owners` empty (a tuple per chunk, millions at
    scale, that kinds and splits, what :func:`source_hints` needs, do not use).
    """
    from converter.plan.megatron import stacked_layers

    if index.info.get("partitioning") == ZERO_FLAT:
        return _zero_layout(index, owners)
    stacked = stacked_layers(index)
    layer_stages = megatron_stages(index, stacked)
    if stacked:  # Megatron: dim 0 of a layer-stacked tensor is its layers; one layer shows the split
        index = replace(index, tensors={k: layer_view(t) if k in stacked else t for k, t in index.tensors.items()})
    stages = find_stages(index)
    stage_of = {r: s for s in stages for r in s}
    by_stage: dict[tuple[int, ...], list[TensorEntry]] = {s: [] for s in stages}
    for t in _sharded(index):
        by_stage[stage_of[t.chunks[0].rank]].append(t)
    cache: dict[FactsKey, tuple[dict[int, int], bool, list[int] | None]] = {}
    facts, ordered = {}, {}
    for key, t in index.tensors.items():
        facts[key], ordered[key] = _facts_cached(t, cache)
    del cache
    meshes = {s: _stage_mesh(s, by_stage[s], facts, ordered) for s in stages}
    layouts = {}
    for key, t in index.tensors.items():
        chunks = t.chunks
        mesh = meshes.get(stage_of.get(chunks[0].rank)) if chunks and None not in map(_RANK, chunks) else None
        kind, tp_dim, form = _classify(t, mesh, facts[key])
        in_order = ordered[key] if owners else ()
        dims, tiled = facts[key]
        if key in stacked:  # back to the stacked tensor's dims
            dims = {d + 1: n for d, n in dims.items()}
            tp_dim = None if tp_dim is None else tp_dim + 1
        tp = mesh.tp if tp_dim is not None else 1
        layouts[key] = TensorLayout(key, dims, kind, tuple(zip(map(_RANK, in_order), map(_BOX, in_order))), tp_dim,
                                    tiled, stacked.get(key, 0), tp, form)
    ws = world_size(index)
    summary, mesh_guess, notes = _summarize(index, ws, stages, meshes, layouts)
    notes = notes + _layout_bound_note(index)
    if len(layer_stages) > 1 and len(stages) <= 1:  # Megatron PP: the layers of one stacked tensor
        spans = " | ".join(f"layers {lo}-{hi} on ranks {_span(sorted(rs))}" for (lo, hi), rs in layer_stages)
        first = meshes.get(stages[0]) if stages else None
        inner = {k: v for k, v in mesh_guess.items() if k != "pp"} if first is not None and first.tp > 1 else {}
        mesh_guess = {"pp": len(layer_stages), **inner}
        summary = f"PP: {len(layer_stages)} stages ({spans}); " + summary
    return LayoutReport(summary, ws, layouts, mesh_guess, stages, notes)


def _zero_layout(index: CheckpointIndex, owners: bool) -> LayoutReport:
    """DeepSpeed ZeRO: each tensor cut in ranges of the ranks' flat partitions, not a DTensor
    layout (the boxes are those ranges' rows, see :mod:`formats.deepspeed_zero.flat`)."""
    ws = world_size(index)
    stage = index.info.get("zero_stage")
    layouts = {key: TensorLayout(key, {}, ZERO_FLAT if len(t.chunks) > 1 else WHOLE,
                                 tuple((c.rank, c.box) for c in t.chunks) if owners else ())
               for key, t in index.tensors.items()}
    summary = (f"ZeRO-{stage}: flat partitions over {ws} data-parallel ranks" if stage and ws and ws > 1 else
               f"ZeRO-{stage}: one data-parallel rank, every tensor whole" if stage else
               "ZeRO-0: every tensor whole")
    pp = index.info.get("pp_degree")
    if isinstance(pp, int) and pp > 1:  # a PipelineModule save read as one (formats.deepspeed_zero.pipeline)
        summary += f" per stage; {pp} pipeline stages merged"
    tp = index.info.get("tp_degree")
    if isinstance(tp, int) and tp > 1:  # a TP save read as its tp1 whole (formats.deepspeed_zero.tp)
        summary += f"; {tp} tensor-parallel ranks' slices joined (read as tp1)"
    return LayoutReport(summary, ws, layouts, {"dp": ws} if ws and ws > 1 else {}, (), ())


def _layout_bound_note(index: CheckpointIndex) -> tuple[str, ...]:
    """A note naming Megatron's layout-bound entries (loadable only on the saved pp x tp; see
    :mod:`converter.plan.megatron`), or nothing."""
    from converter.plan.megatron import layout_bound_objects, source_axes

    bound = layout_bound_objects([*index.objects, *index.tensors])
    if not bound:
        return ()
    names = sorted({b.name for b in bound})
    axes = source_axes(bound)
    saved = " x ".join(f"{a}{n}" for a, n in axes.items()) or "its saved layout"
    return (f"layout-bound Megatron entries (load only on {saved}; from-universal drops them on a TP/PP change): "
            f"{', '.join(names)} ({len(bound)} entries)",)


def megatron_stages(index: CheckpointIndex, stacked: Mapping[str, int]) -> list[tuple[tuple[int, int], frozenset[int]]]:
    """Megatron pipeline stages from its layer-stacked tensors: ((first, last layer), ranks) per
    stage, in layer order. Each layer's chunks are written by its stage's ranks (the main replica),
    so runs of layers whose writers are disjoint from the next run's are the stages; [] when the
    layers do not split into disjoint contiguous runs (one stage)."""
    if not stacked:
        return []
    writers: dict[int, set[int]] = {}
    for key in stacked:
        for c in index.tensors[key].chunks:
            if c.rank is not None and c.box.numel:
                writers.setdefault(c.box.offsets[0], set()).add(c.rank)
    runs: list[tuple[list[int], set[int]]] = []
    for layer in sorted(writers):
        if runs and not runs[-1][1].isdisjoint(writers[layer]):
            runs[-1][0].append(layer)
            runs[-1][1].update(writers[layer])
        else:
            runs.append(([layer], set(writers[layer])))
    if any(not a[1].isdisjoint(b[1]) for i, a in enumerate(runs) for b in runs[i + 1:]):
        return []  # a rank in two runs: not PP stages
    return [((ls[0], ls[-1]), frozenset(rs)) for ls, rs in runs] if len(runs) > 1 else []


def layer_view(entry: TensorEntry) -> TensorEntry:
    """One layer of a Megatron layer-stacked tensor (the first layer's chunks, dim 0 dropped): how
    the saving job split each layer. With PP, the first layer of each stage shows its ranks; the
    layers of one stage are split alike, so the first stage's layer stands for all."""
    first = {c.box.offsets[0] for c in entry.chunks}
    stage_firsts = sorted(first)
    chunks = tuple(ChunkRef(Box(c.box.offsets[1:], c.box.sizes[1:]), c.file, c.locator, c.rank)
                   for c in entry.chunks if c.box.offsets[0] == stage_firsts[0])
    return replace(entry, shape=tuple(entry.shape[1:]), chunks=chunks)


def tp_split_dims(index: CheckpointIndex) -> dict[str, int | None]:
    """Per tensor key: the dim TP split it on (0 column-wise, 1 row-wise), or None.

    Keys of optimizer states are included and get their parameter's split (they are sharded the
    same way). None for FSDP-only, TP-replicated, whole and rank-less (universal/HF) tensors.
    """
    return {k: t.tp_dim for k, t in detect_layout(index, owners=False).tensors.items()}


def _span(ranks: Sequence[int]) -> str:
    lo, hi = min(ranks), max(ranks)
    return f"{lo}-{hi}" if list(ranks) == list(range(lo, hi + 1)) and hi > lo else ",".join(map(str, ranks))


def _count(layouts: Mapping[str, TensorLayout], kind: str) -> int:
    return sum(1 for t in layouts.values() if t.kind == kind)


def _stage_summary(mesh: _Mesh, layouts: Mapping[str, TensorLayout]) -> tuple[str, str, dict[str, int]]:
    """(head, detail, mesh guess) of one stage, e.g. ("FSDP", "dim 0 over 4 ranks", {"dp": 4})."""
    n = len(mesh.ranks)
    if mesh.tp > 1:
        col = _count(layouts, TP_COLWISE)
        inner = [t.tp_dim for t in layouts.values() if t.kind == TP_ROWWISE]
        rows = "".join(f", TP dim {d}: {inner.count(d)}" for d in sorted({1, *inner}))  # dim 2: MoE experts
        rep = _count(layouts, FSDP) if mesh.dp > 1 else _count(layouts, WHOLE)
        detail = f"TP dim 0: {col} tensors{rows}, TP-replicated: {rep}"
        if mesh.replicas > 1:
            r, f = mesh.replicas, mesh.fsdp
            return "3-D", (f"HSDP x TP (dp_replicate{r} x dp_shard{f} x tp{mesh.tp}); {detail}"), \
                {"dp_replicate": r, "dp_shard": f, "tp": mesh.tp}
        if mesh.dp > 1:
            return "2-D", f"TP x FSDP (dp{mesh.dp} x tp{mesh.tp}); {detail}", {"dp": mesh.dp, "tp": mesh.tp}
        return "TP", f"over {mesh.tp} ranks; {detail}", {"tp": mesh.tp}
    if mesh.shards < n:
        guess = {"dp_replicate": n // mesh.shards, "dp_shard": mesh.shards} if n % mesh.shards == 0 else {"dp": mesh.shards}
        if mesh.hsdp:
            r = n // mesh.shards
            return "HSDP", (f"dim 0 over {mesh.shards} shards x {r} replicas (dp_replicate{r} x dp_shard{mesh.shards}; "
                            f"{n} ranks wrote files)"), guess
        return "FSDP", (
            f"dim 0 over {mesh.shards} shards ({n} ranks wrote files: HSDP with {n // mesh.shards} "
            "replicas or another replicated mesh dim - not distinguishable from metadata)"
        ), guess
    return "FSDP", f"dim 0 over {n} ranks", {"dp": n}


def _summarize(index, ws, stages, meshes, layouts):
    """(summary, mesh guess, notes)."""
    notes = []
    irregular = [k for k, t in layouts.items() if t.kind == IRREGULAR]
    if irregular:
        notes.append(f"{len(irregular)} tensors split irregularly, e.g. {irregular[0]!r}")
    gaps = [k for k, t in layouts.items() if not t.tiles]
    if gaps:
        notes.append(f"{len(gaps)} tensors not covered exactly once by their chunks, e.g. {gaps[0]!r}")
    if not layouts:
        return "no tensors", {}, tuple(notes)
    if any(t.kind == CHUNKED for t in layouts.values()):
        src = index.info.get("source") or {}
        extra = f"; source layout: {src['layout']}" if isinstance(src, Mapping) and src.get("layout") else ""
        return f"no rank information: {index.format} storage chunks{extra}", {}, tuple(notes)
    if not any(c.rank is not None for t in index.tensors.values() for c in t.chunks):
        return f"every tensor whole (no rank information in this {index.format} checkpoint)", {}, tuple(notes)
    if not stages:
        return _whole_summary(index, ws), ({} if not ws or ws == 1 else {"dp_replicate": ws}), tuple(notes)
    parts = [_stage_summary(meshes[s], {k: layouts[k] for k in _stage_keys(index, s)}) for s in stages]
    experts = [index.tensors[k] for k, t in layouts.items() if t.kind == EXPERTS]
    if experts:  # EP on torchtitan's sparse mesh: add its degree to every stage
        eps = sorted({expert_parallel_degree(t) for t in experts})
        text = f"; grouped experts: {len(experts)} tensors split on dim 0, " + (
            f"ep{eps[0]}" if len(eps) == 1 else "ep " + "/".join(map(str, eps)))
        if len(eps) == 1 and eps[0] > 1:
            parts = [(h, d + text, {**g, "ep": eps[0]}) for h, d, g in parts]
        else:
            parts = [(h, d + text, g) for h, d, g in parts]
    if len(stages) == 1:
        return f"{parts[0][0]}: {parts[0][1]}", parts[0][2], tuple(notes)
    heads = {p[0] for p in parts}
    head = f"PP x {heads.pop()}" if len(heads) == 1 else "PP"
    groups = " | ".join(_span(s) for s in stages)
    details = {p[1] for p in parts}
    if len(details) == 1:
        per = f"each stage: {details.pop()}"
    else:
        per = "; ".join(f"stage {i}: {p[0]} {p[1]}" for i, p in enumerate(parts))
    mesh = {"pp": len(stages), **parts[0][2]}
    notes.append("PP: disjoint rank blocks holding disjoint modules (HSDP replicas would hold the same modules); "
                 "a model whose every module is whole on one block cannot show the difference")
    return f"{head}: {len(stages)} stages (ranks {groups}); {per}", mesh, tuple(notes)


def _stage_keys(index: CheckpointIndex, stage: tuple[int, ...]) -> list[str]:
    members = set(stage)
    return [k for k, t in index.tensors.items() if len(t.chunks) > 1 and t.chunks[0].rank in members]


def _whole_summary(index: CheckpointIndex, ws: int | None) -> str:
    if ws is None or ws <= 1:
        return "single process: every tensor whole"
    return (
        f"replicated: every tensor whole; {ws} ranks wrote files (DDP-style dedup or pure PP - "
        "not distinguishable from metadata)"
    )


@dataclass(frozen=True)
class SourceHint:
    """How the source laid one tensor out, kept in the store for plans that follow the source."""

    split: dict[str, int]
    replicated: bool
    tp_dim: int | None


def source_hints(layout: LayoutReport, index: CheckpointIndex) -> dict[str, SourceHint]:
    """Per tensor key: split dims, whether every rank held it whole, and its TP split dim."""
    sharded_source = (layout.world_size or 1) > 1
    hints = {}
    for key, lay in layout.tensors.items():
        whole = lay.kind == WHOLE and bool(index.tensors[key].shape)
        hints[key] = SourceHint({str(d): n for d, n in lay.split_dims.items()}, whole and sharded_source, lay.tp_dim)
    return hints
