"""Writing a DCP checkpoint from one process, streaming, with no process group.

A :class:`DCPWriter` is built from the full list of chunks (tensor boxes and the rank whose file
holds them) and objects (already serialized with ``torch.save``). Construction validates that every
tensor is covered exactly once and computes the whole layout: each rank's file holds its objects
and tensor chunks in the key order of ``planner_data`` (the job's state-dict order, in which
``dcp.load`` reads), each chunk a ``torch.save`` archive whose size depends only on (dtype,
shape). Then:

- :meth:`DCPWriter.prepare` creates every rank's file at its final size (also done on first use);
- :meth:`DCPWriter.open_chunk` returns a sink taking the chunk's bytes in C order (thread-safe
  across chunks: each sink ``pwrite``\\ s at its own offsets);
- :meth:`DCPWriter.write_objects` writes the objects verbatim;
- :meth:`DCPWriter.commit` checks every chunk was closed, fsyncs the data (each file not yet synced
  since its last write, once) and publishes ``.metadata`` atomically.

Every write to a rank file goes through one :class:`formats.fsutil.BlockCombiner`: whole 1 MiB
blocks at aligned offsets are written at once (``O_DIRECT`` where the file system takes it), the
pieces' bytes in between and the archives' small records gathered into blocks first, so the files
are written in large aligned writes whatever the chunk sizes. Nothing is named ``.metadata`` before that; :meth:`DCPWriter.abort` removes the data.

The ``.metadata`` matches what ``dcp.save`` (torch 2.13, ``FileSystemWriter``) writes: the same
``TensorProperties`` defaults, ``MetadataIndex(fqn, offsets, index)`` keys, ``_StorageInfo`` values,
``StorageMeta(checkpoint_id=Path(root), save_id=uuid4)`` and ``version="1.0.0"``.

**Rank-local metadata** (``readers``): instead of one ``.metadata``, each rank ``R`` gets
``__R.metadata`` naming only the items it loads, as ``dcp.save(..., use_collectives=False)``
writes them; ``dcp.load`` of a folder without ``.metadata`` reads its rank's file (and plans with
no collective). A box several ranks hold may then be stored once per file (:class:`ChunkCopy`),
so every rank (or every node) reads only its own files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import os
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import repeat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from formats.base import Box, first_overlap
from formats.dcp.archive_writer import TensorArchiveWriter, archive_size
from formats.dtypes import by_name
from formats.errors import ConfigError, DestinationError, IncompleteCheckpointError
from formats.fsutil import (DIRECT_MIN_BYTES, WRITE_BEHIND_BYTES, WRITE_BEHIND_MIN_BLOCK, WRITE_BEHIND_PER_BUDGET,
                            BlockCombiner, DirectWrites, atomic_write_bytes, combine_block, fsync_dir, run_parallel,
                            safe_join, short)
from formats.manifest import Manifest

if TYPE_CHECKING:
    import torch

METADATA_NAME = ".metadata"
DCP_VERSION = "1.0.0"


def rank_metadata_name(rank: int) -> str:
    """The rank-local metadata file of ``rank`` (``dcp.save(..., use_collectives=False)``'s name,
    which ``dcp.load`` reads when the folder has no ``.metadata``)."""
    return f"__{rank}{METADATA_NAME}"


def default_file_name(rank: int) -> str:
    """The data file ``FileSystemWriter`` gives ``rank`` (one file per rank, thread_count=1)."""
    return f"__{rank}_0.distcp"


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """One stored chunk: tensor ``key`` of ``dtype`` and ``global_shape``, its ``box``, the file
    owner ``rank``."""

    key: str
    dtype: str  # torch name, e.g. "bfloat16"
    global_shape: tuple[int, ...]
    box: Box
    rank: int

    @classmethod
    def of(cls, key: str, dtype: str, global_shape: tuple[int, ...], box: Box, rank: int) -> ChunkSpec:
        """A spec from values already in canonical form (a canonical dtype name, tuples of
        Python ints), as layouts make them by the million: no normalisation pass."""
        spec = object.__new__(cls)
        for name, value in (("key", key), ("dtype", dtype), ("global_shape", global_shape), ("box", box),
                            ("rank", rank)):
            object.__setattr__(spec, name, value)
        return spec

    @classmethod
    def many(cls, key: str, dtype: str, global_shape: tuple[int, ...], boxes: Sequence[Box],
             ranks: Sequence[int]) -> list[ChunkSpec]:
        """:meth:`of` for every ``(boxes[i], ranks[i])`` of one tensor, built by C-level iteration
        (no Python call per spec; a 1,024-rank layout makes millions)."""
        n = len(boxes)
        if len(ranks) != n:
            raise ValueError(f"{n} boxes but {len(ranks)} ranks")
        specs = list(map(object.__new__, repeat(cls, n)))
        for setter, values in ((_SET_KEY, repeat(key, n)), (_SET_DTYPE, repeat(dtype, n)),
                               (_SET_SHAPE, repeat(global_shape, n)), (_SET_BOX, boxes), (_SET_RANK, ranks)):
            deque(map(setter, specs, values), 0)
        return specs

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", by_name(self.dtype).name)
        object.__setattr__(self, "global_shape", _int_tuple(self.global_shape))
        box = self.box
        offsets, sizes = _int_tuple(box.offsets), _int_tuple(box.sizes)
        if offsets is not box.offsets or sizes is not box.sizes:
            object.__setattr__(self, "box", Box(offsets, sizes))


_SET_KEY, _SET_DTYPE, _SET_SHAPE = ChunkSpec.key.__set__, ChunkSpec.dtype.__set__, ChunkSpec.global_shape.__set__
_SET_BOX, _SET_RANK = ChunkSpec.box.__set__, ChunkSpec.rank.__set__
_KEY = operator.attrgetter("key")


@dataclass(frozen=True, slots=True)
class ChunkCopy(ChunkSpec):
    """One copy of a chunk stored in several rank files (rank- or node-local outputs): the same
    key and box as the others, its own file; its copy task is journaled apart (``journal_tag``)."""

    @property
    def journal_tag(self) -> str:
        return f"rank{self.rank}"


#: Tuples of plain ints by value (layouts repeat a few offsets and sizes millions of times).
_INT_TUPLES: dict[tuple, tuple[int, ...]] = {}


def _int_tuple(values) -> tuple[int, ...]:
    """``values`` as a tuple of Python ints (numpy ints converted), shared with equal tuples."""
    key = values if type(values) is tuple else tuple(values)
    try:
        return _INT_TUPLES[key]  # numpy ints hash and compare like the ints they hold
    except KeyError:
        pass
    out = tuple(int(v) for v in key)
    if out == key and all(type(v) is int for v in key):
        out = key
    if len(_INT_TUPLES) < 1 << 16:
        _INT_TUPLES[out] = out
    return out


@dataclass(frozen=True)
class ObjectSpec:
    """A non-tensor entry: ``data`` is the ``torch.save`` pickle of the value, written verbatim."""

    key: str
    data: bytes
    rank: int


@dataclass(frozen=True, slots=True)
class ItemLocation:
    """Where an item's bytes lie: file (relative to the root), offset and length."""

    relative_path: str
    offset: int
    length: int


