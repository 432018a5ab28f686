"""``ckptconv verify``: sound checkpoints pass; every flipped data byte is caught with its key and chunk.

Checkpoints are real: ``dcp.save`` (torch's own archives), the shared multi-rank fixtures, and our
conversions of them. DCP flips land in the stored tensor bytes of a random chunk archive (whose zip
CRC-32 torch never checks); universal flips land anywhere in any chunk file (data or padding),
object file or array ``zarr.json``. safetensors has no checksums, and the test says so: a flipped
HF data byte passes verify and is found by ``diff`` against the source.
"""

from __future__ import annotations

import importlib
import io
import json
import pickle
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo

from converter.api import diff, export_hf, from_universal, to_universal, verify
from formats.dcp import DCPReader
from formats.errors import CheckpointNotFoundError
from schemas import validation_errors
from oracle import bits_equal, torch_reference

FLIPS = 60
from cli_runner import run_cli


class Opaque:
    """A non-tensor value torch's weights-only unpickler refuses (needs --trust-pickle)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


def state_dict() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {
            "w": torch.randn(7, 5, generator=g),  # universal chunks (2, 5): the last one padded in dim 0
            "wide": torch.randn(4, 13, generator=g),  # universal chunks (1, 7): padded in dim 1
            "cube": torch.randn(5, 3, 6, generator=g),
            "bf": torch.randn(6, 5, generator=g).to(torch.bfloat16),
            "half": torch.randn(4, 4, generator=g).to(torch.float16),
            "ids": torch.arange(-6, 6, dtype=torch.int64).view(3, 4),
            "mask": torch.rand(11, generator=g) > 0.5,
            "scale": torch.tensor(0.5),
            "empty": torch.empty(0, 3),
        },
        "extra": {"step": 7, "name": "run", "history": [1.5, 2.5]},
    }


def quiet_save(sd: dict, path: Path, storage_writer=None) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        dcp.save(sd, checkpoint_id=path, storage_writer=storage_writer)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """torch-written DCP, its universal store (48-byte chunks: edge chunks padded), a dp3
    reshard written by us (3 files, uneven chunks), and single-file and sharded HF exports."""
    root = tmp_path_factory.mktemp("verify")
    out = {"dcp": quiet_save(state_dict(), root / "dcp")}
    to_universal(out["dcp"], root / "uni", chunk_bytes=48)
    from_universal(root / "uni", root / "dp3", "dp3")
    export_hf(out["dcp"], root / "hf")
    export_hf(out["dcp"], root / "hf_sharded", max_shard_size=150)
    out.update(uni=root / "uni", dp3=root / "dp3", hf=root / "hf", hf_sharded=root / "hf_sharded")
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def flip(path: Path, pos: int, bit: int) -> int:
    """Flip one bit of the byte at ``pos``; returns the original byte (restore with ``put``)."""
    data = bytearray(path.read_bytes())
    old = data[pos]
    data[pos] ^= 1 << bit
    path.write_bytes(bytes(data))
    return old


def put(path: Path, pos: int, value: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] = value
    path.write_bytes(bytes(data))


def assert_sound(report) -> None:
    assert report.ok, [p.message for p in report.problems]
    assert validation_errors("verify", report.to_json()) == []


# ------------------------------------------------------------------------------------------------
# sound checkpoints


@pytest.mark.parametrize("name", ["dcp", "uni", "dp3", "hf", "hf_sharded"])
def test_sound_checkpoints_pass(ckpts, name):
    report = verify(ckpts[name])
    assert_sound(report)
    assert report.tensors >= 7 and report.chunks >= report.tensors - 1
    if name.startswith("hf"):
        assert not report.data_checked and any("no checksums" in n for n in report.notes)
    else:
        assert report.data_checked and report.bytes_checked > 0


@pytest.mark.parametrize("kind", ["tp2dp2", "special_dtypes"])
def test_real_multi_rank_fixtures_pass(dcp_checkpoint, kind, tmp_path):
    src = dcp_checkpoint(kind)
    report = verify(src)
    assert_sound(report)
    assert report.objects > 0 and report.chunks > report.tensors
    to_universal(src, tmp_path / "u")
    assert_sound(verify(tmp_path / "u"))


# ------------------------------------------------------------------------------------------------
# flipped bytes


def dcp_data_spans(root: Path) -> list[tuple[str, tuple[int, ...], Path, int, int]]:
    """(key, chunk offsets, file, first byte, length) of the stored tensor bytes of every chunk."""
    spans = []
    with DCPReader(root) as reader:
        for key, entry in reader.index().tensors.items():
            for chunk in entry.chunks:
                at = reader.chunk_archive(key, chunk)
                if at.data_length:
                    spans.append((key, tuple(chunk.box.offsets), root / chunk.file,
                                  chunk.locator.offset + at.data_start, at.data_length))
    return spans


@pytest.mark.parametrize("name", ["dcp", "dp3"])
def test_every_flipped_dcp_data_byte_is_caught(ckpts, tmp_path, name, flips=FLIPS, seed=0):
    root = copy(ckpts[name], tmp_path / name)
    spans = dcp_data_spans(root)
    rng = random.Random(seed)
    for _ in range(flips):
        key, offsets, path, start, length = rng.choice(spans)
        pos = start + rng.randrange(length)
        old = flip(path, pos, rng.randrange(8))
        report = verify(root, workers=2)
        put(path, pos, old)
        assert [(p.key, p.chunk) for p in report.problems] == [(key, offsets)], (pos, report.problems)
        assert "CRC-32" in report.problems[0].message and path.name in report.problems[0].message
    assert verify(root).ok


def test_streamed_archive_checks(ckpts, tmp_path, monkeypatch):
    """Items bigger than WHOLE_ITEM_BYTES are checked through a window on the file (bounded reads)."""
    monkeypatch.setattr(importlib.import_module("converter.tools.verify"), "WHOLE_ITEM_BYTES", 0)
    assert_sound(verify(ckpts["dp3"]))
    test_every_flipped_dcp_data_byte_is_caught(ckpts, tmp_path, "dp3", flips=10, seed=9)


@pytest.mark.slow
def test_every_flipped_dcp_data_byte_is_caught_long(ckpts, tmp_path):
    test_every_flipped_dcp_data_byte_is_caught(ckpts, tmp_path, "dp3", flips=1000, seed=1)


def test_flips_in_other_archive_entries_are_caught(ckpts, tmp_path):
    """data.pkl, byteorder, version ... are CRC-checked too: a flip there names the chunk."""
    root = copy(ckpts["dcp"], tmp_path / "d")
    import zipfile

    rng = random.Random(2)
    checked = 0
    with DCPReader(root) as reader:
        chunks = [(k, c) for k, e in reader.index().tensors.items() for c in e.chunks]
    for key, chunk in rng.sample(chunks, 5):
        loc = chunk.locator
        path = root / chunk.file
        item = path.read_bytes()[loc.offset:loc.offset + loc.length]
        with zipfile.ZipFile(io.BytesIO(item)) as z:
            for info in z.infolist():
                if "/data/" in info.filename or not info.file_size:
                    continue
                head = item[info.header_offset:info.header_offset + 30]
                start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
                pos = loc.offset + start + rng.randrange(info.file_size)
                old = flip(path, pos, rng.randrange(8))
                report = verify(root, workers=2)
                put(path, pos, old)
                assert [(p.key, p.chunk) for p in report.problems] == [(key, tuple(chunk.box.offsets))], info.filename
                checked += 1
    assert checked >= 10


def universal_files(root: Path) -> dict[str, list[tuple[Path, str | None, tuple | None]]]:
    """Chunk files (with key and chunk offsets), object files (with key), array zarr.json files."""
    meta = json.loads((root / "ckptconv.json").read_text())
    from formats.universal import UniversalReader

    reader = UniversalReader(root)
    chunks = [(root / c.file, k, tuple(c.box.offsets)) for k, e in reader.index().tensors.items() for c in e.chunks]
    objects = [(root / o["file"], k, None) for k, o in meta["objects"].items()]
    arrays = [(root / t["array"] / "zarr.json", k, None) for k, t in meta["tensors"].items()]
    return {"chunks": chunks, "objects": objects, "arrays": arrays}


@pytest.mark.parametrize("what", ["chunks", "objects", "arrays"])
def test_every_flipped_universal_byte_is_caught(ckpts, tmp_path, what):
    root = copy(ckpts["uni"], tmp_path / "u")
    files = universal_files(root)[what]
    padded = [f for f in files if f[0].stat().st_size > 0]
    rng = random.Random(3)
    for _ in range(FLIPS if what == "chunks" else FLIPS // 4):
        path, key, offsets = rng.choice(padded)
        pos = rng.randrange(path.stat().st_size)
        old = flip(path, pos, rng.randrange(8))
        report = verify(root, workers=2)
        put(path, pos, old)
        assert not report.ok, (path, pos)
        assert any(p.key == key and (offsets is None or p.chunk == offsets) for p in report.problems), report.problems
    assert verify(root).ok


@pytest.mark.parametrize("key", ["model.w", "model.wide"])
def test_padding_flips_are_caught_too(ckpts, tmp_path, key):
    """Edge chunks are padded to the full chunk shape (in dim 0 or in an inner dim); a flip in the
    padding is a damaged file."""
    root = copy(ckpts["uni"], tmp_path / "u")
    rec = json.loads((root / "ckptconv.json").read_text())["tensors"][key]
    from formats.universal import UniversalReader

    entry = UniversalReader(root).index().tensors[key]
    edge = next(c for c in entry.chunks if list(c.box.sizes) != rec["chunk_shape"])
    path = root / edge.file
    assert path.stat().st_size == 4 * int(torch.tensor(rec["chunk_shape"]).prod())
    old = flip(path, path.stat().st_size - 1, 0)  # the last byte is padding
    report = verify(root)
    put(path, path.stat().st_size - 1, old)
    assert [p.chunk for p in report.problems] == [tuple(edge.box.offsets)]
    assert "padding" in report.problems[0].message
    assert verify(root).ok


@pytest.mark.parametrize("compressed", [False, True])
def test_flips_anywhere_verify_ok_means_torch_reads_the_same(tmp_path, compressed, flips=40, seed=4):
    """A flip anywhere in a .distcp (zip headers, padding, central directory, zstd streams):
    either verify reports it, or torch's own dcp.load still reads every entry bit for bit."""
    src = tmp_path / "z"
    quiet_save(state_dict(), src, FileSystemWriter(src, _extensions=[ZStandard()]) if compressed else None)
    assert_sound(verify(src))
    reference = torch_reference(src)
    path = next(src.glob("*.distcp"))
    rng = random.Random(seed)
    caught = 0
    for _ in range(flips):
        pos = rng.randrange(path.stat().st_size)
        old = flip(path, pos, rng.randrange(8))
        report = verify(src)
        if report.ok:
            got = torch_reference(src)
            assert got.keys() == reference.keys()
            for k, v in reference.items():
                assert bits_equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, (pos, k)
        else:
            caught += 1
        put(path, pos, old)
    assert caught >= flips // 4


