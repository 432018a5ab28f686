"""``ckptconv verify``: is a checkpoint sound? Structure, completeness and every stored checksum.

- **universal**: ``ckptconv.json`` against its schema; every record consistent (dtype, chunk
  shape, array path); one checksum per chunk of the grid (complete); the group and array
  ``zarr.json`` files; every chunk file whole, its xxh3_64 equal to the recorded one and its edge
  padding zero; every object file's size and xxh3_64; atoms naming existing keys.
- **dcp**: ``.metadata`` through the allowlist unpickler; every tensor covered by its chunks with
  no gap or overlap; every referenced file present and long enough; no two items sharing bytes;
  every chunk archive parsed (dtype, shape, storage) and the zip CRC-32 of every entry in every
  archive checked (``torch.load`` checks none of them); non-tensor entries likewise.
- **hf**: every safetensors header (JSON, dtypes, offsets covering the data exactly, file size),
  the index (every name in the file it names, every tensor of every shard in the index,
  ``total_size``), and a read of every byte. safetensors stores no checksums: a flipped data
  byte cannot be detected from the files alone (compare with ``ckptconv diff`` against the
  source).
- **dcp-safetensors** (DCP's per-rank safetensors, ``HuggingFaceStorageWriter``): every header as
  for hf, every file's ``DCP_SHARDING_INFO`` (an offset per tensor of the right rank), every tensor
  covered by its chunks with no gap or overlap in one dtype, and a read of every chunk's bytes
  (no checksums either).

Checks stream chunk by chunk in bounded slabs, across a thread pool. The result is a
:class:`VerifyReport`; a checkpoint is sound when it has no problems (warnings do not count).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from converter.run.sources import detect_format
from formats.base import ChunkRef
from formats.errors import CkptConvError, UnsafePickleError
from formats.fsutil import read_exact_into, safe_join

#: Bytes read at once when streaming a chunk file (per worker).
SLAB_BYTES = 16 << 20
#: DCP items up to this size are read whole (one read) to check their archives; larger ones are
#: streamed (:func:`formats.dcp.checks.check_archive`).
WHOLE_ITEM_BYTES = 4 << 20
#: Problems listed in the text report before "... and N more".
SHOW_PROBLEMS = 50
HF_NOTE = ("safetensors files carry no checksums: verify checks their structure and reads every byte, "
           "but a flipped data byte cannot be detected from the files alone; compare with "
           "'ckptconv diff' against the source")


@dataclass(frozen=True)
class Problem:
    """One defect: which check found it, a one-line message, and where (key, chunk, file)."""

    check: str
    message: str
    key: str | None = None
    chunk: tuple[int, ...] | None = None  # the chunk's global offsets
    file: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"check": self.check, "message": self.message}
        if self.key is not None:
            doc["key"] = self.key
        if self.chunk is not None:
            doc["chunk"] = list(self.chunk)
        if self.file is not None:
            doc["file"] = self.file
        return doc


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` checked and found. ``ok`` when there are no problems."""

    path: str
    format: str
    checks: tuple[str, ...]
    problems: tuple[Problem, ...]
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    tensors: int = 0
    chunks: int = 0
    objects: int = 0
    files: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    data_checked: bool = True

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (``schemas/verify.schema.json``)."""
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "data_checked": self.data_checked,
            "checks": list(self.checks),
            "counts": {"tensors": self.tensors, "chunks": self.chunks, "objects": self.objects,
                       "files": self.files, "bytes_checked": self.bytes_checked},
            "seconds": round(self.seconds, 3),
            "problems": [p.to_json() for p in self.problems],
            "warnings": list(self.warnings),
            "notes": list(self.notes),
        }


@dataclass
class _Findings:
    """What the checks of one format collect."""

    checks: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    bytes_checked: int = 0
    data_checked: bool = True


# A check task: returns (problems, bytes checked).
_Task = Callable[[], "tuple[list[Problem], int]"]


def verify(path: str | os.PathLike, *, quick: bool = False, trust_pickle: bool = False,
           workers: int | None = None) -> VerifyReport:
    """Check the checkpoint at ``path`` (DCP directory, universal store or HF directory).

    ``quick`` checks structure and completeness only (no data read). ``trust_pickle`` lets
    non-tensor entries that need arbitrary classes be loaded (their pickle code runs). Raises a
    :class:`formats.errors.CkptConvError` only when ``path`` is not a checkpoint at all; defects
    of a checkpoint are reported as :class:`Problem` s.
    """
    from converter import knobs

    start = time.perf_counter()
    fmt = detect_format(path)
    run = {"dcp": _verify_dcp, "universal": _verify_universal, "hf": _verify_hf, "deepspeed": _verify_deepspeed,
           "dcp-safetensors": _verify_dcp_safetensors, "deepspeed-zero": _verify_deepspeed_zero,
           "megatron-legacy": _verify_megatron_legacy}[fmt]
    found = _Findings()
    from formats.storage import is_remote

    if is_remote(path):
        run = _verify_remote
    tasks = run(path if is_remote(path) else Path(path), found, quick, trust_pickle)
    found.bytes_checked += _run_tasks(tasks, found.problems, workers or knobs.WORKERS)
    return VerifyReport(
        path=str(path), format=fmt, checks=tuple(found.checks), problems=tuple(found.problems),
        warnings=tuple(found.warnings), notes=tuple(found.notes),
        tensors=found.counts.get("tensors", 0), chunks=found.counts.get("chunks", 0),
        objects=found.counts.get("objects", 0), files=found.counts.get("files", 0),
        bytes_checked=found.bytes_checked, seconds=time.perf_counter() - start,
        data_checked=found.data_checked and not quick,
    )


def _run_tasks(tasks: Sequence[_Task], problems: list[Problem], workers: int) -> int:
    """Run the check tasks on a pool; problems are appended in task order. Bytes checked."""
    if not tasks:
        return 0
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptconv-verify") as pool:
        results = list(pool.map(lambda t: t(), tasks))
    total = 0
    for found, nbytes in results:
        problems.extend(found)
        total += nbytes
    return total


def _guard(task: Callable[[], int], check: str, key: str | None = None, chunk: ChunkRef | None = None,
           file: str | None = None) -> _Task:
    """A task that turns a CkptConvError raised by ``task`` into one problem."""

    def run() -> tuple[list[Problem], int]:
        try:
            return [], task()
        except CkptConvError as e:
            offsets = None if chunk is None else tuple(chunk.box.offsets)
            return [Problem(check, str(e), key, offsets, file or (chunk.file if chunk else None))], 0

    return run


# ---------------------------------------------------------------------------------------------
# DCP


def _verify_dcp(root: Path, found: _Findings, quick: bool, trust_pickle: bool) -> list[_Task]:
    from formats.dcp import DCPReader

    found.checks += [
        ".metadata unpickled through the allowlist (nothing in it runs)",
        "every tensor covered by its chunks: in bounds, no gaps, no overlaps",
        "every referenced file present and long enough",
        "no two items share bytes of a file",
    ]
    try:
        reader = DCPReader(root, trust_pickle=trust_pickle)
    except CkptConvError as e:
        found.problems.append(Problem("metadata", str(e)))
        return []
    index = reader.index()
    found.counts.update(tensors=len(index.tensors), objects=len(index.objects),
                        chunks=sum(len(t.chunks) for t in index.tensors.values()),
                        files=len(index.info.get("files", {})))
    found.problems += _dcp_overlaps(index)
    found.warnings += _unreferenced(root, set(index.info.get("files", {})), suffix=".distcp")
    if quick:
        return []
    found.checks += [
        "every chunk archive parsed: dtype, shape and storage size match the metadata",
        "zip CRC-32 of every entry of every chunk and object archive (torch.load checks none)",
        "every non-tensor entry loads (weights-only unpickling unless --trust-pickle)",
    ]

    def check_chunk(key: str, entry: Any, chunk: ChunkRef) -> int:
        return reader.check_chunk_archive(key, chunk, WHOLE_ITEM_BYTES)

    def check_object(key: str, obj: Any) -> int:
        return reader.check_object_archive(key, WHOLE_ITEM_BYTES)

    return _entry_tasks(reader, found, trust_pickle, index.tensors, index.objects, check_chunk, check_object,
                        label="chunk")


def _entry_tasks(reader: Any, found: _Findings, trust_pickle: bool, tensors: Mapping[str, Any],
                 objects: Mapping[str, Any], check_chunk: Callable[[str, Any, ChunkRef], int],
                 check_object: Callable[[str, Any], int], label: str = "checksum") -> list[_Task]:
    """One task per chunk of every tensor entry (``check_chunk(key, entry, chunk)``, problems
    filed under ``label``) and per object (``check_object(key, obj)`` on its bytes, then it must
    load: :func:`_object_task`)."""
    tasks = [_guard(lambda key=key, entry=entry, chunk=chunk: check_chunk(key, entry, chunk), label, key, chunk)
             for key, entry in tensors.items() for chunk in entry.chunks]
    tasks += [_object_task(reader, key, obj.file, found, trust_pickle, lambda key=key, obj=obj: check_object(key, obj))
              for key, obj in objects.items()]
    return tasks


def _object_task(reader: Any, key: str, file: str, found: _Findings, trust_pickle: bool,
                 integrity: Callable[[], int]) -> _Task:
    """Check an object's bytes (``integrity``), then that it loads; an object that needs
    --trust-pickle is a warning, not a defect."""

    def check() -> int:
        n = integrity()
        try:
            reader.load_object(key, trust_pickle=trust_pickle)
        except UnsafePickleError:
            found.warnings.append(f"non-tensor entry {key!r} needs --trust-pickle to load (its pickle was "
                                  "not run); its bytes pass their checks")
        return n

    return _guard(check, "object", key, file=file)


def _dcp_overlaps(index: Any) -> list[Problem]:
    """Items whose byte ranges overlap inside one file (a damaged metadata could alias chunks)."""
    from formats.dcp.checks import overlapping_items

    return [Problem("overlap", f"{o.file}: items of key {o.first[2]!r} (bytes {o.first[0]}..{o.first[0] + o.first[1]}) "
                               f"and key {o.second[2]!r} (bytes {o.second[0]}..{o.second[0] + o.second[1]}) overlap; "
                               "the metadata is damaged", o.second[2], file=o.file)
            for o in overlapping_items(index)]


def _unreferenced(root: Path, referenced: set[str], suffix: str) -> list[str]:
    names = sorted(n for n in os.listdir(root) if n.endswith(suffix) and n not in referenced)
    return [f"{n}: not referenced by the checkpoint's metadata (left over from another save?)" for n in names]


# ---------------------------------------------------------------------------------------------
# universal


def _verify_universal(root: Path, found: _Findings, quick: bool, trust_pickle: bool) -> list[_Task]:
    from formats.universal import TENSORS_DIR, UniversalReader

    found.checks += [
        "ckptconv.json valid against schemas/universal.schema.json (the completion marker)",
        "every record consistent: dtype, storage dtype, chunk shape, array path inside the store",
        "one checksum per chunk of every array (complete)",
    ]
    try:
        reader = UniversalReader(root)
        meta, index = reader.meta, reader.index()
    except CkptConvError as e:
        found.problems.append(Problem("metadata", str(e)))
        return []
    zarr = meta.backend == "zarr"
    found.checks += ["group and array zarr.json files match the records" if zarr else
                     "every tensor's first safetensors chunk file: the header its record implies",
                     "atoms name existing keys"]
    found.counts.update(tensors=len(meta.tensors), objects=len(meta.objects),
                        chunks=sum(len(t.chunks) for t in index.tensors.values()))
    if zarr:
        for group in (root, root / TENSORS_DIR):
            found.problems += _check_group_json(root, group)
        for key, record in meta.tensors.items():
            found.problems += _check_array_json(root, key, record)
    else:
        for key, entry in index.tensors.items():
            found.problems += _check_st_header(root, key, meta.tensors[key], entry.chunks[:1])
    found.problems += _check_atoms(meta)
    found.warnings += _strays(root, meta, index)
    if quick:
        return []
    found.checks += [
        "every chunk file whole, its xxh3_64 equal to the recorded checksum, "
        + ("edge padding zero" if zarr else "its safetensors header the one its record implies"),
        "every object file's size and xxh3_64; every object loads (weights-only unless --trust-pickle)",
    ]
    tasks = _entry_tasks(reader, found, trust_pickle, index.tensors, meta.objects,
                         lambda key, entry, chunk: _check_uchunk(root, key, meta.tensors[key], chunk),
                         lambda key, obj: len(reader.read_object_bytes(key)))
    found.counts["files"] = len(tasks) + (3 + len(meta.tensors) if zarr else 1)
    return tasks


def _strays(root: Path, meta: Any, index: Any) -> list[str]:
    """Files the store's metadata does not account for (left over from an interrupted write?)."""
    from converter.run.destination import OUTPUT_RECORD
    from formats.universal import METADATA_FILE, TENSORS_DIR

    known = {METADATA_FILE, OUTPUT_RECORD}  # the record names the conversion that wrote the store
    if meta.backend == "zarr":
        known |= {"zarr.json", f"{TENSORS_DIR}/zarr.json"} | {f"{r.array}/zarr.json" for r in meta.tensors.values()}
    known |= {c.file for e in index.tensors.values() for c in e.chunks}
    known |= {o.file for o in meta.objects.values()}
    strays = sorted(rel for rel in (os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root)
                                    for n in names) if Path(rel).as_posix() not in known)
    if not strays:
        return []
    shown = ", ".join(strays[:10]) + (f" and {len(strays) - 10} more" if len(strays) > 10 else "")
    return [f"{len(strays)} file(s) not part of the store (left over from an interrupted write?): {shown}"]


