"""Hugging Face safetensors export and import, on the plan/execute core.

- ``export_hf``: a universal store or DCP checkpoint -> ``model.safetensors`` (or shards and an
  index). Model weights only (role "param" of :mod:`converter.plan.atoms`, the ``model.`` prefix
  stripped), renamed by a key map, optionally cast; every HF tensor is one write task whose
  pieces are streamed into the file at their offsets (:class:`formats.hf.HFWriter`).
- ``import_hf``: an HF directory -> a universal store (the inverse map), ready for
  ``from-universal``.

Renaming and row permutations (the RoPE q/k permutation) are a :class:`MappedReader`: a view of the
source whose index names the target tensors and whose chunks are boxes in target coordinates, so
``plan_tensor`` and ``execute`` run unchanged. A permuted tensor's virtual chunks are runs of
target rows whose source rows lie in one source chunk; reading a region reads the span of source
rows it needs in one go and gathers the rows (at most a few heads of extra rows).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from converter import __version__
from converter.plan.atoms import group_atoms
from converter.run.remote import remote_destination, spool_hook
from converter.config import RunOptions, parse_size
from converter.run import distributed
from converter.run.destination import conversion_header, guarded, open_destination, option_value
from converter.run.executor import os_errors_as_storage_errors
from converter.run.journal import task_id
from converter.plan.key_maps import (CONFIG_FILLERS, KeyMap, fused_halves_rows, fused_qkv_rows, get_key_map, heads_for,
                                     megatron_args_config, parse_transform, rename_all, rope_permutation)
from converter.plan.megatron import stacked_layers, unstacked_name
from converter.plan.copy_tasks import Piece, WriteTask, describe, plan_tensor
from converter.run.sources import detect_format, open_checkpoint
from converter.commands.to_universal import ConversionResult, _ChunkSink, universal_chunk_bytes
from formats.base import Box, CheckpointIndex, CheckpointReader, ChunkRef, TensorEntry, copy_bits_into, full_box
from formats.dtypes import CASTABLE_FLOATS, by_name, cast_bits, cast_dtype, from_storage_array
from formats.storage import source_label
from formats.errors import CkptConvError, ConfigError, InvalidCheckpointError, PlanError
from formats.fsutil import atomic_write_bytes
from formats.hf import DEFAULT_MAX_SHARD_BYTES, HFWriter, TensorSpec, plan_files

if TYPE_CHECKING:
    import torch

#: Source dtypes --dtype casts (float8 and integer tensors keep theirs).
CASTABLE = CASTABLE_FLOATS
CONFIG_FILE = "config.json"


# ---------------------------------------------------------------------------------------------
# the mapped view


class Source(NamedTuple):
    """Where a target tensor comes from: the source key and a row permutation (or None); or one
    expert ``index`` of a grouped-experts source ``[E, ...]`` (the slice ``[index]``, dim 0
    dropped), or one layer of a Megatron layer-stacked source ``[L, ...]`` (the same slice, its rows
    then permuted when ``perm`` is given); or the ``stack`` of source keys (one per expert, a new
    dim 0; ``key`` unused)."""

    key: str
    perm: np.ndarray | None = None  # int64 row indices
    index: int | None = None
    stack: tuple[str, ...] = ()


class _VLoc(NamedTuple):
    key: str
    chunk: ChunkRef


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
                out.append(ChunkRef(box, c.file, _VLoc(key, c), c.rank))
    return tuple(out)


class MappedReader:
    """A :class:`CheckpointReader` view: target tensors renamed (and row-permuted) from a source.

    ``sources`` maps each target key to its :class:`Source`; ``paths`` gives target object paths.
    """

    def __init__(self, reader: CheckpointReader, sources: Mapping[str, Source],
                 paths: Mapping[str, tuple] | None = None) -> None:
        self.reader = reader
        self.sources = {k: s if s.perm is None else s._replace(perm=np.asarray(s.perm, dtype=np.int64))
                        for k, s in sources.items()}
        src_index = reader.index()
        tensors = {}
        for target, src in self.sources.items():
            path = (paths or {}).get(target, (target,))
            if src.stack:
                tensors[target] = stacked_entry(target, [src_index.tensors[k] for k in src.stack], path)
                continue
            e = src_index.tensors[src.key]
            if src.index is not None and src.perm is None:
                tensors[target] = TensorEntry(target, e.dtype, tuple(e.shape[1:]), expert_chunks(e, src.index), path)
                continue
            if src.index is not None:  # rows of one slice: permute the slice's chunks, locate the source's
                chunks = permuted_chunks(expert_chunks(e, src.index), src.perm, src.key)
                chunks = tuple(replace(c, locator=_VLoc(src.key, c.locator.chunk.locator.chunk)) for c in chunks)
                tensors[target] = TensorEntry(target, e.dtype, (len(src.perm), *e.shape[2:]), chunks, path)
                continue
            if src.perm is None:
                chunks = tuple(ChunkRef(c.box, c.file, _VLoc(src.key, c), c.rank) for c in e.chunks)
            else:
                chunks = permuted_chunks(e.chunks, src.perm, src.key)
            shape = e.shape if src.perm is None else (len(src.perm), *e.shape[1:])
            tensors[target] = TensorEntry(target, e.dtype, tuple(shape), chunks, path)
        self._index = CheckpointIndex(src_index.format, src_index.root, tensors, {}, src_index.info)

    def index(self) -> CheckpointIndex:
        return self._index

    def _source_region(self, key: str, region: Box) -> Box:
        """The source box behind ``region`` of target ``key`` (same elements, same C order): an
        expert slice reads ``[index]`` of its source, one expert of a stack drops the new dim."""
        src = self.sources[key]
        if src.index is not None:
            return Box((src.index, *region.offsets), (1, *region.sizes))
        if src.stack:
            return Box(region.offsets[1:], region.sizes[1:])
        return region

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        """A new tensor holding ``region`` of the target tensor ``key``."""
        loc: _VLoc = chunk.locator
        if self.sources[key].perm is None:
            data = self.reader.read_region(loc.key, loc.chunk, self._source_region(key, region))
            return data.reshape(region.sizes)
        return from_storage_array(self._permuted_bits(key, chunk, region), self._index.tensors[key].dtype)

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` (exactly the region's bytes) with ``region`` of the target tensor, C order."""
        loc: _VLoc = chunk.locator
        if self.sources[key].perm is None:
            self.reader.read_region_into(loc.key, loc.chunk, self._source_region(key, region), out)
            return
        copy_bits_into(self._permuted_bits(key, chunk, region), out)

    def _source_bits(self, key: str, chunk: ChunkRef, region: Box) -> np.ndarray:
        """``region`` of the source chunk behind target ``key`` as a new bit array."""
        loc: _VLoc = chunk.locator
        bits = np.empty(region.sizes, dtype=by_name(self._index.tensors[key].dtype).numpy_dtype)
        self.reader.read_region_into(loc.key, loc.chunk, self._source_region(key, region),
                                     memoryview(bits.reshape(-1).view(np.uint8)))
        return bits

    def _permuted_bits(self, key: str, chunk: ChunkRef, region: Box) -> np.ndarray:
        """The region of a row-permuted target as a bit array: one read of the source rows it
        spans, then the rows taken in target order."""
        rows = self.sources[key].perm[region.offsets[0]: region.ends[0]]
        lo, hi = int(rows.min()), int(rows.max()) + 1
        data = self._source_bits(key, chunk, Box((lo, *region.offsets[1:]), (hi - lo, *region.sizes[1:])))
        if hi - lo == len(rows) and bool((rows == np.arange(lo, hi)).all()):
            return data
        return np.ascontiguousarray(data[rows - lo])

    def read_object_bytes(self, key: str) -> bytes:
        raise PlanError(f"no non-tensor entry {key!r} in a mapped view")

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        return self.read_object_bytes(key)

    def close(self) -> None:
        self.reader.close()


