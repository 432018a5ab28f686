"""The outputs the pipeline drives, one per output format (:func:`universal_output`,
:func:`dcp_output`, :func:`hf_output`, :func:`dcp_safetensors_output`), and their executor sinks: each sink turns a write task's
pieces into bytes in the output (:class:`converter.run.executor.TaskSink`: ``open(task)`` -> a
piece writer whose ``close`` may return what the journal keeps for the task, e.g. a chunk's
checksum)."""

from __future__ import annotations

import datetime as _dt
import math
import threading
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from converter import knobs
from converter.plan.copy_tasks import Piece, WriteTask, target_nbytes
from converter.plan.dcp_safetensors import StorageLayout, WholeTensor
from converter.run import distributed
from converter.plan.atoms import AtomRef
from converter.plan.source_layout import SourceHint
from converter.run.pipeline import Output
from converter.run.remote import spool_hook
from formats.base import TensorEntry
from formats.dcp_safetensors import CONSOLIDATED, shards_manifest
from formats.dtypes import by_name, cast_bits, raw_bytes
from formats.manifest import Manifest
from formats.universal import StorePlan, UniversalWriter
from formats.universal_meta import SourceInfo


class ChunkSink:
    """Universal store: each task (one zarr chunk, one piece) written whole; ``close`` returns the
    chunk's checksum."""

    def __init__(self, writer: Any) -> None:  # formats.universal.UniversalWriter
        self.writer = writer

    def open(self, task: WriteTask) -> ChunkSink._One:
        return ChunkSink._One(self.writer, task)

    def sync(self) -> None:
        self.writer.sync()

    class _One:
        def __init__(self, writer: Any, task: WriteTask) -> None:
            self.writer, self.task = writer, task

        def file_offset(self, piece: Piece) -> int:
            return self.writer.data_offset(self.task.key, self.task.target)

        def write(self, piece: Piece, data: np.ndarray) -> None:
            self.checksum = self.writer.write_chunk(self.task.key, self.task.target, data)

        def close(self) -> str:
            return self.checksum


class RankChunkSink:
    """DCP: each task's pieces streamed into its rank file's archive, cast to the target dtype;
    counts the bytes of the chunks it closed (``written``, in the target dtype)."""

    def __init__(self, writer: Any) -> None:  # formats.dcp.writer.DCPWriter
        self.writer = writer
        self.written = 0
        self._lock = threading.Lock()

    def open(self, task: WriteTask) -> RankChunkSink._One:
        return RankChunkSink._One(self, self.writer.open_chunk(task.target), task)

    def sync(self) -> None:
        self.writer.sync()

    def shared_files(self, task: WriteTask) -> tuple[int, ...]:
        """The rank file ``task`` writes (synced once its tasks are done: the executor's journal)."""
        return (task.target.rank,)

    def sync_files(self, ranks: Sequence[int]) -> None:
        self.writer.sync(ranks)

    class _One:
        def __init__(self, owner: RankChunkSink, sink: Any, task: WriteTask) -> None:
            self.owner, self.sink, self.task = owner, sink, task
            self.src_dtype, self.dtype = task.dtype, task.target.dtype

        def file_offset(self, piece: Piece) -> int | None:
            if self.src_dtype != self.dtype:  # cast into a new array first
                return None
            return getattr(self.sink, "next_offset", None)

        def write(self, piece: Piece, data: np.ndarray) -> None:
            self.sink.write(cast_bits(data, self.src_dtype, self.dtype))

        def close(self) -> None:
            self.sink.close()
            with self.owner._lock:
                self.owner.written += target_nbytes(self.task)
            return None


class HFSink:
    """HF safetensors: pwrite each piece at its offset in the tensor's file, cast to ``dtypes[key]``."""

    def __init__(self, writer: Any, dtypes: Mapping[str, str]) -> None:  # formats.hf.HFWriter
        self.writer, self.dtypes = writer, dtypes

    def open(self, task: WriteTask) -> HFSink._One:
        return HFSink._One(self.writer, task, self.dtypes[task.key])

    def sync(self) -> None:
        self.writer.sync()

    class _One:
        def __init__(self, writer: Any, task: WriteTask, dtype: str) -> None:
            self.writer, self.task, self.dtype = writer, task, dtype
            shape = task.box.sizes
            self.strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]

        def write(self, piece: Piece, data: np.ndarray) -> None:
            local = piece.box.relative_to(self.task.box)
            offset = sum(o * s for o, s in zip(local.offsets, self.strides))
            self.writer.write_tensor(self.task.key, offset, cast_bits(data, self.task.dtype, self.dtype))

        def close(self) -> None:
            pass


