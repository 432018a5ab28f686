"""DCP ``.metadata``: allowlist unpickling and parsing into plain frozen dataclasses.

``.metadata`` is a plain pickle of ``torch.distributed.checkpoint.metadata.Metadata``; torch loads it
with ``pickle.load`` (arbitrary code). Here only the globals DCP itself writes are accepted, and
they resolve to inert stand-ins (:mod:`formats.dcp.safe_pickle`), so nothing in the file runs.
The result is a :class:`DCPMetadata` that carries no torch DCP classes.

Non-tensor entries (each a ``torch.save`` archive) load with ``torch.load(weights_only=True)``
unless the caller trusts the pickle (:func:`load_object_bytes`).
"""

from __future__ import annotations

import contextlib
import gc
import operator
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from itertools import compress, count, repeat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, NamedTuple

from formats.base import Box
from formats.dcp.metadata_fast import fast_loads
from formats.dcp.safe_pickle import SAFE_BUILTINS, DTypeRef, Record, record_class, safe_loads
from formats.dcp.safe_pickle import resolve_torch_dtype, resolve_torch_layout
from formats.errors import CorruptCheckpointError, IncompleteCheckpointError
from formats.fsutil import short

Shape = tuple[int, ...]

#: Largest ``.metadata`` pickle accepted (bytes).
MAX_METADATA_BYTES = 2 << 30
METADATA_NAME = ".metadata"
RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")

_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"
#: Dataclasses pickled by the million: records the C unpickler fills itself.
_FAST = ("TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex")
_RECORDS: dict[tuple[str, str], type[Record]] = {
    (_DCP_MD, n): record_class(n, fast=n in _FAST)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
    )
}
_RECORDS[(_DCP_FS, "_StorageInfo")] = record_class("_StorageInfo", fast=True)
#: torch's own plain planner dataclasses, which Megatron-core's torch_dist backend stores in an extra
#: ``Metadata.all_local_plans`` attribute (its save-plan cache). Built as inert records like the
#: rest (no torch class is imported, nothing is called) and not used: no ``dcp.load`` reads them.
#: ``WriteItemType`` is an Enum: REDUCE with its int value, which a record keeps as an argument.
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
for _name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"):
    _RECORDS[(_DCP_PLANNER, _name)] = record_class(_name)
_RECORD_KINDS = {cls._kind: cls for cls in _RECORDS.values()}


def _mem_format(value: Any) -> int:
    """Stand-in for ``_MEM_FORMAT_ENCODING(value)`` (the memory format is deprecated; kept as int)."""
    return int(value)


def _layout(name: Any) -> str:
    """Stand-in for ``torch.serialization._get_layout("torch.strided")``."""
    return str(name).removeprefix("torch.")


_FIXED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): tuple,  # the builtin: REDUCE then runs no Python code (elements checked later)
    (_DCP_MD, "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): PurePosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib", "WindowsPath"): PureWindowsPath,
    ("pathlib", "PureWindowsPath"): PureWindowsPath,
    **SAFE_BUILTINS,
}


def _resolve_metadata_global(module: str, name: str) -> Any:
    found = _RECORDS.get((module, name)) or _FIXED.get((module, name))
    if found is not None:
        return found
    return resolve_torch_dtype(module, name) or resolve_torch_layout(module, name)


# ---------------------------------------------------------------------------------------------
# Parsed, torch-free metadata


#: A chunk's box in global coordinates (``ChunkStorageMetadata``): the index's own box type, so
#: the reader uses the parsed boxes as they are.
ChunkMeta = Box


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A tensor entry: torch dtype name (``"bfloat16"``), global size, chunks."""

    dtype: str
    size: Shape
    chunks: tuple[ChunkMeta, ...]


@dataclass(frozen=True)
class BytesMeta:
    """A non-tensor entry (serialized with ``torch.save``)."""


class StorageInfo(NamedTuple):
    """Where an item's bytes live: ``[offset, offset + length)`` of ``relative_path`` (a named tuple:
    one per chunk, and the reader's chunk locator as it is)."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class StorageMetaInfo:
    """``StorageMeta`` (torch 2.4+): ids of the save and the stateful modules."""

    checkpoint_id: str | None
    save_id: str | None
    load_id: str | None
    modules: tuple[str, ...]


