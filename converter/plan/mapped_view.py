"""The pure half of a renamed (and row-permuted, expert-sliced or expert-stacked) view of a
checkpoint, as export-hf and import-hf read their source: which source tensor each target tensor
comes from (:class:`Source`), and the view's index, whose chunks are boxes in target coordinates (so
``plan_tensor`` and the executor run unchanged). :class:`converter.run.mapped_reader.MappedReader`
reads through it.

A permuted tensor's virtual chunks are runs of target rows whose source rows lie in one source
chunk (:func:`permuted_chunks`); reading a region then reads the span of source rows it needs in
one go and gathers the rows (at most a few heads of extra rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from converter.plan.key_maps import KeyMap, heads_for, parse_transform, rope_permutation
from converter.plan.view_source import ObjectSource, Source
from formats.base import Box, CheckpointIndex, ChunkRef, ObjectEntry, TensorEntry
from formats.errors import ConfigError, InvalidCheckpointError


class ViewLocator(NamedTuple):
    """A view chunk's locator: the source key and the source chunk it reads."""

    key: str
    chunk: ChunkRef


class ExprLocator(NamedTuple):
    """The locator of a chunk of an index-expression target: part ``part`` of
    :func:`expr_parts` (a strided view of one source) fills the chunk's box."""

    key: str
    part: int


def expr_parts(e: Any, offsets: tuple[int, ...] | None = None) -> list[tuple[Box, Any]]:
    """Every strided view of expression ``e`` with the box of the target it fills (a
    concatenation's parts side by side along its dim, recursively), in order (pure)."""
    from converter.plan import index_expr as ix

    offsets = tuple(0 for _ in e.shape) if offsets is None else offsets
    if isinstance(e, ix.View):
        return [(Box(offsets, tuple(e.shape)), e)]
    out, at = [], offsets[e.dim]
    for p in e.parts:
        out += expr_parts(p, (*offsets[: e.dim], at, *offsets[e.dim + 1:]))
        at += p.shape[e.dim]
    return out


def _expr_entry(src_index: CheckpointIndex, target: str, src: Source, path: tuple) -> TensorEntry:
    """The entry of an index-expression target: one chunk per strided part, in the sources' dtype."""
    parts = expr_parts(src.expr)
    dtypes = {src_index.tensors[v.key].dtype for _, v in parts}
    if len(dtypes) != 1:
        raise InvalidCheckpointError(f"{target}: the map joins tensors of dtypes {sorted(dtypes)}; they must share one")
    chunks = []
    for i, (box, v) in enumerate(parts):
        first = src_index.tensors[v.key].chunks
        chunks.append(ChunkRef(box, first[0].file if first else "", ExprLocator(v.key, i), first[0].rank if first else None))
    return TensorEntry(target, dtypes.pop(), tuple(src.expr.shape), tuple(chunks), path)


def permuted_chunks(chunks: Sequence[ChunkRef], perm: np.ndarray, key: str) -> tuple[ChunkRef, ...]:
    """Virtual chunks (target coordinates) of a tensor whose target row ``t`` is source row
    ``perm[t]``: runs of target rows whose source rows fall in one row segment of the source
    chunks, times each source chunk covering that segment (pure)."""
    perm = np.asarray(perm, dtype=np.int64)
    rows = len(perm)  # target rows: all the source's (a permutation) or some (a part of a fused tensor)
    live = [c for c in chunks if c.box.numel]
    cuts = sorted({0} | {c.box.offsets[0] for c in live} | {c.box.ends[0] for c in live})
    seg = np.searchsorted(np.asarray(cuts[1:-1], dtype=np.int64), perm, side="right")
    starts = [0] + (np.flatnonzero(seg[1:] != seg[:-1]) + 1).tolist()
    out = []
    for t0, t1 in zip(starts, starts[1:] + [rows]):
        s = int(seg[t0])
        lo, hi = cuts[s], cuts[s + 1]
        for c in live:
            if c.box.offsets[0] <= lo and hi <= c.box.ends[0]:
                box = Box((t0, *c.box.offsets[1:]), (t1 - t0, *c.box.sizes[1:]))
                out.append(ChunkRef(box, c.file, ViewLocator(key, c), c.rank))
    return tuple(out)


def leading(index: int | tuple[int, ...]) -> tuple[int, ...]:
    """A :class:`Source` index as its tuple of leading indices."""
    return index if isinstance(index, tuple) else (index,)


def expert_chunks(entry: TensorEntry, index: int | tuple[int, ...]) -> tuple[ChunkRef, ...]:
    """Virtual chunks of expert ``index`` of a grouped tensor ``[E, ...]`` (a tuple: the slice at
    those leading indices): the source chunks holding it, its leading dims dropped (pure)."""
    lead = leading(index)
    n = len(lead)
    return tuple(ChunkRef(Box(c.box.offsets[n:], c.box.sizes[n:]), c.file, ViewLocator(entry.key, c), c.rank)
                 for c in entry.chunks
                 if c.box.numel and all(o <= i < o + s for i, o, s in zip(lead, c.box.offsets, c.box.sizes)))


