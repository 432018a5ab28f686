"""The fast ``.metadata`` reader (:mod:`formats.dcp.metadata_fast`) against torch's own unpickling.

The oracle is torch: ``pickle.load`` of the file with ``torch.distributed.checkpoint`` imported
(what ``FileSystemReader.read_metadata`` does). Each file must be read by the fast path (not the
fallback) and give exactly what torch's objects say; damaged files must give exactly what the
general allowlist path gives.
"""

from __future__ import annotations

import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from formats.base import Box, first_overlap
from formats.dcp import metadata as M
from formats.dcp.safe_pickle import safe_loads
from formats.errors import CkptConvError


def _torch_view(path) -> tuple[dict, dict]:
    """(entries, storage) from torch's own objects, in the parsed metadata's terms."""
    import torch.distributed.checkpoint as dcp  # noqa: F401  (torch's classes, for pickle.load)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(path, "rb") as f:
        md = pickle.load(f)
    entries: dict = {}
    for key, value in md.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata):
            entries[key] = "bytes"
        else:
            entries[key] = (str(value.properties.dtype).removeprefix("torch."), tuple(value.size),
                            [(tuple(c.offsets), tuple(c.sizes)) for c in value.chunks])
    storage = {(i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset, s.length)
               for i, s in md.storage_data.items()}
    return entries, storage


def _ours(md: M.DCPMetadata) -> tuple[dict, dict]:
    entries = {k: "bytes" if isinstance(e, M.BytesMeta) else
               (e.dtype, e.size, [(c.offsets, c.sizes) for c in e.chunks]) for k, e in md.entries.items()}
    storage = {k: (v.relative_path, v.offset, v.length) for k, v in md.storage.items()}
    return entries, storage


def _fast(data: bytes):
    return M.fast_loads(data, M._resolve_metadata_global, M._RECORD_KINDS, M.StorageInfo, M._intern_shape)


def _general(data: bytes, source: str = "x/.metadata") -> M.DCPMetadata:
    with M.gc_paused():
        return M._parse_root(safe_loads(data, source, M._resolve_metadata_global), source)


def _check_against_torch(path) -> None:
    data = path.read_bytes()
    assert _fast(data) is not None, f"{path}: the fast reader fell back"
    ours = M.parse_metadata_bytes(data, str(path))
    assert _ours(ours) == _torch_view(path)
    assert ours == _general(data, str(path))  # and the same objects as the general path


@pytest.fixture(scope="module")
def odd_save(tmp_path_factory):
    """A single-process dcp.save of every dtype family, 0-d and empty tensors, and objects."""
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("odd") / "ck"
    state = {
        "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "bf16": torch.ones(5, dtype=torch.bfloat16),
        "f16": torch.zeros(2, 2, 2, 2, dtype=torch.float16),  # 4-d: a MARK ... TUPLE shape
        "f8": torch.zeros(3, dtype=torch.float8_e4m3fn),
        "i64": torch.tensor(7),  # 0-d
        "u8": torch.zeros(0, 4, dtype=torch.uint8),  # empty
        "b": torch.tensor([True, False]),
        "c64": torch.zeros(2, dtype=torch.complex64),
        "big": torch.zeros(70000, 2, dtype=torch.int8),  # sizes past BININT2
        "obj": {"step": 3, "name": "run", "nested": [1, 2.5, None]},
        "raw": b"\x00\x01bytes",
        "n": 12,
        "ünï.çødé": torch.ones(1),  # a non-ASCII key: read opcode by opcode
    }
    dcp.save(state, checkpoint_id=str(root), no_dist=True)
    return root


def test_fast_reader_matches_torch_on_a_single_process_save(odd_save):
    _check_against_torch(odd_save / ".metadata")


@pytest.mark.parametrize("kind", ["fsdp4", "tp2dp2", "hsdp2x2", "special_dtypes"])
def test_fast_reader_matches_torch_on_multi_process_saves(dcp_checkpoint, kind):
    """FSDP, TP x DP, HSDP (replicated shards deduplicated), and uneven FSDP shards that leave
    some ranks an empty chunk (special_dtypes), each saved by real ranks over gloo."""
    _check_against_torch(dcp_checkpoint(kind) / ".metadata")


