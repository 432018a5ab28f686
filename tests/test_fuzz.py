"""Property-based fuzzing of every reader and converter with hypothesis.

Each target mutates one part of a small real checkpoint (made here with ``dcp.save``, then
``to_universal`` and ``export_hf`` of it): DCP ``.metadata`` (raw bytes, and structured edits of
chunk boxes, sizes, dtypes and ``storage_data`` offsets/lengths/paths/transforms), ``.distcp``
bytes, the universal store's ``ckptconv.json``, ``zarr.json`` files and chunk/object files,
safetensors headers and ``model.safetensors.index.json``. Every case then runs ``verify``, reads
every region and object, and converts into a fresh destination (to-universal, from-universal or
import-hf), and must end in success or in ckptconv's own error type with a one-line message:
no other exception, no hang (a per-case timer), and no file written or changed outside the
destination (the whole case directory, source included, is hashed before and after).

The default suite runs 100 cases per target (derandomized, so reruns are stable); the
``slow``-marked run 1,000 random ones per target.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import shutil
import signal
import struct
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from converter.api import export_hf, from_universal, import_hf, to_universal, verify
from converter.config import RunOptions
from converter.sources import open_checkpoint
from formats.errors import CkptConvError, UnsafePickleError
from schemas import validation_errors

CASE_SECONDS = 20
QUICK = settings(max_examples=100, deadline=None, database=None, derandomize=True, print_blob=True,
                 suppress_health_check=list(HealthCheck))
LONG = settings(QUICK, max_examples=1000, derandomize=False)
OPTIONS = RunOptions(workers=2, memory_budget=8 << 20)
OUTCOMES: Counter = Counter()


class Hang(BaseException):
    """Raised by the per-case timer (a BaseException so no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    def fire(signum, frame):
        raise Hang(f"case ran over {seconds}s (hang?)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------------------------
# base checkpoints and working copies


def state_dict() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(6, 5, generator=g), "bf": torch.randn(4, 3, generator=g).to(torch.bfloat16),
                  "i": torch.arange(6, dtype=torch.int64).view(2, 3), "s": torch.tensor(1.5)},
        "optim": {"state": {"w": {"exp_avg": torch.randn(6, 5, generator=g), "step": torch.tensor(2.0)}}},
        "extra": {"step": 3, "name": "run"},
    }


