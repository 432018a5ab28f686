"""Pure planning: intersect source chunks with target boxes into copy items.

A plan is plain data. Each :class:`WriteTask` fills one target chunk (a zarr chunk, a DCP rank's
chunk, an HF tensor) and is written whole, by one writer. Its :class:`Piece` list splits the
target into C-order contiguous parts of bounded size, so a target of any size streams through a
bounded buffer; each piece lists the :class:`CopyItem` regions to read from source chunks.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, groupby, repeat
from operator import attrgetter, itemgetter
from typing import Any

from formats.base import Box, ChunkRef, TensorEntry
from formats.dtypes import by_name
from formats.errors import CorruptCheckpointError
from formats.universal.plan import DEFAULT_BACKEND, StorePlan, plan_store


@dataclass(frozen=True, slots=True)
class CopyItem:
    """Copy ``region`` (global coordinates) from source chunk ``src``."""

    src: ChunkRef
    region: Box


@dataclass(frozen=True, slots=True)
class Piece:
    """A C-order contiguous part of a target box and the copies that fill it exactly."""

    box: Box
    copies: tuple[CopyItem, ...]


@dataclass(frozen=True, slots=True)
class WriteTask:
    """Fill one target chunk ``target`` (sink specific id) of tensor ``key`` piece by piece.

    ``pieces`` is a tuple, or a :class:`PlannedPieces` that computes them when iterated (plans of
    millions of chunks stay small; each rank computes only the pieces of the tasks it runs).
    """

    key: str
    dtype: str
    target: Hashable
    box: Box
    pieces: Sequence[Piece]

    @property
    def nbytes(self) -> int:
        return self.box.numel * by_name(self.dtype).itemsize

    @property
    def max_piece_bytes(self) -> int:
        size = by_name(self.dtype).itemsize
        pieces = self.pieces
        if isinstance(pieces, PlannedPieces):
            return pieces.max_numel * size
        return max((p.box.numel * size for p in pieces), default=0)


def _split_dim(box: Box, itemsize: int, piece_bytes: int) -> tuple[int, int]:
    """(the dim split into ranges, the range length) of :func:`split_pieces`."""
    sizes = box.sizes
    for d in range(box.ndim):
        inner = math.prod(sizes[d + 1 :]) * itemsize
        if inner <= piece_bytes or d == box.ndim - 1:
            return d, max(1, piece_bytes // max(1, inner))
    raise AssertionError("unreachable")


def split_pieces_first(box: Box, itemsize: int, piece_bytes: int) -> Box:
    """The first (and largest) piece :func:`split_pieces` gives for a non-empty box of 1+ dims."""
    d, step = _split_dim(box, itemsize, piece_bytes)
    sizes = box.sizes
    return Box(box.offsets, (1,) * d + (min(step, sizes[d]),) + sizes[d + 1 :])


def split_pieces(box: Box, itemsize: int, piece_bytes: int) -> list[Box]:
    """Split ``box`` into C-order contiguous sub-boxes of at most ``piece_bytes`` (>= 1 element).

    Walks the dims outermost first: the first dim whose trailing block fits the budget is split
    into ranges; every dim before it is split into single indices.
    """
    if box.ndim == 0 or box.numel == 0:
        return [box]
    sizes = box.sizes
    d, step = _split_dim(box, itemsize, piece_bytes)
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


#: Tensors with at most this many source chunks are scanned, not indexed.
_SCAN_CHUNKS = 8


class ChunkIndex:
    """The source chunks of one tensor, searchable by box in O(log n + overlaps).

    Chunks are sorted by their offset along one split dim (the dim with the most distinct
    offsets: dim 0 for FSDP, dim 0 or 1 for 2-D grids). A query keeps the chunks whose start lies in
    ``(lo - longest extent, hi)`` along that dim and intersects them with the target; for regular
    grids that window holds exactly the chunks the target meets along the split dim. Only non-empty
    chunks are kept (and the single chunk of a 0-d tensor). Sources must be disjoint.
    """

    __slots__ = ("chunks", "_dim", "_starts", "_reach", "_numel")

    def __init__(self, chunks: Iterable[ChunkRef]) -> None:
        chunks = chunks if isinstance(chunks, (list, tuple)) else list(chunks)
        key = (tuple(map(_CHUNK_OFFSETS, chunks)), tuple(map(_CHUNK_SIZES, chunks)))  # C-level loops
        layout = _INDEX_LAYOUTS.get(key)
        if layout is None:
            layout = _index_layout(*key)
            _remember_layout(key, layout)
        order, self._dim, self._starts, self._reach, self._numel = layout
        self.chunks: list[ChunkRef] = list(map(chunks.__getitem__, order))

    @property
    def numel(self) -> int:
        """Elements the chunks hold (the tensor's when they cover it exactly)."""
        return self._numel

    def candidates(self, target: Box) -> Sequence[ChunkRef]:
        """Chunks that may meet ``target`` (a superset of those that do, in index order)."""
        d = self._dim
        if d is None or target.ndim != len(target.offsets) or target.ndim <= d:
            return self.chunks
        lo, hi = target.offsets[d], target.offsets[d] + target.sizes[d]
        i = bisect.bisect_right(self._starts, lo - self._reach)
        j = bisect.bisect_left(self._starts, hi, lo=i)
        return self.chunks[i:j]

    def overlapping(self, target: Box) -> list[ChunkRef]:
        """The chunks that share an element with ``target`` (those :meth:`copies` reads from)."""
        return [chunk for chunk in self.candidates(target) if chunk.box.overlaps(target)]

    def copies(self, target: Box) -> tuple[CopyItem, ...]:
        """The regions of the chunks that fill ``target``."""
        items = []
        for chunk in self.candidates(target):
            region = chunk.box.intersect(target)
            if region is not None and region.numel:
                items.append(CopyItem(chunk, region))
        return tuple(items)


#: :func:`_index_layout` by source boxes (every chunk's offsets, every chunk's sizes): a model's
#: tensors repeat a few layouts (every layer's, and a parameter's optimizer states). Bounded: it is
#: cleared before it would hold more than ``_INDEX_LAYOUT_CHUNKS`` chunks' boxes in all.
_INDEX_LAYOUTS: dict[tuple[tuple, tuple], tuple] = {}
_INDEX_LAYOUT_CHUNKS = 1 << 20
_index_layout_held = [0]  # chunks' boxes held by _INDEX_LAYOUTS


def _remember_layout(key: tuple[tuple, tuple], layout: tuple) -> None:
    n = len(key[0])
    if n > _INDEX_LAYOUT_CHUNKS:
        return
    if _index_layout_held[0] + n > _INDEX_LAYOUT_CHUNKS:
        _INDEX_LAYOUTS.clear()
        _index_layout_held[0] = 0
    _INDEX_LAYOUTS[key] = layout
    _index_layout_held[0] += n


def _index_layout(offsets: tuple[tuple[int, ...], ...], sizes: tuple[tuple[int, ...], ...]
                  ) -> tuple[list[int], int | None, list[int], int, int]:
    """What a :class:`ChunkIndex` keeps of chunks with these boxes: (the positions of the chunks it
    keeps, in its order; the split dim; the chunks' starts along it; the longest extent; the
    elements they hold). Only non-empty chunks are kept (and the single chunk of a 0-d tensor),
    sorted (stably) by their offset along the dim with the most distinct offsets."""
    live = list(compress(range(len(sizes)), map(all, sizes)))  # all() of int sizes: none is 0
    numel = sum(map(math.prod, sizes))
    if not (len(live) > _SCAN_CHUNKS and len(sizes[live[0]])):
        return live, None, [], 0, numel
    ndim = len(sizes[live[0]])
    live_offsets = list(map(offsets.__getitem__, live))
    dim = max(range(ndim), key=lambda d: (len(set(map(itemgetter(d), live_offsets))), -d))
    starts = list(map(itemgetter(dim), live_offsets))
    order = sorted(range(len(live)), key=starts.__getitem__)  # stable, as sorting the chunks
    reach = max(map(itemgetter(dim), map(sizes.__getitem__, live)))
    return list(map(live.__getitem__, order)), dim, list(map(starts.__getitem__, order)), reach, numel


def plan_copies(src_chunks: Sequence[ChunkRef] | ChunkIndex, target: Box) -> tuple[CopyItem, ...]:
    """The regions of ``src_chunks`` that fill ``target`` (sources are disjoint)."""
    index = src_chunks if isinstance(src_chunks, ChunkIndex) else ChunkIndex(src_chunks)
    return index.copies(target)


class _PieceSource:
    """What the pieces of every target box of one tensor are computed from (shared by its
    :class:`PlannedPieces`)."""

    __slots__ = ("index", "itemsize", "piece_bytes", "key")

    def __init__(self, index: ChunkIndex, itemsize: int, piece_bytes: int, key: str) -> None:
        self.index, self.itemsize, self.piece_bytes, self.key = index, itemsize, piece_bytes, key


class PlannedPieces(Sequence[Piece]):
    """The pieces of one target box, computed from a :class:`ChunkIndex` each time they are
    iterated (a plan holds one of these per task instead of every piece and copy)."""

    __slots__ = ("_src", "_box")

    def __init__(self, index: ChunkIndex, box: Box, itemsize: int, piece_bytes: int, key: str) -> None:
        self._src, self._box = _PieceSource(index, itemsize, piece_bytes, key), box

    def _boxes(self) -> list[Box]:
        return split_pieces(self._box, self._src.itemsize, self._src.piece_bytes)

    def __iter__(self) -> Iterator[Piece]:
        for piece_box in self._boxes():
            copies = self._src.index.copies(piece_box)
            if sum(c.region.numel for c in copies) != piece_box.numel:
                raise CorruptCheckpointError(
                    f"key {self._src.key!r}: region {piece_box.to_json()} is not covered exactly by the source chunks"
                )
            yield Piece(piece_box, copies)

    def __len__(self) -> int:
        return len(self._boxes())

    def __getitem__(self, i):  # type: ignore[override]
        return tuple(self)[i]

    def source_files(self) -> set[str]:
        """The files of the source chunks this box is read from (one index query, no pieces)."""
        return {c.file for c in self._src.index.overlapping(self._box)}

    def source_chunks(self) -> list[ChunkRef]:
        """The source chunks this box is read from (one index query, no pieces)."""
        return list(self._src.index.overlapping(self._box))

    @property
    def max_numel(self) -> int:
        """Elements of the largest piece (the first: only the last piece along the split is short)."""
        box = self._box
        if box.ndim == 0 or box.numel == 0:
            return box.numel
        return split_pieces_first(box, self._src.itemsize, self._src.piece_bytes).numel

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PlannedPieces, tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._box, self._src.itemsize, self._src.piece_bytes, self._src.key))

    def __repr__(self) -> str:
        return f"PlannedPieces({self._src.key!r}, {self._box.to_json()}, piece_bytes={self._src.piece_bytes})"