def load_order(planner_data: Mapping[str, tuple]) -> dict[str, int]:
    """Key -> its place in the order ``dcp.load`` (torch 2.13) requests the items: the top-level
    keys of the state dict sorted (``dcp.load`` sorts them before planning), each one's keys in
    ``planner_data``'s order (the saving job's flattening of its state dict; the loading job
    flattens the same structure in the same order, e.g. an optimizer's ``step``, ``exp_avg``,
    ``exp_avg_sq`` per parameter)."""
    keys = sorted(planner_data, key=lambda k: str(planner_data[k][0]))  # stable: planner order within
    return {k: i for i, k in enumerate(keys)}


# ----------------------------------------------------------------------------- validation


def _check_box(spec: ChunkSpec) -> None:
    shape, box = spec.global_shape, spec.box
    if len(box.offsets) != len(shape) or len(box.sizes) != len(shape):
        raise ConfigError(
            f"chunk of {spec.key!r}: box {box.to_json()} has the wrong rank for shape {list(shape)}"
        )
    for o, s, d in zip(box.offsets, box.sizes, shape):
        if o < 0 or s < 0 or o + s > d:
            raise ConfigError(
                f"chunk of {spec.key!r}: box {box.to_json()} lies outside shape {list(shape)}"
            )


def _check_disjoint(key: str, boxes: list[Box]) -> None:
    """Raise unless the non-empty ``boxes`` are pairwise disjoint (a sweep, O(n log n))."""
    full = [b for b in boxes if b.numel]
    if len(full) > 1 and not full[0].ndim:
        raise ConfigError(f"tensor {key!r} is 0-d but has {len(full)} chunks; it needs exactly one")
    pair = first_overlap(full)
    if pair is not None:
        raise ConfigError(
            f"tensor {key!r}: chunks {pair[0].to_json()} and {pair[1].to_json()} overlap; "
            "each element must be stored once"
        )