def test_fast_reader_reads_the_synthetic_metadata(tmp_path):
    """bench/synthetic_metadata.py's files (what the scale numbers are measured on) take the fast
    path too, and torch reads them the same way."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "syn"
    subprocess.run([sys.executable, str(repo / "bench" / "synthetic_metadata.py"), str(out), "--model", "8b", "--layers", "2",
                    "--dim", "256", "--hidden", "512", "--vocab", "1000", "--heads", "4", "--kv-heads", "2",
                    "--world", "16"], check=True, capture_output=True, timeout=300)
    _check_against_torch(out / ".metadata")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_damaged_metadata_reads_exactly_as_the_general_path(fsdp4_metadata, data):
    """Any damage (bytes changed, cut, inserted): the fast reader either gives what the general
    allowlist path gives, or falls back to it; the result or the error message is the same."""
    raw = bytearray(fsdp4_metadata.data)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        how = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip":
            raw[at] = data.draw(st.integers(0, 255))
        elif how == "cut":
            del raw[at:at + data.draw(st.integers(1, 40))]
        else:
            raw[at:at] = bytes(data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=8)))
    damaged = bytes(raw)

    def outcome(parse):
        try:
            return "ok", parse(damaged)
        except CkptConvError as e:
            return type(e).__name__, str(e)

    assert outcome(lambda d: M.parse_metadata_bytes(d, "x/.metadata")) == outcome(_general)


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:  # hypothesis prints its arguments
        return f"<fsdp4 .metadata, {len(self.data)} bytes>"


@pytest.fixture(scope="module")
def fsdp4_metadata(checkpoint_cache):
    return _Bytes((checkpoint_cache.get("fsdp4") / ".metadata").read_bytes())


# ---------------------------------------------------------------------------------------------
# first_overlap: the interval fast path for rows of boxes against the pairwise check


def _overlapping(boxes):
    full = [b for b in boxes if b.numel]
    return any(a.intersect(b) is not None for i, a in enumerate(full) for b in full[i + 1:])


@st.composite
def _rows(draw):
    """Boxes equal in every dim but one (FSDP-like rows, sometimes overlapping or gapped)."""
    ndim = draw(st.integers(1, 3))
    d = draw(st.integers(0, ndim - 1))
    other_off = [draw(st.integers(0, 3)) for _ in range(ndim)]
    other_len = [draw(st.integers(0, 3)) for _ in range(ndim)]
    boxes = []
    for _ in range(draw(st.integers(0, 12))):
        off, size = list(other_off), list(other_len)
        off[d], size[d] = draw(st.integers(0, 30)), draw(st.integers(0, 6))
        boxes.append(Box(tuple(off), tuple(size)))
    if draw(st.booleans()) and boxes:  # sometimes one box off the row
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        boxes[i] = Box(tuple(o + 1 for o in b.offsets), b.sizes)
    random.Random(draw(st.integers(0, 99))).shuffle(boxes)
    return boxes


@settings(max_examples=300, deadline=None)
@given(_rows())
def test_first_overlap_finds_what_the_pairwise_check_finds(boxes):
    pair = first_overlap(boxes)
    assert (pair is not None) == _overlapping(boxes)
    if pair is not None:
        assert pair[0].intersect(pair[1]) is not None or not pair[0].ndim


@settings(max_examples=300, deadline=None)
@given(_rows())
def test_the_readers_grid_check_never_calls_overlapping_rows_disjoint(boxes):
    """formats.dcp.reader's C-level grid check says "disjoint" only when chunks are (it may say
    "not shown" for disjoint ones: the general sweep decides those); FSDP rows pass it."""
    from formats.dcp.reader import _disjoint_grid

    boxes = sorted(boxes, key=lambda b: b.offsets)
    ndim = len(boxes[0].offsets) if boxes else 0
    off_cols = list(zip(*(b.offsets for b in boxes))) if ndim else []
    size_cols = list(zip(*(b.sizes for b in boxes))) if ndim else []
    if _disjoint_grid(off_cols, size_cols, [b.numel for b in boxes]):
        assert not _overlapping(boxes)
    if len(boxes) >= 2 and all(b.numel for b in boxes) and not _overlapping(boxes) and \
            sum(len(set(col)) > 1 for col in off_cols + size_cols) == 1:
        assert _disjoint_grid(off_cols, size_cols, [b.numel for b in boxes])  # FSDP's rows: fast


@st.composite
def _grids(draw):
    """Boxes of a grid (every dim cut into intervals; a box per cell, TP x FSDP-like), sometimes
    with a cell dropped, duplicated, shifted or resized."""
    ndim = draw(st.integers(1, 3))
    cuts = []
    for _ in range(ndim):
        lens = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
        starts = [sum(lens[:i]) for i in range(len(lens))]
        cuts.append(list(zip(starts, lens)))
    cells = [()]
    for dim_cuts in cuts:
        cells = [c + (iv,) for c in cells for iv in dim_cuts]
    boxes = [Box(tuple(o for o, _ in c), tuple(n for _, n in c)) for c in cells]
    change = draw(st.sampled_from(["none", "drop", "duplicate", "shift", "grow"]))
    i = draw(st.integers(0, len(boxes) - 1))
    b = boxes[i]
    if change == "drop":
        boxes.pop(i)
    elif change == "duplicate":
        boxes.append(b)
    elif change == "shift":
        boxes[i] = Box(tuple(o + draw(st.integers(0, 1)) for o in b.offsets), b.sizes)
    elif change == "grow":
        boxes[i] = Box(b.offsets, tuple(n + draw(st.integers(0, 2)) for n in b.sizes))
    return sorted(boxes, key=lambda x: x.offsets), change


@settings(max_examples=400, deadline=None)
@given(_grids())
def test_the_readers_grid_check_never_calls_overlapping_grids_disjoint(grid):
    from formats.dcp.reader import _disjoint_grid

    boxes, change = grid
    off_cols = list(zip(*(b.offsets for b in boxes)))
    size_cols = list(zip(*(b.sizes for b in boxes)))
    shown = _disjoint_grid(off_cols, size_cols, [b.numel for b in boxes])
    if shown:
        assert not _overlapping(boxes)
    if change in ("none", "drop"):
        assert shown  # exact grids (and grids with a cell missing) are shown disjoint in C


# ---------------------------------------------------------------------------------------------
# crafted pickles: what dcp.save never writes, opcode by opcode


class _Pickle:
    """A protocol-4 pickle written opcode by opcode, counting its memo entries."""

    def __init__(self) -> None:
        self.b, self.n = bytearray(b"\x80\x04"), 0

    def op(self, raw: bytes) -> None:
        self.b += raw

    def memo(self) -> int:
        self.b += b"\x94"
        self.n += 1
        return self.n - 1

    def text(self, value: str) -> int:
        raw = value.encode()
        self.b += b"\x8c" + bytes([len(raw)]) + raw
        return self.memo()

    def get(self, index: int) -> None:
        self.b += b"j" + index.to_bytes(4, "little")

    def glob(self, module: str, name: str) -> int:
        self.text(module)
        self.text(name)
        self.op(b"\x93")
        return self.memo()


def _chunks_with_distinct_class_refs(n: int) -> bytes:
    """``{"setup": (cls, ..., n copies of cls), "chunks": [n chunk records]}``, each record naming
    its class through another memo copy (so each has its own encoding)."""
    p = _Pickle()
    p.op(b"}")
    p.memo()
    p.op(b"(")
    p.text("setup")
    p.op(b"(")
    cls = p.glob("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata")
    offsets, sizes, size = p.text("offsets"), p.text("sizes"), p.glob("torch", "Size")
    copies = []
    for _ in range(n):
        p.get(cls)
        copies.append(p.memo())
    p.op(b"t")
    p.memo()
    p.text("chunks")
    p.op(b"]")
    p.memo()
    p.op(b"(")
    for i, c in enumerate(copies):
        p.get(c)
        p.op(b")\x81")
        p.memo()
        p.op(b"}")
        p.memo()
        p.op(b"(")
        for name, value in ((offsets, i % 200), (sizes, 1)):
            p.get(name)
            p.get(size)
            p.op(b"K" + bytes([value]) + b"\x85")
            p.memo()
            p.op(b"\x85")
            p.memo()
            p.op(b"R")
            p.memo()
        p.op(b"ub")
    p.op(b"eu.")
    return bytes(p.b)


def _boxes(items) -> list:
    return [(b.offsets, b.sizes) if type(b) is Box else (b.get("offsets", 0), b.get("sizes", 1)) for b in items]


def test_record_encodings_varied_record_by_record_cost_no_compile_each(monkeypatch):
    """A pickle naming the record class through a new memo copy in every record (valid, but not
    what dcp.save writes) must not compile a pattern per record (ms each: minutes for a crafted
    file of megabytes): past a few encodings the reader goes opcode by opcode, same result."""
    from formats.dcp import metadata_fast as F

    data = _chunks_with_distinct_class_refs(200)
    compiled = []
    real = F._specialize
    monkeypatch.setattr(F, "_specialize", lambda *a: compiled.append(1) or real(*a))
    root = _fast(data)
    assert root is not None and len(compiled) <= F.MAX_PATTERNS
    general = safe_loads(data, "x/.metadata", M._resolve_metadata_global)
    assert _boxes(root["chunks"]) == _boxes(general["chunks"]) == [((i % 200,), (1,)) for i in range(200)]


# ---------------------------------------------------------------------------------------------
# generated dcp.save-style metadata: the batched record runs against the general path


_NAME = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40)
_ODD_NAME = st.one_of(_NAME, st.text(min_size=1, max_size=8).map(lambda s: "é" + s),  # not ASCII
                      st.integers(256, 300).map(lambda n: "L" * n))  # BINUNICODE (over 255 bytes)
_SHAPE_INT = st.one_of(st.integers(0, 300), st.integers(0, 1 << 40))  # K/M/J ints and LONG1


def _fresh(s: str) -> str:
    """An equal string that is another object (pickled anew, not as a memo reference)."""
    return "".join(list(s))


@st.composite
def _dcp_metadata(draw) -> bytes:
    """The ``.metadata`` pickle of a torch ``Metadata`` with random tensors, chunks, files and
    encodings: 0-d to 5-d shapes, small to LONG1 ints, non-ASCII and long names, fqn strings
    new per item or shared (memo references inside a run), file names first seen mid-run,
    bytes entries, a StorageMeta naming storage fqns (memo references to strings the batches
    keep), and pickle frames down to a few dozen bytes (records cut by frame boundaries)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    files = draw(st.lists(st.one_of(st.sampled_from(["__0_0.distcp", "__1_0.distcp"]), _NAME),
                          min_size=1, max_size=4))
    sharing = draw(st.sampled_from(["fresh", "per_tensor", "key"]))
    names = draw(st.lists(_ODD_NAME if draw(st.booleans()) else _NAME, min_size=1, max_size=5, unique=True))
    entries, storage, kept = {}, {}, []
    for name in names:
        if draw(st.integers(0, 5)) == 0:
            entries[name] = BytesStorageMetadata()
            storage[MetadataIndex(_fresh(name))] = _StorageInfo(draw(st.sampled_from(files)), 0, 5)
            continue
        ndim = draw(st.integers(0, 5))
        n = 1 if ndim == 0 else draw(st.integers(1, 60))
        firsts = draw(st.lists(_SHAPE_INT, min_size=n, max_size=n, unique=True)) if ndim else [0]
        chunks = []
        for first in firsts:
            rest = [draw(_SHAPE_INT) for _ in range(ndim - 1)]
            offsets = ([first] + rest)[:ndim]
            sizes = [draw(_SHAPE_INT) for _ in range(ndim)]
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
        entries[name] = TensorStorageMetadata(TensorProperties(dtype=dtype),
                                              torch.Size([draw(_SHAPE_INT) for _ in range(ndim)]), chunks)
        fqn = _fresh(name)
        for i, c in enumerate(chunks):
            if sharing == "fresh":
                fqn = _fresh(name)
            elif sharing == "key":
                fqn = name
            kept.append(fqn)
            info = _StorageInfo(draw(st.sampled_from(files)), draw(_SHAPE_INT), draw(_SHAPE_INT))
            storage[MetadataIndex(fqn, c.offsets, i)] = info
    modules = draw(st.lists(st.sampled_from(kept), max_size=3)) if kept else []
    md = Metadata(entries, planner_data={k: (k,) for k in entries}, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id="ck", save_id="s", load_id="l", modules=modules))
    frame = draw(st.sampled_from([None, 48, 500, 4096]))
    if frame is None:
        return pickle.dumps(md, protocol=4)  # what FileSystemWriter writes (64 KiB frames)
    import io

    buf = io.BytesIO()
    pickler = pickle._Pickler(buf, protocol=4)  # the same opcodes, in smaller frames
    pickler.framer._FRAME_SIZE_TARGET = frame
    pickler.dump(md)
    return buf.getvalue()