class ShardFilesSink:
    """DCP safetensors: each rank chunk's pieces ``pwrite``-n at their offsets in that rank's file,
    each whole tensor's (``--consolidate``) in its hub-shaped file; cast to the target dtype."""

    def __init__(self, shards: Any, layout: StorageLayout, consolidated: Any | None) -> None:
        # formats.hf.SafetensorsFilesWriter (both)
        self.shards, self.layout, self.consolidated = shards, layout, consolidated
        self.whole_file = {t.name: p.name for p in layout.consolidated or () for t in p.tensors}

    def where(self, task: WriteTask) -> tuple[Any, str]:
        """(writer, file) of ``task``'s target."""
        if isinstance(task.target, WholeTensor):
            return self.consolidated, self.whole_file[task.key]
        return self.shards, self.layout.shard_file(task.key, task.target.rank)

    def open(self, task: WriteTask) -> ShardFilesSink._One:
        return ShardFilesSink._One(*self.where(task), task)

    def sync(self) -> None:
        for writer in (self.shards, self.consolidated):
            if writer is not None:
                writer.sync()

    class _One:
        def __init__(self, writer: Any, file: str, task: WriteTask) -> None:
            self.writer, self.file, self.task = writer, file, task
            self.itemsize = by_name(task.target.dtype).itemsize
            shape = task.box.sizes
            self.strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]

        def write(self, piece: Piece, data: np.ndarray) -> None:
            local = piece.box.relative_to(self.task.box)
            offset = sum(o * s for o, s in zip(local.offsets, self.strides))
            bits = cast_bits(data, self.task.dtype, self.task.target.dtype)
            self.writer.write_at(self.file, self.task.key, offset * self.itemsize, raw_bytes(bits))

        def close(self) -> None:
            pass


class LegacySink:
    """Megatron legacy: each task fills a contiguous range of a storage of one rank file (its
    ``target``: :class:`converter.plan.megatron_legacy.StorageTarget`), pieces in C order, cast to
    the target dtype; ``close`` returns the range's CRC-32 (what the other ranks' commit needs)."""

    def __init__(self, writer: Any) -> None:  # formats.megatron.legacy_writer.LegacyWriter
        self.writer = writer

    def open(self, task: WriteTask) -> LegacySink._One:
        return LegacySink._One(self.writer, task)

    def sync(self) -> None:
        self.writer.sync()

    class _One:
        def __init__(self, writer: Any, task: WriteTask) -> None:
            from formats.dtypes import itemsize_of

            self.writer, self.task, self.t = writer, task, task.target
            shape = task.box.sizes
            self.strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
            self.itemsize = itemsize_of(self.t.dtype)
            self.crc, self.done = 0, 0

        def write(self, piece: Piece, data: np.ndarray) -> None:
            from formats.integrity import crc32_combine

            local = piece.box.relative_to(self.task.box)
            start = sum(o * s for o, s in zip(local.offsets, self.strides)) * self.itemsize
            out = cast_bits(data, self.task.dtype, self.t.dtype)
            crc = self.writer.write(self.t.file, self.t.storage, self.t.offset + start, out)
            if start != self.done:
                raise RuntimeError(f"{self.task.key}: pieces out of order ({start} after {self.done} bytes)")
            self.crc = crc32_combine(self.crc, crc, out.nbytes) if self.done else crc
            self.done += out.nbytes

        def close(self) -> dict:
            return {"crc": self.crc, "nbytes": self.done}


def universal_output(out: Path, tensors: Mapping[str, TensorEntry], refs: Mapping[str, AtomRef], store: StorePlan,
                     source: SourceInfo, atoms: Mapping[str, Any], *,
                     hints: Mapping[str, SourceHint] | None = None,
                     write_objects: Callable[[UniversalWriter], None] | None = None) -> Output:
    """A universal store in ``out`` holding ``tensors`` as ``store`` lays them out (backend, chunk
    size, arrays; each tensor's
    atom and role from ``refs``; how the source laid it out from ``hints``): chunks adopted by
    checksum; ``write_objects(writer)`` adds the non-tensor entries (rank 0); the commit writes
    ``ckptconv.json`` (recording ``source`` and ``atoms``) last. A URL destination's spool
    uploads each file as it becomes final."""
    writer = UniversalWriter(out, store.chunk_bytes, on_file_final=spool_hook(out), backend=store.backend,
                             direct_io=knobs.DIRECT_WRITES, fs_sync=knobs.SYNCFS)
    for key, entry in tensors.items():
        h = hints.get(key) if hints is not None else None
        placed = {} if h is None else {"source_split": h.split, "source_replicated": h.replicated,
                                       "tp_split_dim": h.tp_dim}
        writer.add_tensor(entry, refs[key].atom, refs[key].role, plan=store.arrays[key], **placed)

    def commit() -> None:
        from converter import __version__

        created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        writer.commit(source, __version__, dict(atoms), created)

    return Output(sink=ChunkSink(writer), commit=commit, manifest=writer.manifest,
                  prepare=lambda resume: writer.prepare(),
                  adopt=lambda task, info: writer.restore_chunk(task.key, task.target, info),
                  write_objects=None if write_objects is None else lambda: write_objects(writer), needs_info=True)


