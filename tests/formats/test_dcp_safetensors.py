"""DCP's safetensors storage as a source (formats/dcp_safetensors.py), on real saves.

Every checkpoint here was written by a real multi-process ``dcp.save`` through torch's
``HuggingFaceStorageWriter(save_distributed=True)`` (:mod:`hf_storage_factory`). The oracles are
torch's own ``HuggingFaceStorageReader`` (its ``read_metadata`` and a ``dcp.load`` of every tensor)
and the values the saving job held. Damaged headers and sharding metadata (hand-made and a seeded
corpus of byte edits) end in one-line errors.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import hf_storage_factory as hfs
from cli_runner import run_cli
from formats.base import CheckpointReader
from formats.dcp_safetensors import DCPSafetensorsReader, rank_of_file, shard_file_name
from formats.dtypes import by_name, to_storage_array
from formats.errors import CkptConvError, CorruptCheckpointError

KINDS = ["fsdp3", "tp2dp2", "ep2dp2", "dtypes3", "dense2_float"]


def _whole(reader: DCPSafetensorsReader, key: str) -> np.ndarray:
    """The whole tensor ``key`` assembled from its chunks by ``read_region_into``."""
    entry = reader.index().tensors[key]
    d = by_name(entry.dtype)
    out = np.zeros(entry.shape, dtype=d.numpy_dtype)
    for chunk in entry.chunks:
        buf = np.empty(chunk.box.sizes, dtype=d.numpy_dtype)
        reader.read_region_into(key, chunk, chunk.box, memoryview(buf.reshape(-1).view(np.uint8)))
        out[chunk.box.slices()] = buf
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_index_is_torchs_metadata(kind):
    """Keys, dtypes, global shapes and chunk boxes are those torch's HuggingFaceStorageReader builds;
    each chunk lies in the file torch reads it from, and its rank is that file's rank."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    root = hfs.shards(kind)
    md = HuggingFaceStorageReader(str(root)).read_metadata()
    reader = DCPSafetensorsReader(root)
    assert isinstance(reader, CheckpointReader)
    index = reader.index()
    assert index.format == "dcp-safetensors" and index.objects == {}
    assert set(index.tensors) == set(md.state_dict_metadata)
    files = {(mi.fqn, tuple(mi.offset)): Path(info.relative_path).name for mi, info in md.storage_data.items()}
    for key, entry in index.tensors.items():
        tmd = md.state_dict_metadata[key]
        assert by_name(entry.dtype).torch_dtype == tmd.properties.dtype, key
        assert entry.shape == tuple(tmd.size), key
        assert sorted((c.box.offsets, c.box.sizes) for c in entry.chunks) == sorted(
            {(tuple(c.offsets), tuple(c.sizes)) for c in tmd.chunks}), key
        for c in entry.chunks:
            if c.box.numel:
                assert files[(key, c.box.offsets)] == c.file, key
            assert c.rank == rank_of_file(c.file) and c.file == shard_file_name(c.rank)
    assert index.info["world_size"] == hfs.KINDS[kind].world


@pytest.mark.parametrize("kind", KINDS)
def test_every_tensor_reads_as_torch_reads_it(kind):
    """Every tensor assembled from its chunks is bit for bit what torch's reader loads and what the
    saving job held (fp8 specials, NaN payloads, -0.0, bool, ints, 0-d, empty, uneven shards)."""
    root = hfs.shards(kind)
    torch_read, held = hfs.torch_hf_read(root), hfs.reference(kind)
    reader = DCPSafetensorsReader(root)
    assert set(torch_read) == set(reader.index().tensors) == set(held)
    for key in reader.index().tensors:
        ours = _whole(reader, key)
        for name, want in (("torch's reader", torch_read[key]), ("the saving job", held[key])):
            want_bits = to_storage_array(want.contiguous())
            assert ours.dtype == want_bits.dtype and ours.shape == want_bits.shape, (key, name)
            assert ours.tobytes() == want_bits.tobytes(), (key, name)
        for chunk in reader.index().tensors[key].chunks:  # and region reads inside a chunk
            if chunk.box.ndim == 2 and min(chunk.box.sizes) > 1:
                from formats.base import Box

                part = Box(tuple(o + 1 for o in chunk.box.offsets), tuple(s - 1 for s in chunk.box.sizes))
                got = to_storage_array(reader.read_region(key, chunk, part))
                assert got.tobytes() == np.ascontiguousarray(ours[part.slices()]).tobytes()