StorageKey = tuple[str, "Shape | None"]  # (fqn, chunk offsets) ; offsets None for bytes entries


@dataclass(frozen=True)
class DCPMetadata:
    """A parsed ``.metadata`` (or the merge of ``__<rank>.metadata`` files). Read-only mappings."""

    entries: Mapping[str, TensorMeta | BytesMeta]
    planner_data: Mapping[str, tuple[str | int, ...]]
    storage: Mapping[StorageKey, StorageInfo]
    storage_meta: StorageMetaInfo | None
    version: str | None
    sources: tuple[str, ...]  # file names the metadata came from


# ---------------------------------------------------------------------------------------------
# Parsing


_VALID_SHAPES: dict[Shape, Shape] = {}  # shapes repeat across chunks: validate each once


def _shape(value: Any, source: str, what: str) -> Shape:
    """``value`` as a shape tuple; ``what`` (a key) names it in the error message."""
    try:
        return _VALID_SHAPES[value]
    except (KeyError, TypeError):
        pass
    if type(value) not in (tuple, list) or not all(type(v) is int and v >= 0 for v in value):
        raise CorruptCheckpointError(f"{source}: {what!r}: expected a shape, got {value!r}")
    value = tuple(value)
    if len(_VALID_SHAPES) < 65536:
        _VALID_SHAPES[value] = value
    return value


def _kind(obj: Any) -> str:
    return getattr(obj, "_kind", type(obj).__name__)


def _expect(obj: Any, kind: str, source: str, what: str) -> Record:
    if getattr(obj, "_kind", None) != kind:
        raise CorruptCheckpointError(f"{source}: {what!r}: expected {kind}, got {_kind(obj)}")
    return obj


def _parse_tensor(rec: Record, source: str, key: str) -> TensorMeta:
    what = key
    props = _expect(rec.get("properties", 0), "TensorProperties", source, what)
    dtype = props.get("dtype", 0)
    if isinstance(props.state, tuple) and props.state and isinstance(props.state[0], DTypeRef):
        dtype = props.state[0]  # TensorProperties.__getstate__ pickles a tuple
    if not isinstance(dtype, DTypeRef):
        raise CorruptCheckpointError(f"{source}: key {key!r}: tensor has no dtype ({dtype!r})")
    size = _shape(rec.get("size", 1), source, what)
    raw = rec.get("chunks", 2) or ()
    if type(raw) is list and raw:
        types = set(map(type, raw))
        if not types - {Box}:  # read by the fast reader
            return TensorMeta(dtype.name, size, tuple(raw))
        if Box in types:  # read by the fast reader but for a few records (cut by a pickle frame)
            chunks = list(raw)
            for i in _not_of_type(chunks, Box):
                chunks[i] = _parse_chunk(chunks[i], source, what)
            return TensorMeta(dtype.name, size, tuple(chunks))
    boxes = _fast_chunks(raw)
    if boxes is not None:
        return TensorMeta(dtype.name, size, boxes)
    return TensorMeta(dtype.name, size, tuple([_parse_chunk(c, source, what) for c in raw]))


def _not_of_type(items: list, kind: type, *more: tuple[list, type]) -> list[int]:
    """Indexes of the items not of type ``kind`` (or, pairwise, of ``more``'s lists not of their
    types), found by C-level loops."""
    bad = map(operator.is_not, map(type, items), repeat(kind))
    for other, other_kind in more:
        bad = map(operator.or_, bad, map(operator.is_not, map(type, other), repeat(other_kind)))
    return list(compress(count(), bad))