def _read_json(path: Path) -> Any:
    from formats.errors import CorruptCheckpointError
    from formats.fsutil import loads_json, read_error

    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        raise CorruptCheckpointError(f"{path}: missing ({e.strerror}); the store is damaged: reconvert it") from None
    except OSError as e:  # a symlink loop, a name too long
        raise read_error(path, e) from None
    return loads_json(raw, str(path), fix="the store is damaged: reconvert it")


def _check_group_json(root: Path, group: Path) -> list[Problem]:
    rel = (group / "zarr.json").relative_to(root).as_posix()
    try:
        doc = _read_json(group / "zarr.json")
    except CkptConvError as e:
        return [Problem("zarr", str(e), file=rel)]
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        return [Problem("zarr", f"{group / 'zarr.json'}: not a zarr v3 group document", file=rel)]
    return []


def _check_array_json(root: Path, key: str, record: Any) -> list[Problem]:
    """The array's zarr.json must be what ckptconv writes for the record (extra attributes allowed)."""
    from formats.universal import backend_module

    rel = f"{record.array}/zarr.json"
    try:
        path = safe_join(root, rel)
        doc = _read_json(path)
        expected = backend_module("zarr").array_json(record, key)
    except CkptConvError as e:
        return [Problem("zarr", str(e), key, file=rel)]
    if not isinstance(doc, dict):
        return [Problem("zarr", f"{path}: not a JSON object", key, file=rel)]
    attrs = doc.get("attributes")
    got = {**doc, "attributes": expected["attributes"]}
    if got != expected or not isinstance(attrs, dict) or any(attrs.get(k) != v for k, v in expected["attributes"].items()):
        diff = sorted(k for k in expected if doc.get(k) != expected[k])
        return [Problem("zarr", f"{path}: does not match ckptconv.json for key {key!r} (fields {diff}); "
                                "the store is damaged: reconvert it", key, file=rel)]
    return []


