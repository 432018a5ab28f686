"""Conversions check every source chunk as they copy it, stay inside the checkpoint, and fail cleanly.

Sources are the real 4-rank FSDP2 fixture (``dcp.save`` of model + AdamW state) and our store and
HF export of it. A flipped byte in the tensor data of a ``.distcp`` chunk (its zip CRC-32, which
``torch.load`` never checks) or of a store chunk (its xxh3_64 in ``ckptconv.json``) stops every
conversion reading it with one line naming the file, the key and the chunk, exit status 2, and
nothing published; ``--no-verify-source`` copies it anyway. Each chunk is checked once per run, on
the bytes the conversion reads (parts' CRC-32s combined; xxh3 fed in order), never by a second pass.

Then the paths: a store chunk that is a symlink out of the store is refused like the DCP and HF
readers refuse theirs; symlink loops, JSON nested past Python's recursion limit and over-long
names recorded in metadata are each one line, exit status 2, naming the file.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint.filesystem import _StorageInfo

from cli_runner import run_cli
from converter import api
from converter.config import RunOptions
from formats.dcp import DCPReader
from formats.dcp import archive
from formats.errors import CorruptCheckpointError
from formats.hf import HFReader
from formats.integrity import ChunkChecks
from formats.universal import UniversalReader

KEY = "model.layers.1.feed_forward.w1.weight"  # (96, 32) fp32: four 24-row FSDP chunks
STORE_CHUNK = "4096"  # bytes: store chunks of 32 rows, so dp3 / tp targets read parts of them


def one_line_error(result: tuple[int, str, str], *needles: str) -> str:
    code, out, err = result
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: "), err
    assert "Traceback" not in out + err and "internal error" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def ok(result: tuple[int, str, str]) -> None:
    code, out, err = result
    assert code == 0, (code, out, err)


def flip_byte(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


def flip_dcp_chunk(ckpt: Path, key: str, index: int = 1) -> Path:
    """Flip a byte in the middle of the stored tensor data of chunk ``index`` of ``key``; its file."""
    with DCPReader(ckpt) as reader:
        chunk = reader.index().tensors[key].chunks[index]
        at = reader.chunk_archive(key, chunk)
    flip_byte(ckpt / chunk.file, chunk.locator.offset + at.data_start + at.data_length // 2)
    return ckpt / chunk.file


def store_chunk_file(store: Path, key: str, index: int = 0) -> Path:
    reader = UniversalReader(store)
    try:
        return store / reader.index().tensors[key].chunks[index].file
    finally:
        reader.close()


@pytest.fixture(scope="module")
def store(dcp_checkpoint, tmp_path_factory) -> Path:
    """The fsdp4 fixture as a universal store with small chunks (shared read-only)."""
    dst = tmp_path_factory.mktemp("integrity") / "uni"
    ok(run_cli("to-universal", str(dcp_checkpoint("fsdp4")), str(dst), "--chunk-size", STORE_CHUNK))
    return dst


@pytest.fixture()
def store_copy(store, tmp_path) -> Path:
    return Path(shutil.copytree(store, tmp_path / "uni-copy"))


# ------------------------------------------------------------------------------------------------
# point 1: a flipped source byte stops every conversion


@pytest.mark.parametrize("args", [(), ("--chunk-size", "1000")], ids=["whole-chunks", "partial-reads"])
def test_to_universal_refuses_a_flipped_dcp_byte(dcp_checkpoint_copy, tmp_path, args):
    ckpt = dcp_checkpoint_copy("fsdp4")
    file = flip_dcp_chunk(ckpt, KEY)
    out = tmp_path / "uni"
    one_line_error(run_cli("to-universal", str(ckpt), str(out), *args), "CRC-32", str(file), repr(KEY),
                   "chunk at [24, 0]", "--no-verify-source")
    assert not (out / "ckptconv.json").exists()
    ok(run_cli("to-universal", str(ckpt), str(tmp_path / "skipped"), *args, "--no-verify-source"))
    assert (tmp_path / "skipped" / "ckptconv.json").is_file()
    # the damage was copied as asked: the store's own checksums now certify the flipped byte
    assert api.verify(tmp_path / "skipped").ok


def test_a_task_is_journaled_only_once_its_sources_are_verified(dcp_checkpoint_copy, dcp_checkpoint, tmp_path,
                                                                 monkeypatch):
    """Store chunks of 7 rows read the 24-row source chunks in parts, so a damaged chunk fails only
    when its last part is read, after tasks that read its first parts finished. None of those may
    be journaled: after the file is restored (``rsync -a``: same size and time, so the run resumes),
    ``--resume`` must copy them again, and the store then
    holds what torch reads from the source."""
    import json

    from converter import knobs
    from oracle import assert_same_value, torch_reference

    monkeypatch.setattr(knobs, "JOURNAL_FLUSH_SECONDS", 0.0)  # journal every finished task at once
    ckpt = dcp_checkpoint_copy("fsdp4")
    good, stat = (ckpt / "__1_0.distcp").read_bytes(), (ckpt / "__1_0.distcp").stat()
    file = flip_dcp_chunk(ckpt, KEY)
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # bit rot: the file's time is unchanged
    out = tmp_path / "uni"
    opts = RunOptions(workers=1)
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        api.to_universal(ckpt, out, opts, chunk_bytes=1000)
    journal = [json.loads(line) for line in (out / ".ckptconv-journal.jsonl").read_text().splitlines()[1:]]
    done = [json.loads(e["t"]) for e in journal]
    assert any(k == KEY and o[0] < 24 for k, o, _ in done)  # tasks before the damaged chunk were journaled
    assert not [t for t in done if t[0] == KEY and t[1][0] < 48 and t[1][0] + t[2][0] > 24], done
    assert file.name == "__1_0.distcp"
    (ckpt / "__1_0.distcp").write_bytes(good)  # restored from a good copy, times kept (rsync -a)
    os.utime(ckpt / "__1_0.distcp", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    api.to_universal(ckpt, out, dataclasses_replace(opts, resume=True), chunk_bytes=1000)
    assert_same_value(torch_reference(dcp_checkpoint("fsdp4")), torch_reference_of_store(out, tmp_path))


def dataclasses_replace(opts: RunOptions, **changes) -> RunOptions:
    import dataclasses

    return dataclasses.replace(opts, **changes)


def torch_reference_of_store(store: Path, tmp_path: Path):
    """What torch's dcp.load reads from the store converted back to one DCP rank."""
    from oracle import torch_reference

    back = tmp_path / "back"
    api.from_universal(store, back, "dp1")
    return torch_reference(back)


