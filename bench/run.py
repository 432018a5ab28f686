"""Benchmark ckptconv against a raw copy and torch's own paths, on the same real DCP checkpoint.

    python bench/run.py                        # 2GB checkpoint, 3 rounds
    python bench/run.py --sizes 2GB,8GB        # memory flatness check (to-universal / from-universal)
    python bench/run.py --only raw-copy,to-universal --repeats 2

Every step runs as a subprocess; its wall time includes process start and a trailing ``sync``
(for steps that write). Peak RSS is sampled every 20 ms as the sum over the whole process tree
(``tree``; shared library pages of forked ranks are counted once per process) and, exactly, the
kernel's high-water mark of the main process (``main``, from wait4). The page cache is dropped
for the step's input before every step (posix_fadvise DONTNEED, checked with fincore; as root, the
whole page cache is dropped first and the code read back in, so no step pays to reclaim another
step's pages), so every step reads its data cold while the interpreter and torch's libraries stay cached. Prints a markdown table and
writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_checkpoint import OUT, cached_info, dir_bytes, parse_size, size_label  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
PY = sys.executable
MIB = 1 << 20
POLL_S = 0.02


# ----------------------------------------------------------------------------- one measurement


@dataclass(frozen=True)
class Run:
    """One timed execution of a step."""

    wall_s: float
    sync_s: float
    tree_peak_rss: int
    main_max_rss: int
    cpu_s: float  # user + system CPU seconds of the process and the children it waited for
    load_before: tuple[float, float, float]
    cold: bool
    rc: int
    tail: str
    peak_disk: int = 0  # the largest size the watched folder reached (bench/deepspeed_zero.py)


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def can_drop_caches() -> bool:
    """Whether this process may empty the whole page cache (root, writable /proc/sys)."""
    return os.access(DROP_CACHES, os.W_OK)


def drop_all_caches() -> None:
    """Empty the page cache, then read the interpreter's code back in (python, numpy, torch,
    ckptconv), so every step starts from the same memory state: no other step's files to
    reclaim while it allocates pages, and a warm process start."""
    subprocess.run(["sync"], check=True)
    DROP_CACHES.write_text("1\n")
    subprocess.run([PY, "-c", "import torch, numpy, converter.cli"], check=True, capture_output=True)


def evict(path: Path) -> bool:
    """sync, then drop ``path``'s files from the page cache (posix_fadvise DONTNEED); where
    allowed, first the whole page cache (:func:`drop_all_caches`). Every file is read once before
    (:func:`read_through`).

    Only the step's input goes cold: the interpreter and torch's libraries stay cached, so a
    step's time is its own I/O plus a warm process start. False when the kernel kept any page.
    """
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    subprocess.run(["sync"], check=True)
    read_through(files)
    if can_drop_caches():
        drop_all_caches()
    subprocess.run(["sync"], check=True)
    drop_from_cache(files)
    return cached_bytes(files) == 0


def drop_from_cache(files: list[Path]) -> None:
    """``posix_fadvise(DONTNEED)`` each file: its clean pages leave the page cache."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_through(files: list[Path], block: int = 16 << 20) -> None:
    """Read each file once, start to end, before its eviction from the guest's page cache.

    On a VM whose disk is a file on its host, this puts the files in the host's page cache, which
    no guest can drop. This VM's host keeps recently read data (a 2 GB checkpoint then reads at
    ~3.5 GB/s, guest cache cold) and not data just written or pushed out by other I/O (0.65-1 GB/s):
    without priming, which step's input the host happens to hold decides the race ("The host's
    cache" in bench/README). On a machine with its own disk the input is still cold after the
    eviction; the priming then only costs one read of it, untimed."""
    buf = bytearray(block)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]) == block:
                pass
        finally:
            os.close(fd)