@pytest.mark.slow
@pytest.mark.parametrize("compressed", [False, True])
def test_flips_anywhere_long(tmp_path, compressed):
    test_flips_anywhere_verify_ok_means_torch_reads_the_same(tmp_path, compressed, flips=500, seed=5)


def test_hf_data_flips_pass_verify_and_diff_finds_them(ckpts, tmp_path):
    """safetensors has no checksums: verify cannot see a flipped data byte (and says so); diff
    against the source does."""
    root = copy(ckpts["hf"], tmp_path / "h")
    from formats.hf import read_header

    header = read_header(root / "model.safetensors")
    e = header.tensors["w"]
    flip(root / "model.safetensors", e.begin + 5, 3)
    report = verify(root)
    assert report.ok and not report.data_checked
    assert any("cannot be detected" in n for n in report.notes)
    d = diff(ckpts["dcp"], root, model_only=True)
    assert not d.same and [t.key for t in d.tensors if t.status != "equal"] == ["w"]
    assert d.tensors[[t.key for t in d.tensors].index("w")].first == (0, 1)


# ------------------------------------------------------------------------------------------------
# structure


def rewrite_metadata(root: Path, edit) -> None:
    md = pickle.loads((root / ".metadata").read_bytes())  # our own test file: trusted
    edit(md)
    (root / ".metadata").write_bytes(pickle.dumps(md))