def _check_st_header(root: Path, key: str, record: Any, chunks: Any) -> list[Problem]:
    """Each of ``chunks``' safetensors files must start with the header its record implies."""
    from formats.universal import backend_module

    layout = backend_module("safetensors")
    for chunk in chunks:
        try:
            path = safe_join(root, chunk.file)
            with open(path, "rb") as f:
                expected = layout.file_prefix(record, chunk.box)
                got = f.read(len(expected))
        except OSError as e:
            return [Problem("safetensors", f"{root / chunk.file}: cannot read ({e.strerror}); the store is damaged: "
                                           "reconvert it", key, file=chunk.file)]
        if got != expected:
            return [Problem("safetensors", f"{root / chunk.file}: header does not match ckptconv.json for key {key!r}; "
                                           "the store is damaged: reconvert it", key, file=chunk.file)]
    return []


def _check_atoms(meta: Any) -> list[Problem]:
    problems = []
    keys = set(meta.tensors) | set(meta.objects)
    for name, members in meta.atoms.items():
        for role, key in members.items():
            if key not in keys:
                problems.append(Problem("atoms", f"ckptconv.json: atom {name!r} role {role!r} names key {key!r}, "
                                                 "which the store does not hold", key))
    for key, r in [*meta.tensors.items(), *meta.objects.items()]:
        if meta.atoms.get(r.atom, {}).get(r.role) != key:
            problems.append(Problem("atoms", f"ckptconv.json: key {key!r} says it is {r.role!r} of atom {r.atom!r}, "
                                             "but the atom does not list it", key))
    return problems