def _memoized_strings(data: bytes) -> tuple[int, dict[int, str]]:
    """(memo entries, memo index -> value of each entry that is a string) of a pickle."""
    import pickletools

    n, strings, last = 0, {}, None
    for op, arg, _ in pickletools.genops(data):
        if op.name == "MEMOIZE":
            if last is not None:
                strings[n] = last
            n += 1
        last = arg if op.name in ("SHORT_BINUNICODE", "BINUNICODE") else None
    return n, strings


@settings(max_examples=120, deadline=None)
@given(_dcp_metadata())
def test_fast_reader_equals_the_general_path_on_generated_metadata(data):
    """Every generated dcp.save-style pickle takes the fast path, parses exactly as the general
    allowlist path, and the reader counts the memo exactly (each storage fqn it keeps for later
    references sits at the memo index the pickle machine gives it)."""
    from formats.dcp import metadata_fast as F

    assert _fast(data) is not None
    assert M.parse_metadata_bytes(data, "x/.metadata") == _general(data)
    reader = F._Reader(data, M._resolve_metadata_global, M._RECORD_KINDS, M.StorageInfo, M._intern_shape)
    reader.run()
    entries, strings = _memoized_strings(data)
    assert reader.memo_n == entries
    kept = [(i, s) for at, batch in reader.fqn_batches for i, s in zip(at, batch, strict=True)]
    assert all(strings.get(i) == s for i, s in kept)
    assert [i for i, _ in kept] == sorted({i for i, _ in kept})


