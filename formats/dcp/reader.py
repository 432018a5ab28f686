"""``DCPReader``: the read side of a PyTorch Distributed Checkpoint directory.

Opening a checkpoint reads only metadata (``.metadata``, or the ``__<rank>.metadata`` files of
``dcp.save(..., use_collectives=False)`` merged into one index) and validates it: chunks in bounds,
disjoint and covering every tensor exactly; every referenced file present and long enough. Tensor
bytes are read on demand, region by region, with ``os.pread`` (thread safe: no shared seek).
"""

from __future__ import annotations

import functools
import math
import operator
import os
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from formats.base import Box, CheckpointIndex, ChunkRef, ObjectEntry, Shape, TensorEntry, first_overlap
from formats.dcp import archive, checks
from formats.dcp.metadata import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    BytesMeta,
    ChunkMeta,
    DCPMetadata,
    StorageInfo,
    TensorMeta,
    gc_paused,
    load_metadata_file,
    load_object_bytes,
    merge_metadata,
    parse_metadata_bytes,
    rank_metadata_files,
)
from formats.errors import (
    CheckpointNotFoundError,
    CkptConvError,
    CorruptCheckpointError,
    DestinationError,
    IncompleteCheckpointError,
    InvalidCheckpointError,
    PlanError,
    StorageError,
    UnsupportedError,
)
from formats.dtypes import BY_NAME, by_name, itemsize_of
from formats.fsutil import prefetch, short, source_path
from formats.integrity import ChunkChecks, CRCRanges, block_fill
from formats.storage import OpenFiles, RandomFile, Storage, open_storage

if TYPE_CHECKING:
    import numpy as np
    import torch

#: Largest non-tensor entry accepted (bytes, after decompression).
MAX_OBJECT_BYTES = 1 << 30
#: Parsed chunk headers kept per reader, and bytes of decompressed items kept with them.
CACHE_ENTRIES = 8192
CACHE_BYTES = 256 << 20
#: Most bytes one compressed byte can stand for in a zstd stream (RLE blocks: 4 bytes per 128 KiB).
_MAX_ZSTD_RATIO = 1 << 16
#: Slack allowed over a chunk's data size when decompressing its archive (headers, data.pkl).
ARCHIVE_SLACK = 16 << 20

_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")
_REL, _LENGTH = operator.attrgetter("relative_path"), operator.attrgetter("length")
_OFFSET = operator.attrgetter("offset")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_TRANSFORMS = operator.attrgetter("transforms")
DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


#: Where a DCP item lives (the opaque, hashable ``ChunkRef.locator``): relative_path, offset,
#: length, transforms; the parsed storage entry itself.
Locator = StorageInfo


def is_dcp_checkpoint(path: str | os.PathLike | Storage) -> bool:
    """True when ``path`` (local or URL) is a directory holding ``.metadata`` or
    ``__<rank>.metadata`` files."""
    st = open_storage(path)
    if st.is_local and not st.is_dir():
        return False
    names = st.list()
    return METADATA_NAME in names or bool(rank_metadata_files(names))


@functools.lru_cache(maxsize=65536)
def _rank_of(relative_path: str) -> int | None:
    m = DISTCP_RE.match(os.path.basename(relative_path))
    return int(m.group(1)) if m else None


def _max_ends(rels: list[str], ends: list[int]) -> dict[str, int]:
    """``{file: end of its last item}`` over chunks given as parallel lists (in numpy: millions
    of chunks)."""
    import numpy as np

    if not rels:
        return {}
    ids: dict[str, int] = {}
    fid = np.fromiter(map(ids.setdefault, rels, map(len, repeat(ids))), dtype=np.int64, count=len(rels))
    top = np.full(len(ids), -1, dtype=np.int64)
    np.maximum.at(top, fid, np.fromiter(ends, dtype=np.int64, count=len(ends)))
    return dict(zip(ids, top.tolist()))


