"""The data path (issue 26): what each conversion writes and how it makes it durable, and its
speed and memory against a user-space copy of the same bytes.

- Direct writes (``O_DIRECT`` for the large aligned part of each piece) and page-cache writes give
  byte-identical files, for every output the copy steps write (store chunks of both backends,
  DCP rank files), and the direct run really wrote most bytes direct.
- Durability: with no journal batch in between, every output file is fsynced exactly once, the
  marker once, after every data file, and each directory at most twice (the destination's three
  times: its output record at the start, before and after the marker's rename); with a journal batch after every task, a store chunk file is still synced
  once (it is written once) and a DCP rank file once per batch that wrote to it. Where one
  ``syncfs`` stands for the fsyncs of many paths (``formats.durability``), a data file is fsynced
  at most once and a ``syncfs`` comes after the last write into the output and before the marker
  (in-process and at the OS level, where a planted missing ``syncfs`` is caught).
- Generous bounds (slow): each step, cold, within 3x a user-space copy of the same bytes (16 MiB
  writes, fsync per file) once the process start-up is taken off, at under 256 MiB peak RSS with
  the default budget.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from converter import api, knobs
from converter.config import RunOptions
from formats import durability, fsutil

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]

_MAKE = """
import sys, torch, torch.distributed.checkpoint as dcp
g = torch.Generator().manual_seed(0)
mib = int(sys.argv[2])
rows = mib * (1 << 20) // (4 * 1031)
sd = {"model": {f"w{i}": torch.randn(rows + i, 1031, generator=g) for i in range(int(sys.argv[3]))},
      "half": torch.randn(777, 1025, generator=g).to(torch.bfloat16), "step": torch.tensor(3.0)}
dcp.save(sd, checkpoint_id=sys.argv[1])
"""


def make_checkpoint(path: Path, mib: int, n: int) -> Path:
    subprocess.run([sys.executable, "-c", _MAKE, str(path), str(mib), str(n)], check=True, timeout=600,
                   capture_output=True)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A single-process DCP checkpoint of 4 fp32 tensors of ~8 MiB (odd row lengths) + bf16 + 0-d."""
    return make_checkpoint(tmp_path_factory.mktemp("dp") / "ckpt", 8, 4)


def _files(root: Path) -> dict[str, bytes]:
    skip = {"ckptconv.json", ".metadata", ".written-by-ckptconv.json"}  # hold a timestamp, a save id, paths
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


def _steps(ckpt: Path, out: Path, opts: RunOptions) -> dict[str, Path]:
    api.to_universal(ckpt, out / "uni", opts, chunk_bytes=2 * MIB)
    api.to_universal(ckpt, out / "uni-st", opts, chunk_bytes=2 * MIB, backend="safetensors")
    api.from_universal(out / "uni", out / "dp3", "dp3", options=opts)
    api.from_universal(ckpt, out / "dcp3", "dp3", options=opts)
    return {name: out / name for name in ("uni", "uni-st", "dp3", "dcp3")}


