"""Hugging Face safetensors: a validating zero-copy reader and a streaming writer.

A safetensors file is ``u64`` little-endian header length ``N``, ``N`` bytes of JSON (padded with
spaces to a multiple of 8), then the data section: every tensor's raw little-endian C-order bytes,
back to back with no gaps, at ``data_offsets`` relative to the data start. A sharded checkpoint
adds ``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {name:
file}}``) next to ``model-0000i-of-0000N.safetensors``.

:class:`HFReader` parses and validates the headers itself (no safetensors library) and reads any
row range of a tensor with one ``pread`` straight into the returned tensor's memory.

:class:`HFWriter` never needs a whole tensor in memory (the safetensors library does): every
file's header is computed up front from names, dtypes and shapes, written first, the file sized,
and each tensor's bytes are then ``pwrite``-n at their offsets as they arrive. Tensors are laid
out in the order safetensors' own writer uses (dtype rank descending, then name), so the files are
byte-identical to ``safetensors.torch.save_file(..., metadata={"format": "pt"})``. Files are
written as ``*.tmp`` and renamed when complete; the index is published last.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from formats.base import Box, CheckpointIndex, ChunkRef, Shape, TensorEntry, copy_bits_into, full_box
from formats.dtypes import by_name, by_safetensors, from_storage_array, is_torch_tensor, raw_bytes
from formats.manifest import Manifest
from formats.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DestinationError,
    InvalidCheckpointError,
    PlanError,
    UnsupportedError,
)
from formats.fsutil import atomic_write_bytes, fsync_dir, loads_json, pwrite_all, read_error, short, source_path
from formats.storage import OpenFiles, RandomFile, Storage, check_relative, close_file, open_storage, read_into

if TYPE_CHECKING:
    import torch

#: Largest header safetensors accepts (bytes).
MAX_HEADER_BYTES = 100_000_000
#: Largest index JSON accepted (bytes).
MAX_INDEX_BYTES = 100_000_000
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FORMAT_METADATA: Mapping[str, str] = {"format": "pt"}
#: huggingface_hub's default ``max_shard_size`` ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

# safetensors' Rust ``Dtype`` enum order; its writer sorts tensors by it, descending, then by name.
_WRITER_DTYPE_ORDER = (
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16",
    "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)
_DTYPE_RANK = {name: i for i, name in enumerate(_WRITER_DTYPE_ORDER)}


# ---------------------------------------------------------------------------------------------
# headers


@dataclass(frozen=True)
class StEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str  # torch dtype name
    shape: Shape
    begin: int
    end: int


@dataclass(frozen=True)
class StHeader:
    """A parsed, validated safetensors header."""

    file: str
    size: int
    data_start: int
    metadata: Mapping[str, str] | None
    tensors: Mapping[str, StEntry]


def _bad(where: str, what: str) -> InvalidCheckpointError:
    return InvalidCheckpointError(f"{where}: {what}; the file is not a valid safetensors file: re-export it")


def _parse_entry(name: str, doc: Any, data_start: int, where: str) -> StEntry:
    if not isinstance(doc, dict):
        raise _bad(where, f"header entry {name!r} is not an object")
    dtype, shape, offsets = doc.get("dtype"), doc.get("shape"), doc.get("data_offsets")
    if not isinstance(dtype, str):
        raise _bad(where, f"tensor {name!r} has no dtype")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise _bad(where, f"tensor {name!r} has a bad shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
        raise _bad(where, f"tensor {name!r} has bad data_offsets {offsets!r}")
    d = by_safetensors(dtype)
    nbytes = math.prod(shape) * d.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _bad(where, f"tensor {name!r} ({dtype} {shape}) needs {nbytes} bytes but data_offsets span "
                          f"{offsets[1] - offsets[0]}")
    return StEntry(name, d.name, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def parse_header(raw: bytes, file_size: int, where: str, file: str = "") -> StHeader:
    """Validate a header (``raw`` = the JSON bytes) of a file of ``file_size`` bytes.

    Checks what safetensors checks: JSON object, known dtypes, sizes matching shapes, offsets
    covering the data section exactly (no gaps, no overlaps, nothing past the end).
    """
    doc = loads_json(raw, f"{where} (header)", InvalidCheckpointError,
                     "the file is not a valid safetensors file: re-export it")
    if not isinstance(doc, dict):
        raise _bad(where, "header is not a JSON object")
    data_start = 8 + len(raw)
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad(where, "__metadata__ is not a map of strings")
    tensors = {name: _parse_entry(name, d, data_start, where) for name, d in doc.items()}
    cursor = data_start
    for e in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != cursor:
            what = "overlaps the previous tensor" if e.begin < cursor else "leaves a gap before it"
            raise _bad(where, f"tensor {e.name!r} at data offset {e.begin - data_start} {what}")
        cursor = e.end
    if cursor != file_size:
        raise CorruptCheckpointError(
            f"{where}: tensors end at byte {cursor} but the file has {file_size} bytes; "
            "the file is truncated or has trailing data: re-download or re-export it"
        )
    return StHeader(file, file_size, data_start, metadata, tensors)


def read_header(path: Path, file: str = "", storage: Storage | None = None, what: str = "") -> StHeader:
    """Read and validate the header of the safetensors file at ``path`` (or, with ``storage``,
    the file named ``file`` in it: local or URL, two ranged reads). ``what`` says who named the
    file, in errors."""
    try:
        fd: int | RandomFile
        if storage is not None and not storage.is_local:
            fd = storage.open_random(file)
            size = fd.size
        else:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            size = os.fstat(fd).st_size
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{short(path)}: no such safetensors file; check the path or the index") from None
    except OSError as e:  # a symlink loop, a name too long, permissions
        raise read_error(path, e, what) from None
    try:
        head = bytearray(8)
        head = head[: read_into(fd, memoryview(head), 0)]
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path}: {size} bytes is too short for a safetensors file; re-export it")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise InvalidCheckpointError(
                f"{path}: header length {n} is over the {MAX_HEADER_BYTES} byte limit; "
                "not a safetensors file (or a damaged one)"
            )
        if 8 + n > size:
            raise CorruptCheckpointError(f"{path}: header of {n} bytes runs past the end of the {size} byte file; re-export it")
        raw = bytearray(n)
        if read_into(fd, memoryview(raw), 8) != n:
            raise CorruptCheckpointError(f"{path}: file shrank while reading its header")
    finally:
        close_file(fd)
    return parse_header(bytes(raw), size, str(path), file or path.name)


# ---------------------------------------------------------------------------------------------
# the index


def read_index(path: Path, storage: Storage | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """``(weight_map, metadata)`` of a ``model.safetensors.index.json``, validated (with
    ``storage``: the index file in it, local or URL)."""
    remote = storage is not None and not storage.is_local
    try:
        size = storage.size(INDEX_FILE) if remote else path.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise InvalidCheckpointError(f"{path}: {size} bytes is over the {MAX_INDEX_BYTES} byte limit for an index")
        raw = storage.read_bytes(INDEX_FILE) if remote else path.read_bytes()
    except OSError as e:
        raise read_error(path, e) from None
    doc = loads_json(raw, f"{path} (malformed index)", InvalidCheckpointError, "re-export the checkpoint")
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise InvalidCheckpointError(f"{path}: index has no \"weight_map\" object; re-export the checkpoint")
    wmap = doc["weight_map"]
    bad = [k for k, v in wmap.items() if not isinstance(v, str) or not v]
    if bad:
        raise InvalidCheckpointError(f"{path}: weight_map entry {bad[0]!r} does not name a file; fix the index")
    meta = doc.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise InvalidCheckpointError(f"{path}: index \"metadata\" is not an object; fix the index")
    return dict(wmap), dict(meta or {})


def natural_key(name: str) -> tuple:
    """Sort key comparing digit runs as numbers: ``layers.2`` before ``layers.10``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name))