def _group_chunks(chunks: Sequence[ChunkSpec], readers: Sequence[Sequence[int]] | None = None
                  ) -> tuple[list[ChunkSpec], list[tuple[int, ...]] | None]:
    """The chunks to store, in the given order, validated per key: one dtype and shape, boxes in
    bounds, the distinct boxes disjoint and covering the tensor. Repeats of an empty box of one key
    are dropped (``dcp.save`` deduplicates them the same way; their ``readers`` read the one kept).
    Without ``readers`` a box is stored once; with them (aligned with ``chunks``) a non-empty box
    may be stored in several rank files, once per file. Returns the kept chunks and their readers."""
    kept: list[ChunkSpec] = []
    kept_readers: list[tuple[int, ...]] | None = None if readers is None else []
    by_key: dict[str, list[ChunkSpec]] = {}
    empty: dict[tuple, int] = {}  # (key, box) of an empty box -> its kept position
    copies: set[tuple] = set()
    for i, spec in enumerate(chunks):
        specs = by_key.setdefault(spec.key, [])
        first = specs[0] if specs else spec
        if (spec.dtype, spec.global_shape) != (first.dtype, first.global_shape):
            raise ConfigError(
                f"tensor {spec.key!r}: chunks disagree on dtype/shape "
                f"({first.dtype}{list(first.global_shape)} vs {spec.dtype}{list(spec.global_shape)})"
            )
        _check_box(spec)
        box = spec.box
        if not box.numel:
            at = empty.get((spec.key, box))
            if at is not None:  # a repeat: its readers read the kept one
                if kept_readers is not None:
                    kept_readers[at] = tuple(sorted({*kept_readers[at], *readers[i]}))
                continue
            empty[(spec.key, box)] = len(kept)
        elif readers is not None:
            if (spec.key, box, spec.rank) in copies:
                raise ConfigError(f"chunk {spec.key!r} {box.to_json()} is stored twice in rank {spec.rank}'s file")
            copies.add((spec.key, box, spec.rank))
        specs.append(spec)
        kept.append(spec)
        if kept_readers is not None:
            kept_readers.append(tuple(readers[i]))
    for key, specs in by_key.items():
        boxes = list({s.box: None for s in specs}) if readers is not None else [s.box for s in specs]
        total = math.prod(specs[0].global_shape)
        stored = sum(b.numel for b in boxes)
        _check_disjoint(key, boxes)
        if stored != total:
            raise ConfigError(
                f"tensor {key!r}: chunks hold {stored} of its {total} elements; cover it exactly once"
            )
    return kept, kept_readers


def _check_names(
    chunks: Sequence[ChunkSpec],
    objects: Sequence[ObjectSpec],
    planner_data: Mapping[str, tuple],
    world_size: int,
    copies: bool = False,
) -> None:
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    for item in (*chunks, *objects):
        if not 0 <= item.rank < world_size:
            raise ConfigError(f"item {item.key!r}: rank {item.rank} is outside world size {world_size}")
    tensor_keys = {c.key for c in chunks}
    object_keys = [(o.key, o.rank) if copies else o.key for o in objects]
    if len(set(object_keys)) != len(object_keys) or tensor_keys & {o.key for o in objects}:
        dup = sorted({o.key for o, k in zip(objects, object_keys) if object_keys.count(k) > 1 or o.key in tensor_keys})
        raise ConfigError(f"keys stored twice: {dup}; each key is one tensor or one object")
    object_keys = [o.key for o in objects]
    missing = (tensor_keys | set(object_keys)) ^ set(planner_data)
    if missing:
        raise ConfigError(
            f"planner_data must name exactly the stored keys; mismatched: {sorted(missing)[:5]}"
        )
    unjoined = next((k for k, path in planner_data.items() if ".".join(map(str, path)) != k), None)
    if unjoined is not None:  # dcp.save's keys are their paths joined; readers refuse anything else
        raise ConfigError(f"planner_data path {tuple(planner_data[unjoined])!r} of key {unjoined!r} does not "
                          "join (with '.') to the key")


# ----------------------------------------------------------------------------- the writer


