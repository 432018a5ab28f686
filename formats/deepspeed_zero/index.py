"""The index under construction: tensors as chunks of storages inside the DeepSpeed files.

Every stored tensor is a storage (one zip member of a ``torch.save`` archive, :class:`Slot`); a
chunk's locator is ``(slot, storage offset)`` (elements, C strides of the tensor's shape) or
``(slot, storage offset, strides)`` for a whole tensor saved with other strides; a value held in
memory (a step saved as a number) is ``(-1, index)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from formats.base import Box, ChunkRef, ObjectEntry, TensorEntry, full_box
from formats.dcp.archive import ArchiveTensor, TensorDesc
from formats.dcp.archive_writer import contiguous_strides as c_strides
from formats.deepspeed_zero.files import Parsed
from formats.deepspeed_zero.flat import Piece, flat_boxes
from formats.errors import CorruptCheckpointError

Shape = tuple[int, ...]
VALUE_SLOT = -1


@dataclass(frozen=True, slots=True)
class Slot:
    """One tensor storage: zip member bytes ``[data_start, data_start + nbytes)`` of ``file``
    (``resolved`` False: ``data_start`` is the member's local header, read when first needed)."""

    file: str
    data_start: int
    nbytes: int
    crc: int
    resolved: bool = True
    member: str = ""


@dataclass(frozen=True, slots=True)
class Flat:
    """A saved tensor viewed as a flat run of its storage: ``numel`` elements from ``offset``."""

    slot: int
    offset: int
    numel: int
    dtype: str
    file: str


def is_dense(at: ArchiveTensor) -> bool:
    """True when the tensor's elements are one C-order run of its storage."""
    return all(st == c or s == 1 for s, st, c in zip(at.size, at.stride, c_strides(at.size)))


@dataclass(frozen=True, slots=True)
class Copy:
    """Another stored copy of a tensor the index takes once (a TP-replicated tensor's other TP
    ranks, a tied parameter's later pipeline stages): ``verify`` compares it with the one taken.
    ``who`` / ``of`` name the copy and the one taken, ``why`` says what a difference means."""

    who: str
    of: str
    chunks: tuple[ChunkRef, ...]
    why: str


#: A piece of a parameter and the boxes (with their first flat element) it covers.
Cut = tuple[Piece, tuple[tuple[Box, int], ...]]


def cut(shape: Shape, pieces: Sequence[Piece]) -> list[Cut]:
    """Each piece with the boxes of its flat range of a tensor of ``shape``."""
    return [(p, tuple(flat_boxes(shape, p.lo, p.hi))) for p in pieces]


class IndexBuilder:
    """Collects tensor entries, their storages and the objects of a checkpoint."""

    def __init__(self) -> None:
        self.slots: list[Slot] = []
        self._slot_of: dict[tuple[str, str], int] = {}
        self.tensors: dict[str, TensorEntry] = {}
        self.values: list[np.ndarray] = []
        self.objects: dict[str, ObjectEntry] = {}
        self.object_values: dict[str, Any] = {}

    def fork(self) -> IndexBuilder:
        """A builder of its own tensors and objects over this one's storages and values (one
        tensor-parallel rank's, joined later: :mod:`.tp`)."""
        other = IndexBuilder()
        other.slots, other._slot_of, other.values = self.slots, self._slot_of, self.values
        return other

    # -- storages ------------------------------------------------------------------------------

    def stored(self, parsed: Parsed, desc: Any, what: str) -> tuple[int, ArchiveTensor]:
        """The slot of a tensor description of ``parsed`` and its stored view."""
        at = parsed.tensor(desc, what)
        member = parsed.storage_key(desc)
        slot = self._slot_of.get((parsed.name, member))
        if slot is None:
            slot = self._slot_of[(parsed.name, member)] = len(self.slots)
            local = parsed.entries[member].local
            self.slots.append(Slot(parsed.name, at.data_start, at.data_length, at.data_crc, local, member))
        return slot, at

    def flat(self, parsed: Parsed, desc: Any, what: str) -> Flat:
        """A saved tensor that must be one dense run (a flat partition)."""
        if not isinstance(desc, TensorDesc):
            raise CorruptCheckpointError(f"{parsed.path}: {what} holds {type(desc).__name__}, not a tensor; the file "
                                         "is damaged or from an unsupported DeepSpeed version")
        slot, at = self.stored(parsed, desc, what)
        if not is_dense(at):
            raise CorruptCheckpointError(f"{parsed.path}: {what} is a strided view, not a flat partition")
        return Flat(slot, at.storage_offset, math.prod(at.size), at.dtype, parsed.name)

    # -- tensors -------------------------------------------------------------------------------

    def add_whole(self, key: str, path: tuple, parsed: Parsed, desc: Any, what: str,
                  shape: Shape | None = None) -> None:
        """A tensor saved whole (any strides); ``shape``: read a dense one with this shape instead."""
        slot, at = self.stored(parsed, desc, what)
        if shape is not None and (math.prod(shape) != math.prod(at.size) or not is_dense(at)):
            raise CorruptCheckpointError(f"{parsed.path}: {what} is {list(at.size)}, expected {list(shape)}")
        shape = at.size if shape is None else tuple(shape)
        loc = (slot, at.storage_offset) if shape != at.size or is_dense(at) else (slot, at.storage_offset, at.stride)
        chunk = ChunkRef(full_box(shape), parsed.name, loc)
        self.tensors[key] = TensorEntry(key, at.dtype, shape, (chunk,), path)

    def add_pieces(self, key: str, path: tuple, dtype: str, shape: Shape,
                   pieces: Sequence[tuple[Piece, Flat]], where: str) -> None:
        """A tensor cut into flat pieces (``Piece`` of each rank, in that rank's ``Flat``)."""
        self.add_cut(key, path, dtype, shape, cut(shape, [p for p, _ in pieces]), [f for _, f in pieces], where)

    def add_cut(self, key: str, path: tuple, dtype: str, shape: Shape, cuts: Sequence[Cut],
                flats: Sequence[Flat], where: str) -> None:
        """A tensor cut into flat pieces whose boxes are known (:func:`cut`; a parameter's boxes
        are shared by its master and every optimizer state), piece ``i`` in ``flats[i]``."""
        chunks = []
        for (piece, boxes), flat in zip(cuts, flats):
            if flat.dtype != dtype:
                raise CorruptCheckpointError(f"{where}: key {key!r}: partition of rank {piece.rank} holds {flat.dtype}, "
                                             f"rank {cuts[0][0].rank} holds {dtype}")
            if piece.offset + piece.hi - piece.lo > flat.numel:
                raise CorruptCheckpointError(
                    f"{where}: key {key!r}: the partition in {flat.file} holds {flat.numel} elements, the "
                    f"parameter needs {piece.offset + piece.hi - piece.lo}; the files are from different runs")
            base = flat.offset + piece.offset - piece.lo
            chunks += [ChunkRef(box, flat.file, (flat.slot, base + first), piece.rank) for box, first in boxes]
        if not chunks:  # a parameter without elements
            chunks = [ChunkRef(full_box(shape), flats[0].file if flats else "", (VALUE_SLOT, -1))]
        self.tensors[key] = TensorEntry(key, dtype, tuple(shape), tuple(chunks), path)

    def add_value(self, key: str, path: tuple, data: np.ndarray, dtype: str, file: str) -> None:
        """A small tensor held in memory (bit array of ``dtype``'s storage type)."""
        self.values.append(data)
        chunk = ChunkRef(full_box(data.shape), file, (VALUE_SLOT, len(self.values) - 1))
        self.tensors[key] = TensorEntry(key, dtype, tuple(data.shape), (chunk,), path)

    def alias(self, key: str, path: tuple, target: str) -> None:
        """``key`` reads the data of ``target`` (a tied parameter saved once)."""
        entry = self.tensors[target]
        self.tensors[key] = TensorEntry(key, entry.dtype, entry.shape, entry.chunks, path)

    # -- objects -------------------------------------------------------------------------------

    def add_object(self, key: str, path: tuple, value: Any, file: str) -> None:
        self.object_values[key] = value
        self.objects[key] = ObjectEntry(key, path, file, key)
