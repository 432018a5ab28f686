"""The universal store (format version 1): one writer and one reader over either backend.

Layout::

    uni/tensors/...                    the tensors' bytes, laid out by the backend:
                                       zarr (default): a Zarr v3 array per tensor, a file per chunk
                                       (formats/universal/zarr_backend.py); safetensors: a
                                       safetensors file per chunk (formats/universal/safetensors_backend.py)
    uni/objects/<n>.pt                 non-tensor entries, the exact torch.save bytes from the source
    uni/ckptconv.json                  root metadata; written last, atomically: the completion marker

Both backends chunk a tensor the same way (:mod:`formats.universal.plan`, planned before any
I/O) and record the same xxh3_64 of every chunk's logical bytes, so one store converts to the
other chunk for chunk. ckptconv writes each chunk file whole, by one writer, through a temp file
and a rename.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from formats.base import Box, CheckpointIndex, ChunkRef, ObjectEntry, TensorEntry
from formats.dtypes import BY_NAME, by_name, from_storage_array, raw_bytes, to_storage_array
from formats.errors import (
    CheckpointNotFoundError,
    CkptConvError,
    CorruptCheckpointError,
    DestinationError,
    IncompleteCheckpointError,
    InternalError,
    InvalidCheckpointError,
)
from formats.durability import make_durable
from formats.fsutil import (DIRECT_MIN_BYTES, DirectWrites, atomic_write_bytes, loads_json, prefetch_file,
                            pooled_buffer, read_error, run_parallel, short, source_path, start_writeback)
from formats.integrity import ChunkChecks, StreamedHash, block_fill
from formats.manifest import Manifest
from formats.storage import CachedFds, Storage, check_relative, close_file, is_url, open_storage, read_into
from formats.universal import safetensors_backend, zarr_backend
from formats.universal.plan import (
    DEFAULT_BACKEND,
    OBJECTS_DIR,
    TENSORS_DIR,
    ArrayPlan,
    chunk_grid,
    chunk_id,
    plan_array,
)
from formats.universal_meta import (
    METADATA_FILE,
    ObjectRecord,
    SourceInfo,
    TensorRecord,
    UniversalMetadata,
)

if TYPE_CHECKING:
    import torch


def backend_module(name: str) -> ModuleType:
    """The module that lays a backend's chunk files out (same functions in each)."""
    return {zarr_backend.NAME: zarr_backend, safetensors_backend.NAME: safetensors_backend}[name]


def chunk_name(chunk: ChunkRef) -> str:
    """The id (``"0.1"``) a chunk of this store's index is recorded under (its checksum's key)."""
    return chunk_id(chunk.locator[1])


def chunk_box(record: TensorRecord, index: tuple[int, ...]) -> Box:
    """The global box of chunk ``index`` of a tensor's grid, clipped to its shape."""
    offsets = tuple(i * c for i, c in zip(index, record.chunk_shape))
    return Box(offsets, tuple(min(c, s - o) for c, s, o in zip(record.chunk_shape, record.shape, offsets)))