def cached_bytes(files: list[Path]) -> int:
    """Bytes of ``files`` in the page cache (``fincore``; 0 when unavailable)."""
    if not files or shutil.which("fincore") is None:
        return 0
    r = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *map(str, files)], capture_output=True, text=True)
    return sum(int(x) for x in r.stdout.split()) if r.returncode == 0 else 0


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(cmd: list[str], reads: Path, *, sync: bool, cold: bool, watch: Path | None = None) -> Run:
    """Run ``cmd`` (then ``sync`` when it writes), timing it and sampling its process tree's RSS.

    ``reads`` (the step's input) is evicted from the page cache first (``cold``), or read once
    so that it is cached (warm). ``watch``: a folder whose size is sampled too (every 0.25 s: its
    peak, temporary files included, is ``Run.peak_disk``).
    """
    is_cold = evict(reads) if cold else False
    if not is_cold:
        subprocess.run(f"cat {_files(reads)} > /dev/null", shell=True, check=False)
    load = os.getloadavg()
    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        proc, peak, disk, next_disk = psutil.Process(child.pid), 0, 0, 0.0
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            peak = max(peak, _tree_rss(proc))
            if watch is not None and time.perf_counter() >= next_disk:
                disk, next_disk = max(disk, _du(watch)), time.perf_counter() + 0.25
            time.sleep(POLL_S)
        child.returncode = rc = os.waitstatus_to_exitcode(status)
        t1 = time.perf_counter()
        if sync:
            subprocess.run(["sync"], check=True)
        t2 = time.perf_counter()
        log.seek(0)
        tail = log.read()[-2000:].decode(errors="replace")
    main_rss = usage.ru_maxrss * 1024  # KiB on Linux
    cpu = usage.ru_utime + usage.ru_stime
    if watch is not None:
        disk = max(disk, _du(watch))
    return Run(t2 - t0, t2 - t1, max(peak, main_rss), main_rss, cpu, load, is_cold, rc, tail, disk)


def _du(path: Path) -> int:
    """Bytes of every file under ``path`` now (files vanishing meanwhile count as 0)."""
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += os.stat(os.path.join(root, n)).st_size
            except OSError:
                pass
    return total


def _files(path: Path) -> str:
    path = Path(path)
    if path.is_file():
        return f"'{path}'"
    return " ".join(f"'{f}'" for f in sorted(path.rglob("*")) if f.is_file()) or "/dev/null"


# ----------------------------------------------------------------------------- the steps


@dataclass
class Step:
    """One row of the table: a command, what it reads, and what to clean up after it."""

    name: str
    cmd: list[str]
    reads: Path
    writes: Path | None = None
    keep: bool = False  # output used by later steps of the same round
    group: str = ""
    input_bytes: int = 0
    output_bytes: int = 0
    runs: list[Run] = field(default_factory=list)


#: The like-for-like comparison with torch's manual path: one command, DCP in, resharded DCP out.
RESHARD = "reshard DCP->DCP directly (from-universal ckpt/ --mesh dp3)"


def _ckptconv(*args: str) -> list[str]:
    return [PY, "-m", "converter", *args, "--no-progress"]


def export_hf_available() -> bool:
    """True when ``ckptconv export-hf --help`` works (another change may not have landed yet)."""
    r = subprocess.run([PY, "-m", "converter", "export-hf", "--help"], capture_output=True, cwd=ROOT)
    return r.returncode == 0