#: Target boxes already checked to lie inside a shape (layouts repeat a few boxes many times),
#: by identity: ``id(box) -> box`` (the value keeps the box alive, so its id is not reused).
_IN_BOUNDS: dict[tuple[int, ...], dict[int, Box]] = {}


def _check_cover(entry: TensorEntry, index: ChunkIndex) -> None:
    """Disjoint source chunks fill every target box exactly iff they hold the tensor's elements."""
    if index.numel != entry.numel:
        raise CorruptCheckpointError(
            f"key {entry.key!r}: the source chunks hold {index.numel} of {entry.numel} elements; "
            "they do not cover the tensor exactly"
        )


def plan_tensor(
    entry: TensorEntry,
    targets: Iterable[tuple[Hashable, Box]],
    piece_bytes: int,
) -> list[WriteTask]:
    """One write task per target box of ``entry``; its pieces are computed when iterated, from an
    index of the source chunks built once per tensor."""
    targets = targets if isinstance(targets, (list, tuple)) else list(targets)
    return plan_boxes(entry, list(map(_FIRST, targets)), list(map(_SECOND, targets)), piece_bytes)


def plan_boxes(entry: TensorEntry, ids: Sequence[Hashable], boxes: Sequence[Box], piece_bytes: int) -> list[WriteTask]:
    """:func:`plan_tensor` with the targets as two columns: target ``ids[i]`` fills ``boxes[i]``
    (no pair per target: layouts have millions)."""
    if len(ids) != len(boxes):
        raise ValueError(f"{len(ids)} target ids but {len(boxes)} boxes")
    itemsize = by_name(entry.dtype).itemsize
    index = ChunkIndex(entry.chunks)
    _check_cover(entry, index)
    shape = tuple(entry.shape)
    checked = _IN_BOUNDS.setdefault(shape, {}) if len(_IN_BOUNDS) < 4096 else {}
    if not all(map(checked.__contains__, map(id, boxes))):  # C-level: most boxes were seen before
        _check_in_bounds(entry.key, shape, boxes, checked)
    # one PlannedPieces and one WriteTask per box, built by C-level iteration (millions at scale)
    n = len(boxes)
    key = entry.key
    pieces = list(map(_new, repeat(PlannedPieces, n)))
    deque(map(_PP_SRC, pieces, repeat(_PieceSource(index, itemsize, piece_bytes, key), n)), 0)
    deque(map(_PP_BOX, pieces, boxes), 0)
    tasks = list(map(_new, repeat(WriteTask, n)))
    for setter, values in ((_WT_KEY, repeat(key, n)), (_WT_DTYPE, repeat(entry.dtype, n)), (_WT_TARGET, ids),
                           (_WT_BOX, boxes), (_WT_PIECES, pieces)):
        deque(map(setter, tasks, values), 0)
    return tasks


