"""to-universal: DCP (or any readable checkpoint) -> universal store. Plan the chunk tasks, execute, commit."""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass

import numpy as np

from converter import __version__
from converter.plan.atoms import group_atoms
from converter.run.remote import remote_destination, spool_hook
from converter.config import RunOptions
from converter.run import distributed
from converter.run.destination import conversion_header, guarded, open_destination
from converter.run.journal import task_id
from converter.plan.source_layout import WHOLE, LayoutReport, detect_layout
from converter.run.executor import os_errors_as_storage_errors
from converter.plan.copy_tasks import Piece, WriteTask, describe, store_tasks
from converter.plan.selection import Selection, select_entries
from converter.run.sources import open_checkpoint
from formats.base import CheckpointIndex, CheckpointReader
from formats.dcp.framework_files import read_framework_files, write_framework_files
from formats.objects import object_label, preview_value, read_checked_object
from formats.universal import DEFAULT_BACKEND, StorePlan, UniversalReader, UniversalWriter, plan_store
from formats.universal_meta import SourceInfo
from formats.storage import source_label


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion wrote."""

    dst: str
    tensors: int
    objects: int
    bytes: int
    seconds: float
    plan: str | None = None
    warnings: tuple[str, ...] = ()
    preview: dict | None = None  # from-universal --dry-run: the target plan (schemas/target-plan.schema.json)
    mesh: str | None = None  # from-universal: the target mesh
    world_size: int | None = None  # from-universal: ranks of the target job


class _ChunkSink:
    """Execute sink writing each task (one zarr chunk, one piece) whole."""

    def __init__(self, writer: UniversalWriter) -> None:
        self.writer = writer

    def open(self, task: WriteTask) -> "_ChunkSink._One":
        return _ChunkSink._One(self.writer, task)

    def sync(self) -> None:
        self.writer.sync()

    class _One:
        def __init__(self, writer: UniversalWriter, task: WriteTask) -> None:
            self.writer, self.task = writer, task

        def write(self, piece: Piece, data: np.ndarray) -> None:
            self.checksum = self.writer.write_chunk(self.task.key, self.task.target, data)

        def close(self) -> str:
            return self.checksum


@dataclass(frozen=True)
class SourceHint:
    """How the source laid one tensor out, kept in the store for plans that follow the source."""

    split: dict[str, int]
    replicated: bool
    tp_dim: int | None


def source_hints(layout: LayoutReport, index: CheckpointIndex) -> dict[str, SourceHint]:
    """Per tensor key: split dims, whether every rank held it whole, and its TP split dim."""
    sharded_source = (layout.world_size or 1) > 1
    hints = {}
    for key, lay in layout.tensors.items():
        whole = lay.kind == WHOLE and bool(index.tensors[key].shape)
        hints[key] = SourceHint({str(d): n for d, n in lay.split_dims.items()}, whole and sharded_source, lay.tp_dim)
    return hints


def _source_info(index: CheckpointIndex, layout: LayoutReport, src: str) -> SourceInfo:
    info = index.info
    return SourceInfo(
        format=index.format,
        path=source_label(src),
        world_size=layout.world_size if layout.world_size is not None else info.get("world_size"),
        layout=layout.summary,
        dcp_version=info.get("version") if index.format == "dcp" else None,
    )


def recorded_source(reader: CheckpointReader, index: CheckpointIndex, layout: LayoutReport,
                    src: str) -> tuple[dict[str, SourceHint], SourceInfo]:
    """(per-key source hints, the source record) for the new store. A universal store as the
    source (re-encoded, e.g. into the other backend) passes on what it recorded of ITS source, so
    ``--plan source`` still follows the original checkpoint's layout."""
    if isinstance(reader, UniversalReader):
        meta = reader.meta
        hints = {k: SourceHint(dict(r.source_split), r.source_replicated, r.tp_split_dim)
                 for k, r in meta.tensors.items() if k in index.tensors}
        return hints, meta.source
    return source_hints(layout, index), _source_info(index, layout, src)


def _checked_objects(reader: CheckpointReader, index: CheckpointIndex, trust_pickle: bool) -> dict[str, bytes]:
    """Every non-tensor entry's bytes, checked (CRC, zip records, pickle globals) before the
    destination is touched: a refused entry leaves nothing behind."""
    return {key: read_checked_object(reader, key, trust_pickle) for key in index.objects}


def _copy_objects(index: CheckpointIndex, objects: dict[str, bytes], writer: UniversalWriter, refs: dict) -> None:
    for key, entry in index.objects.items():
        data, ref = objects[key], refs[key]
        writer.add_object(key, data, entry.path, ref.atom, ref.role, preview_value(data, object_label(index, key)))