def make_steps(src: Path, work: Path, only: set[str] | None, with_torch: bool, with_online: bool) -> list[Step]:
    """The benchmark rows, in run order (later rows may read earlier rows' kept outputs)."""
    uni, unist, pt = work / "uni", work / "uni-st", work / "full.pt"
    fmt = [PY, "-m", "torch.distributed.checkpoint.format_utils"]
    steps = [
        Step("python -c 'import torch'", [PY, "-c", "import torch"], src, group="fixed"),
        Step("ckptconv --version", [PY, "-m", "converter", "--version"], src, group="fixed"),
        Step("raw copy (cp -r + sync)", ["cp", "-r", str(src), str(work / "copy")], src, work / "copy",
             group="raw"),
        Step("raw read (cat > /dev/null)", ["sh", "-c", f"cat {_files(src)} > /dev/null"], src, group="raw"),
        Step("to-universal", _ckptconv("to-universal", str(src), str(uni)), src, uni, keep=True,
             group="ckptconv"),
        Step("from-universal --mesh tp2,dp2 --plan llama",
             _ckptconv("from-universal", str(uni), str(work / "tp2dp2"), "--mesh", "tp2,dp2", "--plan", "llama"),
             uni, work / "tp2dp2", group="ckptconv"),
        Step("from-universal --mesh dp3", _ckptconv("from-universal", str(uni), str(work / "dp3"), "--mesh", "dp3"),
             uni, work / "dp3", group="ckptconv"),
        # the same conversions through the safetensors backend of the store, side by side
        Step("to-universal --backend safetensors",
             _ckptconv("to-universal", "--backend", "safetensors", str(src), str(unist)), src, unist, keep=True,
             group="ckptconv"),
        Step("from-universal --mesh dp3 (safetensors store)",
             _ckptconv("from-universal", str(unist), str(work / "dp3-st"), "--mesh", "dp3"),
             unist, work / "dp3-st", group="ckptconv"),
    ]
    steps.append(Step(RESHARD, _ckptconv("from-universal", str(src), str(work / "dcp-dp3"), "--mesh", "dp3"),
                      src, work / "dcp-dp3", group="ckptconv"))
    if export_hf_available():
        steps.append(Step("export-hf", _ckptconv("export-hf", str(uni), str(work / "hf")), uni, work / "hf",
                          group="ckptconv"))
        steps.append(Step("export-hf (safetensors store)", _ckptconv("export-hf", str(unist), str(work / "hf-st")),
                          unist, work / "hf-st", group="ckptconv"))
    if with_torch:
        steps += [
            Step("torch dcp_to_torch_save", [*fmt, "dcp_to_torch", str(src), str(pt)], src, pt, keep=True,
                 group="torch"),
            Step("torch torch_save_to_dcp", [*fmt, "torch_to_dcp", str(pt), str(work / "tdcp")], pt,
                 work / "tdcp", group="torch"),
        ]
    if with_online:
        steps += [
            Step("torch online reshard: dcp.load in a dp3 world",
                 [PY, str(BENCH / "make_checkpoint.py"), "load", "--src", str(src), "--world", "3"], src,
                 group="torch"),
        ]
    if only:
        steps = [s for s in steps if s.name.split()[0] in only or s.name in only or s.group in only]
    return steps