def _stats(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int, int]]:
    """(size, mtime_ns, inode) of every file under ``root`` (except under ``skip``)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if skip is not None:
            dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) != str(skip)]
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = os.path.join(dirpath, name)
            st_ = os.lstat(full)
            out[os.path.relpath(full, root)] = (st_.st_size, st_.st_mtime_ns, st_.st_ino)
    return out


class Case:
    """A writable copy of a base checkpoint (``root/src``) and a destination (``root/dst``)."""

    def __init__(self, base: Path, root: Path) -> None:
        self.base, self.root = base, root
        self.src, self.dst = root / "src", root / "dst"
        shutil.copytree(base, self.src)
        self.pristine = _stats(self.src)

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        """Every file next to and under the case root except the destination (any write to a
        file changes its size or mtime)."""
        return _stats(self.root.parent, skip=self.dst)

    def reset(self) -> None:
        """Put the source back exactly as the base, remove the destination."""
        shutil.rmtree(self.dst, ignore_errors=True)
        now = _stats(self.src)
        for rel in set(now) | set(self.pristine):
            if now.get(rel) == self.pristine.get(rel):
                continue
            path = self.src / rel
            if rel not in self.pristine:
                path.unlink()
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes((self.base / rel).read_bytes())
        self.pristine = _stats(self.src)
        for p in self.root.parent.iterdir():
            if p != self.root:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz-base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state_dict(), checkpoint_id=base / "dcp")
    to_universal(base / "dcp", base / "universal", chunk_bytes=48)
    export_hf(base / "dcp", base / "hf", max_shard_size=100)
    assert (base / "hf" / "model.safetensors.index.json").is_file()
    work = tmp_path_factory.mktemp("fuzz-work")
    out = {fmt: Case(base / fmt, work / fmt / "case") for fmt in ("dcp", "universal", "hf")}
    yield out
    if OUTCOMES:
        print("\nfuzz outcomes:", dict(sorted(OUTCOMES.items())))


@pytest.fixture(scope="module", autouse=True)
def no_fsync():
    """fsync makes each conversion ~10x slower here and is not what is under test."""
    mp = pytest.MonkeyPatch()
    mp.setattr(os, "fsync", lambda fd: None)
    mp.setattr(os, "fdatasync", lambda fd: None)
    yield
    mp.undo()


# ---------------------------------------------------------------------------------------------
# what every case runs


def read_everything(path: Path) -> None:
    reader = open_checkpoint(path)
    try:
        index = reader.index()
        for key, entry in index.tensors.items():
            for chunk in entry.chunks:
                reader.read_region(key, chunk, chunk.box)
        for key in index.objects:
            reader.read_object_bytes(key)
            reader.load_object(key)
    finally:
        reader.close()


def check_verify(path: Path) -> bool:
    report = verify(path, workers=2)
    assert validation_errors("verify", report.to_json()) == []
    return report.ok


CONVERT: dict[str, Callable[[Path, Path], object]] = {
    "dcp": lambda s, d: to_universal(s, d, OPTIONS, chunk_bytes=64),
    "universal": lambda s, d: from_universal(s, d, "dp2", options=OPTIONS),
    "hf": lambda s, d: import_hf(s, d, options=OPTIONS),
}


def run_case(target: str, case: Case, mutate: Callable[[Path], None]) -> None:
    fmt = case.base.name
    try:
        mutate(case.src)
        before = case.snapshot()
        steps = [("verify", check_verify), ("read", read_everything), ("convert", lambda p: CONVERT[fmt](p, case.dst))]
        sound = False
        for name, step in steps:
            try:
                with time_limit(CASE_SECONDS):
                    result = step(case.src)
                sound = sound or (name == "verify" and result)
                OUTCOMES[f"{target}/{name}/ok"] += 1
            except CkptConvError as e:
                msg = str(e)
                assert msg and "\n" not in msg, f"{name}: error message is not one line: {msg!r}"
                OUTCOMES[f"{target}/{name}/{type(e).__name__}"] += 1
                # what verify passes must read and convert (objects needing --trust-pickle aside)
                assert not sound or isinstance(e, UnsafePickleError), f"verify passed, then {name} failed: {msg}"
        assert case.snapshot() == before, "a file outside the destination was written or changed"
    finally:
        case.reset()


# ---------------------------------------------------------------------------------------------
# mutations

BAD_PATHS = ["../x", "../../etc/passwd", "/etc/passwd", "a/../../b", "x\x00y", "\x01", "", ".", "..",
             "__0_0.distcp/..", "tensors/../../x", "objects/../../y", "model.safetensors/../z", "//"]
BAD_INTS = [0, 1, -1, 2, 7, 255, 256, 2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30]

json_leaves = (st.none() | st.booleans() | st.sampled_from(BAD_INTS) | st.integers(-10, 100)
               | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(BAD_PATHS)
               | st.sampled_from(["float32", "bfloat16", "int64", "F32", "BF16", "I64", "uint16", "c", "0.0", "0"])
               | st.text(max_size=6))
json_values = st.recursive(json_leaves, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                           max_leaves=5)


def mutate_bytes(draw, data: bytes, lo: int = 0, hi: int | None = None) -> bytes:
    """One to three byte-level edits, positioned in ``[lo, hi)``."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        top = min(len(out), hi if hi is not None else len(out))
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "append", "zero", "copy"]))
        if top <= lo or kind == "append":
            out += draw(st.binary(min_size=1, max_size=16))
            continue
        pos = draw(st.integers(lo, top - 1))
        n = draw(st.integers(1, 16))
        if kind == "flip":
            out[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            out[pos] = draw(st.integers(0, 255))
        elif kind == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del out[pos:pos + n]
        elif kind == "truncate":
            del out[pos:]
        elif kind == "zero":
            out[pos:pos + n] = bytes(len(out[pos:pos + n]))
        else:
            src = draw(st.integers(0, len(out) - 1))
            out[pos:pos + n] = out[src:src + n]
    return bytes(out)


def mutate_json(draw, doc):
    """Replace, tweak, delete or add one node somewhere in a JSON document."""
    doc = copy.deepcopy(doc)
    parent, key, node = None, None, doc
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 4)) > 0:
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        parent, node = node, node[key]
    action = draw(st.sampled_from(["replace", "tweak", "delete", "add"]))
    if action == "add" and isinstance(node, dict):
        node[draw(st.text(max_size=6))] = draw(json_values)
        return doc
    if action == "add" and isinstance(node, list):
        node.insert(draw(st.integers(0, len(node))), draw(json_values) if not node else copy.deepcopy(node[0]))
        return doc
    if parent is None:
        return draw(json_values)
    if action == "delete":
        del parent[key]
    elif action == "tweak" and isinstance(node, bool):
        parent[key] = not node
    elif action == "tweak" and isinstance(node, int):
        parent[key] = node + draw(st.sampled_from([-1, 1, -node - 1, node, 2**40]))
    elif action == "tweak" and isinstance(node, str):
        parent[key] = node + draw(st.sampled_from(["", "x", "/..", "0"])) if node else "x"
    else:
        parent[key] = draw(json_values)
    return doc


