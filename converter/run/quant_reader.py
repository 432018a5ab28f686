"""Reader views that dequantize (import-hf ``--dequantize``) or quantize (export-hf ``--quantize
fp8-block``) block-scaled weights region by region (:mod:`formats.quant` has the formats and the
arithmetic).

A region is computed in slabs of at most ``knobs.QUANT_SLAB_BYTES`` of float32 work, each slab
reading only the data and scale blocks it covers, so no tensor is ever loaded whole and a
worker's extra memory is one slab whatever the tensor's size.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from converter import knobs
from converter.plan.copy_tasks import split_pieces
from formats.base import Box, CheckpointIndex, CheckpointReader, ChunkRef, TensorEntry, copy_bits_into, full_box, read_box
from formats.dtypes import by_name, from_storage_array
from formats.errors import InvalidCheckpointError
from formats.quant import (QuantPair, dequantize_fp8, dequantize_mxfp4, find_pairs, fp8_scale_box, fp8_scale_shape,
                           mx_source_boxes, quantize_fp8)

if TYPE_CHECKING:
    import torch


class _ViewBase:
    """What both views share: the index, region reads as tensors, no objects, close."""

    reader: CheckpointReader
    _index: CheckpointIndex

    def index(self) -> CheckpointIndex:
        return self._index

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        """A new tensor holding ``region`` of ``key``."""
        entry = self._index.tensors[key]
        bits = np.empty(region.sizes, dtype=by_name(entry.dtype).numpy_dtype)
        self.read_region_into(key, chunk, region, memoryview(bits.reshape(-1).view(np.uint8)))
        return from_storage_array(bits, entry.dtype)

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        raise NotImplementedError

    def read_object_bytes(self, key: str) -> bytes:
        return self.reader.read_object_bytes(key)

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        return self.reader.load_object(key, trust_pickle)

    def close(self) -> None:
        self.reader.close()

    def _source_keys(self, chunk: ChunkRef) -> tuple[str, ...] | None:
        """The source tensors a view chunk is computed from (None: a source chunk shown as is)."""
        return None

    def pending_checks(self, chunks: Iterable[ChunkRef]) -> bool:
        """Whether the source's check of a chunk behind ``chunks`` is still open (a computed
        tensor's: any chunk of the tensors it is computed from)."""
        pending = getattr(self.reader, "pending_checks", None)
        if pending is None:
            return False
        behind: list[ChunkRef] = []
        for c in chunks:
            keys = self._source_keys(c)
            behind += [c] if keys is None else [s for k in keys for s in self._src.tensors[k].chunks]
        return pending(behind)

    def finish_checks(self, workers: int = 1) -> int:
        """Complete the source's open checks (:meth:`formats.dcp.DCPReader.finish_checks`)."""
        finish = getattr(self.reader, "finish_checks", None)
        return 0 if finish is None else finish(workers)


def _slabs(box: Box, itemsize: int = 4) -> list[Box]:
    """``box`` split into C-order sub-boxes of at most one slab of ``itemsize``-byte work each."""
    return split_pieces(box, itemsize, knobs.QUANT_SLAB_BYTES)