class DCPWriter:
    """Writes a DCP checkpoint (``.distcp`` files + ``.metadata``) from one process, streaming."""

    def __init__(
        self,
        root: str | os.PathLike,
        chunks: Sequence[ChunkSpec],
        objects: Sequence[ObjectSpec],
        planner_data: Mapping[str, tuple],
        world_size: int,
        *,
        file_name: Callable[[int], str] = default_file_name,
        direct_io: bool = True,
        readers: Sequence[Sequence[int]] | None = None,
        object_readers: Sequence[Sequence[int]] | None = None,
        ranks: Collection[int] | None = None,
        item_order: str = "load",
        memory_budget: int | None = None,
    ) -> None:
        """``direct_io``: send the large aligned part of each piece straight to the device
        (``O_DIRECT`` where the file system takes it: no page-cache copy, no writeback left for
        the commit's fsync), the rest through the page cache.

        ``readers`` (one entry per chunk) and ``object_readers`` (per object): the ranks that load
        each stored item; then every rank ``R`` gets rank-local metadata ``__R.metadata`` naming
        the items it loads, and no ``.metadata`` is written (a box or an object may be stored in
        several rank files). ``ranks``: the rank files this writer creates, writes and publishes
        (with their rank metadata): one node's, when each node writes its own folder (default all).

        ``item_order``: how each rank file's items follow one another. ``"load"`` (default): in
        the order ``dcp.load`` requests them (:func:`load_order`), objects among the tensors, so
        torch's ``FileSystemReader`` reads every file front to back without seeking back.
        ``"save"``: as ``dcp.save`` writes a file: the objects, then the chunks in the given order
        (byte-identical to ``dcp.save``'s file when given its plan's order).

        ``memory_budget``: the conversion's; bounds the blocks small writes are gathered in
        (:func:`formats.fsutil.combine_block`) and the full ones queued for the disk (at most
        1/``WRITE_BEHIND_PER_BUDGET`` of it).
        """
        local = readers is not None
        if local and (len(readers) != len(chunks) or object_readers is None or len(object_readers) != len(objects)):
            raise ConfigError("readers and object_readers name the loading ranks of every chunk and object")
        _check_names(chunks, objects, planner_data, world_size, copies=local)
        self.root = Path(root)
        self.world_size = world_size
        self._files = {r: file_name(r) for r in range(world_size)}
        if len(set(self._files.values())) != world_size:
            raise ConfigError("file_name must give each rank its own file")
        self._own = set(range(world_size)) if ranks is None else set(ranks)
        self._chunks, self._readers = _group_chunks(chunks, readers)  # given order, repeated empty boxes dropped
        self._tensors: dict[str, list[ChunkSpec]] = {}
        for spec in self._chunks:
            self._tensors.setdefault(spec.key, []).append(spec)
        self._objects = list(objects)
        self._object_readers = None if object_readers is None else [tuple(r) for r in object_readers]
        self._planner_data = {k: tuple(v) for k, v in planner_data.items()}
        if item_order not in ("load", "save"):
            raise ConfigError(f"item_order {item_order!r}: choose 'load' or 'save'")
        self._item_order = item_order
        self._chunk_loc, self._object_loc, self._sizes = self._compute_layout()
        self._lock = threading.Lock()
        self._direct_io = direct_io
        #: the small writes of every rank file (archive headers and tails, the unaligned ends of
        #: pieces, small chunks) gathered into whole aligned blocks: large writes whatever the pieces
        block = combine_block(len(self._own), memory=memory_budget)
        queue = None if memory_budget is None else memory_budget // WRITE_BEHIND_PER_BUDGET
        self._combiner = BlockCombiner(block, behind=block >= WRITE_BEHIND_MIN_BLOCK,
                                       queue_bytes=None if queue is None else min(queue, WRITE_BEHIND_BYTES))
        self._fds: dict[int, DirectWrites] = {}
        self._sinks: dict[tuple, TensorArchiveWriter] = {}
        self._objects_written = False
        self._final: Any = None  # the Metadata manifest() described, which commit() then writes
        self._state = "new"  # new -> prepared -> committed | aborted

    @property
    def rank_local(self) -> bool:
        """Whether each rank gets its own ``__<rank>.metadata`` (no ``.metadata``)."""
        return self._readers is not None

    def metadata_names(self) -> list[str]:
        """The metadata files :meth:`commit` publishes (``.metadata``, or this writer's ranks'
        ``__<rank>.metadata``)."""
        if not self.rank_local:
            return [METADATA_NAME]
        return [rank_metadata_name(r) for r in sorted(self._own)]

    def data_files(self) -> list[str]:
        """The data files this writer creates (one per rank of its ranks)."""
        return [self._files[r] for r in sorted(self._own)]

    # -- layout (pure) -------------------------------------------------------------------------

    def _compute_layout(self):
        """Each rank file's items back to back in ``item_order`` (``"load"``: the order ``dcp.load``
        asks for them, :func:`load_order`), the chunks of one key in their given order."""
        cursor = dict.fromkeys(range(self.world_size), 0)
        object_loc, chunk_loc = {}, {}
        if self._item_order == "save":
            position = dict.fromkeys(self._planner_data, -1)  # every object first, the chunks as given
            position.update(dict.fromkeys(self._tensors, 0))
        else:
            position = load_order(self._planner_data)
        chunks = self._chunks
        at = list(map(position.__getitem__, map(_KEY, chunks)))  # C-level loops: millions at scale
        if not all(map(operator.le, at, at[1:])):
            order = sorted(range(len(chunks)), key=at.__getitem__)  # stable: a key's chunks keep their order
            chunks, at = [chunks[i] for i in order], [at[i] for i in order]
        objects = sorted(self._objects, key=lambda o: position[o.key])
        waiting = deque(objects)
        files = self._files

        def place_objects(before: float) -> None:
            while waiting and position[waiting[0].key] < before:
                obj = waiting.popleft()
                object_loc[_object_id(obj)] = ItemLocation(files[obj.rank], cursor[obj.rank], len(obj.data))
                cursor[obj.rank] += len(obj.data)

        for spec, p in zip(chunks, at):
            if waiting:
                place_objects(p)
            length = archive_size(spec.dtype, spec.box.sizes)
            chunk_loc[_chunk_id(spec)] = ItemLocation(files[spec.rank], cursor[spec.rank], length)
            cursor[spec.rank] += length
        place_objects(math.inf)
        return chunk_loc, object_loc, cursor

    def layout(self) -> dict[int, int]:
        """Rank -> size in bytes of its data file (every rank has one, possibly empty)."""
        return dict(self._sizes)

    def location(self, item: ChunkSpec | ObjectSpec | str) -> ItemLocation:
        """Where a chunk's archive (or an object's bytes, by spec or key) lies."""
        if isinstance(item, ChunkSpec):
            return self._chunk_loc[_chunk_id(item)]
        if isinstance(item, ObjectSpec):
            return self._object_loc[_object_id(item)]
        return next(self._object_loc[_object_id(o)] for o in self._objects if o.key == item)

    # -- I/O -----------------------------------------------------------------------------------

    def prepare(self, resume: bool = False) -> None:
        """Create the root and every rank's data file at its final size (idempotent).

        ``resume`` keeps the bytes already in the files (an interrupted run of the same plan).
        """
        with self._lock:
            self._check_state("prepare")
            if self._state == "prepared":
                return
            self.root.mkdir(parents=True, exist_ok=True)
            done = next((n for n in self.metadata_names() if (self.root / n).exists()), None)
            if done is not None:
                raise DestinationError(
                    f"{self.root} already holds a checkpoint ({done}); write to an empty directory"
                )
            flags = os.O_RDWR | os.O_CREAT | (0 if resume else os.O_TRUNC)
            try:
                for rank, name in self._files.items():
                    if rank not in self._own:
                        continue
                    path = safe_join(self.root, name)
                    fd = os.open(path, flags, 0o644)
                    direct = self._direct_io and self._sizes[rank] >= DIRECT_MIN_BYTES
                    # a file reopened at its size (--resume, another torchrun rank) needs no sync
                    # before it is written to; a created or resized one does (its size, its entry)
                    resized = not resume or os.fstat(fd).st_size != self._sizes[rank]
                    self._fds[rank] = DirectWrites(fd, path if direct else None, combiner=self._combiner,
                                                   size=self._sizes[rank], dirty=resized)
                    if resized:
                        os.ftruncate(fd, self._sizes[rank])
            except BaseException:
                self._close_fds()
                raise
            self._state = "prepared"

    def open_chunk(self, spec: ChunkSpec) -> TensorArchiveWriter:
        """A sink for ``spec``'s bytes: ``.write(piece)`` in C order, then ``.close()``."""
        cid = _chunk_id(spec)
        if cid not in self._chunk_loc:
            if any(spec.box == s.box and not s.box.numel for s in self._tensors.get(spec.key, ())):
                return _EmptySink(spec)  # a deduplicated empty chunk: nothing to store
            raise ConfigError(
                f"chunk {spec.key!r} {spec.box.to_json()} of rank {spec.rank} is not in this writer's plan"
            )
        if spec.rank not in self._own:
            raise ConfigError(f"chunk {spec.key!r} {spec.box.to_json()} goes to rank {spec.rank}'s file, which this "
                              "writer does not write")
        self.prepare()
        loc = self._chunk_loc[cid]
        # the chunk is reserved under the lock; its archive's first bytes are written outside it
        # (they may complete a block: a write to the disk, which other chunks need not wait for)
        with self._lock:
            self._check_state("open_chunk")
            if cid in self._sinks:
                raise ConfigError(
                    f"chunk {spec.key!r} {spec.box.to_json()} was opened twice; write each chunk once"
                )
            self._sinks[cid] = _OPENING
            fd = self._fds[spec.rank]
        try:
            sink = TensorArchiveWriter(fd, loc.offset, spec.dtype, spec.box.sizes)
        except BaseException:
            with self._lock:
                del self._sinks[cid]
            raise
        with self._lock:
            self._sinks[cid] = sink
        return sink

    def adopt_chunk(self, spec: ChunkSpec) -> None:
        """Count a chunk written (and made durable) by an interrupted run as written (resume)."""
        cid = _chunk_id(spec)
        if cid not in self._chunk_loc:
            return
        with self._lock:
            self._sinks[cid] = _Adopted()

    def close(self) -> None:
        """Close the files and keep them (an interrupted run that ``--resume`` continues)."""
        with self._lock:
            self._close_fds()

    def sync(self, ranks: Collection[int] | None = None) -> None:
        """fdatasync every rank file (of ``ranks``; None: all) written since its last sync,
        several at once (the journal calls this before recording finished chunks)."""
        with self._lock:
            files = [f for r, f in self._fds.items() if ranks is None or r in ranks]
        run_parallel(lambda f: f.sync(), [f for f in files if f.dirty])

    def write_objects(self) -> None:
        """Write every object's bytes at its offset (idempotent)."""
        self.prepare()
        with self._lock:
            self._check_state("write_objects")
            if self._objects_written:
                return
            for obj in self._objects:
                if obj.rank in self._own:
                    self._fds[obj.rank].pwrite(obj.data, self._object_loc[_object_id(obj)].offset)
            self._objects_written = True

    def commit(self) -> None:
        """Check completeness, make the data files durable (each file once: those written since
        their last sync, several at once), fsync the directory, then publish ``.metadata``
        atomically (written, fsynced, renamed, the directory fsynced again)."""
        self.write_objects()
        with self._lock:
            self._check_state("commit")
            unclosed = [c for c in self._chunk_loc if c[1] in self._own and (c not in self._sinks or not self._sinks[c].closed)]
            if unclosed:
                key, _, offsets, _ = unclosed[0]
                raise IncompleteCheckpointError(
                    f"{self.root}: {len(unclosed)} chunk(s) not written and closed, e.g. {key!r} at "
                    f"{list(offsets)}; close every chunk before commit()"
                )
            run_parallel(lambda f: f.sync(), [f for f in self._fds.values() if f.dirty])
            self._close_fds()
            fsync_dir(self.root)
            final = self._final if self._final is not None else self._metadata_to_publish()
            if self.rank_local:
                self._publish_rank_metadata(final)
            else:
                from formats.dcp import metadata_pickle as mp

                atomic_write_bytes(self.root / METADATA_NAME, mp.dumps(final))  # what manifest() described
            self._state = "committed"

    def abort(self) -> None:
        """Close the files and remove the data this writer created; never leaves a ``.metadata``."""
        with self._lock:
            if self._state in ("committed", "aborted"):
                return
            self._close_fds(flush=self._state != "prepared")  # its files are removed: nothing to write
            if self._state == "prepared":
                for name in self.data_files():
                    try:
                        os.unlink(self.root / name)
                    except FileNotFoundError:
                        pass
            self._state = "aborted"

    def __enter__(self) -> DCPWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _check_state(self, action: str) -> None:
        if self._state in ("committed", "aborted"):
            raise ConfigError(f"{action}() on a DCPWriter for {self.root} that is already {self._state}")

    def _close_fds(self, flush: bool = True) -> None:
        fds, self._fds = self._fds, {}
        for f in fds.values():
            f.close(flush=flush)

    # -- metadata ------------------------------------------------------------------------------

    def metadata_bytes(self, save_id: str | None = None) -> bytes:
        """The ``.metadata`` pickle: unpickles to what :meth:`metadata` returns, but is built
        without importing torch (seconds of CPU); see :mod:`formats.dcp.metadata_pickle`.
        ``save_id`` defaults to a new uuid4, as in ``dcp.save``."""
        from formats.dcp import metadata_pickle as mp

        if self.rank_local:
            raise ConfigError("a writer of rank-local metadata has no .metadata; see rank_metadata_bytes")
        return mp.dumps(self._stand_in_metadata(save_id))

    def _metadata_to_publish(self) -> Any:
        """What :meth:`commit` publishes: the stand-in ``.metadata``, or (rank-local) each own
        rank's stand-in ``__<rank>.metadata`` by rank, sharing one save id."""
        if not self.rank_local:
            return self._stand_in_metadata()
        items, save_id = self.rank_items(), str(uuid.uuid4())  # one save, as dcp.save's ranks share its id
        return {r: self._rank_metadata(r, items[r], save_id) for r in sorted(self._own)}

    def _stand_in_metadata(self, save_id: str | None = None) -> Any:
        """The stand-in ``Metadata`` that :meth:`metadata_bytes` pickles."""
        from formats.dcp import metadata_pickle as mp

        sd_md: dict = {o.key: mp.bytes_storage_metadata() for o in self._objects}
        index: dict[tuple, Any] = {}
        for key, specs in self._tensors.items():
            specs = sorted(specs, key=lambda s: s.rank)  # dcp.save gathers plans in rank order
            sd_md[key] = mp.tensor_storage_metadata(
                specs[0].dtype, specs[0].global_shape,
                [(s.box.offsets, s.box.sizes) for s in specs],
            )
            index.update({_chunk_id(s): mp.MetadataIndex(key, s.box.offsets, i) for i, s in enumerate(specs)})
        items = [(mp.MetadataIndex(o.key), self._object_loc[_object_id(o)]) for o in self._objects]
        items += [(index[_chunk_id(s)], self._chunk_loc[_chunk_id(s)]) for s in self._chunks]
        ranks = {name: r for r, name in self._files.items()}
        items.sort(key=lambda it: (ranks[it[1].relative_path], it[1].offset))  # file order, like dcp.save
        storage = {mi: mp.storage_info(loc.relative_path, loc.offset, loc.length) for mi, loc in items}
        ordered = {k: sd_md[k] for k in self._planner_data}
        with_meta, with_version = mp.torch_fields()
        return mp.metadata(ordered, dict(self._planner_data), storage, self.root, save_id or str(uuid.uuid4()),
                           DCP_VERSION if with_version else None, with_meta)

    def manifest(self) -> Manifest:
        """What :meth:`commit` is about to publish, read from the very ``Metadata`` it pickles
        (built here once and kept for the commit): each tensor's dtype, shape and chunk count,
        where each chunk's and object's bytes lie in the rank files, and any chunk not written or
        without storage."""
        from formats.dcp import metadata_pickle as mp

        if self._final is None:
            self._final = self._metadata_to_publish()
        m = Manifest()
        published = self._final if self.rank_local else {None: self._final}
        kinds: dict[str, tuple] = {}  # key -> (dtype, shape), or () for an object: each recorded once
        extents: set[tuple[str, int, int]] = set()  # a copy several ranks' metadata name: one extent
        for rank, md in published.items():
            state = md.__dict__
            chunks: dict[str, int] = {}
            for key, entry in state["state_dict_metadata"].items():
                kind = () if mp.is_bytes_entry(entry) else (entry.properties.dtype, tuple(entry.size))
                if key not in kinds:
                    kinds[key] = kind
                    if kind:
                        m.tensor(key, *kind)
                    else:
                        m.objects.append(key)
                elif kinds[key] != kind:
                    m.problem(f"entry {short(repr(key))} differs between the ranks' metadata (rank {rank})")
                if kind:
                    chunks[key] = len(entry.chunks)
            stored: Counter = Counter()
            for mi, info in state["storage_data"].items():
                stored[mi.fqn] += 1
                extent = (info.relative_path, info.offset, info.offset + info.length)
                if extent not in extents:
                    extents.add(extent)
                    m.extent(mi.fqn, *extent)
            odd = next((k for k, n in chunks.items() if stored[k] != n), None)
            if odd is not None:
                where = "" if rank is None else f" in rank {rank}'s metadata"
                m.problem(f"tensor {short(repr(odd))} has {chunks[odd]} chunks and {stored[odd]} storage entries{where}")
        unwritten = [c for c in self._chunk_loc
                     if c[1] in self._own and (c not in self._sinks or not self._sinks[c].closed)]
        if unwritten:
            m.problem(f"tensor {short(repr(unwritten[0][0]))}: {len(unwritten)} chunk(s) not written")
        return m

    def rank_items(self) -> dict[int, tuple[list[int], list[int]]]:
        """Rank -> (positions of the chunks, positions of the objects) its metadata names (rank-local)."""
        out: dict[int, tuple[list[int], list[int]]] = {r: ([], []) for r in range(self.world_size)}
        for i, readers in enumerate(self._readers or ()):
            for r in readers:
                out[r][0].append(i)
        for i, readers in enumerate(self._object_readers or ()):
            for r in readers:
                out[r][1].append(i)
        return out

    def rank_metadata_bytes(self, rank: int, items: tuple[list[int], list[int]] | None = None,
                            save_id: str | None = None) -> bytes:
        """``__<rank>.metadata``: what ``dcp.save(..., use_collectives=False)`` writes for a rank
        holding exactly the items ``rank`` loads (``items``: :meth:`rank_items`' entry), each
        mapped to the copy it reads; built without torch like :meth:`metadata_bytes`."""
        from formats.dcp import metadata_pickle as mp

        return mp.dumps(self._rank_metadata(rank, self.rank_items()[rank] if items is None else items, save_id))

    def _rank_metadata(self, rank: int, items: tuple[list[int], list[int]], save_id: str | None = None) -> Any:
        """The stand-in ``Metadata`` that :meth:`rank_metadata_bytes` pickles."""
        from formats.dcp import metadata_pickle as mp

        chunk_pos, object_pos = items
        objects = [self._objects[i] for i in object_pos]
        specs = [self._chunks[i] for i in chunk_pos]
        sd_md: dict = {o.key: mp.bytes_storage_metadata() for o in objects}
        by_key: dict[str, list[ChunkSpec]] = {}
        for spec in specs:
            by_key.setdefault(spec.key, []).append(spec)
        storage_items: list[tuple[Any, ItemLocation]] = []
        for key, mine in by_key.items():
            sd_md[key] = mp.tensor_storage_metadata(mine[0].dtype, mine[0].global_shape,
                                                    [(s.box.offsets, s.box.sizes) for s in mine])
            storage_items += [(mp.MetadataIndex(key, s.box.offsets, i), self._chunk_loc[_chunk_id(s)])
                              for i, s in enumerate(mine)]
        storage_items += [(mp.MetadataIndex(o.key), self._object_loc[_object_id(o)]) for o in objects]
        ranks = {name: r for r, name in self._files.items()}
        storage_items.sort(key=lambda it: (ranks[it[1].relative_path], it[1].offset))  # file order
        storage = {mi: mp.storage_info(loc.relative_path, loc.offset, loc.length) for mi, loc in storage_items}
        ordered = {k: sd_md[k] for k in self._planner_data if k in sd_md}
        with_meta, with_version = mp.torch_fields()
        return mp.metadata(ordered, {k: self._planner_data[k] for k in ordered}, storage, self.root,
                           save_id or str(uuid.uuid4()), DCP_VERSION if with_version else None, with_meta)

    def _publish_rank_metadata(self, published: Mapping[int, Any]) -> None:
        """Write every own rank's ``__<rank>.metadata`` (``published``: rank -> the stand-in
        ``Metadata`` :meth:`manifest` described): each to a temp name and fsynced (several at
        once), then all renamed into place, then the directory fsynced once."""
        from formats.dcp import metadata_pickle as mp

        temps: list[tuple[Path, Path]] = []
        try:
            for rank, md in published.items():
                final = self.root / rank_metadata_name(rank)
                tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
                tmp.write_bytes(mp.dumps(md))
                temps.append((tmp, final))
            run_parallel(_fsync_file, [t for t, _ in temps])
            for tmp, final in temps:
                os.replace(tmp, final)
        finally:
            for tmp, _ in temps:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        fsync_dir(self.root)

    def metadata(self) -> Any:
        """The ``Metadata`` that :meth:`metadata_bytes` stands for, built from torch's own classes
        (imports ``torch.distributed.checkpoint``: seconds). ``commit`` never calls it; it is the
        oracle the tests compare :meth:`metadata_bytes` with."""
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo  # imported late: it costs seconds
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        sd_md: dict = {o.key: BytesStorageMetadata() for o in self._objects}
        index: dict[tuple, MetadataIndex] = {}
        for key, specs in self._tensors.items():
            specs = sorted(specs, key=lambda s: s.rank)  # dcp.save gathers plans in rank order
            sd_md[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=by_name(specs[0].dtype).torch_dtype),
                size=torch.Size(specs[0].global_shape),
                chunks=[
                    ChunkStorageMetadata(torch.Size(s.box.offsets), torch.Size(s.box.sizes)) for s in specs
                ],
            )
            index.update({_chunk_id(s): MetadataIndex(key, s.box.offsets, i) for i, s in enumerate(specs)})
        items = [(MetadataIndex(o.key), self._object_loc[_object_id(o)]) for o in self._objects]
        items += [(index[_chunk_id(s)], self._chunk_loc[_chunk_id(s)]) for s in self._chunks]
        ranks = {name: r for r, name in self._files.items()}
        items.sort(key=lambda it: (ranks[it[1].relative_path], it[1].offset))  # file order, like dcp.save
        storage = {mi: _StorageInfo(loc.relative_path, loc.offset, loc.length) for mi, loc in items}
        ordered = {k: sd_md[k] for k in self._planner_data}
        return _make_metadata(ordered, dict(self._planner_data), storage, self.root)