class UniversalWriter:
    """Writes a universal store: laid out from the plan, chunks written whole, metadata last.

    Nothing is written before :meth:`prepare` (the constructor and :meth:`add_tensor` only
    record the plan); then chunks and objects in any order, from any thread; :meth:`commit` last.
    """

    def __init__(self, root: str | os.PathLike, chunk_bytes: int,
                 on_file_final: Callable[[str], None] | None = None, backend: str = DEFAULT_BACKEND,
                 direct_io: bool = True, fs_sync: bool = True) -> None:
        """``direct_io``: write the large aligned part of each chunk file straight to the device
        (``O_DIRECT`` where the file system takes it), the rest through the page cache.
        ``fs_sync``: make many files durable with one ``syncfs`` where that is as safe as an
        fsync of each (:mod:`formats.durability`)."""
        self.root = Path(root)
        self.chunk_bytes = chunk_bytes
        self.backend = backend
        self._layout = backend_module(backend)
        # spool mode (a URL destination, converter/remote.py): each chunk / object file is handed to
        # ``on_file_final(relpath)`` once final (it uploads and deletes it); no local fsyncs
        self._on_final = on_file_final
        self._tensors: dict[str, TensorRecord] = {}
        self._objects: dict[str, ObjectRecord] = {}
        self._names: set[str] = set()
        self._lock = threading.Lock()
        self._unsynced: list[Path] = []
        self._synced_dirs: set[str] = set()  # directories holding only chunk files already synced
        self._made_dirs: set[Path] = set()
        self._meta_files: set[str] = set()  # written by the backend's prepare
        self._direct_io = direct_io and on_file_final is None  # spooled files are read back at once
        self._fs_sync = fs_sync
        self._prepared = False

    def add_tensor(self, entry: TensorEntry, atom: str, role: str, *, source_split: dict[str, int] | None = None,
                   source_replicated: bool = False, tp_split_dim: int | None = None,
                   plan: ArrayPlan | None = None) -> TensorRecord:
        """Record ``entry``'s array (no I/O) and return its record.

        ``plan``: the array as :func:`formats.universal.plan.plan_store` planned it (planned here
        from the chunk size when not given). ``source_split`` / ``source_replicated`` /
        ``tp_split_dim`` record how the source laid the tensor out, for placement plans that
        follow the source.
        """
        if plan is None:
            plan = plan_array(entry.key, entry.dtype, tuple(entry.shape), self.chunk_bytes, self._names)
        else:
            self._names.add(plan.array.rsplit("/", 1)[-1])
        d = by_name(plan.dtype)
        record = TensorRecord(
            array=plan.array,
            dtype=d.name,
            storage_dtype=d.storage,
            shape=plan.shape,
            chunk_shape=plan.chunk_shape,
            path=tuple(entry.path),
            atom=atom,
            role=role,
            checksums={},
            source_split=dict(source_split or {}),
            source_replicated=source_replicated,
            tp_split_dim=tp_split_dim,
            **self._layout.record_fields(plan),
        )
        self._tensors[entry.key] = record
        return record

    def prepare(self) -> None:
        """Create the store's folders and the backend's metadata files (the first I/O).

        A plan that names one array for two keys is refused first (InternalError, nothing
        written): their chunk files would be the same files, written by two tasks at once."""
        self._refuse_shared_arrays()
        self._meta_files = {str(p) for p in self._layout.prepare(self.root, self._tensors)}
        self._prepared = True

    def _refuse_shared_arrays(self) -> None:
        holder: dict[str, str] = {}
        for key, record in self._tensors.items():
            other = holder.setdefault(record.array, key)
            if other != key:
                raise InternalError(
                    f"internal error: the output is not its plan: tensors {short(repr(other))} and "
                    f"{short(repr(key))} are both stored in {short(record.array)}; nothing was published "
                    "(refused before writing; please report this bug)")

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], Box]]:
        """The (chunk index, box) pairs of a tensor's array; each is one write task."""
        r = self._tensors[key]
        return list(chunk_grid(r.shape, r.chunk_shape))

    def data_offset(self, key: str, index: tuple[int, ...]) -> int:
        """Where a chunk's bytes start in its file (a pure function of the record)."""
        record = self._tensors[key]
        return self._layout.data_offset(record, chunk_box(record, index))

    def write_chunk(self, key: str, index: tuple[int, ...], tensor: Any) -> str:
        """Write one whole chunk (thread-safe across chunks): temp file, then rename; its checksum.

        ``tensor`` is the chunk's bit array (numpy, storage dtype) or a torch tensor. Its large
        aligned part goes straight to the device when the buffer is aligned like its place in the
        file (:meth:`data_offset`; :class:`formats.fsutil.DirectWrites`).
        """
        if not self._prepared:
            raise RuntimeError("internal error: UniversalWriter.prepare() was not called before writing")
        record = self._tensors[key]
        data = to_storage_array(tensor)
        if data.dtype != np.dtype(record.storage_dtype):
            raise ValueError(f"{key!r}: chunk data of dtype {data.dtype}, the array stores {record.storage_dtype}")
        checksum = xxhash.xxh3_64_hexdigest(raw_bytes(data))
        relative = self._layout.chunk_file(record, index)
        path = self.root / relative
        if path.parent not in self._made_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made_dirs.add(path.parent)
        tmp = path.with_name(f".{path.name}.tmp")
        parts, size = self._layout.chunk_file_parts(key, record, chunk_box(record, index), data)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        out = DirectWrites(fd, tmp if self._direct_io and size >= DIRECT_MIN_BYTES else None)
        try:
            buffered = sum(out.pwrite(part, offset) for offset, part in parts)
            end = max((offset + len(part) for offset, part in parts), default=0)
            if size > end:
                os.ftruncate(fd, size)
            if buffered >= DIRECT_MIN_BYTES:  # through the page cache: start its writeback now
                start_writeback(fd)
        finally:
            out.close()
        os.replace(tmp, path)
        with self._lock:
            record.checksums[chunk_id(index)] = checksum
            self._unsynced.append(path)
        if self._on_final is not None:  # spool mode: the chunk file is final
            self._on_final(relative)
        return checksum

    def restore_chunk(self, key: str, index: tuple[int, ...], checksum: str) -> None:
        """Adopt a chunk written by an interrupted run (resume): its file must be there."""
        record = self._tensors[key]
        path = self.root / self._layout.chunk_file(record, index)
        if self._on_final is None and not path.is_file():  # spool mode: uploaded, maybe by another rank
            raise CorruptCheckpointError(f"{path}: chunk of {key!r} recorded as written is missing; rerun with --overwrite")
        with self._lock:
            record.checksums[chunk_id(index)] = checksum

    def sync(self) -> None:
        """Make every chunk file written since the last sync durable (:func:`make_durable`)."""
        with self._lock:
            paths, self._unsynced = self._unsynced, []
        if self._on_final is not None:  # spool mode: the files leave this disk, no local durability
            return
        make_durable(self.root, paths, self._fs_sync)
        with self._lock:
            self._synced_dirs.update(str(p.parent) for p in paths)

    def add_object(self, key: str, data: bytes, path: tuple, atom: str, role: str, json_view: Any) -> None:
        """Store a non-tensor entry's exact bytes with a JSON view."""
        if not self._prepared:
            raise RuntimeError("internal error: UniversalWriter.prepare() was not called before writing")
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

    def manifest(self) -> Manifest:
        """What :meth:`commit` is about to record (its ``ckptconv.json`` is these records): each
        tensor's dtype and shape and its array (a folder of its own), each object's file, and any
        tensor whose chunks are not all written."""
        m = Manifest()
        for key, r in self._tensors.items():
            m.tensor(key, r.dtype, r.shape)
            m.whole(key, r.array)
            chunks = math.prod(math.ceil(s / c) if s else 0 for s, c in zip(r.shape, r.chunk_shape))
            if len(r.checksums) != chunks:
                m.problem(f"tensor {short(repr(key))} has {len(r.checksums)} of its {chunks} chunks written")
        for key, o in self._objects.items():
            m.objects.append(key)
            m.whole(key, o.file)
        return m

    def commit(self, source: SourceInfo, tool_version: str, atoms: dict[str, dict[str, str]], created: str) -> None:
        """Make every written file and folder durable (:func:`make_durable`: the chunk files not
        yet synced, the metadata files, every folder), then publish ``ckptconv.json`` atomically
        (the marker)."""
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
        with self._lock:  # chunk files not yet synced (the journal synced the others)
            unsynced, self._unsynced = self._unsynced, []
        if self._on_final is None:  # spool mode: nothing local needs to be durable
            tree = _tree_paths(self.root, skip_files=self._synced_dirs, always=self._meta_files)
            make_durable(self.root, [*unsynced, *tree], self._fs_sync)
        meta = UniversalMetadata(
            tool_version=tool_version, source=source, tensors=self._tensors,
            objects=self._objects, atoms=atoms, created=created, backend=self.backend,
        )
        atomic_write_bytes(self.root / METADATA_FILE, meta.dumps())