def pick_file(draw, root: Path, pattern: str) -> Path:
    files = sorted(p for p in root.rglob(pattern) if p.is_file())
    return draw(st.sampled_from(files))


def dcp_metadata_bytes(draw, src: Path) -> None:
    path = src / ".metadata"
    path.write_bytes(mutate_bytes(draw, path.read_bytes()))


def dcp_metadata_structured(draw, src: Path) -> None:
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       TensorStorageMetadata)

    path = src / ".metadata"
    md = pickle.loads(path.read_bytes())  # our own file: trusted
    tensors = sorted(k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    key = draw(st.sampled_from(sorted(md.state_dict_metadata)))
    entry = md.state_dict_metadata[key]
    kind = draw(st.sampled_from(["chunk", "chunk", "size", "grow", "dtype", "drop_chunk", "dup_chunk", "swap_kind",
                                 "storage", "storage", "storage_path", "transforms", "drop_storage", "planner"]))
    ints = st.sampled_from(BAD_INTS) | st.integers(-2, 8)
    if kind in ("chunk", "size", "grow", "drop_chunk", "dup_chunk", "dtype"):
        key = draw(st.sampled_from(tensors))
        entry = md.state_dict_metadata[key]
    if kind == "grow" and entry.size:  # size and its one chunk grown together: coverage still holds
        d, big = draw(st.integers(0, len(entry.size) - 1)), draw(st.sampled_from([10**6, 10**9, 10**13, 2**40]))
        entry.size = torch.Size([big if i == d else s for i, s in enumerate(entry.size)])
        chunk = entry.chunks[0]
        chunk.sizes = torch.Size([big if i == d else s for i, s in enumerate(chunk.sizes)])
    elif kind == "chunk":
        chunk = draw(st.sampled_from(entry.chunks))
        name = draw(st.sampled_from(["offsets", "sizes"]))
        dims = list(getattr(chunk, name))
        if dims and draw(st.booleans()):
            dims[draw(st.integers(0, len(dims) - 1))] = draw(ints)
        else:
            dims.append(draw(ints)) if draw(st.booleans()) or not dims else dims.pop()
        object.__setattr__(chunk, name, torch.Size(dims) if all(d >= 0 for d in dims) else tuple(dims))
    elif kind == "size":
        dims = list(entry.size)
        if dims:
            dims[draw(st.integers(0, len(dims) - 1))] = draw(ints.filter(lambda v: v >= 0))
        else:
            dims.append(draw(ints.filter(lambda v: v >= 0)))
        entry.size = torch.Size(dims)
    elif kind == "dtype":
        entry.properties.dtype = draw(st.sampled_from([torch.float16, torch.int8, torch.bool, torch.complex64,
                                                       torch.float8_e5m2, torch.float64, torch.qint8, torch.uint32]))
    elif kind == "drop_chunk" and entry.chunks:
        entry.chunks.pop(draw(st.integers(0, len(entry.chunks) - 1)))
    elif kind == "dup_chunk" and entry.chunks:
        c = draw(st.sampled_from(entry.chunks))
        entry.chunks.append(ChunkStorageMetadata(offsets=c.offsets, sizes=c.sizes))
    elif kind == "swap_kind":
        md.state_dict_metadata[key] = (BytesStorageMetadata() if isinstance(entry, TensorStorageMetadata)
                                       else md.state_dict_metadata[tensors[0]])
    elif kind in ("storage", "storage_path", "transforms", "drop_storage"):
        index = draw(st.sampled_from(sorted(md.storage_data, key=repr)))
        info = md.storage_data[index]
        if kind == "storage":
            setattr(info, draw(st.sampled_from(["offset", "length"])), draw(ints))
        elif kind == "storage_path":
            info.relative_path = draw(st.sampled_from(BAD_PATHS + ["__0_0.distcp", "__1_0.distcp", ".metadata"]))
        elif kind == "transforms":
            info.transform_descriptors = draw(st.lists(st.sampled_from(["stream.zstd/1", "stream.zstd/2", "bogus", ""]),
                                                       max_size=2))
        else:
            del md.storage_data[index]
    else:
        md.planner_data[key] = draw(st.sampled_from([(), ("a",), (1, 2), ("model", "../x"), None, "x"]))
    path.write_bytes(pickle.dumps(md))


def distcp_bytes(draw, src: Path) -> None:
    path = pick_file(draw, src, "*.distcp")
    path.write_bytes(mutate_bytes(draw, path.read_bytes()))


def universal_metadata(draw, src: Path) -> None:
    path = src / "ckptconv.json"
    how = draw(st.sampled_from(["bytes", "json", "json", "grow", "array"]))
    if how == "bytes":
        path.write_bytes(mutate_bytes(draw, path.read_bytes()))
        return
    doc = json.loads(path.read_text())
    if how == "json":
        doc = mutate_json(draw, doc)
    else:
        rec = doc["tensors"][draw(st.sampled_from(sorted(doc["tensors"])))]
        if how == "array":  # where the array lives: paths that leave the store
            rec["array"] = draw(st.sampled_from(BAD_PATHS + ["tensors", "objects", "tensors/zarr.json"]))
        elif rec["shape"]:  # shape and chunk shape grown together: the chunk grid keeps its size
            d, big = draw(st.integers(0, len(rec["shape"]) - 1)), draw(st.sampled_from([10**6, 10**9, 10**13, 2**40]))
            rec["shape"][d] = big
            rec["chunk_shape"][d] = big
    path.write_text(json.dumps(doc))


def zarr_json(draw, src: Path) -> None:
    path = pick_file(draw, src, "zarr.json")
    if draw(st.booleans()):
        path.write_bytes(mutate_bytes(draw, path.read_bytes()))
    else:
        path.write_text(json.dumps(mutate_json(draw, json.loads(path.read_text()))))


def universal_data(draw, src: Path) -> None:
    rels = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    files = [src / r for r in rels if "/c/" in r or r.endswith("/c") or r.startswith("objects/")]
    path = draw(st.sampled_from(files))
    if draw(st.integers(0, 9)) == 0:
        path.unlink()
    else:
        path.write_bytes(mutate_bytes(draw, path.read_bytes()))


def safetensors_header(draw, src: Path) -> None:
    path = pick_file(draw, src, "*.safetensors")
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    how = draw(st.sampled_from(["json", "json", "bytes", "length"]))
    if how == "json":
        header = json.dumps(mutate_json(draw, json.loads(raw[8:8 + n])), separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8 if draw(st.booleans()) else 0)
        path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])
    elif how == "bytes":
        path.write_bytes(mutate_bytes(draw, raw, 0, 8 + n))
    else:
        value = draw(st.sampled_from([0, 1, 7, n - 1, n + 1, n + 8, len(raw), 2**31, 10**8, 10**8 + 1, 2**64 - 1]))
        path.write_bytes(struct.pack("<Q", value) + raw[8:])