def expert_chunks(entry: TensorEntry, index: int) -> tuple[ChunkRef, ...]:
    """Virtual chunks of expert ``index`` of a grouped tensor ``[E, ...]``: the source chunks
    holding that expert, their dim 0 dropped (pure)."""
    return tuple(ChunkRef(Box(c.box.offsets[1:], c.box.sizes[1:]), c.file, _VLoc(entry.key, c), c.rank)
                 for c in entry.chunks if c.box.numel and c.box.offsets[0] <= index < c.box.ends[0])


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
    chunks = tuple(ChunkRef(Box((i, *c.box.offsets), (1, *c.box.sizes)), c.file, _VLoc(p.key, c), c.rank)
                   for i, p in enumerate(parts) for c in p.chunks)
    return TensorEntry(target, first.dtype, (len(parts), *first.shape), chunks, path)


def _perm_for(kmap: KeyMap, native_key: str, shape: Sequence[int], config: Mapping[str, Any] | None,
              to_hf: bool) -> np.ndarray | None:
    spec = kmap.transform_of(native_key)
    if spec is None:
        return None
    _, field = parse_transform(spec, f"key map {kmap.name!r}")
    if not shape:
        raise ConfigError(f"key map {kmap.name!r}: cannot permute the rows of 0-d tensor {native_key!r}")
    heads = heads_for(field, config, kmap.name, native_key)
    return rope_permutation(int(shape[0]), heads, to_hf, native_key)


