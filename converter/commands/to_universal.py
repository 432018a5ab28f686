"""to-universal: DCP (or any readable checkpoint) -> universal store. Plan the chunk tasks, execute, commit."""

from __future__ import annotations

import datetime as _dt
import os

from converter import __version__
from converter.plan.atoms import group_atoms
from converter.run.remote import remote_destination, spool_hook
from converter.config import RunOptions
from converter.run import distributed
from converter.run.destination import conversion_header, guarded, open_destination
from converter.run.journal import task_id
from converter.plan.source_layout import LayoutReport, SourceHint, detect_layout, source_hints
from converter.run.executor import os_errors_as_storage_errors
from converter.plan.copy_tasks import describe, plan_universal, store_tasks, universal_chunk_bytes
from converter.run.pipeline import ConversionResult
from converter.run.sinks import ChunkSink
from converter.plan.selection import Selection, select_entries
from converter.run.sources import open_checkpoint
from formats.base import CheckpointIndex, CheckpointReader
from formats.dcp.framework_files import read_framework_files, write_framework_files
from formats.objects import object_label, preview_value, read_checked_object
from formats.universal import DEFAULT_BACKEND, UniversalReader, UniversalWriter
from formats.universal_meta import SourceInfo
from formats.storage import source_label


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
        store = plan_universal(index.tensors, chunk_bytes, backend)
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
        stats, written = dist.execute(tasks, reader, ChunkSink(writer), workers=options.workers,
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

