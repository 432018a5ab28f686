"""A reader view whose tensors are renamed (and row-permuted or transposed) from a source reader: what export-hf
and import-hf read through (the plan side, :mod:`converter.plan.mapped_view`, says which source
tensor and rows each target tensor is)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from converter import knobs
from converter.plan import index_expr as ix
from converter.plan.copy_tasks import split_pieces
from converter.plan.mapped_view import (ExprLocator, ObjectSource, Source, ViewLocator, expr_parts, mapped_index,
                                        normalized_sources, object_entries, source_region, transposed_box)
from formats.base import Box, CheckpointIndex, CheckpointReader, ChunkRef, copy_bits_into, read_box
from formats.dtypes import by_name, from_storage_array
from formats.errors import PlanError

if TYPE_CHECKING:
    import torch


class MappedReader:
    """A :class:`CheckpointReader` view: target tensors renamed (and row-permuted) from a source.

    ``sources`` maps each target key to its :class:`Source`; ``paths`` gives target object paths;
    ``objects`` the view's non-tensor entries (target key -> :class:`ObjectSource`: a source
    entry's bytes, or new ones).
    """

    def __init__(self, reader: CheckpointReader, sources: Mapping[str, Source],
                 paths: Mapping[str, tuple] | None = None,
                 objects: Mapping[str, ObjectSource] | None = None) -> None:
        self.reader = reader
        self.sources = normalized_sources(sources)
        self.objects = dict(objects or {})
        index = mapped_index(reader.index(), self.sources, paths)
        if self.objects:
            index = replace(index, objects=object_entries(reader.index(), self.objects))
        self._index = index
        self._parts = {k: expr_parts(s.expr) for k, s in self.sources.items() if s.expr is not None}

    def index(self) -> CheckpointIndex:
        return self._index

    def _source_region(self, key: str, region: Box) -> Box:
        """The source box behind ``region`` of target ``key`` (:func:`source_region`)."""
        return source_region(self.sources[key], region)

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        """A new tensor holding ``region`` of the target tensor ``key``."""
        loc: ViewLocator = chunk.locator
        if key in self._parts:
            bits = np.empty(region.sizes, dtype=by_name(self._index.tensors[key].dtype).numpy_dtype)
            self._gather(key, chunk, region, memoryview(bits.reshape(-1).view(np.uint8)))
            return from_storage_array(bits, self._index.tensors[key].dtype)
        if self.sources[key].transpose:
            return from_storage_array(self._transposed_bits(key, chunk, region), self._index.tensors[key].dtype)
        if self.sources[key].perm is None:
            data = self.reader.read_region(loc.key, loc.chunk, self._source_region(key, region))
            return data.reshape(region.sizes)
        return from_storage_array(self._permuted_bits(key, chunk, region), self._index.tensors[key].dtype)

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` (exactly the region's bytes) with ``region`` of the target tensor, C order."""
        loc: ViewLocator = chunk.locator
        if key in self._parts:
            self._gather(key, chunk, region, out)
            return
        if self.sources[key].transpose:
            copy_bits_into(self._transposed_bits(key, chunk, region), out)
            return
        if self.sources[key].perm is None:
            self.reader.read_region_into(loc.key, loc.chunk, self._source_region(key, region), out)
            return
        copy_bits_into(self._permuted_bits(key, chunk, region), out)

    def _source_bits(self, key: str, chunk: ChunkRef, region: Box) -> np.ndarray:
        """``region`` of the source chunk behind target ``key`` as a new bit array."""
        loc: ViewLocator = chunk.locator
        bits = np.empty(region.sizes, dtype=by_name(self._index.tensors[key].dtype).numpy_dtype)
        self.reader.read_region_into(loc.key, loc.chunk, self._source_region(key, region),
                                     memoryview(bits.reshape(-1).view(np.uint8)))
        return bits

    def _transposed_bits(self, key: str, chunk: ChunkRef, region: Box) -> np.ndarray:
        """The region of a transposed target as a bit array: the transposed region of the
        untransposed view (rows permuted where the source says), transposed in memory (one extra
        copy of the region: bounded by the piece size, as the region is)."""
        flipped = transposed_box(region)
        bits = self._source_bits(key, chunk, flipped) if self.sources[key].perm is None \
            else self._permuted_bits(key, chunk, flipped)
        out = np.empty(bits.shape[::-1], dtype=bits.dtype)  # plain C strides even for size-1 dims
        out[...] = bits.T
        return out

    def _permuted_bits(self, key: str, chunk: ChunkRef, region: Box) -> np.ndarray:
        """The region of a row-permuted target as a bit array: one read of the source rows it
        spans, then the rows taken in target order."""
        rows = self.sources[key].perm[region.offsets[0]: region.ends[0]]
        lo, hi = int(rows.min()), int(rows.max()) + 1
        data = self._source_bits(key, chunk, Box((lo, *region.offsets[1:]), (hi - lo, *region.sizes[1:])))
        if hi - lo == len(rows) and bool((rows == np.arange(lo, hi)).all()):
            return data
        return np.ascontiguousarray(data[rows - lo])

    def pending_checks(self, chunks: Iterable[ChunkRef]) -> bool:
        """Whether the source's check of any chunk behind ``chunks`` is still open."""
        pending = getattr(self.reader, "pending_checks", None)
        if pending is None:
            return False
        behind: list[ChunkRef] = []
        for c in chunks:  # a gathered part reads from any chunk of its source
            loc = c.locator
            behind += list(self.reader.index().tensors[loc.key].chunks) if isinstance(loc, ExprLocator) else [loc.chunk]
        return pending(behind)

    def finish_checks(self, workers: int = 1) -> int:
        """Complete the source's open checks (:meth:`formats.dcp.DCPReader.finish_checks`)."""
        finish = getattr(self.reader, "finish_checks", None)
        return 0 if finish is None else finish(workers)

    def _gather(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """``region`` of an index-expression target (inside one of its parts), slab by slab: each
        slab reads the smallest source box holding its elements, then takes them in order."""
        box, view = self._parts[key][chunk.locator.part]
        entry = self.reader.index().tensors[view.key]
        item = by_name(entry.dtype).itemsize
        rel = region.relative_to(box)
        cursor = 0
        for slab in split_pieces(rel, 8, knobs.QUANT_SLAB_BYTES) if rel.ndim else [rel]:  # int64 indices
            lo, sizes, local = ix.source_box(view, entry.shape, slab.offsets, slab.sizes)
            bits = read_box(self.reader, entry, Box(lo, sizes))
            idx = np.zeros(slab.sizes, dtype=np.int64)
            for t, a in enumerate(local):
                idx += a.reshape([-1 if d == t else 1 for d in range(len(local))])
            n = slab.numel * item
            copy_bits_into(bits.reshape(-1)[idx], out[cursor: cursor + n])
            cursor += n

    def read_object_bytes(self, key: str) -> bytes:
        """The bytes of a non-tensor entry of the view: its source entry's, as stored, or its own."""
        obj = self.objects.get(key)
        if obj is None:
            raise PlanError(f"no non-tensor entry {key!r} in a mapped view")
        return obj.data if obj.data is not None else self.reader.read_object_bytes(obj.key)

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        """The value of a non-tensor entry of the view (allowlisted unpickling unless ``trust_pickle``)."""
        obj = self.objects.get(key)
        if obj is not None and obj.data is None:
            return self.reader.load_object(obj.key, trust_pickle)
        from formats.objects import load_torch_object

        return load_torch_object(self.read_object_bytes(key), f"{self._index.root}: key {key!r}", trust_pickle)

    def framework_files(self) -> dict[str, bytes]:
        """None: the framework files beside the source (Megatron's ``metadata.json``) describe its
        names, not the view's."""
        return {}

    def close(self) -> None:
        self.reader.close()