def universal_chunk_bytes(options: RunOptions) -> int:
    """The default zarr chunk size: ``knobs.UNIVERSAL_CHUNK_BYTES``, less when the memory budget
    gives each worker less than two chunks (a chunk is filled whole in one buffer)."""
    from converter import knobs

    return max(1 << 16, min(knobs.UNIVERSAL_CHUNK_BYTES, options.memory_budget // (2 * options.workers)))


@remote_destination  # URL destinations: spool, upload, marker last (converter/remote.py)
@guarded  # the destination's lock is held for the call; an interrupt says how to resume
@os_errors_as_storage_errors("to-universal")
def to_universal(src: str | os.PathLike, dst: str | os.PathLike, options: RunOptions | None = None,
                 chunk_bytes: int | None = None, selection: Selection | None = None,
                 backend: str = DEFAULT_BACKEND) -> ConversionResult:
    """Convert the checkpoint at ``src`` into a universal store at ``dst``.

    Streams chunk by chunk under ``options.memory_budget``; ``dst`` is marked complete (its
    ``ckptconv.json`` written) only after every chunk and object is on disk. ``selection``
    (``--keys``, ``--model-only``, ``--optim-only``) copies only the entries it keeps.
    ``backend`` puts the tensors' chunks in zarr arrays (default) or safetensors files.
    """
    options = options or RunOptions()
    dist = distributed.current()
    reader = open_checkpoint(src, trust_pickle=options.trust_pickle, verify=options.verify_source)
    try:
        index = reader.index()
        chunk_bytes = chunk_bytes or universal_chunk_bytes(options)
        paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
        refs, atoms = group_atoms(paths)  # of the whole checkpoint: a selection keeps atoms' names
        selected = select_entries(index, selection or Selection(), refs)
        index, atoms = selected.restrict(index), selected.restrict_atoms(atoms)
        store = plan_universal(index, chunk_bytes, backend)
        tasks = store_tasks(index.tensors, store, chunk_bytes)  # the same plan for the dry run and the run
        if options.dry_run:
            total = sum(t.nbytes for t in tasks)
            return ConversionResult(str(dst), len(index.tensors), len(index.objects), total, 0.0, plan=describe(tasks))
        header = conversion_header("to-universal", src, index, {
            "--chunk-size": chunk_bytes,
            "--keys": None if selection is None or selection.everything else selection.to_json(),
            **({"--backend": backend} if backend != DEFAULT_BACKEND else {})})
        objects = _checked_objects(reader, index, options.trust_pickle)
        framework = read_framework_files(src, options.trust_pickle) if index.format == "dcp" else {}
        out, journal = open_destination(src, dst, header, options)
        # URL destination: each file is uploaded as soon as it is final
        writer = UniversalWriter(out, chunk_bytes, on_file_final=spool_hook(out), backend=backend)
        hints, source = recorded_source(reader, index, detect_layout(index), str(src))
        for key, entry in index.tensors.items():
            h = hints[key]
            writer.add_tensor(entry, refs[key].atom, refs[key].role, source_split=h.split,
                              source_replicated=h.replicated, tp_split_dim=h.tp_dim, plan=store.arrays[key])
        writer.prepare()
        for task in tasks:
            if journal.is_done(task):
                writer.restore_chunk(task.key, task.target, journal.info(task))
        if dist.leader:
            _copy_objects(index, objects, writer, refs)
            write_framework_files(out, framework)  # Megatron's metadata.json / common.pt, as they are
        stats, written = dist.execute(tasks, reader, _ChunkSink(writer), workers=options.workers,
                                      memory_budget=options.memory_budget, progress=options.progress,
                                      label="to-universal", journal=journal, gather_info=dist.active)

        def publish() -> None:
            if dist.active:  # adopt the chunks the other ranks wrote
                for task in tasks:
                    writer.restore_chunk(task.key, task.target, written[task_id(task)])
            created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            writer.commit(source, __version__, atoms, created)
            dist.remove_journals(journal, out)

        dist.on_leader(publish)
        journal.remove()
        return ConversionResult(str(out), len(index.tensors), len(index.objects), stats.bytes_written, stats.seconds)
    finally:
        reader.close()


def plan_universal(index: CheckpointIndex, chunk_bytes: int, backend: str = DEFAULT_BACKEND) -> StorePlan:
    """The universal store's layout for ``index``'s tensors (pure: no I/O)."""
    return plan_store(((k, e.dtype, tuple(e.shape)) for k, e in index.tensors.items()), chunk_bytes, backend)
