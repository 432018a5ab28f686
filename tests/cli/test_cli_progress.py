"""Issue 18.5: progress lines never go backwards and end at 100 %, under torchrun each prefixed by
its rank; the end-of-run summary names files, bytes, mesh, world size, processes, a wall time that
matches the process's and the rate."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from converter.tools.demo import demo_checkpoint
from test_cli_readable import REPO, ckptconv

LINE = re.compile(r"^(?:\[rank (?P<rank>\d+)/(?P<world>\d+)\] )?(?P<label>[\w-]+): (?P<done>[\d.]+)/(?P<total>[\d.]+ \w+) "
                  r"\((?P<pct>\d+) %\), [\d.]+ \w+/s, (ETA \d+ s|done in [\d.]+ s)$")


def _progress(stderr: str) -> dict[str | None, list[re.Match]]:
    by_rank: dict[str | None, list[re.Match]] = {}
    for ln in stderr.splitlines():
        m = LINE.match(ln)
        assert m is not None or not ln.strip() or "warning" in ln.lower(), f"unexpected stderr line {ln!r}"
        if m:
            by_rank.setdefault(m["rank"], []).append(m)
    return by_rank


def _check_monotonic_to_100(lines: list[re.Match]) -> None:
    done = [float(m["done"]) for m in lines]
    assert done == sorted(done) and lines[-1]["pct"] == "100" and lines[-1]["done"] == lines[-1]["total"].split()[0]
    assert all(int(a["pct"]) <= int(b["pct"]) for a, b in zip(lines, lines[1:]))


def test_progress_lines_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTCONV_PROGRESS_SECONDS", "0")
    start = time.monotonic()
    proc = ckptconv("from-universal", str(demo_checkpoint()), str(tmp_path / "out"), "--mesh", "tp2,dp2",
                    "--plan", "llama", "--progress", "--workers", "2")
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    lines = _progress(proc.stderr)
    assert list(lines) == [None] and len(lines[None]) >= 2  # one process: no prefix
    _check_monotonic_to_100(lines[None])
    summary = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"wrote (?P<dst>\S+): 84 tensors, 14 objects, (?P<size>[\d.]+ KiB) in 5 files; "
                     r"mesh dp_shard2,tp2 \(world size 4\); 1 process, (?P<wall>[\d.]+) s wall, [\d.]+ \w+/s", summary)
    assert m is not None, summary
    assert 0 < float(m["wall"]) <= wall + 0.05 and float(m["wall"]) > wall - 1.5  # the process's own wall time


def test_no_progress_prints_nothing(tmp_path):
    proc = ckptconv("to-universal", str(demo_checkpoint()), str(tmp_path / "u"), "--no-progress")
    assert proc.returncode == 0 and proc.stderr == ""
    assert re.search(r"; 1 process, [\d.]+ s wall, [\d.]+ \w+/s$", proc.stdout.strip())


def test_torchrun_progress_prefixed_and_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update(PYTHONPATH=str(REPO), CKPTCONV_PROGRESS_SECONDS="0", GLOO_SOCKET_IFNAME="lo", COLUMNS="80")
    out = tmp_path / "uni"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "converter",
           "to-universal", str(demo_checkpoint()), str(out), "--progress", "--workers", "2", "--chunk-size", "1KiB"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stderr = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith(("W1", "W0", "*****", "Setting OMP")))
    lines = _progress(stderr)
    assert set(lines) == {"0", "1"}, proc.stderr
    for rank_lines in lines.values():
        assert all(m["world"] == "2" and m["label"] == "to-universal" for m in rank_lines)
        _check_monotonic_to_100(rank_lines)
    wrote = [ln for ln in proc.stdout.splitlines() if ln.startswith("wrote ")]
    assert len(wrote) == 1 and "; 2 processes, " in wrote[0] and " s wall, " in wrote[0], proc.stdout
    assert (out / "ckptconv.json").is_file()
