"""import-ds: a DeepSpeed universal checkpoint (``ds_to_universal.py``'s output) -> universal store.

The checkpoint is read by :class:`formats.deepspeed.DeepSpeedReader` (no DeepSpeed needed, none of
its pickled classes run) as a ``get_state_dict``-style checkpoint: ``model.<fqn>`` (the fp32
master weights), ``optim.state.<fqn>.<state>`` (exp_avg, exp_avg_sq, ..., step) and
``optim.param_groups.<i>.<hparam>``; ZeRO-3's flat atoms come out in the parameters' shapes.
Then the plan/execute core copies it chunk by chunk into the store, as ``to-universal`` does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from converter.config import RunOptions
from converter.plan.atoms import group_atoms
from converter.plan.copy_tasks import describe, plan_universal, store_tasks, universal_chunk_bytes
from converter.run.cross_view import map_header, mapped, with_map
from converter.run.pipeline import (Conversion, ConversionResult, Output, PlannedOutput,
                                     conversion_command, run_conversion)
from converter.run.sinks import universal_output
from formats.base import CheckpointReader
from formats.deepspeed import DeepSpeedReader
from formats.objects import object_label, preview_value
from formats.storage import source_label
from formats.universal import DEFAULT_BACKEND, UniversalWriter
from formats.universal_meta import SourceInfo


@conversion_command("import-ds")
def import_ds(src: str | os.PathLike, dst: str | os.PathLike, options: RunOptions | None = None,
              chunk_bytes: int | None = None, backend: str = DEFAULT_BACKEND, *, key_map: Any = None,
              map_direction: str = "auto", key_style: str = "auto", config: Any = None) -> ConversionResult:
    """Convert the DeepSpeed universal checkpoint at ``src`` (the folder holding ``zero/``, or the
    one whose ``latest_universal`` names it) into a universal store at ``dst``.

    Streams chunk by chunk under ``options.memory_budget``; bit-exact; ``dst`` is complete only
    once its ``ckptconv.json`` is written. ``backend``: the store's array format (as to-universal).
    ``key_map``, ``map_direction``, ``key_style``, ``config``: as to-universal's (``--map``: the store
    in another framework's names, optimizer states and param groups included).
    """
    options = options or RunOptions()
    ds = DeepSpeedReader(src, verify=options.verify_source)
    reader: CheckpointReader = ds
    try:
        reader, cross = mapped(ds, src, key_map, map_direction, key_style, config, options.trust_pickle)
        conv = _plan(reader, ds.root, ds.index().info.get("zero_stage"), dst, options, chunk_bytes, backend,
                     map_header(key_map, map_direction, key_style, config))
        return run_conversion(with_map(conv, cross), options)
    finally:
        reader.close()


def _plan(reader: CheckpointReader, src: Path, stage: Any, dst: str | os.PathLike, options: RunOptions,
          chunk_bytes: int | None, backend: str, extra_header: dict[str, Any]) -> Conversion:
    """The conversion: the store's layout and its chunk tasks (the same plan for the dry run and
    the run), the atoms, and the source record."""
    index = reader.index()
    chunk_bytes = chunk_bytes or universal_chunk_bytes(options)
    store = plan_universal(index.tensors, chunk_bytes, backend)
    tasks = store_tasks(index.tensors, store, chunk_bytes)
    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    refs, atoms = group_atoms(paths)
    source = SourceInfo(format="deepspeed", path=source_label(src), world_size=None,
                        layout=f"deepspeed universal (ZeRO-{stage})" if stage else "deepspeed universal")
    objects: dict[str, bytes] = {}  # read (allowlisted pickles) before the destination is touched

    def check() -> None:
        objects.update({key: reader.read_object_bytes(key) for key in index.objects})

    def write_objects(writer: UniversalWriter) -> None:
        for key, entry in index.objects.items():
            data = objects[key]
            writer.add_object(key, data, entry.path, refs[key].atom, refs[key].role,
                              preview_value(data, object_label(index, key)))

    def open_output(out: Path) -> Output:
        return universal_output(out, index.tensors, refs, store, source, atoms, write_objects=write_objects)

    header = {"--chunk-size": chunk_bytes, **({"--backend": backend} if backend != DEFAULT_BACKEND else {}),
              **extra_header}
    planned = ConversionResult(str(dst), len(index.tensors), len(index.objects), sum(t.nbytes for t in tasks), 0.0)
    return Conversion("import-ds", src, dst, index, reader, tasks, header, open_output, planned,
                      describe=lambda: (describe(tasks), None), check=check,
                      expected=PlannedOutput.of_entries(index.tensors, index.objects))
