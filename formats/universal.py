"""The universal store (format version 1): a Zarr v3 group written and read without zarr's I/O.

Layout::

    uni/zarr.json                      group
    uni/tensors/<name>/zarr.json       one array per tensor key (name = encoded key)
    uni/tensors/<name>/c/<i>/<j>...    chunks: raw little-endian C-order bytes, no codec
    uni/objects/<n>.pt                 non-tensor entries, the exact torch.save bytes from the source
    uni/ckptconv.json                  root metadata; written last, atomically: the completion marker

Arrays use the ``bytes`` codec only (no compression), so every chunk file is the chunk's raw bytes
(edge chunks padded to the full chunk shape with zeros, as zarr does). ckptconv writes each chunk
file whole, by one writer, through a temp file and a rename; stock zarr (3.x) opens every array.
bfloat16 and float8 are stored as uint16 / uint8 bit patterns (see ``formats.dtypes``); the array
attributes ``torch_dtype`` and ``key`` name the original dtype and key.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import numpy as np
import xxhash

from formats.base import Box, CheckpointIndex, ChunkRef, ObjectEntry, TensorEntry
from formats.dtypes import BY_NAME, by_name, from_storage_array, raw_bytes, to_storage_array
from formats.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DestinationError,
    IncompleteCheckpointError,
    InvalidCheckpointError,
)
from formats.fsutil import (atomic_write_bytes, fsync_dir, loads_json, pooled_buffer, read_error, short,
                            source_path, start_writeback)
from formats.integrity import ChunkChecks
from formats.storage import Storage, check_relative, close_file, is_url, open_storage, read_into
from formats.universal_meta import (
    METADATA_FILE,
    ObjectRecord,
    SourceInfo,
    TensorRecord,
    UniversalMetadata,
)

if TYPE_CHECKING:
    import torch

TENSORS_DIR = "tensors"
OBJECTS_DIR = "objects"
_GROUP_JSON = {"zarr_format": 3, "node_type": "group", "attributes": {}}


def array_name(key: str) -> str:
    """The zarr array name for a tensor key: the key, percent-encoded where it is unsafe.

    '/' and control characters are encoded, a leading '.' or '__' too, so that a key can never
    name a path outside ``tensors/`` or a name zarr reserves; overlong names get a hash suffix.
    """
    if not key:
        return "%00empty"
    name = quote(key, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if name.startswith("__"):
        name = "%5F" + name[1:]
    if name.lower() == "zarr.json":  # the group's own metadata file lives beside the arrays
        name = "zarr%2Ejson"
    if len(name.encode()) > 200:
        name = name[:160] + "~" + xxhash.xxh3_64_hexdigest(key.encode())
    return name


def chunk_shape_for(shape: tuple[int, ...], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """A chunk shape of about ``target_bytes``: split the outermost dims first, balanced.

    Chunks are row blocks (whole trailing dims) whenever one row fits the target, so reads for
    any target mesh touch few chunks; the blocks are balanced so the last one is not a sliver.
    """
    chunk = [max(1, s) for s in shape]
    for d in range(len(shape)):
        inner = math.prod(chunk[d + 1 :]) * itemsize
        if inner * chunk[d] <= target_bytes:
            break
        if inner <= target_bytes:
            per = max(1, target_bytes // inner)
            n = math.ceil(shape[d] / per)
            chunk[d] = math.ceil(shape[d] / n)
            break
        chunk[d] = 1
    return tuple(chunk)


def chunk_grid(shape: tuple[int, ...], chunk: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], Box]]:
    """Every (chunk index, global box clipped to the shape) of a regular grid, in C order."""
    counts = [math.ceil(s / c) if s else 0 for s, c in zip(shape, chunk)]
    for flat in range(math.prod(counts)):
        idx = []
        for n in reversed(counts):
            idx.append(flat % n)
            flat //= n
        idx = tuple(reversed(idx))
        offsets = tuple(i * c for i, c in zip(idx, chunk))
        sizes = tuple(min(c, s - o) for c, s, o in zip(chunk, shape, offsets))
        yield idx, Box(offsets, sizes)


def chunk_id(index: tuple[int, ...]) -> str:
    """The checksum key of a chunk: indices joined by '.', 'c' for a 0-d array."""
    return ".".join(map(str, index)) if index else "c"


def _chunk_file(array: str, index: tuple[int, ...]) -> str:
    return "/".join([array, "c", *map(str, index)])


def _array_json(record: TensorRecord, key: str) -> dict[str, Any]:
    d = by_name(record.dtype)
    codec: dict[str, Any] = {"name": "bytes"}
    if d.numpy_dtype.itemsize > 1:
        codec["configuration"] = {"endian": "little"}
    fill: Any = False if d.storage == "bool" else 0
    if d.storage.startswith("complex"):
        fill = [0.0, 0.0]
    return {
        "shape": list(record.shape),
        "data_type": d.storage,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(record.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": [codec],
        "attributes": {"torch_dtype": record.dtype, "key": key},
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }


def _padded_bytes(data: np.ndarray, chunk: tuple[int, ...]) -> tuple[memoryview, int]:
    """The bytes to store for one chunk and the full chunk size (edge chunks padded with zeros)."""
    full = math.prod(chunk) * data.itemsize
    if data.shape == chunk or data.ndim == 0:
        return memoryview(data).cast("B"), full
    if data.shape[1:] == chunk[1:]:  # only dim 0 is short: the data is a prefix of the chunk
        return memoryview(np.ascontiguousarray(data)).cast("B"), full
    padded = np.zeros(chunk, dtype=data.dtype)
    padded[tuple(slice(0, s) for s in data.shape)] = data
    return memoryview(padded).cast("B"), full


class UniversalWriter:
    """Writes a universal store: arrays created up front, chunks written whole, metadata last."""

    def __init__(self, root: str | os.PathLike, chunk_bytes: int,
                 on_file_final: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        self.chunk_bytes = chunk_bytes
        # spool mode (a URL destination, converter/remote.py): each chunk / object file is handed to
        # ``on_file_final(relpath)`` once final (it uploads and deletes it); no local fsyncs
        self._on_final = on_file_final
        self._tensors: dict[str, TensorRecord] = {}
        self._objects: dict[str, ObjectRecord] = {}
        self._names: set[str] = set()
        self._lock = threading.Lock()
        self._unsynced: list[Path] = []
        self._synced_dirs: set[str] = set()  # directories holding only chunk files already synced
        (self.root / TENSORS_DIR).mkdir(parents=True, exist_ok=True)
        (self.root / OBJECTS_DIR).mkdir(exist_ok=True)
        for d in (self.root, self.root / TENSORS_DIR):
            (d / "zarr.json").write_text(json.dumps(_GROUP_JSON))

    def add_tensor(self, entry: TensorEntry, atom: str, role: str, *, source_split: dict[str, int] | None = None,
                   source_replicated: bool = False, tp_split_dim: int | None = None) -> TensorRecord:
        """Create the zarr array for ``entry`` (metadata only) and return its record.

        ``source_split`` / ``source_replicated`` / ``tp_split_dim`` record how the source laid the
        tensor out, for placement plans that follow the source.
        """
        name = array_name(entry.key)
        if name in self._names:
            name = f"{name}~{xxhash.xxh3_64_hexdigest(entry.key.encode())}"
        self._names.add(name)
        d = by_name(entry.dtype)
        record = TensorRecord(
            array=f"{TENSORS_DIR}/{name}",
            dtype=d.name,
            storage_dtype=d.storage,
            shape=tuple(entry.shape),
            chunk_shape=chunk_shape_for(tuple(entry.shape), d.itemsize, self.chunk_bytes),
            path=tuple(entry.path),
            atom=atom,
            role=role,
            checksums={},
            source_split=dict(source_split or {}),
            source_replicated=source_replicated,
            tp_split_dim=tp_split_dim,
        )
        array_dir = self.root / record.array
        array_dir.mkdir(parents=True, exist_ok=True)
        (array_dir / "zarr.json").write_text(json.dumps(_array_json(record, entry.key), indent=1))
        self._tensors[entry.key] = record
        return record

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], Box]]:
        """The (chunk index, box) pairs of a tensor's array; each is one write task."""
        r = self._tensors[key]
        return list(chunk_grid(r.shape, r.chunk_shape))

    def write_chunk(self, key: str, index: tuple[int, ...], tensor: Any) -> str:
        """Write one whole chunk (thread-safe across chunks): temp file, then rename; its checksum.

        ``tensor`` is the chunk's bit array (numpy, storage dtype) or a torch tensor.
        """
        record = self._tensors[key]
        data = to_storage_array(tensor)
        if data.dtype != np.dtype(record.storage_dtype):
            raise ValueError(f"{key!r}: chunk data of dtype {data.dtype}, the array stores {record.storage_dtype}")
        checksum = xxhash.xxh3_64_hexdigest(raw_bytes(data))
        payload, full = _padded_bytes(data, record.chunk_shape)
        path = self.root / _chunk_file(record.array, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(payload)
            if len(payload) < full:
                f.truncate(full)
            start_writeback(f.fileno())
        os.replace(tmp, path)
        with self._lock:
            record.checksums[chunk_id(index)] = checksum
            self._unsynced.append(path)
        if self._on_final is not None:  # spool mode: the chunk file is final
            self._on_final(_chunk_file(record.array, index))
        return checksum

    def restore_chunk(self, key: str, index: tuple[int, ...], checksum: str) -> None:
        """Adopt a chunk written by an interrupted run (resume): its file must be there."""
        record = self._tensors[key]
        path = self.root / _chunk_file(record.array, index)
        if self._on_final is None and not path.is_file():  # spool mode: uploaded, maybe by another rank
            raise CorruptCheckpointError(f"{path}: chunk of {key!r} recorded as written is missing; rerun with --overwrite")
        with self._lock:
            record.checksums[chunk_id(index)] = checksum

    def sync(self) -> None:
        """fsync every chunk file written since the last sync."""
        with self._lock:
            paths, self._unsynced = self._unsynced, []
        if self._on_final is not None:  # spool mode: the files leave this disk, no local durability
            return
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        with self._lock:
            self._synced_dirs.update(str(p.parent) for p in paths)

    def add_object(self, key: str, data: bytes, path: tuple, atom: str, role: str, json_view: Any) -> None:
        """Store a non-tensor entry's exact bytes with a JSON view."""
        file = f"{OBJECTS_DIR}/{len(self._objects):06d}.pt"
        target = self.root / file
        with open(target, "wb") as f:
            f.write(data)
        self._objects[key] = ObjectRecord(
            file=file, path=tuple(path), nbytes=len(data),
            checksum=xxhash.xxh3_64_hexdigest(data), atom=atom, role=role, json=json_view,
        )
        if self._on_final is not None:  # spool mode: the object file is final
            self._on_final(file)

    def commit(self, source: SourceInfo, tool_version: str, atoms: dict[str, dict[str, str]], created: str) -> None:
        """fsync every written file, then publish ``ckptconv.json`` atomically (the marker)."""
        missing = [
            k for k, r in self._tensors.items()
            if len(r.checksums) != sum(1 for _ in chunk_grid(r.shape, r.chunk_shape))
        ]
        if missing:
            raise CorruptCheckpointError(f"internal error: chunks of {missing[0]!r} were not all written")
        for r in self._tensors.values():  # grid order, whichever worker (or rank) finished first
            ordered = {chunk_id(idx): r.checksums[chunk_id(idx)] for idx, _ in chunk_grid(r.shape, r.chunk_shape)}
            r.checksums.clear()
            r.checksums.update(ordered)
        self.sync()  # chunk files not yet synced (the journal synced the others)
        if self._on_final is None:  # spool mode: nothing local needs to be durable
            _fsync_tree(self.root, skip_files=self._synced_dirs)
        meta = UniversalMetadata(
            tool_version=tool_version, source=source, tensors=self._tensors,
            objects=self._objects, atoms=atoms, created=created,
        )
        atomic_write_bytes(self.root / METADATA_FILE, meta.dumps())


def _fsync_tree(root: Path, skip_files: set[str] = frozenset()) -> None:
    """fsync every file and directory under ``root``; files directly in a ``skip_files``
    directory are not synced (only directories are, for their renames)."""
    for dirpath, _, files in os.walk(root):
        if dirpath in skip_files:
            fsync_dir(dirpath)
            continue
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def is_universal_store(path: str | os.PathLike | Storage) -> bool:
    """True when ``path`` (local or URL) looks like a universal store (complete or not)."""
    st = open_storage(path)
    if st.is_local:
        p = st.root
        return (p / METADATA_FILE).is_file() or ((p / TENSORS_DIR).is_dir() and (p / "zarr.json").is_file())
    names = st.list()
    return METADATA_FILE in names or (TENSORS_DIR in names and "zarr.json" in names)


def read_metadata(root: str | os.PathLike | Storage) -> UniversalMetadata:
    """The validated root metadata (local or URL); refuses an incomplete store."""
    st = open_storage(root)
    root = st.root
    names = st.list() if not st.is_local else None
    if not (root.exists() if st.is_local else names):
        raise CheckpointNotFoundError(f"{root}: no such universal store")
    meta_path = root / METADATA_FILE
    if not (meta_path.is_file() if st.is_local else METADATA_FILE in names):
        if (root / TENSORS_DIR).is_dir() if st.is_local else TENSORS_DIR in names:
            raise IncompleteCheckpointError(
                f"{root}: incomplete universal store (no {METADATA_FILE}; the conversion that wrote it "
                "did not finish): rerun to-universal with --overwrite"
            )
        raise InvalidCheckpointError(f"{root}: not a ckptconv universal store (no {METADATA_FILE})")
    doc = loads_json(st.read_bytes(METADATA_FILE), str(meta_path), fix="the store is damaged: reconvert it")
    try:
        return UniversalMetadata.from_json(doc, str(meta_path))
    except RecursionError:  # a document nested just under the parser's limit, deeper than the schema's
        raise CorruptCheckpointError(f"{meta_path}: JSON nested too deeply to read; the store is damaged: "
                                     "reconvert it") from None


#: OS errors that mean a file of the store is not where its metadata says (a damaged layout).
_LAYOUT_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def _inside(root: Path, relative: str, top: str, key: str, where: Path) -> Path:
    """``root / relative``, which must lie under ``root / top`` (no '..', absolute paths, or
    symlinks out of the store); ``root`` may be a URL."""
    if not relative.startswith(top + "/"):
        raise CorruptCheckpointError(f"{where}: key {key!r} names {short(repr(relative))}, outside {top}/ of the store; "
                                     "the metadata is damaged: reconvert it")
    if not is_url(root):
        return source_path(root, relative, f"key {key!r}")  # the rule of every reader: no way out, no loops
    try:
        return root / check_relative(root, relative)
    except DestinationError:
        raise CorruptCheckpointError(f"{where}: key {key!r} names {short(repr(relative))}, outside {top}/ of the "
                                     "store; the metadata is damaged: reconvert it") from None


def _check_record(root: Path, key: str, r: TensorRecord, where: Path, st: Storage | None = None) -> None:
    """A tensor record must be consistent before anything is planned from it: known dtype, chunk
    shape of the tensor's rank, an array path inside ``tensors/``, one checksum per chunk of the
    grid, and a first chunk file of the full chunk size (so damaged shapes cannot plan or
    allocate more than the store holds)."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: key {key!r}: {what}; the store is damaged: reconvert it")

    if r.dtype not in BY_NAME or BY_NAME[r.dtype].storage != r.storage_dtype:
        raise bad(f"dtype {r.dtype!r} stored as {r.storage_dtype!r} is not a known encoding")
    if len(r.chunk_shape) != len(r.shape):
        raise bad(f"chunk shape {list(r.chunk_shape)} does not match shape {list(r.shape)}")
    array = _inside(root, r.array, TENSORS_DIR, key, where)
    counts = [math.ceil(s / c) for s, c in zip(r.shape, r.chunk_shape)]
    if len(r.checksums) != math.prod(counts):
        raise bad(f"{len(r.checksums)} chunk checksums for a grid of {math.prod(counts)} chunks")
    if not math.prod(counts):
        return
    first = _chunk_file(r.array, tuple(0 for _ in r.shape))
    full = math.prod(r.chunk_shape) * BY_NAME[r.dtype].itemsize
    try:
        if st is None or st.is_local:
            size = array.joinpath("c", *("0" for _ in r.shape)).stat().st_size
        else:
            size = st.size(first)
    except _LAYOUT_ERRORS as e:
        raise bad(f"chunk file {first} is missing ({e.strerror or 'not found'})") from None
    except OSError as e:  # a symlink loop, a name too long
        raise read_error(root / first, e, f"key {key!r}") from None
    if size != full:
        raise bad(f"chunk file {first} has {size} bytes, a chunk needs {full}")


#: Rows of partial-row reads (TP column shards of row-block chunks) are read in batches of at
#: most this many bytes, through one pooled buffer per thread.
ROWS_BATCH_BYTES = 4 << 20


class UniversalReader:
    """The universal store's :class:`formats.base.CheckpointReader`."""

    def __init__(self, root: str | os.PathLike, verify: bool = False) -> None:
        """``verify``: check every chunk's xxh3_64 (recorded in ``ckptconv.json``) as it is read,
        once per chunk (:mod:`formats.integrity`); a mismatch raises CorruptCheckpointError naming
        the file, key and chunk."""
        self._storage = open_storage(root)
        self.root = self._storage.root
        self._checks = ChunkChecks() if verify else None
        self._paths: dict[str, Path] = {}  # chunk file -> its checked local path
        self.meta = read_metadata(self._storage)
        where = self.root / METADATA_FILE
        if not self._storage.is_local:  # one listing for the chunk checks, not a request per tensor
            self._storage.prefetch_sizes(TENSORS_DIR)
        for key, record in self.meta.tensors.items():
            _check_record(self.root, key, record, where, self._storage)
        for key, obj in self.meta.objects.items():
            _inside(self.root, obj.file, OBJECTS_DIR, key, where)
        self._index: CheckpointIndex | None = None

    def index(self) -> CheckpointIndex:
        if self._index is None:
            self._index = self._build_index()
        return self._index

    def _build_index(self) -> CheckpointIndex:
        tensors = {}
        for key, r in self.meta.tensors.items():
            chunks = tuple(
                ChunkRef(box=box, file=_chunk_file(r.array, idx), locator=(key, idx))
                for idx, box in chunk_grid(r.shape, r.chunk_shape)
            )
            tensors[key] = TensorEntry(key, r.dtype, r.shape, chunks, r.path)
        objects = {
            key: ObjectEntry(key, o.path, o.file, locator=key, nbytes=o.nbytes)
            for key, o in self.meta.objects.items()
        }
        src = self.meta.source
        info = {
            "version": "1",
            "tool_version": self.meta.tool_version,
            "source": src.__dict__,
            "world_size": None,
            "atoms": self.meta.atoms,
        }
        return CheckpointIndex("universal", str(self.root), tensors, objects, info)

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        """Read ``region`` of one chunk; row slabs are read with a single pread."""
        record = self.meta.tensors[key]
        result: list[np.ndarray] = []

        def read_checked() -> None:  # the whole chunk: check the bytes just read
            result.append(np.require(self._read_chunk_part(record, chunk, region), requirements="C"))  # 0-d stays 0-d
            self._compare(key, record, chunk, xxhash.xxh3_64_hexdigest(memoryview(result[0]).cast("B")))

        self._check(key, record, chunk, region, read_checked)
        data = result[0] if result else self._read_chunk_part(record, chunk, region)
        return from_storage_array(data, record.dtype)

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` (writable bytes, exactly the region's size) with ``region`` in C order;
        a region of whole chunk rows is read straight into ``out`` (one pread, no copy)."""
        record = self.meta.tensors[key]

        def read_checked() -> None:  # the whole chunk: check the bytes just read
            self._read_into(record, chunk, region, out)
            self._compare(key, record, chunk, xxhash.xxh3_64_hexdigest(memoryview(out).cast("B")))

        if not self._check(key, record, chunk, region, read_checked):
            self._read_into(record, chunk, region, out)

    def _check(self, key: str, record: TensorRecord, chunk: ChunkRef, region: Box,
               read_checked: Callable[[], None]) -> bool:
        """Check the chunk's xxh3_64 if this reader verifies and nobody checked it yet: by
        ``read_checked()`` (which reads the region and checks the bytes it read) when the region
        is the whole chunk, else by a streamed pass over the chunk file. True when
        ``read_checked`` ran (the region is read)."""
        checks = self._checks
        if checks is None or checks.done(chunk.locator):
            return False
        if region == chunk.box:
            return checks.once(chunk.locator, read_checked)
        checks.once(chunk.locator, lambda: self._compare(key, record, chunk, self._stream_checksum(record, chunk)))
        return False

    def _compare(self, key: str, record: TensorRecord, chunk: ChunkRef, actual: str) -> None:
        cid = chunk_id(chunk.locator[1])
        expected = record.checksums.get(cid, "")
        if actual != expected:
            raise CorruptCheckpointError(
                f"{self.root / chunk.file}: key {key!r} chunk {cid}: xxh3_64 {actual} != recorded {expected}; the "
                "chunk's bytes are damaged: reconvert the store (--no-verify-source copies them anyway)")

    def _read_into(self, record: TensorRecord, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        cshape = record.chunk_shape
        if not cshape or region.sizes[0] <= 1 or region.sizes[1:] == cshape[1:]:
            batches = [(0, region)]  # one row, or whole rows: one read straight into ``out``
        else:  # partial rows: read full rows in batches of at most ROWS_BATCH_BYTES (bounded buffer)
            row = math.prod(cshape[1:]) * np.dtype(record.storage_dtype).itemsize
            step = max(1, ROWS_BATCH_BYTES // row)
            r0, o, s = region.offsets[0], region.offsets[1:], region.sizes[1:]
            batches = [(a, Box((r0 + a, *o), (min(step, region.sizes[0] - a), *s)))
                       for a in range(0, region.sizes[0], step)]
        region_row = len(out) // max(1, region.sizes[0]) if cshape else len(out)
        for a, sub in batches:
            view = out[a * region_row: a * region_row + sub.numel * np.dtype(record.storage_dtype).itemsize]
            data = self._read_chunk_part(record, chunk, sub, into=view)
            if data is not None:
                np.copyto(np.frombuffer(view, dtype=data.dtype).reshape(data.shape), data)

    def _stream_checksum(self, record: TensorRecord, chunk: ChunkRef) -> str:
        """xxh3_64 of a chunk's logical bytes (C order, without the edge padding), read in slabs
        of whole chunk rows of at most ROWS_BATCH_BYTES (one pooled buffer)."""
        hasher = xxhash.xxh3_64()
        cshape, sizes = record.chunk_shape, chunk.box.sizes
        if not cshape:
            hasher.update(memoryview(np.ascontiguousarray(self._read_chunk_part(record, chunk, chunk.box))).cast("B"))
            return hasher.hexdigest()
        itemsize = np.dtype(record.storage_dtype).itemsize
        row = math.prod(cshape[1:]) * itemsize
        step = max(1, ROWS_BATCH_BYTES // max(1, row))
        inner = Box(tuple(0 for _ in cshape[1:]), tuple(sizes[1:]))
        for r0 in range(0, sizes[0], step):
            n = min(step, sizes[0] - r0)
            rows = Box((chunk.box.offsets[0] + r0, *chunk.box.offsets[1:]), (n, *cshape[1:]))
            buf = pooled_buffer("universal-check", n * row)
            self._read_rows(record, chunk, rows, memoryview(buf))
            if tuple(sizes[1:]) == tuple(cshape[1:]):
                hasher.update(memoryview(buf))
            else:  # an edge chunk in an inner dim: the logical part of each row
                part = buf.view(record.storage_dtype).reshape((n, *cshape[1:]))[(slice(None), *inner.slices())]
                hasher.update(memoryview(np.ascontiguousarray(part)).cast("B"))
        return hasher.hexdigest()

    def _read_rows(self, record: TensorRecord, chunk: ChunkRef, rows: Box, into: memoryview) -> None:
        """Read whole stored rows (``rows`` spans full chunk rows, global coords) into ``into``."""
        local0 = rows.offsets[0] - chunk.box.offsets[0]
        row = len(into) // max(1, rows.sizes[0])
        self._pread(record, chunk, into, local0 * row)

    def _file(self, chunk: ChunkRef) -> Path:
        """The checked local path of a chunk file: inside the store (the rule of every reader)."""
        path = self._paths.get(chunk.file)
        if path is None:
            path = self._paths[chunk.file] = source_path(self.root, chunk.file)
        return path

    def _pread(self, record: TensorRecord, chunk: ChunkRef, into: memoryview, offset: int) -> None:
        """Fill ``into`` from ``offset`` of the chunk file; errors name the file and key."""
        path = self.root / chunk.file
        try:
            fd = os.open(self._file(chunk), os.O_RDONLY) if self._storage.is_local else self._storage.open_random(chunk.file)
            try:
                got = read_into(fd, into, offset)
            finally:
                close_file(fd)
        except _LAYOUT_ERRORS as e:
            raise CorruptCheckpointError(
                f"{path}: chunk file missing for key {record.array!r} ({e.strerror or 'not found'}); the store is "
                "damaged: reconvert it") from None
        except OSError as e:
            raise read_error(path, e, f"key {record.array!r}") from None
        if got != len(into):
            raise CorruptCheckpointError(f"{path}: chunk file truncated ({offset + got} of {offset + len(into)} bytes); "
                                         "reconvert the store")

    def _read_chunk_part(self, record: TensorRecord, chunk: ChunkRef, region: Box,
                         into: memoryview | None = None) -> np.ndarray | None:
        """The region's stored array; with ``into`` (the region's bytes), rows that hold exactly
        the region are read into it and None is returned."""
        storage = np.dtype(record.storage_dtype)
        cshape = record.chunk_shape
        local = region.relative_to(chunk.box)
        whole_rows = not cshape or (all(o == 0 for o in local.offsets[1:]) and local.sizes[1:] == cshape[1:])
        direct = into is not None and whole_rows
        row = math.prod(cshape[1:]) * storage.itemsize if cshape else storage.itemsize
        # rows [r0, r1) of the chunk hold the region; read just them
        r0 = local.offsets[0] if cshape else 0
        r1 = r0 + local.sizes[0] if cshape else 1
        nbytes = (r1 - r0) * row
        if direct:
            arr = np.frombuffer(into, dtype=storage)
        elif into is not None:  # rows copied out into ``into`` right away: a pooled buffer
            arr = pooled_buffer("universal-rows", nbytes).view(storage)
        else:
            arr = np.empty(nbytes // storage.itemsize, dtype=storage)
        self._pread(record, chunk, memoryview(arr).cast("B"), r0 * row)
        if direct:
            return None
        if not cshape:
            return arr.reshape(())
        arr = arr.reshape((r1 - r0, *cshape[1:]))
        sel = (slice(None),) + tuple(slice(o, o + s) for o, s in zip(local.offsets[1:], local.sizes[1:]))
        return arr[sel]

    def chunk_checksum(self, key: str, chunk: ChunkRef) -> tuple[str, str]:
        """(expected, actual) xxh3_64 of a chunk's logical bytes."""
        record = self.meta.tensors[key]
        return record.checksums.get(chunk_id(chunk.locator[1]), ""), self._stream_checksum(record, chunk)

    def read_object_bytes(self, key: str) -> bytes:
        rec = self.meta.objects[key]
        path = self.root / rec.file
        try:
            local = source_path(self.root, rec.file, f"key {key!r}") if self._storage.is_local else None
            data = local.read_bytes() if local is not None else self._storage.read_bytes(rec.file)
        except _LAYOUT_ERRORS as e:
            raise CorruptCheckpointError(f"{path}: object file missing for key {key!r} ({e.strerror or 'not found'}); "
                                         "reconvert the store") from None
        except OSError as e:
            raise read_error(path, e, f"key {key!r}") from None
        if xxhash.xxh3_64_hexdigest(data) != rec.checksum:
            raise CorruptCheckpointError(f"{path}: checksum mismatch for object {key!r}; the store is damaged: reconvert it")
        return data

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        from formats.objects import load_torch_object

        return load_torch_object(self.read_object_bytes(key), f"{self.root}:{key}", trust_pickle)

    def close(self) -> None:
        pass