def stacked_entry(target: str, parts: Sequence[TensorEntry], path: tuple) -> TensorEntry:
    """The entry of ``stack(parts)`` (a new dim 0, one per part; their chunks at index ``i``);
    every part must have the same dtype and shape (InvalidCheckpointError names the first that
    differs)."""
    first = parts[0]
    for p in parts[1:]:
        if (p.dtype, tuple(p.shape)) != (first.dtype, tuple(first.shape)):
            raise InvalidCheckpointError(
                f"{p.key} is {p.dtype}{list(p.shape)} but {first.key} is {first.dtype}{list(first.shape)}; the "
                f"experts of {target} must all have one dtype and shape")
    chunks = tuple(ChunkRef(Box((i, *c.box.offsets), (1, *c.box.sizes)), c.file, ViewLocator(p.key, c), c.rank)
                   for i, p in enumerate(parts) for c in p.chunks)
    return TensorEntry(target, first.dtype, (len(parts), *first.shape), chunks, path)


def transposed_box(box: Box) -> Box:
    """The 2-D ``box`` with its two dims swapped (pure)."""
    return Box(tuple(reversed(box.offsets)), tuple(reversed(box.sizes)))


def transposed_entry(entry: TensorEntry) -> TensorEntry:
    """The entry of the transpose of 2-D ``entry``: shape and every chunk box swapped (pure);
    InvalidCheckpointError for another rank."""
    if len(entry.shape) != 2:
        raise InvalidCheckpointError(f"{entry.key}: the key map transposes it but it is {len(entry.shape)}-d "
                                     f"{list(entry.shape)}, not 2-d")
    chunks = tuple(replace(c, box=transposed_box(c.box)) for c in entry.chunks)
    return replace(entry, shape=tuple(reversed(entry.shape)), chunks=chunks)


def source_region(src: Source, region: Box) -> Box:
    """The source box behind ``region`` of a target read from ``src`` (same elements, same C
    order): an expert slice reads ``[index]`` of its source, one expert of a stack drops the new
    dim (a stack's chunks each hold one expert)."""
    if src.index is not None:
        lead = leading(src.index)
        return Box((*lead, *region.offsets), (*(1 for _ in lead), *region.sizes))
    if src.stack:
        return Box(region.offsets[1:], region.sizes[1:])
    return region


def normalized_sources(sources: Mapping[str, Source]) -> dict[str, Source]:
    """``sources`` with every permutation an int64 array."""
    return {k: s if s.perm is None else s._replace(perm=np.asarray(s.perm, dtype=np.int64)) for k, s in sources.items()}


def mapped_index(src_index: CheckpointIndex, sources: Mapping[str, Source],
                 paths: Mapping[str, tuple] | None = None) -> CheckpointIndex:
    """The view's index: one tensor per target key of ``sources`` (object path from ``paths``,
    else the key), its chunks in target coordinates; no objects (pure)."""
    tensors = {}
    for target, src in normalized_sources(sources).items():
        tensors[target] = _view_entry(src_index, target, src, (paths or {}).get(target, (target,)))
        if src.transpose:
            tensors[target] = transposed_entry(tensors[target])
    return CheckpointIndex(src_index.format, src_index.root, tensors, {}, src_index.info)


def object_entries(src_index: CheckpointIndex, objects: Mapping[str, ObjectSource]) -> dict[str, ObjectEntry]:
    """The view's non-tensor entries: each where its source entry lies, or (new bytes) nowhere in
    the source (pure)."""
    out = {}
    for key, obj in objects.items():
        if obj.data is not None:
            out[key] = ObjectEntry(key, tuple(obj.path), "", ("new", key), len(obj.data))
        else:
            e = src_index.objects[obj.key]
            out[key] = ObjectEntry(key, tuple(obj.path), e.file, e.locator, e.nbytes)
    return out


def _view_entry(src_index: CheckpointIndex, target: str, src: Source, path: tuple) -> TensorEntry:
    """The (untransposed) view entry of one target tensor (pure)."""
    if src.expr is not None:
        return _expr_entry(src_index, target, src, path)
    if src.stack:
        return stacked_entry(target, [src_index.tensors[k] for k in src.stack], path)
    e = src_index.tensors[src.key]
    if src.index is not None and src.perm is None:
        return TensorEntry(target, e.dtype, tuple(e.shape[len(leading(src.index)):]), expert_chunks(e, src.index), path)
    if src.index is not None:  # rows of one slice: permute the slice's chunks, locate the source's
        chunks = permuted_chunks(expert_chunks(e, src.index), src.perm, src.key)
        chunks = tuple(replace(c, locator=ViewLocator(src.key, c.locator.chunk.locator.chunk)) for c in chunks)
        return TensorEntry(target, e.dtype, (len(src.perm), *e.shape[len(leading(src.index)) + 1:]), chunks, path)
    if src.perm is None:
        chunks = tuple(ChunkRef(c.box, c.file, ViewLocator(src.key, c), c.rank) for c in e.chunks)
    else:
        chunks = permuted_chunks(e.chunks, src.perm, src.key)
    shape = e.shape if src.perm is None else (len(src.perm), *e.shape[1:])
    return TensorEntry(target, e.dtype, tuple(shape), chunks, path)


def row_permutation(kmap: KeyMap, native_key: str, shape: Sequence[int], config: Mapping[str, Any] | None,
                    to_hf: bool) -> np.ndarray | None:
    """The row permutation the key map's transform asks for ``native_key`` (None: none)."""
    spec = kmap.transform_of(native_key)
    if spec is None:
        return None
    _, field = parse_transform(spec, f"key map {kmap.name!r}")
    if not shape:
        raise ConfigError(f"key map {kmap.name!r}: cannot permute the rows of 0-d tensor {native_key!r}")
    heads = heads_for(field, config, kmap.name, native_key)
    return rope_permutation(int(shape[0]), heads, to_hf, native_key)
