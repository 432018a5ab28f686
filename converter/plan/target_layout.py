"""The target layout of a DCP checkpoint on a mesh (pure: metadata in, chunks out).

1. place: the placement plan gives every parameter its placements on the mesh (and PP stage);
   optimizer states of a parameter follow it (an atom with states only is placed as its
   parameter would be: :func:`stateful_atoms`), 0-d tensors and other shapes are replicated;
2. layout: each rank's box per tensor (what ``compute_local_shape_and_global_offset`` gives),
   deduplicated: a box held by several ranks is written once, in the least-loaded holder's file
   (:class:`OwnerPicker`, as DCP's own dedup does) or exactly where ``dcp.save`` puts it
   (:func:`torch_dedup_owners`);
3. tasks: the pieces of every chunk filled from the source chunks (:func:`layout_tasks`).

``converter.commands.from_universal`` plans with these and hands the chunks to the DCP writers.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import groupby
from operator import attrgetter

import numpy as np

from converter.plan.atoms import AtomRef, group_atoms, is_megatron
from converter.plan.auto_plan import choose_plan, family_plan, model_family, unused_dim_warnings, unused_dims
from converter.plan.copy_tasks import WriteTask, plan_boxes
from converter.plan.mesh import Mesh
from converter.plan.placement_rules import HeadCounts, TensorPlacement, check_head_split, plan_all, replicated
from converter.plan.plans import get_plan
from formats.base import Box, CheckpointIndex, TensorEntry
from formats.dcp.writer import ChunkCopy, ChunkSpec
from formats.errors import ConfigError
from formats.dtypes import CASTABLE_FLOATS, by_name


#: ``--local-files``: where a box several ranks hold is stored.
LOCAL_FILES = ("dedup", "rank", "node")


@dataclass(frozen=True)
class LocalFiles:
    """``--local-files MODE [--ranks-per-node K]``: ``dedup`` (one copy of each box, in the
    least-loaded holder's file, one ``.metadata``: what ``dcp.save`` writes), ``rank`` (every rank's
    file holds everything that rank loads) or ``node`` (every node's files, ranks ``N*K`` to
    ``N*K+K-1``, hold everything its ranks load: one copy per node); the last two write rank-local
    metadata ``__<rank>.metadata`` mapping each rank's items to its own copies."""

    mode: str = "dedup"
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in LOCAL_FILES:
            raise ConfigError(f"--local-files {self.mode!r}: choose one of {', '.join(LOCAL_FILES)}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ConfigError(f"--ranks-per-node must be at least 1 (got {self.ranks_per_node})")
        if self.mode == "node" and self.ranks_per_node is None:
            raise ConfigError("--local-files node needs --ranks-per-node K (the ranks of each node: N*K .. N*K+K-1)")
        if self.mode != "node" and self.ranks_per_node is not None:
            raise ConfigError("--ranks-per-node groups the files of --local-files node; add --local-files node")

    @property
    def local(self) -> bool:
        """Whether ranks get rank-local metadata (``rank`` or ``node``)."""
        return self.mode != "dedup"

    @property
    def group(self) -> int:
        """Ranks per file group: 1 for ``rank``, K for ``node``."""
        return self.ranks_per_node or 1

    def check(self, world: int) -> None:
        """Refuse a node size that does not divide the world (before any I/O)."""
        if self.mode == "node" and world % self.group:
            raise ConfigError(f"--ranks-per-node {self.group} does not divide the {world} ranks of the mesh")

    def nodes(self, world: int) -> int:
        """How many file groups (nodes) a ``world``-rank target has."""
        return world // self.group if self.local else 1


@dataclass(frozen=True)
class TargetLayout:
    """Every chunk of the target checkpoint, and the warnings the plan raised. With rank-local
    metadata (``local.local``) a box may be stored once per rank file (or per node) and
    ``readers`` names, per chunk, the ranks whose metadata lists that copy."""

    mesh: Mesh
    chunks: tuple[ChunkSpec, ...]
    warnings: tuple[str, ...] = ()
    placements: Mapping[str, TensorPlacement] = field(default_factory=dict)
    key_placements: Mapping[str, TensorPlacement] = field(default_factory=dict)  # per tensor key
    plan: str = ""  # the plan that placed them (what --plan auto chose)
    plan_reason: str | None = None  # --plan auto: why (one line)
    local: LocalFiles = LocalFiles()
    readers: tuple[tuple[int, ...], ...] | None = None  # per chunk (rank-local metadata only)
    #: per chunk, the ranks that load it, where no placement tells (--plan megatron-core's boxes)
    holders: tuple[tuple[int, ...], ...] | None = None

    def only(self, keys: Collection[str]) -> TargetLayout:
        """The layout of ``keys``' chunks only (itself when every key is kept: C-level checks)."""
        if set(map(_KEY, self.chunks)) <= set(keys):
            return self
        kept = [i for i, c in enumerate(self.chunks) if c.key in keys]
        return replace(self, chunks=tuple(self.chunks[i] for i in kept),
                       readers=None if self.readers is None else tuple(self.readers[i] for i in kept),
                       holders=None if self.holders is None else tuple(self.holders[i] for i in kept))


def target_layout(index: CheckpointIndex, refs: Mapping[str, AtomRef], mesh: Mesh, plan_name: str,
                  tp_splits: Mapping[str, int | None], replicated: set[str],
                  dtype_override: str | None = None, keep: Collection[str] | None = None,
                  heads: HeadCounts | None = None, dedup: str = "least-loaded",
                  source_mesh: Mapping[str, int] | None = None, local: LocalFiles = LocalFiles()) -> TargetLayout:
    """Pure: the target chunks (key, box, owner rank) for every tensor of ``index`` on ``mesh``
    (only the tensors in ``keep`` when given: parameters are still planned from the whole
    ``index``, so a selected optimizer state follows its parameter's placement). With ``heads``
    known, a TP degree that does not divide them is refused. ``dedup``: which holder's file keeps
    a box several ranks hold: ``least-loaded`` (:class:`OwnerPicker`) or ``torch`` (exactly what
    ``dcp.save``'s dedup picks, :func:`torch_dedup_owners`). ``plan_name`` ``auto`` chooses the
    plan from the checkpoint (:func:`converter.plan.auto_plan.choose_plan`; ``source_mesh``, the
    detected source mesh, is named in its reason); a ``tp`` or ``ep`` mesh dim the plan leaves
    unused is warned about, naming the plan that would use it. ``local`` (``--local-files``) stores
    a box once per holding rank's file (``rank``) or once per node among its holders, in the
    least-loaded holder of that node (``node``), each copy read by its own rank (or node)."""
    local.check(mesh.world_size)
    params = {
        ref.atom: tuple(index.tensors[k].shape)
        for k, ref in refs.items()
        if ref.role == "param" and k in index.tensors and k not in replicated and index.tensors[k].shape
    }
    stateful = stateful_atoms(index, refs, params, replicated)
    params |= stateful
    param_splits = atom_splits(index, refs, tp_splits, stateful)
    megatron = is_megatron({k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()})
    reason = None
    if plan_name == "auto":
        choice = choose_plan(params, param_splits, megatron, source_mesh)
        plan, reason = choice.plan, choice.reason
    else:
        plan = get_plan(plan_name, source_splits=param_splits, mesh=mesh, params=params)
    placements, warnings = plan_all(params, plan, mesh)
    warnings += _unused_dims(params, placements, mesh, plan.name, megatron)
    check_head_split(placements, mesh, heads)
    owners = OwnerPicker(mesh.world_size, exact=_huge(index))
    chunks: list[ChunkSpec] = []
    readers: list[tuple[int, ...]] | None = [] if local.local else None
    by_key: dict[str, TensorPlacement] = {}
    later: list[tuple[str, str, tuple[int, ...], BoxGroups]] = []  # dedup="torch": owners after the loop
    for key, entry in index.tensors.items():
        if keep is not None and key not in keep:
            continue
        placement = by_key[key] = _placement_for(entry, refs.get(key), params, placements, mesh)
        dtype = by_name(target_dtype(entry, refs.get(key), dtype_override)).name
        itemsize, shape = by_name(dtype).itemsize, tuple(int(n) for n in entry.shape)
        groups = owners.groups(placement, shape, mesh)
        if dedup == "torch":
            later.append((key, dtype, shape, groups))
            continue
        if readers is not None:
            boxes, ranks, read = owners.pick_local(groups, itemsize, local.group)
            chunks += ChunkCopy.many(key, dtype, shape, boxes, ranks)
            readers += read
            continue
        # layout boxes: Python ints
        chunks += ChunkSpec.many(key, dtype, shape, groups.boxes, owners.pick(groups, itemsize))
    if later:
        picked = torch_dedup_owners([(g, math.prod(shape) * by_name(dtype).itemsize) for _, dtype, shape, g in later],
                                    mesh.world_size)
        for (key, dtype, shape, groups), ranks in zip(later, picked):
            chunks += ChunkSpec.many(key, dtype, shape, groups.boxes, ranks)
    return TargetLayout(mesh, tuple(chunks), tuple(warnings), placements, by_key, plan.name, reason, local,
                        None if readers is None else tuple(readers))


def _unused_dims(params: Mapping[str, tuple], placements: Mapping[str, TensorPlacement], mesh: Mesh,
                 plan_name: str, megatron: bool) -> list[str]:
    """Warnings for a ``tp`` / ``ep`` dim of ``mesh`` no placement splits a tensor over, naming the
    family's plan when it would (placed only then: the warning is rare). A ``torchtitan:`` plan's
    placements are torchtitan's own and name the dims EP borrows (``tp: Shard(0)`` for experts
    when ep spans the tp ranks), never ``ep``: no ep warning for it."""
    dims = unused_dims(placements, mesh)
    if plan_name.startswith("torchtitan:"):
        dims = [d for d in dims if d != "ep"]
    if not dims:
        return []
    family = model_family(params, megatron)
    uses: list[str] = []
    if family is not None and family.plan != plan_name:
        uses = [d for d in dims if d not in unused_dims(plan_all(params, family_plan(family, params), mesh)[0], mesh)]
    return unused_dim_warnings(dims, mesh, plan_name, family, uses)


def _placement_for(entry: TensorEntry, ref: AtomRef | None, params: Mapping[str, tuple],
                   placements: Mapping[str, TensorPlacement], mesh: Mesh) -> TensorPlacement:
    """The parameter's placement for its value and same-shaped states; replicate otherwise."""
    p = placements.get(ref.atom) if ref is not None else None
    if p is None:
        return replicated(mesh)
    if tuple(entry.shape) != params.get(ref.atom):
        return replace(replicated(mesh), pp_stage=p.pp_stage)  # 0-d step, or a state of another shape
    return p


def target_dtype(entry: TensorEntry, ref: AtomRef | None, override: str | None) -> str:
    """The dtype a tensor is written in: ``override`` (``--dtype``) for a floating-point parameter,
    else its own."""
    if override and ref is not None and ref.role == "param" and entry.dtype in CASTABLE_FLOATS:
        return override
    return entry.dtype


def stateful_atoms(index: CheckpointIndex, refs: Mapping[str, AtomRef], params: Mapping[str, tuple],
                   replicated: set[str]) -> dict[str, tuple]:
    """Atoms with optimizer states but no parameter value among the keys, with the states' shape.

    torchtitan 0.3.0's fused ``qkv_linear.wqkv.weight`` is one: the model's save hook writes it as
    ``wq``/``wk``/``wv``, the optimizer keeps the fused name. Its states are placed as the
    parameter they belong to would be (None of them held whole by the source, all one shape).
    """
    shapes: dict[str, set[tuple]] = {}
    held_whole: set[str] = set()
    for key, ref in refs.items():
        entry = index.tensors.get(key)
        if entry is None or ref.role in ("param", "value") or ref.atom in params or not entry.shape:
            continue
        shapes.setdefault(ref.atom, set()).add(tuple(entry.shape))
        if key in replicated:
            held_whole.add(ref.atom)
    return {atom: next(iter(s)) for atom, s in shapes.items() if len(s) == 1 and atom not in held_whole}


def atom_splits(index: CheckpointIndex, refs: Mapping[str, AtomRef], tp_splits: Mapping[str, int | None],
                stateful: Mapping[str, tuple]) -> dict[str, int | None]:
    """Per atom, the TP split dim the source shows (``--plan source``): its parameter value's, or
    for an atom with optimizer states only (:func:`stateful_atoms`, e.g. torchtitan 0.3.0's fused
    ``wqkv``) its states' of that shape, when they agree."""
    out = {refs[k].atom: d for k, d in tp_splits.items() if k in refs and refs[k].role == "param"}
    found: dict[str, set[int | None]] = {}
    for key, d in tp_splits.items():
        ref = refs.get(key)
        if ref is not None and ref.atom in stateful and ref.atom not in out and key in index.tensors \
                and tuple(index.tensors[key].shape) == stateful[ref.atom]:
            found.setdefault(ref.atom, set()).add(d)
    return out | {atom: next(iter(dims)) for atom, dims in found.items() if len(dims) == 1}


def atom_refs(index: CheckpointIndex) -> dict[str, AtomRef]:
    """Every key's atom (a parameter and its optimizer states) and role."""
    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    return group_atoms(paths)[0]


def torch_dedup_owners(tensors: list[tuple[BoxGroups, int]], world: int) -> list[list[int]]:
    """The owner rank of every box of every tensor (``(groups, global bytes)`` in state-dict order)
    exactly as torch's ``dedup_save_plans`` picks it (``dcp.save``'s default planner): write items
    are taken rank by rank, each rank's in state-dict order; an item held by several ranks is decided
    where it first appears (at its lowest holder) and goes to the holder with the fewest bytes so
    far (ties: the lowest rank); every item adds its tensor's GLOBAL size (0 counts 1) to its
    owner's bytes. So at a decision in rank ``r``'s turn, rank ``r`` has its own single-holder items
    of earlier keys, and higher ranks only what earlier decisions gave them (their own items come in
    their turn): replicated boxes go to the ranks after the first. Decisions only loop in Python;
    the single-holder items are summed in numpy."""
    owners: list[list[int | None]] = []
    decisions: list[tuple[int, int, int]] = []  # (lowest holder, key index, box index)
    for k, (g, _) in enumerate(tensors):
        own: list[int | None] = []
        for b, h in enumerate(g.holders):
            if len(h) == 1:
                own.append(h[0])
            else:
                own.append(None)
                decisions.append((min(h), k, b))
        owners.append(own)
    if decisions:
        deciders = sorted({r for r, _, _ in decisions})
        col = np.full(world + 1, -1, dtype=np.int64)
        col[deciders] = np.arange(len(deciders))
        own_bytes = np.zeros((len(tensors), len(deciders)), dtype=np.int64)
        for k, (g, nbytes) in enumerate(tensors):
            single = np.array([h[0] for h in g.holders if len(h) == 1], dtype=np.int64)
            cols = col[single]
            np.add.at(own_bytes[k], cols[cols >= 0], nbytes or 1)
        before = np.cumsum(own_bytes, axis=0) - own_bytes  # a decider's own bytes of earlier keys
        base = np.zeros(world, dtype=np.int64)  # bytes given by decisions so far
        for r, k, b in sorted(decisions):
            g, nbytes = tensors[k]
            holders = np.array(sorted(g.holders[b]), dtype=np.int64)
            loads = base[holders]
            loads[0] += before[k, col[r]]  # holders[0] is r: its own earlier items count too
            owner = int(holders[int(np.argmin(loads))])  # first minimum: the lowest rank
            base[owner] += nbytes or 1
            owners[k][b] = owner
    return owners  # type: ignore[return-value]


def _huge(index: CheckpointIndex) -> bool:
    """Whether per-rank byte counts could leave int64 (then loads are Python ints)."""
    return sum(math.prod(e.shape) for e in index.tensors.values()) * 16 >= 1 << 62


@dataclass(frozen=True)
class BoxGroups:
    """A placement's distinct boxes on one shape (:meth:`TensorPlacement.unique_boxes`), with
    their holders as a table for picking owners of all boxes at once."""

    boxes: tuple[Box, ...]
    holders: tuple[tuple[int, ...], ...]
    numels: np.ndarray | None  # int64, per box (None: loads are Python ints)
    table: np.ndarray | None  # (box, holder) -> rank, short rows padded with the sentinel rank;


class OwnerPicker:
    """The least-loaded rule of DCP's dedup over a whole layout: each box goes to the holder that
    owns the fewest bytes so far (ties: the first holder, the lowest rank), boxes in layout order.

    A rank holds one box of a tensor, so within a tensor no two boxes share a holder and every
    box's choice depends only on the loads before the tensor: a tensor's owners are one argmin
    over its holder table (rows padded with a sentinel rank whose load never wins)."""

    def __init__(self, world_size: int, exact: bool = False) -> None:
        self.world_size, self.exact = world_size, exact
        self.loads = np.zeros(world_size + 1, dtype=np.int64)
        self.loads[world_size] = np.iinfo(np.int64).max  # the padding rank
        self.py_loads: dict[int, int] = {r: 0 for r in range(world_size)}
        self._groups: dict[tuple, BoxGroups] = {}
        self._splits: dict[tuple, _NodeSplit] = {}

    def groups(self, placement: TensorPlacement, shape: tuple[int, ...], mesh: Mesh) -> BoxGroups:
        """The placement's boxes on ``shape`` (cached: layouts repeat a few shapes)."""
        key = (placement.placements, placement.dims, placement.pp_stage, shape)
        found = self._groups.get(key)
        if found is None:
            found = self._groups[key] = self._make(placement.unique_boxes(shape, mesh))
        return found

    def _make(self, unique: list[tuple[Box, tuple[int, ...]]]) -> BoxGroups:
        boxes = tuple(b for b, _ in unique)
        holders = tuple(h for _, h in unique)
        numels = None if self.exact else np.array([b.numel for b in boxes], dtype=np.int64)
        flat = [r for h in holders for r in h]
        table = None
        if boxes and len(set(flat)) == len(flat) and min(map(len, holders)) > 0:
            width = max(map(len, holders))
            table = np.full((len(boxes), width), self.world_size, dtype=np.int64)
            for i, h in enumerate(holders):
                table[i, :len(h)] = h
        return BoxGroups(boxes, holders, numels, table)

    def pick(self, groups: BoxGroups, itemsize: int) -> list[int]:
        """The owner rank of each of ``groups.boxes``, and their bytes added to the loads."""
        table = groups.table
        if self.exact or table is None:
            return self._pick_each(groups, itemsize)
        if table.shape[1] == 1:
            owners = table[:, 0]
        else:
            owners = table[np.arange(len(table)), self.loads[table].argmin(axis=1)]
        self.loads[owners] += groups.numels * itemsize  # owners are distinct: no lost updates
        return owners.tolist()

    def _pick_each(self, groups: BoxGroups, itemsize: int) -> list[int]:
        """:meth:`pick` box by box (Python ints; a rank holding two boxes, or loads beyond int64)."""
        loads = self.py_loads if self.exact else self.loads
        out = []
        for box, holders in zip(groups.boxes, groups.holders):
            owner = min(holders, key=loads.__getitem__)  # least loaded; ties: lowest rank (holders ascend)
            loads[owner] += box.numel * itemsize
            out.append(int(owner))
        return out


    def pick_local(self, groups: BoxGroups, itemsize: int, node_size: int
                   ) -> tuple[list[Box], list[int], list[tuple[int, ...]]]:
        """Rank-local copies of ``groups.boxes``: ``(boxes, file ranks, readers)``, one copy per
        node of ``node_size`` ranks among each box's holders (``node_size`` 1: per holding rank),
        in that node's least-loaded holder, read by the node's holders; an empty box is stored
        once (nothing reads it). The bytes are added to the loads."""
        split = self._split(groups, node_size)
        if split.fixed is not None:  # every copy's holder is its only candidate: no choice to make
            boxes, ranks, readers, numels = split.fixed
            if self.exact:
                for r, n in zip(ranks, numels):
                    self.py_loads[r] += n * itemsize
            else:
                np.add.at(self.loads, np.asarray(ranks, dtype=np.int64), np.asarray(numels, dtype=np.int64) * itemsize)
            return boxes, ranks, readers
        loads = self.py_loads if self.exact else self.loads
        boxes, ranks, readers = [], [], []
        for box, parts in zip(groups.boxes, split.parts):
            nbytes = box.numel * itemsize
            for part in parts:
                owner = part[0] if len(part) == 1 else int(min(part, key=loads.__getitem__))  # ties: lowest rank
                loads[owner] += nbytes
                boxes.append(box)
                ranks.append(owner)
                readers.append(part)
        return boxes, ranks, readers

    def _split(self, groups: BoxGroups, node_size: int) -> _NodeSplit:
        """Each box's holders split by node (cached per box groups and node size)."""
        key = (id(groups), node_size)
        found = self._splits.get(key)
        if found is not None and found.groups is groups:
            return found
        parts: list[tuple[tuple[int, ...], ...]] = []
        for box, holders in zip(groups.boxes, groups.holders):
            if not box.numel or len(holders) <= 1:
                parts.append((holders,) if holders else ())
                continue
            by_node: dict[int, list[int]] = {}
            for r in holders:
                by_node.setdefault(r // node_size, []).append(r)
            parts.append(tuple(_ranks(g) for g in by_node.values()))
        fixed = None
        if all(len(g) == 1 for p in parts for g in p):
            flat = [(box, g) for box, p in zip(groups.boxes, parts) for g in p]
            fixed = ([b for b, _ in flat], [g[0] for _, g in flat], [g for _, g in flat], [b.numel for b, _ in flat])
        found = self._splits[key] = _NodeSplit(groups, tuple(parts), fixed)
        return found


@dataclass(frozen=True)
class _NodeSplit:
    """A box group's holders by node: per box, one rank tuple per node; ``fixed`` when each part
    has one rank (``(boxes, ranks, readers, numels)`` of the copies, the same every time)."""

    groups: BoxGroups
    parts: tuple[tuple[tuple[int, ...], ...], ...]
    fixed: tuple[list, list, list, list] | None


_SINGLES: dict[int, tuple[int, ...]] = {}


def _ranks(ranks: list[int]) -> tuple[int, ...]:
    """``ranks`` as a tuple, one shared object per single rank (layouts make millions)."""
    if len(ranks) == 1:
        r = ranks[0]
        found = _SINGLES.get(r)
        if found is None:
            found = _SINGLES[r] = (r,)
        return found
    return tuple(ranks)


def local_objects(specs: Sequence[tuple[str, tuple, bytes, int]], loaders: Mapping[str, tuple[int, ...]], world: int,
                  local: LocalFiles) -> tuple[list[tuple[str, tuple, bytes, int]], list[tuple[int, ...]]]:
    """The non-tensor entries ``(key, path, bytes, rank file)`` stored rank-locally: once per node
    (rank, with ``--local-files rank``) among the ranks that load each (``loaders``; every rank
    when not named), in that node's first loading rank's file; with the ranks that read each copy."""
    size = local.group
    every = [tuple(range(n * size, min(world, (n + 1) * size))) for n in range(local.nodes(world))]
    out: list[tuple[str, tuple, bytes, int]] = []
    readers: list[tuple[int, ...]] = []
    for key, path, data, _ in specs:
        ranks = loaders.get(key)
        if ranks is None:
            parts = every
        else:
            by_node: dict[int, list[int]] = {}
            for r in ranks:
                by_node.setdefault(r // size, []).append(r)
            parts = [tuple(g) for g in by_node.values()]
        for part in parts:
            out.append((key, path, data, part[0]))
            readers.append(part)
    return out, readers


def rank_loads(layout: TargetLayout, objects: Sequence[tuple[int, tuple[int, ...] | None]]) -> list[set[int]]:
    """Per rank of the target, the rank files its ``dcp.load`` opens (read items only: empty
    boxes are never read): the copies it reads (``layout.readers``, or every holder of a box
    stored once) and its non-tensor entries (``objects``: ``(file rank, readers)``, readers None:
    every rank)."""
    world = layout.mesh.world_size
    loads: list[set[int]] = [set() for _ in range(world)]
    shared: set[int] = set()  # files every rank reads
    for rank, readers in objects:
        if readers is None:
            shared.add(rank)
        else:
            for r in readers:
                loads[r].add(rank)
    if layout.readers is not None or layout.holders is not None:
        for spec, readers in zip(layout.chunks, layout.readers or layout.holders):
            if spec.box.numel:
                f = spec.rank
                for r in readers:
                    loads[r].add(f)
    else:
        cache: dict[tuple, dict[tuple, tuple[int, ...]]] = {}
        for key, group in groupby(layout.chunks, _KEY):
            specs = list(group)
            placement = layout.key_placements[key]
            shape = specs[0].global_shape
            holders = cache.get((placement, shape))
            if holders is None:
                holders = cache[(placement, shape)] = {(b.offsets, b.sizes): h for b, h in
                                                       placement.unique_boxes(shape, layout.mesh)}
            for spec in specs:
                box = spec.box
                if box.numel:
                    f = spec.rank
                    for r in holders.get((box.offsets, box.sizes), (f,)):
                        loads[r].add(f)
    if shared:
        for s in loads:
            s |= shared
    return loads


def layout_tasks(index: CheckpointIndex, layout: TargetLayout, piece_bytes: int) -> list[WriteTask]:
    """The copy tasks that fill every chunk of ``layout`` from the source chunks of ``index``
    (pieces of at most ``piece_bytes``)."""
    by_key: dict[str, list[ChunkSpec]] = {}
    for key, group in groupby(layout.chunks, _KEY):  # a key's chunks are contiguous: C-level grouping
        by_key.setdefault(key, []).extend(group)
    tasks: list[WriteTask] = []
    for key, specs in by_key.items():
        tasks += plan_boxes(index.tensors[key], specs, list(map(_BOX, specs)), piece_bytes)
    return tasks


_KEY, _BOX = attrgetter("key"), attrgetter("box")


def chunks_of(chunks: tuple[ChunkSpec, ...], keys: Collection[str]) -> tuple[ChunkSpec, ...]:
    """The ``chunks`` of ``keys`` (``chunks`` itself when every key is kept: C-level checks only)."""
    if set(map(_KEY, chunks)) <= set(keys):
        return chunks
    return tuple(c for c in chunks if c.key in keys)