def dcp_output(writer: Any, extra_files: Callable[[], None] | None = None,
               before_commit: Callable[[], None] | None = None,
               after_commit: Callable[[], None] | None = None) -> Output:
    """A DCP checkpoint (:class:`formats.dcp.writer.DCPWriter`): rank files sized by rank 0, chunks
    cast to the target dtype; ``extra_files`` runs after the non-tensor entries are written (rank
    0); ``before_commit`` / ``after_commit`` around the writer's commit (a manifest before the
    ``.metadata``; the completion marker after rank-local metadata). The result counts every
    rank's bytes in the target dtype."""
    sink = RankChunkSink(writer)

    def commit() -> None:
        if before_commit is not None:
            before_commit()
        writer.commit()
        if after_commit is not None:
            after_commit()

    def write_objects() -> None:
        writer.write_objects()
        if extra_files is not None:
            extra_files()

    return Output(sink=sink, commit=commit, manifest=writer.manifest,
                  prepare=lambda resume: writer.prepare(resume=resume),
                  adopt=lambda task, info: writer.adopt_chunk(task.target), write_objects=write_objects,
                  close=writer.close, bytes_written=lambda stats: sum(distributed.current().gather(sink.written)))


def hf_output(writer: Any, dtypes: Mapping[str, str], planned_bytes: int,
              before_commit: Callable[[], None] | None = None,
              before_prepare: Callable[[], None] | None = None, record_files: Sequence[str] = ()) -> Output:
    """Hugging Face safetensors (:class:`formats.hf.HFWriter`): files sized by rank 0, each tensor
    cast to ``dtypes[name]``; ``before_prepare`` runs before the files are created,
    ``before_commit`` just before the index (or single file) is published; ``record_files``: the
    output's files beyond HF's own (:attr:`Output.record_files`). The result counts the planned
    bytes (resumed or not)."""

    def commit() -> None:
        if before_commit is not None:
            before_commit()
        writer.commit()

    def prepare(resume: bool) -> None:
        if before_prepare is not None:
            before_prepare()
        writer.start(resume=resume)

    return Output(sink=HFSink(writer, dtypes), commit=commit, manifest=writer.manifest, prepare=prepare,
                  adopt=lambda task, info: writer.adopt(task.key), close=writer.close,
                  bytes_written=lambda stats: planned_bytes, record_files=tuple(record_files))


def dcp_safetensors_output(shards: Any, layout: StorageLayout, consolidated: Any | None, planned_bytes: int,
                           after_commit: Callable[[], None] | None = None) -> Output:
    """DCP's per-rank safetensors storage (:mod:`converter.plan.dcp_safetensors`): the per-rank files
    (``shards``; None for ``consolidate``) and, with ``--consolidate``, the hub-shaped ones
    (``consolidated``), both :class:`formats.hf.SafetensorsFilesWriter` s, sized by rank 0; published
    per-rank files first, then the consolidated files and their index, then ``after_commit`` (the
    completion marker). The result counts the planned bytes."""
    sink = ShardFilesSink(shards, layout, consolidated)
    writers = [w for w in (shards, consolidated) if w is not None]

    def prepare(resume: bool) -> None:
        for w in writers:
            w.start(resume=resume)

    def adopt(task: WriteTask, info: Any) -> None:
        writer, file = sink.where(task)
        writer.adopt_at(file, task.key)

    def commit() -> None:
        for w in writers:
            w.commit()
        if after_commit is not None:
            after_commit()

    def close() -> None:
        for w in writers:
            w.close()

    def manifest() -> Manifest:
        m = shards_manifest(shards, f"{layout.shard_dir}/" if layout.shard_dir else "") if shards is not None \
            else Manifest()
        if consolidated is not None:
            m.extend(consolidated.manifest(suffix=CONSOLIDATED))
        return m

    return Output(sink=sink, commit=commit, manifest=manifest, prepare=prepare, adopt=adopt, close=close,
                  bytes_written=lambda stats: planned_bytes)


def legacy_output(writer: Any, before_commit: Callable[[], None] | None = None) -> Output:
    """A Megatron-LM legacy checkpoint (:class:`formats.megatron.legacy_writer.LegacyWriter`): files
    sized by rank 0; each task's CRC-32 journaled and adopted so rank 0's commit finishes every
    archive; ``before_commit`` runs before the tracker file (written last)."""
    def adopt(task: WriteTask, info: Any) -> None:
        if info:
            t = task.target
            writer.add_crc(t.file, t.storage, t.offset, int(info["nbytes"]), int(info["crc"]))

    def commit() -> None:
        if before_commit is not None:
            before_commit()
        writer.commit()

    return Output(sink=LegacySink(writer), commit=commit, manifest=writer.manifest,
                  prepare=lambda resume: writer.prepare(resume=resume), adopt=adopt, close=writer.close,
                  needs_info=True)
