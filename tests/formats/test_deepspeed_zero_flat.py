"""formats/deepspeed_zero/flat.py: flat ranges as boxes, and DeepSpeed's partition arithmetic,
against numpy on random shapes and against DeepSpeed's own formulas (stage_1_and_2.py, stage3.py)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from formats.deepspeed_zero.flat import flat_boxes, zero3_pieces, zero12_pieces, zero12_shortfall

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)


@settings(max_examples=300, deadline=None)
@given(shapes, st.data())
def test_flat_boxes_cover_exactly_the_range_each_one_contiguous(shape, data):
    """The boxes of ``[start, stop)`` hold exactly those flat elements, in order, each box one
    contiguous run starting at its reported flat index; at most 2*ndim - 1 boxes."""
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    flat = np.arange(n).reshape(shape)
    boxes = flat_boxes(shape, start, stop)
    got = []
    for box, first in boxes:
        block = flat[box.slices()].reshape(-1)
        assert block.size and block[0] == first
        assert np.array_equal(block, np.arange(first, first + block.size))  # one contiguous run
        got.extend(block.tolist())
    assert got == list(range(start, stop))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def _deepspeed_zero12(numels, paddings, world):
    """DeepSpeed's ZeRO-1/2 layout, as stage_1_and_2.py builds it: params (with their alignment
    paddings) in one flat buffer padded to 2*world, equal partitions; saved without the tail."""
    flat = []
    for i, n in enumerate(numels):
        flat += [(i, e) for e in range(n)] + [None] * paddings[i]
    flat += [None] * ((-len(flat)) % (2 * world))
    size = len(flat) // world
    parts = [flat[r * size:(r + 1) * size] for r in range(world)]
    end = max(j for j, x in enumerate(flat) if x is not None) + 1 if any(x is not None for x in flat) else 0
    return [p[:max(0, min(size, end - r * size))] for r, p in enumerate(parts)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(1, 5), st.data())
def test_zero12_pieces_find_every_element_where_deepspeed_put_it(numels, world, data):
    paddings = [data.draw(st.integers(0, 3)) for _ in numels[:-1]] + [0]
    parts = _deepspeed_zero12(numels, paddings, world)
    lengths = [len(p) for p in parts]
    assert zero12_shortfall(numels, paddings, lengths) is None
    for i, pieces in enumerate(zero12_pieces(numels, paddings, lengths)):
        found = [parts[p.rank][p.offset + k] for p in pieces for k in range(p.hi - p.lo)]
        assert found == [(i, e) for e in range(numels[i])]
        assert [p.lo for p in pieces] == sorted(p.lo for p in pieces)


def test_zero12_shortfall_names_the_rank_missing_elements():
    assert zero12_shortfall([10, 6], None, [8, 8]) is None
    assert zero12_shortfall([10, 6], None, [8, 7]) == 1  # rank 1 cut short
    assert zero12_shortfall([10, 6], None, [8, 9]) == 1  # longer than rank 0's partition
    assert zero12_shortfall([10, 6], None, [8]) == 1  # a rank's file missing
    assert zero12_shortfall([4], None, [0, 0]) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 11), min_size=1, max_size=6), st.integers(1, 5))
def test_zero3_pieces_find_every_element_where_deepspeed_put_it(numels, world):
    """stage3.py: each parameter padded to world * ceil(numel / world), rank r holding the r-th
    part; a rank's flat buffer of the sub group is its parts, parameter after parameter."""
    flats = [[] for _ in range(world)]
    for i, n in enumerate(numels):
        part = -(-n // world)
        padded = [(i, e) for e in range(n)] + [None] * (part * world - n)
        for r in range(world):
            flats[r] += padded[r * part:(r + 1) * part]
    pieces, length = zero3_pieces(numels, world)
    assert all(len(f) == length for f in flats)
    for i, ps in enumerate(pieces):
        found = [flats[p.rank][p.offset + k] for p in ps for k in range(p.hi - p.lo)]
        assert found == [(i, e) for e in range(numels[i])]