# ---------------------------------------------------------------------------------------------
# options


def normalize_dtype(dtype: str | None) -> str | None:
    """``bf16`` / ``bfloat16`` / ``torch.bfloat16`` -> ``bfloat16`` (:func:`formats.dtypes.cast_dtype`)."""
    return None if dtype is None else cast_dtype(dtype)


def source_config(src: str | os.PathLike) -> Path | dict[str, Any] | None:
    """``src``'s own config.json (a local path, or parsed when ``src`` is a URL); None if absent."""
    from formats.storage import is_remote, open_storage

    if not is_remote(src):
        return Path(src) / CONFIG_FILE if (Path(src) / CONFIG_FILE).is_file() else None
    st = open_storage(src)
    if not st.exists(CONFIG_FILE):
        return None
    try:
        doc = json.loads(st.read_bytes(CONFIG_FILE))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{st.root / CONFIG_FILE}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{st.root / CONFIG_FILE}: config must be a JSON object")
    return doc


def load_config_arg(config: str | os.PathLike | Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, bytes | None]:
    """(parsed config, original file bytes) from a path, inline JSON text or a mapping."""
    if config is None:
        return None, None
    if isinstance(config, Mapping):
        return dict(config), None
    text = os.fspath(config)
    raw: bytes | None = None
    if text.lstrip().startswith("{"):
        where, body = "--config", text
    else:
        path = Path(text)
        if path.is_dir():
            path = path / CONFIG_FILE
        if not path.is_file():
            raise ConfigError(f"--config {text!r}: no such file; pass a config.json path or inline JSON")
        raw = path.read_bytes()
        where, body = str(path), raw.decode("utf-8", errors="replace")
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise ConfigError(f"{where}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: config must be a JSON object")
    return doc, raw


# ---------------------------------------------------------------------------------------------
# export


def model_weights(index: CheckpointIndex) -> dict[str, str]:
    """Source key -> model FQN (prefix stripped) of every model weight, in index order."""
    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    refs, _ = group_atoms(paths)
    return {k: refs[k].atom for k in index.tensors if refs[k].role == "param"}


@dataclass(frozen=True)
class ExportPlan:
    """Everything an export writes, decided before any tensor byte is read."""

    sources: dict[str, Source]  # HF name -> source key (+ permutation)
    specs: tuple[TensorSpec, ...]  # HF tensors in source order, target dtypes
    config: dict[str, Any] | None