def test_direct_and_buffered_writes_give_the_same_files(ckpt, tmp_path, monkeypatch):
    direct_bytes = []  # bytes written through an O_DIRECT descriptor
    write = fsutil.pwrite_all

    def counting(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            direct_bytes.append(len(memoryview(data).cast("B")))
        return write(fd, data, offset)

    monkeypatch.setattr(fsutil, "pwrite_all", counting)
    opts = RunOptions(piece_bytes=4 * MIB)
    monkeypatch.setattr(knobs, "DIRECT_WRITES", True)
    direct = _steps(ckpt, tmp_path / "direct", opts)
    went_direct = sum(direct_bytes)
    monkeypatch.setattr(knobs, "DIRECT_WRITES", False)
    direct_bytes.clear()
    buffered = _steps(ckpt, tmp_path / "buffered", opts)
    assert sum(direct_bytes) == 0
    for name in direct:
        a, b = _files(direct[name]), _files(buffered[name])
        assert a.keys() == b.keys() and a, name
        for f in a:
            assert a[f] == b[f], (name, f)
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    if fsutil.open_direct(probe) is not None:  # where the file system takes direct writes
        total = sum(sum(len(v) for v in _files(p).values()) for p in direct.values())
        assert went_direct > total / 2, (went_direct, total)


class _Syncs:
    """Every fsync / fdatasync of this process, by the path of the descriptor, in order, and each
    ``syncfs`` (as ``syncfs:<path>``)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        for name in ("fsync", "fdatasync"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._spy(real))
        real_syncfs = durability.syncfs

        def syncfs(path):
            self.calls.append(f"syncfs:{path}")
            return real_syncfs(path)

        monkeypatch.setattr(durability, "syncfs", syncfs)

    def syncfs_calls(self) -> list[int]:
        return [i for i, c in enumerate(self.calls) if c.startswith("syncfs:")]

    def _spy(self, real):
        def sync(fd):
            self.calls.append(os.readlink(f"/proc/self/fd/{fd}"))
            return real(fd)

        return sync

    def count(self, path: Path) -> int:
        return self.calls.count(str(path))


def _data_files(root: Path) -> list[Path]:
    """The files a conversion wrote, but the marker and the files written atomically (their temp
    file is fsynced) or not meant to be durable (the journal, the lock)."""
    return [p for p in root.rglob("*") if p.is_file() and p.name not in ("ckptconv.json", ".metadata")
            and not p.name.startswith((".ckptconv", ".written-by-ckptconv"))]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name descriptors")
def _syncfs_wherever_it_would_suit(monkeypatch, on: bool) -> None:
    """``on``: one syncfs stands for the fsyncs of many paths on any filesystem the tests run on
    (its rules but the filesystem's type and the machine's dirty bytes); off: every path fsynced."""
    monkeypatch.setattr(knobs, "SYNCFS", on)
    monkeypatch.setattr(durability, "syncfs_suits", lambda path, n: n >= durability.SYNCFS_MIN_PATHS)


@pytest.mark.parametrize("syncfs", [False, True], ids=["fsync-each", "syncfs"])
@pytest.mark.parametrize("step", ["to-universal", "from-universal", "dcp-reshard"])
def test_each_file_is_made_durable_once_then_the_marker(ckpt, tmp_path, monkeypatch, step, syncfs):
    opts = RunOptions(piece_bytes=1 * MIB)
    uni = tmp_path / "uni"
    if step == "from-universal":
        api.to_universal(ckpt, uni, opts, chunk_bytes=2 * MIB)
    _syncfs_wherever_it_would_suit(monkeypatch, syncfs)
    syncs = _Syncs(monkeypatch)  # the default journal batches: a DCP rank file is still synced once
    out = tmp_path / "out"
    if step == "to-universal":
        api.to_universal(ckpt, out, opts, chunk_bytes=2 * MIB)
        marker = out / "ckptconv.json"
    else:
        api.from_universal(uni if step == "from-universal" else ckpt, out, "dp3", options=opts)
        marker = out / ".metadata"
    files = _data_files(out)
    assert files
    counts = {f: syncs.count(f) for f in files}
    marker_tmp = [i for i, c in enumerate(syncs.calls) if Path(c).name.startswith(f".{marker.name}.tmp")]
    assert len(marker_tmp) == 1
    if syncfs and step == "to-universal":  # the store's many paths: one syncfs at the commit
        assert set(counts.values()) <= {0, 1}, {str(f.relative_to(out)): n for f, n in counts.items() if n > 1}
        assert syncs.syncfs_calls() and syncs.calls[syncs.syncfs_calls()[-1]] == f"syncfs:{out}"
        last_data = syncs.syncfs_calls()[-1]
    else:  # a few rank files (or syncfs off): fsynced one by one
        assert not syncs.syncfs_calls()
        assert set(counts.values()) == {1}, {str(f.relative_to(out)): n for f, n in counts.items() if n != 1}
        last_data = max(i for i, c in enumerate(syncs.calls) if Path(c) in counts)
    assert last_data < marker_tmp[0]  # every data file is durable before the marker is written
    dirs = {c for c in syncs.calls if Path(c).is_dir()}
    counts = {d: syncs.calls.count(d) for d in dirs}
    assert counts.pop(str(out)) <= 3, counts  # the output record (at the start), before and after the marker
    assert all(n <= 2 for n in counts.values()), counts
    assert syncs.calls[-1] == str(out)  # the marker's rename made durable last


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name descriptors")
def test_journal_batches_sync_only_what_they_wrote(ckpt, tmp_path, monkeypatch):
    opts = RunOptions(piece_bytes=1 * MIB, workers=1)
    monkeypatch.setattr(knobs, "JOURNAL_FLUSH_SECONDS", 0.0)  # a batch as often as the loop looks
    monkeypatch.setattr(knobs, "SYNCFS", False)  # what each batch syncs, path by path
    syncs = _Syncs(monkeypatch)
    api.to_universal(ckpt, tmp_path / "uni", opts, chunk_bytes=2 * MIB)
    counts = {f: syncs.count(f) for f in _data_files(tmp_path / "uni")}
    assert set(counts.values()) == {1}, counts
    syncs.calls.clear()
    api.from_universal(tmp_path / "uni", tmp_path / "dp3", "dp3", options=opts)
    for f in _data_files(tmp_path / "dp3"):
        assert 1 <= syncs.count(f) <= 20, (f, syncs.count(f))  # open files too: one per batch that wrote to it
    monkeypatch.setattr(knobs, "JOURNAL_OPEN_FILE_SECONDS", 1e9)  # a rank file synced only once its tasks are done
    syncs.calls.clear()
    api.from_universal(tmp_path / "uni", tmp_path / "dp3b", "dp3", options=opts)
    for f in _data_files(tmp_path / "dp3b"):
        assert syncs.count(f) == 1, (f, syncs.count(f))


# ------------------------------------------------------------------------------- at the OS-call level

_CALL = re.compile(r"^(\d+\.\d+)\s+(\w+)\((\d+)<([^>]*)>.*\)\s+=\s+(-?\d+)")
_TEMP = re.compile(r"^\.(.+?)\.tmp(-\d+)?$")  # a temp file renamed into place: .<name>.tmp[-pid]

#: Runs the CLI with every data file's sync done twice (the planted fault the count must catch).
_TWICE = """import runpy, sys
from formats import fsutil
sync = fsutil.DirectWrites.sync
def twice(self, data_only=True):
    was = self.dirty
    sync(self, data_only)
    if was:
        self.dirty = True
        sync(self, data_only)
fsutil.DirectWrites.sync = twice
sys.argv = ["ckptconv", *sys.argv[1:]]
runpy.run_module("converter", run_name="__main__")
"""

#: Runs the CLI with one syncfs standing for the fsyncs of many paths on any filesystem (as
#: ``_syncfs_wherever_it_would_suit``); ``FORGET=1``: the planted fault, syncfs reported done but
#: never called.
_SYNCFS = """import os, runpy, sys
from formats import durability
durability.syncfs_suits = lambda path, n: n >= durability.SYNCFS_MIN_PATHS
if os.environ.get("FORGET") == "1":
    durability.syncfs = lambda path: True
sys.argv = ["ckptconv", *sys.argv[1:]]
runpy.run_module("converter", run_name="__main__")
"""


def _os_events(args: list[str], out: Path, tmp: Path, code: str | None = None,
               env: dict[str, str] | None = None) -> list[tuple[float, str, str, int]]:
    """Run ``ckptconv ARGS`` (or ``python -c CODE ARGS``) under ``strace -ff -ttt -y`` (every
    thread): its fsync, fdatasync, syncfs and write calls on paths under ``out``, in time order, as
    (time, call, path relative to ``out``, result): a temp file counts as the file it is renamed
    to, a directory ends with ``/`` (``out`` itself is ``/``)."""
    prefix = tmp / "strace"
    run = [sys.executable, "-c", code] if code else [sys.executable, "-m", "converter"]
    calls = "fsync,fdatasync,syncfs,write,pwrite64,pwritev,writev"
    proc = subprocess.run(["strace", "-ff", "-ttt", "-y", "-qq", "-e", f"trace={calls}", "-o", str(prefix), *run,
                           *args, "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = []
    for log in tmp.glob("strace.*"):
        for line in log.read_text(errors="replace").splitlines():
            m = _CALL.match(line)
            if not m or not (m.group(4) + "/").startswith(f"{out}/"):
                continue
            when, name, path, ret = float(m.group(1)), m.group(2), m.group(4), int(m.group(5))
            rel = os.path.relpath(path, out)
            head, _, base = rel.rpartition("/")
            temp = _TEMP.match(base)
            rel = (f"{head}/" if head else "") + (temp.group(1) if temp else base)
            rel = "/" if rel == "." else rel + ("/" if Path(path).is_dir() else "")
            events.append((when, name, rel, ret))
        log.unlink()
    return sorted(events)


def _os_calls(args: list[str], out: Path, tmp: Path, planted: bool = False) -> tuple[dict[str, int], list[int]]:
    """:func:`_os_events` with every path fsynced one by one (``CKPTCONV_SYNCFS=0``): (fsync +
    fdatasync calls by the path they made durable; the byte counts of the writes into ``out``)."""
    syncs: dict[str, int] = {}
    writes: list[int] = []
    for _, name, rel, ret in _os_events(args, out, tmp, _TWICE if planted else None, {"CKPTCONV_SYNCFS": "0"}):
        if name in ("fsync", "fdatasync"):
            syncs[rel] = syncs.get(rel, 0) + 1
        elif name != "syncfs" and ret > 0:
            writes.append(ret)
    return syncs, writes


def _check_commits(syncs: dict[str, int], out: Path, marker: str, data: list[str]) -> tuple[int, dict[str, int]]:
    """One durable commit per data file, and the bookkeeping's, each for the reason given."""
    extra = {p: n for p, n in syncs.items() if p in data and n != 1}
    assert not extra and all(p in syncs for p in data), (extra, sorted(set(data) - set(syncs))[:5])
    assert syncs.pop(marker) == 1  # the completion marker's temp file, before its rename
    # the output record: just before the marker (and a store's early one, before its first chunk)
    assert syncs.pop(".written-by-ckptconv.json") <= (2 if marker == "ckptconv.json" else 1)
    assert syncs.pop("/") <= 3  # the output's folder: after the record's rename, before and after the marker's
    journal = syncs.pop(".ckptconv-journal.jsonl")  # its header, then one per batch of durable tasks
    assert syncs.pop(".ckptconv-lock", 0) <= 1  # the lock's holder line (who is writing here)
    rest = {p: n for p, n in syncs.items() if p not in data}
    return journal, rest


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_every_file_of_each_step_is_made_durable_once_at_the_os_level(tmp_path):
    """strace of the CLI (every thread), default journal batches: each data file written by the
    three copy steps gets one fsync/fdatasync (a DCP rank file too, however many tasks write it),
    the bookkeeping only its own commits; the DCP rank files are written in large aligned writes.
    A planted second sync of every data file is caught."""
    src = make_checkpoint(tmp_path / "ckpt", 8, 6)
    uni, dp3, dcp3 = tmp_path / "uni", tmp_path / "dp3", tmp_path / "dcp3"
    syncs, writes = _os_calls(["to-universal", str(src), str(uni), "--chunk-size", "2MiB"], uni, tmp_path)
    chunks = [str(p.relative_to(uni)) for p in uni.rglob("*") if p.is_file()
              and p.name not in ("ckptconv.json", ".written-by-ckptconv.json")]
    journal, rest = _check_commits(syncs, uni, "ckptconv.json", chunks)
    assert journal >= 2  # the header and the end, at least
    dirs = {p: n for p, n in rest.items() if p.endswith("/")}
    assert rest.keys() == dirs.keys() and all(n <= 2 for n in dirs.values()), rest  # each folder: its new entries
    for args, out in ((["from-universal", str(uni), str(dp3), "--mesh", "dp3"], dp3),
                      (["from-universal", str(src), str(dcp3), "--mesh", "dp3"], dcp3)):
        syncs, writes = _os_calls(args, out, tmp_path)
        ranks = sorted(p.name for p in out.glob("__*_0.distcp"))
        assert len(ranks) == 3
        journal, rest = _check_commits(syncs, out, ".metadata", ranks)
        assert journal <= 2 + len(ranks)  # header, a batch as each rank file is done, the end
        assert rest == {".ckptconv-loads.json": 1}, rest  # what each rank loads: before the marker
        big = sum(n for n in writes if n >= 1 << 20)
        assert big >= 0.9 * sum(writes), (big, sum(writes), len(writes))
    syncs, _ = _os_calls(["from-universal", str(src), str(tmp_path / "planted"), "--mesh", "dp3"],
                         tmp_path / "planted", tmp_path, planted=True)
    with pytest.raises(AssertionError):
        _check_commits(syncs, tmp_path / "planted", ".metadata", ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"])


def _syncfs_covers_the_store(events: list[tuple[float, str, str, int]]) -> None:
    """The store's data files fsynced at most once each; a syncfs of the output after the last
    write into any of its data files, and before the marker's temp file is made durable."""
    bookkeeping = ("ckptconv.json", ".written-by-ckptconv.json", ".ckptconv-journal.jsonl", ".ckptconv-lock")
    data_writes = [t for t, name, rel, ret in events
                   if name not in ("fsync", "fdatasync", "syncfs") and ret > 0 and rel not in bookkeeping]
    fsyncs: dict[str, int] = {}
    for _, name, rel, _ in events:
        if name in ("fsync", "fdatasync") and rel not in bookkeeping and not rel.endswith("/"):
            fsyncs[rel] = fsyncs.get(rel, 0) + 1
    assert all(n == 1 for n in fsyncs.values()), {p: n for p, n in fsyncs.items() if n != 1}
    marker = [t for t, name, rel, _ in events if name in ("fsync", "fdatasync") and rel == "ckptconv.json"]
    covering = [t for t, name, rel, ret in events if name == "syncfs" and rel == "/" and ret == 0]
    assert data_writes and len(marker) == 1
    assert any(max(data_writes) < t < marker[0] for t in covering), (max(data_writes), covering, marker)


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_one_syncfs_makes_the_store_durable_before_its_marker_at_the_os_level(tmp_path):
    """strace -ttt of to-universal where one syncfs stands for the fsyncs of the store's many
    paths: it comes after the last write into the store and before the marker; no data file is
    fsynced twice. A planted syncfs that is never called is caught."""
    src = make_checkpoint(tmp_path / "ckpt", 8, 6)
    args = ["to-universal", str(src), str(tmp_path / "uni"), "--chunk-size", "2MiB"]
    events = _os_events(args, tmp_path / "uni", tmp_path, _SYNCFS)
    assert sum(1 for e in events if e[1] in ("fsync", "fdatasync")) < 40  # not one per path (~100 here)
    _syncfs_covers_the_store(events)
    args[2] = str(tmp_path / "planted")
    planted = _os_events(args, tmp_path / "planted", tmp_path, _SYNCFS, {"FORGET": "1"})
    with pytest.raises(AssertionError):
        _syncfs_covers_the_store(planted)


# ---------------------------------------------------------------------------------------------- bounds


def _drop_caches(paths: list[Path]) -> None:
    subprocess.run(["sync"], check=True)
    if os.access("/proc/sys/vm/drop_caches", os.W_OK):
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return
    for root in paths:
        for f in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


#: Runs argv[1:] and prints its peak RSS (KiB): a fresh small interpreter forks it, so the child's
#: peak does not start from this (torch-importing) process's.
_LAUNCH = """import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _timed(cmd: list[str], reads: Path) -> tuple[float, int]:
    """(wall seconds including a trailing sync, peak RSS bytes of the process) of ``cmd`` run cold."""
    _drop_caches([reads])
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _LAUNCH, *cmd], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t, int(proc.stdout.split()[-1]) * 1024


@pytest.mark.slow
def test_each_step_within_3x_of_a_user_space_copy(tmp_path):
    """Generous bounds on a 384 MiB checkpoint, cold: (step - process start-up) <= 3x a user-space
    copy of the same bytes, peak RSS < 256 MiB at the default budget. Best of 2 (shared machine)."""
    src = make_checkpoint(tmp_path / "ckpt", 48, 8)
    py = [sys.executable]
    conv = [*py, "-m", "converter"]

    def best(cmd, reads, out):
        runs = []
        for _ in range(2):
            subprocess.run(["rm", "-rf", str(out)], check=True)
            runs.append(_timed(cmd, reads))
        return min(r[0] for r in runs), max(r[1] for r in runs)

    startup, _ = best([*conv, "--version"], src, tmp_path / "none")
    user, _ = best([*py, str(ROOT / "bench" / "datapath.py"), "usercopy", str(src), str(tmp_path / "copy")], src,
                   tmp_path / "copy")
    uni = tmp_path / "uni"
    steps = {"to-universal": ([*conv, "to-universal", str(src), str(uni), "--no-progress"], src, uni),
             "from-universal": ([*conv, "from-universal", str(uni), str(tmp_path / "dp3"), "--mesh", "dp3",
                                 "--no-progress"], uni, tmp_path / "dp3"),
             "dcp-reshard": ([*conv, "from-universal", str(src), str(tmp_path / "dcp3"), "--mesh", "dp3",
                              "--no-progress"], src, tmp_path / "dcp3")}
    for name, (cmd, reads, out) in steps.items():
        wall, rss = best(cmd, reads, out)
        print(f"{name}: {wall:.2f} s (start-up {startup:.2f} s), user-space copy {user:.2f} s, peak RSS {rss / MIB:.0f} MiB")
        assert wall - startup <= 3 * user, (name, wall, startup, user)
        assert rss < 256 * MIB, (name, rss)


def test_the_user_space_copy_copies_the_tree(ckpt, tmp_path):
    """bench/datapath.py's baseline copy (what the bounds above compare with) copies every byte."""
    subprocess.run([sys.executable, str(ROOT / "bench" / "datapath.py"), "usercopy", str(ckpt), str(tmp_path / "c")],
                   check=True, timeout=300)
    assert _files(ckpt) == _files(tmp_path / "c") and _files(ckpt)


@pytest.mark.parametrize("procs", [1, 2])
def test_the_direct_copy_copies_the_tree(ckpt, tmp_path, procs):
    """bench/datapath.py's O_DIRECT baseline (1 process, and 2 sharing the files: what says whether
    the disk allows two writers any gain) copies every byte, unaligned tails and nested folders too."""
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    (src / "sub").mkdir()
    (src / "sub" / "odd.bin").write_bytes(os.urandom(3 * 4096 + 17))
    (src / "empty").write_bytes(b"")
    subprocess.run([sys.executable, str(ROOT / "bench" / "datapath.py"), "directcopy", str(src), str(tmp_path / "c"),
                    str(procs)], check=True, timeout=300)

    def every_file(root: Path) -> dict[str, bytes]:
        return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}

    assert every_file(src) == every_file(tmp_path / "c") and len(every_file(src)) >= 4


def test_the_torchrun_target_applies_only_where_two_raw_writers_gain():
    """"torchrun 2 >= 1.6x one process, where the disk allows": judged only when two processes'
    O_DIRECT copy is itself >= 1.6x one process's; otherwise reported as not applicable."""
    sys.path.insert(0, str(ROOT / "bench"))
    import datapath

    def res(one, two):
        return {"size": "1GB", "rows": [{"name": datapath.DIRECT1, "wall_s": one},
                                        {"name": datapath.DIRECT2, "wall_s": two}]}

    slow_disk = datapath._scaling_target(res(1.0, 0.95), datapath.TO, 0.5)
    assert slow_disk["ok"] is None and slow_disk["disk_x"] == 1.05 and "not applicable" in slow_disk["target"]
    fast_disk = datapath._scaling_target(res(2.0, 1.0), datapath.TO, 1.2)
    assert fast_disk["ok"] is False and fast_disk["disk_x"] == 2.0
    assert datapath._scaling_target(res(2.0, 1.0), datapath.TO, 1.7)["ok"] is True
    assert datapath._scaling_target({"size": "1GB", "rows": []}, datapath.TO, 1.0)["ok"] is False


def test_the_copy_targets_take_the_worse_of_the_median_and_the_paired_ratio():
    """Each step is compared with cp round by round (the paired ratio: steady when the machine
    drifts between rounds) and by medians; the 1.3x target is met only when both are."""
    sys.path.insert(0, str(ROOT / "bench"))
    import datapath
    from run import Run

    def run(wall, rc=0):
        return Run(wall_s=wall, sync_s=0.0, tree_peak_rss=1, main_max_rss=1, cpu_s=1.0, load_before=(0, 0, 0),
                   cold=True, rc=rc, tail="")

    def step(name, walls):
        s = datapath.Step(name, ["true"], Path("."), Path("."))
        s.runs = [run(w) for w in walls]
        return s

    cp = step(datapath.CP, [1.0, 2.0, 2.0])
    tu = step(datapath.TO, [2.4, 2.0, 2.5])  # 1.2x cp's median; paired by round: 2.4, 1.0, 1.25 -> 1.25
    assert datapath.paired_ratio(tu, cp) == pytest.approx(1.25)
    assert datapath.paired_ratio(tu, None) is None
    failed = step(datapath.TO, [2.4, 2.0, 2.5])
    failed.runs[0] = run(0.1, rc=1)  # a failed run pairs with nothing
    assert datapath.paired_ratio(failed, cp) == pytest.approx(1.125)
    row = datapath.summarize(tu, 2.0, None, cp, None)
    assert row["x_cp"] == pytest.approx(1.2) and row["x_cp_paired"] == pytest.approx(1.25)
    (target,) = [t for t in datapath.targets([{"size": "1GB", "rows": [row]}]) if "cp" in t["target"]]
    assert target["ok"] is True and target["value"] == "1.20; 1.25"
    row["x_cp_paired"] = 1.4  # the rounds say otherwise: not met
    (target,) = [t for t in datapath.targets([{"size": "1GB", "rows": [row]}]) if "cp" in t["target"]]
    assert target["ok"] is False


def test_the_ab_bench_pairs_runs_and_runs_each_side_s_code(tmp_path):
    """bench/ab.py: B/A per pair (failed pairs left out), medians per side; side A runs the other
    checkout's code, B this one's."""
    sys.path.insert(0, str(ROOT / "bench"))
    import ab

    def side(wall, rc=0):
        return {"wall_s": wall, "rc": rc, "phases_s": {"copy": wall - 0.5}}

    runs = [{"a": side(2.0), "b": side(1.6)}, {"a": side(2.5), "b": side(2.25)}, {"a": side(2.0), "b": side(9.0, rc=1)},
            {"a": side(1.0), "b": side(0.7)}]
    s = ab.summarize(runs)
    assert s["pairs"] == 3 and s["ratio_b_over_a"] == pytest.approx(0.8)
    assert s["a_wall_s"] == 2.0 and s["b_wall_s"] == 1.6 and s["b_phases_s"] == {"copy": 1.1}
    cmd, reads = ab.command(tmp_path / "old", "reshard", Path("src"), Path("uni"), Path("out"))
    assert reads == Path("src") and str(tmp_path / "old") in cmd[2] and cmd[3:5] == ["from-universal", "src"]
    assert ab.command(ROOT, "from-universal", Path("src"), Path("uni"), Path("out"))[1] == Path("uni")
    assert cmd[cmd.index("--mesh") + 1] == "dp3"
    cmd, _ = ab.command(ROOT, "from-universal", Path("src"), Path("uni"), Path("out"), "tp2,dp32")
    assert cmd[cmd.index("--mesh") + 1] == "tp2,dp32"


def test_the_bench_runs_on_any_dcp_checkpoint_given(tmp_path):
    """bench/datapath.py --sources: a DCP checkpoint folder is an input like a size (named by its
    folder, its bytes counted); a folder without .metadata is refused in one line."""
    sys.path.insert(0, str(ROOT / "bench"))
    import datapath

    (tmp_path / "run7").mkdir()
    with pytest.raises(SystemExit, match="no .metadata"):
        datapath.given_checkpoint(tmp_path / "run7")
    (tmp_path / "run7" / ".metadata").write_bytes(b"x" * 10)
    (tmp_path / "run7" / "__0_0.distcp").write_bytes(b"y" * 90)
    info = datapath.given_checkpoint(tmp_path / "run7")
    assert info["bytes"] == 100 and info["path"] == str(tmp_path / "run7")
    assert datapath.input_label(tmp_path / "run7") == "run7" and datapath.input_label(1 << 30) == datapath.size_label(1 << 30)


def test_the_layout_copy_writes_the_source_bytes_into_the_trees_files(tmp_path):
    """bench/datapath.py layoutcopy: the output tree has the layout's folders, file names and
    sizes; its files hold the source's bytes one after another (from the start again past their
    end), across the source's files."""
    src, layout = tmp_path / "src", tmp_path / "layout"
    src.mkdir()
    (src / "a").write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    (src / "b").write_bytes(b"\x07" * 5000)
    sizes = {"x/zarr.json": 300, "x/c/0/0": 9000, "y/c": 4096 * 3 + 5, "z/0": 1}
    for rel, size in sizes.items():
        (layout / rel).parent.mkdir(parents=True, exist_ok=True)
        (layout / rel).write_bytes(b"\x00" * size)
    (layout / "empty_dir").mkdir()
    subprocess.run([sys.executable, str(ROOT / "bench" / "datapath.py"), "layoutcopy", str(src), str(layout),
                    str(tmp_path / "out")], check=True)
    stream = (src / "a").read_bytes() + (src / "b").read_bytes()
    stream = stream * 3
    at = 0
    for rel in sorted(sizes, key=lambda r: str(tmp_path / "out" / r)):
        got = (tmp_path / "out" / rel).read_bytes()
        assert got == stream[at: at + sizes[rel]], rel
        at += sizes[rel]
    assert (tmp_path / "out" / "empty_dir").is_dir()