class DequantizedReader(_ViewBase):
    """An HF checkpoint with each quantized pair (:func:`formats.quant.find_pairs`) shown as its
    logical tensor in ``dtype`` (the scales hidden); every other tensor as it is."""

    def __init__(self, reader: CheckpointReader, dtype: str, block: tuple[int, int],
                 mx_layout: str = "transformers") -> None:
        self.reader, self.dtype = reader, by_name(dtype).name
        src = reader.index()
        self._src = src
        self.pairs = find_pairs(src.tensors, block, mx_layout, where=f"{src.root}: ")
        by_data = {p.data: p for p in self.pairs.values()}
        self._by_name = {p.name: p for p in self.pairs.values()}
        hidden = {p.scale for p in self.pairs.values()}
        tensors: dict[str, TensorEntry] = {}
        for key, e in src.tensors.items():
            if key in hidden:
                continue
            pair = by_data.get(key)
            if pair is None:
                tensors.setdefault(key, e)
                continue
            if pair.name in tensors or (pair.name != key and pair.name in src.tensors):
                raise InvalidCheckpointError(f"{src.root}: {pair.name!r} is both a tensor and the dequantized {key}; "
                                             "the checkpoint cannot be dequantized")
            chunk = ChunkRef(full_box(pair.shape), e.chunks[0].file if e.chunks else "", ("dequantized", pair.name))
            tensors[pair.name] = TensorEntry(pair.name, self.dtype, pair.shape, (chunk,), (pair.name,))
        info = {**src.info, "dequantized": {"dtype": self.dtype, "tensors": len(self.pairs)}}
        self._index = CheckpointIndex(src.format, src.root, tensors, src.objects, info)

    def _source_keys(self, chunk: ChunkRef) -> tuple[str, ...] | None:
        loc = chunk.locator
        if isinstance(loc, tuple) and len(loc) == 2 and loc[0] == "dequantized":
            pair = self._by_name[loc[1]]
            return (pair.data, pair.scale)
        return None

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` with ``region`` of ``key`` (dequantized slab by slab for a pair)."""
        pair = self.pairs.get(key)
        if pair is None:
            self.reader.read_region_into(key, chunk, region, out)
            return
        item = by_name(self.dtype).itemsize
        cursor = 0
        for slab in _slabs(region):
            n = slab.numel * item
            copy_bits_into(self._slab(pair, slab), out[cursor: cursor + n])
            cursor += n

    def _slab(self, pair: QuantPair, slab: Box) -> np.ndarray:
        data, scale = self._src.tensors[pair.data], self._src.tensors[pair.scale]
        if pair.kind == "fp8-block":
            w = read_box(self.reader, data, slab)
            s = read_box(self.reader, scale, fp8_scale_box(slab, pair.block))  # type: ignore[arg-type]
            return dequantize_fp8(w, data.dtype, s, scale.dtype, slab, pair.block, self.dtype)  # type: ignore[arg-type]
        bbox, sbox, skip, k = mx_source_boxes(pair, slab)
        values = dequantize_mxfp4(read_box(self.reader, data, bbox), read_box(self.reader, scale, sbox), self.dtype)
        values = values[..., skip: skip + k]
        return values.swapaxes(1, 2) if pair.transpose else values


class QuantTarget(NamedTuple):
    """A tensor the quantizing view computes: an FP8 ``weight`` or its ``scale`` (``weight_scale_inv``),
    both from the source tensor ``source`` (block rows x cols)."""

    kind: str  # "weight" | "scale"
    source: str
    block: tuple[int, int]
    fp8: str = "float8_e4m3fn"


class QuantizingReader(_ViewBase):
    """A view of ``reader`` where each :class:`QuantTarget` is computed by block-scaled FP8
    quantization (:func:`formats.quant.quantize_fp8`) of its source; other tensors as they are.

    A weight region reads the whole blocks it touches; the scales those blocks give are kept (up
    to ``knobs.QUANT_SCALE_MEMO_BYTES``) for the scale tensor's reads, which otherwise quantize
    the source again (same bits: the arithmetic is deterministic).
    """

    def __init__(self, reader: CheckpointReader, targets: Mapping[str, QuantTarget]) -> None:
        self.reader, self.targets = reader, dict(targets)
        src = reader.index()
        self._src = src
        tensors: dict[str, TensorEntry] = dict(src.tensors)
        for name, t in self.targets.items():
            e = src.tensors[t.source]
            shape = tuple(e.shape) if t.kind == "weight" else fp8_scale_shape(tuple(e.shape), t.block)
            dtype = t.fp8 if t.kind == "weight" else "float32"
            chunk = ChunkRef(full_box(shape), e.chunks[0].file if e.chunks else "", ("quantized", name))
            tensors[name] = TensorEntry(name, dtype, shape, (chunk,), (name,))
        self._index = CheckpointIndex(src.format, src.root, tensors, src.objects, src.info)
        self._memo: dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._block = {t.source: t.block for t in self.targets.values()}
        self._memo_bytes = 0
        self._lock = threading.Lock()

    def _source_keys(self, chunk: ChunkRef) -> tuple[str, ...] | None:
        loc = chunk.locator
        if isinstance(loc, tuple) and len(loc) == 2 and loc[0] == "quantized":
            return (self.targets[loc[1]].source,)
        return None

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` with ``region`` of ``key`` (quantized block by block for a target)."""
        t = self.targets.get(key)
        if t is None:
            self.reader.read_region_into(key, chunk, region, out)
            return
        entry = self._index.tensors[key]
        dest = np.frombuffer(out, dtype=by_name(entry.dtype).numpy_dtype).reshape(region.sizes)
        blocks = fp8_scale_box(region, t.block) if t.kind == "weight" else region
        lead = len(region.offsets) - 2
        for part in self._parts(t, blocks):
            q, inv, elems = self._quantize(t, part, lead)
            if t.kind == "scale":
                dest[part.relative_to(region).slices()] = inv
                continue
            self._remember(t.source, part, inv)
            hit = elems.intersect(region)
            if hit is not None:
                dest[hit.relative_to(region).slices()] = q[hit.relative_to(elems).slices()]

    def _parts(self, t: QuantTarget, blocks: Box) -> list[Box]:
        """``blocks`` (a box of whole blocks) in slabs of whole block rows (all their columns: one
        pread run each, and scales kept row by row for the scale tensor) of at most one slab of
        float32 work, or of one row up to 16 slabs; a wider row is split into columns."""
        block = 4 * t.block[0] * t.block[1]  # float32 work of one block
        row = block * blocks.sizes[-1]
        budget = knobs.QUANT_SLAB_BYTES if row > 16 * knobs.QUANT_SLAB_BYTES else max(row, knobs.QUANT_SLAB_BYTES)
        return split_pieces(blocks, block, budget)

    def _quantize(self, t: QuantTarget, blocks: Box, lead: int) -> tuple[np.ndarray | None, np.ndarray, Box]:
        """(fp8 bits or None, scale_inv, element box) of the blocks ``blocks`` of ``t``'s source."""
        src = self._src.tensors[t.source]
        shape = tuple(src.shape)
        lo = [o * b for o, b in zip(blocks.offsets[lead:], t.block)]
        hi = [min(e * b, n) for e, b, n in zip(blocks.ends[lead:], t.block, shape[lead:])]
        elems = Box((*blocks.offsets[:lead], *lo), (*blocks.sizes[:lead], *(h - o for h, o in zip(hi, lo))))
        if t.kind == "scale":
            inv = self._recall(t.source, blocks)
            if inv is not None:
                return None, inv, elems
        q, inv = quantize_fp8(read_box(self.reader, src, elems), src.dtype, t.block, t.fp8)
        return q, inv, elems

    def _remember(self, source: str, blocks: Box, inv: np.ndarray) -> None:
        """Keep ``inv`` (the scales of ``blocks``) row by row for the scale tensor's reads (each
        block row one float32 array of every block column, filled as its parts are quantized)."""
        lead = len(blocks.offsets) - 2
        width = fp8_scale_shape(tuple(self._src.tensors[source].shape), self._block[source])[-1]
        c0, c1 = blocks.offsets[-1], blocks.ends[-1]
        with self._lock:
            for idx in np.ndindex(*blocks.sizes[:lead + 1]):
                at = (source, tuple(o + i for o, i in zip(blocks.offsets, idx)))
                row = self._memo.get(at)
                if row is None:
                    if self._memo_bytes + 5 * width > knobs.QUANT_SCALE_MEMO_BYTES:
                        return
                    row = self._memo[at] = (np.zeros(width, np.float32), np.zeros(width, bool), np.zeros(width, bool))
                    self._memo_bytes += 6 * width
                row[0][c0:c1] = inv[idx]
                row[1][c0:c1] = True

    def _recall(self, source: str, blocks: Box) -> np.ndarray | None:
        """The scales of ``blocks`` when every one of them was kept (each block's taken once; a row
        is dropped once all its blocks were taken), else None."""
        lead = len(blocks.offsets) - 2
        c0, c1 = blocks.offsets[-1], blocks.ends[-1]
        with self._lock:
            keys = [(source, tuple(o + i for o, i in zip(blocks.offsets, idx)))
                    for idx in np.ndindex(*blocks.sizes[:lead + 1])]
            rows = [self._memo.get(k) for k in keys]
            if any(r is None or not r[1][c0:c1].all() for r in rows):
                return None
            out = np.stack([r[0][c0:c1] for r in rows]).reshape(blocks.sizes)
            for k, r in zip(keys, rows):
                r[2][c0:c1] = True
                if r[2].all():
                    del self._memo[k]
                    self._memo_bytes -= 6 * len(r[0])
        return out