class _RankOf(dict):
    """file name -> the rank that wrote it (:func:`_rank_of`), computed once per file."""

    def __missing__(self, relative_path: str) -> int | None:
        rank = self[relative_path] = _rank_of(relative_path)
        return rank


def guess_path(key: str) -> tuple[str | int, ...]:
    """An object path for a key without planner data (dots inside FQNs make this a guess; a
    checkpoint whose every path is this guess had no planner data: Megatron-core's torch_dist
    backend writes none, see :mod:`converter.plan.atoms`)."""
    parts = key.split(".")
    if len(parts) >= 4 and parts[1] == "state":
        return (parts[0], "state", ".".join(parts[2:-1]), parts[-1])
    if len(parts) >= 4 and parts[1] == "param_groups" and parts[2].isdigit():
        return (parts[0], "param_groups", int(parts[2]), ".".join(parts[3:]))
    return tuple(parts[:1]) + ((".".join(parts[1:]),) if len(parts) > 1 else ())


# ---------------------------------------------------------------------------------------------
# Opening: find and merge metadata


def _not_a_checkpoint(root: Path | Storage) -> InvalidCheckpointError:
    st = open_storage(root)
    root, names = st.root, st.list()
    if any(n.endswith(".distcp") for n in names):
        return IncompleteCheckpointError(
            f"{root} has .distcp files but no .metadata: the save did not finish (DCP writes "
            ".metadata last); re-run the save or use another checkpoint"
        )
    what = "the directory is empty" if not names else "expected the output of dcp.save"
    return InvalidCheckpointError(f"not a DCP checkpoint: no .metadata in {root}; {what}")


def read_checkpoint_metadata(root: Path | Storage) -> tuple[DCPMetadata, list[str]]:
    """The checkpoint's metadata and the metadata file names it came from (local or URL)."""
    st = open_storage(root)
    names = st.list()
    root = st.root
    if METADATA_NAME in names:
        return _load(st, METADATA_NAME), [METADATA_NAME]
    per_rank = rank_metadata_files(names)
    if not per_rank:
        raise _not_a_checkpoint(st)
    missing = sorted(set(range(max(per_rank) + 1)) - set(per_rank))
    writers = {r for r in map(_rank_of, names) if r is not None}
    missing += sorted(writers - set(per_rank) - set(missing))
    if missing:
        raise IncompleteCheckpointError(
            f"{root}: per-rank metadata __{missing[0]}.metadata is missing (ranks with metadata: "
            f"{sorted(per_rank)}); the save did not finish on every rank"
        )
    names = [per_rank[r] for r in sorted(per_rank)]
    return merge_metadata([_load(st, n) for n in names]), names


def _load(st: Storage, name: str) -> DCPMetadata:
    path = st.root / name
    if st.is_local:
        try:
            return load_metadata_file(path)
        except OSError as exc:
            raise InvalidCheckpointError(f"{path}: cannot read metadata ({exc.strerror})") from None
    size = st.size(name)
    if size > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{path}: metadata is {size} bytes, over the {MAX_METADATA_BYTES} byte limit")
    return parse_metadata_bytes(st.read_bytes(name), str(path))


# ---------------------------------------------------------------------------------------------
# Validation


