"""DCP's safetensors storage (``torch.distributed.checkpoint.hf_storage``): the per-rank form.

``dcp.save(state, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))`` makes
every rank write its own shards of every tensor it saves (after DCP's dedup) into
``shard-<R>-model-<F>-of-<N>.safetensors`` (``R`` = rank + 1, ``F`` = the file index of
``fqn_to_index_mapping``, 1 of 1 without one), with ``enable_consolidation=True`` under
``path/sharded/`` beside the consolidated, hub-shaped files. There is no ``.metadata``: each file's
``__metadata__`` carries the sharding, ``{"DCP_SHARDING_INFO": json.dumps({fqn: {"saved_offsets":
[...]}}), "DCP_VERSION": "1.0", "format": "pt"}``, and ``HuggingFaceStorageReader`` builds DCP's
``Metadata`` from every ``*.safetensors`` header of the directory: a chunk per (file, tensor) at its
saved offsets, the global shape the largest ``offset + size`` per dim. Tensors only: DCP writes a
non-tensor entry's bytes in front of the safetensors data, which no reader can open.

:class:`DCPSafetensorsReader` reads that form (no safetensors library, no torch): the same headers,
the same chunks and global shapes, validated (in bounds, disjoint, covering every tensor, one dtype
per tensor; every damaged header or sharding entry is a one-line error naming the file and key),
each chunk's rank from its file name. Regions are read as :class:`formats.hf.HFReader` reads them:
one ``pread`` of the rows they span.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from formats.base import Box, CheckpointIndex, ChunkRef, Shape, TensorEntry
from formats.dcp.reader import check_cover, guess_path
from formats.errors import CorruptCheckpointError, InvalidCheckpointError, PlanError
from formats.fsutil import loads_json, short, source_path
from formats.hf import HFReader, StEntry, StHeader, natural_key, read_header

#: ``__metadata__`` keys torch's HF storage writes (``torch.distributed.checkpoint._hf_utils``).
SHARDING_KEY = "DCP_SHARDING_INFO"
VERSION_KEY = "DCP_VERSION"
OFFSETS_KEY = "saved_offsets"
#: The value torch 2.13 writes under ``DCP_VERSION`` (``HF_DCP_VERSION``).
HF_DCP_VERSION = "1.0"
#: Where ``enable_consolidation=True`` puts the per-rank files, under the output directory.
SHARDED_DIR = "sharded"
SUFFIX = ".safetensors"
#: ``_gen_file_name(index, largest, shard_index)``: ``shard-00001-model-00001-of-00001.safetensors``.
SHARD_RE = re.compile(r"shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors")
FORMAT = "dcp-safetensors"


def shard_file_name(rank: int, file_index: int = 1, files: int = 1) -> str:
    """The file torch's ``HuggingFaceStorageWriter(save_distributed=True)`` gives ``rank`` (from 0)
    for file ``file_index`` of ``files`` (from 1)."""
    return f"shard-{rank + 1:05d}-model-{file_index:05d}-of-{files:05d}{SUFFIX}"


def rank_of_file(name: str) -> int | None:
    """The rank (from 0) that wrote the per-rank file ``name``; None for another name."""
    m = SHARD_RE.fullmatch(os.path.basename(name))
    return int(m.group(1)) - 1 if m and int(m.group(1)) >= 1 else None


def is_per_rank_listing(names: Iterable[str]) -> bool:
    """Whether a directory listing holds per-rank files of DCP's safetensors storage."""
    return any(SHARD_RE.fullmatch(n) for n in names)