def _check_in_bounds(key: str, shape: tuple[int, ...], boxes: Iterable[Box], checked: dict[int, Box]) -> None:
    """Raise for the first of ``boxes`` outside ``shape``; remember the boxes inside in ``checked``."""
    for box in boxes:
        if id(box) in checked:
            continue
        if len(box.offsets) != len(shape) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(box.offsets, box.sizes, shape)
        ):
            raise CorruptCheckpointError(
                f"key {key!r}: target {box.to_json()} lies outside the tensor's shape {list(shape)}"
            )
        if len(checked) < 1 << 16:
            checked[id(box)] = box


_new = object.__new__
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_CHUNK_OFFSETS, _CHUNK_SIZES = attrgetter("box.offsets"), attrgetter("box.sizes")
_PP_SRC, _PP_BOX = PlannedPieces._src.__set__, PlannedPieces._box.__set__
_WT_KEY, _WT_DTYPE, _WT_TARGET = WriteTask.key.__set__, WriteTask.dtype.__set__, WriteTask.target.__set__
_WT_BOX, _WT_PIECES = WriteTask.box.__set__, WriteTask.pieces.__set__


def universal_chunk_bytes(options: Any) -> int:
    """The default zarr chunk size for ``options`` (a :class:`converter.config.RunOptions`):
    ``knobs.UNIVERSAL_CHUNK_BYTES``, less when the memory budget gives each worker less than two
    chunks (a chunk is filled whole in one buffer)."""
    from converter import knobs

    return max(1 << 16, min(knobs.UNIVERSAL_CHUNK_BYTES, options.memory_budget // (2 * options.workers)))


def plan_universal(tensors: Mapping[str, TensorEntry], chunk_bytes: int, backend: str = DEFAULT_BACKEND) -> StorePlan:
    """The universal store's layout for these tensors (an index's ``tensors``; pure: no I/O)."""
    return plan_store(((k, e.dtype, tuple(e.shape)) for k, e in tensors.items()), chunk_bytes, backend)


def store_tasks(tensors: Mapping[str, TensorEntry], store: StorePlan, piece_bytes: int) -> list[WriteTask]:
    """One write task per chunk of every tensor's array in the universal store ``store`` (the
    layout :func:`formats.universal.plan_store` planned); the dry run and the run alike."""
    tasks: list[WriteTask] = []
    for key, entry in tensors.items():
        tasks += plan_tensor(entry, store.arrays[key].grid(), piece_bytes=piece_bytes)
    return tasks


def target_nbytes(task: WriteTask) -> int:
    """Bytes ``task`` writes: its box in the dtype of its target (a DCP chunk; ``--dtype`` casts parameters;
    ``task.nbytes`` counts the source dtype, which is what the reads and the memory budget need)."""
    return task.box.numel * _itemsize(task.target.dtype)


def total_target_nbytes(tasks: Iterable[WriteTask]) -> int:
    """``sum(target_nbytes(t) for t in tasks)``, in C-level loops (a plan has millions of tasks)."""
    total = 0
    for dtype, group in groupby(tasks, _TARGET_DTYPE):  # runs of one target dtype (a key's tasks)
        total += _itemsize(dtype) * sum(map(math.prod, map(_BOX_SIZES, group)))
    return total


_BOX_SIZES, _TARGET_DTYPE = attrgetter("box.sizes"), attrgetter("target.dtype")


@functools.lru_cache(maxsize=64)
def _itemsize(dtype: str) -> int:
    return by_name(dtype).itemsize


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