def check_cover(key: str, shape: Shape, boxes: list[Box], where: str,
                missing: str = "some chunks are missing from the metadata") -> list[int]:
    """Chunks (``boxes`` of a tensor of ``shape``, sorted by offsets) in bounds, pairwise
    disjoint, covering the tensor exactly (empty chunks allowed); the chunks' element counts.
    ``missing`` ends the message of a tensor not covered (what the format says is missing)."""
    ndim = len(shape)
    offsets, sizes = list(map(_OFFSETS, boxes)), list(map(_SIZES, boxes))
    off_cols, size_cols = list(zip(*offsets)), list(zip(*sizes))  # per dim, over every chunk
    if set(map(len, offsets)) - {ndim} or set(map(len, sizes)) - {ndim} or (ndim and boxes and any(
        max(map(operator.add, offs, lens)) > d  # C-level iteration
        for offs, lens, d in zip(off_cols, size_cols, shape)
    )):
        bad = next(b for b in boxes if len(b.offsets) != ndim or len(b.sizes) != ndim
                   or any(o + n > d for o, n, d in zip(b.offsets, b.sizes, shape)))
        raise CorruptCheckpointError(
            f"{where}: key {key!r} has chunk {list(bad.offsets)}+{list(bad.sizes)} outside its "
            f"shape {list(shape)}"
        )
    numels = list(map(math.prod, sizes))
    covered = sum(numels)
    if not _disjoint_grid(off_cols, size_cols, numels, zip(offsets, sizes)):
        _check_disjoint(key, boxes, where)
    if covered != math.prod(shape):
        raise CorruptCheckpointError(
            f"{where}: key {key!r} chunks cover {covered} of {math.prod(shape)} elements; {missing}"
        )
    return numels


def _disjoint_grid(off_cols: list[tuple[int, ...]], size_cols: list[tuple[int, ...]],
                   numels: list[int], boxes: Iterable[tuple[Shape, Shape]] | None = None) -> bool:
    """True when the non-empty chunks (per-dim columns of their offsets and sizes, sorted by
    offsets) are shown disjoint in C-level loops; False means "not shown": run the general sweep.

    A row (equal in every dim but one, as FSDP writes) is disjoint when it does not overlap along
    that dim. A grid (TP x FSDP, strided or not) is disjoint when in every dim the distinct
    intervals the chunks span are pairwise disjoint and no two chunks span the same interval in
    every dim (two chunks that meet in every dim would be one chunk). ``boxes``: the chunks as
    ``(offsets, sizes)`` pairs, when the caller has them.
    """
    if len(numels) < 2:
        return True
    if not off_cols or not min(numels):
        return False
    varying = [d for d, (offs, lens) in enumerate(zip(off_cols, size_cols))
               if offs.count(offs[0]) != len(offs) or lens.count(lens[0]) != len(lens)]
    if len(varying) == 1:  # a row, sorted along its dim
        starts = off_cols[varying[0]]
        return all(map(operator.ge, starts[1:], map(operator.add, starts, size_cols[varying[0]])))
    for d in varying:
        offs = off_cols[d]
        spans = sorted(set(zip(offs, map(operator.add, offs, size_cols[d]))))  # (start, end), distinct
        if not all(map(operator.ge, map(_FIRST, spans[1:]), map(_SECOND, spans))):
            return False  # two different intervals overlap along this dim
    if boxes is None:
        boxes = zip(zip(*off_cols), zip(*size_cols))
    return len(set(boxes)) == len(numels)


def _check_disjoint(key: str, boxes: list[Box], where: str) -> None:
    """Raise when two non-empty chunks overlap (a sweep: :func:`formats.base.first_overlap`)."""
    pair = first_overlap(boxes)
    if pair is not None:
        a, box = pair
        raise CorruptCheckpointError(
            f"{where}: key {key!r} chunks {list(a.offsets)}+{list(a.sizes)} and "
            f"{list(box.offsets)}+{list(box.sizes)} overlap"
        )


def _check_files(st: Storage, refs: Iterable[tuple[str, StorageInfo]]) -> dict[str, int]:
    """``{relative_path: size}``; every referenced file exists and holds its items."""
    need: dict[str, tuple[int, str]] = {}
    for key, info in refs:
        _need(need, key, info)
    return _check_sizes(st, need)


