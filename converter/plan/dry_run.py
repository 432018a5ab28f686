"""``from-universal --dry-run``: the target checkpoint before anything is written.

:func:`build_preview` turns the pure plan (target layout + copy tasks) into one JSON document
(``schemas/target-plan.schema.json``): the mesh and every rank's file, chunks and bytes; per
tensor key its placement on each mesh dim, every distinct box with the rank whose file will hold
it (and every rank that holds the same box), and the source files that box is read from; the
non-tensor entries and their files. :func:`render_preview` prints it as text and
:func:`preview_index` rebuilds the target's index from it, so ``--dry-run --layout KEY`` draws
exactly the picture ``inspect --layout KEY`` draws for the written output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from itertools import groupby
from operator import attrgetter
from typing import Any

import numpy as np

from converter.plan.copy_tasks import PlannedPieces
from formats.base import Box, CheckpointIndex, ChunkRef, ObjectEntry, TensorEntry
from formats.dtypes import by_name

#: Chunk lines shown per tensor key in the text form (a 1,024-rank target has a million chunks;
#: ``--json`` keeps them all).
PREVIEW_CHUNK_LINES = 16
SCHEMA_NAME = "target-plan"
SCHEMA_ID = "ckptconv.target-plan/1"


@lru_cache(maxsize=1 << 16)
def rank_file(rank: int) -> str:
    """The DCP file a rank writes (``formats.dcp.writer``'s naming)."""
    from formats.dcp.writer import default_file_name

    return default_file_name(rank)


_dcp_rank_file = rank_file


def placement_name(p: Any) -> str:
    """torch's name of a placement: ``Shard(0)``, ``_StridedShard(dim=0, sf=2)``, ``Replicate()``."""
    from converter.plan.placements import Shard, StridedShard

    if isinstance(p, StridedShard):
        return f"_StridedShard(dim={p.dim}, sf={p.split_factor})"
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    return "Replicate()"


def _placement_json(placement: Any, mesh: Any) -> list[dict[str, Any]]:
    groups = placement.dims if placement.dims is not None else tuple((n,) for n in mesh.names if n != "pp")
    return [{"mesh_dims": list(g), "placement": placement_name(p)} for p, g in zip(placement.placements, groups)]


def _box_json(box: Box) -> dict[str, list[int]]:
    return {"offsets": list(box.offsets), "sizes": list(box.sizes)}


def build_preview(src: str, dst: str, plan_name: str, layout: Any, tasks: Iterable[Any],
                  index: CheckpointIndex, objects: Sequence[tuple[str, int]],
                  chunk_lines: int | None = None, rank_file_of: Callable[[int], str] | None = None,
                  files: int | None = None, loads: Sequence[Sequence[str]] | None = None,
                  object_readers: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """The dry-run document (JSON-able; see the module docstring). ``layout`` is the
    :class:`converter.plan.target_layout.TargetLayout`, ``tasks`` its copy tasks, ``objects`` the non-tensor
    entries as ``(key, rank file)``.

    ``chunk_lines``: list only the first that many chunks of each key (what the text form shows;
    each tensor then says its ``chunk_count``), so a million-chunk plan costs its totals, not a
    document entry per chunk; None lists every chunk (the schema's document: ``--json``, ``--layout``).
    ``rank_file_of(rank)`` names a rank's file (default DCP's ``__<rank>_0.distcp``); ``files``: the
    output's file count (default one per rank and ``.metadata``, or a rank-local metadata file
    per rank). ``loads[rank]``: the files that rank's ``dcp.load`` opens (``ranks[].loads``).
    With rank-local metadata (``--local-files rank|node``) a box is listed once per stored copy,
    with the ranks that read that copy (``readers``), as are the objects (``object_readers``).
    """
    rank_file = rank_file_of or _dcp_rank_file
    mesh = layout.mesh
    by_key: dict[str, list[Any]] = {}
    for key, group in groupby(layout.chunks, _KEY):  # a key's chunks are contiguous: C-level grouping
        by_key.setdefault(key, []).extend(group)
    readers_of: dict[int, tuple[int, ...]] = {}
    if layout.readers is not None:
        readers_of = {id(c): r for c, r in zip(layout.chunks, layout.readers)}
    holders_of: dict[int, tuple[int, ...]] = {}  # where no placement tells them (--plan megatron-core)
    if getattr(layout, "holders", None) is not None:
        holders_of = {id(c): h for c, h in zip(layout.chunks, layout.holders)}
    listed = {k: specs if chunk_lines is None else specs[:chunk_lines] for k, specs in by_key.items()}
    sources = _sources(tasks, None if chunk_lines is None else {
        k: {(s.box.offsets, s.box.sizes) for s in specs} for k, specs in listed.items()})
    holder_maps: dict[tuple, dict[tuple, tuple[int, ...]]] = {}
    n_chunks = np.zeros(mesh.world_size, dtype=np.int64)
    n_bytes = np.zeros(mesh.world_size, dtype=np.int64)
    tensors = []
    for key, specs in by_key.items():
        entry = index.tensors[key]
        placement = layout.key_placements[key]
        holders = _holders(holder_maps, placement, tuple(entry.shape), mesh)
        itemsize = by_name(specs[0].dtype).itemsize
        ranks = np.fromiter(map(_RANK, specs), dtype=np.int64, count=len(specs))
        numels = np.fromiter(map(math.prod, map(_SIZES, map(_BOX, specs))), dtype=np.int64, count=len(specs))
        np.add.at(n_chunks, ranks, 1)
        np.add.at(n_bytes, ranks, numels * itemsize)
        chunks = []
        for s in listed[key]:
            box = (s.box.offsets, s.box.sizes)
            chunk = {"rank": s.rank, "file": rank_file(s.rank), **_box_json(s.box),
                     "bytes": s.box.numel * itemsize,
                     "holders": list(holders_of.get(id(s)) or holders.get(box, (s.rank,))),  # ascending
                     "sources": sorted(sources.get((key, *box), ()))}
            if readers_of:
                chunk["readers"] = list(readers_of[id(s)])
            chunks.append(chunk)
        doc = {"key": key, "dtype": specs[0].dtype, "source_dtype": entry.dtype, "shape": list(entry.shape),
               "placement": _placement_json(placement, mesh), "pp_stage": placement.pp_stage,
               "rule": placement.rule, "chunks": chunks}
        if chunk_lines is not None:
            doc["chunk_count"] = len(specs)
        tensors.append(doc)
    ranks_doc = [{"rank": r, "coords": mesh.rank_coords(r), "file": rank_file(r),
                  "chunks": n, "bytes": b} for r, (n, b) in enumerate(zip(n_chunks.tolist(), n_bytes.tolist()))]
    if loads is not None:
        for r, names in zip(ranks_doc, loads):
            r["loads"] = list(names)
    local = getattr(layout, "local", None)
    rank_local = local is not None and local.local
    objects_doc = [{"key": k, "file": rank_file(r)} for k, r in objects]
    if object_readers is not None:
        for o, readers in zip(objects_doc, object_readers):
            o["readers"] = list(readers)
    return {
        "schema": SCHEMA_ID,
        "src": src,
        "dst": dst,
        "plan": plan_name,
        "plan_reason": getattr(layout, "plan_reason", None),
        "mesh": {"spec": str(mesh), "dims": [{"name": d.name, "size": d.size} for d in mesh.dims],
                 "world_size": mesh.world_size},
        "ranks": ranks_doc,
        "tensors": tensors,
        "local_files": {"mode": local.mode if local is not None else "dedup",
                        "ranks_per_node": local.ranks_per_node if local is not None else None},
        "objects": objects_doc,
        "warnings": list(layout.warnings),
        "totals": {"tensors": len(tensors), "objects": len({k for k, _ in objects}), "bytes": int(n_bytes.sum()),
                   "files": files if files is not None else 2 * mesh.world_size if rank_local else mesh.world_size + 1},
    }


_KEY, _RANK, _BOX = attrgetter("key"), attrgetter("rank"), attrgetter("box")
_SIZES = attrgetter("sizes")


def _sources(tasks: Iterable[Any], wanted: Mapping[str, set[tuple]] | None) -> dict[tuple, set[str]]:
    """``{(key, offsets, sizes): source files}`` of every task, or (``wanted``: key -> boxes as
    ``(offsets, sizes)``) of the wanted boxes only (a key's tasks are scanned until all are found)."""
    sources: dict[tuple[str, tuple, tuple], set[str]] = {}
    for key, group in groupby(tasks, _KEY):
        want = None if wanted is None else set(wanted.get(key, ()))
        if want is not None and not want:
            continue
        for t in group:
            box = (t.box.offsets, t.box.sizes)
            if want is not None:
                if box not in want:
                    continue
                want.discard(box)
            files = sources.setdefault((key, *box), set())
            pieces = t.pieces
            if isinstance(pieces, PlannedPieces):  # a lazy plan: one index query for the whole box
                files.update(pieces.source_files())
            else:
                files.update(c.src.file for p in pieces for c in p.copies)
            if want is not None and not want:
                break
    return sources


def _holders(cache: dict, placement: Any, shape: tuple, mesh: Any) -> dict[tuple, tuple[int, ...]]:
    """``{(offsets, sizes): ranks holding that box}`` of a placement (in ``cache``: shapes repeat)."""
    found = cache.get((placement, shape))
    if found is None:
        found = cache[(placement, shape)] = {(b.offsets, b.sizes): h for b, h in placement.unique_boxes(shape, mesh)}
    return found


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def render_preview(doc: Mapping[str, Any], per_key: bool = True) -> str:
    """The dry-run as text: one line per rank, then (``per_key``) one block per tensor key."""
    from converter.plan.keys import box_text as _box_text
    from converter.units import human_bytes, plural

    mesh = doc["mesh"]
    lines = [f"# target mesh {mesh['spec']} ({mesh['world_size']} ranks)"]
    if doc.get("plan_reason"):
        lines.append(f"# plan {doc['plan']} (--plan auto): {doc['plan_reason']}")
    for r in doc["ranks"]:
        coords = ",".join(f"{k}={v}" for k, v in r["coords"].items())
        lines.append(f"rank {r['rank']} ({coords}): {r['file']}  {plural(r['chunks'], 'chunk')}  "
                     f"{human_bytes(r['bytes'])} ({r['bytes']} bytes)")
    if per_key and doc["tensors"]:
        lines.append(f"# per key (plan {doc['plan']}): placement on each mesh dim; each box, the rank whose file holds it "
                     "(and the other ranks that hold it), <- the source files it is read from")
        for t in doc["tensors"]:
            cast = f" (from {t['source_dtype']})" if t["source_dtype"] != t["dtype"] else ""
            stage = f"  pp stage {t['pp_stage']}" if t["pp_stage"] is not None else ""
            count = t.get("chunk_count", len(t["chunks"]))
            lines.append(f"{t['key']}  {t['dtype']}{cast}  {tuple(t['shape'])}  {plural(count, 'chunk')}{stage}")
            place = "  ".join(f"{'+'.join(p['mesh_dims'])}: {p['placement']}" for p in t["placement"]) or "replicated"
            lines.append(f"    placement: {place}  (rule: {t['rule'] or '-'})")
            shown = t["chunks"] if len(t["chunks"]) <= PREVIEW_CHUNK_LINES else t["chunks"][:PREVIEW_CHUNK_LINES]
            for c in shown:
                box = Box(tuple(c["offsets"]), tuple(c["sizes"]))
                others = [h for h in c["holders"] if h != c["rank"]]
                also = f" (also on {_ranks_text(others)})" if others else ""
                lines.append(f"    rank {c['rank']}{also}: {_box_text(box, tuple(t['shape']))}  "
                             f"<- {', '.join(c['sources']) or '-'}")
            if len(shown) < count:
                lines.append(f"    ... and {count - len(shown)} more chunks (--json lists every one)")
    if doc["objects"]:
        files = sorted({o["file"] for o in doc["objects"]})
        lines.append(f"# {plural(len(doc['objects']), 'non-tensor entry', 'non-tensor entries')} in {', '.join(files)}")
    lines += [f"warning: {w}" for w in doc["warnings"]]
    return "\n".join(lines)


def preview_index(doc: Mapping[str, Any]) -> CheckpointIndex:
    """The index of the checkpoint the dry run describes (what its ``.metadata`` will say)."""
    tensors = {}
    for t in doc["tensors"]:
        boxes = {(tuple(c["offsets"]), tuple(c["sizes"])): c for c in reversed(t["chunks"])}  # a box's first copy
        chunks = tuple(ChunkRef(Box(*box), c["file"], None, c["rank"]) for box, c in reversed(boxes.items()))
        tensors[t["key"]] = TensorEntry(t["key"], t["dtype"], tuple(t["shape"]), chunks, (t["key"],))
    objects = {o["key"]: ObjectEntry(o["key"], (o["key"],), o["file"], None) for o in doc["objects"]}
    return CheckpointIndex("dcp", doc["dst"], tensors, objects, {"world_size": doc["mesh"]["world_size"]})
