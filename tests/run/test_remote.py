"""converter/run/remote.py and the public RemoteStorage calls it uses, on fsspec's in-process
``memory://`` filesystem (a real fsspec backend, no server): listing, upload, removal, the marker
uploaded last, ``--overwrite`` refusing what ckptconv did not write, and a conversion whose
destination is a URL read back bit for bit against the tensors torch saved."""

from __future__ import annotations

import uuid
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from converter import api
from converter.config import RunOptions
from converter.run.remote import MARKERS, _files, prepare_remote, upload
from formats.errors import DestinationError
from formats.storage import RemoteStorage


@pytest.fixture
def url() -> str:
    """A fresh prefix of the process-wide memory filesystem."""
    return f"memory://ckptconv-tests/{uuid.uuid4().hex}"


def test_list_all_put_file_remove_all(tmp_path, url):
    st = RemoteStorage(url)
    assert st.list_all() == [] and st.list() == []
    (tmp_path / "f").write_bytes(b"abc")
    st.put_file(tmp_path / "f", "a/b.bin")
    st.put_file(tmp_path / "f", "c.bin")
    assert sorted(st.list_all()) == ["a/b.bin", "c.bin"]
    assert st.list() == ["a", "c.bin"] and st.size("a/b.bin") == 3 and st.read_bytes("c.bin") == b"abc"
    st.refresh()
    st.remove_all()
    assert st.list_all() == [] and RemoteStorage(url).list() == []


def test_upload_sends_data_then_markers(tmp_path, url):
    out = tmp_path / "out"
    (out / "tensors").mkdir(parents=True)
    (out / "tensors" / "c0").write_bytes(b"x" * 10)
    (out / "ckptconv.json").write_bytes(b"{}")
    (out / ".ckptconv-journal.jsonl").write_bytes(b"{}")  # bookkeeping: never uploaded
    data, markers = _files(out)
    assert data == ["tensors/c0"] and markers == ["ckptconv.json"] and set(markers) <= set(MARKERS)
    st = RemoteStorage(url)
    assert upload(out, st, workers=2) == 12
    assert sorted(st.list_all()) == ["ckptconv.json", "tensors/c0"]
    assert not (out / "tensors" / "c0").exists()  # uploaded files leave the spool


def test_prepare_refuses_foreign_objects_and_overlap(tmp_path, url):
    st = RemoteStorage(url)
    (tmp_path / "f").write_bytes(b"keep")
    st.put_file(tmp_path / "f", "important.txt")
    with pytest.raises(DestinationError, match="not empty"):
        prepare_remote(tmp_path / "src", url, overwrite=False)
    with pytest.raises(DestinationError, match="not a ckptconv output"):
        prepare_remote(tmp_path / "src", url, overwrite=True)
    assert st.read_bytes("important.txt") == b"keep"
    with pytest.raises(DestinationError, match="overlaps the source"):
        prepare_remote(url + "/inner", url, overwrite=True)


def test_to_universal_into_a_url_reads_back_exactly(tmp_path, url):
    from formats.universal import UniversalReader

    state = {"w": torch.randn(37, 5).to(torch.bfloat16), "b": torch.arange(11, dtype=torch.int64),
             "s": torch.tensor(2.5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    result = api.to_universal(tmp_path / "dcp", url, RunOptions(workers=2), chunk_bytes=128)
    assert result.dst == url
    st = RemoteStorage(url)
    assert "ckptconv.json" in st.list() and not any(n.startswith(".ckptconv-journal") for n in st.list())
    reader = UniversalReader(url)
    for key, want in state.items():
        entry = reader.index().tensors[key]
        got = torch.empty(want.shape, dtype=want.dtype)
        for c in entry.chunks:
            got[c.box.slices()] = reader.read_region(key, c, c.box)
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))  # bit for bit
    with pytest.raises(DestinationError, match="not empty"):
        api.to_universal(tmp_path / "dcp", url, RunOptions(workers=2))
    api.to_universal(tmp_path / "dcp", url, RunOptions(workers=2, overwrite=True))  # its own output: replaced