def test_inspect_shows_which_rank_file_holds_which_box():
    code, out, err = run_cli("inspect", str(hfs.shards("tp2dp2")), "--layout", "model.layers.0.attention.wq.weight")
    assert code == 0, err
    for rank in range(4):
        assert f"rank {rank}  {shard_file_name(rank)}" in out
    code, out, err = run_cli("inspect", str(hfs.shards("tp2dp2")))
    assert code == 0 and "dcp-safetensors" in out and "world size: 4" in out, out
    assert "2-D" in out or "TP" in out, out


def test_inspect_json_validates():
    import jsonschema

    code, out, err = run_cli("inspect", str(hfs.shards("ep2dp2")), "--json")
    assert code == 0, err
    doc = json.loads(out)
    schema = json.loads((Path(__file__).resolve().parents[2] / "schemas" / "inspect.schema.json").read_text())
    jsonschema.validate(doc, schema)
    assert doc["format"] == "dcp-safetensors" and doc["world_size"] == 4


def test_consolidated_folder_is_plain_hf_and_its_sharded_folder_the_per_rank_form(tmp_path):
    root = hfs.get("dense2_float") / "ckpt"
    code, out, _ = run_cli("inspect", str(root))
    assert code == 0 and "format: hf" in out
    code, out, _ = run_cli("inspect", str(root / "sharded"))
    assert code == 0 and "format: dcp-safetensors" in out
    only = tmp_path / "save"  # a save whose consolidation never ran: only sharded/
    shutil.copytree(root / "sharded", only / "sharded")
    code, out, err = run_cli("inspect", str(only))
    assert code == 2 and err.count("\n") == 1 and f"pass {only / 'sharded'}" in err, err


def test_verify_reads_every_chunk():
    code, out, err = run_cli("verify", str(hfs.shards("dtypes3")))
    assert code == 0 and out.startswith("ok:") and "dcp-safetensors" in out, out + err


# ---------------------------------------------------------------------------------------------
# damaged headers and sharding metadata


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _edit_sharding(path: Path, edit) -> None:
    header, data = _split(path)
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    header["__metadata__"]["DCP_SHARDING_INFO"] = edit(info) if not isinstance(edit, str) else edit
    if not isinstance(edit, str):
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(header["__metadata__"]["DCP_SHARDING_INFO"])
    _join(path, header, data)


def _first_key(info: dict, dims: int = 2) -> str:
    return next(k for k, v in info.items() if len(v["saved_offsets"]) == dims)