def plan_export(index: CheckpointIndex, kmap: KeyMap, dtype: str | None,
                config: Mapping[str, Any] | None) -> ExportPlan:
    """Pure: which source tensor becomes which HF tensor, with dtypes and permutations.

    With a key map other than ``identity``, Megatron's layer-stacked tensors export one tensor per
    layer (``decoder.layers.<i>.<name>``, read as the slice ``source[i]``)."""
    weights = model_weights(index)
    if not weights:
        raise InvalidCheckpointError(f"{index.root}: no model weights found (only optimizer / training state); nothing to export")
    if len(set(weights.values())) != len(weights):
        raise InvalidCheckpointError(f"{index.root}: two keys hold the same model weight; cannot export")
    stacked = {} if kmap.identity else stacked_layers(index)
    fqn_src: dict[str, tuple[str, int | None]] = {}  # native name -> (source key, layer of a stacked tensor)
    for key, fqn in weights.items():
        if key in stacked:
            fqn_src |= {unstacked_name(fqn, i): (key, i) for i in range(stacked[key])}
        else:
            fqn_src[fqn] = (key, None)
    fqn_key = {fqn: key for fqn, (key, _) in fqn_src.items()}
    shapes = {fqn: tuple(index.tensors[k].shape)[0 if layer is None else 1:] for fqn, (k, layer) in fqn_src.items()}
    parts = _fused_parts(kmap, shapes)  # part fqn -> (fused fqn, part number)
    counts: dict[str, int] = {}  # fused fqn -> its number of parts
    for f, i in parts.values():
        counts[f] = max(counts.get(f, 0), i + 1)
    filler = CONFIG_FILLERS.get(kmap.name)
    if config is not None and filler is not None:
        config = filler(_part_shapes(shapes, parts, config, kmap.name, counts), config)
    natives = [p for fqn in fqn_key for p in ([q for q, (f, _) in parts.items() if f == fqn] or [fqn])]
    grouped = {f: kmap.expert_names(f, int(shapes[f][0])) for f in natives if shapes.get(f) and len(shapes[f]) >= 2}
    grouped = {f: names for f, names in grouped.items() if names is not None}
    names = rename_all([f for f in natives if f not in grouped], kmap.exporter(), kmap.name, "export")
    sources, specs = {}, []
    for fqn in natives:
        if fqn in grouped:  # one HF tensor per expert: the slice [e], a region of the grouped tensor
            entry = index.tensors[fqn_key[fqn]]
            target = dtype if dtype is not None and entry.dtype in CASTABLE else entry.dtype
            for e, hf in enumerate(grouped[fqn]):
                sources[hf] = Source(fqn_key[fqn], index=e)
                specs.append(TensorSpec(hf, target, tuple(entry.shape[1:])))
            continue
        if fqn not in names:
            continue  # dropped by the map
        hf = names[fqn]
        fused, part = parts.get(fqn, (fqn, None))
        key, layer = fqn_src[fused]
        entry = index.tensors[key]
        rows = None if part is None else _fused_rows(shapes[fused], config, kmap.name, fused, counts[fused])[part]
        shape = shapes[fused] if rows is None else (len(rows), *shapes[fused][1:])
        perm = _perm_for(kmap, fqn, shape, config, to_hf=True)
        if rows is not None:
            perm = rows if perm is None else rows[perm]
        sources[hf] = Source(key, perm, index=layer)
        target = dtype if dtype is not None and entry.dtype in CASTABLE else entry.dtype
        specs.append(TensorSpec(hf, target, tuple(shape)))
    return ExportPlan(sources, tuple(specs), None if config is None else dict(config))


def _fused_parts(kmap: KeyMap, shapes: Mapping[str, tuple]) -> dict[str, tuple[str, int]]:
    """Native name of each part of a fused tensor -> (the fused tensor's name, part number)."""
    out = {}
    for fqn in shapes:
        names = kmap.fused_parts(fqn)
        for i, name in enumerate(names or ()):
            if name in shapes:
                raise InvalidCheckpointError(f"the checkpoint holds both {fqn!r} and its part {name!r}; cannot export both")
            out[name] = (fqn, i)
    return out


