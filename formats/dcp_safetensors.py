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

Writing the form is pure layout here (:func:`plan_shard_files`: every rank's files, headers and
offsets as torch's writer makes them; :func:`plan_consolidated` and :func:`consolidated_index`:
the hub-shaped files of torch's ``consolidate_safetensors_files``); the bytes are streamed by
:class:`formats.hf.SafetensorsFilesWriter`.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from formats.base import Box, CheckpointIndex, ChunkRef, Shape, TensorEntry
from formats.dcp.reader import check_cover, guess_path
from formats.errors import ConfigError, CorruptCheckpointError, InvalidCheckpointError, PlanError, UnsupportedError
from formats.fsutil import loads_json, short, source_path
from formats.hf import (MAX_HEADER_BYTES, FilePlan, HFReader, SafetensorsFilesWriter, StEntry, StHeader, TensorSpec,
                        build_header, read_header, split_shards, writer_order)
from formats.manifest import Manifest

#: ``__metadata__`` keys torch's HF storage writes (``torch.distributed.checkpoint._hf_utils``).
SHARDING_KEY = "DCP_SHARDING_INFO"
VERSION_KEY = "DCP_VERSION"
OFFSETS_KEY = "saved_offsets"
#: ckptconv's completion marker of the form it writes (torch's readers ignore it): it lists every
#: per-rank file, so a reader can tell a missing one (torch's own saves have no such list).
COMPLETE_MARKER = ".ckptconv-complete.json"
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
    for name in sorted(header.tensors, key=_order_in(doc)):  # the order the rank saved them in
        e = header.tensors[name]
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


def _order_in(doc: Mapping[str, Any]) -> Any:
    """Sort key: a name's position among ``doc``'s keys (names it lacks last)."""
    pos = {k: i for i, k in enumerate(doc)}
    return lambda name: pos.get(name, len(pos))


#: Ready keys weighed by their prefix with the previous key; more are taken in first-seen order.
_SCAN = 256


def state_dict_order(orders: Sequence[Sequence[str]]) -> list[str]:
    """The saving job's key order, recovered from each file's keys in the order its rank saved
    them (``DCP_SHARDING_INFO`` is written in the rank's state-dict order): a linear order keeping
    every file's order (a merge of the sequences: Kahn's algorithm over the keys). Where the files
    leave the order open (a key only one rank saved, between keys it does not hold), the next key
    is the one sharing the longest dotted prefix with the key before it (DCP flattens nested
    dicts depth first: siblings are contiguous), then one from a later file (it was deduplicated
    away from the earlier ranks: it sits before their next key), then the first seen. A cycle (files
    that disagree) leaves the rest in first-seen order. Identical sequences (FSDP ranks) count once."""
    distinct = list(dict.fromkeys(map(tuple, orders)))
    first: dict[str, tuple[int, int]] = {}
    for i, seq in enumerate(distinct):
        for j, key in enumerate(seq):
            first.setdefault(key, (i, j))
    succ: dict[str, set[str]] = {k: set() for k in first}
    indegree = dict.fromkeys(first, 0)
    for seq in distinct:
        for a, b in zip(seq, seq[1:]):
            if b not in succ[a]:
                succ[a].add(b)
                indegree[b] += 1
    parts = {k: k.split(".") for k in first}
    ready = [k for k, d in indegree.items() if d == 0]
    out: list[str] = []
    prev: list[str] = []
    while ready:
        def rank(k: str) -> tuple[int, int, int]:
            shared = 0
            for x, y in zip(prev, parts[k]):
                if x != y:
                    break
                shared += 1
            return (-shared, -first[k][0], first[k][1])

        key = min(ready, key=rank) if len(ready) <= _SCAN else min(ready, key=first.__getitem__)
        ready.remove(key)
        out.append(key)
        prev = parts[key]
        for b in succ[key]:
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    if len(out) < len(first):
        done = set(out)
        out += sorted((k for k in first if k not in done), key=first.__getitem__)
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
    name), rank from the file name)``. Keys are in the saving job's state-dict order, recovered from
    the order each rank wrote its sharding entries (:func:`state_dict_order`), so DCP's dedup on the
    same mesh picks the same owners again; object paths are guessed from the dotted keys (DCP's
    planner data is not saved):
    ``model.<fqn>`` and ``optim.state.<fqn>.<name>`` keep their roots, anything else is one name.
    """

    def _build_index(self) -> CheckpointIndex:
        names = self._storage.list() if self._names is None else self._names
        files = per_rank_files(names)
        if not files:
            raise InvalidCheckpointError(f"{self.root}: no *.safetensors files; pass the directory "
                                         "HuggingFaceStorageWriter saved into (its sharded/ folder)")
        self._check_listed(set(files))
        self._at: dict[tuple[str, str], StEntry] = {}
        chunks: dict[str, list[tuple[Box, str, StEntry]]] = {}
        sizes: dict[str, int] = {}
        versions: set[str] = set()
        orders: list[list[str]] = []  # each file's keys in the order its rank saved them
        for f in files:
            header = self._header(f)
            where = str(self.root / f)
            sizes[f] = header.size
            if header.metadata and isinstance(header.metadata.get(VERSION_KEY), str):
                versions.add(header.metadata[VERSION_KEY])
            sharding = sharding_of(header, where)
            orders.append(list(sharding))
            for name, offsets in sharding.items():
                e = header.tensors[name]
                chunks.setdefault(name, []).append((Box(offsets, e.shape), f, e))
                self._at[(f, name)] = e
        tensors = {key: self._entry_of(key, chunks[key]) for key in state_dict_order(orders)}
        ranks = {r for r in map(rank_of_file, files) if r is not None}
        info: dict[str, Any] = {
            "version": min(versions) if versions else None,
            "storage": "HuggingFaceStorageWriter (save_distributed): per-rank safetensors",
            "world_size": max(ranks) + 1 if ranks else None,
            "files": sizes,
            "metadata_files": [],
        }
        return CheckpointIndex(FORMAT, str(self.root), tensors, {}, info)

    def _check_listed(self, present: set[str]) -> None:
        """Where ckptconv wrote the folder, every per-rank file its marker lists must be here (a
        rank that saved nothing writes no file, so torch's own saves cannot be checked so)."""
        if not self._storage.is_local:
            return
        for marker, prefix in ((self.root / COMPLETE_MARKER, ""), (self.root.parent / COMPLETE_MARKER,
                                                                   self.root.name + "/")):
            try:
                doc = json.loads(marker.read_bytes()) if marker.is_file() else None
            except (OSError, ValueError):
                doc = None
            listed = doc.get("files") if isinstance(doc, dict) else None
            if not isinstance(listed, list):
                continue
            mine = [f[len(prefix):] for f in listed if isinstance(f, str) and f.startswith(prefix)
                    and "/" not in f[len(prefix):]]
            missing = sorted(set(mine) - present)
            if missing:
                raise CorruptCheckpointError(
                    f"{self.root / missing[0]}: missing ({len(missing)} of the {len(mine)} per-rank files "
                    f"{marker.name} lists); copy the whole checkpoint")
            return

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


# ---------------------------------------------------------------------------------------------
# writing the form: pure layouts (the bytes are streamed by formats.hf.SafetensorsFilesWriter)


def plan_shard_files(chunks: Iterable[Any], file_index: Mapping[str, int] | None = None,
                     files: int = 1) -> list[FilePlan]:
    """The per-rank files torch's ``HuggingFaceStorageWriter(save_distributed=True,
    fqn_to_index_mapping=file_index)`` writes for ``chunks`` (each with ``key``, ``dtype``, ``box``
    and the ``rank`` whose file holds it, in the ranks' state-dict order): one file per (rank, file
    index) that holds anything, named :func:`shard_file_name`; tensors laid out as safetensors'
    writer lays them (dtype rank descending, then name), ``__metadata__`` as torch writes it (the
    sharding JSON in write order). Pure; files in rank, then file-index order.

    Headers are joined from JSON fragments made once per key (:class:`_Fragments`): a 1,024-rank
    layout has millions of entries; byte-identical to :func:`formats.hf.build_header` of
    :func:`sharding_metadata` (tests compare both)."""
    groups: dict[tuple[int, int], list[Any]] = {}
    for c in chunks:
        groups.setdefault((c.rank, 1 if file_index is None else file_index[c.key]), []).append(c)
    frag = _Fragments()
    plans = []
    for (rank, f), group in sorted(groups.items()):
        name = shard_file_name(rank, f, files)
        if len({c.key for c in group}) != len(group):
            dup = next(c.key for i, c in enumerate(group) if any(d.key == c.key for d in group[:i]))
            raise ConfigError(f"{name}: rank {rank} holds two chunks of {dup!r}; a rank's file holds one per tensor")
        plans.append(frag.plan(name, group))
    return plans


class _Fragments:
    """JSON pieces of per-rank headers, cached per key: the name as safetensors (UTF-8) and as
    Python's ``json.dumps`` (ASCII, inside the sharding string) write it, the dtype's order."""

    def __init__(self) -> None:
        from formats.dtypes import by_name
        from formats.hf import _DTYPE_RANK

        self._by_name, self._rank = by_name, _DTYPE_RANK
        self._key: dict[str, tuple] = {}

    def _of(self, key: str, dtype: str) -> tuple:
        found = self._key.get(key)
        if found is None:
            d = self._by_name(dtype)
            found = self._key[key] = (
                (-self._rank[d.safetensors], key.encode("utf-8")),  # safetensors' writer order
                json.dumps(key, ensure_ascii=False) + ':{"dtype":"' + d.safetensors + '","shape":[',
                json.dumps(key),  # inside DCP_SHARDING_INFO (json.dumps' defaults)
                d.itemsize,
            )
        return found

    def plan(self, name: str, group: list[Any]) -> FilePlan:
        """The file ``name`` holding ``group``'s chunks (in write order)."""
        of = [self._of(c.key, c.dtype) for c in group]
        info = "{" + ", ".join(f'{o[2]}: {{"saved_offsets": [{", ".join(map(str, c.box.offsets))}]}}'
                               for o, c in zip(of, group)) + "}"
        meta = {SHARDING_KEY: info, VERSION_KEY: HF_DCP_VERSION, "format": "pt"}
        parts = ['{"__metadata__":' + json.dumps(meta, ensure_ascii=False, separators=(",", ":"))]
        order = sorted(range(len(group)), key=lambda i: of[i][0])
        offsets: dict[str, int] = {}
        specs = []
        cursor = 0
        for i in order:
            c, o = group[i], of[i]
            sizes = tuple(c.box.sizes)
            n = o[3]
            for size in sizes:
                n *= size
            parts.append(f'{o[1]}{",".join(map(str, sizes))}],"data_offsets":[{cursor},{cursor + n}]}}')
            offsets[c.key] = cursor
            cursor += n
            specs.append(TensorSpec(c.key, c.dtype, sizes))
        text = (",".join(parts) + "}").encode("utf-8")
        text += b" " * (-len(text) % 8)
        if len(text) > MAX_HEADER_BYTES:
            raise UnsupportedError(f"{name}: a header of {len(text)} bytes is over safetensors' {MAX_HEADER_BYTES} "
                                   "byte limit; split the keys into more files (--max-shard-size)")
        header = struct.pack("<Q", len(text)) + text
        return FilePlan(name, tuple(specs), header, {k: len(header) + v for k, v in offsets.items()})


def plan_shard_file_slow(name: str, group: list[Any]) -> FilePlan:
    """:meth:`_Fragments.plan` by the general builders (the oracle the tests hold it to)."""
    meta = sharding_metadata({c.key: c.box.offsets for c in group})
    ordered = writer_order(TensorSpec(c.key, c.dtype, tuple(c.box.sizes)) for c in group)
    header, rel = build_header(ordered, meta)
    return FilePlan(name, tuple(ordered), header, {k: len(header) + v for k, v in rel.items()})


def consolidated_name(file_index: int, files: int) -> str:
    """torch's name for consolidated file ``file_index`` of ``files`` (``_gen_file_name`` without a
    shard index): ``model-00001-of-00001.safetensors`` even for one file."""
    return f"model-{file_index:05d}-of-{files:05d}{SUFFIX}"


def plan_consolidated(specs: Sequence[TensorSpec], file_index: Mapping[str, int]) -> list[FilePlan]:
    """The hub-shaped files torch's ``consolidate_safetensors_files(fqn_to_index_mapping=...)``
    writes: files in the order their index first appears, each file's tensors in ``specs`` order;
    its header as torch writes it (``json.dumps`` with default separators, ``shape``, ``dtype``,
    ``data_offsets`` per tensor, no ``__metadata__``, no padding). Pure."""
    from formats.dtypes import by_name

    files = max(file_index.values(), default=1)
    by_file: dict[int, list[TensorSpec]] = {}
    for s in specs:
        by_file.setdefault(file_index[s.name], []).append(s)
    plans = []
    for f, group in by_file.items():
        doc, offsets, cursor = {}, {}, 0
        for s in group:
            n = s.nbytes
            doc[s.name] = {"shape": list(s.shape), "dtype": by_name(s.dtype).safetensors, "data_offsets": [cursor, cursor + n]}
            offsets[s.name] = cursor
            cursor += n
        text = json.dumps(doc).encode("utf-8")
        header = struct.pack("<Q", len(text)) + text
        plans.append(FilePlan(consolidated_name(f, files), tuple(group), header,
                              {k: len(header) + v for k, v in offsets.items()}))
    return plans


def consolidated_index(plans: Sequence[FilePlan]) -> bytes:
    """``model.safetensors.index.json`` exactly as torch's consolidation writes it (``json.dump``
    with ``indent=2``, the weight map in file then tensor order, no trailing newline)."""
    doc = {"metadata": {"total_size": sum(t.nbytes for p in plans for t in p.tensors)},
           "weight_map": {t.name: p.name for p in plans for t in p.tensors}}
    return json.dumps(doc, indent=2).encode("utf-8")


def file_split(specs: Sequence[TensorSpec], max_bytes: int | None) -> dict[str, int]:
    """Each tensor's consolidated file index (from 1): all in file 1 (torch's default, no
    ``fqn_to_index_mapping``), or huggingface_hub's greedy split at ``max_bytes`` in ``specs``
    order."""
    if max_bytes is None:
        return {s.name: 1 for s in specs}
    return {s.name: i + 1 for i, group in enumerate(split_shards(list(specs), max_bytes)) for s in group}


def consolidated_order(chunks: Iterable[Any]) -> list[str]:
    """The keys of ``chunks`` in the order ``dcp.save``'s metadata lists them, which is the order
    torch's ``HuggingFaceStorageWriter`` consolidates in: rank by rank, each rank's items in its
    state-dict order (``chunks`` in state-dict order, each with its owner ``rank``): a key comes
    where the lowest rank holding a chunk of it saves it."""
    first: dict[str, tuple[int, int]] = {}
    for i, c in enumerate(chunks):
        was = first.get(c.key)
        if was is None or c.rank < was[0]:
            first[c.key] = (c.rank, was[1] if was is not None else i)
    return sorted(first, key=first.__getitem__)


#: How the hub-shaped copy of a tensor is named in a manifest beside its per-rank chunks.
CONSOLIDATED = " (consolidated)"


def shards_manifest(writer: SafetensorsFilesWriter, where: str = "") -> Manifest:
    """What the per-rank files ``writer`` is about to publish hold, read from their headers (as
    ``HuggingFaceStorageReader`` reads them): each tensor once, of its chunks' dtype and its global
    shape (the largest ``saved_offsets + shape`` per dim); each chunk's byte range (files named
    ``where`` + name); any tensor whose chunks differ in dtype or do not add up to its shape, and
    any chunk not all written."""
    m = Manifest()
    seen: dict[str, list] = {}  # key -> [dtype, ends per dim, elements]
    for file, (meta, entries) in writer.headers().items():
        sharding = json.loads((meta or {}).get(SHARDING_KEY, "{}"))
        for name, (dtype, shape, begin, end) in entries.items():
            m.extent(name, where + file, begin, end)
            offsets = sharding.get(name, {}).get(OFFSETS_KEY, [0] * len(shape))
            ends = [o + n for o, n in zip(offsets, shape)]
            got = seen.setdefault(name, [dtype, ends, 0])
            if got[0] != dtype:
                m.problem(f"tensor {name!r}: chunks of {got[0]} and of {dtype} ({file})")
            got[1] = [max(a, b) for a, b in zip(got[1], ends)]
            got[2] += math.prod(shape)
    for name, (dtype, ends, numel) in seen.items():
        m.tensor(name, dtype, tuple(ends))
        if numel != math.prod(ends):
            m.problem(f"tensor {name!r}: its chunks hold {numel} of the {math.prod(ends)} elements of {ends}")
    writer.unwritten(m)
    return m