def test_from_universal_from_dcp_refuses_a_flipped_dcp_byte(dcp_checkpoint_copy, tmp_path):
    ckpt = dcp_checkpoint_copy("fsdp4")
    file = flip_dcp_chunk(ckpt, KEY)
    out = tmp_path / "dp3"
    one_line_error(run_cli("from-universal", str(ckpt), str(out), "--mesh", "dp3"), "CRC-32", str(file), repr(KEY))
    assert not (out / ".metadata").exists()
    ok(run_cli("from-universal", str(ckpt), str(tmp_path / "skipped"), "--mesh", "dp3", "--no-verify-source"))
    assert (tmp_path / "skipped" / ".metadata").is_file()


def test_export_hf_from_dcp_refuses_a_flipped_dcp_byte(dcp_checkpoint_copy, tmp_path):
    ckpt = dcp_checkpoint_copy("fsdp4")
    file = flip_dcp_chunk(ckpt, KEY)
    one_line_error(run_cli("export-hf", str(ckpt), str(tmp_path / "hf")), "CRC-32", str(file), repr(KEY))
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    ok(run_cli("export-hf", str(ckpt), str(tmp_path / "skipped"), "--no-verify-source"))


@pytest.mark.parametrize("mesh", [("--mesh", "dp3"), ("--mesh", "tp2,dp2", "--plan", "llama")],
                         ids=["dp3", "tp2dp2"])