def _remove(path: Path | None) -> None:
    if path is None or not path.exists():
        return
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def _size(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    return dir_bytes(path) if path.is_dir() else path.stat().st_size


def run_rounds(steps: list[Step], repeats: int, cold: bool) -> None:
    """Run every step ``repeats`` times, round-robin, cleaning outputs as it goes."""
    for rnd in range(repeats):
        for step in steps:
            if not step.reads.exists():
                print(f"  skip {step.name}: {step.reads} missing", file=sys.stderr)
                continue
            _remove(step.writes)
            step.input_bytes = _size(step.reads)
            run = measure(step.cmd, step.reads, sync=step.writes is not None, cold=cold)
            step.runs.append(run)
            step.output_bytes = _size(step.writes)
            status = "" if run.rc == 0 else f"  FAILED rc={run.rc}: {run.tail[-300:]}"
            print(f"  round {rnd + 1}/{repeats}  {step.name:<48} {run.wall_s:7.2f} s  "
                  f"tree {run.tree_peak_rss / MIB:7.0f} MiB  load {run.load_before[0]:.1f}{status}",
                  file=sys.stderr, flush=True)
            if not step.keep:
                _remove(step.writes)
        for step in steps:
            _remove(step.writes)


# ----------------------------------------------------------------------------- results


def summarize(step: Step, nbytes: int, raw_copy_s: float | None) -> dict:
    """Medians over a step's successful runs."""
    ok = [r for r in step.runs if r.rc == 0]
    row = {"name": step.name, "group": step.group, "cmd": " ".join(step.cmd), "input_bytes": nbytes,
           "output_bytes": step.output_bytes,
           "runs": [asdict(r) for r in step.runs], "ok_runs": len(ok)}
    if not ok:
        return row
    wall = statistics.median(r.wall_s for r in ok)
    row |= {
        "wall_s": wall,
        "wall_s_all": [round(r.wall_s, 3) for r in ok],
        "sync_s": statistics.median(r.sync_s for r in ok),
        "cpu_s": statistics.median(r.cpu_s for r in ok),
        "gb_per_s": nbytes / wall / 1e9 if step.group not in ("fixed",) else None,
        "x_raw_copy": wall / raw_copy_s if raw_copy_s and step.group != "fixed" else None,
        "tree_peak_rss": max(r.tree_peak_rss for r in ok),
        "main_max_rss": max(r.main_max_rss for r in ok),
    }
    return row


def torch_sum_row(rows: list[dict], nbytes: int, raw_copy_s: float | None) -> dict | None:
    """dcp_to_torch_save + torch_save_to_dcp as one row (sum of walls, max of peaks)."""
    parts = [r for r in rows if r["name"] in ("torch dcp_to_torch_save", "torch torch_save_to_dcp")]
    if len(parts) != 2 or any("wall_s" not in r for r in parts):
        return None
    wall = sum(r["wall_s"] for r in parts)
    cpu = sum(r.get("cpu_s", 0.0) for r in parts)
    return {"cpu_s": cpu, "name": "torch manual path (sum of both)", "group": "torch", "input_bytes": nbytes,
            "output_bytes": parts[1].get("output_bytes", 0), "wall_s": wall,
            "gb_per_s": nbytes / wall / 1e9, "x_raw_copy": wall / raw_copy_s if raw_copy_s else None,
            "tree_peak_rss": max(r["tree_peak_rss"] for r in parts),
            "main_max_rss": max(r["main_max_rss"] for r in parts), "ok_runs": min(r["ok_runs"] for r in parts)}


def ensure_checkpoint(size: int) -> dict:
    """The cached checkpoint's info, building it in a child process when missing.

    This process never imports torch: a forked child's max RSS (wait4) starts from its parent's.
    """
    info = cached_info(size)
    if info is None:
        subprocess.run([PY, str(BENCH / "make_checkpoint.py"), "make", "--size", str(size)], check=True,
                       stdout=subprocess.DEVNULL)
        info = cached_info(size)
    return info


def bench_size(size: int, args: argparse.Namespace) -> dict:
    """Make (or reuse) the checkpoint of ``size`` and run every step on it."""
    t0 = time.perf_counter()
    info = ensure_checkpoint(size)
    made_s = time.perf_counter() - t0
    src = Path(info["path"])
    print(f"# {size_label(size)}: {src} ({info['bytes'] / 1e9:.2f} GB, {info['params'] / 1e6:.0f}M params; "
          f"built in {info['build_seconds']} s)", file=sys.stderr, flush=True)
    work = OUT / f"work-{size_label(size)}"
    _remove(work)
    work.mkdir(parents=True)
    free = psutil.virtual_memory().available
    with_torch = size <= parse_size(args.torch_max_size) and free > 1.5 * info["bytes"]
    with_online = size <= parse_size(args.online_max_size) and free > 3 * info["bytes"]
    steps = make_steps(src, work, set(args.only.split(",")) if args.only else None, with_torch, with_online)
    try:
        run_rounds(steps, args.repeats, not args.warm)
    finally:
        _remove(work)
    raw = next((s for s in steps if s.group == "raw" and s.name.startswith("raw copy")), None)
    raw_rows = summarize(raw, info["bytes"], None) if raw else None
    raw_copy_s = raw_rows.get("wall_s") if raw_rows else None
    rows = [summarize(s, s.input_bytes or info["bytes"], raw_copy_s) for s in steps]
    extra = torch_sum_row(rows, info["bytes"], raw_copy_s)
    if extra:
        rows.append(extra)
    return {"size": size_label(size), "checkpoint": info, "checkpoint_ready_s": round(made_s, 1),
            "torch_manual_path": with_torch, "torch_online_reshard": with_online, "rows": rows}


def machine() -> dict:
    """What the numbers were measured on."""
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor())
    torch_version = subprocess.run([PY, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                   text=True).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return {"cpu": model, "cpu_count": os.cpu_count(), "mem_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch_version,
            "disk": _disk_of(ROOT), "git_commit": commit.stdout.strip(), "engine_uncommitted": _dirty()}


def _dirty() -> list[str]:
    """Engine files that differ from the commit (other work in progress in the same tree)."""
    r = subprocess.run(["git", "status", "--porcelain", "--", "converter", "formats"], capture_output=True,
                       text=True, cwd=ROOT)
    return [ln[3:] for ln in r.stdout.splitlines()]


def _disk_of(path: Path) -> str:
    r = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True)
    return " ".join(r.stdout.split()[2:]) if r.returncode == 0 else "?"


