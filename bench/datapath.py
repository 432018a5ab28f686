"""The data path against a plain copy of the same bytes: ``cp -r``, a user-space copy, ckptconv's
three copy steps and torch's own manual path, side by side in one run (issue 26).

    python bench/datapath.py                              # 1GB and 8GB, 3 rounds, profile: ~35 min
    python bench/datapath.py --sizes 1GB --repeats 1      # a quick look (~4 min)
    python bench/datapath.py --no-profile --no-torchrun   # the timed table only
    python bench/datapath.py --sizes 1GB --workdir /dev/shm/ckptconv-bench   # a memory-speed "disk"
    python bench/datapath.py --sources /data/run1/step-1000,/data/run2/ckpt   # any DCP checkpoints

Checkpoints are real 4-rank FSDP2 ``dcp.save`` outputs (``make_checkpoint.py``, cached under
``bench/out/``), or with ``--sources`` any DCP checkpoint folders (the rows keep their names). Each round runs, per size and in this order, every step as a subprocess, timed from
its start to its exit plus a ``sync`` (counted), the page cache dropped first (as root; else the
step's input is evicted with ``posix_fadvise``, see ``run.py``), after the input was read once
(so that a VM host's page cache holds every step's input alike: ``run.read_through``):

- ``cp -r SRC DST``;
- a user-space copy: 16 MiB ``read``/``write`` per call, ``fsync`` per file (this file's ``usercopy``);
- an ``O_DIRECT`` copy as ckptconv writes (``directcopy``), by 1 process and by 2 processes sharing
  the files: whether two writers gain anything on this disk (the torchrun target applies only
  where they do, "where the disk allows");
- ``cp -r`` of the store to-universal wrote (from-universal's own input: its ~10^3 chunk files);
- the source's bytes written into files of the store's paths and sizes by 2 threads, no framework
  (``layoutcopy``: what to-universal's output shape alone costs on this disk);
- ``to-universal SRC UNI`` (FSDP4 DCP -> store), ``from-universal UNI DP3 --mesh dp3`` (store -> DCP)
  and ``from-universal SRC DCP3 --mesh dp3`` (DCP -> DCP reshard), source checks on (the default);
- the same three under ``torchrun --standalone --nproc-per-node 2`` (``--no-torchrun`` skips them);
- torch's manual path: ``dcp.load`` of the whole checkpoint into a state dict, then ``dcp.save``
  (this file's ``torchcopy``; skipped when free memory is under 1.5x the checkpoint).

Then, unless ``--no-profile``, one profiled run of each ckptconv step at the first size: CPU seconds
by cause from ``perf record -g`` (read, check, copy, write, sync, page faults, Python/other), wall
seconds per thread by what it was doing from ``py-spy --idle`` (when installed), and syscall counts
from ``strace -f`` (calls, bytes per write, fsyncs per file written). Results:
``bench/results/<date>T<time>-datapath-<sizes>.json`` and a markdown table on stdout.

Disk space: the checkpoint (1 GB + 8 GB, kept under ``bench/out/``) plus, while a size runs, about
4x its size (the store kept for from-universal, one step's output, torch's output); every output
is deleted right after its step. 8 GB needs ~45 GB free.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import psutil

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(BENCH.parent))  # formats.durability, for layoutcopy (the repo's, not an installed one)
from make_checkpoint import OUT, parse_size, size_label  # noqa: E402
from run import (RESULTS, Step, _fmt, _remove, _size, can_drop_caches, ensure_checkpoint,  # noqa: E402
                 machine, measure)

PY = sys.executable
MIB = 1 << 20
BLOCK = 16 << 20
CP, USER = "cp -r", "user-space copy (16 MiB, fsync per file)"
DIRECT1, DIRECT2 = "O_DIRECT copy, 1 process", "O_DIRECT copy, 2 processes"
CP_STORE = "cp -r of the store (from-universal's input)"
LAYOUT = "the source's bytes into the store's files (no framework)"
TO, FROM, RESHARD = "to-universal (FSDP4 -> store)", "from-universal (store -> dp3)", "DCP -> DCP reshard (dp3)"
TORCH = "torch manual path (dcp.load + dcp.save)"
CONVERSIONS = (TO, FROM, RESHARD)


# ----------------------------------------------------------------------------- the helper commands


def user_copy(src: Path, dst: Path) -> None:
    """Copy the tree ``src`` to ``dst`` in user space: 16 MiB ``read`` / ``write`` calls through one
    buffer, ``fsync`` per file, then each directory (what a careful copy tool does)."""
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    for dirpath, _, files in os.walk(src):
        out = dst / Path(dirpath).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            fin = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            fout = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                while n := os.readv(fin, [view]):
                    done = 0
                    while done < n:
                        done += os.write(fout, view[done:n])
                os.fsync(fout)
            finally:
                os.close(fin)
                os.close(fout)
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def direct_copy(src: Path, dst: Path, procs: int = 1) -> None:
    """Copy the tree ``src`` to ``dst`` as ckptconv writes: 16 MiB reads, the aligned part of each
    written with ``O_DIRECT`` (the page cache bypassed), a file's unaligned tail through the page
    cache, ``fsync`` per file. With ``procs`` > 1, that many processes (forked) copy the files
    between them, each the same share of bytes: how much two writers gain on this disk at all
    (issue 26's "where the disk allows")."""
    if not src.is_dir():
        raise SystemExit(f"direct copy: {src} is not a folder")
    files = sorted((f for f in src.rglob("*") if f.is_file()), key=lambda f: -f.stat().st_size)
    for f in files:
        (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
    shares: list[list[Path]] = [[] for _ in range(procs)]
    loads = [0] * procs
    for f in files:  # the largest file to the least-loaded process
        k = loads.index(min(loads))
        shares[k].append(f)
        loads[k] += f.stat().st_size
    pids = []
    for share in shares[1:]:
        pid = os.fork()
        if pid == 0:  # the child reports a failure by its exit status
            code = 1
            try:
                _direct_copy_files(share, src, dst)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    _direct_copy_files(shares[0], src, dst)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"direct copy: a process failed ({status})")


@contextlib.contextmanager
def _direct_target(target: Path, sync: bool = True) -> Iterator[Callable[[memoryview, int], None]]:
    """A new file written as ckptconv writes: ``write(view, offset)`` sends the aligned part of
    ``view`` (a page-aligned buffer) with ``O_DIRECT`` and its unaligned tail through the page
    cache; the file is fsynced on leaving the block (``sync``; else the caller makes it durable)."""
    fout = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            fdirect = os.open(target, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
        except OSError:  # a file system without O_DIRECT: everything through the page cache
            fdirect = os.dup(fout)
        try:
            def write(view: memoryview, offset: int) -> None:
                aligned = len(view) & ~4095
                if aligned:
                    os.pwrite(fdirect, view[:aligned], offset)
                if len(view) > aligned:
                    os.pwrite(fout, view[aligned:], offset + aligned)

            yield write
            if sync:
                os.fsync(fout)
        finally:
            os.close(fdirect)
    finally:
        os.close(fout)


def _direct_copy_files(files: list[Path], src: Path, dst: Path) -> None:
    import mmap

    from formats.fsutil import fsync_paths

    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    for f in files:
        fin = os.open(f, os.O_RDONLY)
        try:
            with _direct_target(dst / f.relative_to(src)) as write:
                offset = 0
                while n := os.readv(fin, [view]):
                    write(view[:n], offset)
                    offset += n
        finally:
            os.close(fin)
    fsync_paths(sorted({(dst / f.relative_to(src)).parent for f in files}))


def layout_copy(src: Path, layout: Path, dst: Path, threads: int = 2) -> None:
    """The floor of writing a conversion's output tree with no framework: the bytes of ``src`` (its
    files one after another, from the start again if the tree is larger) written into files of
    the same relative paths and sizes as under ``layout`` (the output of the step, e.g. the store
    to-universal wrote: ~10^3 small files and their folders), ``threads`` threads, each file read
    with ``preadv`` and written as ckptconv and ``directcopy`` write (aligned part ``O_DIRECT``),
    then every file and folder made durable as ckptconv's store commit does it
    (``formats.durability.make_durable``: one ``syncfs`` where that suits, else an fsync of each).
    No checks, no metadata: what the output's shape costs on this disk whatever the program."""
    import bisect
    import mmap
    import threading

    from formats.durability import make_durable

    sources = sorted(f for f in src.rglob("*") if f.is_file())
    starts, total, fds = [], 0, []
    for f in sources:
        starts.append(total)
        total += f.stat().st_size
        fds.append(os.open(f, os.O_RDONLY))
    if not total:
        raise SystemExit(f"layout copy: {src} holds no bytes")

    def read(view: memoryview, at: int) -> None:  # ``len(view)`` bytes of the concatenated source
        done = 0
        while done < len(view):
            pos = (at + done) % total
            k = bisect.bisect_right(starts, pos) - 1
            end = starts[k + 1] if k + 1 < len(starts) else total
            n = os.preadv(fds[k], [view[done: done + min(len(view) - done, end - pos)]], pos - starts[k])
            if n <= 0:
                raise SystemExit(f"layout copy: {sources[k]} shrank while read")
            done += n

    plan, at = [], 0
    for f in sorted((f for f in layout.rglob("*") if f.is_file()), key=str):
        size = f.stat().st_size
        plan.append((dst / f.relative_to(layout), size, at))
        at += size
    folders = sorted({dst} | {dst / d.relative_to(layout) for d in layout.rglob("*") if d.is_dir()})
    errors: list[BaseException] = []

    def copy(share: list[tuple[Path, int, int]]) -> None:
        buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
        view = memoryview(buf)
        try:
            for target, size, start in share:
                with _direct_target(target, sync=False) as write:
                    for offset in range(0, size, BLOCK):
                        n = min(BLOCK, size - offset)
                        read(view[:n], start + offset)
                        write(view[:n], offset)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    for d in folders:
        d.mkdir(parents=True, exist_ok=True)
    workers = [threading.Thread(target=copy, args=(plan[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for fd in fds:
        os.close(fd)
    if errors:
        raise errors[0]
    make_durable(dst, [*(target for target, _, _ in plan), *folders])


def torch_copy(src: Path, dst: Path) -> None:
    """torch's own manual path: the whole checkpoint loaded into one state dict (``dcp.load`` with
    the planner ``dcp_to_torch_save`` uses), then ``dcp.save`` of it (one process, no group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    _load_state_dict(sd, storage_reader=dcp.FileSystemReader(str(src)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    dcp.save(sd, checkpoint_id=str(dst), no_dist=True)


# ----------------------------------------------------------------------------- the steps


def _ckptconv(*args: str, ranks: int = 1) -> list[str]:
    if ranks > 1:
        return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                "-m", "converter", *args, "--no-progress"]
    return [PY, "-m", "converter", *args, "--no-progress"]


def make_steps(src: Path, work: Path, with_torch: bool, with_torchrun: bool) -> list[Step]:
    """The rows of one size, in run order (from-universal reads the store to-universal kept)."""
    uni = work / "uni"
    me = [PY, str(Path(__file__).resolve())]
    steps = [
        Step(CP, ["cp", "-r", str(src), str(work / "cp")], src, work / "cp", group="raw"),
        Step(USER, [*me, "usercopy", str(src), str(work / "user")], src, work / "user", group="raw"),
        Step(DIRECT1, [*me, "directcopy", str(src), str(work / "direct1"), "1"], src, work / "direct1", group="raw"),
        Step(DIRECT2, [*me, "directcopy", str(src), str(work / "direct2"), "2"], src, work / "direct2", group="raw"),
        Step(TO, _ckptconv("to-universal", str(src), str(uni)), src, uni, keep=True, group="ckptconv"),
        Step(CP_STORE, ["cp", "-r", str(uni), str(work / "cp-store")], uni, work / "cp-store", group="raw"),
        Step(LAYOUT, [*me, "layoutcopy", str(src), str(uni), str(work / "layout")], src, work / "layout", group="raw"),
        Step(FROM, _ckptconv("from-universal", str(uni), str(work / "dp3"), "--mesh", "dp3"), uni, work / "dp3",
             group="ckptconv"),
        Step(RESHARD, _ckptconv("from-universal", str(src), str(work / "dcp3"), "--mesh", "dp3"), src,
             work / "dcp3", group="ckptconv"),
    ]
    if with_torchrun:
        uni2 = work / "uni2"
        steps += [
            Step(f"{TO}, torchrun 2", _ckptconv("to-universal", str(src), str(uni2), ranks=2), src, uni2,
                 group="torchrun"),
            Step(f"{FROM}, torchrun 2", _ckptconv("from-universal", str(uni), str(work / "dp3-2"), "--mesh", "dp3",
                                                  ranks=2), uni, work / "dp3-2", group="torchrun"),
            Step(f"{RESHARD}, torchrun 2", _ckptconv("from-universal", str(src), str(work / "dcp3-2"), "--mesh",
                                                     "dp3", ranks=2), src, work / "dcp3-2", group="torchrun"),
        ]
    if with_torch:
        steps.append(Step(TORCH, [*me, "torchcopy", str(src), str(work / "torch")], src, work / "torch",
                          group="torch"))
    return steps


def run_rounds(steps: list[Step], repeats: int) -> None:
    """Every step ``repeats`` times, round-robin; outputs removed as soon as no later step needs them."""
    for rnd in range(repeats):
        for step in steps:
            _remove(step.writes)
            step.input_bytes = _size(step.reads)
            run = measure(step.cmd, step.reads, sync=True, cold=True)
            step.runs.append(run)
            step.output_bytes = _size(step.writes)
            status = "" if run.rc == 0 else f"  FAILED rc={run.rc}: {run.tail[-400:]}"
            print(f"  round {rnd + 1}/{repeats}  {step.name:<52} {run.wall_s:7.2f} s  cpu {run.cpu_s:6.2f}  "
                  f"rss {run.tree_peak_rss / MIB:6.0f} MiB  load {run.load_before[0]:.1f}{status}",
                  file=sys.stderr, flush=True)
            if not step.keep:
                _remove(step.writes)
        for step in steps:
            _remove(step.writes)


_TIMINGS = re.compile(r"ckptconv: timings: (.*) \| total")


def phases(tail: str) -> dict[str, float] | None:
    """The ``CKPTCONV_TIMINGS`` line a ckptconv step printed (seconds per phase), or None."""
    m = _TIMINGS.search(tail)
    if not m:
        return None
    return {name: float(sec) for name, sec in (f.rsplit(" ", 1) for f in m.group(1).split(" | "))}


def paired_ratio(step: Step, ref: Step | None) -> float | None:
    """The median over rounds of this step's wall time over ``ref``'s in the same round (both
    succeeded): steady under the drift of this VM between rounds, unlike a ratio of medians."""
    if ref is None:
        return None
    pairs = [a.wall_s / b.wall_s for a, b in zip(step.runs, ref.runs) if a.rc == 0 and b.rc == 0 and b.wall_s > 0]
    return statistics.median(pairs) if pairs else None


def summarize(step: Step, cp_s: float | None, user_s: float | None, cp: Step | None = None,
              user: Step | None = None) -> dict:
    ok = [r for r in step.runs if r.rc == 0]
    row = {"name": step.name, "group": step.group, "cmd": " ".join(step.cmd), "input_bytes": step.input_bytes,
           "output_bytes": step.output_bytes, "ok_runs": len(ok), "runs": [asdict(r) for r in step.runs]}
    if not ok:
        return row
    wall = statistics.median(r.wall_s for r in ok)
    row |= {"wall_s": wall, "wall_s_all": [round(r.wall_s, 3) for r in ok],
            "sync_s": statistics.median(r.sync_s for r in ok), "cpu_s": statistics.median(r.cpu_s for r in ok),
            "gb_per_s": step.input_bytes / wall / 1e9, "x_cp": wall / cp_s if cp_s else None,
            "x_user_copy": wall / user_s if user_s else None,
            "x_cp_paired": paired_ratio(step, cp), "x_user_copy_paired": paired_ratio(step, user),
            "tree_peak_rss": max(r.tree_peak_rss for r in ok), "main_max_rss": max(r.main_max_rss for r in ok)}
    parsed = [p for p in (phases(r.tail) for r in ok) if p]
    if parsed:  # the median of each phase over the runs (CKPTCONV_TIMINGS)
        row["phases_s"] = {k: round(statistics.median(p.get(k, 0.0) for p in parsed), 3) for k in parsed[0]}
    return row


def input_label(what: int | Path) -> str:
    """How an input is named in the table: its size (``1GB``), or the checkpoint folder's name."""
    return what.name if isinstance(what, Path) else size_label(what)


def given_checkpoint(path: Path, option: str = "--sources") -> dict:
    """The info of a checkpoint folder given with ``option`` (any DCP checkpoint)."""
    if not (path / ".metadata").is_file():
        raise SystemExit(f"{option} {path}: not a DCP checkpoint folder (no .metadata)")
    return {"path": str(path), "bytes": _size(path), "given": True}


def _source(what: int | Path, args: argparse.Namespace) -> tuple[dict, Path, Path]:
    """(checkpoint info, source folder, work root): the cached checkpoint under ``bench/out`` (or
    the folder given), or with ``--workdir`` a copy of it there (made once), outputs there too."""
    info = given_checkpoint(what) if isinstance(what, Path) else ensure_checkpoint(what)
    src = Path(info["path"])
    if args.workdir is None:
        return info, src, OUT
    root = Path(args.workdir)
    need = 4.5 * info["bytes"]  # the copy, the store, one output, torch's output
    if root.resolve().is_relative_to("/dev/shm") and psutil.virtual_memory().available < need + (2 << 30):
        raise SystemExit(f"--workdir {root}: tmpfs needs ~{need / 1e9:.1f} GB of free memory, "
                         f"{psutil.virtual_memory().available / 1e9:.1f} GB available")
    copy = root / f"ckpt-{input_label(what)}"
    if not copy.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, copy.with_name(copy.name + ".part"), dirs_exist_ok=True)
        os.replace(copy.with_name(copy.name + ".part"), copy)
    return info | {"path": str(copy)}, copy, root


def bench_size(size: int | Path, args: argparse.Namespace) -> dict:
    info, src, root = _source(size, args)
    print(f"# {input_label(size)}: {src} ({info['bytes'] / 1e9:.2f} GB)", file=sys.stderr, flush=True)
    work = root / f"datapath-{input_label(size)}"
    _remove(work)
    work.mkdir(parents=True)
    with_torch = args.torch and psutil.virtual_memory().available > 1.5 * info["bytes"]
    steps = make_steps(src, work, with_torch, args.torchrun)
    try:
        run_rounds(steps, args.repeats)
    finally:
        _remove(work)
    walls = {s.name: statistics.median(r.wall_s for r in s.runs if r.rc == 0) for s in steps
             if any(r.rc == 0 for r in s.runs)}
    by_name = {s.name: s for s in steps}
    rows = [summarize(s, walls.get(CP), walls.get(USER), by_name.get(CP), by_name.get(USER)) for s in steps]
    return {"size": input_label(size), "checkpoint": info, "torch_manual_path": with_torch, "rows": rows}


# ----------------------------------------------------------------------------- the profile

#: perf stack frames (kernel and user symbols) -> the cause a CPU sample is charged to: the first
#: cause (in this order) any frame of the sample's stack matches.
PERF_CAUSES = (
    ("check", re.compile(r"crc32|XXH|xxh3|XXHL64")),
    ("page faults", re.compile(r"exc_page_fault|clear_page|do_anonymous_page")),
    ("sync", re.compile(r"fsync|fdatasync|sync_file_range|jbd2|file_write_and_wait|writeback_single")),
    ("write", re.compile(r"ksys_write|ksys_pwrite|vfs_write|do_pwritev|iomap_dio|generic_perform_write")),
    ("read", re.compile(r"ksys_read|ksys_pread|vfs_read|do_preadv|filemap_read")),
    ("copy", re.compile(r"__memmove|__memcpy|memcpy|PyArray_AssignArray|raw_array_assign")),
    ("Python and other", re.compile(r"")),
)


def perf_causes(cmd: list[str], reads: Path, tmp: Path) -> dict | None:
    """CPU seconds by cause of one cold run of ``cmd`` (``perf record -g``, 499 Hz), or None
    without perf."""
    if shutil.which("perf") is None:
        return None
    data = tmp / "perf.data"
    measure(["perf", "record", "-F", "499", "-g", "-o", str(data), "--", *cmd], reads, sync=True, cold=True)
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,sym"], capture_output=True, text=True)
    if script.returncode:
        return None
    counts: collections.Counter[str] = collections.Counter()
    samples = 0
    for block in script.stdout.split("\n\n"):
        frames = [ln.strip().split(" ", 1)[-1] for ln in block.strip().splitlines()]
        if not frames:
            continue
        samples += 1
        cause = next(c for c, rx in PERF_CAUSES if any(rx.search(f) for f in frames))
        counts[cause] += 1
    return {c: round(n / 499, 2) for c, n in counts.most_common()} | {"samples": samples}


#: py-spy: the main thread's phase, by the first of these its stack holds.
SPY_PHASES = (
    ("finish checks", re.compile(r"finish_checks")),
    ("commit (fsyncs, marker)", re.compile(r"\bcommit \(|publish \(")),
    ("copy (executor)", re.compile(r"^execute \(converter/run/(executor|distributed)")),
    ("start-up and imports", re.compile(r"importlib|^_run_module_as_main|^_run_code")),
    ("open, plan, other", re.compile(r"")),
)
#: py-spy: what a copy worker thread is doing, by its leaf frames (innermost first); first match wins.
SPY_WORK = (
    ("check", re.compile(r"integrity\.py|xxh3|_compare|check_crc|_stream_checksum")),
    ("write", re.compile(r"pwrite|write_chunk|_write_prefix|archive_writer\.py|DirectWrites|start_writeback|mkdir|replace")),
    ("read", re.compile(r"_fill \(|read_exact_into|_pread|read_into|SliceReader|storage\.py")),
    ("copy", re.compile(r"fill_piece|cast_bits|copyto|_padded_bytes")),
    ("waiting (no task, budget, locks)", re.compile(r"_worker \(|wait|acquire|Condition")),
    ("other", re.compile(r"")),
)


def spy_causes(cmd: list[str], reads: Path, tmp: Path) -> dict | None:
    """Wall seconds of one cold run (``py-spy --threads --idle``, 100 Hz): the main thread by phase;
    the copy workers by activity, per worker (their sum over the number of workers); the sync
    pool's threads in total. None without py-spy."""
    if shutil.which("py-spy") is None:
        return None
    raw = tmp / "spy.txt"
    measure(["py-spy", "record", "--threads", "--idle", "-r", "100", "--format", "raw", "-o", str(raw), "--", *cmd],
            reads, sync=True, cold=True)
    if not raw.exists():
        return None
    main: collections.Counter[str] = collections.Counter()
    work: collections.Counter[str] = collections.Counter()
    workers, sync = set(), 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        thread, *frames = stack.split(";")
        name = thread.rpartition(": ")[2]
        if name == "MainThread":
            deep = [f for f in frames if not f.startswith(("_run_module_as_main", "_run_code"))]
            phase = next((c for c, rx in SPY_PHASES[:3] if any(rx.search(f) for f in deep)), None)
            if phase is None:
                phase = SPY_PHASES[3][0] if len(deep) <= 1 or any("importlib" in f for f in deep) else SPY_PHASES[4][0]
            main[phase] += int(n)
        elif name.startswith("ckptconv-sync"):
            sync += int(n)
        elif name.startswith("ckptconv"):
            workers.add(name)
            work[next(c for c, rx in SPY_WORK if any(rx.search(f) for f in frames[-4:]))] += int(n)
    per = max(1, len(workers))
    return {"main_thread_s": {c: round(main[c] / 100, 2) for c, _ in SPY_PHASES},
            "per_worker_s": {c: round(work[c] / 100 / per, 2) for c, _ in SPY_WORK}, "workers": len(workers),
            "sync_threads_s": round(sync / 100, 2)}


_CALL = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\d+)")
_TMP = re.compile(r"^\.(.+?)\.tmp(-\d+)?$")  # a temp file renamed into place: .<name>.tmp[-pid]


def _final(path: str) -> str:
    """The path a temp file is renamed to."""
    head, _, name = path.rpartition("/")
    m = _TMP.match(name)
    return f"{head}/{m.group(1)}" if m else path


def strace_counts(cmd: list[str], reads: Path, tmp: Path, out: Path) -> dict | None:
    """Syscall counts of one run (``strace -ff -y``, one log per thread): calls, bytes per write
    call, fsyncs per file written (temp files counted as the file they are renamed to), or None
    without strace."""
    if shutil.which("strace") is None:
        return None
    prefix = tmp / "strace"
    calls = "read,pread64,readv,preadv,preadv2,write,pwrite64,writev,pwritev,pwritev2,fsync,fdatasync,sync_file_range"
    measure(["strace", "-ff", "-y", "-qq", "-e", f"trace={calls}", "-o", str(prefix), *cmd], reads, sync=True,
            cold=True)
    counts: collections.Counter[str] = collections.Counter()
    written: collections.Counter[str] = collections.Counter()
    syncs: collections.Counter[str] = collections.Counter()
    write_bytes = []
    for log in tmp.glob("strace.*"):
        for line in log.read_text(errors="replace").splitlines():
            m = _CALL.match(line)
            if not m:
                continue
            name, rest, ret = m.group(1), m.group(2), int(m.group(3))
            counts[name] += 1
            where = re.match(r"\d+<([^>]*)>", rest)
            path = _final(where.group(1)) if where else "?"
            if not path.startswith(str(out)):
                continue
            if name.startswith(("write", "pwrite")) and ret > 0:
                write_bytes.append(ret)
                written[path] += 1
            if name in ("fsync", "fdatasync"):
                syncs[path] += 1
        log.unlink()
    files = [p for p in written if not os.path.basename(p).startswith(".ckptconv")]
    per_file = collections.Counter(syncs.get(p, 0) for p in files)
    return {"calls": dict(counts.most_common()), "write_calls_to_output": len(write_bytes),
            "bytes_per_write_median": statistics.median(write_bytes) if write_bytes else 0,
            "bytes_written_in_writes_of_1MiB_or_more": sum(b for b in write_bytes if b >= MIB),
            "bytes_written": sum(write_bytes), "files_written": len(files),
            "fsyncs_per_file_written": dict(sorted(per_file.items())), "fsyncs_of_output": sum(syncs.values())}


def profile(size: int | Path, args: argparse.Namespace) -> dict:
    """One profiled cold run of each ckptconv step (perf, py-spy, strace each its own run)."""
    info, src, root = _source(size, args)
    work = root / f"datapath-profile-{input_label(size)}"
    _remove(work)
    work.mkdir(parents=True)
    out: dict = {"size": input_label(size)}
    try:
        with tempfile.TemporaryDirectory(dir=work) as tmp_dir:
            tmp = Path(tmp_dir)
            uni = work / "uni"
            subprocess.run(_ckptconv("to-universal", str(src), str(uni)), check=True, capture_output=True)
            steps = {TO: (["to-universal", str(src)], src), FROM: (["from-universal", str(uni)], uni),
                     RESHARD: (["from-universal", str(src)], src)}
            for name, (head, reads) in steps.items():
                dst = work / "out"
                tail = ["--mesh", "dp3"] if head[0] == "from-universal" else []
                cmd = _ckptconv(*head, str(dst), *tail)
                row = {}
                for what, fn in (("cpu_s_by_cause", lambda: perf_causes(cmd, reads, tmp)),
                                 ("wall_s_by_activity", lambda: spy_causes(cmd, reads, tmp)),
                                 ("syscalls", lambda: strace_counts(cmd, reads, tmp, dst))):
                    _remove(dst)
                    row[what] = fn()
                    print(f"  profile {name:<40} {what}: {row[what]}", file=sys.stderr, flush=True)
                _remove(dst)
                out[name] = row
    finally:
        _remove(work)
    return out


# ----------------------------------------------------------------------------- report


def table(results: list[dict]) -> str:
    lines = ["| size | step | GB | wall s (median of runs) | runs | x cp | x cp, paired | x user copy "
             "| x user copy, paired | GB/s | CPU s | sync s | peak RSS MiB |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        for r in res["rows"]:
            if "wall_s" not in r:
                lines.append(f"| {res['size']} | {r['name']} | | FAILED | | | | | | | | | |")
                continue
            lines.append(f"| {res['size']} | {r['name']} | {r['input_bytes'] / 1e9:.2f} | {r['wall_s']:.2f} "
                         f"| {', '.join(f'{w:.2f}' for w in r['wall_s_all'])} | {_fmt(r['x_cp'], '.2f')} "
                         f"| {_fmt(r.get('x_cp_paired'), '.2f')} | {_fmt(r['x_user_copy'], '.2f')} "
                         f"| {_fmt(r.get('x_user_copy_paired'), '.2f')} | {r['gb_per_s']:.2f} | {r['cpu_s']:.1f} "
                         f"| {r['sync_s']:.2f} | {r['tree_peak_rss'] / MIB:.0f} |")
    return "\n".join(lines)


def phase_table(results: list[dict]) -> str:
    """Where each ckptconv step's wall time went (``CKPTCONV_TIMINGS``, medians), as markdown."""
    names = ["imports", "source", "planned", "destination", "prepare", "copy", "commit", "exit"]
    lines = ["| size | step | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    for res in results:
        for r in res["rows"]:
            ph = r.get("phases_s")
            if ph:
                lines.append(f"| {res['size']} | {r['name']} | " + " | ".join(f"{ph.get(n, 0):.2f}" for n in names) + " |")
    return "\n".join(lines)


def profile_table(prof: dict) -> str:
    """CPU by cause and wall by activity per step, as markdown."""
    steps = [k for k in prof if k != "size"]
    causes = [c for c, _ in PERF_CAUSES]
    lines = [f"CPU seconds by cause (perf, {prof['size']}):", "",
             "| step | " + " | ".join(causes) + " |", "|---|" + "---:|" * len(causes)]
    for s in steps:
        cpu = prof[s].get("cpu_s_by_cause") or {}
        lines.append(f"| {s} | " + " | ".join(f"{cpu.get(c, 0):.2f}" for c in causes) + " |")
    phases, acts = [c for c, _ in SPY_PHASES], [c for c, _ in SPY_WORK]
    lines += ["", f"Wall seconds of the main thread by phase, and of each copy worker by activity (py-spy --idle, "
              f"{prof['size']}):", "",
              "| step | " + " | ".join(phases) + " | worker: " + " | ".join(acts) + " |",
              "|---|" + "---:|" * (len(phases) + len(acts))]
    for s in steps:
        wall = prof[s].get("wall_s_by_activity") or {}
        m, w = wall.get("main_thread_s", {}), wall.get("per_worker_s", {})
        lines.append(f"| {s} | " + " | ".join(f"{m.get(c, 0):.2f}" for c in phases) + " | "
                     + " | ".join(f"{w.get(c, 0):.2f}" for c in acts) + " |")
    lines += ["", "| step | write calls | median bytes/write | bytes in writes >= 1 MiB | files | fsyncs per file "
              "(count: files) | fsyncs |", "|---|---:|---:|---:|---:|---|---:|"]
    for s in steps:
        st = prof[s].get("syscalls")
        if st:
            share = st["bytes_written_in_writes_of_1MiB_or_more"] / max(1, st["bytes_written"])
            lines.append(f"| {s} | {st['write_calls_to_output']} | {st['bytes_per_write_median']:.0f} "
                         f"| {share:.1%} | {st['files_written']} | {st['fsyncs_per_file_written']} "
                         f"| {st['fsyncs_of_output']} |")
    return "\n".join(lines)


def _row(res: dict, name: str) -> dict | None:
    return next((r for r in res["rows"] if r["name"] == name and "wall_s" in r), None)


def _scaling_target(res: dict, name: str, speed: float) -> dict:
    """torchrun 2 >= 1.6x one process "where the disk allows": the disk allows it when two
    processes' O_DIRECT copy of the same bytes is itself >= 1.6x one process's. Where it is not,
    the target is not applicable (ok None) and the row says how much the disk gave."""
    one, two = _row(res, DIRECT1), _row(res, DIRECT2)
    disk = one["wall_s"] / two["wall_s"] if one and two else None
    target = f"{res['size']} {name}: torchrun 2 processes >= 1.6x one process"
    if disk is None or disk >= 1.6:
        return {"target": target, "value": round(speed, 2), "ok": speed >= 1.6,
                "disk_x": None if disk is None else round(disk, 2)}
    return {"target": target + f" (not applicable: two O_DIRECT copies give x{disk:.2f})",
            "value": round(speed, 2), "ok": None, "disk_x": round(disk, 2)}


def targets(results: list[dict]) -> list[dict]:
    """Issue 26's targets on these numbers."""
    out = []
    for res in results:
        for name in CONVERSIONS:
            r = _row(res, name)
            if not r:
                continue
            for ref, key in (("cp", "x_cp"), ("the user-space copy", "x_user_copy")):
                if r.get(key) is not None:  # met only when the ratio of medians and the paired ratio both are
                    paired = r.get(f"{key}_paired")
                    worst = max(r[key], paired if paired is not None else r[key])
                    out.append({"target": f"{res['size']} {name}: wall <= 1.3x {ref} (medians; paired by round)",
                                "value": f"{r[key]:.2f}; {_fmt(paired, '.2f')}", "ok": worst <= 1.3})
            own = _row(res, {FROM: CP_STORE, TO: LAYOUT}.get(name, ""))
            if own:  # the raw copy of this step's own input (the store's files) or output (into them)
                x = r["wall_s"] / own["wall_s"]
                out.append({"target": f"{res['size']} {name}: wall <= 1.3x {own['name']}", "value": round(x, 2),
                            "ok": x <= 1.3})
            out.append({"target": f"{res['size']} {name}: peak RSS < 256 MiB", "ok": r["tree_peak_rss"] < 256 * MIB,
                        "value": f"{r['tree_peak_rss'] / MIB:.0f} MiB"})
            two = _row(res, f"{name}, torchrun 2")
            if two:
                out.append(_scaling_target(res, name, r["wall_s"] / two["wall_s"]))
        manual = _row(res, TORCH)
        direct = _row(res, RESHARD)
        if manual and direct:
            out.append({"target": f"{res['size']} DCP -> DCP reshard vs torch's manual path (x faster)",
                        "value": round(manual["wall_s"] / direct["wall_s"], 2), "ok": True})
    if len(results) >= 2:
        for name in CONVERSIONS:
            a, b = _row(results[0], name), _row(results[-1], name)
            if a and b:
                growth = b["tree_peak_rss"] / a["tree_peak_rss"]
                out.append({"target": f"{name}: peak RSS flat {results[0]['size']} -> {results[-1]['size']}",
                            "value": f"x{growth:.2f}", "ok": growth <= 1.15})
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["usercopy"]:
        return user_copy(Path(argv[1]), Path(argv[2]))
    if argv[:1] == ["directcopy"]:
        return direct_copy(Path(argv[1]), Path(argv[2]), int(argv[3]))
    if argv[:1] == ["layoutcopy"]:
        return layout_copy(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    if argv[:1] == ["torchcopy"]:
        return torch_copy(Path(argv[1]), Path(argv[2]))
    assert "torch" not in sys.modules, "datapath.py must not import torch (it inflates children's max RSS)"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1GB,8GB", help="checkpoint sizes (default 1GB,8GB)")
    p.add_argument("--sources", default=None,
                   help="comma-separated DCP checkpoint folders to run on instead of the bench's own (--sizes)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; medians are shown (default 3)")
    p.add_argument("--no-torch", dest="torch", action="store_false", help="skip torch's manual path")
    p.add_argument("--no-torchrun", dest="torchrun", action="store_false", help="skip the torchrun 2-process rows")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled runs")
    p.add_argument("--workdir", default=None,
                   help="put a copy of the source and every output under this folder (e.g. /dev/shm/ckptconv-bench: "
                        "a memory-speed disk; free memory is checked first)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<date>T<time>-datapath-<sizes>.json)")
    args = p.parse_args(argv)
    sizes: list[int | Path] = ([Path(x).resolve() for x in args.sources.split(",")] if args.sources
                               else [parse_size(s) for s in args.sizes.split(",")])
    # the program's bytecode compiled first, as a pip-installed wheel has it: where
    # PYTHONDONTWRITEBYTECODE is set (this workplace sets it) every step would compile its sources
    subprocess.run([PY, "-m", "compileall", "-q", "converter", "formats", "schemas"], cwd=str(BENCH.parent),
                   check=True, capture_output=True)
    os.environ["CKPTCONV_TIMINGS"] = "1"  # each ckptconv step prints where its time went (phases_s)
    t0 = dt.datetime.now().astimezone()
    load0 = os.getloadavg()
    doc: dict = {"started": t0.isoformat(timespec="seconds"),
                 "command": " ".join(["python", "bench/datapath.py", *argv]), "machine": machine(),
                 "workdir": args.workdir,
                 "page_cache": "whole page cache dropped before every step" if can_drop_caches()
                 else "each step's input evicted (posix_fadvise DONTNEED) before it", "loadavg_start": load0}
    doc["results"] = [bench_size(s, args) for s in sizes]
    doc["profile"] = profile(sizes[0], args) if args.profile else None
    doc |= {"finished": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "loadavg_end": os.getloadavg(), "targets": targets(doc["results"]), "table": table(doc["results"]),
            "phase_table": phase_table(doc["results"])}
    if doc["profile"]:
        doc["profile_table"] = profile_table(doc["profile"])
    RESULTS.mkdir(exist_ok=True)
    name = Path(args.out) if args.out else \
        RESULTS / f"{t0.strftime('%Y-%m-%dT%H%M')}-datapath-{'_'.join(input_label(s) for s in sizes)}.json"
    name.write_text(json.dumps(doc, indent=1) + "\n")
    print(doc["table"])
    print("\nWhere each step's wall time went (s, CKPTCONV_TIMINGS, medians):\n\n" + doc["phase_table"])
    if doc["profile"]:
        print("\n" + doc["profile_table"])
    print()
    for t in doc["targets"]:
        print(f"- [{'x' if t['ok'] else ' ' if t['ok'] is not None else '-'}] {t['target']}: {t['value']}")
    print(f"\nload: {load0} -> {doc['loadavg_end']}\nJSON: {name}")


if __name__ == "__main__":
    main()