def _check_uchunk(root: Path, key: str, record: Any, chunk: ChunkRef) -> int:
    """Stream one chunk file: size, xxh3_64 of its logical bytes, zero padding. Bytes read."""
    from formats.errors import CorruptCheckpointError
    from formats.universal import backend_module, chunk_name

    path = safe_join(root, chunk.file)
    isz = np.dtype(record.storage_dtype).itemsize
    layout = backend_module("safetensors" if record.tensor is not None else "zarr")
    prefix = layout.file_prefix(record, chunk.box)
    cshape, sizes = tuple(layout.stored_shape(record, chunk.box)), tuple(chunk.box.sizes)
    full = layout.file_size(record, chunk.box)
    where = f"{path}: key {key!r} chunk {chunk_name(chunk)}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CorruptCheckpointError(f"{where}: chunk file is missing ({e.strerror}); the store is damaged: "
                                     "reconvert it") from None
    if not os.path.isfile(path):
        os.close(fd)
        raise CorruptCheckpointError(f"{where}: not a file; the store is damaged: reconvert it")
    try:
        size = os.fstat(fd).st_size
        if size != full:
            raise CorruptCheckpointError(f"{where}: chunk file has {size} bytes, expected {full}; "
                                         "the store is damaged: reconvert it")
        if prefix and (read_exact_into(fd, memoryview(head := bytearray(len(prefix))), 0) != len(prefix)
                       or bytes(head) != prefix):
            raise CorruptCheckpointError(f"{where}: the safetensors header does not match ckptconv.json; "
                                         "the store is damaged: reconvert it")
        hasher, padding_ok = xxhash.xxh3_64(), True
        for slab, sel in _slabs(fd, cshape, sizes, isz, where, len(prefix)):
            hasher.update(memoryview(np.ascontiguousarray(slab[sel])).cast("B"))
            if sel is not None and padding_ok and cshape != sizes:
                rest = slab.copy()
                rest[sel] = 0
                padding_ok = not rest.any()
    finally:
        os.close(fd)
    expected = record.checksums.get(chunk_name(chunk), "")
    if hasher.hexdigest() != expected:
        raise CorruptCheckpointError(f"{where}: xxh3_64 {hasher.hexdigest()} != recorded {expected}; "
                                     "the chunk's bytes are damaged")
    if not padding_ok:
        raise CorruptCheckpointError(f"{where}: the padding past the tensor's edge is not zero; the chunk file is damaged")
    return full