def test_aliased_items_are_reported(tmp_path):
    """Two keys whose metadata points at the same bytes: every CRC passes, the overlap does not."""
    root = quiet_save({"a": torch.arange(4.0), "b": torch.arange(4.0) + 1}, tmp_path / "alias")

    def alias(md):
        items = {i.fqn: (i, s) for i, s in md.storage_data.items()}
        md.storage_data[items["b"][0]] = _StorageInfo(items["a"][1].relative_path, items["a"][1].offset,
                                                      items["a"][1].length)

    rewrite_metadata(root, alias)
    report = verify(root)
    assert [(p.check, p.key) for p in report.problems] == [("overlap", "b")], report.problems


def test_truncated_and_missing_dcp_files(ckpts, tmp_path):
    root = copy(ckpts["dp3"], tmp_path / "t")
    f = root / "__1_0.distcp"
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    report = verify(root)
    assert len(report.problems) == 1 and "__1_0.distcp" in report.problems[0].message
    assert "truncated" in report.problems[0].message
    f.unlink()
    report = verify(root)
    assert not report.ok and "__1_0.distcp" in report.problems[0].message and "missing" in report.problems[0].message


@pytest.mark.parametrize("rows,what", [(1, "cover"), (4, "overlap")])
def test_gaps_and_overlaps_in_chunk_coverage(ckpts, tmp_path, rows, what):
    root = copy(ckpts["dp3"], tmp_path / "g")

    def resize(md):
        chunks = md.state_dict_metadata["model.w"].chunks  # dp3 of (7, 5): rows 3 + 3 + 1
        assert [list(c.sizes) for c in chunks] == [[3, 5], [3, 5], [1, 5]]
        chunks[0].sizes = torch.Size([rows, 5])

    rewrite_metadata(root, resize)
    report = verify(root)
    assert [p.check for p in report.problems] == ["metadata"]
    assert "model.w" in report.problems[0].message and what in report.problems[0].message