def sharding_of(header: StHeader, where: str) -> dict[str, Shape]:
    """Each tensor of the file -> its saved offsets in the whole tensor, from ``DCP_SHARDING_INFO``
    (all zeros when the file has none, as ``HuggingFaceStorageReader`` reads it). A damaged entry
    is a one-line CorruptCheckpointError naming the file and the tensor."""
    meta = header.metadata or {}
    raw = meta.get(SHARDING_KEY)
    if raw is None:
        return {name: (0,) * len(e.shape) for name, e in header.tensors.items()}
    fix = "the file's sharding metadata is damaged: re-save the checkpoint or restore the file"
    doc = loads_json(raw, f"{where} (__metadata__ {SHARDING_KEY})", CorruptCheckpointError, fix)
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: __metadata__ {SHARDING_KEY} is not a JSON object; {fix}")
    out: dict[str, Shape] = {}
    for name, e in header.tensors.items():
        entry = doc.get(name)
        if not isinstance(entry, dict) or OFFSETS_KEY not in entry:
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} has no {OFFSETS_KEY} in __metadata__ {SHARDING_KEY}; {fix}")
        offsets = entry[OFFSETS_KEY]
        if (not isinstance(offsets, list) or len(offsets) != len(e.shape)
                or not all(type(o) is int and o >= 0 for o in offsets)):
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} ({e.dtype} {list(e.shape)}) has bad {OFFSETS_KEY} "
                f"{short(repr(offsets), 80)} (need {len(e.shape)} non-negative integers); {fix}")
        out[name] = tuple(offsets)
    return out


def per_rank_files(names: Sequence[str]) -> list[str]:
    """The files ``HuggingFaceStorageReader`` reads in a directory: every ``*.safetensors``, here
    in rank, then file order (per-rank names first, by their numbers; other names after)."""
    files = [n for n in names if n.endswith(SUFFIX) and not n.startswith(".")]

    def order(n: str) -> tuple:
        m = SHARD_RE.fullmatch(n)
        return (0, int(m.group(1)), int(m.group(2)), n) if m else (1, 0, 0, n)

    return sorted(files, key=order)


def missing_sharded_hint(root: Path, names: Sequence[str]) -> str | None:
    """The message for a directory whose only checkpoint is its ``sharded/`` folder (a save whose
    consolidation never ran or failed: torch's consolidation crashes on integer and bool
    tensors); None when that is not the case."""
    sub = root / SHARDED_DIR
    if SHARDED_DIR not in names or any(n.endswith(SUFFIX) for n in names) or not sub.is_dir():
        return None
    if not is_per_rank_listing(os.listdir(sub)):
        return None
    return (f"{root}: holds no checkpoint files itself, but {sub} holds the per-rank safetensors files of "
            f"a DCP HuggingFaceStorageWriter save (not consolidated here); pass {sub}")