#: Files of a model directory that hold weights (in any format) or index them: never companions.
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|onnx|tmp)|.*\.index\.json")


def companion_files(root: str | os.PathLike) -> list[str]:
    """The non-weight files of a local model directory (config.json, generation_config.json,
    tokenizer files, chat templates, custom modeling code, README, ...): its top-level files
    (links to files too: a hub cache snapshot is links), hidden ones excepted, that hold no
    weights and no index."""
    out = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith(".") or not entry.is_file():
            continue
        if not _WEIGHT_FILE.fullmatch(entry.name):
            out.append(entry.name)
    return out


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` (local or URL) is a directory holding safetensors files or an HF index."""
    st = open_storage(path)
    if not st.is_local:
        return any(n == INDEX_FILE or n.endswith(".safetensors") for n in st.list())
    p = st.root
    return p.is_dir() and ((p / INDEX_FILE).is_file() or any(p.glob("*.safetensors")))


# ---------------------------------------------------------------------------------------------
# reader


class HFReader:
    """Reads a Hugging Face safetensors directory (single file or sharded with an index).

    Each tensor is one chunk (the whole tensor); regions are read with one ``pread`` of the rows
    they span, straight into the returned tensor's memory. HF checkpoints hold no non-tensor
    entries.
    """

    def __init__(self, path: str | os.PathLike, verify: bool = False) -> None:
        """``verify`` is accepted for symmetry with the other readers: safetensors records no
        checksums, so what can be checked (header, sizes, exact coverage of the data, each file's
        size still matching its header when it is opened for reading) is always checked."""
        self._storage = open_storage(path)
        self.root = self._storage.root
        self._names = None if self._storage.is_local else self._storage.list()
        if not (self.root.exists() if self._storage.is_local else self._names or self._storage.exists()):
            raise CheckpointNotFoundError(f"{self.root}: no such directory; check the path")
        if not (self.root.is_dir() if self._storage.is_local else self._names):
            raise InvalidCheckpointError(f"{self.root}: is a file; pass the Hugging Face model directory")
        self._open = OpenFiles(self._storage, self._check_size)
        self._entries: dict[str, tuple[str, StEntry]] = {}
        self._index = self._build_index()

    def _files(self) -> tuple[list[str], dict[str, str] | None, dict[str, Any]]:
        index_path = self.root / INDEX_FILE
        if index_path.is_file() if self._names is None else INDEX_FILE in self._names:
            wmap, meta = read_index(index_path, self._storage)
            return list(dict.fromkeys(wmap.values())), wmap, meta
        names = sorted(p.name for p in self.root.glob("*.safetensors")) if self._names is None else sorted(
            n for n in self._names if n.endswith(".safetensors"))
        if not names:
            raise InvalidCheckpointError(f"{self.root}: no *.safetensors files and no {INDEX_FILE}; "
                                         "pass a Hugging Face model directory")
        if len(names) > 1:
            raise InvalidCheckpointError(
                f"{self.root}: {len(names)} safetensors files but no {INDEX_FILE}; a sharded checkpoint "
                "needs its index (it is written last: was the save interrupted?)"
            )
        return names, None, {}

    def _build_index(self) -> CheckpointIndex:
        files, wmap, meta = self._files()
        headers: dict[str, StHeader] = {}
        for f in files:
            try:
                path = (source_path(self.root, f, f"named by {INDEX_FILE}") if self._storage.is_local
                        else self.root / check_relative(self.root, f))
            except DestinationError:
                raise InvalidCheckpointError(
                    f"{self.root / INDEX_FILE}: names file {short(repr(f))}, outside the checkpoint directory; fix the index"
                ) from None
            headers[f] = read_header(path, f, self._storage, f"named by {INDEX_FILE}" if wmap is not None else "")
        if wmap is None:
            wmap = {name: files[0] for name in headers[files[0]].tensors}
            sharded = False
        else:
            sharded = True
        # shard order, then natural name order (layers.2 before layers.10): the model's order as
        # far as the files still show it (the index itself is sorted by name)
        names = sorted(wmap.items(), key=lambda kv: (kv[1], natural_key(kv[0])))
        tensors: dict[str, TensorEntry] = {}
        for name, f in names:
            e = headers[f].tensors.get(name)
            if e is None:
                raise CorruptCheckpointError(
                    f"{self.root / INDEX_FILE}: tensor {name!r} is mapped to {f} but that file does not "
                    "hold it; the shards and the index do not match: re-export the checkpoint"
                )
            self._entries[name] = (f, e)
            chunk = ChunkRef(full_box(e.shape), f, (f, e.begin))
            tensors[name] = TensorEntry(name, e.dtype, e.shape, (chunk,), (name,))
        sizes = {f: h.size for f, h in headers.items()}
        info: dict[str, Any] = {
            "version": None,
            "files": sizes,
            "metadata_files": [INDEX_FILE] if sharded else [],
            "file_metadata": {f: dict(h.metadata) if h.metadata is not None else None for f, h in headers.items()},
            "index_metadata": meta,
            "sharded": sharded,
        }
        if sharded:
            info["files"][INDEX_FILE] = self._storage.size(INDEX_FILE)
        return CheckpointIndex("hf", str(self.root), tensors, {}, info)

    def index(self) -> CheckpointIndex:
        """The checkpoint's index (built and validated on open)."""
        return self._index

    def _fd(self, file: str) -> int | RandomFile:
        """An fd (local) or a ranged-read file (URL), opened once per file."""
        return self._open.get(file)

    def _check_size(self, file: str, path: Path, fd: int) -> None:
        """A local file opened for reading must still have its header's size."""
        size, expected = os.fstat(fd).st_size, self._index.info["files"].get(file)
        if expected is not None and size != expected:  # safetensors has no checksums: sizes at least
            os.close(fd)
            raise CorruptCheckpointError(f"{path}: {size} bytes now, {expected} when its header was read; the "
                                         "file changed during the conversion: rerun it")

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        """A new contiguous tensor holding ``region``: one pread of the rows it spans."""
        file, e, local = self._locate(key, chunk, region)
        return from_storage_array(self._read_bits(file, e, local), e.dtype)

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` (writable, exactly the region's bytes) with ``region`` in C order; a region
        of whole rows is read straight into ``out``."""
        file, e, local = self._locate(key, chunk, region)
        if not e.shape or local.sizes[1:] == e.shape[1:]:
            self._read_rows(file, e, local, out)
            return
        bits = self._read_bits(file, e, local)
        copy_bits_into(bits, out)

    def _locate(self, key: str, chunk: ChunkRef, region: Box) -> tuple[str, StEntry, Box]:
        """(file, stored tensor, ``region`` in the stored tensor's own coordinates) of ``chunk``."""
        found = self._entries.get(key)
        if found is None:
            raise PlanError(f"{self.root}: no tensor {key!r} in this checkpoint")
        file, e = found
        if region.ndim != len(e.shape) or not full_box(e.shape).contains(region):
            raise PlanError(f"key {key!r}: region {region.to_json()} is not inside the tensor {list(e.shape)}")
        return file, e, region

    def _read_rows(self, file: str, e: StEntry, local: Box, out: memoryview) -> None:
        """Read the rows ``local`` (a box of whole rows of ``e``) spans into ``out``, which holds
        exactly them."""
        row = math.prod(e.shape[1:]) * by_name(e.dtype).itemsize
        r0 = local.offsets[0] if e.shape else 0
        if read_into(self._fd(file), out, e.begin + r0 * row) != len(out):
            raise CorruptCheckpointError(f"{self.root / file}: truncated while reading {e.name!r}; re-export it")

    def _read_bits(self, file: str, e: StEntry, local: Box) -> np.ndarray:
        """The box ``local`` of ``e`` as a new bit array (storage dtype), read with one pread of its
        rows."""
        d = by_name(e.dtype)
        r0, r1 = (local.offsets[0], local.ends[0]) if e.shape else (0, 1)
        rows = np.empty((r1 - r0, *e.shape[1:]) if e.shape else (), dtype=d.numpy_dtype)
        self._read_rows(file, e, Box((r0, *local.offsets[1:]), (r1 - r0, *e.shape[1:])) if e.shape else local,
                        memoryview(rows.reshape(-1).view(np.uint8)))
        if not e.shape or local.sizes[1:] == e.shape[1:]:
            return rows
        return np.ascontiguousarray(rows[(slice(None),) + local.slices()[1:]])

    def read_object_bytes(self, key: str) -> bytes:
        raise PlanError(f"{self.root}: Hugging Face checkpoints hold no non-tensor entries (asked for {key!r})")

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        return self.read_object_bytes(key)

    def close(self) -> None:
        """Close open files (they are reopened if the reader is used again)."""
        self._open.close()

    def __enter__(self) -> HFReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# writer: pure layout


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: HF name, torch dtype name, shape."""

    name: str
    dtype: str
    shape: Shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * by_name(self.dtype).itemsize

    @property
    def st_dtype(self) -> str:
        return by_name(self.dtype).safetensors


@dataclass(frozen=True)
class FilePlan:
    """One output file: its name, the tensors in file order, the header bytes and offsets."""

    name: str
    tensors: tuple[TensorSpec, ...]
    header: bytes  # the u64 length and the padded JSON
    offsets: Mapping[str, int] = field(default_factory=dict)  # name -> absolute begin

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def split_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors into shards as huggingface_hub's ``split_torch_state_dict_into_shards`` does.

    Greedy in the given order: a tensor that would take the current shard over the limit starts a
    new shard; a tensor bigger than the limit gets a shard of its own (appended at once, before the
    shard being filled).
    """
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    first_empty: list[TensorSpec] | None = None  # hub groups every empty tensor with the first one
    for spec in specs:
        n = spec.nbytes
        if n == 0 and first_empty is not None:
            first_empty.append(spec)  # (they share storage id (cpu, data_ptr 0, 0) in huggingface_hub)
            continue
        if n == 0:
            first_empty = current
        if n > max_shard_bytes:
            shards.append([spec])
            continue
        if size + n > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += n
    if current:
        shards.append(current)
    return shards


def shard_names(n: int) -> list[str]:
    """HF file names for ``n`` shards (``model.safetensors`` for one)."""
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def writer_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """The order safetensors' writer lays tensors out: dtype rank descending, then name."""
    return sorted(specs, key=lambda s: (-_DTYPE_RANK[s.st_dtype], s.name.encode("utf-8")))


def build_header(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None) -> tuple[bytes, dict[str, int]]:
    """(header bytes with the length prefix, name -> begin relative to the data start) for tensors
    in file order, byte-identical to what safetensors writes."""
    doc: dict[str, Any] = {}
    if metadata is not None:
        doc["__metadata__"] = dict(metadata)
    offsets, cursor = {}, 0
    for s in specs:
        doc[s.name] = {"dtype": s.st_dtype, "shape": list(s.shape), "data_offsets": [cursor, cursor + s.nbytes]}
        offsets[s.name] = cursor
        cursor += s.nbytes
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise UnsupportedError(f"safetensors header of {len(text)} bytes is over the {MAX_HEADER_BYTES} byte limit; "
                               "use a smaller --max-shard-size")
    return struct.pack("<Q", len(text)) + text, offsets


@dataclass(frozen=True)
class ShardLayout:
    """A given file layout (another checkpoint's, ``export-hf --like``): each file's name and its
    tensors in file order, each file's ``__metadata__``, and whether an index is written."""

    files: tuple[tuple[str, tuple[str, ...]], ...]
    metadata: Mapping[str, Mapping[str, str] | None] = field(default_factory=dict)
    index: bool = True
    #: the index's ``metadata`` fields other than ``total_size`` (kept as they are)
    index_metadata: Mapping[str, Any] = field(default_factory=dict)


def plan_files(specs: Sequence[TensorSpec], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
               metadata: Mapping[str, str] | None = FORMAT_METADATA, layout: ShardLayout | None = None) -> list[FilePlan]:
    """Every output file with its tensors, header and offsets (pure): huggingface_hub's split and
    safetensors' tensor order, or exactly ``layout`` (every spec in one of its files)."""
    for s in specs:
        if s.st_dtype not in _DTYPE_RANK:
            raise UnsupportedError(f"tensor {s.name!r}: dtype {s.dtype} cannot be written to safetensors by torch; "
                                   "cast it with --dtype or drop it with a key map")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"two tensors would both be written as {dup!r}; fix the key map")
    if layout is not None:
        return _layout_files(specs, layout)
    groups = split_shards(specs, max_shard_bytes) if specs else [[]]
    plans = []
    for name, group in zip(shard_names(len(groups)), groups):
        ordered = writer_order(group)
        header, rel = build_header(ordered, metadata)
        plans.append(FilePlan(name, tuple(ordered), header, {k: len(header) + v for k, v in rel.items()}))
    return plans


def _layout_files(specs: Sequence[TensorSpec], layout: ShardLayout) -> list[FilePlan]:
    by_name = {s.name: s for s in specs}
    placed = [n for _, names in layout.files for n in names]
    if sorted(placed) != sorted(by_name):
        extra = sorted(set(by_name) - set(placed)) or sorted(set(placed) - set(by_name))
        raise ConfigError(f"the file layout and the tensors differ ({extra[0]!r}); internal error")
    plans = []
    for name, names in layout.files:
        ordered = [by_name[n] for n in names]
        header, rel = build_header(ordered, layout.metadata.get(name, FORMAT_METADATA))
        plans.append(FilePlan(name, tuple(ordered), header, {k: len(header) + v for k, v in rel.items()}))
    return plans


def layout_of(index: CheckpointIndex) -> ShardLayout:
    """The file layout of an HF checkpoint read by :class:`HFReader`: its files in index order,
    each file's tensors in data-offset order, its ``__metadata__``, whether it has an index."""
    files: dict[str, list[tuple[int, str]]] = {}
    for name, e in index.tensors.items():
        file, begin = e.chunks[0].locator
        files.setdefault(file, []).append((begin, name))
    meta = index.info.get("file_metadata") or {}
    order = sorted(files, key=natural_key)
    extra = {k: v for k, v in (index.info.get("index_metadata") or {}).items() if k != "total_size"}
    return ShardLayout(tuple((f, tuple(n for _, n in sorted(files[f]))) for f in order),
                       {f: meta.get(f) for f in order}, bool(index.info.get("sharded")), extra)


def index_json(plans: Sequence[FilePlan], metadata: Mapping[str, Any] | None = None) -> bytes:
    """The ``model.safetensors.index.json`` bytes, formatted as transformers writes it (extra
    ``metadata`` fields beside ``total_size``)."""
    doc = {
        "metadata": {**(metadata or {}), "total_size": sum(t.nbytes for p in plans for t in p.tensors)},
        "weight_map": {t.name: p.name for p in plans for t in p.tensors},
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------------
# writer: I/O


class SafetensorsFilesWriter:
    """Streams tensors into the safetensors files ``plans`` lays out (headers already built).

    ``start`` creates every ``<file>.tmp`` with its header, sized to its final length; then
    :meth:`write_at` ``pwrite``s any byte range of any tensor of any file (thread-safe, ranges
    written once); ``commit`` checks that every byte was written, fsyncs, renames each file into
    place and writes ``index`` (name, bytes), if any, last. ``abort`` removes the temp files.
    Tensors are addressed by ``(file, name)``: one name may lie in several files.
    """

    def __init__(self, root: str | os.PathLike, plans: Sequence[FilePlan],
                 index: tuple[str, bytes] | None = None) -> None:
        self.root = Path(root)
        self.plans = list(plans)
        self.index = index
        self._where: dict[tuple[str, str], tuple[FilePlan, int, int]] = {
            (p.name, t.name): (p, p.offsets[t.name], t.nbytes) for p in self.plans for t in p.tensors
        }
        self._fds: dict[str, int] = {}
        self._written: dict[tuple[str, str], int] = dict.fromkeys(self._where, 0)
        self._lock = threading.Lock()

    def _tmp(self, plan: FilePlan) -> Path:
        return self.root / f"{plan.name}.tmp"

    def names(self) -> list[str]:
        """Every file this writer publishes, the index last."""
        return [p.name for p in self.plans] + ([self.index[0]] if self.index is not None else [])

    def start(self, resume: bool = False) -> None:
        """Create every temp file: header written, sized to its final length.

        ``resume`` keeps the bytes of an interrupted run (files it already renamed into place go
        back to their temp names until the commit).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        if resume:
            for plan in self.plans:
                if (self.root / plan.name).exists() and not self._tmp(plan).exists():
                    os.replace(self.root / plan.name, self._tmp(plan))
        for name in [p.name for p in self.plans] + [self.index[0] if self.index is not None else INDEX_FILE]:
            if (self.root / name).exists():
                raise DestinationError(f"{self.root / name}: already exists; choose an empty directory")
        trunc = 0 if resume else os.O_TRUNC
        for plan in self.plans:
            fd = os.open(self._tmp(plan), os.O_CREAT | trunc | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644)
            self._fds[plan.name] = fd
            pwrite_all(fd, memoryview(plan.header), 0)
            os.ftruncate(fd, plan.size)

    def write_at(self, file: str, name: str, byte_offset: int, data: memoryview) -> None:
        """Write ``data`` at ``byte_offset`` within the bytes of tensor ``name`` of ``file``."""
        plan, begin, nbytes = self._where[(file, name)]
        if byte_offset < 0 or byte_offset + len(data) > nbytes:
            raise PlanError(f"tensor {name!r} of {file}: write of {len(data)} bytes at {byte_offset} is outside "
                            f"its {nbytes} bytes")
        pwrite_all(self._fds[plan.name], data, begin + byte_offset)
        with self._lock:
            self._written[(file, name)] += len(data)

    def adopt_at(self, file: str, name: str) -> None:
        """Count tensor ``name`` of ``file`` as written by an interrupted run (resume)."""
        with self._lock:
            self._written[(file, name)] = self._where[(file, name)][2]

    def headers(self) -> dict[str, tuple[dict[str, str] | None, dict[str, tuple[str, Shape, int, int]]]]:
        """What each file's header (written by :meth:`start`) records: file -> (``__metadata__``,
        name -> (torch dtype name, shape, first byte, end byte)), byte offsets in the file."""
        out = {}
        for plan in self.plans:
            n = struct.unpack("<Q", plan.header[:8])[0]
            doc = json.loads(plan.header[8:8 + n])
            meta = doc.pop("__metadata__", None)
            out[plan.name] = (meta, {name: (by_safetensors(e["dtype"]).name, tuple(e["shape"]),
                                            8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1])
                                     for name, e in doc.items()})
        return out

    def manifest(self, suffix: str = "", where: str = "") -> Manifest:
        """What :meth:`commit` is about to publish, read from its files' headers and the index it
        writes, for files of whole tensors (HF, hub-shaped): each tensor a loader finds (through
        the index, where there is one) with its dtype and shape (its key + ``suffix``), each
        tensor's byte range (files named ``where`` + name), and any tensor the index and the headers
        disagree on, any file its tensors do not cover, any tensor not all written."""
        m = Manifest()
        headers = self.headers()
        for plan in self.plans:
            entries = headers[plan.name][1]
            for name, (_, _, begin, end) in entries.items():
                m.extent(name + suffix, where + plan.name, begin, end)
            data_start = struct.unpack("<Q", plan.header[:8])[0] + 8
            stored = sum(end - begin for _, _, begin, end in entries.values())
            if data_start + stored != plan.size:  # safetensors: the data is covered, no gaps
                m.problem(f"{plan.name}: its tensors hold {stored} bytes of the {plan.size - data_start} "
                          "after the header")
        if self.index is not None:
            weight_map = json.loads(self.index[1])["weight_map"]
        else:
            weight_map = {name: file for file, (_, entries) in headers.items() for name in entries}
        for name, file in weight_map.items():
            e = headers.get(file, (None, {}))[1].get(name)
            if e is None:
                m.problem(f"tensor {name!r}: the index names {file}, whose header does not hold it")
                continue
            m.tensor(name + suffix, e[0], e[1])
        unlisted = next((n for f, (_, entries) in headers.items() for n in entries if weight_map.get(n) != f), None)
        if unlisted is not None:
            m.problem(f"tensor {unlisted!r} is in a file's header but the index does not lead to it")
        self.unwritten(m)
        return m

    def unwritten(self, m: Manifest) -> None:
        """Add to ``m`` the first tensor whose bytes are not all written (or adopted)."""
        short_written = next((k for k, w in self._written.items() if w != self._where[k][2]), None)
        if short_written is not None:
            file, name = short_written
            m.problem(f"tensor {name!r} of {file}: {self._written[short_written]} of its "
                      f"{self._where[short_written][2]} bytes written")

    def commit(self) -> list[str]:
        """fsync, rename every file into place, then publish the index (if any)."""
        short = [n for n, w in self._written.items() if w != self._where[n][2]]
        if short:
            file, name = short[0]
            raise CorruptCheckpointError(
                f"internal error: tensor {name!r} of {file} got {self._written[short[0]]} of "
                f"{self._where[short[0]][2]} bytes")
        for plan in self.plans:
            fd = self._fds.pop(plan.name)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self._tmp(plan), self.root / plan.name)
        fsync_dir(self.root)
        if self.index is not None:
            atomic_write_bytes(self.root / self.index[0], self.index[1])
        return self.names()

    def sync(self) -> None:
        """fdatasync every temp file (before the journal records finished tensors)."""
        for fd in list(self._fds.values()):
            os.fdatasync(fd)

    def close(self) -> None:
        """Close the temp files and keep them, for ``--resume``."""
        for name, fd in list(self._fds.items()):
            os.close(fd)
            self._fds.pop(name)

    def abort(self) -> None:
        """Close and remove the temp files (published files are left alone)."""
        self.close()
        for plan in self.plans:
            self._tmp(plan).unlink(missing_ok=True)


class HFWriter(SafetensorsFilesWriter):
    """Streams tensors into HF safetensors files laid out by :func:`plan_files` (or exactly as a
    given ``layout``); tensors are addressed by name (each lies in one file); the index is written
    for a sharded output (or where the layout has one)."""

    def __init__(self, root: str | os.PathLike, specs: Sequence[TensorSpec],
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 metadata: Mapping[str, str] | None = FORMAT_METADATA, layout: ShardLayout | None = None) -> None:
        plans = plan_files(specs, max_shard_bytes, metadata, layout)
        write_index = layout.index if layout is not None else len(plans) > 1
        extra = dict(layout.index_metadata) if layout is not None else {}
        super().__init__(root, plans, (INDEX_FILE, index_json(plans, extra)) if write_index else None)
        self._file_of = {t.name: p.name for p in self.plans for t in p.tensors}
        self._itemsize = {t.name: by_name(t.dtype).itemsize for p in self.plans for t in p.tensors}

    @property
    def sharded(self) -> bool:
        """Whether an index is written (several files, or a layout that has one)."""
        return self.index is not None

    def write(self, name: str, byte_offset: int, data: memoryview) -> None:
        """Write ``data`` at ``byte_offset`` within tensor ``name``'s bytes."""
        self.write_at(self._file_of[name], name, byte_offset, data)

    def write_tensor(self, name: str, element_offset: int, tensor: Any) -> None:
        """Write a contiguous run of elements of ``name`` starting at flat index ``element_offset``.

        ``tensor`` is a bit array (numpy, storage dtype) or a torch tensor of the tensor's dtype.
        """
        if is_torch_tensor(tensor):
            tensor = tensor.detach()
        self.write(name, element_offset * self._itemsize[name], raw_bytes(tensor))

    def adopt(self, name: str) -> None:
        """Count tensor ``name`` as written by an interrupted run (resume)."""
        self.adopt_at(self._file_of[name], name)