def test_from_universal_refuses_a_flipped_store_byte(store_copy, tmp_path, mesh):
    file = store_chunk_file(store_copy, KEY)
    flip_byte(file, 100)
    out = tmp_path / "out"
    one_line_error(run_cli("from-universal", str(store_copy), str(out), *mesh), "xxh3_64", str(file), repr(KEY),
                   "chunk 0.0")
    assert not (out / ".metadata").exists()
    ok(run_cli("from-universal", str(store_copy), str(tmp_path / "skipped"), *mesh, "--no-verify-source"))


def test_export_hf_refuses_a_flipped_store_byte(store_copy, tmp_path):
    file = store_chunk_file(store_copy, KEY)
    flip_byte(file, 5)
    out = tmp_path / "hf"
    one_line_error(run_cli("export-hf", str(store_copy), str(out)), "xxh3_64", str(file), repr(KEY))
    assert not (out / "model.safetensors").exists()
    ok(run_cli("export-hf", str(store_copy), str(tmp_path / "skipped"), "--no-verify-source"))
    assert (tmp_path / "skipped" / "model.safetensors").is_file()


def test_diff_names_the_damaged_chunk(store_copy, dcp_checkpoint):
    file = store_chunk_file(store_copy, KEY)
    flip_byte(file, 5)
    one_line_error(run_cli("diff", str(dcp_checkpoint("fsdp4")), str(store_copy)), "xxh3_64", str(file))
    code, out, _ = run_cli("diff", str(dcp_checkpoint("fsdp4")), str(store_copy), "--no-verify-source")
    assert code == 1 and KEY in out


def test_sound_sources_convert_with_verification(store, dcp_checkpoint, tmp_path):
    """The default (checked) path writes what torch's own reader reads as the source."""
    from oracle import assert_same_value, torch_reference

    out = tmp_path / "tp"
    ok(run_cli("from-universal", str(store), str(out), "--mesh", "tp2,dp2", "--plan", "llama"))
    assert_same_value(torch_reference(out), torch_reference(dcp_checkpoint("fsdp4")))


# ------------------------------------------------------------------------------------------------
# each chunk is checked once, whole reads inline, partial reads by one streamed pass


def _spy(monkeypatch) -> dict[object, int]:
    """Count how often each chunk's check ran (successfully): a whole check, or a ledger of parts
    compared once complete."""
    ran: dict[object, int] = {}
    once, settle = ChunkChecks.once, ChunkChecks._settle

    def counting(self, chunk, check):
        did = once(self, chunk, check)
        if did:
            ran[chunk] = ran.get(chunk, 0) + 1
        return did

    def settling(self, chunk, pending):
        settle(self, chunk, pending)
        ran[chunk] = ran.get(chunk, 0) + 1

    monkeypatch.setattr(ChunkChecks, "once", counting)
    monkeypatch.setattr(ChunkChecks, "_settle", settling)
    return ran


@pytest.mark.parametrize("conversion", ["to-universal-partial", "from-universal-dp3", "dcp-reshard", "export-hf"])
def test_each_source_chunk_is_checked_once_per_run(conversion, store, dcp_checkpoint, tmp_path, monkeypatch):
    ran = _spy(monkeypatch)
    ckpt = dcp_checkpoint("fsdp4")
    opts = RunOptions(workers=4)
    if conversion == "to-universal-partial":
        src = ckpt
        api.to_universal(ckpt, tmp_path / "o", opts, chunk_bytes=1000)
    elif conversion == "from-universal-dp3":
        src = store
        api.from_universal(store, tmp_path / "o", "dp3", options=opts)
    elif conversion == "dcp-reshard":
        src = ckpt
        api.from_universal(ckpt, tmp_path / "o", "tp2,dp2", plan="llama", options=opts)
    else:
        src = store
        api.export_hf(store, tmp_path / "o", options=opts)
    reader = api.open_checkpoint(src)
    chunks = {c.locator: key for key, e in reader.index().tensors.items() for c in e.chunks if c.box.numel}
    if conversion == "export-hf":
        chunks = {loc: k for loc, k in chunks.items() if k.startswith("model.")}
    assert set(ran) == set(chunks)
    assert set(ran.values()) == {1}


