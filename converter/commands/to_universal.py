"""to-universal: DCP (or any readable checkpoint) -> universal store. Plans the store and its chunk
tasks; :func:`converter.run.pipeline.run_conversion` runs them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from converter.config import RunOptions
from converter.plan.atoms import group_atoms
from converter.plan.copy_tasks import describe, plan_universal, store_tasks, universal_chunk_bytes
from converter.plan.selection import Selection, select_entries
from converter.plan.source_layout import LayoutReport, SourceHint, detect_layout, source_hints
from converter.run.cross_view import map_header, mapped, with_map
from converter.run.pipeline import (Conversion, ConversionResult, Output, PlannedOutput,
                                     conversion_command, run_conversion)
from converter.run.sinks import universal_output
from converter.run.optim_view import fully_reshardable
from converter.run.sources import framework_files, open_checkpoint
from formats.base import CheckpointIndex, CheckpointReader
from formats.dcp.framework_files import write_framework_files
from formats.objects import object_label, preview_value, read_checked_object
from formats.storage import source_label
from formats.universal import DEFAULT_BACKEND, UniversalReader, UniversalWriter
from formats.universal_meta import SourceInfo


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


@conversion_command("to-universal")
def to_universal(src: str | os.PathLike, dst: str | os.PathLike, options: RunOptions | None = None,
                 chunk_bytes: int | None = None, selection: Selection | None = None,
                 backend: str = DEFAULT_BACKEND, *, key_map: Any = None, map_direction: str = "auto",
                 key_style: str = "auto", config: Any = None) -> ConversionResult:
    """Convert the checkpoint at ``src`` into a universal store at ``dst``.

    Streams chunk by chunk under ``options.memory_budget``; ``dst`` is marked complete (its
    ``ckptconv.json`` written) only after every chunk and object is on disk. ``selection``
    (``--keys``, ``--model-only``, ``--optim-only``) copies only the entries it keeps.
    ``backend`` puts the tensors' chunks in zarr arrays (default) or safetensors files.
    ``key_map`` (``--map``), ``map_direction``, ``key_style``: the store holds the checkpoint as
    another framework names it, optimizer states and param groups included
    (:mod:`converter.plan.cross_map`); ``config`` gives the head counts the map's row transforms need.
    """
    options = options or RunOptions()
    reader = open_checkpoint(src, trust_pickle=options.trust_pickle, verify=options.verify_source)
    try:
        reader = fully_reshardable(reader, options.trust_pickle)  # megatron's dp_reshardable optimizer, kept
        reader, cross = mapped(reader, src, key_map, map_direction, key_style, config, options.trust_pickle)
        conv = _plan(reader, src, dst, options, chunk_bytes, selection, backend,
                     map_header(key_map, map_direction, key_style, config))
        return run_conversion(with_map(conv, cross), options)
    finally:
        reader.close()


def _plan(reader: CheckpointReader, src: str | os.PathLike, dst: str | os.PathLike, options: RunOptions,
          chunk_bytes: int | None, selection: Selection | None, backend: str,
          extra_header: dict[str, Any] | None = None) -> Conversion:
    """The conversion: the selected entries, the store's layout and its chunk tasks (the same plan
    for the dry run and the run)."""
    index = reader.index()
    chunk_bytes = chunk_bytes or universal_chunk_bytes(options)
    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    refs, atoms = group_atoms(paths)  # of the whole checkpoint: a selection keeps atoms' names
    selected = select_entries(index, selection or Selection(), refs)
    index, atoms = selected.restrict(index), selected.restrict_atoms(atoms)
    store = plan_universal(index.tensors, chunk_bytes, backend)
    tasks = store_tasks(index.tensors, store, chunk_bytes)
    objects: dict[str, bytes] = {}  # read and checked by check(), written by write_objects()
    framework: dict[str, bytes] = {}  # Megatron's files beside a DCP source

    def check() -> None:  # every non-tensor entry read and checked before the destination is touched
        objects.update(_checked_objects(reader, index, options.trust_pickle))
        framework.update(framework_files(reader, src, options.trust_pickle) if index.format != "universal" else {})

    def write_objects(writer: UniversalWriter, out: Path) -> None:
        _copy_objects(index, objects, writer, refs)
        write_framework_files(out, framework)  # Megatron's metadata.json / common.pt, as they are

    def open_output(out: Path) -> Output:
        hints, source = recorded_source(reader, index, detect_layout(index), str(src))
        return universal_output(out, index.tensors, refs, store, source, atoms, hints=hints,
                                write_objects=lambda writer: write_objects(writer, out))

    header = {"--chunk-size": chunk_bytes,
              "--keys": None if selection is None or selection.everything else selection.to_json(),
              **({"--backend": backend} if backend != DEFAULT_BACKEND else {}), **(extra_header or {})}
    planned = ConversionResult(str(dst), len(index.tensors), len(index.objects), sum(t.nbytes for t in tasks), 0.0)
    return Conversion("to-universal", src, dst, index, reader, tasks, header, open_output, planned,
                      describe=lambda: (describe(tasks), None), check=check,
                      expected=PlannedOutput.of_entries(index.tensors, index.objects))