def _tree_paths(root: Path, skip_files: set[str] = frozenset(), always: set[str] = frozenset()) -> list[str]:
    """Every file and directory under ``root`` that the commit makes durable: files directly in a
    ``skip_files`` directory (chunk files already synced) are left out, except those in
    ``always`` (metadata written beside them); directories always count, for their entries."""
    paths: list[str] = []
    for dirpath, _, files in os.walk(root):
        skip = dirpath in skip_files
        paths += [p for p in (os.path.join(dirpath, name) for name in files) if not skip or p in always]
        paths.append(dirpath)
    return paths


def is_universal_store(path: str | os.PathLike | Storage) -> bool:
    """True when ``path`` (local or URL) looks like a universal store (complete or not): the
    marker, or ``tensors/`` beside the root ``zarr.json`` (zarr backend) or ``objects/`` (either)."""
    st = open_storage(path)
    if st.is_local:
        p = st.root
        return (p / METADATA_FILE).is_file() or ((p / TENSORS_DIR).is_dir() and (
            (p / "zarr.json").is_file() or (p / OBJECTS_DIR).is_dir()))
    names = st.list()
    return METADATA_FILE in names or (TENSORS_DIR in names and ("zarr.json" in names or OBJECTS_DIR in names))


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


def _check_record(root: Path, key: str, r: TensorRecord, where: Path, st: Storage | None = None,
                  layout: ModuleType = zarr_backend) -> Path:
    """A tensor record must be consistent before anything is planned from it: known dtype, chunk
    shape of the tensor's rank, an array path inside ``tensors/``, one checksum per chunk of the
    grid, the backend's own fields, and a first chunk file of the size the backend writes (so
    damaged shapes cannot plan or allocate more than the store holds). Returns the array's checked
    path (resolved, for a local store)."""

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
    problem = layout.check_record(r, key)
    if problem:
        raise bad(problem)
    if not math.prod(counts):
        return array
    index = tuple(0 for _ in r.shape)
    first = layout.chunk_file(r, index)
    full = layout.file_size(r, chunk_box(r, index))
    try:
        if st is None or st.is_local:
            size = array.joinpath(*first[len(r.array) + 1:].split("/")).stat().st_size
        else:
            size = st.size(first)
    except _LAYOUT_ERRORS as e:
        raise bad(f"chunk file {first} is missing ({e.strerror or 'not found'})") from None
    except OSError as e:  # a symlink loop, a name too long
        raise read_error(root / first, e, f"key {key!r}") from None
    if size != full:
        raise bad(f"chunk file {first} has {size} bytes, a chunk needs {full}")
    return array


