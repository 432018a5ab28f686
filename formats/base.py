"""The shared index types and reader/writer protocol of every on-disk format.

Every format exposes the same read side: a :class:`CheckpointIndex` (tensor entries with their
global shapes and chunks, plus non-tensor objects), and a reader that returns any region of any
chunk without touching the rest of the checkpoint.

Coordinates are global: a chunk (and a region) is a box ``(offsets, sizes)`` in the tensor's global
index space. 0-d tensors have ``offsets == sizes == ()``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable, Iterable, Mapping
from itertools import compress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Box:
    """A box in a tensor's global index space: ``offsets`` and ``sizes`` per dim."""

    offsets: Shape
    sizes: Shape

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> Shape:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        """The common box, or None when they share no element (0-d boxes always intersect)."""
        a, b = self.offsets, other.offsets
        lo = tuple(map(max, a, b))  # per-dim work in C: planning intersects millions of boxes
        hi = map(min, map(operator.add, a, self.sizes), map(operator.add, b, other.sizes))
        sizes = tuple(map(operator.sub, hi, lo))
        if min(sizes, default=1) <= 0:
            return None
        return Box(lo, sizes)

    def overlaps(self, other: Box) -> bool:
        """Whether the boxes share an element (``intersect`` is not None) without building the box."""
        a, b = self.offsets, other.offsets
        hi = map(min, map(operator.add, a, self.sizes), map(operator.add, b, other.sizes))
        return min(map(operator.sub, hi, map(max, a, b)), default=1) > 0

    def relative_to(self, outer: Box) -> Box:
        """This box expressed in the local coordinates of ``outer`` (which contains it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        """Python slices selecting this box from an array whose origin is the global origin."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + s <= a + t
            for a, t, b, s in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def to_json(self) -> dict[str, list[int]]:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes)}


_OFFSETS = operator.attrgetter("offsets")
_SIZES = operator.attrgetter("sizes")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def first_overlap(boxes: Iterable[Box]) -> tuple[Box, Box] | None:
    """Two of the non-empty ``boxes`` that share an element, or None when they are disjoint.

    A sweep along the dim with the most distinct offsets: boxes sorted by their start there are
    compared only with those still open at that start, O(n log n) for grids of any size. A row of
    boxes (equal in every other dim, as FSDP shards are) is checked as intervals in C-level loops.
    """
    boxes = list(boxes)
    full = list(compress(boxes, map(math.prod, map(_SIZES, boxes))))
    if len(full) < 2:
        return None
    if not full[0].ndim:
        return full[0], full[1]
    ndim = full[0].ndim
    if set(map(len, map(_OFFSETS, full))) == {ndim} and set(map(len, map(_SIZES, full))) == {ndim}:
        offs = list(zip(*map(_OFFSETS, full)))
        sizes = list(zip(*map(_SIZES, full)))
        distinct = [len(set(col)) for col in offs]
        d = max(range(ndim), key=lambda i: (distinct[i], -i))
        if all(distinct[i] == 1 and len(set(sizes[i])) == 1 for i in range(ndim) if i != d):
            spans = sorted(zip(offs[d], map(operator.add, offs[d], sizes[d])))
            starts, ends = list(map(_FIRST, spans)), list(map(_SECOND, spans))
            if all(map(operator.ge, starts[1:], ends[:-1])):
                return None  # sorted intervals that each start after the last one ended
    d = max(range(full[0].ndim), key=lambda i: (len({b.offsets[i] for b in full}), -i))
    full.sort(key=lambda b: b.offsets[d])
    active: list[tuple[int, Box]] = []
    for box in full:
        start = box.offsets[d]
        active = [(end, a) for end, a in active if end > start]
        for _, a in active:
            if a.intersect(box) is not None:
                return a, box
        active.append((start + box.sizes[d], box))
    return None


