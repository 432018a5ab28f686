"""Memory is bounded by the budget, not by the checkpoint: peak RSS of a real conversion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MIB = 1 << 20

_MAKE = """
import sys, torch, torch.distributed.checkpoint as dcp
n, mib = int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(0)
rows = mib * (1 << 20) // (4 * 1024)
sd = {"model": {f"layers.{i}.w": torch.randn(rows, 1024, generator=g) for i in range(n)}}
dcp.save(sd, checkpoint_id=sys.argv[1])
"""

_MEASURE = """
import json, sys, threading, time
import psutil, torch, numpy, xxhash
import converter.cli, converter.commands.to_universal, converter.commands.from_universal, formats.dcp, formats.universal
import torch.distributed.checkpoint  # imported late by the DCP writer: library code, not buffers
proc = psutil.Process()
base = proc.memory_info().rss
peak = [base]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.002)
t = threading.Thread(target=sample, daemon=True)
t.start()
try:
    converter.cli.main(sys.argv[1:])
except SystemExit as e:
    if e.code:
        raise
done.set()
t.join()
print(json.dumps({"base": base, "peak": max(peak[0], proc.memory_info().rss)}))
"""


def rss_growth(*args: str) -> int:
    """Growth of RSS (bytes) above the post-import baseline during one ``ckptconv ARGS`` run."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc["peak"] - doc["base"]


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> Path:
    """A 256 MiB single-process DCP checkpoint: 8 tensors of 32 MiB."""
    path = tmp_path_factory.mktemp("big") / "ckpt"
    subprocess.run([sys.executable, "-c", _MAKE, str(path), "8", "32"], check=True, timeout=600)
    return path


@pytest.mark.parametrize("backend", ["zarr", "safetensors"])
def test_to_universal_peak_rss_stays_under_budget(big_checkpoint, tmp_path, backend):
    budget = 32 * MIB  # the checkpoint is 8x larger
    growth = rss_growth("to-universal", "--workers", "2", "--memory-budget", "32MiB", "--backend", backend,
                        str(big_checkpoint), str(tmp_path / "u1"))
    size = sum(f.stat().st_size for f in big_checkpoint.iterdir())
    print(f"to-universal: checkpoint {size / MIB:.0f} MiB, budget 32 MiB, RSS growth {growth / MIB:.1f} MiB")
    assert size > 7 * budget
    assert growth < budget, f"RSS grew {growth / MIB:.0f} MiB, over the 32 MiB budget"


@pytest.mark.parametrize("backend", ["zarr", "safetensors"])
def test_from_universal_peak_rss_stays_under_budget(big_checkpoint, tmp_path, backend):
    uni = tmp_path / "u"
    subprocess.run([sys.executable, "-m", "converter", "to-universal", "--backend", backend, str(big_checkpoint),
                    str(uni)],
                   check=True, timeout=600, capture_output=True)
    # one process target: every rank chunk is a whole 32 MiB tensor, streamed in pieces
    growth = rss_growth("from-universal", "--workers", "2", "--memory-budget", "32MiB", "--mesh", "dp1",
                        str(uni), str(tmp_path / "o1"))
    print(f"from-universal: budget 32 MiB, RSS growth {growth / MIB:.1f} MiB")
    assert growth < 32 * MIB


def test_growth_follows_the_budget(big_checkpoint, tmp_path):
    """The measurement can fail: a 4x larger budget lets RSS grow past the small budget."""
    growth = rss_growth("to-universal", "--workers", "2", "--memory-budget", "256MiB",
                        str(big_checkpoint), str(tmp_path / "u2"))
    print(f"to-universal with a 256 MiB budget: RSS growth {growth / MIB:.1f} MiB")
    assert growth > 32 * MIB