def _count_reads(monkeypatch) -> list[int]:
    """The sizes of every read of a DCP item's bytes (headers and data)."""
    sizes: list[int] = []
    fill = archive.SliceReader._fill

    def counting(self, view, offset):
        sizes.append(len(view))
        return fill(self, view, offset)

    monkeypatch.setattr(archive.SliceReader, "_fill", counting)
    return sizes


def test_dcp_reader_checks_parts_in_memory(dcp_checkpoint, monkeypatch):
    """A chunk read in parts, in any order, is checked on the bytes read (CRC-32s combined), by the
    read that completes it: no streamed pass, each byte read once."""
    streamed, compared = [], []
    monkeypatch.setattr(archive, "verify_crc", lambda *a: streamed.append(a))
    monkeypatch.setattr(archive, "check_crc", lambda at, crc, where, f=archive.check_crc: (compared.append(where), f(at, crc, where))[1])
    from formats.base import Box

    with DCPReader(dcp_checkpoint("fsdp4"), verify=True) as reader:
        a, b = reader.index().tensors[KEY].chunks[:2]
        reader.chunk_archive(KEY, b)  # headers parsed before counting
        whole = reader.read_region_array(KEY, a, a.box)  # whole chunk: checked on the bytes read
        assert len(compared) == 1
        reader.read_region_array(KEY, a, a.box)
        assert len(compared) == 1
        reads = _count_reads(monkeypatch)
        rows = [Box((b.box.offsets[0] + r, 0), (1, 32)) for r in range(b.box.sizes[0])]
        order = rows[1::2] + rows[::2]  # out of order: odd rows first
        for i, r in enumerate(order):
            assert reader.pending_checks([b]) == (0 < i)
            reader.read_region_array(KEY, b, r)
        assert len(compared) == 2 and not streamed and not reader.pending_checks([b])
        assert sum(reads) == b.box.numel * 4  # every byte once
        assert reader.finish_checks() == 0
    with DCPReader(dcp_checkpoint("fsdp4")) as plain:
        assert (plain.read_region_array(KEY, a, a.box) == whole).all()


def test_dcp_reader_finishes_what_no_read_covered(dcp_checkpoint_copy, monkeypatch):
    """A chunk read only in part is completed by finish_checks, which reads just the gap; a damaged
    byte in that gap fails there."""
    from formats.base import Box

    ckpt = dcp_checkpoint_copy("fsdp4")
    with DCPReader(ckpt, verify=True) as reader:
        b = reader.index().tensors[KEY].chunks[1]
        reader.chunk_archive(KEY, b)
        reads = _count_reads(monkeypatch)
        reader.read_region_array(KEY, b, Box(b.box.offsets, (5, 32)))
        assert reader.pending_checks([b])
        assert reader.finish_checks() == 1 and not reader.pending_checks([b])
        assert sum(reads) == b.box.numel * 4
    flip_dcp_chunk(ckpt, KEY)  # a byte in the middle: rows not read below
    with DCPReader(ckpt, verify=True) as reader:
        b = reader.index().tensors[KEY].chunks[1]
        reader.read_region_array(KEY, b, Box(b.box.offsets, (5, 32)))
        with pytest.raises(CorruptCheckpointError, match="CRC-32 mismatch"):
            reader.finish_checks()


