"""formats/dcp/framework_files.py on hostile inputs: bounded reads, one-line errors."""

from __future__ import annotations

import tracemalloc

import pytest

from formats.dcp.framework_files import MAX_FRAMEWORK_FILE_BYTES, read_framework_files
from formats.errors import CorruptCheckpointError


def test_an_oversized_framework_file_is_refused_before_it_is_read(tmp_path):
    """A (sparse) common.pt past the limit is refused by its size: the bytes are never read into
    memory (a hostile checkpoint could otherwise ask for any amount)."""
    with open(tmp_path / "common.pt", "wb") as f:
        f.truncate(MAX_FRAMEWORK_FILE_BYTES + (64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=r"common\.pt: .* over the .* byte limit"):
            read_framework_files(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"read {peak >> 20} MiB of an oversized file"


def test_a_small_metadata_json_is_carried(tmp_path):
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    assert read_framework_files(tmp_path) == {"metadata.json": b'{"sharded_backend": "torch_dist"}'}