DAMAGE = {
    "sharding not json": (lambda p: _edit_sharding(p, "{not json"), "not JSON"),
    "sharding not an object": (lambda p: _edit_sharding(p, lambda i: [1, 2]), "not a JSON object"),
    "offsets missing": (lambda p: _edit_sharding(p, lambda i: {k: v for k, v in list(i.items())[1:]}), "no saved_offsets"),
    "offsets wrong rank": (lambda p: _edit_sharding(p, lambda i: {**i, _first_key(i): {"saved_offsets": [0]}}), "bad saved_offsets"),
    "offset negative": (lambda p: _edit_sharding(p, lambda i: {**i, _first_key(i): {"saved_offsets": [-1, 0]}}), "bad saved_offsets"),
    "offset not int": (lambda p: _edit_sharding(p, lambda i: {**i, _first_key(i): {"saved_offsets": [0.5, 0]}}), "bad saved_offsets"),
    "offset moved (overlap or gap)": (lambda p: _edit_sharding(
        p, lambda i: {**i, _first_key(i): {"saved_offsets": [i[_first_key(i)]["saved_offsets"][0] + 1, 0]}}),
        "chunks"),
    "header truncated": (lambda p: p.write_bytes(p.read_bytes()[:40]), "safetensors"),
    "data truncated": (lambda p: p.write_bytes(p.read_bytes()[:-3]), "truncated"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_file_is_a_one_line_error(tmp_path, damage):
    root = tmp_path / "ckpt"
    shutil.copytree(hfs.shards("fsdp3"), root)
    mutate, words = DAMAGE[damage]
    mutate(root / shard_file_name(1))
    with pytest.raises(CkptConvError) as e:
        DCPSafetensorsReader(root)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
    assert shard_file_name(1) in str(e.value) or "key" in str(e.value), str(e.value)
    code, out, err = run_cli("inspect", str(root))
    assert code == 2 and err.startswith("ckptconv: error:") and err.count("\n") == 1, err


def test_a_missing_rank_file_names_the_gap(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(hfs.shards("fsdp3"), root)
    (root / shard_file_name(1)).unlink()
    with pytest.raises(CorruptCheckpointError, match="rank's shard file is missing"):
        DCPSafetensorsReader(root)


def test_files_of_two_checkpoints_are_refused(tmp_path):
    """A tensor of one dtype in one file and another in the next: not one checkpoint."""
    root = tmp_path / "ckpt"
    shutil.copytree(hfs.shards("fsdp3"), root)
    header, data = _split(root / shard_file_name(2))
    key = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32" and v["shape"])
    header[key]["dtype"] = "I32"
    _join(root / shard_file_name(2), header, data)
    with pytest.raises(CorruptCheckpointError, match="not of one checkpoint"):
        DCPSafetensorsReader(root)


@pytest.mark.parametrize("seed", range(40))
def test_byte_edits_of_headers_end_in_one_line_or_a_correct_read(tmp_path, seed):
    """A seeded corpus: bytes of a header (length prefix, JSON, sharding string) overwritten; the
    reader either refuses with one line or reads exactly what torch's reader reads."""
    rng = random.Random(seed)
    root = tmp_path / "ckpt"
    shutil.copytree(hfs.shards("dtypes3"), root)
    victim = root / shard_file_name(rng.randrange(3))
    raw = bytearray(victim.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    for _ in range(rng.choice([1, 2, 5])):
        pos = rng.randrange(0, 8 + n)
        raw[pos] = rng.choice([0, 0x22, 0x2C, 0x30 + rng.randrange(10), 0x7B, 0x7D, 0xFF, rng.randrange(256)])
    victim.write_bytes(bytes(raw))
    try:
        reader = DCPSafetensorsReader(root)
    except CkptConvError as e:
        assert "\n" not in str(e) and len(str(e)) < 1000
        return
    try:
        want = hfs.torch_hf_read(root)
    except Exception:  # torch cannot read it either, yet ours did: it must then hold the same tensors
        want = None
    for key in reader.index().tensors:
        got = _whole(reader, key)
        if want is not None and key in want:
            assert got.tobytes() == to_storage_array(want[key].contiguous()).tobytes(), key


def test_reader_needs_no_torch(tmp_path):
    """The per-rank reader and its region reads import no torch (a subprocess checks)."""
    import subprocess
    import sys

    code = ("import sys\nfrom formats.dcp_safetensors import DCPSafetensorsReader\n"
            "from formats.dtypes import by_name\n"
            f"r = DCPSafetensorsReader({str(hfs.shards('dtypes3'))!r})\n"
            "for k, e in r.index().tensors.items():\n"
            "    for c in e.chunks:\n"
            "        r.read_region_into(k, c, c.box, memoryview(bytearray(c.box.numel * by_name(e.dtype).itemsize)))\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr


def test_fast_shard_headers_are_the_general_builders(tmp_path):
    """plan_shard_files' headers (joined from cached JSON pieces) are byte for byte what
    formats.hf.build_header makes of sharding_metadata, on random files: names with quotes,
    backslashes, control characters and non-ASCII, every dtype, 0-d, empty and 4-d boxes."""
    from types import SimpleNamespace

    from formats.base import Box
    from formats.dcp_safetensors import _Fragments, plan_shard_file_slow
    from formats.dtypes import BY_NAME

    rng = random.Random(7)
    dtypes = [d for d in BY_NAME if d not in ("float8_e8m0fnu", "complex128")]
    alphabet = ["a", "b", ".", "0", "9", '"', "\\", "\n", "\x01", "é", "層", "😀", " ", "/"]
    for trial in range(60):
        keys = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 30))})
        group = []
        for k in keys:
            ndim = rng.choice([0, 1, 2, 4])
            sizes = tuple(rng.choice([0, 1, 3, 17]) for _ in range(ndim))
            offs = tuple(rng.choice([0, 5, 10**12]) for _ in range(ndim))
            group.append(SimpleNamespace(key=k, dtype=rng.choice(dtypes), box=Box(offs, sizes), rank=0))
        fast, slow = _Fragments().plan("f", group), plan_shard_file_slow("f", group)
        assert fast.header == slow.header, trial
        assert dict(fast.offsets) == dict(slow.offsets) and fast.tensors == slow.tensors, trial


def test_a_file_ckptconvs_marker_lists_must_be_there(tmp_path):
    """ckptconv's outputs list their per-rank files; a missing one is named (even the last rank's,
    which coverage alone cannot tell: the global shape shrinks with it)."""
    from converter.run.destination import ST_MARKER
    from formats.dcp_safetensors import COMPLETE_MARKER

    assert ST_MARKER == COMPLETE_MARKER
    out = tmp_path / "out"
    assert run_cli("from-universal", str(hfs.shards("dtypes3")), str(out), "--mesh", "dp2", "--format",
                   "dcp-safetensors", "--consolidate")[0] == 0
    DCPSafetensorsReader(out / "sharded")
    (out / "sharded" / shard_file_name(1)).unlink()
    with pytest.raises(CorruptCheckpointError, match="missing .1 of the 2 per-rank files"):
        DCPSafetensorsReader(out / "sharded")
