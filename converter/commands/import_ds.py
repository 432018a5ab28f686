"""import-ds: a DeepSpeed universal checkpoint (``ds_to_universal.py``'s output) -> universal store.

The checkpoint is read by :class:`formats.deepspeed.DeepSpeedReader` (no DeepSpeed needed, none of
its pickled classes run) as a ``get_state_dict``-style checkpoint: ``model.<fqn>`` (the fp32
master weights), ``optim.state.<fqn>.<state>`` (exp_avg, exp_avg_sq, ..., step) and
``optim.param_groups.<i>.<hparam>``; ZeRO-3's flat atoms come out in the parameters' shapes.
Then the plan/execute core copies it chunk by chunk into the store, as ``to-universal`` does.
"""

from __future__ import annotations

import datetime as _dt
import os

from converter import __version__
from converter.run import distributed
from converter.plan.atoms import group_atoms
from converter.config import RunOptions
from converter.run.destination import conversion_header, guarded, open_destination
from converter.run.executor import os_errors_as_storage_errors
from converter.run.pipeline import ConversionResult
from converter.run.sinks import ChunkSink
from converter.run.journal import task_id
from converter.plan.copy_tasks import describe, plan_universal, store_tasks, universal_chunk_bytes
from converter.run.remote import remote_destination, spool_hook
from formats.deepspeed import DeepSpeedReader
from formats.objects import object_label, preview_value
from formats.storage import source_label
from formats.universal import UniversalWriter
from formats.universal_meta import SourceInfo


@remote_destination  # URL destinations: spool, upload, marker last (converter/remote.py)
@guarded  # the destination's lock is held for the call; an interrupt says how to resume
@os_errors_as_storage_errors("import-ds")
def import_ds(src: str | os.PathLike, dst: str | os.PathLike, options: RunOptions | None = None,
              chunk_bytes: int | None = None, backend: str = "zarr") -> ConversionResult:
    """Convert the DeepSpeed universal checkpoint at ``src`` (the folder holding ``zero/``, or the
    one whose ``latest_universal`` names it) into a universal store at ``dst``.

    Streams chunk by chunk under ``options.memory_budget``; bit-exact; ``dst`` is complete only
    once its ``ckptconv.json`` is written. ``backend``: the store's array format (as to-universal).
    """
    options = options or RunOptions()
    dist = distributed.current()
    reader = DeepSpeedReader(src, verify=options.verify_source)
    src = reader.root
    try:
        index = reader.index()
        chunk_bytes = chunk_bytes or universal_chunk_bytes(options)
        store = plan_universal(index.tensors, chunk_bytes, backend)
        tasks = store_tasks(index.tensors, store, chunk_bytes)  # the same plan for the dry run and the run
        if options.dry_run:
            return ConversionResult(str(dst), len(index.tensors), len(index.objects), sum(t.nbytes for t in tasks),
                                    0.0, plan=describe(tasks))
        header = conversion_header("import-ds", src, index, {
            "--chunk-size": chunk_bytes, **({"--backend": backend} if backend != "zarr" else {})})
        objects = {key: reader.read_object_bytes(key) for key in index.objects}
        out, journal = open_destination(src, dst, header, options)
        paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
        refs, atoms = group_atoms(paths)
        writer = UniversalWriter(out, chunk_bytes, on_file_final=spool_hook(out), backend=backend)  # URL dst: upload
        for key, entry in index.tensors.items():
            writer.add_tensor(entry, refs[key].atom, refs[key].role, plan=store.arrays[key])
        writer.prepare()
        for task in tasks:
            if journal.is_done(task):
                writer.restore_chunk(task.key, task.target, journal.info(task))
        if dist.leader:
            for key, entry in index.objects.items():
                data = objects[key]
                writer.add_object(key, data, entry.path, refs[key].atom, refs[key].role,
                                  preview_value(data, object_label(index, key)))
        stats, written = dist.execute(tasks, reader, ChunkSink(writer), workers=options.workers,
                                      memory_budget=options.memory_budget, progress=options.progress,
                                      label="import-ds", journal=journal, gather_info=dist.active)
        stage = index.info.get("zero_stage")
        source = SourceInfo(format="deepspeed", path=source_label(src), world_size=None,
                            layout=f"deepspeed universal (ZeRO-{stage})" if stage else "deepspeed universal")

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