def test_unreferenced_files_are_warnings(ckpts, tmp_path):
    root = copy(ckpts["dcp"], tmp_path / "w")
    (root / "__9_0.distcp").write_bytes(b"stale")
    report = verify(root)
    assert report.ok and any("__9_0.distcp" in w for w in report.warnings)
    assert not verify(ckpts["uni"]).warnings
    uni = copy(ckpts["uni"], tmp_path / "u")
    (uni / "tensors" / "model.w" / "c" / ".0.tmp").write_bytes(b"x")
    (uni / ".ckptconv-journal.jsonl").write_text("{}")
    report = verify(uni)
    assert report.ok and len(report.warnings) == 1 and ".0.tmp" in report.warnings[0]
    assert "2 file(s)" in report.warnings[0]


def test_universal_missing_and_resized_chunks(ckpts, tmp_path):
    root = copy(ckpts["uni"], tmp_path / "u")
    files = [f for f in universal_files(root)["chunks"] if any(f[2])]  # not a tensor's first chunk
    (path, key, offsets), (path2, key2, offsets2) = files[0], files[-1]
    path.unlink()
    with open(path2, "ab") as f:
        f.write(b"\0")
    report = verify(root)
    assert {(p.key, p.chunk) for p in report.problems} == {(key, offsets), (key2, offsets2)}
    assert any("missing" in p.message for p in report.problems)
    assert any("bytes, expected" in p.message for p in report.problems)
    # a tensor's first chunk sizes the whole grid: the store is refused on open, naming it
    first = next(f for f in universal_files(root)["chunks"] if not any(f[2]) and f[1] != key)
    first[0].unlink()
    report = verify(root)
    assert [p.check for p in report.problems] == ["metadata"]
    assert repr(first[1]) in report.problems[0].message and "missing" in report.problems[0].message


