"""Where a parameter's elements lie in DeepSpeed's flat ZeRO partitions (pure arithmetic).

ZeRO keeps each parameter flattened (C order) inside 1-D buffers cut across the data-parallel
ranks; a rank's piece of a parameter is a range of its flat elements, which is a box only when
it starts and ends on whole rows. :func:`flat_boxes` cuts any range into at most ``2 * ndim - 1``
boxes, each one contiguous run of the flat buffer, so a piece reads as ordinary chunks.

* ZeRO-1/2 (:func:`zero12_pieces`, also the BF16 optimizer): per param group, the parameters of
  ``param_shapes`` one after another (with ``param_alignment_paddings`` after each) in one flat
  buffer, split into equal partitions of ``P`` elements; rank ``r`` holds ``[r*P, r*P + len_r)``
  (the alignment padding at the end of the last partitions may be cut off when saved).
* ZeRO-3 (:func:`zero3_pieces`): per sub group, each parameter is cut on its own into ``W``
  partitions of ``ceil(numel / W)`` elements (the last padded); rank ``r``'s flat buffer holds
  its partition of every parameter of the sub group, one after another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from formats.base import Box

Shape = tuple[int, ...]


def flat_boxes(shape: Shape, start: int, stop: int) -> list[tuple[Box, int]]:
    """The boxes covering flat elements ``[start, stop)`` of a C-order tensor of ``shape``, in
    order, each with the flat index of its first element (each box is one contiguous run)."""
    if start >= stop:
        return []
    if not shape:
        return [(Box((), ()), 0)]
    inner = math.prod(shape[1:])
    out: list[tuple[Box, int]] = []
    rest = (0,) * (len(shape) - 1)
    pos = start
    if pos % inner:  # a partial first row
        row = pos // inner
        end = min(stop, (row + 1) * inner)
        out += _in_row(shape, row, pos - row * inner, end - row * inner)
        pos = end
    if stop - pos >= inner:  # whole rows
        rows = (stop - pos) // inner
        out.append((Box((pos // inner, *rest), (rows, *shape[1:])), pos))
        pos += rows * inner
    if pos < stop:  # a partial last row
        out += _in_row(shape, pos // inner, 0, stop - pos)
    return out


def _in_row(shape: Shape, row: int, start: int, stop: int) -> list[tuple[Box, int]]:
    base = row * math.prod(shape[1:])
    return [(Box((row, *b.offsets), (1, *b.sizes)), base + f) for b, f in flat_boxes(shape[1:], start, stop)]


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[lo, hi)`` of a parameter (flat, C order) held by ``rank`` at element
    ``offset`` of its flat buffer."""

    rank: int
    offset: int
    lo: int
    hi: int


def group_offsets(numels: Sequence[int], paddings: Sequence[int] | None) -> tuple[list[int], int]:
    """Each parameter's start in a ZeRO-1/2 group's flat buffer, and where the last one ends
    (``paddings``: DeepSpeed's ``param_alignment_paddings`` of the group, or None)."""
    starts, pos = [], 0
    for i, n in enumerate(numels):
        starts.append(pos)
        pos += n + (paddings[i] if paddings is not None else 0)
    end = starts[-1] + numels[-1] if numels else 0
    return starts, end


def zero12_pieces(numels: Sequence[int], paddings: Sequence[int] | None, lengths: Sequence[int]) -> list[list[Piece]]:
    """Per parameter of a ZeRO-1/2 group, its pieces on the ranks whose saved flat partitions
    have ``lengths`` (the partition size is rank 0's: only partitions past the end are short)."""
    starts, _ = group_offsets(numels, paddings)
    size = lengths[0] if lengths else 0
    out = []
    for start, n in zip(starts, numels):
        pieces = []
        if n and size:
            for rank in range(start // size, (start + n - 1) // size + 1):
                lo, hi = max(start, rank * size), min(start + n, (rank + 1) * size)
                pieces.append(Piece(rank, lo - rank * size, lo - start, hi - start))
        out.append(pieces)
    return out


def zero12_shortfall(numels: Sequence[int], paddings: Sequence[int] | None, lengths: Sequence[int]) -> int | None:
    """The first rank whose saved partition cannot hold what the group's parameters need there
    (or is longer than rank 0's), None when every rank's partition fits."""
    _, end = group_offsets(numels, paddings)
    size = lengths[0] if lengths else 0
    if end and not size:
        return 0
    for rank, length in enumerate(lengths):
        need = min(size, max(0, end - rank * size))
        if not need <= length <= size:
            return rank
    if size and end > size * len(lengths):
        return len(lengths)
    return None


def zero3_partition(numel: int, world: int) -> int:
    """Elements of each rank's ZeRO-3 partition of a parameter (``ceil(numel / world)``)."""
    return -(-numel // world)


def zero3_pieces(numels: Sequence[int], world: int) -> tuple[list[list[Piece]], int]:
    """Per parameter of a ZeRO-3 sub group, its pieces on each of ``world`` ranks, and the
    length of every rank's flat buffer of the sub group."""
    out, pos = [], 0
    for n in numels:
        part = zero3_partition(n, world)
        pieces = []
        for rank in range(world):
            lo, hi = rank * part, min(n, (rank + 1) * part)
            if lo < hi:
                pieces.append(Piece(rank, pos, lo, hi))
        out.append(pieces)
        pos += part
    return out, pos