class _EmptySink:
    """Sink of a deduplicated empty chunk: accepts only empty pieces."""

    closed = False

    def __init__(self, spec: ChunkSpec) -> None:
        self._spec = spec

    def write(self, piece: np.ndarray | torch.Tensor) -> None:
        if math.prod(piece.shape):
            spec = self._spec
            raise ConfigError(f"chunk {spec.key!r} {spec.box.to_json()} is empty; it takes no data")

    def close(self) -> None:
        self.closed = True


class _Adopted:
    """A chunk an earlier, interrupted run wrote."""

    closed = True


class _Opening:
    """A chunk being opened: its archive's first bytes are being written (not closed)."""

    closed = False


_OPENING = _Opening()


def _chunk_id(spec: ChunkSpec) -> tuple:
    return (spec.key, spec.rank, spec.box.offsets, spec.box.sizes)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _object_id(obj: ObjectSpec) -> tuple:
    return (obj.key, obj.rank)


def _make_metadata(sd_md: dict, planner_data: dict, storage: dict, root: Path) -> Any:
    """``Metadata`` with the fields this torch has (storage_meta/version appeared in 2.4/2.9)."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    names = {f.name for f in dataclasses.fields(Metadata)}
    kwargs = {"state_dict_metadata": sd_md, "planner_data": planner_data, "storage_data": storage}
    if "storage_meta" in names:
        kwargs["storage_meta"] = StorageMeta(checkpoint_id=root, save_id=str(uuid.uuid4()))
    if "version" in names:
        kwargs["version"] = DCP_VERSION
    return Metadata(**kwargs)
