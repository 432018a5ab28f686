"""Plans are values: pure tests of piece splitting and copy planning, no disk."""

from __future__ import annotations

import math

import hypothesis.strategies as st
from hypothesis import given, settings

from converter.plan.copy_tasks import plan_copies, plan_tensor, split_pieces
from formats.base import Box, ChunkRef, TensorEntry, full_box


def _covers_exactly(box: Box, parts: list[Box]) -> bool:
    seen = set()
    for p in parts:
        assert box.contains(p)
        for idx in _cells(p):
            assert idx not in seen
            seen.add(idx)
    return len(seen) == box.numel


def _cells(b: Box):
    ranges = [range(o, o + s) for o, s in zip(b.offsets, b.sizes)]
    if not ranges:
        yield ()
        return
    import itertools

    yield from itertools.product(*ranges)


@st.composite
def boxes(draw, max_dims=3, max_size=6):
    ndim = draw(st.integers(0, max_dims))
    sizes = tuple(draw(st.integers(0, max_size)) for _ in range(ndim))
    offsets = tuple(draw(st.integers(0, 4)) for _ in range(ndim))
    return Box(offsets, sizes)


@given(boxes(), st.integers(1, 8), st.integers(1, 200))
@settings(max_examples=200, deadline=None)
def test_pieces_cover_box_once_and_are_c_order_contiguous(box, itemsize, piece_bytes):
    pieces = split_pieces(box, itemsize, piece_bytes)
    assert _covers_exactly(box, pieces)
    for p in pieces:
        assert p.numel * itemsize <= max(piece_bytes, itemsize) or p.numel == 0
        # contiguous in C order: all dims after the first non-1 dim are full
        first = next((d for d, s in enumerate(p.sizes) if s != 1), p.ndim)
        assert p.sizes[first + 1 :] == box.sizes[first + 1 :]
    # pieces come in C order: their first cells are increasing
    starts = [p.offsets for p in pieces if p.numel]
    assert starts == sorted(starts)


def test_plan_copies_intersects_fsdp_chunks_with_a_target():
    chunks = [ChunkRef(Box((r * 13, 0), (min(13, 50 - r * 13), 8)), f"__{r}_0.distcp", r, r) for r in range(4)]
    copies = plan_copies(chunks, Box((10, 0), (20, 8)))
    assert [(c.src.rank, c.region.offsets, c.region.sizes) for c in copies] == [
        (0, (10, 0), (3, 8)), (1, (13, 0), (13, 8)), (2, (26, 0), (4, 8))]


@given(st.integers(1, 40), st.integers(1, 5), st.integers(1, 6), st.integers(1, 6), st.integers(4, 400))
@settings(max_examples=100, deadline=None)
def test_plan_tensor_fills_every_target_exactly(rows, cols, n_src, n_dst, piece_bytes):
    def chunked(n):
        step = math.ceil(rows / n)
        return [Box((o, 0), (min(step, rows - o), cols)) for o in range(0, rows, step)]

    src = tuple(ChunkRef(b, f"f{i}", i, i) for i, b in enumerate(chunked(n_src)))
    entry = TensorEntry("w", "float32", (rows, cols), src, ("model", "w"))
    tasks = plan_tensor(entry, list(enumerate(chunked(n_dst))), piece_bytes)
    for t in tasks:
        assert _covers_exactly(t.box, [p.box for p in t.pieces])
        for p in t.pieces:
            assert _covers_exactly(p.box, [c.region for c in p.copies])


def test_zero_dim_tensor_plans_one_copy():
    entry = TensorEntry("step", "float32", (), (ChunkRef(Box((), ()), "f", 0, 0),), ("optim", "state", "w", "step"))
    [task] = plan_tensor(entry, [("c", full_box(()))], 1 << 20)
    assert len(task.pieces) == 1 and len(task.pieces[0].copies) == 1


@st.composite
def partitions(draw, max_dims=3, max_size=12):
    """A random shape and a random guillotine partition of it into disjoint boxes (general boxes,
    not a grid), plus a few empty chunks; the chunks come shuffled."""
    ndim = draw(st.integers(1, max_dims))
    shape = tuple(draw(st.integers(1, max_size)) for _ in range(ndim))
    parts, todo = [], [full_box(shape)]
    while todo:
        box = todo.pop()
        d = draw(st.integers(0, ndim - 1))
        if box.sizes[d] > 1 and len(parts) + len(todo) < 40 and draw(st.booleans()):
            cut = draw(st.integers(1, box.sizes[d] - 1))
            lo = Box(box.offsets, box.sizes[:d] + (cut,) + box.sizes[d + 1 :])
            hi = Box(box.offsets[:d] + (box.offsets[d] + cut,) + box.offsets[d + 1 :],
                     box.sizes[:d] + (box.sizes[d] - cut,) + box.sizes[d + 1 :])
            todo += [lo, hi]
        else:
            parts.append(box)
    parts += [Box(tuple(shape[:1]) + (0,) * (ndim - 1), (0,) + shape[1:])] * draw(st.integers(0, 2))
    order = draw(st.permutations(range(len(parts))))
    return shape, [parts[i] for i in order]


@given(partitions(), st.integers(0, 10), st.data())
@settings(max_examples=300, deadline=None)
def test_chunk_index_finds_what_the_straightforward_scan_finds(part, scan_limit, data):
    """The per-tensor index (sorted along one dim, windowed) against intersecting every chunk."""
    from converter.plan import copy_tasks as plan

    shape, parts = part
    chunks = [ChunkRef(b, f"f{i}", i, i) for i, b in enumerate(parts)]
    saved, plan._SCAN_CHUNKS = plan._SCAN_CHUNKS, scan_limit  # index small tensors too
    try:
        index = plan.ChunkIndex(chunks)
    finally:
        plan._SCAN_CHUNKS = saved
    for _ in range(5):
        offs = tuple(data.draw(st.integers(0, n)) for n in shape)
        sizes = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, offs))
        target = Box(offs, sizes)
        scan = {(c.locator, r) for c in chunks if c.box.numel
                for r in [c.box.intersect(target)] if r is not None and r.numel}
        found = {(c.src.locator, c.region) for c in index.copies(target)}
        assert found == scan
        assert {c.locator for c in index.overlapping(target)} == {loc for loc, _ in scan}
        if target.numel:
            assert sum(r.numel for _, r in found) == target.numel


def test_plan_tensor_refuses_sources_that_do_not_cover_the_tensor():
    import pytest

    from formats.errors import CorruptCheckpointError

    src = (ChunkRef(Box((0, 0), (4, 8)), "f0", 0, 0), ChunkRef(Box((6, 0), (4, 8)), "f1", 1, 1))
    entry = TensorEntry("w", "float32", (10, 8), src, ("model", "w"))
    with pytest.raises(CorruptCheckpointError, match="2 of 80|64 of 80"):
        plan_tensor(entry, [("t", full_box((10, 8)))], 1 << 20)