def test_universal_incomplete_checksums_and_atoms(ckpts, tmp_path):
    root = copy(ckpts["uni"], tmp_path / "u")
    meta_path = root / "ckptconv.json"
    pristine = meta_path.read_text()
    meta = json.loads(pristine)
    meta["tensors"]["model.w"]["checksums"].popitem()
    meta_path.write_text(json.dumps(meta))
    report = verify(root)
    assert not report.ok and any(p.key == "model.w" or "model.w" in p.message for p in report.problems)
    meta = json.loads(pristine)
    meta["atoms"]["w"]["members"]["param"] = "model.nope"
    meta_path.write_text(json.dumps(meta))
    report = verify(root)
    assert {p.check for p in report.problems} == {"atoms"} and any("model.nope" in p.message for p in report.problems)


def test_hf_index_consistency(ckpts, tmp_path):
    root = copy(ckpts["hf_sharded"], tmp_path / "h")
    index_path = root / "model.safetensors.index.json"
    pristine = json.loads(index_path.read_text())
    assert len(set(pristine["weight_map"].values())) > 1
    doc = json.loads(json.dumps(pristine))
    dropped = sorted(doc["weight_map"])[0]
    del doc["weight_map"][dropped]
    doc["metadata"]["total_size"] += 1
    index_path.write_text(json.dumps(doc))
    report = verify(root)
    assert [(p.check, p.key) for p in report.problems] == [("index", dropped)]
    assert any("total_size" in w for w in report.warnings)
    doc = json.loads(json.dumps(pristine))
    a, b = sorted(set(doc["weight_map"].values()))[:2]
    name = next(k for k, v in doc["weight_map"].items() if v == a)
    doc["weight_map"][name] = b
    index_path.write_text(json.dumps(doc))
    report = verify(root)
    assert not report.ok and name in report.problems[0].message


def test_hf_header_damage(ckpts, tmp_path):
    root = copy(ckpts["hf"], tmp_path / "h")
    path = root / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[12] = ord("!")
    path.write_bytes(bytes(data))
    report = verify(root)
    assert [p.check for p in report.problems] == ["header"] and "model.safetensors" in report.problems[0].message


def test_quick_skips_data(ckpts, tmp_path):
    root = copy(ckpts["dcp"], tmp_path / "q")
    key, offsets, path, start, length = dcp_data_spans(root)[0]
    flip(path, start, 0)
    quick = verify(root, quick=True)
    assert quick.ok and not quick.data_checked and quick.bytes_checked == 0
    assert not verify(root).ok


def test_objects_needing_trust_pickle_are_warnings(tmp_path):
    root = quiet_save({"w": torch.ones(3), "extra": {"opaque": Opaque(3)}}, tmp_path / "p")
    report = verify(root)
    assert report.ok and any("extra.opaque" in w and "--trust-pickle" in w for w in report.warnings)
    trusted = verify(root, trust_pickle=True)
    assert trusted.ok and not trusted.warnings


def test_not_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        verify(tmp_path / "nope")


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_exit_codes_and_json(ckpts, tmp_path):
    code, out, _ = run_cli("verify", str(ckpts["uni"]))
    assert code == 0 and out.startswith("ok: ")
    code, out, _ = run_cli("verify", "--json", str(ckpts["hf"]))
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and validation_errors("verify", doc) == []
    root = copy(ckpts["dcp"], tmp_path / "c")
    key, offsets, path, start, length = dcp_data_spans(root)[0]
    flip(path, start, 0)
    code, out, _ = run_cli("verify", str(root))
    assert code == 1 and out.startswith("FAILED") and repr(key) in out
    code, out, _ = run_cli("verify", "--json", str(root))
    doc = json.loads(out)
    assert code == 1 and not doc["ok"] and doc["problems"][0]["key"] == key
    assert doc["problems"][0]["chunk"] == list(offsets) and validation_errors("verify", doc) == []
    code, out, err = run_cli("verify", str(tmp_path / "missing"))
    assert code == 2 and err.startswith("ckptconv: error: ") and len(err.strip().splitlines()) == 1
