"""Planning at scale and bounded work on hostile metadata (issues 15 and 12 point 8).

- the synthetic-metadata generator of ``bench/`` writes what ``dcp.save`` writes (checked against
  the real FSDP2 fixture: keys, chunk boxes, planner data, storage layout);
- a dry run over a synthetic 1,024-rank checkpoint plans in bounded time (the per-tensor index,
  lazily computed pieces), and its plan matches the straightforward one on a small instance;
- ``.metadata`` with a huge memo index or deep nesting is refused without the memory the C
  unpickler would take; tables clip huge keys.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import synthetic_metadata as syn  # noqa: E402
from child_usage import Usage, run_measured  # noqa: E402

from converter.plan.copy_tasks import ChunkIndex, plan_copies  # noqa: E402
from formats.base import Box  # noqa: E402
from formats.errors import CorruptCheckpointError  # noqa: E402

TINY = syn.Shape(dim=32, layers=2, heads=4, kv_heads=2, hidden=96, vocab=50)
#: What the 1,024-rank dry run may take: measured 1.1 CPU seconds and 418 MiB peak RSS (the 2-core
#: machine, shared); the bounds leave room for a slower machine, not for a per-chunk scan.
DRY_RUN_MAX_CPU_SECONDS = 15
DRY_RUN_MAX_RSS = 1 << 30


def test_synthetic_metadata_matches_a_real_fsdp2_save(dcp_checkpoint, tmp_path):
    """Same keys in the same order, same chunk boxes, planner data and storage layout as the
    fsdp4 fixture (a real 4-rank FSDP2 ``dcp.save`` of ``get_state_dict(model, AdamW)``)."""
    real = dcp_checkpoint("fsdp4")
    args = json.loads((real.parent / "_fixture.json").read_text())["model_args"]
    assert (args["dim"], args["n_layers"], args["vocab_size"]) == (TINY.dim, TINY.layers, TINY.vocab)
    syn.build(tmp_path / "syn", TINY, 4, ["step", "kind"], quiet=True)
    syn.check(tmp_path / "syn", real)


def test_synthetic_fsdp_tp_metadata_matches_a_real_fsdp2_tp_save(dcp_checkpoint, tmp_path):
    """``--tp``: the same for FSDP2 over torchtitan's TP plan (the tp2dp2 fixture: a real 4-rank
    save on the mesh (dp 2, tp 2); strided FSDP over colwise shards, 2-D grids for rowwise ones)."""
    real = dcp_checkpoint("tp2dp2")
    args = json.loads((real.parent / "_fixture.json").read_text())["model_args"]
    assert (args["dim"], args["n_layers"], args["vocab_size"]) == (TINY.dim, TINY.layers, TINY.vocab)
    syn.build(tmp_path / "syn", TINY, 4, ["step", "kind"], quiet=True, tp=2)
    syn.check(tmp_path / "syn", real)


def test_rank_startup_bench_runs(tmp_path):
    """bench/rank_startup.py (the per-rank start-up figures of README's "Planning at scale") still
    runs: one process on a tiny synthetic checkpoint, its JSON line counting the whole plan."""
    syn.build(tmp_path / "ck", TINY, 4, [], quiet=True)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "rank_startup.py"), str(tmp_path / "ck"),
                           str(tmp_path / "out"), "--mesh", "tp2,dp2"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["rank"] == 0 and line["world"] == 1 and line["tasks"] == line["my_tasks"] > 0
    assert line["my_copies"] >= line["my_tasks"]


def _run(*args: str, timeout: float = 600) -> Usage:
    """``ckptconv ARGS`` in a child process: its exit status, output, and its own CPU seconds and
    peak RSS (``os.wait4``: the child's accounting, not this process's)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    used = run_measured([sys.executable, "-m", "converter", *args], env=env, timeout=timeout)
    assert not used.timed_out, f"ckptconv {args[0]}: over {timeout} s"
    return used


def test_dry_run_of_a_1024_rank_checkpoint_is_fast(tmp_path):
    """A 2-layer Llama (dim 1024) FSDP'd over 1,024 ranks (~25k chunks) re-planned for tp8,dp128:
    seconds of the child's CPU, not the minutes the per-piece scan took, in a bounded peak RSS."""
    shape = syn.Shape(dim=1024, layers=2, heads=8, kv_heads=8, hidden=2048, vocab=4096)
    syn.build(tmp_path / "ck", shape, 1024, [], quiet=True)
    proc = _run("from-universal", str(tmp_path / "ck"), str(tmp_path / "out"), "--mesh", "tp8,dp128",
                "--plan", "llama", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "rank 1023 " in proc.stdout
    assert not (tmp_path / "out").exists()
    assert proc.cpu_seconds < DRY_RUN_MAX_CPU_SECONDS, f"the dry run took {proc.cpu_seconds:.1f} CPU seconds"
    assert proc.peak_rss < DRY_RUN_MAX_RSS, f"the dry run peaked at {proc.peak_rss >> 20} MiB"


def test_lazy_plan_matches_the_straightforward_scan():
    """Every piece's copies from the index equal those of intersecting every source chunk."""
    from converter.plan.copy_tasks import plan_tensor
    from formats.base import ChunkRef, TensorEntry

    rows, cols = 1000, 24
    src = [ChunkRef(Box((r * 7, 0), (min(7, rows - r * 7), cols)), f"f{r}", r, r) for r in range(143)]
    entry = TensorEntry("w", "float32", (rows, cols), tuple(src), ("model", "w"))
    targets = [(i, Box((o, c), (min(60, rows - o), 12))) for i, (o, c) in
               enumerate((o, c) for o in range(0, rows, 60) for c in (0, 12))]
    for task in plan_tensor(entry, targets, piece_bytes=1000):
        for piece in task.pieces:
            scan = tuple(
                (c, r) for c in src for r in [c.box.intersect(piece.box)] if r is not None and r.numel
            )
            assert tuple((c.src, c.region) for c in piece.copies) == scan
        assert task.max_piece_bytes == max(p.box.numel * 4 for p in task.pieces)


def test_plan_copies_accepts_an_index_or_chunks():
    src = [ChunkRef_(r) for r in range(20)]
    assert plan_copies(src, Box((5,), (10,))) == ChunkIndex(src).copies(Box((5,), (10,)))


def ChunkRef_(r: int):
    from formats.base import ChunkRef

    return ChunkRef(Box((r,), (1,)), "f", r, r)


# ---------------------------------------------------------------------------------------------
# hostile .metadata (issue 12, point 8)


def _metadata(dcp_checkpoint) -> bytes:
    return (dcp_checkpoint("fsdp4") / ".metadata").read_bytes()


def _memo_prefix(index: int) -> bytes:
    """Bytes in front of a pickle: PROTO 4, NONE, LONG_BINPUT index, POP."""
    return b"\x80\x04N" + b"r" + struct.pack("<I", index) + b"0"


@pytest.mark.parametrize("index", [2**27, 2**31])
def test_huge_memo_index_is_refused_by_the_prescan(dcp_checkpoint, index):
    from formats.dcp.metadata import parse_metadata_bytes

    data = _memo_prefix(index) + _metadata(dcp_checkpoint)
    with pytest.raises(CorruptCheckpointError, match="memo index"):
        parse_metadata_bytes(data, "x/.metadata")


_CAPPED = r"""
import resource, struct, sys
sys.path.insert(0, sys.argv[1])
from formats.dcp import safe_pickle
from formats.dcp.metadata import parse_metadata_bytes
from formats.errors import CorruptCheckpointError
safe_pickle.PRESCAN_MAX_BYTES = 0  # the path of a large .metadata: no prescan, an address-space cap
safe_pickle.CAP_BASE_BYTES = 256 << 20
data = open(sys.argv[2], "rb").read()
parse_metadata_bytes(data, "ok/.metadata")  # the real one parses under the cap
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
hostile = b"\x80\x04Nr" + struct.pack("<I", 2**28) + b"0" + data
try:
    parse_metadata_bytes(hostile, "bad/.metadata")
except CorruptCheckpointError as e:
    print("refused:", e)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print("grown KiB", grown)
assert grown < 300 << 10, grown
"""


def test_huge_memo_index_in_a_large_metadata_stays_within_the_cap(dcp_checkpoint):
    """Without the prescan (large files), the unpickler runs under an address-space cap: a memo
    index of 2**28 (4 GiB of memo table) fails at once instead of paging in gigabytes."""
    path = dcp_checkpoint("fsdp4") / ".metadata"
    proc = subprocess.run([sys.executable, "-c", _CAPPED, str(REPO), str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "refused:" in proc.stdout and "memory" in proc.stdout


def test_deep_nesting_is_refused(dcp_checkpoint):
    from formats.dcp.metadata import parse_metadata_bytes

    deep = b"\x80\x04" + b"(" * 5000 + b"N" + b"l" * 5000 + b"."
    with pytest.raises(CorruptCheckpointError, match="nests deeper"):
        parse_metadata_bytes(deep, "x/.metadata")


def test_table_cells_are_clipped():
    from converter.tools.tables import MAX_CELL_CHARS, clip_cell

    assert clip_cell("k" * MAX_CELL_CHARS) == "k" * MAX_CELL_CHARS
    long = clip_cell("k" * (20 << 20))
    assert len(long) <= MAX_CELL_CHARS and long.startswith("kkk") and "20971520 characters" in long


def test_inspect_of_a_20_mib_key_renders_quickly(tmp_path):
    """A 20 MiB key name: the table clips it (the rich table took over 900 s to lay it out)."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"k" * (20 << 20): torch.zeros(2), "w": torch.ones(3)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    proc = _run("inspect", str(tmp_path / "ck"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.cpu_seconds < 120, f"inspect took {proc.cpu_seconds:.1f} CPU seconds"
    assert len(proc.stdout) < 200_000


@pytest.mark.parametrize("module", ["os\nsystem() # ", "x" * (1 << 20)])
def test_global_with_a_newline_or_huge_name_is_one_short_line(dcp_checkpoint, tmp_path, module):
    """A .metadata naming a global by STACK_GLOBAL (names from strings: any characters, any size):
    the refusal is one line of bounded length."""
    import shutil

    from cli_runner import run_cli

    ckpt = tmp_path / "ckpt"
    shutil.copytree(dcp_checkpoint("fsdp4"), ckpt)
    name = module.encode()
    (ckpt / ".metadata").write_bytes(b"\x80\x04\x8d" + struct.pack("<Q", len(name)) + name
                                     + b"\x8c\x06system\x93)R.")
    code, out, err = run_cli("inspect", str(ckpt))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ckptconv: error: "), err[:2000]
    assert ".metadata" in lines[0] and len(lines[0]) < 1000, lines[0][:2000]