def _parse_chunk(c: Any, source: str, what: str) -> ChunkMeta:
    """One entry of a tensor's ``chunks`` list as a ChunkMeta."""
    if type(c) is Box:  # read by the fast reader (validated there)
        return c
    if type(c) is _RECORDS[(_DCP_MD, "ChunkStorageMetadata")] and len(c) == 1 and type(c[0]) is dict:
        d = c[0]  # what torch writes
        offsets, sizes = d.get("offsets"), d.get("sizes")
        if offsets is not None and sizes is not None:
            return ChunkMeta(_shape(offsets, source, what), _shape(sizes, source, what))
    c = _expect(c, "ChunkStorageMetadata", source, what)
    return ChunkMeta(_shape(c.get("offsets", 0), source, what), _shape(c.get("sizes", 1), source, what))


_OFFSETS_SIZES = operator.itemgetter("offsets", "sizes")


def _fast_chunks(raw: Any) -> tuple[Box, ...] | None:
    """The boxes of a chunk list exactly as torch writes it (records with a dict state holding
    shapes seen before), with the per-chunk work in C-level ``map``; None when anything differs
    (the caller then checks chunk by chunk and says what is wrong)."""
    fast = _RECORDS[(_DCP_MD, "ChunkStorageMetadata")]
    if type(raw) is not list or set(map(type, raw)) - {fast} or set(map(len, raw)) - {1}:
        return None
    states = [c[0] for c in raw]
    if set(map(type, states)) - {dict}:
        return None
    try:
        pairs = list(map(_OFFSETS_SIZES, states))
        valid = _VALID_SHAPES
        return tuple([Box(valid[o], valid[s]) for o, s in pairs])
    except (KeyError, TypeError):  # a missing field, or a shape not validated yet
        return None


def _parse_entries(raw: Any, source: str) -> dict[str, TensorMeta | BytesMeta]:
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{source}: state_dict_metadata is not a dict")
    out: dict[str, TensorMeta | BytesMeta] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{source}: non-string key {key!r}")
        kind = _kind(value)
        if kind == "BytesStorageMetadata":
            out[key] = BytesMeta()
        elif kind == "TensorStorageMetadata":
            out[key] = _parse_tensor(value, source, key)
        else:
            raise CorruptCheckpointError(f"{source}: key {key!r} has unknown entry type {kind}")
    return out


def _parse_storage(raw: Any, source: str) -> dict[StorageKey, StorageInfo]:
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(
            f"{source}: storage_data is not a dict of _StorageInfo (a custom storage writer?)"
        )
    if raw and not set(map(type, raw)) - {tuple} and not set(map(type, raw.values())) - {StorageInfo}:
        return raw  # every item read by the fast reader: already (fqn, offsets) -> StorageInfo
    # the items the fast reader did not read (all, or a few cut by a pickle frame), in order
    keys, infos = list(raw), list(raw.values())
    for i in _not_of_type(keys, tuple, (infos, StorageInfo)):
        keys[i], infos[i] = _parse_storage_item(keys[i], infos[i], source)
    return dict(zip(keys, infos))


def _parse_storage_item(index: Any, info: Any, source: str) -> tuple[StorageKey, StorageInfo]:
    """One ``storage_data`` item (MetadataIndex -> _StorageInfo) as ``(fqn, offsets), StorageInfo``."""
    if type(index) is tuple and type(info) is StorageInfo:  # read by the fast reader
        return index, info
    index_type, info_type = _RECORDS[(_DCP_MD, "MetadataIndex")], _RECORDS[(_DCP_FS, "_StorageInfo")]
    if (type(index) is index_type and type(info) is info_type and len(index) == 1
            and len(info) == 1 and type(index[0]) is dict and type(info[0]) is dict):  # what torch writes
        d, f = index[0], info[0]
        fqn, offset = d.get("fqn"), d.get("offset")
        path, start, length = f.get("relative_path"), f.get("offset"), f.get("length")
        if (type(fqn) is str and type(path) is str and path and type(start) is int
                and type(length) is int and start >= 0 and length >= 0
                and not f.get("transform_descriptors")):
            if offset is not None:
                offset = _shape(offset, source, fqn)
            return (fqn, offset), StorageInfo(path, start, length, ())
    index = _expect(index, "MetadataIndex", source, "storage_data key")
    fqn = index.get("fqn", 0)
    if type(fqn) is not str:
        raise CorruptCheckpointError(f"{source}: storage_data key has no fqn")
    offset = index.get("offset", 1)
    if offset is not None:
        offset = _shape(offset, source, fqn)
    info = _expect(info, "_StorageInfo", source, fqn)
    return (fqn, offset), _parse_storage_info(info, source, fqn)