class DCPSafetensorsReader(HFReader):
    """Reads the per-rank form of DCP's safetensors storage (see the module docstring).

    Every chunk is one tensor of one file: ``ChunkRef(box at its saved offsets, file, (file,
    name), rank from the file name)``. Keys are in natural name order (the files keep no state
    dict order); object paths are guessed from the dotted keys (DCP's planner data is not saved):
    ``model.<fqn>`` and ``optim.state.<fqn>.<name>`` keep their roots, anything else is one name.
    """

    def _build_index(self) -> CheckpointIndex:
        names = self._storage.list() if self._names is None else self._names
        files = per_rank_files(names)
        if not files:
            raise InvalidCheckpointError(f"{self.root}: no *.safetensors files; pass the directory "
                                         "HuggingFaceStorageWriter saved into (its sharded/ folder)")
        self._at: dict[tuple[str, str], StEntry] = {}
        chunks: dict[str, list[tuple[Box, str, StEntry]]] = {}
        sizes: dict[str, int] = {}
        versions: set[str] = set()
        for f in files:
            header = self._header(f)
            where = str(self.root / f)
            sizes[f] = header.size
            if header.metadata and isinstance(header.metadata.get(VERSION_KEY), str):
                versions.add(header.metadata[VERSION_KEY])
            for name, offsets in sharding_of(header, where).items():
                e = header.tensors[name]
                chunks.setdefault(name, []).append((Box(offsets, e.shape), f, e))
                self._at[(f, name)] = e
        tensors = {key: self._entry_of(key, chunks[key]) for key in sorted(chunks, key=natural_key)}
        ranks = {r for r in map(rank_of_file, files) if r is not None}
        info: dict[str, Any] = {
            "version": min(versions) if versions else None,
            "storage": "HuggingFaceStorageWriter (save_distributed): per-rank safetensors",
            "world_size": max(ranks) + 1 if ranks else None,
            "files": sizes,
            "metadata_files": [],
        }
        return CheckpointIndex(FORMAT, str(self.root), tensors, {}, info)

    def _header(self, f: str) -> StHeader:
        path = source_path(self.root, f) if self._storage.is_local else self.root / f
        return read_header(path, f, self._storage)

    def _entry_of(self, key: str, found: list[tuple[Box, str, StEntry]]) -> TensorEntry:
        """The tensor ``key`` from its chunks: one dtype and rank, shape as torch's reader infers
        it (largest ``offset + size`` per dim), chunks covering it exactly once."""
        first_box, first_file, first = found[0]
        for box, f, e in found[1:]:
            if e.dtype != first.dtype or len(e.shape) != len(first.shape):
                raise CorruptCheckpointError(
                    f"{self.root}: tensor {key!r} is {first.dtype} {list(first.shape)} in {first_file} but "
                    f"{e.dtype} {list(e.shape)} in {f}; the files are not of one checkpoint")
        shape = tuple(max(b.offsets[d] + b.sizes[d] for b, _, _ in found) for d in range(len(first.shape)))
        kept = _drop_repeated_empty(found)
        kept.sort(key=lambda c: c[0].offsets)
        check_cover(key, shape, [b for b, _, _ in kept], str(self.root),
                    missing="a rank's shard file is missing or damaged")
        refs = tuple(ChunkRef(b, f, (f, e.name), rank_of_file(f)) for b, f, e in kept)
        return TensorEntry(key, first.dtype, shape, refs, object_path(key))

    def _locate(self, key: str, chunk: ChunkRef, region: Box) -> tuple[str, StEntry, Box]:
        """(file, stored tensor, ``region`` in the stored tensor's coordinates) of ``chunk``."""
        e = self._at.get(chunk.locator) if isinstance(chunk.locator, tuple) else None
        if e is None or e.name != key:
            raise PlanError(f"{self.root}: no chunk of {key!r} at {chunk.box.to_json()} in this checkpoint")
        if region.ndim != chunk.box.ndim or not chunk.box.contains(region):
            raise PlanError(f"key {key!r}: region {region.to_json()} is not inside chunk {chunk.box.to_json()}")
        return chunk.locator[0], e, region.relative_to(chunk.box)


def _drop_repeated_empty(found: list[tuple[Box, str, StEntry]]) -> list[tuple[Box, str, StEntry]]:
    """``found`` without repeats of an empty box (torch's reader keeps one entry per offset)."""
    seen: set[Box] = set()
    out = []
    for c in found:
        if not c[0].numel:
            if c[0] in seen:
                continue
            seen.add(c[0])
        out.append(c)
    return out


def object_path(key: str) -> tuple[str, ...]:
    """The object path of a dotted key whose save recorded none: DCP's ``model.`` / ``optim.`` /
    ``optimizer.`` roots kept (:func:`formats.dcp.reader.guess_path`), any other key one name (an
    HF or torchtitan top-level name)."""
    return tuple(guess_path(key)) if key.split(".", 1)[0] in ("model", "optim", "optimizer") and "." in key \
        else (key,)


def sharding_metadata(offsets: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """The ``__metadata__`` torch's writer gives a per-rank file whose tensors lie at ``offsets``
    (in the file's write order): the sharding JSON exactly as ``json.dumps`` writes it."""
    info = json.dumps({name: {OFFSETS_KEY: [int(o) for o in offs]} for name, offs in offsets.items()})
    return {SHARDING_KEY: info, VERSION_KEY: HF_DCP_VERSION, "format": "pt"}