def _slabs(fd: int, cshape: tuple[int, ...], sizes: tuple[int, ...], isz: int, where: str,
           start: int = 0) -> Iterable[tuple[np.ndarray, Any]]:
    """(slab of whole chunk rows viewed as (rows, *cshape[1:], itemsize) bytes, selection of its
    logical part) in file order; the rows start at byte ``start`` of the file."""
    from formats.errors import CorruptCheckpointError

    rows = cshape[0] if cshape else 1
    row = math.prod(cshape[1:]) * isz
    step = max(1, SLAB_BYTES // max(1, row))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        buf = np.empty((r1 - r0) * row, dtype=np.uint8)
        if read_exact_into(fd, memoryview(buf), start + r0 * row) != buf.size:
            raise CorruptCheckpointError(f"{where}: chunk file shrank while reading")
        if not cshape:
            yield buf, slice(None)
            continue
        slab = buf.reshape((r1 - r0, *cshape[1:], isz))
        live = max(0, min(r1, sizes[0]) - r0)
        yield slab, (slice(0, live), *(slice(0, s) for s in sizes[1:]), slice(None))


# ---------------------------------------------------------------------------------------------
# HF


def _open_safetensors(cls: Any, root: Path, found: _Findings, checks: list[str]) -> Any:
    """``cls(root)`` (an HF or DCP-safetensors reader, which validates every header on open) with
    its checks listed; None (and the problem filed) when it refuses the checkpoint."""
    found.checks += ["every safetensors header: JSON, known dtypes, sizes matching shapes, offsets covering "
                     "the data exactly", *checks]
    found.notes.append(HF_NOTE)
    found.data_checked = False
    try:
        return cls(root)
    except CkptConvError as e:
        found.problems.append(Problem("header", str(e)))
        return None


def _verify_hf(root: Path, found: _Findings, quick: bool, trust_pickle: bool) -> list[_Task]:
    from formats.hf import INDEX_FILE, HFReader, read_header

    reader = _open_safetensors(HFReader, root, found, ["the index: every name stored in the file it names"])
    if reader is None:
        return []
    index = reader.index()
    files = [f for f in index.info.get("files", {}) if f != INDEX_FILE]
    found.counts.update(tensors=len(index.tensors), chunks=len(index.tensors), files=len(index.info.get("files", {})))
    if index.info.get("sharded"):
        found.checks += ["the index: every tensor of every shard listed, metadata.total_size"]
        for f in files:
            header = read_header(safe_join(root, f), f)
            for name in header.tensors:
                if name not in index.tensors or index.tensors[name].chunks[0].file != f:
                    found.problems.append(Problem("index", f"{root / f}: tensor {name!r} is not mapped to this file "
                                                           f"by {INDEX_FILE}; the index and the shards do not match",
                                                  name, file=f))
        total = index.info.get("index_metadata", {}).get("total_size")
        nbytes = sum(t.nbytes for t in index.tensors.values())
        if total is not None and total != nbytes:
            found.warnings.append(f"{INDEX_FILE}: metadata.total_size is {total} but the tensors hold {nbytes} bytes")
    found.warnings += _unreferenced(root, set(files), suffix=".safetensors")
    for f, meta in sorted(index.info.get("file_metadata", {}).items()):
        if meta is None or meta.get("format") != "pt":
            found.warnings.append(f"{f}: __metadata__ has no \"format\": \"pt\" (transformers expects it)")
    if quick:
        return []
    found.checks += ["every tensor's bytes read (unreadable or vanished data is found; flipped bytes are not)"]
    return [_guard(lambda key=key, e=e: _read_chunk(reader, key, e, e.chunks[0]), "read", key, e.chunks[0])
            for key, e in index.tensors.items()]


def _verify_dcp_safetensors(root: Path, found: _Findings, quick: bool, trust_pickle: bool) -> list[_Task]:
    from formats.dcp_safetensors import DCPSafetensorsReader

    reader = _open_safetensors(DCPSafetensorsReader, root, found, [
        "every file's DCP_SHARDING_INFO: saved offsets for each of its tensors, of the tensor's rank",
        "every tensor covered by its chunks: one dtype, no gaps, no overlaps (shape as torch's reader infers it)",
    ])
    if reader is None:
        return []
    index = reader.index()
    found.counts.update(tensors=len(index.tensors), chunks=sum(len(t.chunks) for t in index.tensors.values()),
                        files=len(index.info.get("files", {})))
    if quick:
        return []
    found.checks += ["every chunk's bytes read (unreadable or vanished data is found; flipped bytes are not)"]
    return [_guard(lambda key=key, e=e, c=c: _read_chunk(reader, key, e, c), "read", key, c)
            for key, e in index.tensors.items() for c in e.chunks]


def _verify_remote(url: str, found: _Findings, quick: bool, trust_pickle: bool) -> list[_Task]:
    """A checkpoint behind a URL, through its reader (ranged reads, nothing downloaded whole):
    opening validates the metadata, every referenced file and its size; then every universal
    chunk's xxh3_64, every DCP chunk's zip CRC-32, every HF tensor read, every object loaded."""
    from converter.run.sources import open_checkpoint

    found.checks += ["metadata valid; every referenced file present and long enough (the reader's open checks)"]
    try:
        reader = open_checkpoint(url, trust_pickle=trust_pickle)
        index = reader.index()
    except CkptConvError as e:
        found.problems.append(Problem("metadata", str(e)))
        return []
    found.counts.update(tensors=len(index.tensors), objects=len(index.objects),
                        chunks=sum(len(t.chunks) for t in index.tensors.values()))
    if quick:
        return []
    found.checks += ["every chunk's checksum (universal: xxh3_64, DCP: zip CRC-32) or full read (HF)",
                     "every object loads (weights-only unless --trust-pickle)"]
    return _entry_tasks(reader, found, trust_pickle, index.tensors, index.objects,
                        lambda key, entry, chunk: _remote_chunk(reader, key, entry, chunk),
                        lambda key, obj: len(reader.read_object_bytes(key)))


def _remote_chunk(reader: Any, key: str, entry: Any, chunk: ChunkRef) -> int:
    from formats.dcp import DCPReader
    from formats.errors import CorruptCheckpointError
    from formats.universal import UniversalReader

    if isinstance(reader, UniversalReader):
        expected, actual = reader.chunk_checksum(key, chunk)
        if expected != actual:
            raise CorruptCheckpointError(f"{reader.root}/{chunk.file}: key {key!r} checksum mismatch "
                                         f"({actual} != {expected}); the store is damaged: reconvert it")
        return chunk.box.numel * entry.nbytes // max(1, math.prod(entry.shape) or 1)
    if isinstance(reader, DCPReader):
        reader.verify_chunk_crc(key, chunk)
        return chunk.box.numel * entry.nbytes // max(1, math.prod(entry.shape) or 1)
    return _read_chunk(reader, key, entry, chunk)


def _verify_deepspeed(root: Path, found: _Findings, quick: bool, trust_pickle: bool) -> list[_Task]:
    """A DeepSpeed universal checkpoint: every atom parsed (allowlisted pickle, shapes against
    param_shapes), then (not quick) every atom's bytes read against its zip CRC-32."""
    from formats.deepspeed import DeepSpeedReader

    found.checks += [
        "zero/optimizer_state.pt and the model-states file: allowlisted pickles (DeepSpeed's classes as data)",
        "every zero/<param>/<state>.pt: a torch.save zip whose tensor matches the parameter's shape",
    ]
    try:
        reader = DeepSpeedReader(root, verify=not quick)
    except CkptConvError as e:
        found.problems.append(Problem("structure", str(e)))
        return []
    index = reader.index()
    files = {c.file for e in index.tensors.values() for c in e.chunks}
    found.counts.update(tensors=len(index.tensors), chunks=len(index.tensors), objects=len(index.objects),
                        files=len(files))
    if quick:
        return []
    found.checks += ["every atom's bytes read and checked against its zip CRC-32"]
    return [_guard(lambda key=key, e=e: _read_chunk(reader, key, e, e.chunks[0]), "crc", key, e.chunks[0])
            for key, e in index.tensors.items()]


def _verify_deepspeed_zero(root: Path, found: _Findings, quick: bool, trust_pickle: bool) -> list[_Task]:
    """A DeepSpeed ``save_checkpoint`` folder: every file parsed (allowlisted pickles), every
    parameter laid out in the partitions, then (not quick) every storage against its CRC-32."""
    from formats.deepspeed_zero import DeepSpeedZeroReader

    found.checks += [
        "every *_model_states.pt / *_optim_states.pt: a torch.save zip with an allowlisted pickle (DeepSpeed's "
        "classes as data)",
        "the flat partitions of every rank hold every parameter param_shapes lists (sizes, paddings, rank count)",
    ]
    try:
        reader = DeepSpeedZeroReader(root)
    except CkptConvError as e:
        found.problems.append(Problem("structure", str(e)))
        return []
    index = reader.index()
    found.counts.update(tensors=len(index.tensors), chunks=sum(len(e.chunks) for e in index.tensors.values()),
                        objects=len(index.objects), files=len(set(reader.storages)))
    found.notes += [f"left out (not plain data): {x}" for x in index.info.get("left_out", [])]
    if quick:
        return []
    found.checks += ["every tensor storage read and checked against its zip CRC-32"]
    tasks = [_guard(lambda n=n: reader.check_storage(n), "crc", file=file) for n, file in enumerate(reader.storages)]
    if reader.replicated_keys:
        found.checks += ["every tensor stored more than once (TP-replicated on each TP rank, a TiedLayerSpec parameter on "
                         "each pipeline stage holding it): each copy equal to the one read, bit for bit"]
        tasks += [_guard(lambda key=key: reader.check_replicas(key), "replica", key) for key in reader.replicated_keys]
    return tasks


def _verify_megatron_legacy(root: Path, found: _Findings, quick: bool, trust_pickle: bool) -> list[_Task]:
    """A Megatron-LM legacy checkpoint: every rank file parsed (allowlisted pickle), every tensor
    covered by the rank folders' shards (TP, PP, experts) and the optimizer buffers matching the
    model's; then (not quick) every record of every file against its zip CRC-32 and every
    non-tensor entry through the allowlist."""
    from formats.megatron.legacy import LegacyReader
    from formats.objects import check_object_bytes

    found.checks += [
        "every model_optim_rng.pt / distrib_optim.pt: a torch.save zip whose data.pkl unpickles through the allowlist",
        "every tensor covered by the rank folders' shards; distrib_optim.pt buffers match megatron's buffer layout",
    ]
    try:
        reader = LegacyReader(root, trust_pickle=trust_pickle)
    except CkptConvError as e:
        found.problems.append(Problem("structure", str(e)))
        return []
    index = reader.index()
    files = index.info["files"]
    found.counts.update(tensors=len(index.tensors), chunks=sum(len(e.chunks) for e in index.tensors.values()),
                        objects=len(index.objects), files=len(files))
    if quick:
        return []
    found.checks += ["every record of every file read and checked against its zip CRC-32",
                     "every non-tensor entry's globals against the allowlist"]
    tasks = [_guard(lambda rel=rel: reader.check_file(rel), "crc", file=rel) for rel in files]

    def check_object(key: str) -> int:
        data = reader.read_object_bytes(key)
        check_object_bytes(data, f"{root}: key {key!r}", trust_pickle)
        return len(data)

    return tasks + [_guard(lambda key=key: check_object(key), "object", key) for key in index.objects]


def _read_chunk(reader: Any, key: str, entry: Any, chunk: ChunkRef) -> int:
    """Read one chunk in bounded slabs (row blocks) into a reused buffer, no torch. Bytes read."""
    from converter.plan.copy_tasks import split_pieces
    from formats.dtypes import by_name

    itemsize = by_name(entry.dtype).itemsize
    buf = bytearray(min(SLAB_BYTES, chunk.box.numel * itemsize) or 1)
    total = 0
    for piece in split_pieces(chunk.box, itemsize, SLAB_BYTES):
        n = piece.numel * itemsize
        if len(buf) < n:
            buf = bytearray(n)
        reader.read_region_into(key, chunk, piece, memoryview(buf)[:n])
        total += n
    return total


# ---------------------------------------------------------------------------------------------
# text rendering


def render_text(report: VerifyReport) -> str:
    """The human report: a verdict line, then problems, warnings and notes."""
    from converter.units import human_bytes, plural

    what = (f"{plural(report.tensors, 'tensor')}, {plural(report.chunks, 'chunk')}, {plural(report.objects, 'object')}, "
            f"{human_bytes(report.bytes_checked)} checked in {report.seconds:.2f}s")
    verdict = "ok" if report.ok else f"FAILED ({plural(len(report.problems), 'problem')})"
    lines = [f"{verdict}: {report.path} ({report.format}): {what}"]
    for p in report.problems[:SHOW_PROBLEMS]:
        lines.append(f"  problem [{p.check}]: {p.message}")
    if len(report.problems) > SHOW_PROBLEMS:
        lines.append(f"  ... and {len(report.problems) - SHOW_PROBLEMS} more (use --json for all)")
    lines += [f"  warning: {w}" for w in report.warnings]
    lines += [f"  note: {n}" for n in report.notes]
    if not report.data_checked and report.format not in ("hf", "dcp-safetensors"):
        lines.append("  note: --quick: structure only, no data read")
    return "\n".join(lines)
