"""Streaming statistics of one tensor: read chunk by chunk in bounded slabs, never whole.

Each chunk is read in slabs of at most :data:`converter.knobs.PIECE_BYTES` of float64 (the upcast
size bounds memory, so a bf16 slab holds PIECE_BYTES / 8 elements); per-slab moments are combined
with Chan et al.'s pairwise update in float64.

Conventions: ``min``, ``max``, ``mean`` and ``std`` are over the finite values (NaN and +-Inf are
counted separately); ``std`` is the population standard deviation (``correction=0``); ``zeros``
counts +0.0 and -0.0. Integers keep exact ``min``/``max``; bool is treated as 0/1. Complex tensors
are summarized by magnitude (``of == "abs"``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from typing import TYPE_CHECKING

import numpy as np

import converter.knobs as knobs
from formats.base import Box, CheckpointReader
from formats.dtypes import to_storage_array

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Stats:
    """Summary statistics of one tensor (see the module docstring for the conventions)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    count: int  # elements
    finite: int  # elements that min/max/mean/std cover
    nan: int
    posinf: int
    neginf: int
    zeros: int
    min: float | int | None
    max: float | int | None
    mean: float | None
    std: float | None
    of: str = "value"  # "abs" for complex tensors

    def to_json(self) -> dict:
        """A JSON-able dict (shape as a list)."""
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass
class _Acc:
    """Running moments (Chan's pairwise combine) and counts."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    lo: float | int | None = None
    hi: float | int | None = None
    count: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    zeros: int = 0

    def add(self, x: np.ndarray, lo, hi) -> None:
        """Fold in the finite values ``x`` (float64) with their exact extremes ``lo``/``hi``."""
        n = x.size
        if n == 0:
            return
        mean = float(x.mean())
        m2 = float(np.square(x - mean).sum())
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total
        self.lo = lo if self.lo is None else min(self.lo, lo)
        self.hi = hi if self.hi is None else max(self.hi, hi)


def slabs(box: Box, max_elems: int) -> Iterator[Box]:
    """Sub-boxes of ``box`` in row-major order, each at most ``max_elems`` elements: the copy
    planner's pieces (:func:`converter.plan.copy_tasks.split_pieces`) counted in elements."""
    from converter.plan.copy_tasks import split_pieces

    return iter(split_pieces(box, 1, max_elems))


def _fold(acc: _Acc, t: torch.Tensor) -> None:
    """Fold one slab into ``acc`` (complex slabs by magnitude)."""
    import torch

    if t.is_complex():
        t = t.abs()
    acc.count += t.numel()
    if t.is_floating_point():
        x = t.to(torch.float64).reshape(-1).numpy()
        nan = np.isnan(x)
        acc.nan += int(nan.sum())
        acc.posinf += int(np.count_nonzero(x == np.inf))
        acc.neginf += int(np.count_nonzero(x == -np.inf))
        acc.zeros += int(np.count_nonzero(x == 0))
        fin = x[np.isfinite(x)]
        if fin.size:
            acc.add(fin, float(fin.min()), float(fin.max()))
        return
    a = to_storage_array(t).reshape(-1)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    acc.zeros += int(np.count_nonzero(a == 0))
    if a.size:
        acc.add(a.astype(np.float64), int(a.min()), int(a.max()))


def tensor_stats(reader: CheckpointReader, key: str, piece_bytes: int | None = None) -> Stats:
    """Statistics of tensor ``key``, streamed chunk by chunk in slabs of at most ``piece_bytes``
    (default :data:`converter.knobs.PIECE_BYTES`, measured in float64)."""
    entry = reader.index().tensors[key]
    max_elems = max(1, (piece_bytes or knobs.PIECE_BYTES) // 8)
    acc = _Acc()
    for chunk in entry.chunks:
        if chunk.box.numel == 0:
            continue
        for region in slabs(chunk.box, max_elems):
            _fold(acc, reader.read_region(key, chunk, region))
    std = math.sqrt(acc.m2 / acc.n) if acc.n else None
    return Stats(
        key, entry.dtype, tuple(entry.shape), acc.count, acc.n, acc.nan, acc.posinf, acc.neginf,
        acc.zeros, acc.lo, acc.hi, acc.mean if acc.n else None, std,
        "abs" if entry.dtype.startswith("complex") else "value",
    )