def _fused_rows(shape: tuple, config: Mapping[str, Any] | None, map_name: str, key: str,
                parts: int = 3) -> tuple[np.ndarray, ...]:
    """The source rows of each part of a fused tensor: a two-part one (Megatron's GLU
    ``linear_fc1``) in halves; q, k, v of a fused ``wqkv`` / ``linear_qkv`` by query group (head
    counts from the config; without ``num_key_value_heads``, from the fused rows and the head size:
    ``rows = (heads + 2 kv) head_dim``, never HF's default of as many k/v heads as q heads, whose
    split also divides a GQA tensor)."""
    if parts != 3:
        return fused_halves_rows(int(shape[0]), parts, key)
    n_heads = heads_for("num_attention_heads", config, map_name, key)
    if (config or {}).get("num_key_value_heads") is None and len(shape) == 2:
        head_dim = (config or {}).get("head_dim") or int(shape[1]) // n_heads  # HF Llama: hidden / heads
        if isinstance(head_dim, int) and head_dim > 0 and int(shape[0]) % head_dim == 0 \
                and (int(shape[0]) // head_dim - n_heads) % 2 == 0 and int(shape[0]) // head_dim > n_heads:
            return fused_qkv_rows(int(shape[0]), n_heads, (int(shape[0]) // head_dim - n_heads) // 2, key)
    n_kv = heads_for("num_key_value_heads", config, map_name, key)
    return fused_qkv_rows(int(shape[0]), n_heads, n_kv, key)


def _part_shapes(shapes: Mapping[str, tuple], parts: Mapping[str, tuple[str, int]],
                 config: Mapping[str, Any], map_name: str, counts: Mapping[str, int] | None = None) -> dict[str, tuple]:
    """``shapes`` with each fused tensor replaced by its parts' shapes (for the config filler)."""
    out = {f: s for f, s in shapes.items() if not any(f == fused for fused, _ in parts.values())}
    for name, (fused, i) in parts.items():
        n = (counts or {}).get(fused, 3)
        if n != 3 or isinstance(config.get("num_attention_heads"), int):
            rows = _fused_rows(shapes[fused], config, map_name, fused, n)[i]
            out[name] = (len(rows), *shapes[fused][1:])
    return out


class _HFSink:
    """Execute sink: pwrite each piece at its offset in the tensor's file, cast if asked."""

    def __init__(self, writer: HFWriter, dtypes: Mapping[str, str]) -> None:
        self.writer, self.dtypes = writer, dtypes

    def open(self, task: WriteTask) -> _HFSink._One:
        return _HFSink._One(self.writer, task, self.dtypes[task.key])

    def sync(self) -> None:
        self.writer.sync()

    class _One:
        def __init__(self, writer: HFWriter, task: WriteTask, dtype: str) -> None:
            self.writer, self.task, self.dtype = writer, task, dtype
            shape = task.box.sizes
            self.strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]

        def write(self, piece: Piece, data: np.ndarray) -> None:
            local = piece.box.relative_to(self.task.box)
            offset = sum(o * s for o, s in zip(local.offsets, self.strides))
            self.writer.write_tensor(self.task.key, offset, cast_bits(data, self.task.dtype, self.dtype))

        def close(self) -> None:
            pass


def _shard_summary(plans) -> str:
    from converter.units import human_bytes, plural

    return "\n".join(f"# {p.name}: {plural(len(p.tensors), 'tensor')}, {human_bytes(p.size)} ({p.size} bytes)" for p in plans)


@remote_destination  # URL destinations: spool, upload, marker last (converter/remote.py)
@guarded  # the destination's lock is held for the call; an interrupt says how to resume
@os_errors_as_storage_errors("export-hf")
def export_hf(src: str | os.PathLike, dst: str | os.PathLike, *, key_map: str | KeyMap | None = "identity",
              max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES, dtype: str | None = None,
              config: str | os.PathLike | Mapping[str, Any] | None = None,
              options: RunOptions | None = None) -> ConversionResult:
    """Write the model weights of ``src`` (universal store or DCP) as HF safetensors in ``dst``.

    ``key_map``: ``identity``, ``torchtitan-llama`` or a map file; ``max_shard_size``: bytes or
    text like ``5GB`` (huggingface_hub's default); ``dtype``: cast floating-point weights (e.g.
    ``bf16``); ``config``: a config.json path or inline JSON, written to ``dst/config.json``
    (completed from the weights' shapes for the built-in Llama map) and used for head counts.
    """
    options = options or RunOptions()
    kmap = get_key_map(key_map)
    max_bytes = parse_size(max_shard_size)
    if max_bytes < 1:
        raise ConfigError(f"--max-shard-size must be positive (got {max_shard_size!r})")
    dtype = normalize_dtype(dtype)
    cfg, cfg_raw = load_config_arg(config)
    dist = distributed.current()
    reader = open_checkpoint(src, trust_pickle=options.trust_pickle, verify=options.verify_source)
    try:
        index = reader.index()
        if kmap.name.startswith("megatron") and not (cfg or {}).get("num_attention_heads"):
            cfg = {**megatron_args_config(megatron_args(reader, index)), **(cfg or {})} or None
        plan = plan_export(index, kmap, dtype, cfg)
        view = MappedReader(reader, plan.sources)
        file_plans = plan_files(plan.specs, max_bytes)
        tasks = [t for hf, e in view.index().tensors.items()
                 for t in plan_tensor(e, [(hf, full_box(e.shape))], options.effective_piece_bytes)]
        total = sum(s.nbytes for s in plan.specs)
        if options.dry_run:
            return ConversionResult(str(dst), len(plan.specs), 0, total, 0.0,
                                    plan=_shard_summary(file_plans) + "\n" + describe(tasks))
        header = conversion_header("export-hf", src, index, {
            "--map": option_value(key_map), "--dtype": dtype, "--max-shard-size": max_bytes,
            "--config": option_value(cfg)})
        out, journal = open_destination(src, dst, header, options)
        writer = HFWriter(out, plan.specs, max_bytes)
        dtypes = {s.name: by_name(s.dtype).name for s in plan.specs}
        try:
            # rank 0 creates and sizes every file; the other ranks then open them without truncating
            dist.leader_first(lambda: writer.start(resume=options.resume), lambda: writer.start(resume=True))
            for task in tasks:
                if journal.is_done(task):
                    writer.adopt(task.key)
            stats, _ = dist.execute(tasks, view, _HFSink(writer, dtypes), workers=options.workers,
                                    memory_budget=options.memory_budget, progress=options.progress,
                                    label="export-hf", journal=journal)

            def write_config() -> None:
                if plan.config is not None:
                    same = cfg_raw is not None and plan.config == cfg
                    atomic_write_bytes(out / CONFIG_FILE, cfg_raw if same else _config_bytes(plan.config))

            dist.publish(writer, journal, out, lambda: [writer.adopt(t.key) for t in tasks], write_config)
        except BaseException:
            writer.close()
            raise
        journal.remove()
        return ConversionResult(str(out), len(plan.specs), 0, total, stats.seconds)
    finally:
        reader.close()


def megatron_args(reader: CheckpointReader, index: CheckpointIndex) -> dict[str, Any]:
    """``vars(args)`` of a Megatron checkpoint's training arguments (its ``common_state`` entry,
    loaded through the allowlist: an ``argparse.Namespace`` is plain data), or ``{}``."""
    import argparse

    for key in index.objects:
        if key.split("/", 1)[0] != "common_state":
            continue
        try:
            value = reader.load_object(key, trust_pickle=False)
        except CkptConvError:
            return {}
        if isinstance(value, list) and len(value) == 1:  # torch_dist stores a ShardedObject's data in a list
            value = value[0]
        args = value.get("args") if isinstance(value, dict) else None
        return dict(vars(args)) if isinstance(args, argparse.Namespace) else {}
    return {}


def _config_bytes(cfg: Mapping[str, Any]) -> bytes:
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------------
# import


#: HF name of a tied output projection -> the HF name of the embedding it is tied to. Hugging Face
#: saves a tied ``lm_head.weight`` only once, as the embedding (safetensors refuses shared storage).
TIED_HF = {"lm_head.weight": "model.embed_tokens.weight"}


def tied_copies(index: CheckpointIndex, config: Mapping[str, Any] | None) -> dict[str, str]:
    """HF names the checkpoint left out because ``config.json`` says ``tie_word_embeddings`` ->
    the HF name whose tensor they are (pure); empty when not tied or already present."""
    if not config or config.get("tie_word_embeddings") is not True:
        return {}
    return {out: emb for out, emb in TIED_HF.items() if out not in index.tensors and emb in index.tensors}


def plan_import(index: CheckpointIndex, kmap: KeyMap, config: Mapping[str, Any] | None,
                prefix: str | None) -> tuple[dict[str, Source], dict[str, tuple]]:
    """Pure: (universal key -> Source, universal key -> object path) for an HF index.

    A tied output projection the checkpoint omits (see :func:`tied_copies`) is recreated from
    the embedding it is tied to, so that the model's state dict (which holds both) loads.
    """
    tied = tied_copies(index, config)
    experts = _expert_stacks(index, kmap)
    in_stack = {k for keys in experts.values() for k in keys}
    names = rename_all([k for k in [*index.tensors, *tied] if k not in in_stack], kmap.importer(), kmap.name, "import")
    sources, paths = {}, {}
    for native, keys in experts.items():
        key = f"{prefix}.{native}" if prefix else native
        sources[key] = Source("", stack=keys)
        paths[key] = (prefix, native) if prefix else (native,)
    for hf, native in names.items():
        key = f"{prefix}.{native}" if prefix else native
        src = tied.get(hf, hf)
        sources[key] = Source(src, _perm_for(kmap, native, index.tensors[src].shape, config, to_hf=False))
        paths[key] = (prefix, native) if prefix else (native,)
    return sources, paths


def _expert_stacks(index: CheckpointIndex, kmap: KeyMap) -> dict[str, tuple[str, ...]]:
    """Grouped native name -> its HF expert tensors in expert order ``0..E-1`` (pure); a missing
    expert is an InvalidCheckpointError naming it."""
    found: dict[str, dict[int, str]] = {}
    for hf in index.tensors:
        hit = kmap.expert_of(hf)
        if hit is not None:
            found.setdefault(hit[0], {})[hit[1]] = hf
    out = {}
    for native, by_expert in found.items():
        missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
        if missing:
            raise InvalidCheckpointError(
                f"{index.root}: expert {missing[0]} of {native} is missing ({len(by_expert)} of {max(by_expert) + 1} "
                "experts present); the HF checkpoint must hold every expert 0..E-1")
        out[native] = tuple(by_expert[e] for e in range(len(by_expert)))
    return out


@remote_destination  # URL destinations: spool, upload, marker last (converter/remote.py)
@guarded  # the destination's lock is held for the call; an interrupt says how to resume
@os_errors_as_storage_errors("import-hf")
def import_hf(src: str | os.PathLike, dst: str | os.PathLike, *, key_map: str | KeyMap | None = "identity",
              config: str | os.PathLike | Mapping[str, Any] | None = None, prefix: str | None = None,
              options: RunOptions | None = None, chunk_bytes: int | None = None,
              backend: str = "zarr") -> ConversionResult:
    """Convert the HF safetensors directory ``src`` into a universal store at ``dst``.

    ``key_map`` renames HF names to native ones (the inverse of the export map); ``config``
    (default: ``src/config.json`` when the map needs head counts) gives the head counts;
    ``prefix`` puts the weights under an object-path root (e.g. ``model`` for DCP's
    ``get_state_dict`` style), top level by default (torchtitan's style). ``backend`` puts the
    tensors' chunks in zarr arrays (default) or safetensors files.
    """
    from converter.commands.to_universal import plan_universal
    from converter.plan.copy_tasks import store_tasks
    from formats.universal import UniversalWriter
    from formats.universal_meta import SourceInfo

    options = options or RunOptions()
    kmap = get_key_map(key_map)
    if kmap.export_only:
        raise ConfigError(f"--map {kmap.name}: export only (Megatron keeps layers stacked and q/k/v, gate/up fused); "
                          "import-hf cannot write its names")
    if detect_format(src) != "hf":
        raise ConfigError(f"{src}: import-hf reads a Hugging Face directory (*.safetensors); use to-universal for other checkpoints")
    if config is None and (src_config := source_config(src)) is not None:  # head counts, tie_word_embeddings
        try:
            cfg, _ = load_config_arg(src_config)
        except ConfigError:
            if kmap.transforms:  # the map needs it: say what is wrong with it
                raise
            cfg = None  # only read for tie_word_embeddings: an unreadable one changes nothing
    else:
        cfg, _ = load_config_arg(config)
    dist = distributed.current()
    reader = open_checkpoint(src, verify=options.verify_source)
    try:
        index = reader.index()
        sources, paths = plan_import(index, kmap, cfg, prefix)
        notes = tuple(f"{out} recreated from {emb}: config.json says tie_word_embeddings and the checkpoint "
                      "stores the tied weight once" for out, emb in tied_copies(index, cfg).items())
        view = MappedReader(reader, sources, paths)
        vindex = view.index()
        chunk_bytes = chunk_bytes or universal_chunk_bytes(options)
        store = plan_universal(vindex, chunk_bytes, backend)
        tasks = store_tasks(vindex.tensors, store, chunk_bytes)  # the same plan for the dry run and the run
        if options.dry_run:
            return ConversionResult(str(dst), len(sources), 0, sum(t.nbytes for t in tasks), 0.0, plan=describe(tasks))
        header = conversion_header("import-hf", src, index, {
            "--map": option_value(key_map), "--config": option_value(cfg), "--prefix": prefix,
            "--chunk-size": chunk_bytes, **({"--backend": backend} if backend != "zarr" else {})})
        out, journal = open_destination(src, dst, header, options)
        refs, atoms = group_atoms(paths)
        # URL destination: each file is uploaded as soon as it is final
        writer = UniversalWriter(out, chunk_bytes, on_file_final=spool_hook(out), backend=backend)
        for key, entry in vindex.tensors.items():
            writer.add_tensor(entry, refs[key].atom, refs[key].role, plan=store.arrays[key])
        writer.prepare()
        for task in tasks:
            if journal.is_done(task):
                writer.restore_chunk(task.key, task.target, journal.info(task))
        stats, written = dist.execute(tasks, view, _ChunkSink(writer), workers=options.workers,
                                      memory_budget=options.memory_budget, progress=options.progress,
                                      label="import-hf", journal=journal, gather_info=dist.active)
        files = [f for f in index.info.get("files", {}) if f.endswith(".safetensors")]
        layout = f"hf {len(files)} file{'s' if len(files) != 1 else ''}"
        source = SourceInfo(format="hf", path=source_label(src), world_size=None, layout=layout)

        def publish() -> None:
            if dist.active:  # adopt the chunks the other ranks wrote
                for task in tasks:
                    writer.restore_chunk(task.key, task.target, written[task_id(task)])
            created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            writer.commit(source, __version__, atoms, created)
            dist.remove_journals(journal, out)

        dist.on_leader(publish)
        journal.remove()
        return ConversionResult(str(out), len(sources), 0, stats.bytes_written, stats.seconds, warnings=notes)
    finally:
        reader.close()