def full_box(shape: Shape) -> Box:
    """The box covering a whole tensor."""
    return Box(tuple(0 for _ in shape), tuple(shape))


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One stored chunk of a tensor: its global box and where its bytes live.

    ``file`` is the path (relative to the checkpoint root) of the file holding the bytes, for
    display and validation. ``rank`` is the rank that wrote the file when the format knows it.
    ``locator`` is format specific and opaque to callers (hashable).
    """

    box: Box
    file: str
    locator: Hashable
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor in a checkpoint: flattened key, torch dtype name, global shape and chunks.

    ``path`` is the object path of the key in the original (nested) state dict, e.g.
    ``("optim", "state", "layers.0.w1.weight", "exp_avg")``; DCP records it in ``planner_data``.
    """

    key: str
    dtype: str
    shape: Shape
    chunks: tuple[ChunkRef, ...]
    path: tuple[str | int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        from formats.dtypes import by_name

        return self.numel * by_name(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    """A non-tensor entry: its flattened key, object path, and where its serialized bytes live."""

    key: str
    path: tuple[str | int, ...]
    file: str
    locator: Hashable
    nbytes: int | None = None


@dataclass(frozen=True)
class CheckpointIndex:
    """What a checkpoint holds, format independent. Built from metadata alone, no tensor data."""

    format: str  # "dcp" | "universal" | "hf"
    root: str
    tensors: Mapping[str, TensorEntry]
    objects: Mapping[str, ObjectEntry]
    info: Mapping[str, Any] = field(default_factory=dict)  # version, world_size, files, ...

    @property
    def files(self) -> list[str]:
        names = {c.file for t in self.tensors.values() for c in t.chunks}
        names |= {o.file for o in self.objects.values()}
        return sorted(names)


@runtime_checkable
class CheckpointReader(Protocol):
    """The read side every format implements."""

    def index(self) -> CheckpointIndex:
        """The checkpoint's index (cached; metadata only)."""
        ...

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        """A new contiguous tensor holding ``region`` (global coords, inside ``chunk.box``)."""
        ...

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` (writable bytes, exactly the region's size) with the bits of ``region``
        in C order (no torch needed; a reader with only tensors can use :class:`TensorReader`)."""
        ...

    def read_object_bytes(self, key: str) -> bytes:
        """The serialized bytes of a non-tensor entry, exactly as stored."""
        ...

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        """The value of a non-tensor entry (allowlisted unpickling unless ``trust_pickle``)."""
        ...

    def close(self) -> None:
        """Release open files."""
        ...

    # Optional, for readers that check stored checksums as they read (the executor calls them
    # when present): ``pending_checks(chunks) -> bool``, whether the check of any of ``chunks``
    # waits for bytes not read yet (the chunk was read in parts); ``finish_checks(workers) ->
    # int``, complete every open check (read what no region read covered), raising on a mismatch.


def copy_bits_into(bits: np.ndarray, out: memoryview) -> None:
    """Copy the bit array ``bits`` (any layout) into ``out`` (exactly its bytes) in C order."""
    import numpy as np

    np.copyto(np.frombuffer(out, dtype=bits.dtype).reshape(bits.shape), bits)


def read_box(reader: CheckpointReader, entry: TensorEntry, box: Box) -> np.ndarray:
    """``box`` of ``entry`` as a new bit array, read from every chunk it overlaps."""
    import numpy as np

    from formats.dtypes import by_name

    d = by_name(entry.dtype)
    out = np.empty(box.sizes, dtype=d.numpy_dtype)
    for c in entry.chunks:
        part = c.box.intersect(box)
        if part is None or not part.numel:
            continue
        if part == box:
            reader.read_region_into(entry.key, c, box, memoryview(out.reshape(-1).view(np.uint8)))
            return out
        tmp = np.empty(part.sizes, dtype=d.numpy_dtype)
        reader.read_region_into(entry.key, c, part, memoryview(tmp.reshape(-1).view(np.uint8)))
        out[part.relative_to(box).slices()] = tmp
    return out


class TensorReader:
    """A base for readers that make regions as tensors only: :meth:`read_region_into` copies
    the bits of :meth:`read_region` (a test double, a reader wrapping a framework's loader)."""

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        raise NotImplementedError

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` with the bits of :meth:`read_region` (one tensor copy)."""
        from formats.dtypes import to_storage_array

        copy_bits_into(to_storage_array(self.read_region(key, chunk, region)), out)


def iter_tensor_entries(index: CheckpointIndex, keys: Iterable[str] | None = None):
    """Tensor entries of ``index`` in key order, optionally restricted to ``keys``."""
    wanted = None if keys is None else set(keys)
    for key, entry in index.tensors.items():
        if wanted is None or key in wanted:
            yield entry
