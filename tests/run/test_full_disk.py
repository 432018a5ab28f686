"""A full disk (simulated with RLIMIT_FSIZE): a clean error, nothing published, resume works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG instead
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from converter.cli import main
main(sys.argv[2:])
"""


def run_limited(limit: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _LIMITED, str(limit), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CKPTCONV_JOURNAL_FLUSH_SECONDS": "0"})


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("disk") / "ckpt"
    g = torch.Generator().manual_seed(0)
    dcp.save({"model": {f"w{i}": torch.randn(512, 512, generator=g) for i in range(4)}}, checkpoint_id=str(path))
    return path


def test_to_universal_on_a_full_disk_then_resume(source, tmp_path):
    dst = tmp_path / "uni"
    # 1 MiB chunk files cannot be written under a 600 KiB file size limit
    proc = run_limited(600 * 1024, "to-universal", "--chunk-size", "1MiB", str(source), str(dst))
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("ckptconv: error:") and "out of space" in line and "--resume" in line
    assert "Traceback" not in proc.stderr
    assert not (dst / "ckptconv.json").exists()
    from converter.cli import main

    main(["to-universal", "--chunk-size", "1MiB", "--resume", str(source), str(dst)])  # raises SystemExit on error
    from formats.universal import UniversalReader

    reader = UniversalReader(dst)
    ref = torch.load(_torch_save(source, tmp_path), weights_only=True)
    for key, entry in reader.index().tensors.items():
        out = torch.empty(entry.shape)
        for c in entry.chunks:
            out[c.box.slices()] = reader.read_region(key, c, c.box)
        assert torch.equal(out, ref["model"][key.split(".", 1)[1]])


def test_from_universal_on_a_full_disk_then_resume(source, tmp_path):
    from converter import RunOptions, from_universal, to_universal

    uni, out = tmp_path / "uni", tmp_path / "out"
    to_universal(source, uni, RunOptions(workers=2))
    proc = run_limited(1024 * 1024, "from-universal", "--mesh", "dp1", str(uni), str(out))
    assert proc.returncode == 2, proc.stderr
    assert "out of space" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / ".metadata").exists()
    from_universal(uni, out, "dp1", options=RunOptions(workers=2, resume=True))
    loaded = {"model": {f"w{i}": torch.zeros(512, 512) for i in range(4)}}
    dcp.load(loaded, checkpoint_id=str(out))
    ref = torch.load(_torch_save(source, tmp_path), weights_only=True)
    for k, v in loaded["model"].items():
        assert torch.equal(v, ref["model"][k])


def _torch_save(src: Path, tmp: Path) -> Path:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = tmp / "ref.pt"
    if not path.exists():
        dcp_to_torch_save(src, path)
    return path
