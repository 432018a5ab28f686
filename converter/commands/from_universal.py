"""from-universal: universal store (or any readable checkpoint) -> DCP laid out for a target mesh.

1. place + layout (:mod:`converter.plan.target_layout`, pure): every parameter's placements on
   the mesh, each rank's box per tensor, which file keeps a box several ranks hold;
2. plan + execute: pieces of every rank chunk are filled from the source chunks and streamed
   into that rank's ``__<rank>_0.distcp`` (:func:`converter.run.pipeline.run_conversion`);
   ``.metadata`` is written last, atomically.

``format="dcp-safetensors"`` writes the same chunks in DCP's other storage form, the per-rank
safetensors files of ``HuggingFaceStorageWriter(save_distributed=True)``, and with ``consolidate``
also the hub-shaped files torch's consolidation makes of them, in the same run
(:mod:`converter.plan.dcp_safetensors`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from converter import knobs
from converter.config import RunOptions
from converter.plan.atoms import AtomRef, is_megatron
from converter.plan.copy_tasks import WriteTask, plan_boxes, total_target_nbytes
from converter.plan.dataloader_state import loading_ranks, plan_objects
from converter.plan.megatron import plan_layout_bound
from converter.plan.mesh import Mesh, parse_mesh, refuse_etp
from converter.plan.placement_rules import HeadCounts
from converter.plan.selection import Selection, select_entries
from converter.plan.dcp_safetensors import (FORMATS, StorageLayout, consolidation_tasks, load_fqn_index, plan_storage,
                                             tensors_only_warning)
from converter.plan.target_layout import (LocalFiles, TargetLayout, atom_refs, layout_tasks, local_objects, rank_loads,
                                          target_dtype, target_layout)
from converter.run import distributed
from converter.run.cross_view import map_header, mapped, with_map
from converter.run.destination import (FROM_UNIVERSAL_LEGACY, FROM_UNIVERSAL_ST, option_value, write_complete_marker,
                                       write_loads_manifest)
from converter.run.pipeline import (Conversion, ConversionResult, Output, PlannedOutput,
                                     conversion_command, run_conversion)
from converter.run.sinks import dcp_output, dcp_safetensors_output
from converter.run.optim_view import fully_reshardable
from converter.run.sources import framework_files, open_checkpoint
from formats.base import CheckpointIndex, CheckpointReader
from formats.dcp.framework_files import write_framework_files
from formats.dcp.metadata import gc_paused
from formats.dcp.writer import METADATA_NAME, DCPWriter, ObjectSpec, rank_metadata_name
from formats.dcp.writer import default_file_name as rank_file
from formats.dcp_safetensors import CONSOLIDATED, FORMAT as ST_FORMAT
from formats.errors import ConfigError, PlanError
from formats.hf import SafetensorsFilesWriter
from formats.dtypes import CASTABLE_FLOATS, by_name, cast_dtype
from formats.objects import read_checked_object
from formats.storage import source_label

#: ``--format`` of a Megatron-LM legacy target.
LEGACY_FORMAT = "megatron-legacy"
MEGATRON_CODE_PLAN = "megatron-core"






def _source_hints(reader: CheckpointReader, index: CheckpointIndex
                  ) -> tuple[dict[str, int | None], set[str], dict[str, int]]:
    """(param key -> TP split dim in the source, keys the source held whole on every rank, the
    source's detected mesh: empty for a universal store)."""
    from formats.universal import UniversalReader

    if isinstance(reader, UniversalReader):  # to-universal recorded them
        return (*reader.source_layout(), {})
    from converter.plan.source_layout import detect_layout, source_hints

    report = detect_layout(index, owners=False)  # kinds and splits: no owner lists
    hints = source_hints(report, index)
    return {k: h.tp_dim for k, h in hints.items()}, {k for k, h in hints.items() if h.replicated}, dict(report.mesh)










    # None when a rank holds two boxes (then owners are picked one box after the other)












@conversion_command("from-universal")
def from_universal(src: str | os.PathLike, dst: str | os.PathLike, mesh: str, *, plan: str = "auto",
                   mesh_order: str | None = None, dtype: str | None = None,
                   options: RunOptions | None = None, selection: Selection | None = None,
                   drop_dataloader: bool = False,
                   config: str | os.PathLike | Mapping | None = None,
                   preview_chunks: int | None = None,
                   layout_objects: str = "drop", format: str = "dcp", consolidate: bool = False,
                   max_shard_size: int | str | None = None,
                   fqn_index: str | os.PathLike | Mapping[str, int] | None = None, vpp: int = 1,
                   megatron_names: str | None = None, local_files: str = "dedup",
                   ranks_per_node: int | None = None, key_map: Any = None, map_direction: str = "auto",
                   key_style: str = "auto", node_local_dst: bool = False) -> ConversionResult:
    """Write the DCP checkpoint a job on ``mesh`` would save, from the store (or checkpoint) ``src``.

    ``selection`` (``--keys``, ``--model-only``, ``--optim-only``) writes only the entries it keeps.
    ``drop_dataloader`` leaves the per-rank dataloader state out (and writes torchtitan an empty one
    for the target's DP degree; see :mod:`converter.plan.dataloader_state`).
    ``config`` (a config.json path, inline JSON or a mapping; default: ``src/config.json`` when
    present) gives the attention head counts a TP split must divide.
    ``preview_chunks`` (dry run): list only that many chunks per key in ``result.preview`` (what
    the text shows; None: every chunk, the whole plan document).
    ``layout_objects`` (``drop``, ``keep``, ``refuse``): what becomes of Megatron's layout-bound
    ShardedObjects (``rng_state``, ...) when the target layout differs from the saved one
    (:mod:`converter.plan.megatron`); framework files beside the source (Megatron's ``metadata.json``,
    ``common.pt``) are copied as they are.
    ``format``: ``dcp`` (``.metadata`` + ``__<rank>_0.distcp``) or ``dcp-safetensors`` (DCP's
    per-rank safetensors storage, ``HuggingFaceStorageWriter``'s form; tensors only: non-tensor
    entries are left out with a warning). ``consolidate`` (dcp-safetensors): the per-rank files go
    to ``sharded/`` and the hub-shaped files torch's consolidation makes are written beside them;
    ``max_shard_size`` (dcp-safetensors; bytes or text like ``5GB``) splits the keys into files
    (torch's ``fqn_to_index_mapping``; default one file); ``fqn_index`` (dcp-safetensors) is that
    mapping itself: a hub ``model.safetensors.index.json`` (path, or the folder holding it) or
    ``{key: file index}`` (JSON path or mapping), as torchtitan passes it; it also orders the
    consolidated files. ``format`` ``megatron-legacy`` writes what Megatron-LM's ``save_checkpoint``
    writes with ``--ckpt-format torch`` on the mesh's tp / pp / dp / ep with ``vpp`` model chunks per
    stage (:mod:`converter.plan.megatron_legacy`; ``megatron_names`` ``local`` or ``te``: the layer
    spec whose tensor names the files use, default from the checkpoint's ``args.transformer_impl``).
    ``local_files`` (``--local-files``, ``format`` dcp): ``dedup`` (a box several ranks hold is
    written once, one ``.metadata``: as ``dcp.save`` writes it), ``rank`` (each rank's file holds
    everything that rank loads, replicated boxes and non-tensor entries included, and its own
    ``__<rank>.metadata`` maps them: ``dcp.load`` of the folder reads only the rank's two files) or
    ``node`` (the same per node of ``ranks_per_node`` consecutive ranks: one copy per node).
    ``node_local_dst`` (``--node-local-dst``, with ``local_files`` ``node``, under a torchrun of the
    target job's shape: ``--nnodes world/K --nproc-per-node K``): ``dst`` is on each node's own
    storage; each node writes there only its node's files and metadata, as a conversion of its own
    (:func:`converter.run.distributed.per_node`), and marks that folder complete when its files are.
    ``key_map`` (``--map NAME|FILE|torchtitan:MODEL``): the checkpoint as another framework names it,
    every parameter's optimizer states and param groups with it (:mod:`converter.plan.cross_map`),
    ``map_direction`` ``auto`` / ``to-hf`` / ``from-hf``, in ``key_style`` (``auto``: the destination
    framework's; ``torchtitan``, ``dcp``, ``dcp-flat``, ``source``); ``config`` gives the head counts
    its row transforms need.
    """
    options = options or RunOptions()
    local = LocalFiles(local_files, ranks_per_node)
    if local.local and format != "dcp":
        raise ConfigError(f"--local-files {local_files} writes rank-local DCP metadata: it is for --format dcp")
    node = None
    if node_local_dst:
        if local.mode != "node":
            raise ConfigError("--node-local-dst writes each node's own files into DST on that node: add --local-files "
                              "node --ranks-per-node K")
        world = parse_mesh(mesh, mesh_order).world_size
        local.check(world)  # K divides the mesh: else one line here, before any I/O
        if not options.dry_run:  # a dry run plans the whole output, wherever it runs
            node = distributed.node_place(local.group, world)
    if format == LEGACY_FORMAT:
        if key_map is not None or key_style != "auto":
            raise ConfigError("--map writes another framework's names; --format megatron-legacy writes Megatron's own")
        if consolidate or max_shard_size is not None or fqn_index is not None:
            raise ConfigError("--consolidate, --max-shard-size and --fqn-index are for --format dcp-safetensors")
        return _to_legacy(src, dst, parse_mesh(mesh, mesh_order), options, selection, layout_objects,
                          cast_dtype(dtype) if dtype is not None else None, vpp, megatron_names)
    if megatron_names is not None or (vpp != 1 and plan not in (MEGATRON_CODE_PLAN, "auto")):
        raise ConfigError("--vpp and --megatron-names shape a megatron-legacy target (--vpp also --plan "
                          f"{MEGATRON_CODE_PLAN}): add --format megatron-legacy")
    max_shard_bytes = _check_format(format, consolidate, max_shard_size)
    if fqn_index is not None and (format != ST_FORMAT or max_shard_bytes is not None):
        raise ConfigError("--fqn-index is for --format dcp-safetensors, without --max-shard-size (it is the split)")
    mapping = None if fqn_index is None else load_fqn_index(fqn_index)
    target_mesh = parse_mesh(mesh, mesh_order)
    if dtype is not None:
        dtype = cast_dtype(dtype)
    planning = contextlib.ExitStack()  # opening and planning build millions of small acyclic objects:
    planning.enter_context(gc_paused())  # no cyclic GC passes over them until the plan is done
    try:
        reader = open_checkpoint(src, trust_pickle=options.trust_pickle, verify=options.verify_source)
    except BaseException:
        planning.close()
        raise
    try:
        with planning:
            reader = fully_reshardable(reader, options.trust_pickle)  # megatron's dp_reshardable optimizer, kept
            reader, cross = mapped(reader, src, key_map, map_direction, key_style, config, options.trust_pickle)
            index = reader.index()
            refs = atom_refs(index)
            splits, replicated, source_mesh = _source_hints(reader, index)
            selected = select_entries(index, selection or Selection(), refs)
            heads = _head_counts(src, config)
            code_layout, object_owners, why_not = None, {}, ""
            if plan == MEGATRON_CODE_PLAN or (plan == "auto" and _megatron_names(index)):
                code_layout, object_owners, why_not = _megatron_code_layout(
                    reader, index, target_mesh, dtype, refs, selected.tensors, options, vpp, auto=plan == "auto",
                    local=local.local)
            if code_layout is not None:
                layout = code_layout
            else:
                if vpp != 1:
                    raise ConfigError(f"--vpp is for megatron-core's own plan, which is not used here ({why_not}); "
                                      "without it, add --format megatron-legacy")
                refuse_etp(target_mesh, f"{plan} ({why_not})" if why_not else str(plan))
                layout = target_layout(index, refs, target_mesh, plan, splits, replicated, dtype, keep=selected.tensors,
                                       heads=heads, dedup="torch" if format == ST_FORMAT else "least-loaded",
                                       source_mesh=source_mesh, local=local)
                if why_not and layout.plan_reason:
                    layout = replace(layout, plan_reason=f"{layout.plan_reason}; megatron-core's own plan not used: "
                                                         f"{why_not}")
            index = selected.restrict(index)  # the whole index planned the parameters; write the selection
            # every entry checked (CRC, zip records, pickle globals) before the destination is touched
            object_specs, index, notes = plan_objects(index, lambda k: read_checked_object(reader, k, options.trust_pickle),
                                                      target_mesh, drop_dataloader)
            if object_owners:  # --plan megatron-core: each ShardedObject (a layer's extra state) in its main replica's file
                object_specs = [(k, p, d, object_owners.get(k, r)) for k, p, d, r in object_specs]
            unbound, bound_notes = plan_layout_bound([*(k for k, *_ in object_specs), *index.tensors], target_mesh,
                                                     layout_objects)
            object_specs, notes = [o for o in object_specs if o[0] not in unbound], [*notes, *bound_notes]
            index = replace(index, objects={k: o for k, o in index.objects.items() if k not in unbound},
                            tensors={k: t for k, t in index.tensors.items() if k not in unbound})
            if format == ST_FORMAT:
                object_specs, notes = [], [*notes, *tensors_only_warning([k for k, *_ in object_specs])]
            framework = framework_files(reader, src, options.trust_pickle) if format == "dcp" else {}
            layout = replace(layout.only(index.tensors), warnings=layout.warnings + tuple(notes))
            tasks = layout_tasks(index, layout, options.effective_piece_bytes)
            header = {"--mesh": str(target_mesh), "--mesh-order": mesh_order, "--plan": option_value(plan),
                      "--dtype": dtype,
                      "--keys": None if selection is None or selection.everything else selection.to_json(),
                      "--drop-dataloader-state": bool(drop_dataloader), "--config": option_value(config),
                      **({"--vpp": vpp} if vpp != 1 else {}),
                      **({"--layout-bound-objects": layout_objects} if layout_objects != "drop" else {}),
                      **({"--local-files": local.mode, "--ranks-per-node": local.ranks_per_node} if local.local else {}),
                      **({"--node-local-dst": f"node {node} of {local.nodes(target_mesh.world_size)}"}
                         if node is not None else {}),
                      **map_header(key_map, map_direction, key_style)}
            expected = PlannedOutput.of(((k, target_dtype(e, refs.get(k), dtype), e.shape)
                                         for k, e in index.tensors.items()), (k for k, *_ in object_specs))
            if format == ST_FORMAT:
                header.update({"--format": format, "--consolidate": consolidate, "--max-shard-size": max_shard_bytes,
                               "--fqn-index": option_value(fqn_index)})
                conversion = _st_conversion(src, dst, index, reader, layout, tasks, header, plan, preview_chunks,
                                            consolidate, max_shard_bytes, options, mapping, expected)
            else:
                conversion = _conversion(src, dst, index, reader, layout, tasks, object_specs, header, plan,
                                         preview_chunks, framework, expected, node, options.memory_budget)
        if node is None:
            return run_conversion(with_map(conversion, cross), options)
        with distributed.per_node(local.group):  # each node: a conversion of its own folder
            return run_conversion(with_map(conversion, cross), options)
    finally:
        reader.close()


def _check_format(format: str, consolidate: bool, max_shard_size: int | str | None) -> int | None:
    """Reject format options that do not go together (before any I/O); the max shard bytes."""
    from converter.config import parse_size

    if format not in FORMATS:
        raise ConfigError(f"--format {format!r}: choose one of {', '.join((*FORMATS, LEGACY_FORMAT))}")
    if format != ST_FORMAT and (consolidate or max_shard_size is not None):
        raise ConfigError(f"{'--consolidate' if consolidate else '--max-shard-size'} is for --format {ST_FORMAT} "
                          "(DCP's safetensors storage); a .distcp checkpoint has one file per rank")
    if max_shard_size is None:
        return None
    n = parse_size(max_shard_size)
    if n < 1:
        raise ConfigError(f"--max-shard-size must be positive (got {max_shard_size!r})")
    return n




def _conversion(src: str | os.PathLike, dst: str | os.PathLike, index: CheckpointIndex, reader: CheckpointReader,
                layout: TargetLayout, tasks: list[WriteTask], object_specs: list, header: dict[str, Any],
                plan_name: str, preview_chunks: int | None = None, framework: Mapping[str, bytes] | None = None,
                expected: PlannedOutput | None = None, node: int | None = None,
                memory_budget: int | None = None) -> Conversion:
    """The planned conversion: a DCP writer for the layout's chunks and the objects' specs (and the
    ``framework`` files copied beside them); its dry run is the target plan (``preview_chunks``
    chunks listed per key; None: all). With rank-local metadata (``--local-files rank|node``) the
    objects are stored once per rank (node) that loads them, and a completion marker follows the
    ranks' metadata; otherwise ``.ckptconv-loads.json`` (what each rank's ``dcp.load`` opens)
    precedes ``.metadata``. ``node`` (``--node-local-dst``): only that node's part (:func:`_node_part`)."""
    mesh, local = layout.mesh, layout.local
    loaders = loading_ranks(object_specs, mesh)
    if local.local:
        object_specs, object_readers = local_objects(object_specs, loaders, mesh.world_size, local)
        object_loads = list(zip((o[3] for o in object_specs), object_readers))
    else:
        object_readers = None
        object_loads = [(o[3], loaders.get(o[0])) for o in object_specs]
    own = None
    if node is not None:
        own = range(node * local.group, (node + 1) * local.group)
        tasks, expected = _node_part(own, layout, tasks, object_specs, object_readers, expected)

    def loads() -> list[list[str]]:
        return [[rank_metadata_name(r) if local.local else METADATA_NAME, *map(rank_file, sorted(files))]
                for r, files in enumerate(rank_loads(layout, object_loads))]

    def describe() -> tuple[str, dict]:
        from converter.plan.dry_run import build_preview, render_preview

        with gc_paused():  # the plan document is millions of small acyclic objects at scale
            doc = build_preview(source_label(src), str(dst), layout.plan or plan_name, layout, tasks, index,
                                [(k, r) for k, _, _, r in object_specs], chunk_lines=preview_chunks,
                                loads=loads() if preview_chunks is None else None, object_readers=object_readers)
            return render_preview(doc), doc

    def open_output(out: Path) -> Output:
        objects = [ObjectSpec(k, data, rank) for k, _, data, rank in object_specs]
        planner_data = {k: tuple(e.path) for k, e in index.tensors.items()} | {k: path for k, path, _, _ in object_specs}
        writer = DCPWriter(out, layout.chunks, objects, planner_data, mesh.world_size, direct_io=knobs.DIRECT_WRITES,
                           readers=layout.readers, object_readers=object_readers, ranks=own,
                           memory_budget=memory_budget)
        marker = {"format": "dcp", "local_files": local.mode, "ranks_per_node": local.ranks_per_node,
                  "world_size": mesh.world_size, "mesh": str(mesh),
                  **({"node": node, "nodes": local.nodes(mesh.world_size)} if node is not None else {}),
                  "files": [*writer.metadata_names(), *writer.data_files()]}
        if local.local:
            before, after = None, lambda: write_complete_marker(out, marker)
        else:
            before, after = lambda: write_loads_manifest(out, loads()), None
        # Megatron's metadata.json / common.pt, as they are
        return dcp_output(writer, extra_files=lambda: write_framework_files(out, framework or {}),
                          before_commit=before, after_commit=after)

    choice = None if layout.plan_reason is None else f"plan {layout.plan} (--plan {plan_name}): {layout.plan_reason}"
    planned = ConversionResult(str(dst), len(index.tensors), len({o[0] for o in object_specs}), total_target_nbytes(tasks),
                               0.0, warnings=layout.warnings, mesh=str(mesh), world_size=mesh.world_size,
                               plan_choice=choice)
    return Conversion("from-universal", src, dst, index, reader, tasks, header, open_output, planned, describe,
                      expected=expected)


def _node_part(own: range, layout: TargetLayout, tasks: list[WriteTask], object_specs: list,
               object_readers: list | None, expected: PlannedOutput | None
               ) -> tuple[list[WriteTask], PlannedOutput | None]:
    """The part of a rank-local plan one node writes into its own folder: the tasks of its ranks'
    files, and what its ranks' metadata must name (every tensor and non-tensor entry one of its
    ranks loads)."""
    mine = set(own)
    tasks = [t for t in tasks if t.target.rank in mine]
    if expected is None:
        return tasks, None
    keys = {c.key for c, rd in zip(layout.chunks, layout.readers or ()) if mine.intersection(rd)}
    objects = {o[0] for o, rd in zip(object_specs, object_readers or ()) if mine.intersection(rd)}
    return tasks, PlannedOutput({k: v for k, v in expected.tensors.items() if k in keys},
                                frozenset(k for k in expected.objects if k in objects))


def _st_conversion(src: str | os.PathLike, dst: str | os.PathLike, index: CheckpointIndex, reader: CheckpointReader,
                   layout: TargetLayout, tasks: list[WriteTask], header: dict[str, Any], plan_name: str,
                   preview_chunks: int | None, consolidate: bool, max_shard_bytes: int | None,
                   options: RunOptions, fqn_index: Mapping[str, int] | None = None,
                   expected: PlannedOutput | None = None) -> Conversion:
    """The planned conversion to DCP's per-rank safetensors storage (and, ``consolidate``, its
    hub-shaped files): the same target chunks, in the files :func:`plan_storage` lays out."""
    storage = plan_storage(layout.chunks, consolidate, max_shard_bytes, fqn_index)  # the layout's boxes are distinct
    whole = consolidation_tasks(index, storage, options.effective_piece_bytes)
    mesh = layout.mesh

    def describe() -> tuple[str, dict]:
        from converter.plan.dry_run import build_preview, render_preview

        with gc_paused():
            doc = build_preview(source_label(src), str(dst), plan_name, layout, tasks, index, [],
                                chunk_lines=preview_chunks, rank_file_of=storage.rank_file_text,
                                files=storage.n_files)
            return render_preview(doc) + _consolidated_text(storage), doc

    def open_output(out: Path) -> Output:
        shards = SafetensorsFilesWriter(out / storage.shard_dir if storage.shard_dir else out, storage.shards)
        hub = None if storage.consolidated is None else SafetensorsFilesWriter(out, storage.consolidated,
                                                                                 storage.index)
        marker = {"format": ST_FORMAT, "world_size": mesh.world_size, "mesh": str(mesh),
                  "files": [f"{storage.shard_dir}/{p.name}" if storage.shard_dir else p.name for p in storage.shards],
                  "consolidated": [p.name for p in storage.consolidated or ()]}
        return dcp_safetensors_output(shards, storage, hub, total_target_nbytes(tasks) + total_target_nbytes(whole),
                                      lambda: write_complete_marker(out, marker))

    planned = ConversionResult(str(dst), len(index.tensors), 0, total_target_nbytes(tasks) + total_target_nbytes(whole),
                               0.0, warnings=layout.warnings, mesh=str(mesh), world_size=mesh.world_size)
    if expected is not None and storage.consolidated is not None:  # the hub-shaped copy of every tensor too
        expected = PlannedOutput.of([*((k, *v) for k, v in expected.tensors.items()),
                                     *((k + CONSOLIDATED, *v) for k, v in expected.tensors.items())])
    return Conversion(FROM_UNIVERSAL_ST, src, dst, index, reader, [*tasks, *whole], header, open_output, planned,
                      describe, expected=expected)


def _consolidated_text(storage: StorageLayout) -> str:
    """The dry run's lines for the hub-shaped files."""
    from converter.units import human_bytes

    if storage.consolidated is None:
        return ""
    lines = [f"# consolidated (hub-shaped, as torch's consolidate_safetensors_files writes them), beside "
             f"{storage.shard_dir}/:"]
    for p in storage.consolidated:
        lines.append(f"{p.name}  {len(p.tensors)} tensors  {human_bytes(p.size)} ({p.size} bytes)")
    lines.append(f"{storage.index[0]}")
    return "\n" + "\n".join(lines)


def _head_counts(src: str | os.PathLike, config: Any) -> HeadCounts | None:
    """The model's head counts from ``config``, else from a config.json beside the source."""
    from converter.plan.hf_config import load_config_arg, source_config
    from converter.plan.placement_rules import head_counts

    if config is None:
        config = source_config(src)
        where = f"{source_label(src)}/config.json"
    else:
        where = "--config" if isinstance(config, Mapping) or str(config).lstrip().startswith("{") else str(config)
    doc, _ = load_config_arg(config)
    return head_counts(doc, where)








def _megatron_names(index: CheckpointIndex) -> bool:
    """Whether ``index`` holds megatron-core torch_dist names (``--plan auto`` then tries megatron-core's plan)."""
    return is_megatron({k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()})


def _megatron_code_layout(reader: CheckpointReader, index: CheckpointIndex, mesh: Mesh, dtype: str | None,
                          refs: Mapping[str, AtomRef], keep: Any, options: RunOptions, vpp: int,
                          auto: bool = False, local: bool = False) -> tuple[TargetLayout | None, Mapping[str, int], str]:
    """``--plan megatron-core``: every chunk where megatron-core's own ``sharded_state_dict()`` puts it
    on ``mesh`` with ``vpp`` model chunks per stage (:mod:`converter.plan.megatron_code`), in its main
    replica's file; with the rank of each ShardedObject's main replica. ``auto`` (``--plan auto`` on
    Megatron names): where that plan cannot be used (megatron-core not installed, no training args,
    a tensor its model does not name or shapes it differently, ``local``: --local-files rank|node),
    no layout and why not, not an error."""
    from converter.plan import megatron_code as mc

    def refuse(why: str) -> tuple[None, Mapping[str, int], str]:
        if auto:
            return None, {}, why
        raise ConfigError(f"--plan {MEGATRON_CODE_PLAN}: {why}; use --plan megatron (its name rules)")

    if auto and not mc.installed():
        return refuse("megatron-core is not installed")
    if local:
        return refuse("--local-files rank|node is not planned on megatron's boxes (each box is stored once)")
    if _COMMON not in index.objects:
        return refuse(f"{source_label(index.root)} has no {_COMMON} (megatron's training args build the model)")
    (common,) = reader.load_object(_COMMON, options.trust_pickle)
    args = vars(common.get("args")) if isinstance(common, dict) and hasattr(common.get("args"), "__dict__") else {}
    missing = mc.missing_model_args(args)
    if missing:
        return refuse(f"the checkpoint's args lack {', '.join(missing)} (megatron's model is built from them)")
    experts = f", {args['num_experts']} experts" if args.get("num_experts") else ""
    reason = (("Megatron-core names with their training args: " if auto else "")
              + f"megatron-core's own sharded_state_dict() of the GPTModel its training args build "
              f"({args['num_layers']} layers, hidden {args['hidden_size']}{experts}) on {mesh}"
              + (f", vpp {vpp}" if vpp > 1 else ""))
    try:
        boxes = mc.load_rank_boxes(args, mesh, vpp)
        layout = mc.code_target_layout(index, refs, mesh, boxes, dtype, keep, reason, strict=auto)
    except (ConfigError, PlanError) as e:
        if not auto:
            raise
        return refuse(str(e).removeprefix(f"--plan {MEGATRON_CODE_PLAN}: "))
    return layout, dict(boxes.objects), ""


# ---------------------------------------------------------------------------------------------
# --format megatron-legacy


def _to_legacy(src: str | os.PathLike, dst: str | os.PathLike, mesh: Mesh, options: RunOptions,
               selection: Selection | None, layout_objects: str, dtype: str | None, vpp: int,
               names: str | None) -> ConversionResult:
    """Megatron-LM's legacy checkpoint on ``mesh`` (tp, pp, dp, ep) x ``vpp`` model chunks."""
    from converter.plan.megatron_legacy import plan_legacy

    reader = open_checkpoint(src, trust_pickle=options.trust_pickle, verify=options.verify_source)
    try:
        reader = fully_reshardable(reader, options.trust_pickle)
        index = reader.index()
        refs = atom_refs(index)
        index = select_entries(index, selection or Selection(), refs).restrict(index)
        values = _ObjectValues(reader, options.trust_pickle)
        common = values.common()
        layout = _legacy_layout(mesh, vpp, names, common.get("args"))
        unbound, bound_notes = plan_layout_bound(list(index.objects), mesh, layout_objects)
        objects = values.load(k for k in index.objects if k not in unbound and k != _COMMON)
        tied = _tied(common.get("args"), index)
        files, warnings = plan_legacy(index, layout, common, objects, tied, common.get("iteration", "release"))
        warnings = [*bound_notes, *warnings]
        if not any(k.startswith("rng_state/") for k in objects):
            warnings.append("no rng_state for the target layout: Megatron-LM loads it with --no-load-rng")
        planned_files, tasks = _legacy_tasks(index, files, values.data_of, dtype, options)
        iteration = common.get("iteration", "release")
        header = {"--format": "megatron-legacy", "--mesh": str(mesh), "--vpp": vpp, "--megatron-names": names,
                  "--dtype": dtype, "--keys": None if selection is None or selection.everything else selection.to_json(),
                  **({"--layout-bound-objects": layout_objects} if layout_objects != "drop" else {})}
        conversion = _legacy_conversion(src, dst, index, reader, planned_files, tasks, header, str(iteration),
                                        layout, tuple(warnings))
        return run_conversion(conversion, options)
    finally:
        reader.close()


_COMMON = "common_state/shard_0_1"


class _ObjectValues:
    """The values of a source's non-tensor entries parsed for re-pickling (megatron's classes kept
    as inert records), with the bytes of the tensors inside them (RNG states)."""

    def __init__(self, reader: CheckpointReader, trust_pickle: bool) -> None:
        from formats.megatron.legacy import FRAMEWORK_MODULES
        from formats.torch_file import file_resolver

        self.reader, self.trust = reader, trust_pickle
        self._resolve = file_resolver(FRAMEWORK_MODULES, trust_pickle)
        self._data: dict[int, bytes] = {}

    def _value(self, key: str) -> Any:
        from formats.torch_file import is_tensor, read_torch_bytes

        data = read_checked_object(self.reader, key, self.trust)
        value, data_of = read_torch_bytes(data, f"{source_label(self.reader.index().root)}: key {key!r}", self._resolve)
        stack = [value]
        while stack:  # remember the bytes of every tensor inside (an RNG state's)
            v = stack.pop()
            if is_tensor(v):
                self._data[id(v)] = data_of(v)
            elif isinstance(v, dict):
                stack += list(v.values())
            elif isinstance(v, (list, tuple)):
                stack += list(v)
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    def common(self) -> dict:
        if _COMMON not in self.reader.index().objects:
            raise ConfigError(f"{source_label(self.reader.index().root)}: no {_COMMON} (megatron's common state: args, "
                              "iteration, optimizer hyperparameters); --format megatron-legacy converts Megatron "
                              "checkpoints (torch_dist, legacy, or their universal store)")
        value = self._value(_COMMON)
        if not isinstance(value, dict):
            raise ConfigError(f"{_COMMON} holds a {type(value).__name__}, not megatron's common state dict")
        return value

    def load(self, keys: Any) -> dict[str, Any]:
        return {k: self._value(k) for k in keys}

    def data_of(self, desc: Any) -> bytes:
        return self._data[id(desc)]


def _legacy_layout(mesh: Mesh, vpp: int, names: str | None, args: Any) -> Any:
    from converter.plan.megatron_legacy import LegacyLayout

    if mesh.size("cp") > 1 or mesh.size("dp_replicate") > 1:
        raise ConfigError(f"--mesh {mesh}: a megatron-legacy target takes tp, pp, dp and ep")
    a = vars(args) if hasattr(args, "__dict__") else {}
    if names not in (None, "local", "te"):
        raise ConfigError(f"--megatron-names {names!r}: choose local or te")
    local = (names == "local") if names is not None else a.get("transformer_impl") == "local"
    bucket = a.get("ddp_bucket_size")
    return LegacyLayout(tp=mesh.size("tp"), pp=mesh.size("pp"), vpp=vpp, ep=mesh.ep, etp=mesh.etp or None,
                        dp=mesh.size("dp_shard"),
                        local_spec=local, grouped_experts=bool(a.get("moe_grouped_gemm")),
                        overlap_grad_reduce=bool(a.get("overlap_grad_reduce")),
                        bucket_size=bucket if isinstance(bucket, int) else None,
                        grad_fp32=a.get("accumulate_allreduce_grads_in_fp32", True) is not False)


def _tied(args: Any, index: CheckpointIndex) -> bool:
    """Whether the output layer shares the word embeddings (Megatron-LM's default)."""
    untie = getattr(args, "untie_embeddings_and_output_weights", None)
    if isinstance(untie, bool):
        return not untie
    return "output_layer.weight" not in index.tensors and "embedding.word_embeddings.weight" in index.tensors


def _legacy_tasks(index: CheckpointIndex, files: list, data_of: Any, dtype: str | None,
                  options: RunOptions) -> tuple[list[tuple[str, bytes, list]], list[WriteTask]]:
    """Each file pickled (its storages sized) and the tasks that fill its slots."""
    from converter.plan.megatron_legacy import StorageTarget
    from formats.torch_file import plan_value

    planned, by_key = [], {}
    for i, f in enumerate(files):
        for slot, _ in f.fills:  # (--dtype casts the model's floating-point tensors)
            if dtype is not None and not f.rel.endswith("distrib_optim.pt") and slot.dtype in CASTABLE_FLOATS:
                slot.dtype = dtype
        pkl, storages = plan_value(f.value, data_of)
        planned.append((f.rel, pkl, storages))
        for slot, fill in f.fills:
            target = StorageTarget(i, slot.storage, fill.offset * by_name(slot.dtype).itemsize, slot.dtype)
            ids, boxes = by_key.setdefault(fill.key, ([], []))
            ids.append(target)
            boxes.append(fill.box)
    tasks: list[WriteTask] = []
    for key, (ids, boxes) in by_key.items():
        tasks += plan_boxes(index.tensors[key], ids, boxes, options.effective_piece_bytes)
    return planned, tasks


def _legacy_conversion(src: str | os.PathLike, dst: str | os.PathLike, index: CheckpointIndex,
                       reader: CheckpointReader, files: list, tasks: list[WriteTask], header: dict, tracker: str,
                       layout: Any, warnings: tuple[str, ...]) -> Conversion:
    from converter.run.sinks import legacy_output
    from converter.units import human_bytes
    from formats.megatron.legacy_writer import LegacyWriter, storage_key

    def describe() -> tuple[str, dict]:
        lines = [f"# megatron-legacy target: tp{layout.tp} pp{layout.pp} vpp{layout.vpp} ep{layout.ep} dp{layout.dp}, "
                 f"{len(files)} files, {len(tasks)} tasks"]
        for rel, pkl, storages in files:
            nbytes = len(pkl) + sum(len(s) if isinstance(s, (bytes, bytearray)) else s for s in storages)
            lines.append(f"{rel}  {len(storages)} tensors  {human_bytes(nbytes)}")
        lines += [f"warning: {w}" for w in warnings]
        return "\n".join(lines), {"files": [rel for rel, _, _ in files]}

    def open_output(out: Path) -> Output:
        writer = LegacyWriter(out, files, tracker)
        return legacy_output(writer)

    planned = ConversionResult(str(dst), len(index.tensors), 0, total_target_nbytes(tasks), 0.0, warnings=warnings,
                               mesh=f"tp{layout.tp},pp{layout.pp},dp{layout.dp}", world_size=layout.tp * layout.pp * layout.dp)
    # every storage a task fills: each file's tensors as the plan pickled them (their sizes)
    expected = PlannedOutput.of((storage_key(rel, i), "uint8", (s,)) for rel, _, storages in files
                                for i, s in enumerate(storages) if not isinstance(s, (bytes, bytearray)))
    return Conversion(FROM_UNIVERSAL_LEGACY, src, dst, index, reader, tasks, header, open_output, planned, describe,
                      expected=expected)
