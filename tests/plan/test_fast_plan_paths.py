"""The fast planning paths of ``from-universal`` (issue 15: 1,024-rank dry runs) give exactly what
the straightforward ones give, on random source layouts, target meshes and plans.

Each fast path is compared with a plain reference kept here (the per-chunk loops they replaced):
``detect_layout`` (facts and chunk order cached per distinct boxes), ``target_layout`` (owners by
one argmin per tensor), ``ChunkIndex`` (layout cached per source boxes), ``plan_tensor`` /
``_plan`` (tasks built by slot setters, bounds checked per box identity), ``ChunkSpec.many`` and
``total_target_nbytes``.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import replace

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, reject, settings

from converter.plan import target_layout as tl
from converter.config import RunOptions
from converter.plan import copy_tasks, source_layout
from converter.plan.atoms import group_atoms
from converter.plan.copy_tasks import (ChunkIndex, CopyItem, PlannedPieces, WriteTask, plan_tensor, target_nbytes,
                                       total_target_nbytes)
from converter.plan.mesh import parse_mesh
from converter.plan.placements import Replicate, Shard, StridedShard, unique_boxes
from formats.base import Box, CheckpointIndex, ChunkRef, TensorEntry
from formats.dcp.writer import ChunkSpec
from formats.dtypes import by_name
from formats.errors import CorruptCheckpointError, PlanError

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# random source checkpoints: llama-ish tensors saved on a random (dp, tp) mesh, DCP-deduplicated


def _fqns(layers: int) -> list[tuple[str, str]]:
    """(fqn, kind) of a small Llama: kind picks the source placement."""
    out = [("tok_embeddings.weight", "row"), ("norm.weight", "vec"), ("output.weight", "col")]
    for i in range(layers):
        out += [(f"layers.{i}.attention.wq.weight", "col"), (f"layers.{i}.attention.wo.weight", "row"),
                (f"layers.{i}.attention_norm.weight", "vec"), (f"layers.{i}.feed_forward.w1.weight", "col")]
    return out


def _source_placements(kind: str, tp: int) -> tuple:
    """(dp, tp) placements torch gives each kind under FSDP2 x TP."""
    if tp == 1:
        return Shard(0), Replicate()
    if kind == "col":
        return StridedShard(0, tp), Shard(0)
    if kind == "row":
        return Shard(0), Shard(1)
    return Shard(0), Replicate()


@st.composite
def source_indexes(draw) -> CheckpointIndex:
    dp, tp = draw(st.sampled_from([(1, 1), (2, 1), (4, 1), (3, 1), (2, 2), (1, 2), (4, 2), (2, 4), (8, 1)]))
    mesh = parse_mesh(f"dp{dp},tp{tp}" if tp > 1 else f"dp{dp}")
    rng = random.Random(draw(st.integers(0, 2**16)))
    # heads split evenly over tp <= 4 (the llama plan refuses others); shards may be uneven or empty
    dim, vocab, hidden = 4 * draw(st.integers(1, 3)), draw(st.integers(1, 20)), draw(st.integers(1, 16))
    shuffle, states = draw(st.booleans()), draw(st.booleans())
    tensors: dict[str, TensorEntry] = {}
    for fqn, kind in _fqns(draw(st.integers(0, 3))):
        shape = {"tok_embeddings.weight": (vocab, dim), "output.weight": (vocab, dim)}.get(fqn)
        if shape is None:
            shape = (dim,) if kind == "vec" else (hidden, dim) if "w1" in fqn else (dim, dim)
        dp_p, tp_p = _source_placements(kind, tp)
        placements = tuple(tp_p if name == "tp" else dp_p for name in mesh.names)
        unique = unique_boxes(shape, mesh, placements)
        writers = [rng.choice(holders) for _, holders in unique]  # dedup: any holder writes it
        roles = [("model", fqn)] + ([("optim", "state", fqn, "exp_avg"), ("optim", "state", fqn, "exp_avg_sq")]
                                    if states else [])
        for path in roles:
            key = ".".join(path)
            chunks = [ChunkRef(box, f"__{r}_0.distcp", (key, i), r) for i, ((box, _), r) in enumerate(zip(unique, writers))]
            if shuffle:
                rng.shuffle(chunks)
            tensors[key] = TensorEntry(key, draw(st.sampled_from(["float32", "bfloat16"])) if path[0] == "model"
                                       else "float32", shape, tuple(chunks), path)
        if states:
            key = f"optim.state.{fqn}.step"
            tensors[key] = TensorEntry(key, "float32", (), (ChunkRef(Box((), ()), "__0_0.distcp", key, 0),),
                                       ("optim", "state", fqn, "step"))
    return CheckpointIndex("dcp", "src", tensors, {}, {"world_size": dp * tp})


TARGETS = st.sampled_from([("dp4", "fsdp"), ("dp3", "fsdp"), ("tp2,dp2", "llama"), ("tp2,dp3", "llama"),
                           ("tp4,dp2", "llama"), ("dp_replicate2,dp_shard2", "fsdp"), ("tp2", "llama"),
                           ("pp2,dp2", "llama"), ("dp16", "fsdp")])


# ---------------------------------------------------------------------------------------------
# references: the straightforward per-chunk loops


def reference_chunks(index: CheckpointIndex, refs, layout, dtype: str | None) -> tuple[ChunkSpec, ...]:
    """The target chunks by the plain least-loaded loop over every box."""
    mesh = layout.mesh
    loads = {r: 0 for r in range(mesh.world_size)}
    out = []
    for key, entry in index.tensors.items():
        placement = layout.key_placements[key]
        target_dtype = by_name(tl.target_dtype(entry, refs.get(key), dtype)).name
        itemsize, shape = by_name(target_dtype).itemsize, tuple(entry.shape)
        for box, holders in placement.unique_boxes(shape, mesh):
            owner = min(holders, key=loads.__getitem__)
            loads[owner] += box.numel * itemsize
            out.append(ChunkSpec(key, target_dtype, shape, box, owner))
    return tuple(out)


class ReferenceChunkIndex:
    """The per-chunk ChunkIndex the cached one replaced."""

    def __init__(self, chunks) -> None:
        live = [c for c in chunks if 0 not in c.box.sizes]
        self._dim, self._starts, self._reach = None, [], 0
        if len(live) > copy_tasks._SCAN_CHUNKS and live[0].box.ndim:
            ndim = live[0].box.ndim
            self._dim = max(range(ndim), key=lambda d: (len({c.box.offsets[d] for c in live}), -d))
            d = self._dim
            live.sort(key=lambda c: c.box.offsets[d])
            self._starts = [c.box.offsets[d] for c in live]
            self._reach = max(c.box.sizes[d] for c in live)
        self.chunks = live

    @property
    def numel(self) -> int:
        return sum(math.prod(c.box.sizes) for c in self.chunks)

    def candidates(self, target: Box):
        d = self._dim
        if d is None or target.ndim <= d:
            return self.chunks
        lo, hi = target.offsets[d], target.offsets[d] + target.sizes[d]
        i = bisect.bisect_right(self._starts, lo - self._reach)
        return self.chunks[i:bisect.bisect_left(self._starts, hi, lo=i)]

    def overlapping(self, target: Box):
        return [c for c in self.candidates(target) if c.box.overlaps(target)]

    def copies(self, target: Box):
        return tuple(CopyItem(c, r) for c in self.candidates(target)
                     for r in [c.box.intersect(target)] if r is not None and r.numel)


def reference_plan_tensor(entry: TensorEntry, targets, piece_bytes: int) -> list[WriteTask]:
    itemsize = by_name(entry.dtype).itemsize
    index = ReferenceChunkIndex(entry.chunks)
    if index.numel != entry.numel:
        raise CorruptCheckpointError(f"key {entry.key!r}: cover")
    shape = tuple(entry.shape)
    tasks = []
    for target_id, box in targets:
        if len(box.offsets) != len(shape) or any(o < 0 or n < 0 or o + n > d
                                                 for o, n, d in zip(box.offsets, box.sizes, shape)):
            raise CorruptCheckpointError(
                f"key {entry.key!r}: target {box.to_json()} lies outside the tensor's shape {list(shape)}")
        tasks.append(WriteTask(entry.key, entry.dtype, target_id, box,
                               PlannedPieces(index, box, itemsize, piece_bytes, entry.key)))
    return tasks


def assert_same_tasks(fast: list[WriteTask], slow: list[WriteTask]) -> None:
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert (a.key, a.dtype, a.target, a.box) == (b.key, b.dtype, b.target, b.box)
        assert list(a.pieces) == list(b.pieces)
        assert repr(a.pieces) == repr(b.pieces) and hash(a.pieces) == hash(b.pieces)
        assert a.max_piece_bytes == b.max_piece_bytes and a.nbytes == b.nbytes
        assert a.pieces.source_files() == {c.file for c in b.pieces._src.index.overlapping(b.box)}


# ---------------------------------------------------------------------------------------------
# the properties


@SETTINGS
@given(source_indexes())
def test_detect_layout_equals_the_uncached_facts_and_order(index):
    fast = source_layout.detect_layout(index)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(source_layout, "_facts_cached",
                  lambda t, cache: (source_layout._facts(t), source_layout._order(t.chunks)))
        slow = source_layout.detect_layout(index)
    assert fast == slow
    bare = source_layout.detect_layout(index, owners=False)  # what source_hints reads
    assert bare == replace(fast, tensors={k: replace(t, owners=()) for k, t in fast.tensors.items()})
    for key, t in index.tensors.items():
        lay = fast.tensors[key]
        assert lay.owners == tuple((c.rank, c.box) for c in source_layout._order(t.chunks))
        assert (dict(lay.split_dims), lay.tiles) == (source_layout.split_dims(t), source_layout.tiles(t))


@SETTINGS
@given(source_indexes(), TARGETS, st.sampled_from([None, "bfloat16"]), st.integers(16, 4096))
def test_layout_and_plan_equal_the_straightforward_loops(index, target, dtype, piece_bytes):
    mesh_spec, plan = target
    mesh = parse_mesh(mesh_spec)
    refs = group_atoms({k: e.path for k, e in index.tensors.items()})[0]
    hints = source_layout.source_hints(source_layout.detect_layout(index), index)
    splits = {k: h.tp_dim for k, h in hints.items()}
    replicated = {k for k, h in hints.items() if h.replicated}
    try:
        layout = tl.target_layout(index, refs, mesh, plan, splits, replicated, dtype)
    except PlanError:  # a refusal (uneven _StridedShard, ...) comes before any box is placed
        reject()
    assert layout.chunks == reference_chunks(index, refs, layout, dtype)
    with pytest.MonkeyPatch.context() as m:  # loads beyond int64: the box-by-box path
        m.setattr(tl, "_huge", lambda index: True)
        assert tl.target_layout(index, refs, mesh, plan, splits, replicated, dtype) == layout

    options = RunOptions(piece_bytes=piece_bytes)
    tasks = tl.layout_tasks(index, layout, options.effective_piece_bytes)
    slow = []
    for key, entry in index.tensors.items():
        specs = [s for s in layout.chunks if s.key == key]
        slow += reference_plan_tensor(entry, [(s, s.box) for s in specs], options.effective_piece_bytes)
    assert_same_tasks(tasks, slow)
    assert total_target_nbytes(tasks) == sum(target_nbytes(t) for t in tasks)


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), min_size=1, max_size=12), st.integers(1, 3),
       st.data())
def test_chunk_index_equals_the_per_chunk_one(cells, cols, data):
    """Random row blocks x column blocks (empty ones included), in any order; the same boxes in a
    second tensor (other files) hit the cache and still index their own chunks."""
    boxes, row = [], 0
    for rows, _ in cells:
        for c in range(cols):
            boxes.append(Box((row, c * 2), (rows, 2)))
        row += rows
    order = data.draw(st.permutations(range(len(boxes))))
    for file in ("a", "b"):
        chunks = [ChunkRef(boxes[i], f"{file}{i}", (file, i), i) for i in order]
        fast, slow = ChunkIndex(chunks), ReferenceChunkIndex(chunks)
        assert (fast.chunks, fast._dim, fast._starts, fast._reach, fast.numel) == \
               (slow.chunks, slow._dim, slow._starts, slow._reach, slow.numel)
        for _ in range(5):
            o = data.draw(st.integers(0, max(row, 1)))
            target = Box((o, 0), (data.draw(st.integers(0, row - o + 1)), cols * 2))
            assert fast.copies(target) == slow.copies(target)
            assert fast.overlapping(target) == slow.overlapping(target)


def test_chunk_index_of_0d_and_few_chunks():
    for chunks in ([ChunkRef(Box((), ()), "f", 0, 0)], [ChunkRef(Box((i,), (1,)), "f", i, i) for i in range(3)]):
        fast, slow = ChunkIndex(iter(chunks)), ReferenceChunkIndex(chunks)
        assert (fast.chunks, fast._dim, fast.numel) == (slow.chunks, slow._dim, slow.numel)


def test_out_of_bounds_target_is_refused_like_before():
    """The first box outside the shape raises the same error, also for a box object that was
    checked in bounds for another shape."""
    entry = TensorEntry("w", "float32", (8, 4), (ChunkRef(Box((0, 0), (8, 4)), "f", 0, 0),), ("w",))
    small = TensorEntry("v", "float32", (4, 4), (ChunkRef(Box((0, 0), (4, 4)), "f", 0, 0),), ("v",))
    inside, outside = Box((0, 0), (4, 4)), Box((4, 0), (4, 4))
    assert_same_tasks(plan_tensor(entry, [(0, inside), (1, outside)], 64),
                      reference_plan_tensor(entry, [(0, inside), (1, outside)], 64))
    for bad in ([(0, inside), (1, outside)], [(0, Box((0,), (4,)))], [(0, Box((0, -1), (4, 4)))]):
        with pytest.raises(CorruptCheckpointError) as want:
            reference_plan_tensor(small, bad, 64)
        with pytest.raises(CorruptCheckpointError) as got:
            plan_tensor(small, bad, 64)
        assert str(got.value) == str(want.value)


@given(st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), min_size=1, max_size=6),
       st.lists(st.integers(0, 50), min_size=8, max_size=8), st.booleans())
def test_owner_picker_equals_the_min_loop(holder_lists, start, exact):
    """Holders that overlap or differ in number (the box-by-box path) and disjoint ones (the table)."""
    boxes = [Box((i,), (n + 1,)) for i, n in enumerate(range(len(holder_lists)))]
    unique = [(b, tuple(sorted(h))) for b, h in zip(boxes, holder_lists)]
    picker = tl.OwnerPicker(8, exact=exact)
    for r, n in enumerate(start):
        picker.loads[r] += n
        picker.py_loads[r] += n
    loads = dict(enumerate(start))
    want = []
    for box, holders in unique:
        owner = min(holders, key=loads.__getitem__)
        loads[owner] += box.numel * 2
        want.append(owner)
    for _ in range(2):  # twice: the loads carry over
        assert picker.pick(picker._make(unique), 2) == want
        want = []
        for box, holders in unique:
            owner = min(holders, key=loads.__getitem__)
            loads[owner] += box.numel * 2
            want.append(owner)


def test_chunk_spec_many_equals_of():
    boxes = [Box((0, 0), (2, 3)), Box((2, 0), (0, 3))]
    assert ChunkSpec.many("k", "float32", (2, 3), boxes, [1, 0]) == [
        ChunkSpec.of("k", "float32", (2, 3), boxes[0], 1), ChunkSpec.of("k", "float32", (2, 3), boxes[1], 0)]
    with pytest.raises(ValueError):
        ChunkSpec.many("k", "float32", (2, 3), boxes, [1])


@given(st.lists(st.sampled_from("abc"), max_size=8), st.sets(st.sampled_from("abcd")))
def test_chunks_of_equals_the_filter(keys, kept):
    chunks = tuple(ChunkSpec.of(k, "float32", (1,), Box((0,), (1,)), 0) for k in keys)
    assert tl.chunks_of(chunks, kept) == tuple(c for c in chunks if c.key in kept)


def test_chunk_index_layout_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(copy_tasks, "_INDEX_LAYOUT_CHUNKS", 40)
    monkeypatch.setattr(copy_tasks, "_INDEX_LAYOUTS", {})
    monkeypatch.setattr(copy_tasks, "_index_layout_held", [0])
    for n in range(9, 30):
        chunks = [ChunkRef(Box((i,), (1,)), "f", i, i) for i in reversed(range(n))]
        assert ChunkIndex(chunks).chunks == ReferenceChunkIndex(chunks).chunks
        assert copy_tasks._index_layout_held[0] <= 40
        assert sum(len(k[0]) for k in copy_tasks._INDEX_LAYOUTS) == copy_tasks._index_layout_held[0]