# ----------------------------------------------------------------------------- report


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def table(results: list[dict]) -> str:
    """The markdown table of every size's rows."""
    lines = ["| size | step | in GB | out GB | wall s (median) | runs | GB/s (in) | x raw copy | CPU s "
             "| peak RSS tree MiB | peak RSS main MiB |", "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for res in results:
        for r in res["rows"]:
            if "wall_s" not in r:
                lines.append(f"| {res['size']} | {r['name']} | | | FAILED | | | | | | |")
                continue
            runs = ", ".join(f"{w:.2f}" for w in r.get("wall_s_all", []))
            gb = "" if r["group"] == "fixed" else f"{r['input_bytes'] / 1e9:.2f}"
            out = f"{r['output_bytes'] / 1e9:.2f}" if r.get("output_bytes") else ""
            lines.append(
                f"| {res['size']} | {r['name']} | {gb} | {out} | {r['wall_s']:.2f} | {runs} "
                f"| {_fmt(r.get('gb_per_s'), '.2f')} | {_fmt(r.get('x_raw_copy'), '.2f')} "
                f"| {_fmt(r.get('cpu_s'), '.1f')} "
                f"| {r['tree_peak_rss'] / MIB:.0f} | {r['main_max_rss'] / MIB:.0f} |")
    return "\n".join(lines)


def _row(res: dict, name: str) -> dict | None:
    return next((r for r in res["rows"] if r["name"] == name and "wall_s" in r), None)


def targets(results: list[dict]) -> list[dict]:
    """The issue's targets, checked on these numbers."""
    out = []
    conv = ("to-universal", "from-universal --mesh tp2,dp2 --plan llama", "from-universal --mesh dp3", RESHARD)
    for res in results:
        for name in conv:
            r = _row(res, name)
            if r and r.get("x_raw_copy") is not None:
                out.append({"target": f"{res['size']} {name} wall <= 1.5x raw copy",
                            "value": round(r["x_raw_copy"], 2), "ok": r["x_raw_copy"] <= 1.5})
            if r:
                out.append({"target": f"{res['size']} {name} peak RSS (tree) < 1 GiB",
                            "value": f"{r['tree_peak_rss'] / MIB:.0f} MiB", "ok": r["tree_peak_rss"] < 1 << 30})
        tu, manual = _row(res, "to-universal"), _row(res, "torch manual path (sum of both)")
        fu = _row(res, "from-universal --mesh dp3")
        if tu and fu and manual:
            ours = tu["wall_s"] + fu["wall_s"]
            speed = manual["wall_s"] / ours
            mem = max(tu["tree_peak_rss"], fu["tree_peak_rss"]) / manual["tree_peak_rss"]
            out.append({"target": f"{res['size']} to+from-universal(dp3) >= 3x faster than torch manual path",
                        "value": round(speed, 2), "ok": speed >= 3})
            out.append({"target": f"{res['size']} ... at <= 1/5 of its peak RSS",
                        "value": round(mem, 3), "ok": mem <= 0.2})
        direct = _row(res, RESHARD)
        if direct and manual:
            speed = manual["wall_s"] / direct["wall_s"]
            mem = direct["tree_peak_rss"] / manual["tree_peak_rss"]
            out.append({"target": f"{res['size']} reshard DCP->DCP directly >= 3x faster than torch manual path",
                        "value": round(speed, 2), "ok": speed >= 3})
            out.append({"target": f"{res['size']} ... at <= 1/5 of its peak RSS", "value": round(mem, 3),
                        "ok": mem <= 0.2})
    if len(results) >= 2:
        small, big = results[0], results[-1]
        for name in conv:
            a, b = _row(small, name), _row(big, name)
            if a and b:
                growth = b["tree_peak_rss"] / a["tree_peak_rss"]
                out.append({"target": f"{name} peak RSS flat {small['size']} -> {big['size']}",
                            "value": f"{a['tree_peak_rss'] / MIB:.0f} -> {b['tree_peak_rss'] / MIB:.0f} MiB "
                                     f"(x{growth:.2f})", "ok": growth <= 1.15})
    return out


def main(argv: list[str] | None = None) -> None:
    assert "torch" not in sys.modules, "run.py must not import torch (it inflates children's max RSS)"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="2GB", help="checkpoint size (default 2GB)")
    p.add_argument("--sizes", default=None, help="several sizes, e.g. 2GB,8GB (overrides --size)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; the table shows medians (default 3)")
    p.add_argument("--only", default=None, help="comma-separated step names or groups (raw,ckptconv,torch,fixed)")
    p.add_argument("--torch-max-size", default="10GB",
                   help="run torch's manual path only up to this size (it holds the whole checkpoint in RAM)")
    p.add_argument("--online-max-size", default="4GB",
                   help="run the online reshard only up to this size (3 ranks: ~2.5x the checkpoint in RAM)")
    p.add_argument("--warm", action="store_true", help="keep inputs in the page cache (pre-read) instead of evicting them")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<date>T<time>-<sizes>.json)")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in (args.sizes or args.size).split(",")]
    t_start = dt.datetime.now().astimezone()
    started = t_start.isoformat(timespec="seconds")
    load0, mach = os.getloadavg(), machine()
    results = [bench_size(s, args) for s in sizes]
    doc = {"started": started, "finished": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": " ".join(["python", "bench/run.py", *(argv if argv is not None else sys.argv[1:])]),
           "machine": mach, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
           "page_cache": "warm (inputs pre-read)" if args.warm else
           ("whole page cache dropped, code re-read, before every step (cold data, warm code)" if can_drop_caches()
            else "input evicted before every step (cold data, warm code)"),
           "results": results, "targets": targets(results)}
    doc["table"] = table(results)
    RESULTS.mkdir(exist_ok=True)
    stamp = t_start.strftime("%Y-%m-%dT%H%M")
    name = args.out or RESULTS / f"{stamp}-{'_'.join(size_label(s) for s in sizes)}.json"
    Path(name).write_text(json.dumps(doc, indent=1) + "\n")
    print(doc["table"])
    print()
    for t in doc["targets"]:
        print(f"- [{'x' if t['ok'] else ' '}] {t['target']}: {t['value']}")
    print(f"\nmachine: {doc['machine']}\nload: {load0} -> {doc['loadavg_end']}\nJSON: {name}")


if __name__ == "__main__":
    main()