def _parse_storage_info(info: Record, source: str, fqn: str) -> StorageInfo:
    f = info.fields
    if "relative_path" in f and "offset" in f and "length" in f:  # fast path: a dataclass state
        path, offset, length = f["relative_path"], f["offset"], f["length"]
    else:
        path, offset, length = (info.get(n, i) for i, n in
                                enumerate(("relative_path", "offset", "length")))
    transforms = info.get("transform_descriptors", 3) or ()
    if type(path) is not str or not path:
        raise CorruptCheckpointError(f"{source}: key {fqn!r}: storage entry has no file name")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise CorruptCheckpointError(
            f"{source}: key {fqn!r}: bad storage offset/length {offset!r}/{length!r}"
        )
    if transforms:
        if type(transforms) not in (list, tuple) or not all(type(t) is str for t in transforms):
            raise CorruptCheckpointError(
                f"{source}: key {fqn!r}: bad transform_descriptors {transforms!r}"
            )
        transforms = tuple(transforms)
    return StorageInfo(path, offset, length, transforms or ())


def _parse_planner(raw: Any, source: str) -> dict[str, tuple[str | int, ...]]:
    """Each key's object path (``planner_data``: what ``dcp.save``'s flattening recorded).

    A value that is no path is left out (custom planners may store anything; the path is then
    inferred from the key). A path must name its key: ``dcp.save`` makes every key by joining
    its path with ``'.'``, so a path that joins to another name is damage, and it is refused (it
    would file the key under another object: export-hf, for one, would not see a model weight)."""
    if not isinstance(raw, dict):
        return {}
    out = {}
    for key, path in raw.items():
        if isinstance(key, str) and isinstance(path, (tuple, list)) and path:
            if all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path):
                if ".".join(map(str, path)) != key:
                    raise CorruptCheckpointError(
                        f"{source}: key {short(repr(key))}: planner data gives it the object path "
                        f"{short(repr(tuple(path)))}, which does not join to the key (dcp.save names each key by "
                        "its path joined with '.'); the metadata is damaged: save the checkpoint again")
                out[key] = tuple(path)
    return out


def _parse_storage_meta(raw: Any) -> StorageMetaInfo | None:
    if raw is None or _kind(raw) != "StorageMeta":
        return None

    def text(v: Any) -> str | None:
        return None if v is None else str(v)

    modules = raw.get("modules", 3) or ()
    return StorageMetaInfo(
        text(raw.get("checkpoint_id", 0)),
        text(raw.get("save_id", 1)),
        text(raw.get("load_id", 2)),
        tuple(str(m) for m in modules) if isinstance(modules, (list, tuple)) else (),
    )


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building many small acyclic objects (2-3x faster for large
    checkpoints: every allocation burst otherwise triggers full collections)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_metadata_bytes(data: bytes, source: str) -> DCPMetadata:
    """Unpickle (allowlisted) and parse the bytes of a ``.metadata`` file named ``source``."""
    if not data:
        raise CorruptCheckpointError(f"{source}: empty metadata file; the save did not finish")
    with gc_paused():
        root = fast_loads(data, _resolve_metadata_global, _RECORD_KINDS, StorageInfo, _intern_shape)
        if root is None:  # not exactly what dcp.save writes: the general allowlist unpickler
            root = safe_loads(data, source, _resolve_metadata_global)
        return _parse_root(root, source)


def _intern_shape(shape: Shape) -> Shape:
    """The shared tuple of a shape the fast reader validated (non-negative ints)."""
    found = _VALID_SHAPES.get(shape)
    if found is not None:
        return found
    if len(_VALID_SHAPES) < 65536:
        _VALID_SHAPES[shape] = shape
    return shape


