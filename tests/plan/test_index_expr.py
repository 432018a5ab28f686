"""Index expressions (converter/plan/index_expr.py) against numpy doing the same rearrangements,
and the mapped view reading them region by region from a source split into several chunks.

The oracle: numpy's own reshape / swapaxes / slicing / concatenate / stack on an ``arange`` whose
values are the source's flat indices.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from converter import knobs
from converter.plan import index_expr as ix
from converter.plan.adapter_maps import source_of
from converter.plan.mapped_view import Source, expr_parts
from converter.run.mapped_reader import MappedReader
from formats.base import Box, CheckpointIndex, ChunkRef, TensorEntry, TensorReader
from formats.errors import UnsupportedError


def random_rearrangement(rng: random.Random, shape: tuple[int, ...], key: str = "k", ops: int = 6):
    """(numpy result, expression) of a random sequence of view ops on ``arange(shape)``."""
    a = np.arange(math.prod(shape)).reshape(shape)
    e: ix.Expr = ix.leaf(key, shape)
    for _ in range(rng.randint(1, ops)):
        op, nd = rng.choice(["t", "narrow", "split", "merge", "unsqueeze", "squeeze", "cat"]), a.ndim
        if op == "t" and nd >= 2:
            i, j = rng.sample(range(nd), 2)
            a, e = a.swapaxes(i, j), ix.transpose(e, i, j)
        elif op == "narrow" and nd and a.shape[0]:
            d = rng.randrange(nd)
            if not a.shape[d]:
                continue
            s = rng.randrange(a.shape[d])
            n = rng.randint(0, a.shape[d] - s)
            a, e = np.take(a, range(s, s + n), axis=d), ix.narrow(e, d, s, n)
        elif op in ("split", "merge") and nd and a.size:
            d = rng.randrange(nd)
            n = a.shape[d]
            factors = [f for f in range(2, n) if n % f == 0]
            if op == "split" and factors:
                f = rng.choice(factors)
                new = [*a.shape[:d], f, n // f, *a.shape[d + 1:]]
            elif op == "merge" and d < nd - 1:
                new = [*a.shape[:d], a.shape[d] * a.shape[d + 1], *a.shape[d + 2:]]
            else:
                continue
            try:
                e2 = ix.reshape(e, new)
            except UnsupportedError:  # a merge across a non-contiguous pair: torch would copy
                continue
            a, e = a.reshape(new), e2
        elif op == "unsqueeze":
            d = rng.randrange(nd + 1)
            a, e = np.expand_dims(a, d), ix.unsqueeze(e, d)
        elif op == "squeeze" and 1 in a.shape:
            d = a.shape.index(1)
            a, e = a.squeeze(d), ix.squeeze(e, d)
        elif op == "cat" and nd:
            d = rng.randrange(nd)
            a, e = np.concatenate([a, a], axis=d), ix.cat([e, e], d)
    return a, e


def read_part(view: ix.View, shape, offsets, sizes) -> np.ndarray:
    lo, box, local = ix.source_box(view, shape, offsets, sizes)
    buf = np.arange(math.prod(shape)).reshape(shape)[tuple(slice(o, o + n) for o, n in zip(lo, box))].reshape(-1)
    idx = np.zeros(sizes, dtype=np.int64)
    for t, x in enumerate(local):
        idx += x.reshape([-1 if d == t else 1 for d in range(len(local))])
    return buf[idx]


def test_expressions_equal_numpy():
    rng = random.Random(0)
    checked = 0
    for _ in range(1500):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        want, e = random_rearrangement(rng, shape)
        assert tuple(e.shape) == want.shape
        assert ix.from_json(ix.to_json(e)) == e
        for box, view in expr_parts(e):
            offsets = [rng.randrange(n) if n else 0 for n in box.sizes]
            sizes = [rng.randint(0, n - o) if n else 0 for o, n in zip(offsets, box.sizes)]
            got = read_part(view, shape, offsets, sizes)
            part = want[box.slices()][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            assert got.shape == part.shape and np.array_equal(got, part), (shape, e)
            checked += 1
    assert checked > 1500


class ArrayReader(TensorReader):
    """Source tensors held in memory, each split into row chunks (a stand-in for a sharded save)."""

    def __init__(self, arrays: dict[str, np.ndarray], rows: int):
        self.arrays = arrays
        tensors = {}
        for k, a in arrays.items():
            chunks = tuple(ChunkRef(Box((r, *(0 for _ in a.shape[1:])), (min(rows, a.shape[0] - r), *a.shape[1:])), "f", k)
                           for r in range(0, a.shape[0], rows))
            tensors[k] = TensorEntry(k, "int64", a.shape, chunks, (k,))
        self._index = CheckpointIndex("test", "/", tensors, {})

    def index(self):
        return self._index

    def read_region(self, key, chunk, region):
        assert chunk.box.contains(region)
        return torch.from_numpy(np.ascontiguousarray(self.arrays[key][region.slices()]))


@pytest.mark.parametrize("seed", range(4))
def test_mapped_view_reads_expressions_across_chunks(seed, monkeypatch):
    monkeypatch.setattr(knobs, "QUANT_SLAB_BYTES", 64)  # many slabs per region
    rng = random.Random(seed)
    arrays, sources, wants = {}, {}, {}
    for i in range(12):
        shape = tuple(rng.randint(2, 7) for _ in range(rng.randint(2, 3)))
        key = f"s{i}"
        want, e = random_rearrangement(rng, shape, key)
        arrays[key] = np.arange(math.prod(shape)).reshape(shape) + 1000 * i
        sources[f"t{i}"], wants[f"t{i}"] = source_of(e, {key: shape}), want + 1000 * i
    view = MappedReader(ArrayReader(arrays, rows=2), sources)
    for name, want in wants.items():
        entry = view.index().tensors[name]
        assert tuple(entry.shape) == want.shape
        for c in entry.chunks:
            got = view.read_region(name, c, c.box).numpy()
            assert np.array_equal(got, want[c.box.slices()]), name


def test_simple_forms_are_recognised():
    shapes = {"w": (8, 4), "e": (3, 4, 5), "a": (4, 5), "b": (4, 5)}
    w = ix.leaf("w", shapes["w"])
    assert source_of(w, shapes) == Source("w")
    rope = ix.reshape(ix.transpose(ix.reshape(w, [2, 2, 2, 4]), 1, 2), [8, 4])  # HF's permute
    s = source_of(rope, shapes)
    assert s.key == "w" and s.expr is None and list(s.perm) == [0, 2, 1, 3, 4, 6, 5, 7]
    expert = ix.squeeze(ix.narrow(ix.leaf("e", shapes["e"]), 0, 2, 1), 0)
    assert source_of(expert, shapes) == Source("e", index=2)
    assert source_of(ix.transpose(w, 0, 1), shapes) == Source("w", transpose=True)
    stacked = ix.stack([ix.leaf("a", (4, 5)), ix.leaf("b", (4, 5))], 0)
    assert source_of(stacked, shapes) == Source("", stack=("a", "b"))
    fused = ix.cat([ix.leaf("a", (4, 5)), ix.leaf("b", (4, 5))], 1)
    assert source_of(fused, shapes).expr == fused  # anything else: a general gather


def test_reshapes_torch_copies_are_expressions_too():
    a = np.arange(24).reshape(4, 6)
    e = ix.reshape(ix.transpose(ix.leaf("w", (4, 6)), 0, 1), [24])  # torch copies; still a strided gather
    assert np.array_equal(read_part(e, (4, 6), [0], [24]), a.T.reshape(24))
    e = ix.reshape(ix.leaf("w", (2, 3)), [3, 2])  # contiguous: dims merged, then split
    assert np.array_equal(read_part(e, (2, 3), [0, 0], [3, 2]), np.arange(6).reshape(3, 2))


def test_unstreamable_rearrangements_are_refused():
    with pytest.raises(UnsupportedError, match="cannot stream"):
        ix.reshape(ix.transpose(ix.leaf("w", (2, 3)), 0, 1), [2, 3])  # mixed radix across strides
    with pytest.raises(UnsupportedError, match="cannot stream"):
        ix.reshape(ix.cat([ix.leaf("a", (2, 3)), ix.leaf("b", (2, 3))], 0), [12])