def _outcome(parse, data):
    try:
        return "ok", parse(data)
    except CkptConvError as e:
        return type(e).__name__, str(e)


@settings(max_examples=150, deadline=None)
@given(_dcp_metadata(), st.data())
def test_a_byte_tampered_in_the_records_reads_as_the_general_path(data, draw):
    """A byte changed anywhere in the chunk / storage records (what the batched runs read): the
    result or the error message is the general path's."""
    start = data.find(b"chunks")
    at = draw.draw(st.integers(max(start, 2), len(data) - 2))
    damaged = data[:at] + bytes([draw.draw(st.integers(0, 255))]) + data[at + 1:]
    assert _outcome(lambda d: M.parse_metadata_bytes(d, "x/.metadata"), damaged) == _outcome(_general, damaged)


def _long_run_metadata() -> bytes:
    """One tensor of 300 chunks in one file (one long run of each record kind), lengths 70,000
    (BININT: ``J`` and 4 bytes)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    chunks = [ChunkStorageMetadata(torch.Size([i * 10, 0]), torch.Size([10, 7])) for i in range(300)]
    storage = {MetadataIndex(_fresh("w"), c.offsets, i): _StorageInfo("__0_0.distcp", i * 70000, 70000)
               for i, c in enumerate(chunks)}
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([3000, 7]),
                                              chunks)}, storage_data=storage)
    return pickle.dumps(md, protocol=4)


def test_a_negative_length_inside_a_run_falls_back_and_is_refused_as_before():
    data = _long_run_metadata()
    length = b"J" + (70000).to_bytes(4, "little")
    at = data.index(length, len(data) // 2)  # a record in the middle of the run
    damaged = data[:at] + b"J" + (-5).to_bytes(4, "little", signed=True) + data[at + 5:]
    assert _fast(data) is not None and _fast(damaged) is None
    with pytest.raises(CkptConvError, match=r"bad storage offset/length \d+/-5") as e:
        M.parse_metadata_bytes(damaged, "x/.metadata")
    assert _outcome(_general, damaged) == (type(e.value).__name__, str(e.value))


def test_a_shape_with_a_wrong_tuple_opcode_inside_a_run_falls_back():
    """TUPLE1 where the two ints of a chunk's sizes need TUPLE2: the run's shape check bails to the
    general path (which then decides), as the record-by-record reader did."""
    data = _long_run_metadata()
    sizes = b"K\nK\x07\x86\x94"  # (10, 7): two BININT1 and TUPLE2, MEMOIZE
    at = data.index(sizes, data.index(b"chunks") + 150 * len(sizes) * 8)  # about record 150
    damaged = data[:at] + b"K\nK\x07\x85\x94" + data[at + len(sizes):]
    assert _fast(damaged) is None
    assert _outcome(lambda d: M.parse_metadata_bytes(d, "x/.metadata"), damaged) == _outcome(_general, damaged)


def test_the_reader_lets_go_of_the_data_without_the_cyclic_gc():
    """Callers pause the cyclic GC while parsing: nothing may keep the file's bytes (612 MB at 1,024
    ranks) alive in a reference cycle after fast_loads returns, read or fallen back."""
    import gc
    import sys

    data = _long_run_metadata()
    was = gc.isenabled()
    gc.disable()
    try:
        for raw in (data, data[:len(data) // 2]):
            before = sys.getrefcount(raw)
            _fast(raw)
            assert sys.getrefcount(raw) == before
    finally:
        if was:
            gc.enable()