def test_store_reader_hashes_parts_in_order(store_copy, monkeypatch):
    """A store chunk read in parts is hashed on the bytes read, in order: a part read ahead of the
    bytes hashed so far first has the gap read; a damaged byte fails the read that completes it."""
    from formats.base import Box
    from formats.universal import store as store_module

    reader = UniversalReader(store_copy, verify=True)
    entry = reader.index().tensors[KEY]
    chunk = entry.chunks[0]
    n = chunk.box.sizes[0]
    preads: list[int] = []
    pread = store_module.UniversalReader._pread
    monkeypatch.setattr(store_module.UniversalReader, "_pread",
                        lambda self, record, c, into, offset: (preads.append(len(into)), pread(self, record, c, into, offset))[1])
    row = chunk.box.sizes[1] * 4
    first = Box(chunk.box.offsets, (n // 2, chunk.box.sizes[1]))
    second = Box((chunk.box.offsets[0] + n // 2, chunk.box.offsets[1]), (n - n // 2, chunk.box.sizes[1]))
    reader.read_region(KEY, chunk, first)
    assert reader.pending_checks([chunk])
    reader.read_region(KEY, chunk, second)
    assert not reader.pending_checks([chunk]) and sum(preads) == n * row
    preads.clear()
    other = entry.chunks[1]
    later = Box((other.box.offsets[0] + 1, other.box.offsets[1]), (other.box.sizes[0] - 1, other.box.sizes[1]))
    reader.read_region(KEY, other, later)  # ahead: row 0 is read for the hash first
    assert not reader.pending_checks([other]) and sum(preads) == other.box.numel * 4  # the gap + the rest
    flip_byte(store_chunk_file(store_copy, KEY, 2), 3 * row + 1)
    damaged = entry.chunks[2]
    reader.read_region(KEY, damaged, Box(damaged.box.offsets, (2, damaged.box.sizes[1])))
    with pytest.raises(CorruptCheckpointError, match="xxh3_64"):
        reader.read_region(KEY, damaged, Box((damaged.box.offsets[0] + 2, damaged.box.offsets[1]),
                                             (damaged.box.sizes[0] - 2, damaged.box.sizes[1])))


def test_dcp_reader_checks_empty_0d_and_strided_chunks(tmp_path):
    """Whole-chunk reads of an empty, a 0-d and a transposed tensor are checked and equal what
    torch's dcp.load reads (an empty chunk's bytes could not be viewed for its CRC-32)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    sd = {"empty": torch.empty(0, 3), "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
          "t": torch.arange(6.0).reshape(2, 3).t(), "e3": torch.ones(2, 0, 4, dtype=torch.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=tmp_path / "ckpt")
        back = {k: torch.full_like(v, 7) for k, v in sd.items()}
        dcp.load(back, checkpoint_id=tmp_path / "ckpt")
    with DCPReader(tmp_path / "ckpt", verify=True) as reader:
        for key, entry in reader.index().tensors.items():
            (chunk,) = entry.chunks
            got = reader.read_region(key, chunk, chunk.box)
            assert got.shape == back[key].shape and torch.equal(got, back[key]), key
            out = bytearray(chunk.box.numel * got.element_size())
            reader.read_region_into(key, chunk, chunk.box, memoryview(out))
            assert bytes(out) == back[key].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), key


def test_hf_file_changed_after_its_header_was_read(dcp_checkpoint, tmp_path):
    """safetensors has no checksums; a file whose size no longer matches its header is refused."""
    hf = tmp_path / "hf"
    ok(run_cli("export-hf", str(dcp_checkpoint("fsdp4")), str(hf)))
    reader = HFReader(hf)
    with open(hf / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    e = reader.index().tensors["output.weight"]
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.*changed"):
        reader.read_region(e.key, e.chunks[0], e.chunks[0].box)


# ------------------------------------------------------------------------------------------------
# point 9: one rule for every reader, no reading through symlinks out of the checkpoint


def test_store_chunk_symlink_out_of_the_store_is_refused(store_copy, tmp_path):
    file = store_chunk_file(store_copy, KEY)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(file.read_bytes())  # same size and bytes: only the link is wrong
    file.unlink()
    file.symlink_to(outside)
    for args in [("inspect", str(store_copy), "--stats", KEY),
                 ("from-universal", str(store_copy), str(tmp_path / "dp3"), "--mesh", "dp3"),
                 ("export-hf", str(store_copy), str(tmp_path / "hf"))]:
        one_line_error(run_cli(*args), str(file), "outside the checkpoint directory")
    assert not (tmp_path / "dp3" / ".metadata").exists() and not (tmp_path / "hf" / "model.safetensors").exists()
    assert not api.verify(store_copy).ok


def test_store_symlinks_inside_the_store_are_followed(store_copy, tmp_path):
    file = store_chunk_file(store_copy, KEY)
    moved = store_copy / "moved.bin"
    file.rename(moved)
    file.symlink_to(moved)
    ok(run_cli("from-universal", str(store_copy), str(tmp_path / "dp3"), "--mesh", "dp3"))


def test_dcp_and_hf_files_symlinked_out_are_refused(dcp_checkpoint_copy, tmp_path):
    ckpt = dcp_checkpoint_copy("fsdp4")
    distcp = ckpt / "__1_0.distcp"
    shutil.move(distcp, tmp_path / "elsewhere.distcp")
    distcp.symlink_to(tmp_path / "elsewhere.distcp")
    one_line_error(run_cli("inspect", str(ckpt)), "__1_0.distcp", "outside the checkpoint directory")
    one_line_error(run_cli("to-universal", str(ckpt), str(tmp_path / "u")), "__1_0.distcp", "outside")
    hf = tmp_path / "hf"
    ok(run_cli("export-hf", str(dcp_checkpoint_copy("fsdp4")), str(hf)))
    shutil.move(hf / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (hf / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    one_line_error(run_cli("inspect", str(hf)), "model.safetensors", "outside the checkpoint directory")


# ------------------------------------------------------------------------------------------------
# point 10: clean one-line errors for symlink loops, deep JSON and over-long names


def _loop(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    path.symlink_to(path.name)


def test_symlink_loops_in_a_store(store_copy, tmp_path):
    chunk = store_chunk_file(store_copy, KEY, 1)  # read when copied (the first chunk is checked on open)
    first = store_chunk_file(store_copy, "model.output.weight")
    _loop(chunk)
    one_line_error(run_cli("inspect", str(store_copy), "--stats", KEY), str(chunk), "symlink loop")
    one_line_error(run_cli("from-universal", str(store_copy), str(tmp_path / "o"), "--mesh", "dp2"), "symlink loop")
    _loop(first)
    one_line_error(run_cli("inspect", str(store_copy)), str(first), "symlink loop")
    array = first.parents[2]
    _loop(array)
    one_line_error(run_cli("inspect", str(store_copy)), "symlink loop")
    _loop(store_copy / "ckptconv.json")
    one_line_error(run_cli("inspect", str(store_copy)), str(store_copy))


def test_symlink_loops_in_dcp_and_hf(dcp_checkpoint_copy, tmp_path):
    ckpt = dcp_checkpoint_copy("fsdp4")
    _loop(ckpt / "__2_0.distcp")
    one_line_error(run_cli("inspect", str(ckpt)), "__2_0.distcp", "symlink loop")
    one_line_error(run_cli("to-universal", str(ckpt), str(tmp_path / "u")), "__2_0.distcp", "symlink loop")
    _loop(ckpt / ".metadata")
    one_line_error(run_cli("inspect", str(ckpt)), ".metadata")
    hf = tmp_path / "hf"
    ok(run_cli("export-hf", str(dcp_checkpoint_copy("fsdp4")), str(hf), "--max-shard-size", "20kB"))
    shard = sorted(hf.glob("model-*.safetensors"))[0]
    _loop(shard)
    one_line_error(run_cli("inspect", str(hf)), shard.name, "symlink loop")
    one_line_error(run_cli("import-hf", str(hf), str(tmp_path / "u2")), shard.name, "symlink loop")


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [100_000, 900])
def test_deeply_nested_store_json(store_copy, tmp_path, depth):
    meta = store_copy / "ckptconv.json"
    doc = json.loads(meta.read_text())
    meta.write_text(json.dumps(doc)[:-1] + ', "x": ' + _deep(depth) + "}")
    one_line_error(run_cli("inspect", str(store_copy)), str(meta))
    one_line_error(run_cli("from-universal", str(store_copy), str(tmp_path / "o"), "--mesh", "dp2"), str(meta))
    meta.write_text(_deep(depth))
    one_line_error(run_cli("inspect", str(store_copy)), str(meta))


def test_deeply_nested_zarr_json_is_a_verify_problem(store_copy):
    array_json = store_chunk_file(store_copy, KEY).parents[2] / "zarr.json"
    array_json.write_text(_deep(100_000))
    code, out, err = run_cli("verify", str(store_copy))
    assert code == 1 and "Traceback" not in out + err and "internal error" not in err, (code, out, err)
    assert "zarr.json" in out


@pytest.mark.parametrize("where", ["header", "index"])
def test_deeply_nested_hf_json(dcp_checkpoint, tmp_path, where):
    hf = tmp_path / "hf"
    ok(run_cli("export-hf", str(dcp_checkpoint("fsdp4")), str(hf), "--max-shard-size", "20kB"))
    if where == "index":
        bad = hf / "model.safetensors.index.json"
        bad.write_text(_deep(100_000))
    else:
        bad = sorted(hf.glob("model-*.safetensors"))[0]
        text = _deep(100_000).encode()
        bad.write_bytes(len(text).to_bytes(8, "little") + text)
    one_line_error(run_cli("inspect", str(hf)), bad.name)
    one_line_error(run_cli("import-hf", str(hf), str(tmp_path / "u")), bad.name)


@pytest.mark.parametrize("name", ["x" * 5000, "/".join(["d" * 200] * 30) + "/__0_0.distcp"],
                         ids=["long-name", "long-path"])
def test_over_long_relative_path_in_dcp_metadata(dcp_checkpoint_copy, tmp_path, name):
    ckpt = dcp_checkpoint_copy("fsdp4")
    md = pickle.loads((ckpt / ".metadata").read_bytes())  # the fixture's own file: trusted
    index = next(i for i in md.storage_data if i.fqn == KEY)
    info = md.storage_data[index]
    md.storage_data[index] = _StorageInfo(name, info.offset, info.length)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    for args in [("inspect", str(ckpt)), ("to-universal", str(ckpt), str(tmp_path / "u")),
                 ("from-universal", str(ckpt), str(tmp_path / "o"), "--mesh", "dp2")]:
        line = one_line_error(run_cli(*args), repr(KEY))
        assert len(line) < 1000
    code, out, err = run_cli("verify", str(ckpt))
    assert code == 1 and "Traceback" not in out + err and "internal error" not in err


def test_over_long_file_name_in_hf_index(dcp_checkpoint, tmp_path):
    hf = tmp_path / "hf"
    ok(run_cli("export-hf", str(dcp_checkpoint("fsdp4")), str(hf), "--max-shard-size", "20kB"))
    index = hf / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"][next(iter(doc["weight_map"]))] = "y" * 5000 + ".safetensors"
    index.write_text(json.dumps(doc))
    line = one_line_error(run_cli("inspect", str(hf)), "model.safetensors.index.json")
    assert len(line) < 1000
    one_line_error(run_cli("import-hf", str(hf), str(tmp_path / "u")))
    assert os.path.isdir(hf)


def test_reader_views_forward_the_source_checks():
    """The executor completes a source's open checks through every view over it (renamed, dequantized,
    quantized): a view that dropped them would leave chunks read in parts unchecked."""
    from converter.run.mapped_reader import MappedReader
    from converter.run.quant_reader import DequantizedReader, QuantizingReader
    from formats.base import Box, ChunkRef

    class Inner:
        def __init__(self):
            self.calls = []

        def pending_checks(self, chunks):
            self.calls.append(("pending", list(chunks)))
            return True

        def finish_checks(self, workers=1):
            self.calls.append(("finish", workers))
            return 7

    src = ChunkRef(Box((0,), (4,)), "f", "loc")
    for cls in (MappedReader, DequantizedReader, QuantizingReader):
        view = object.__new__(cls)
        view.reader = Inner()
        assert view.finish_checks(3) == 7 and view.reader.calls == [("finish", 3)], cls
        chunk = ChunkRef(src.box, "f", type("Loc", (), {"chunk": src})()) if cls is MappedReader else src
        assert view.pending_checks([chunk]) and view.reader.calls[-1] == ("pending", [src]), cls