def _parse_root(root: Any, source: str) -> DCPMetadata:
    md = _expect(root, "Metadata", source, "top-level object")
    version = md.get("version", 4)
    return DCPMetadata(
        entries=_parse_entries(md.get("state_dict_metadata", 0), source),
        planner_data=_parse_planner(md.get("planner_data", 1), source),
        storage=_parse_storage(md.get("storage_data", 2), source),
        storage_meta=_parse_storage_meta(md.get("storage_meta", 3)),
        version=None if version is None else str(version),
        sources=(os.path.basename(source),),
    )


def load_metadata_file(path: str | os.PathLike) -> DCPMetadata:
    """Read and parse one ``.metadata`` / ``__<rank>.metadata`` file."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(
            f"{path}: metadata is {size} bytes, over the {MAX_METADATA_BYTES} byte limit"
        )
    return parse_metadata_bytes(path.read_bytes(), str(path))


# ---------------------------------------------------------------------------------------------
# Per-rank metadata (dcp.save(..., use_collectives=False))


def rank_metadata_files(root: str | os.PathLike | list[str]) -> dict[int, str]:
    """``{rank: file name}`` of the ``__<rank>.metadata`` files directly under ``root`` (a local
    path or URL, or the list of names already read from it)."""
    from formats.storage import listdir

    out = {}
    for name in root if isinstance(root, list) else listdir(root):
        m = RANK_METADATA_RE.match(name)
        if m:
            out[int(m.group(1))] = name
    return out


def _merge_tensor(key: str, a: TensorMeta, b: TensorMeta, sources: str) -> TensorMeta:
    if (a.dtype, a.size) != (b.dtype, b.size):
        raise CorruptCheckpointError(
            f"{sources}: key {key!r} is {a.dtype}{list(a.size)} in one rank's metadata and "
            f"{b.dtype}{list(b.size)} in another"
        )
    seen = set(a.chunks)
    extra = tuple(c for c in b.chunks if c not in seen)  # replicated chunks: keep the first copy
    return TensorMeta(a.dtype, a.size, a.chunks + extra)


def merge_metadata(parts: Sequence[DCPMetadata]) -> DCPMetadata:
    """Merge per-rank metadata into one index (rank order; the first copy of a duplicate wins).

    Tensor chunks are united; a chunk box present on several ranks (replicated state such as
    AdamW ``step``) keeps the lowest rank's copy. A non-tensor key saved by several ranks keeps the
    lowest rank's value (each rank's own value is what ``dcp.load`` would give that rank).
    """
    if not parts:
        raise IncompleteCheckpointError("no metadata to merge")
    names = ", ".join(s for p in parts for s in p.sources)
    entries: dict[str, TensorMeta | BytesMeta] = {}
    planner: dict[str, tuple[str | int, ...]] = {}
    storage: dict[StorageKey, StorageInfo] = {}
    for part in parts:
        for key, entry in part.entries.items():
            prev = entries.get(key)
            if prev is None:
                entries[key] = entry
            elif isinstance(prev, TensorMeta) and isinstance(entry, TensorMeta):
                entries[key] = _merge_tensor(key, prev, entry, names)
            elif type(prev) is not type(entry):
                raise CorruptCheckpointError(
                    f"{names}: key {key!r} is a tensor on one rank and an object on another"
                )
        for k, v in part.planner_data.items():
            planner.setdefault(k, v)
        for k, v in part.storage.items():
            storage.setdefault(k, v)
    first = parts[0]
    return DCPMetadata(
        entries, planner, storage, first.storage_meta, first.version,
        tuple(s for p in parts for s in p.sources),
    )


# ---------------------------------------------------------------------------------------------
# Non-tensor entries


def load_object_bytes(data: bytes, source: str, key: str, trust_pickle: bool = False) -> Any:
    """The value of a non-tensor entry (a ``torch.save`` archive): :func:`formats.objects.load_torch_object`
    (plain data without torch; else torch's weights-only unpickler plus its allowlist; arbitrary
    classes only with ``trust_pickle``, which runs code from the file: only for checkpoints you trust).
    """
    from formats.objects import load_torch_object

    return load_torch_object(data, f"{source}: key {key!r}", trust_pickle)
