"""Throughput of conversions with 1 and 2 processes (``torchrun --nproc-per-node``) on this machine.

Makes (and caches) a synthetic single-file DCP checkpoint of ``--size`` bytes (fp32 matrices),
then for each process count runs to-universal, from-universal (``--mesh dp4``) and export-hf
through ``python -m converter`` (under ``torchrun`` for more than one process), with
``--overwrite``. Reports the conversion's own time (the slowest rank's execute loop, what
``wrote ... in Xs`` prints) and the wall time of the whole command (process start, torch import,
process group, planning, commit), and MB/s for both. Results: ``bench/results/scale_out.json``.

    python bench/scale_out.py --size 1GiB --nproc 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
OUT = BENCH / "out"
RESULTS = BENCH / "results" / "scale_out.json"
_UNITS = {"": 1, "MB": 10**6, "GB": 10**9, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"([0-9.]+)\s*([A-Za-z]*)", text.strip())
    if not m or m.group(2).upper() not in _UNITS:
        raise SystemExit(f"cannot read size {text!r}; write it like 512MiB or 1GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def make_source(size: int) -> Path:
    """A DCP checkpoint of about ``size`` bytes of fp32 model weights (cached)."""
    root = OUT / f"scaleout-{size}"
    done = root / "done"
    if done.is_file():
        return root / "ckpt"
    code = f"""
import torch, torch.distributed.checkpoint as dcp
g = torch.Generator().manual_seed(0)
n, rows = 16, 1024
cols = max(1, {size} // (4 * n * rows))
sd = {{"model": {{f"layers.{{i}}.w": torch.randn(rows, cols, generator=g) for i in range(n)}}}}
dcp.save(sd, checkpoint_id={str(root / 'ckpt')!r}, no_dist=True)
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    done.write_text("ok")
    return root / "ckpt"


def run(nproc: int, args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, conversion seconds, stdout) of one ckptconv command on ``nproc`` processes."""
    cmd = [sys.executable, "-m", "converter", *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "converter", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed on {nproc} process(es): {proc.stderr[-2000:]}")
    m = re.search(r"in ([0-9.]+)s", proc.stdout)
    return wall, float(m.group(1)) if m else wall, proc.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--workers", type=int, default=2, help="I/O threads per process")
    a = ap.parse_args()
    size = parse_size(a.size)
    src = make_source(size)
    work = OUT / "scaleout-work"
    rows = []
    for nproc in a.nproc:
        uni, dcp_out, hf = work / f"uni{nproc}", work / f"dcp{nproc}", work / f"hf{nproc}"
        steps = [
            ("to-universal", ["to-universal", "--overwrite", "--workers", str(a.workers), str(src), str(uni)]),
            ("from-universal dp4", ["from-universal", "--overwrite", "--workers", str(a.workers), "--mesh", "dp4",
                                    str(uni), str(dcp_out)]),
            ("export-hf", ["export-hf", "--overwrite", "--workers", str(a.workers), str(uni), str(hf)]),
        ]
        for name, args in steps:
            wall, conv, _ = run(nproc, args)
            row = {"step": name, "nproc": nproc, "workers_per_process": a.workers, "bytes": size,
                   "wall_s": round(wall, 2), "convert_s": round(conv, 2),
                   "wall_MBps": round(size / wall / 1e6, 1), "convert_MBps": round(size / conv / 1e6, 1)}
            rows.append(row)
            print(f"{name:20s} nproc={nproc} convert {row['convert_s']:6.2f}s {row['convert_MBps']:7.1f} MB/s   "
                  f"wall {row['wall_s']:6.2f}s {row['wall_MBps']:7.1f} MB/s", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    doc = {"machine": {"cpus": os.cpu_count(), "load_1min_at_end": load}, "size_bytes": size, "rows": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