def _one_owner(owners: dict[Path, str], path: Path, key: str, what: str, name: str, where: Path) -> None:
    """Record that ``key`` owns ``path``; a second key naming the same file or array (two keys
    over one storage: one of them would silently read the other's bytes) is refused."""
    first = owners.setdefault(path, key)
    if first != key:
        raise CorruptCheckpointError(
            f"{where}: keys {short(repr(first))} and {short(repr(key))} both name the {what} {short(repr(name))} (each "
            "key has its own); the metadata is damaged: reconvert the store")


#: Chunk files a reader keeps open between reads (idle ones; those in use are never closed), and
#: at most 1/``READ_FDS_PER_LIMIT`` of the soft open-file limit: a reader inside a training job
#: (``UniversalStorageReader`` under ``dcp.load``) leaves the job its descriptors. The workers take
#: a tensor's tasks one after another, so a few dozen catch every reuse.
READ_FDS = 32
READ_FDS_PER_LIMIT = 16

#: Threads that look up a local store's chunk files at open (:meth:`UniversalReader._warm_inodes`).
STAT_WORKERS = 8

#: Rows of partial-row reads (TP column shards of row-block chunks) are read in batches of at
#: most this many bytes, through one pooled buffer per thread.
ROWS_BATCH_BYTES = 4 << 20


