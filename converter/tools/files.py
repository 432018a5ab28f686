"""``ckptconv files OUT --rank R`` (or ``--node N``): the files a target rank's ``dcp.load`` opens.

A launcher stages exactly these to the rank's local disk before the job starts. They are read from
the output itself, never re-planned:

- an output with rank-local metadata (``from-universal --local-files rank|node``): the rank's own
  ``__<R>.metadata`` and every data file its items live in (an empty chunk is never read, so its
  file does not count), which is what ``dcp.load`` of a folder without ``.metadata`` opens;
- a from-universal output with one ``.metadata``: the manifest ``.ckptconv-loads.json`` the
  conversion wrote from its plan (every rank's boxes, the replicated ones included, and the
  non-tensor entries each rank loads).

A node's list is the union over its ranks ``N*K .. N*K+K-1`` (``K``: ``--ranks-per-node``, by
default the one the output was written with).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from formats.dcp.metadata import METADATA_NAME, BytesMeta, load_metadata_file
from formats.dcp.writer import rank_metadata_name
from formats.errors import ConfigError, InvalidCheckpointError

#: The manifest beside a from-universal DCP output's ``.metadata`` (converter.run.destination).
LOADS_MANIFEST = ".ckptconv-loads.json"
#: The completion marker of a rank-local output (its ``local_files`` and ``ranks_per_node``).
MARKER = ".ckptconv-complete.json"


def rank_files(out: str | os.PathLike, rank: int) -> list[str]:
    """The files (names in ``out``) rank ``rank``'s ``dcp.load`` opens: its metadata first, then
    the data files in rank order."""
    root = Path(out)
    if rank < 0:
        raise ConfigError(f"--rank {rank}: ranks start at 0")
    if (root / METADATA_NAME).is_file():
        return _from_manifest(root, rank)
    own = root / rank_metadata_name(rank)
    if own.is_file():
        return [own.name, *_data_files(own)]
    if any(root.glob("__*.metadata")) or (root / MARKER).is_file():
        world = _marker(root).get("world_size")
        beyond = f" (the output has {world} ranks)" if isinstance(world, int) and rank >= world else ""
        raise InvalidCheckpointError(f"{root}: no {own.name}{beyond}: rank {rank}'s metadata is not in this folder "
                                     f"(a node-local output: run this on the node that holds rank {rank})")
    raise InvalidCheckpointError(f"{root}: not a DCP checkpoint (no {METADATA_NAME}, no __<rank>.metadata)")


def node_files(out: str | os.PathLike, node: int, ranks_per_node: int | None = None) -> list[str]:
    """The union of :func:`rank_files` over node ``node``'s ranks (``ranks_per_node`` of them,
    default the output's own ``--ranks-per-node``)."""
    root = Path(out)
    k = ranks_per_node if ranks_per_node is not None else _marker(root).get("ranks_per_node")
    if not isinstance(k, int) or k < 1:
        raise ConfigError(f"{root}: --node needs --ranks-per-node K (the output records none)")
    if node < 0:
        raise ConfigError(f"--node {node}: nodes start at 0")
    seen: dict[str, None] = {}
    for rank in range(node * k, (node + 1) * k):
        for name in rank_files(root, rank):
            seen.setdefault(name, None)
    return sorted(seen, key=_order)


def _data_files(metadata_path: Path) -> list[str]:
    """The data files the items of one rank-local metadata file live in (empty chunks excepted)."""
    md = load_metadata_file(metadata_path)
    empty = {(key, box.offsets) for key, e in md.entries.items() if not isinstance(e, BytesMeta)
             for box in e.chunks if not box.numel}
    files = {info.relative_path for key, info in md.storage.items() if key not in empty}
    return sorted(files, key=_order)


def _from_manifest(root: Path, rank: int) -> list[str]:
    try:
        doc = json.loads((root / LOADS_MANIFEST).read_bytes())
        files, loads = doc["files"], doc["loads"]
    except FileNotFoundError:
        raise InvalidCheckpointError(
            f"{root}: no {LOADS_MANIFEST}: this checkpoint was not written by ckptconv from-universal (or by an older "
            "one), so which files a rank opens is not recorded; dcp.load may open any of them") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidCheckpointError(f"{root / LOADS_MANIFEST}: unreadable ({e}); convert again") from None
    if rank >= len(loads):
        raise ConfigError(f"--rank {rank}: {root} was written for {len(loads)} ranks")
    return [files[i] for i in loads[rank]]


def _marker(root: Path) -> dict:
    try:
        doc = json.loads((root / MARKER).read_bytes())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _order(name: str) -> tuple:
    """Metadata first, then data files by rank."""
    if name.endswith(".metadata"):
        return (0, name)
    parts = name.strip("_").split("_")
    try:
        return (1, int(parts[0]), name)
    except ValueError:
        return (2, name)