def hf_index(draw, src: Path) -> None:
    path = src / "model.safetensors.index.json"
    if draw(st.integers(0, 3)) == 0:
        path.write_bytes(mutate_bytes(draw, path.read_bytes()))
    else:
        path.write_text(json.dumps(mutate_json(draw, json.loads(path.read_text()))))


TARGETS: dict[str, tuple[str, Callable]] = {
    "dcp-metadata-bytes": ("dcp", dcp_metadata_bytes),
    "dcp-metadata-structured": ("dcp", dcp_metadata_structured),
    "distcp-bytes": ("dcp", distcp_bytes),
    "universal-ckptconv-json": ("universal", universal_metadata),
    "universal-zarr-json": ("universal", zarr_json),
    "universal-chunks-objects": ("universal", universal_data),
    "safetensors-header": ("hf", safetensors_header),
    "hf-index-json": ("hf", hf_index),
}


def fuzz_one(target: str, cases: dict[str, Case], data) -> None:
    fmt, mutation = TARGETS[target]
    run_case(target, cases[fmt], lambda src: mutation(data.draw, src))


@pytest.mark.parametrize("target", list(TARGETS))
@QUICK
@given(data=st.data())
def test_fuzz_quick(target, cases, data):
    fuzz_one(target, cases, data)


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
@LONG
@given(data=st.data())
def test_fuzz_long(target, cases, data):
    fuzz_one(target, cases, data)


def test_mutators_change_something(cases):
    """Sanity: the fixtures are sound and a mutation really reaches the files."""
    for case in cases.values():
        assert verify(case.src).ok
        read_everything(case.src)


@pytest.mark.parametrize("array", ["tensors/zarr.json", "tensors", "objects/000000.pt", "tensors/model.w/c"])
def test_regression_array_path_names_a_file(cases, array):
    """Found by the long run: an array path naming a file made a chunk path go through it
    (NotADirectoryError escaped)."""

    def point(src: Path) -> None:
        doc = json.loads((src / "ckptconv.json").read_text())
        doc["tensors"]["model.bf"]["array"] = array
        (src / "ckptconv.json").write_text(json.dumps(doc))

    run_case("regression", cases["universal"], point)