def _in_save_order(entries: Mapping[str, Any], planner_data: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``entries`` in the saving job's state-dict order: ``planner_data``'s order (``dcp.save``'s
    flattening of the whole state dict, which ``dcp.load`` walks in the same order to request the
    items), then any entries it does not name, in their own order. ``state_dict_metadata``'s
    order differs: it follows the gathered save plans, where a replicated item (an optimizer
    ``step``) comes with the rank that wrote it, so torchtitan's 0-d steps trail every other key;
    a converted file laid out in that order makes the loader seek to the file's end and back for
    each parameter's state."""
    ordered = [(k, entries[k]) for k in planner_data if k in entries]
    if len(ordered) == len(entries):
        return ordered
    named = set(planner_data)
    return ordered + [(k, v) for k, v in entries.items() if k not in named]


def _need(need: dict[str, tuple[int, str]], key: str, info: StorageInfo) -> None:
    """Record that ``info``'s file must hold ``info``'s item (for :func:`_check_sizes`)."""
    end = info.offset + info.length
    if end > need.get(info.relative_path, (-1, ""))[0]:
        need[info.relative_path] = (end, key)


def _check_sizes(st: Storage, need: dict[str, tuple[int, str | None]],
                 key_of: Callable[[str, int], str] | None = None) -> dict[str, int]:
    """``{relative_path: size}``; every file of ``need`` exists and reaches its item's end.
    ``need`` gives each file's end and the key whose item ends there, or None: then ``key_of(file,
    end)`` names it, only for a message."""
    sizes = {}
    root = st.root
    for rel, (end, key) in sorted(need.items()):
        if key is None:
            key = _LazyKey(key_of, rel, end)
        if st.is_local:  # the one rule of every reader: inside the checkpoint, no loops
            source_path(root, rel, _Text(lambda: f"key {key!r}"))  # formatted only in an error
        try:
            sizes[rel] = st.size(rel)
        except DestinationError:
            raise CorruptCheckpointError(
                f"{root}: key {key!r} points at {rel!r}, outside the checkpoint directory"
            ) from None
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"{root}: file {short(rel)} is missing (needed by key {key!r}); copy the whole checkpoint"
            ) from None
        except (CorruptCheckpointError, StorageError) as e:  # a name too long, a loop: name the key too
            raise type(e)(f"{e} (file named by key {key!r})") from None
        if sizes[rel] < end:
            raise CorruptCheckpointError(
                f"{root / rel}: file is truncated ({sizes[rel]} bytes; key {key!r} needs {end}); "
                "re-copy it"
            )
    return sizes


class _LazyKey:
    """The key a message names, looked up when the message is formatted (``!r``)."""

    def __init__(self, key_of: Callable[[str, int], str] | None, rel: str, end: int) -> None:
        self._key_of, self._rel, self._end = key_of, rel, end

    def __repr__(self) -> str:
        return repr(self._key_of(self._rel, self._end)) if self._key_of else "?"


class _Text:
    """Text made when it is formatted (a message part that costs a lookup)."""

    def __init__(self, make: Callable[[], str]) -> None:
        self._make = make

    def __str__(self) -> str:
        return self._make()

    def __format__(self, spec: str) -> str:
        return format(self._make(), spec)


def _check_item_size(key: str, offsets: Any, nbytes: int, info: StorageInfo, where: str) -> None:
    """A chunk's data must fit in its item (which holds it uncompressed, or zstd-compressed at
    most ``_MAX_ZSTD_RATIO`` to 1): damaged sizes would otherwise plan huge conversions."""
    if nbytes > (info.length * _MAX_ZSTD_RATIO if info.transforms else info.length):
        raise CorruptCheckpointError(
            f"{where}: key {key!r} chunk at {list(offsets)} holds {nbytes} bytes of data but its "
            f"item in {info.relative_path} is {info.length} bytes; the metadata is damaged"
        )


def _storage_of(md: DCPMetadata, key: str, offsets: Any, where: str) -> StorageInfo:
    info = md.storage.get((key, offsets))
    if info is None:
        at = "" if offsets is None else f" chunk at {list(offsets)}"
        raise CorruptCheckpointError(f"{where}: key {key!r}{at} has no storage entry")
    return info


# ---------------------------------------------------------------------------------------------
# The reader