def _read_fds() -> int:
    """How many idle chunk files a reader keeps open: ``READ_FDS``, within the open-file limit."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return READ_FDS
    if soft == resource.RLIM_INFINITY:
        return READ_FDS
    return max(1, min(READ_FDS, soft // READ_FDS_PER_LIMIT))


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
        self._fds = CachedFds(_read_fds())  # the chunk files read, kept open for the next reads
        self.meta = read_metadata(self._storage)
        self._layout = backend_module(self.meta.backend)
        self._located: dict[str, tuple[int, tuple[int, ...]]] = {}  # chunk file -> (data offset, stored shape)
        where = self.root / METADATA_FILE
        if not self._storage.is_local:  # one listing for the chunk checks, not a request per tensor
            self._storage.prefetch_sizes(TENSORS_DIR)
        else:
            self._warm_inodes()
        owners: dict[Path, str] = {}  # checked array / object path -> the key that names it
        for key, record in self.meta.tensors.items():
            array = _check_record(self.root, key, record, where, self._storage, self._layout)
            _one_owner(owners, array, key, "array", record.array, where)
        for key, obj in self.meta.objects.items():
            _one_owner(owners, _inside(self.root, obj.file, OBJECTS_DIR, key, where), key, "object file", obj.file, where)
        self._index: CheckpointIndex | None = None

    def _warm_inodes(self) -> None:
        """Look up every first chunk file (which the checks below stat, one after another) several
        at once: on a cold disk each lookup reads a directory and an inode, and the checks then
        find them cached (errors are left to the checks)."""
        first = [os.path.join(self.root, self._layout.chunk_file(r, tuple(0 for _ in r.shape)))
                 for r in self.meta.tensors.values()
                 if r.array.startswith(TENSORS_DIR + "/") and ".." not in r.array.split("/")]  # nothing outside

        def look(path: str) -> None:
            try:
                os.stat(path)
            except (OSError, ValueError):
                pass

        if len(first) > 1:
            run_parallel(look, first, STAT_WORKERS)

    def index(self) -> CheckpointIndex:
        if self._index is None:
            self._index = self._build_index()
        return self._index

    def _build_index(self) -> CheckpointIndex:
        tensors = {}
        for key, r in self.meta.tensors.items():
            chunks = tuple(
                ChunkRef(box=box, file=self._layout.chunk_file(r, idx), locator=(key, idx))
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
            "backend": self.meta.backend,
        }
        return CheckpointIndex("universal", str(self.root), tensors, objects, info)

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        """Read ``region`` of one chunk; row slabs are read with a single pread."""
        record = self.meta.tensors[key]
        data = self._read_chunk_part(record, chunk, region, seen=self._seen(key, record, chunk))
        return from_storage_array(np.require(data, requirements="C"), record.dtype)  # 0-d stays 0-d

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` (writable bytes, exactly the region's size) with ``region`` in C order;
        a region of whole chunk rows is read straight into ``out`` (one pread, no copy)."""
        record = self.meta.tensors[key]
        self._read_into(record, chunk, region, out, self._seen(key, record, chunk))

    def _seen(self, key: str, record: TensorRecord, chunk: ChunkRef) -> Callable[[int, memoryview], None] | None:
        """Where a region read reports the chunk bytes it read, for the chunk's xxh3_64 (None when
        this reader does not verify, or the chunk is checked already).

        The bytes of every read feed the chunk's hash in memory (:class:`formats.integrity.StreamedHash`,
        in order: a read that starts past the bytes hashed so far first reads the gap, the bytes
        the task next to it is about to read); the read that completes the chunk compares. An edge
        chunk of an inner dim, whose logical bytes are not one run of its file (rows longer than
        the chunk size), is checked by one streamed pass the first time any part of it is read.
        """
        checks = self._checks
        if checks is None or checks.done(chunk.locator):
            return None
        cshape = self._stored(record, chunk)[1]
        if cshape and tuple(cshape[1:]) != tuple(chunk.box.sizes[1:]):
            checks.once(chunk.locator, lambda: (self._check_prefix(key, record, chunk),
                                                self._compare(key, record, chunk, self._stream_checksum(record, chunk))))
            return None
        length = chunk.box.numel * np.dtype(record.storage_dtype).itemsize

        def start():
            self._check_prefix(key, record, chunk)
            fill = block_fill(lambda offset, view: self._pread(record, chunk, view, offset))
            return StreamedHash(length, fill), lambda actual: self._compare(key, record, chunk, actual), fill

        locator, part = chunk.locator, checks.part
        return lambda offset, data: part(locator, offset, data, start)

    def pending_checks(self, chunks: Iterable[ChunkRef]) -> bool:
        """Whether the check of any of ``chunks`` is still open (parts read, not all bytes seen)."""
        return self._checks is not None and self._checks.any_pending(c.locator for c in chunks)

    def finish_checks(self, workers: int = 1) -> int:
        """Complete the open checks: read the bytes of each chunk no region read covered (parts
        another rank copied), compare. CorruptCheckpointError on a mismatch; returns the chunks
        completed."""
        return 0 if self._checks is None else self._checks.finish(workers)

    def _check_prefix(self, key: str, record: TensorRecord, chunk: ChunkRef) -> None:
        """The bytes before the chunk's data (a safetensors file's header; none in zarr) are what
        the record says: the data offsets come from the record, so a damaged header would convert
        fine yet mislead any other reader of the file."""
        prefix = self._layout.file_prefix(record, chunk.box)
        if not prefix:
            return
        got = bytearray(len(prefix))
        self._pread(record, chunk, memoryview(got), -self._stored(record, chunk)[0])  # from the file's start
        if got != prefix:
            raise CorruptCheckpointError(
                f"{self.root / chunk.file}: key {key!r} chunk {chunk_name(chunk)}: the file's header differs from "
                "what ckptconv.json records (other safetensors readers would misread it); the file is damaged: "
                "reconvert the store (--no-verify-source copies the data anyway)")

    def _compare(self, key: str, record: TensorRecord, chunk: ChunkRef, actual: str) -> None:
        cid = chunk_name(chunk)
        expected = record.checksums.get(cid, "")
        if actual != expected:
            raise CorruptCheckpointError(
                f"{self.root / chunk.file}: key {key!r} chunk {cid}: xxh3_64 {actual} != recorded {expected}; the "
                "chunk's bytes are damaged: reconvert the store (--no-verify-source copies them anyway)")

    def _stored(self, record: TensorRecord, chunk: ChunkRef) -> tuple[int, tuple[int, ...]]:
        """(byte offset of the chunk's data in its file, shape of the array stored there): pure,
        from the record (the backend wrote the file from it), cached per file."""
        got = self._located.get(chunk.file)
        if got is None:
            if len(self._located) >= 1 << 16:  # bounded: a store of millions of chunks
                self._located.clear()
            got = self._located[chunk.file] = (self._layout.data_offset(record, chunk.box),
                                               tuple(self._layout.stored_shape(record, chunk.box)))
        return got

    def _read_into(self, record: TensorRecord, chunk: ChunkRef, region: Box, out: memoryview,
                   seen: Callable[[int, memoryview], None] | None = None) -> None:
        cshape = self._stored(record, chunk)[1]
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
            data = self._read_chunk_part(record, chunk, sub, into=view, seen=seen)
            if data is not None:
                np.copyto(np.frombuffer(view, dtype=data.dtype).reshape(data.shape), data)

    def _stream_checksum(self, record: TensorRecord, chunk: ChunkRef) -> str:
        """xxh3_64 of a chunk's logical bytes (C order, without the edge padding), read in slabs
        of whole chunk rows of at most ROWS_BATCH_BYTES (one pooled buffer)."""
        hasher = xxhash.xxh3_64()
        cshape, sizes = self._stored(record, chunk)[1], chunk.box.sizes
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

    def prefetch(self, key: str, chunk: ChunkRef) -> None:
        """Start reading the chunk's file into the page cache (local stores; a hint, no wait:
        errors are left to the read)."""
        if self._storage.is_local:
            try:
                prefetch_file(self._file(chunk))
            except (OSError, CkptConvError):
                return

    def _pread(self, record: TensorRecord, chunk: ChunkRef, into: memoryview, offset: int) -> None:
        """Fill ``into`` from ``offset`` of the chunk's data in its file; errors name the file and key."""
        path = self.root / chunk.file
        offset += self._stored(record, chunk)[0]
        try:
            if self._storage.is_local:
                local = self._file(chunk)
                fd = self._fds.acquire(local)
                try:
                    got = read_into(fd, into, offset)
                finally:
                    self._fds.release(local)
            else:
                f = self._storage.open_random(chunk.file)
                try:
                    got = read_into(f, into, offset)
                finally:
                    close_file(f)
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
                         into: memoryview | None = None,
                         seen: Callable[[int, memoryview], None] | None = None) -> np.ndarray | None:
        """The region's stored array; with ``into`` (the region's bytes), rows that hold exactly
        the region are read into it and None is returned. ``seen`` is told the rows read (their
        offset in the chunk's bytes)."""
        storage = np.dtype(record.storage_dtype)
        cshape = self._stored(record, chunk)[1]
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
        if seen is not None:
            seen(r0 * row, memoryview(arr).cast("B"))
        if direct:
            return None
        if not cshape:
            return arr.reshape(())
        arr = arr.reshape((r1 - r0, *cshape[1:]))
        sel = (slice(None),) + tuple(slice(o, o + s) for o, s in zip(local.offsets[1:], local.sizes[1:]))
        return arr[sel]

    def source_layout(self) -> tuple[dict[str, int | None], set[str]]:
        """What the store recorded of its source's layout: (key -> the dim tensor parallelism
        split it along, None when not split; the keys the source held whole on every rank)."""
        tensors = self.meta.tensors
        return {k: r.tp_split_dim for k, r in tensors.items()}, {k for k, r in tensors.items() if r.source_replicated}

    def chunk_checksum(self, key: str, chunk: ChunkRef) -> tuple[str, str]:
        """(expected, actual) xxh3_64 of a chunk's logical bytes."""
        record = self.meta.tensors[key]
        return record.checksums.get(chunk_name(chunk), ""), self._stream_checksum(record, chunk)

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
        """Close the chunk files kept open (a later read opens them again)."""
        self._fds.close()
