"""The reader protocol (formats/base.py) held by every reader: DCP, the universal store (both
backends), Hugging Face safetensors (written by the safetensors library itself), DCP's per-rank
safetensors storage (torch's ``HuggingFaceStorageWriter``) and export-hf's mapped view; ``read_region_into`` gives exactly the bits of ``read_region``, and both give the
bits torch saved. And the DCP checks verify uses (formats/dcp/checks.py) on their own."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from converter import api
from converter.config import RunOptions
from formats.base import Box, CheckpointReader, TensorReader
from formats.dcp import DCPReader
from formats.dcp_safetensors import DCPSafetensorsReader
from formats.dcp.checks import Overlap, check_archive, overlapping_items
from formats.dtypes import to_storage_array
from formats.errors import CorruptCheckpointError
from formats.hf import HFReader
from formats.universal import UniversalReader

STATE = {
    "w": torch.randn(13, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    "ids": torch.arange(24, dtype=torch.int32).reshape(2, 3, 4),
    "h": torch.linspace(-2, 2, 10, dtype=torch.float16),
    "s": torch.tensor(3.0),
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("protocol")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(STATE, checkpoint_id=str(root / "dcp"))
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        dcp.save(STATE, storage_writer=HuggingFaceStorageWriter(str(root / "dcp-st"), save_distributed=True))
    for backend in ("zarr", "safetensors"):
        api.to_universal(root / "dcp", root / backend, RunOptions(workers=2), chunk_bytes=40, backend=backend)
    (root / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in STATE.items()}, str(root / "hf" / "model.safetensors"))
    return root


def _readers(roots):
    from converter.plan.mapped_view import Source
    from converter.run.mapped_reader import MappedReader

    dcp_reader = DCPReader(roots / "dcp")
    perm = np.arange(13)[::-1].copy()  # the mapped view reverses w's rows
    view = MappedReader(DCPReader(roots / "dcp"), {"w_rev": Source("w", perm), "ids": Source("ids")})
    return {"dcp": dcp_reader, "zarr": UniversalReader(roots / "zarr"), "safetensors": UniversalReader(roots / "safetensors"),
            "hf": HFReader(roots / "hf"), "view": view, "dcp-st": DCPSafetensorsReader(roots / "dcp-st")}


def _expected(name: str, key: str) -> torch.Tensor:
    return STATE["w"].flip(0) if key == "w_rev" else STATE[key]


def _regions(box: Box):
    yield box
    if box.ndim and box.sizes[0] > 1:  # a row run, and a column block (not one dense run)
        yield Box(box.offsets, (box.sizes[0] - 1, *box.sizes[1:]))
        yield Box(box.offsets, (box.sizes[0], *(max(1, s - 1) for s in box.sizes[1:])))


@pytest.mark.parametrize("which", ["dcp", "zarr", "safetensors", "hf", "view", "dcp-st"])
def test_read_region_into_is_read_region_is_what_torch_saved(roots, which):
    reader = _readers(roots)[which]
    assert isinstance(reader, CheckpointReader)
    for key, entry in reader.index().tensors.items():
        want = to_storage_array(_expected(which, key))
        for chunk in entry.chunks:
            for region in _regions(chunk.box):
                bits = to_storage_array(reader.read_region(key, chunk, region))
                out = np.empty(region.sizes, dtype=bits.dtype)
                reader.read_region_into(key, chunk, region, memoryview(out.reshape(-1).view(np.uint8)))
                expect = want[region.slices()] if region.ndim else want
                assert np.array_equal(bits, expect) and np.array_equal(out, expect), (which, key, region)
    reader.close()


def test_tensor_reader_gives_tensor_only_readers_the_protocol():
    class Only(TensorReader):
        def index(self):
            raise NotImplementedError

        def read_region(self, key, chunk, region):
            return STATE["w"][region.slices()].clone()

        def read_object_bytes(self, key):
            raise KeyError(key)

        def load_object(self, key, trust_pickle=False):
            raise KeyError(key)

        def close(self):
            pass

    region = Box((2, 1), (3, 4))
    out = np.empty(region.sizes, dtype=np.uint16)
    Only().read_region_into("w", None, region, memoryview(out.reshape(-1).view(np.uint8)))
    assert isinstance(Only(), CheckpointReader)
    assert np.array_equal(out, to_storage_array(STATE["w"][2:5, 1:5]))


def test_dcp_archive_checks(roots, tmp_path):
    import shutil

    root = tmp_path / "dcp"
    shutil.copytree(roots / "dcp", root)
    with DCPReader(root) as reader:
        index = reader.index()
        assert overlapping_items(index) == []
        chunk = index.tensors["w"].chunks[0]
        assert reader.check_chunk_archive("w", chunk) >= STATE["w"].numel() * 2
        assert reader.check_chunk_archive("w", chunk, whole_item_bytes=0) == reader.check_chunk_archive("w", chunk)
        first = next(iter(index.objects), None)
        if first is not None:
            assert reader.check_object_archive(first) > 0
        pos = chunk.locator.offset + reader.chunk_archive("w", chunk).data_start + 3  # a byte of w's data
    data = bytearray((root / chunk.file).read_bytes())
    data[pos] ^= 0x10
    (root / chunk.file).write_bytes(bytes(data))
    for whole in (0, 1 << 20):  # streamed and read whole
        with DCPReader(root) as reader, pytest.raises(CorruptCheckpointError) as e:
            reader.check_chunk_archive("w", reader.index().tensors["w"].chunks[0], whole_item_bytes=whole)
        assert chunk.file in str(e.value) and "'w'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CorruptCheckpointError, match="zip"):
        from formats.dcp.archive import BufferReader

        check_archive(BufferReader(b"not a zip archive", "x"), "x")


def test_overlapping_items_names_both_keys():
    from formats.base import CheckpointIndex, ChunkRef, TensorEntry
    from formats.dcp.metadata import StorageInfo

    def entry(key: str, offset: int) -> TensorEntry:
        loc = StorageInfo("__0_0.distcp", offset, 100)
        return TensorEntry(key, "float32", (5,), (ChunkRef(Box((0,), (5,)), "__0_0.distcp", loc),), (key,))

    index = CheckpointIndex("dcp", "/x", {"a": entry("a", 0), "b": entry("b", 60), "c": entry("c", 200)}, {})
    assert overlapping_items(index) == [Overlap("__0_0.distcp", (0, 100, "a"), (60, 100, "b"))]