class _Cache:
    """A small thread-safe LRU keyed by locator, bounded by entries and by held bytes."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._max_entries, self._max_bytes, self._bytes = max_entries, max_bytes, 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, value: Any, weight: int) -> None:
        if weight > self._max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            self._bytes += weight - (old[1] if old else 0)
            self._items[key] = (value, weight)
            while self._items and (
                len(self._items) > self._max_entries or self._bytes > self._max_bytes
            ):
                _, (_, w) = self._items.popitem(last=False)
                self._bytes -= w

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


class DCPReader:
    """Reads a DCP checkpoint directory: index from metadata, tensor regions on demand.

    ``trust_pickle`` makes :meth:`load_object` accept any pickle (arbitrary code: only for
    checkpoints you trust). ``verify`` checks every chunk's zip CRC-32 as it is read, once per
    chunk (:mod:`formats.integrity`): a mismatch raises CorruptCheckpointError naming the file,
    key and chunk. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike, trust_pickle: bool = False, verify: bool = False) -> None:
        self._storage = open_storage(path)
        self.root = self._storage.root
        self.trust_pickle = trust_pickle
        self._checks = ChunkChecks() if verify else None
        if self._storage.is_local and not self.root.exists():
            raise CheckpointNotFoundError(f"{self.root}: no such checkpoint directory")
        if not self._storage.is_dir():
            if not self._storage.is_local and not self._storage.exists():
                raise CheckpointNotFoundError(f"{self.root}: no such checkpoint (nothing under this URL)")
            raise InvalidCheckpointError(
                f"{self.root} is a file; a DCP checkpoint is a directory holding .metadata"
            )
        self._md, self._md_files = read_checkpoint_metadata(self._storage)
        with gc_paused():
            self._index = self._build_index()
        self._files = OpenFiles(self._storage)
        self._cache = _Cache(CACHE_ENTRIES, CACHE_BYTES)

    # -- index -------------------------------------------------------------------------------

    def _build_index(self) -> CheckpointIndex:
        md, where = self._md, str(self.root / self._md_files[0])
        tensors: dict[str, TensorEntry] = {}
        objects: dict[str, ObjectEntry] = {}
        need: dict[str, tuple[int, str]] = {}  # file -> (end of its last item, a key there)
        transforms: set[tuple[str, ...]] = set()
        sized: list[tuple[str, Any, int, StorageInfo]] = []  # chunks bigger than their items
        ranks = _RankOf()  # file -> the rank that wrote it
        storage_get = md.storage.get
        prod = math.prod
        new_ref = ChunkRef.__new__
        set_box, set_file = ChunkRef.box.__set__, ChunkRef.file.__set__
        set_locator, set_rank = ChunkRef.locator.__set__, ChunkRef.rank.__set__
        chunk_rels: list[str] = []  # every chunk's file and item end (for need, at the end)
        chunk_ends: list[int] = []
        for key, meta in _in_save_order(md.entries, md.planner_data):  # the order dcp.load asks in
            path = md.planner_data.get(key) or guess_path(key)
            if isinstance(meta, BytesMeta):
                info = _storage_of(md, key, None, where)
                _need(need, key, info)
                transforms.add(info.transforms)
                objects[key] = ObjectEntry(key, path, info.relative_path, _locator(info),
                                           info.length)
                continue
            boxes = list(meta.chunks)  # ChunkMeta is Box; dcp.save writes them in order
            if not all(map(operator.le, map(_OFFSETS, boxes), map(_OFFSETS, boxes[1:]))):
                boxes.sort(key=_OFFSETS)
            numels = check_cover(key, meta.size, boxes, where)
            itemsize = _itemsize(meta.dtype, key, where)
            infos = list(map(storage_get, zip(repeat(key), map(_OFFSETS, boxes))))  # C-level loops
            if None in infos:
                _storage_of(md, key, boxes[infos.index(None)].offsets, where)  # raises
            rels = list(map(_REL, infos))
            if any(map(operator.gt, map(operator.mul, numels, repeat(itemsize)),
                       map(_LENGTH, infos))):  # rare: compressed, or damaged
                sized += [(key, b.offsets, prod(b.sizes) * itemsize, i) for b, i in zip(boxes, infos)
                          if prod(b.sizes) * itemsize > i.length]
            if any(map(_TRANSFORMS, infos)):
                transforms.update(filter(None, map(_TRANSFORMS, infos)))
            chunk_rels += rels
            chunk_ends += map(operator.add, map(_OFFSET, infos), map(_LENGTH, infos))
            # ChunkRef(box, rel, info, rank) for every chunk in C-level loops (no Python call each)
            chunks = list(map(new_ref, repeat(ChunkRef, len(boxes))))
            for setter, values in ((set_box, boxes), (set_file, rels), (set_locator, infos),
                                   (set_rank, map(ranks.__getitem__, rels))):
                deque(map(setter, chunks, values), 0)
            tensors[key] = TensorEntry(key, meta.dtype, meta.size, tuple(chunks), path)
        for rel, end in _max_ends(chunk_rels, chunk_ends).items():
            if end > need.get(rel, (-1, ""))[0]:
                need[rel] = (end, None)  # its key is looked up only for a message (key_of)

        def key_of(rel: str, end: int) -> str:  # the first chunk (index order) whose item ends there
            return next(k for k, t in tensors.items() for c in t.chunks
                        if c.file == rel and c.locator.offset + c.locator.length == end)

        files = _check_sizes(self._storage, need, key_of)
        for key, offsets, nbytes, info in sized:
            _check_item_size(key, offsets, nbytes, info, where)
        return CheckpointIndex("dcp", str(self.root), tensors, objects, self._info(files, transforms))

    def _info(self, files: dict[str, int], transforms: set[tuple[str, ...]]) -> dict[str, Any]:
        md = self._md
        names = self._storage.list()
        ranks = {r for r in map(_rank_of, names) if r is not None}
        ranks |= {r for r in rank_metadata_files(names)}
        sm = md.storage_meta
        return {
            "version": md.version,
            "layout_version": _era(md),
            "world_size": max(ranks) + 1 if ranks else None,
            "files": files,
            "metadata_files": list(self._md_files),
            "per_rank_metadata": self._md_files != [METADATA_NAME],
            "transforms": sorted({"+".join(t) for t in transforms if t}),
            "storage_meta": None if sm is None else {
                "checkpoint_id": sm.checkpoint_id, "save_id": sm.save_id,
                "modules": list(sm.modules),
            },
        }

    def index(self) -> CheckpointIndex:
        """The checkpoint's index (built and validated on open)."""
        return self._index

    # -- raw access --------------------------------------------------------------------------

    def _fd(self, relative_path: str) -> int | RandomFile:
        """An fd (local) or a ranged-read file (URL) for ``relative_path``, opened once."""
        return self._files.get(relative_path)

    def _item(self, loc: Locator, key: str, limit: int) -> archive.ReadAt:
        """A reader over the item's (decoded) bytes."""
        where = f"{self.root / loc.relative_path}: key {key!r}"
        raw = archive.SliceReader(self._fd(loc.relative_path), loc.offset, loc.length, where)
        if not loc.transforms:
            return raw
        return archive.BufferReader(
            archive.decode_item(bytes(raw(0, loc.length)), loc.transforms, where, limit), where
        )

    def _chunk(self, key: str, chunk: ChunkRef) -> tuple[archive.ArchiveTensor, archive.ReadAt]:
        loc = chunk.locator
        hit = self._cache.get(loc)
        if hit is not None:
            return hit
        entry = self._tensor(key)
        nbytes = chunk.box.numel * itemsize_of(entry.dtype)
        read = self._item(loc, key, nbytes + ARCHIVE_SLACK)
        where = f"{self.root / loc.relative_path}: key {key!r} chunk at {list(chunk.box.offsets)}"
        parsed = archive.parse_tensor_archive(read, where, entry.dtype, chunk.box.sizes)
        self._cache.put(loc, (parsed, read), read.length if loc.transforms else 0)
        return parsed, read

    def _tensor(self, key: str) -> TensorEntry:
        entry = self._index.tensors.get(key)
        if entry is None:
            raise PlanError(f"{self.root}: no tensor {key!r} in this checkpoint")
        return entry

    # -- the CheckpointReader protocol -------------------------------------------------------

    def _local(self, key: str, chunk: ChunkRef, region: Box) -> Box:
        if not chunk.box.contains(region) or region.ndim != chunk.box.ndim:
            raise PlanError(
                f"key {key!r}: region {region.to_json()} is not inside chunk {chunk.box.to_json()}"
            )
        return region.relative_to(chunk.box)

    def prefetch(self, key: str, chunk: ChunkRef) -> None:
        """Start reading the chunk's item into the page cache (a local file's; a hint, no wait:
        errors are left to the read)."""
        loc = chunk.locator
        try:
            fd = self._fd(loc.relative_path)
        except (OSError, CkptConvError):
            return
        if isinstance(fd, int):
            prefetch(fd, loc.offset, loc.length)

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        """A new contiguous tensor holding ``region`` (global coords, inside ``chunk.box``).
        Imports torch; :meth:`read_region_array` and :meth:`read_region_into` do not."""
        return archive.as_tensor(self.read_region_array(key, chunk, region), self._tensor(key).dtype)

    def read_region_array(self, key: str, chunk: ChunkRef, region: Box) -> np.ndarray:
        """A new C-contiguous numpy bit array (storage dtype of :mod:`formats.dtypes`) holding
        ``region`` (global coords, inside ``chunk.box``)."""
        local = self._local(key, chunk, region)
        parsed, read = self._chunk(key, chunk)
        return archive.read_region_array(parsed, read, local.offsets, local.sizes, self._seen(key, chunk, parsed))

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` (writable bytes, exactly the region's size) with ``region`` in C order,
        reading straight into it when the region is one dense run of the stored chunk."""
        local = self._local(key, chunk, region)
        parsed, read = self._chunk(key, chunk)
        archive.read_region_into(parsed, read, local.offsets, local.sizes, out, self._seen(key, chunk, parsed))

    def _seen(self, key: str, chunk: ChunkRef, parsed: archive.ArchiveTensor) -> archive.Seen | None:
        """Where a region read reports the storage bytes it read, for the chunk's CRC-32 (None
        when this reader does not verify, or the chunk is checked already): the bytes of every
        read are CRC'd in memory and combined (:class:`formats.integrity.CRCRanges`); the read
        that completes the chunk compares, and raises on a mismatch."""
        checks = self._checks
        if checks is None or checks.done(chunk.locator):
            return None
        where = self._where(key, chunk)
        if not parsed.data_length:  # nothing stored (an empty chunk): its CRC is that of no bytes
            checks.once(chunk.locator, lambda: archive.check_crc(parsed, 0, where))
            return None

        def gap_reader(offset: int, view: memoryview) -> None:  # the chunk's bytes no read covered
            archive.storage_reader(*self._chunk(key, chunk))(offset, view)

        def start():
            return (CRCRanges(parsed.data_length), lambda crc: archive.check_crc(parsed, crc, where),
                    block_fill(gap_reader))

        locator, part = chunk.locator, checks.part
        return lambda offset, data: part(locator, offset, data, start)

    def pending_checks(self, chunks: Iterable[ChunkRef]) -> bool:
        """Whether the check of any of ``chunks`` is still open (parts read, not all bytes seen)."""
        return self._checks is not None and self._checks.any_pending(c.locator for c in chunks)

    def finish_checks(self, workers: int = 1) -> int:
        """Complete the open checks: read the bytes of each chunk no region read covered (storage
        beyond its view, parts another rank copied), compare. CorruptCheckpointError on a
        mismatch; returns the chunks completed."""
        return 0 if self._checks is None else self._checks.finish(workers)

    def _where(self, key: str, chunk: ChunkRef) -> str:
        return f"{self.root / chunk.file}: key {key!r} chunk at {list(chunk.box.offsets)}"

    def chunk_archive(self, key: str, chunk: ChunkRef) -> archive.ArchiveTensor:
        """The parsed archive of a chunk (dtype, stride, where its storage bytes start)."""
        return self._chunk(key, chunk)[0]

    def check_chunk_archive(self, key: str, chunk: ChunkRef, whole_item_bytes: int = checks.WHOLE_ITEM_BYTES) -> int:
        """Parse the chunk's archive (dtype, shape, storage size against the metadata), then check
        the CRC-32 of every entry in it (:func:`formats.dcp.checks.check_archive`; items over
        ``whole_item_bytes`` streamed). CorruptCheckpointError on damage; entry bytes checked."""
        _, read = self._chunk(key, chunk)
        return checks.check_archive(read, self._where(key, chunk), whole_item_bytes)

    def check_object_archive(self, key: str, whole_item_bytes: int = checks.WHOLE_ITEM_BYTES) -> int:
        """Check the CRC-32 of every entry of a non-tensor entry's archive (stream transforms
        undone first). CorruptCheckpointError on damage; entry bytes checked."""
        entry = self._object(key)
        read = self._item(entry.locator, key, MAX_OBJECT_BYTES)
        return checks.check_archive(read, f"{self.root / entry.file}: key {key!r}", whole_item_bytes)

    def verify_chunk_crc(self, key: str, chunk: ChunkRef) -> None:
        """Check the zip CRC-32 of a chunk's stored bytes; CorruptCheckpointError on mismatch."""
        parsed, read = self._chunk(key, chunk)
        archive.verify_crc(parsed, read, self._where(key, chunk))

    def read_object_bytes(self, key: str) -> bytes:
        """The ``torch.save`` bytes of a non-tensor entry (stream transforms undone)."""
        loc = self._object(key).locator
        if loc.length > MAX_OBJECT_BYTES:
            raise CorruptCheckpointError(
                f"{self.root / loc.relative_path}: key {key!r} is {loc.length} bytes, over the "
                f"{MAX_OBJECT_BYTES} byte limit for non-tensor entries"
            )
        read = self._item(loc, key, MAX_OBJECT_BYTES)
        return bytes(read(0, read.length))

    def _object(self, key: str) -> ObjectEntry:
        entry = self._index.objects.get(key)
        if entry is None:
            raise PlanError(f"{self.root}: no non-tensor entry {key!r} in this checkpoint")
        return entry

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        """The value of a non-tensor entry (weights-only unpickling unless pickles are trusted)."""
        data = self.read_object_bytes(key)
        source = str(self.root / self._index.objects[key].file)
        return load_object_bytes(data, source, key, trust_pickle or self.trust_pickle)

    def close(self) -> None:
        """Close the open files and drop cached headers (the reader reopens files if used again)."""
        self._files.close()
        self._cache.clear()

    def __enter__(self) -> DCPReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _itemsize(dtype: str, key: str, where: str) -> int:
    """Bytes per element of a tensor's dtype; an unsupported dtype names the key and the file."""
    try:
        return by_name(dtype).itemsize
    except UnsupportedError:
        raise UnsupportedError(
            f"{where}: key {key!r} has dtype {dtype!r}, which this ckptconv cannot copy; supported: "
            f"{', '.join(BY_NAME)}; upgrade ckptconv (and torch) or leave the key out of the save"
        ) from None


def _locator(info: StorageInfo) -> Locator:
    return info


def _era(md: DCPMetadata) -> str:
    """Which torch era wrote the metadata (fields appeared in 2.4 and 2.9)."""
    if md.version is not None:
        return f"dcp-{md.version}"
    return "torch-2.4-2.8" if md.storage_meta is not None else "torch<=2.3"
