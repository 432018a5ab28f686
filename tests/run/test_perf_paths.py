"""The fast paths of issue 5 give the same bytes as the plain ones.

- ``.metadata`` pickled from stand-ins (no ``torch.distributed.checkpoint`` import) unpickles to
  exactly the ``Metadata`` torch's classes build;
- pieces filled in place in pooled buffers (``read_region_into``) equal pieces assembled from
  ``read_region`` tensors, for dense and non-dense regions, from DCP and universal sources.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import torch

from converter.run.executor import _dense_offset, _fill_piece_tensors, fill_piece
from converter.plan.copy_tasks import plan_tensor
from formats.base import Box
from formats.dtypes import to_storage_array
from formats.dcp.writer import ChunkSpec, DCPWriter, ObjectSpec


def _writer(root) -> DCPWriter:
    chunks = [
        ChunkSpec("a.w", "float32", (4, 6), Box((0, 0), (2, 6)), 0),
        ChunkSpec("a.w", "float32", (4, 6), Box((2, 0), (2, 6)), 1),
        ChunkSpec("b", "bfloat16", (), Box((), ()), 0),
        ChunkSpec("c", "int64", (3, 0), Box((0, 0), (3, 0)), 1),
    ]
    objects = [ObjectSpec("o", pickle.dumps({"x": 1}), 1)]
    planner = {"a.w": ("a", "w"), "b": ("b",), "c": ("c",), "o": ("o",)}
    return DCPWriter(root, chunks, objects, planner, 2)


def test_metadata_bytes_unpickle_to_torchs_metadata(tmp_path):
    w = _writer(tmp_path / "x")
    ours = pickle.loads(w.metadata_bytes())
    theirs = w.metadata()
    ours.storage_meta.save_id = theirs.storage_meta.save_id
    assert ours == theirs
    assert list(ours.storage_data) == list(theirs.storage_data)
    assert [k.index for k in ours.storage_data] == [k.index for k in theirs.storage_data]
    assert pickle.dumps(ours) == pickle.dumps(theirs)


def test_metadata_bytes_do_not_import_torch_distributed_checkpoint(tmp_path):
    code = (
        "import sys\n"
        "from tests.run.test_perf_paths import _writer\n"
        f"_writer({str(tmp_path / 'y')!r}).metadata_bytes()\n"
        "assert 'torch.distributed.checkpoint' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_dense_offset():
    sizes = (4, 3, 5)
    assert _dense_offset(Box((0, 0, 0), sizes), sizes) == 0
    assert _dense_offset(Box((2, 0, 0), (2, 3, 5)), sizes) == 30
    assert _dense_offset(Box((1, 1, 0), (1, 2, 5)), sizes) == 20
    assert _dense_offset(Box((1, 1, 2), (1, 1, 3)), sizes) == 22
    assert _dense_offset(Box((0, 1, 0), (2, 2, 5)), sizes) is None
    assert _dense_offset(Box((0, 0, 1), (1, 3, 4)), sizes) is None
    assert _dense_offset(Box((), ()), ()) == 0


def _check_pieces(reader, key, targets, piece_bytes):
    entry = reader.index().tensors[key]
    for task in plan_tensor(entry, targets, piece_bytes):
        for piece in task.pieces:
            want = torch.empty(piece.box.sizes, dtype=getattr(torch, task.dtype))
            for c in piece.copies:  # the torch path: read_region tensors assembled by torch
                want[c.region.relative_to(piece.box).slices()] = reader.read_region(task.key, c.src, c.region)
            got = fill_piece(reader, task, piece)  # a bit array of the storage dtype
            bits = to_storage_array(want)
            assert got.dtype == bits.dtype and got.shape == bits.shape
            assert np.array_equal(got, bits)
            assert np.array_equal(_fill_piece_tensors(reader, task, piece), bits)


def test_fill_piece_in_place_matches_read_region(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from converter import api
    from formats.dcp.reader import DCPReader
    from formats.universal import UniversalReader

    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 7, generator=g).to(torch.bfloat16)
    sd = {"w": w, "t": torch.arange(24, dtype=torch.int64).reshape(2, 3, 4), "s": torch.tensor(3.5)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"))
    targets = {
        "w": [(0, Box((0, 0), (10, 7))), (1, Box((3, 2), (5, 4))), (2, Box((9, 0), (1, 7)))],
        "t": [(0, Box((0, 0, 0), (2, 3, 4))), (1, Box((1, 1, 1), (1, 2, 3))), (2, Box((0, 2, 0), (2, 1, 4)))],
        "s": [(0, Box((), ()))],
    }
    with DCPReader(tmp_path / "ckpt") as reader:
        for key, tg in targets.items():
            for piece_bytes in (1 << 20, 16):
                _check_pieces(reader, key, tg, piece_bytes)
    api.to_universal(tmp_path / "ckpt", tmp_path / "uni", api.RunOptions(piece_bytes=64), chunk_bytes=64)
    reader = UniversalReader(tmp_path / "uni")
    for batch in (4 << 20, 1):  # partial rows read all at once, then one row per batch
        monkeypatch.setattr("formats.universal.store.ROWS_BATCH_BYTES", batch)
        for key, tg in targets.items():
            for piece_bytes in (1 << 20, 16):
                _check_pieces(reader, key, tg, piece_bytes)


def test_progress_lines_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    from converter.run import executor as execute

    monkeypatch.setattr(execute, "PROGRESS_LINE_SECONDS", 0.0)
    bar = execute._Progress(2_000_000_000, "converting", None)
    bar.advance(1_200_000_000)
    bar.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("converting: 1.1/1.9 GiB (60 %), ") and "B/s, ETA " in err[0]
    quiet = execute._Progress(2_000_000_000, "converting", False)
    quiet.advance(1_200_000_000)
    assert capsys.readouterr().err == ""
