"""Pure planning: intersect source chunks with target boxes into copy items.

A plan is plain data. Each :class:`WriteTask` fills one target chunk (a zarr chunk, a DCP rank's
chunk, an HF tensor) and is written whole, by one writer. Its :class:`Piece` list splits the
target into C-order contiguous parts of bounded size, so a target of any size streams through a
bounded buffer; each piece lists the :class:`CopyItem` regions to read from source chunks.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from formats.base import Box, ChunkRef, TensorEntry
from formats.dtypes import by_name
from formats.errors import CorruptCheckpointError


@dataclass(frozen=True)
class CopyItem:
    """Copy ``region`` (global coordinates) from source chunk ``src``."""

    src: ChunkRef
    region: Box


@dataclass(frozen=True)
class Piece:
    """A C-order contiguous part of a target box and the copies that fill it exactly."""

    box: Box
    copies: tuple[CopyItem, ...]


@dataclass(frozen=True)
class WriteTask:
    """Fill one target chunk ``target`` (sink specific id) of tensor ``key`` piece by piece."""

    key: str
    dtype: str
    target: Hashable
    box: Box
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.box.numel * by_name(self.dtype).itemsize

    @property
    def max_piece_bytes(self) -> int:
        size = by_name(self.dtype).itemsize
        return max((p.box.numel * size for p in self.pieces), default=0)


def split_pieces(box: Box, itemsize: int, piece_bytes: int) -> list[Box]:
    """Split ``box`` into C-order contiguous sub-boxes of at most ``piece_bytes`` (>= 1 element).

    Walks the dims outermost first: the first dim whose trailing block fits the budget is split
    into ranges; every dim before it is split into single indices.
    """
    if box.ndim == 0 or box.numel == 0:
        return [box]
    sizes = box.sizes
    for d in range(box.ndim):
        inner = math.prod(sizes[d + 1 :]) * itemsize
        if inner <= piece_bytes or d == box.ndim - 1:
            step = max(1, piece_bytes // max(1, inner))
            break
    outer = sizes[:d]
    out = []
    for flat in range(math.prod(outer)):
        idx = []
        for n in reversed(outer):
            idx.append(flat % n)
            flat //= n
        idx.reverse()
        for start in range(0, sizes[d], step):
            length = min(step, sizes[d] - start)
            offsets = tuple(o + i for o, i in zip(box.offsets[:d], idx)) + (box.offsets[d] + start,) + box.offsets[d + 1 :]
            out.append(Box(offsets, tuple(1 for _ in idx) + (length,) + sizes[d + 1 :]))
    return out


def plan_copies(src_chunks: Sequence[ChunkRef], target: Box) -> tuple[CopyItem, ...]:
    """The regions of ``src_chunks`` that fill ``target`` (sources are disjoint)."""
    items = []
    for chunk in src_chunks:
        region = chunk.box.intersect(target)
        if region is not None and region.numel:
            items.append(CopyItem(chunk, region))
    return tuple(items)


def plan_tensor(
    entry: TensorEntry,
    targets: Iterable[tuple[Hashable, Box]],
    piece_bytes: int,
) -> list[WriteTask]:
    """One write task per target box of ``entry``, each split into covered pieces."""
    itemsize = by_name(entry.dtype).itemsize
    live_chunks = [c for c in entry.chunks if c.box.numel or not c.box.ndim]
    tasks = []
    for target_id, box in targets:
        pieces = []
        for piece_box in split_pieces(box, itemsize, piece_bytes):
            copies = plan_copies(live_chunks, piece_box)
            if sum(c.region.numel for c in copies) != piece_box.numel:
                raise CorruptCheckpointError(
                    f"key {entry.key!r}: region {piece_box.to_json()} is not covered exactly by the source chunks"
                )
            pieces.append(Piece(piece_box, copies))
        tasks.append(WriteTask(entry.key, entry.dtype, target_id, box, tuple(pieces)))
    return tasks


def describe(tasks: Sequence[WriteTask]) -> str:
    """A printable summary of a plan (for --dry-run)."""
    lines = []
    for t in tasks:
        srcs = sorted({c.src.file for p in t.pieces for c in p.copies})
        lines.append(
            f"{t.key} {t.dtype} target={t.target} box={list(t.box.offsets)}+{list(t.box.sizes)} "
            f"bytes={t.nbytes} pieces={len(t.pieces)} from={','.join(srcs)}"
        )
    return "\n".join(lines)
