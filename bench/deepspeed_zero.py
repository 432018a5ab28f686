"""Benchmark: a DeepSpeed ZeRO folder read directly by ckptconv vs DeepSpeed's own tools, on the
same real ``engine.save_checkpoint`` files (bench/make_ds_checkpoint.py: DeepSpeed 0.19.8, CPU).

    python bench/deepspeed_zero.py                 # 2GB ZeRO-2 bf16 save of 2 ranks, every row once
    python bench/deepspeed_zero.py --quiet         # the same, printing only the table
    python bench/deepspeed_zero.py --stage 3 --repeats 2 --only ckptconv,zero_to_fp32

Rows (each a subprocess, its input evicted from the page cache first, as bench/run.py does):

- ``ckptconv to-universal ZERO UNI``: everything (weights, Adam states, steps, param groups) into a
  universal store, straight from the folder;
- ``ckptconv export-hf ZERO HF``: the fp32 weights only, as safetensors (what zero_to_fp32 makes);
- ``ds_to_universal``: DeepSpeed's ``ds_to_universal.py`` (``--num_extract_workers`` and
  ``--num_merge_workers`` = the CPU count; ZeRO-1/2 with ``--inject_missing_state``), then
  ``ckptconv import-ds`` of its output into the same store, and their sum;
- ``zero_to_fp32``: DeepSpeed's ``zero_to_fp32.py`` (copied into every save), fp32 weights.

Columns: wall s, CPU s, peak RSS of the process tree, peak temporary disk (the most the step's
output folder held beyond what it finally holds), output size, and the 1-minute load average
before the step (the machine is shared: compare rows of one run). JSON goes to
``bench/results/<date>T<time>-ds-zero-<size>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from make_checkpoint import parse_size, size_label  # noqa: E402
from run import MIB, PY, RESULTS, Run, _ckptconv, _du, machine, measure  # noqa: E402

GROUPS = ("ckptconv", "ds_to_universal", "zero_to_fp32")
#: What a step may hold beyond its final output without counting as temporary files: the resume
#: journal (``.ckptconv-journal.jsonl``, one line per finished task) and the lock, deleted at commit.
BOOKKEEPING_BYTES = 64 * 1024


def _steps(ckpt: Path, tag: Path, work: Path, stage: int, workers: int) -> list[dict]:
    """The rows: name, group, command, what it reads, the folder it writes."""
    d2u = [PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag), "--output_folder",
           str(work / "dsu"), "--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]
    if stage < 3:
        d2u.append("--inject_missing_state")
    return [
        {"name": "ckptconv to-universal (direct)", "group": "ckptconv", "reads": ckpt, "writes": work / "uni",
         "cmd": _ckptconv("to-universal", str(ckpt), str(work / "uni"))},
        {"name": "ckptconv export-hf (direct, fp32 weights)", "group": "ckptconv", "reads": ckpt, "writes": work / "hf",
         "cmd": _ckptconv("export-hf", str(ckpt), str(work / "hf"))},
        {"name": "DeepSpeed ds_to_universal.py", "group": "ds_to_universal", "reads": tag, "writes": work / "dsu",
         "cmd": d2u, "keep": True},
        {"name": "ckptconv import-ds (of its output)", "group": "ds_to_universal", "reads": work / "dsu",
         "writes": work / "uni2", "cmd": _ckptconv("import-ds", str(work / "dsu"), str(work / "uni2"))},
        {"name": "DeepSpeed zero_to_fp32.py (fp32 weights)", "group": "zero_to_fp32", "reads": ckpt,
         "writes": work / "fp32", "cmd": [PY, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(work / "fp32")]},
    ]


def _row(step: dict, runs: list[Run]) -> dict:
    ok = [r for r in runs if r.rc == 0]
    if not ok:
        return {"name": step["name"], "group": step["group"], "failed": runs[-1].tail[-1500:]}
    final = _du(step["writes"]) if step["writes"].exists() else 0
    return {"name": step["name"], "group": step["group"], "wall_s": statistics.median(r.wall_s for r in ok),
            "wall_s_all": [round(r.wall_s, 2) for r in ok], "cpu_s": statistics.median(r.cpu_s for r in ok),
            "tree_peak_rss": max(r.tree_peak_rss for r in ok), "main_max_rss": max(r.main_max_rss for r in ok),
            "peak_disk": max(r.peak_disk for r in ok), "output_bytes": final,
            "temp_disk": max(0, max(r.peak_disk for r in ok) - final),
            "load_before": [r.load_before[0] for r in ok], "cold": all(r.cold for r in ok)}


def run_all(ckpt: Path, tag: Path, work: Path, stage: int, workers: int, repeats: int, only: set[str],
            quiet: bool) -> list[dict]:
    """Every selected row ``repeats`` times (outputs removed after each, but for rows later ones read)."""
    steps = [s for s in _steps(ckpt, tag, work, stage, workers) if s["group"] in only]
    runs: dict[str, list[Run]] = {s["name"]: [] for s in steps}
    rows: dict[str, dict] = {}
    for _ in range(repeats):
        for s in steps:
            shutil.rmtree(s["writes"], ignore_errors=True)
            s["writes"].mkdir(parents=True)
            run = measure(s["cmd"], s["reads"], sync=True, cold=True, watch=s["writes"])
            runs[s["name"]].append(run)
            rows[s["name"]] = _row(s, runs[s["name"]])
            if not quiet:
                r = rows[s["name"]]
                print(f"{s['name']}: " + (f"{run.wall_s:.1f} s, {run.tree_peak_rss / MIB:.0f} MiB RSS, "
                                          f"temp {r['temp_disk'] / MIB:.0f} MiB, load {run.load_before[0]:.1f}"
                                          if run.rc == 0 else f"FAILED rc={run.rc}"), flush=True)
            if not s.get("keep"):
                shutil.rmtree(s["writes"], ignore_errors=True)
        shutil.rmtree(work / "dsu", ignore_errors=True)
    out = [rows[s["name"]] for s in steps]
    a, b = rows.get("DeepSpeed ds_to_universal.py"), rows.get("ckptconv import-ds (of its output)")
    if a and b and "wall_s" in a and "wall_s" in b:
        out.insert(out.index(b) + 1, {"name": "ds_to_universal + import-ds (sum)", "group": "ds_to_universal",
                                      "wall_s": a["wall_s"] + b["wall_s"], "cpu_s": a["cpu_s"] + b["cpu_s"],
                                      "tree_peak_rss": max(a["tree_peak_rss"], b["tree_peak_rss"]),
                                      "main_max_rss": max(a["main_max_rss"], b["main_max_rss"]),
                                      "temp_disk": a["temp_disk"] + a["output_bytes"] + b["temp_disk"],
                                      "output_bytes": b["output_bytes"]})
    return out


def table(rows: list[dict], size: int) -> str:
    lines = [f"| step ({size / 1e9:.2f} GB ZeRO folder) | wall s | CPU s | peak RSS MiB | temp disk MiB | out MiB | load |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "wall_s" not in r:
            lines.append(f"| {r['name']} | FAILED | | | | | |")
            continue
        load = ", ".join(f"{x:.1f}" for x in r.get("load_before", []))
        lines.append(f"| {r['name']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['tree_peak_rss'] / MIB:.0f} "
                     f"| {r['temp_disk'] / MIB:.0f} | {r['output_bytes'] / MIB:.0f} | {load} |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[dict]:
    """The issue's goals on these numbers: faster than ds_to_universal alone, a tenth of
    zero_to_fp32's memory, no temporary files."""
    by = {r["name"]: r for r in rows if "wall_s" in r}
    direct, d2u = by.get("ckptconv to-universal (direct)"), by.get("DeepSpeed ds_to_universal.py")
    hf, z2f = by.get("ckptconv export-hf (direct, fp32 weights)"), by.get("DeepSpeed zero_to_fp32.py (fp32 weights)")
    out = []
    if direct and d2u:
        out.append({"target": "to-universal (direct) faster than ds_to_universal.py alone",
                    "value": round(d2u["wall_s"] / direct["wall_s"], 2), "ok": direct["wall_s"] < d2u["wall_s"]})
    if hf and z2f:
        ratio = hf["tree_peak_rss"] / z2f["tree_peak_rss"]
        out.append({"target": "export-hf (direct) at <= 1/10 of zero_to_fp32.py's peak RSS", "value": round(ratio, 3),
                    "ok": ratio <= 0.1})
    for r in (direct, hf):  # ckptconv's own bookkeeping (the resume journal, a few KiB) is removed at commit
        if r:
            out.append({"target": f"{r['name']}: no temporary data (<= {BOOKKEEPING_BYTES // 1024} KiB of resume "
                                  "journal, removed at commit)",
                        "value": r["temp_disk"], "ok": r["temp_disk"] <= BOOKKEEPING_BYTES})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="2GB")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--only", default=",".join(GROUPS), help=f"row groups: {', '.join(GROUPS)}")
    p.add_argument("--quiet", action="store_true", help="print only the table and the targets")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/<date>-ds-zero-<size>.json)")
    a = p.parse_args(argv)
    import os
    import subprocess

    size = parse_size(a.size)
    made = subprocess.run([PY, str(BENCH / "make_ds_checkpoint.py"), "--size", a.size, "--stage", str(a.stage),
                           "--dtype", a.dtype, "--world", str(a.world)], capture_output=True, text=True)
    if made.returncode:
        raise SystemExit(f"making the checkpoint failed:\n{made.stderr[-3000:]}")
    info = json.loads(made.stdout[made.stdout.index("{"):])
    ckpt = Path(info["path"])
    tag = ckpt / (ckpt / "latest").read_text().strip()
    work = BENCH / "out" / "ds-zero-work"
    shutil.rmtree(work, ignore_errors=True)
    rows = run_all(ckpt, tag, work, a.stage, os.cpu_count() or 1, a.repeats, set(a.only.split(",")), a.quiet)
    shutil.rmtree(work, ignore_errors=True)
    goals = targets(rows)
    print(table(rows, info["bytes"]))
    for g in goals:
        print(f"{'ok  ' if g['ok'] else 'MISS'} {g['target']}: {g['value']}")
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M")
    path = Path(a.out) if a.out else RESULTS / f"{stamp}-ds-zero-{size_label(size)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"checkpoint": info, "rows": rows, "targets": goals, "machine": machine(),
                                "load_average": os.getloadavg()}, indent=1))
    if not a.quiet:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
