"""Planning at scale: dry runs and ``inspect`` of synthetic Llama-3 checkpoints, against torch's
own ``pickle.load`` of the same ``.metadata``.

Builds (and caches under ``bench/out/scale/``) DCP checkpoints with :mod:`synthetic_metadata`
(what ``dcp.save`` of ``get_state_dict(model, AdamW)`` writes under FSDP2; data files sparse), then
times, each in a fresh process under ``/usr/bin/time`` (CPU seconds, wall seconds, peak RSS):

- ``torch pickle.load``: ``import torch.distributed.checkpoint`` then ``pickle.load`` of
  ``.metadata`` (what ``FileSystemReader.read_metadata`` does), timed inside the process from
  after the import;
- ``ckptconv inspect CKPT`` (the whole command, table included);
- ``ckptconv from-universal CKPT OUT --mesh M --plan llama --dry-run``.

    python bench/scale_plan.py                       # 70B DP128 -> tp2,dp32; 405B DP128/512/1024 -> tp8,dp*
    python bench/scale_plan.py --cases 70b:128:tp2,dp32 8b:512:tp8,dp64
    python bench/scale_plan.py --cases 405b:1024/tp8:tp4,dp256   # source FSDP128 x TP8 (1,024 ranks)

Results: ``bench/results/scale_plan.json`` (with the load average before and after each case: the
machine is shared, so CPU seconds are the comparable column).
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
REPO = BENCH.parent
OUT = BENCH / "out" / "scale"
RESULTS = BENCH / "results" / "scale_plan.json"
DEFAULT_CASES = ["70b:128:tp2,dp32", "405b:128:tp8,dp16", "405b:512:tp8,dp64", "405b:1024:tp8,dp128",
                 "405b:1024/tp8:tp4,dp256"]

_PICKLE_LOAD = r"""
import pickle, sys, time
import torch.distributed.checkpoint  # torch's classes, as FileSystemReader has them
t, c = time.perf_counter(), time.process_time()
with open(sys.argv[1], "rb") as f:
    md = pickle.load(f)
print(f"LOAD {time.perf_counter() - t:.2f} {time.process_time() - c:.2f}")
"""


def checkpoint(model: str, world: int, tp: int = 1) -> Path:
    """The cached synthetic checkpoint of ``model`` FSDP'd over ``world`` ranks (over TP ``tp``)."""
    root = OUT / (f"{model}_dp{world}" if tp == 1 else f"{model}_dp{world // tp}tp{tp}")
    if not (root / ".metadata").is_file():
        subprocess.run([sys.executable, str(BENCH / "synthetic_metadata.py"), str(root), "--model", model,
                        "--world", str(world), "--tp", str(tp)], check=True)
    return root


def timed(cmd: list[str]) -> dict:
    """Wall, CPU seconds and peak RSS of ``cmd`` (``/usr/bin/time``), plus its stdout."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "TIME %e %U %S %M", *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    m = re.search(r"TIME ([0-9.]+) ([0-9.]+) ([0-9.]+) ([0-9]+)", proc.stderr)
    if proc.returncode or not m:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round(float(m.group(2)) + float(m.group(3)), 2),
            "peak_rss_gib": round(int(m.group(4)) / (1 << 20), 3), "stdout": proc.stdout}


def run_case(spec: str) -> dict:
    model, source, mesh = spec.split(":")
    world, _, tp = source.partition("/tp")
    ck = checkpoint(model, int(world), int(tp or 1))
    md = (ck / ".metadata").stat().st_size
    load_before = os.getloadavg()[0]
    torch_load = timed([sys.executable, "-c", _PICKLE_LOAD, str(ck / ".metadata")])
    m = re.search(r"LOAD ([0-9.]+) ([0-9.]+)", torch_load.pop("stdout"))
    torch_load["in_process_wall_s"], torch_load["in_process_cpu_s"] = float(m.group(1)), float(m.group(2))
    inspect = timed([sys.executable, "-m", "converter", "inspect", str(ck)])
    inspect.pop("stdout")
    dry = timed([sys.executable, "-m", "converter", "from-universal", str(ck), str(OUT / "never-written"),
                 "--mesh", mesh, "--plan", "llama", "--dry-run"])
    dry.pop("stdout")
    return {"case": spec, "model": model, "world": int(world), "source_tp": int(tp or 1), "target": mesh, "metadata_bytes": md,
            "torch_pickle_load": torch_load, "inspect": inspect, "dry_run": dry,
            "load_avg_before": round(load_before, 2), "load_avg_after": round(os.getloadavg()[0], 2)}


def _source(row: dict) -> str:
    tp = row.get("source_tp", 1)
    return f"DP{row['world']}" if tp == 1 else f"DP{row['world'] // tp} x TP{tp} ({row['world']} ranks)"


def table(rows: list[dict]) -> str:
    out = ["| source | target | .metadata MB | torch pickle.load CPU s in-process / whole process / wall s / peak GiB | "
           "inspect CPU s / wall s / peak GiB (÷ torch's process: CPU, wall) | dry run CPU s / wall s / peak GiB | "
           "load avg |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        t, i, d = r["torch_pickle_load"], r["inspect"], r["dry_run"]
        out.append(
            f"| {r['model'].upper()} {_source(r)} | `{r['target']} --plan llama` | {r['metadata_bytes'] / 1e6:.0f} | "
            f"{t['in_process_cpu_s']:.1f} / {t['cpu_s']:.1f} / {t['wall_s']:.1f} / {t['peak_rss_gib']:.2f} | "
            f"{i['cpu_s']:.1f} / {i['wall_s']:.1f} / {i['peak_rss_gib']:.2f} "
            f"({i['cpu_s'] / t['cpu_s']:.2f}x, {i['wall_s'] / t['wall_s']:.2f}x) | "
            f"{d['cpu_s']:.1f} / {d['wall_s']:.1f} / {d['peak_rss_gib']:.2f} | "
            f"{r['load_avg_before']:.1f}-{r['load_avg_after']:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="MODEL:WORLD[/tpN]:TARGET_MESH (/tpN: the source is FSDP over TP N)")
    a = ap.parse_args()
    rows = []
    for spec in a.cases:
        rows.append(run_case(spec))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"commit": commit, "cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
