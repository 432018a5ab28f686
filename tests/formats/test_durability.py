"""formats.durability: when one syncfs stands for the fsyncs of many paths, and what it does.

- The kernel check, the filesystem type (against ``df``'s, and on synthetic mountinfo: bind mounts,
  optional fields, no match), the machine's dirty bytes (``/proc/meminfo``) and the rules table.
- ``make_durable``: one real syncfs and no fsync where the rules allow; an fsync of every path
  where they do not, or where syncfs is missing (ENOSYS); a syncfs error (EIO) is raised.
- The store's commit: one syncfs with ``fs_sync``, every file and folder fsynced without it, and
  the store reads back the same either way.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from formats import durability
from formats.base import TensorEntry
from formats.universal import UniversalWriter, array_name
from formats.universal_meta import SourceInfo

linux_only = pytest.mark.skipif(not Path("/proc/self/mountinfo").is_file(), reason="needs Linux /proc")


@pytest.mark.parametrize("release, ok", [
    ("5.8.0", True), ("5.7.19", False), ("6.18.44-fc-v1272", True), ("5.15.0-91-generic", True),
    ("4.19.0", False), ("10.0", True), ("5", False), ("garbage", False), ("", False),
])
def test_kernel_reports_syncfs_errors_from_5_8(release, ok):
    assert durability.kernel_reports_errors(release) is ok


@linux_only
@pytest.mark.skipif(shutil.which("df") is None, reason="needs df")
@pytest.mark.parametrize("where", ["tmp", "/dev/shm", "/proc"])
def test_filesystem_type_is_dfs(tmp_path, where):
    path = tmp_path if where == "tmp" else Path(where)
    if not path.exists():
        pytest.skip(f"no {where}")
    proc = subprocess.run(["df", "--output=fstype", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip("df without --output")
    st = os.stat(path)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    mounted = any(line.split()[2] == device for line in Path("/proc/self/mountinfo").read_text().splitlines())
    # a device no mount names (a btrfs subvolume's own st_dev) is unknown: fsync each path there
    assert durability.filesystem_type(path) == (proc.stdout.split()[-1] if mounted else None)


def _mountinfo(dev: str, *lines: str) -> str:
    return "\n".join(line.replace("DEV", dev) for line in lines)


def test_filesystem_type_from_mountinfo_lines(tmp_path):
    st = os.stat(tmp_path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    other = f"{os.major(st.st_dev) + 1}:{os.minor(st.st_dev)}"
    plain = "36 35 DEV / /data rw,noatime shared:1 - xfs /dev/nvme0n1 rw"
    bind = "37 35 DEV /sub /mnt/sub rw master:2 propagation:x - xfs /dev/nvme0n1 rw"  # optional fields
    assert durability.filesystem_type(tmp_path, _mountinfo(dev, plain, bind)) == "xfs"
    assert durability.filesystem_type(tmp_path, _mountinfo(other, plain)) is None  # no mount of the device
    assert durability.filesystem_type(tmp_path, _mountinfo(dev, plain, plain.replace("xfs", "nfs4"))) is None
    assert durability.filesystem_type(tmp_path, _mountinfo(dev, "36 35 DEV / /data rw")) is None  # no separator
    assert durability.filesystem_type(tmp_path / "missing", _mountinfo(dev, plain)) is None


def test_dirty_bytes_from_meminfo():
    text = "MemTotal: 100 kB\nDirty:   1024 kB\nWriteback:   8 kB\nWritebackTmp: 5 kB\n"
    assert durability.dirty_bytes(text) == (1024 + 8) * 1024
    assert durability.dirty_bytes("Dirty: 3 kB\n") is None  # a field missing
    assert durability.dirty_bytes("Dirty: x kB\nWriteback: 0 kB\n") is None
    if Path("/proc/meminfo").is_file():
        assert durability.dirty_bytes() >= 0


@pytest.mark.parametrize("kernel, kind, dirty, paths, ok", [
    (True, "ext4", 0, 32, True),
    (True, "xfs", durability.SYNCFS_MAX_DIRTY_BYTES, 10_000, True),
    (True, "ext4", 0, 31, False),  # few paths: fsync each
    (False, "ext4", 0, 1000, False),  # a kernel whose syncfs may not report errors
    (True, "nfs4", 0, 1000, False),  # a network filesystem
    (True, "overlay", 0, 1000, False),
    (True, "tmpfs", 0, 1000, False),
    (True, None, 0, 1000, False),  # unknown
    (True, "ext4", durability.SYNCFS_MAX_DIRTY_BYTES + 1, 1000, False),  # others' data to wait for
    (True, "ext4", None, 1000, False),
])
def test_syncfs_rules(monkeypatch, tmp_path, kernel, kind, dirty, paths, ok):
    monkeypatch.setattr(durability, "kernel_reports_errors", lambda: kernel)
    monkeypatch.setattr(durability, "filesystem_type", lambda path: kind)
    monkeypatch.setattr(durability, "dirty_bytes", lambda: dirty)
    assert durability.syncfs_suits(tmp_path, paths) is ok


def _tree(root: Path, n: int) -> list[Path]:
    paths = []
    for i in range(n):
        d = root / f"d{i % 7}"
        d.mkdir(exist_ok=True)
        (d / f"f{i}").write_bytes(os.urandom(100))
        paths += [d / f"f{i}", d]
    return [*dict.fromkeys(paths)]


class _Calls:
    def __init__(self, monkeypatch) -> None:
        self.fsyncs: list[int] = []
        self.syncfs: list[str] = []
        real_fsync, real_syncfs = os.fsync, durability.syncfs
        monkeypatch.setattr(os, "fsync", lambda fd: (self.fsyncs.append(fd), real_fsync(fd))[1])
        monkeypatch.setattr(durability, "syncfs",
                            lambda path: (self.syncfs.append(os.fspath(path)), real_syncfs(path))[1])


@linux_only
def test_make_durable_by_one_syncfs_where_the_rules_allow(tmp_path, monkeypatch):
    paths = _tree(tmp_path, 40)
    monkeypatch.setattr(durability, "syncfs_suits", lambda path, n: n >= 32)
    calls = _Calls(monkeypatch)
    assert durability.make_durable(tmp_path, paths) == "syncfs"
    assert calls.syncfs == [str(tmp_path)] and calls.fsyncs == []
    assert durability.make_durable(tmp_path, paths, allow_syncfs=False) == "fsync"  # the caller's switch
    assert durability.make_durable(tmp_path, paths[:10]) == "fsync"
    assert len(calls.fsyncs) == len(paths) + 10 and calls.syncfs == [str(tmp_path)]


def test_make_durable_fsyncs_every_path_where_syncfs_does_not_suit(tmp_path, monkeypatch):
    paths = _tree(tmp_path, 40)
    monkeypatch.setattr(durability, "syncfs_suits", lambda path, n: False)
    calls = _Calls(monkeypatch)
    assert durability.make_durable(tmp_path, paths) == "fsync"
    assert len(calls.fsyncs) == len(paths) and calls.syncfs == []


def _fake_syncfs(monkeypatch, err: int) -> None:
    def fail(fd: int) -> int:
        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(durability, "_syncfs", fail)


def test_no_syncfs_falls_back_to_fsyncs(tmp_path, monkeypatch):
    paths = _tree(tmp_path, 40)
    monkeypatch.setattr(durability, "syncfs_suits", lambda path, n: True)
    _fake_syncfs(monkeypatch, errno.ENOSYS)
    calls = _Calls(monkeypatch)
    assert durability.make_durable(tmp_path, paths) == "fsync"
    assert len(calls.fsyncs) == len(paths)
    assert durability._syncfs is False  # not tried again


def test_a_syncfs_error_is_raised(tmp_path, monkeypatch):
    paths = _tree(tmp_path, 40)
    monkeypatch.setattr(durability, "syncfs_suits", lambda path, n: True)
    _fake_syncfs(monkeypatch, errno.EIO)
    with pytest.raises(OSError) as info:
        durability.make_durable(tmp_path, paths)
    assert info.value.errno == errno.EIO and info.value.filename == str(tmp_path)


@linux_only
@pytest.mark.parametrize("fs_sync", [True, False])
def test_store_commit_by_one_syncfs_or_an_fsync_of_every_path(tmp_path, monkeypatch, fs_sync):
    monkeypatch.setattr(durability, "syncfs_suits", lambda path, n: n >= 32)
    calls = _Calls(monkeypatch)
    root = tmp_path / "uni"
    tensors = {f"w{i}": torch.randn(40, 30, generator=torch.Generator().manual_seed(i)) for i in range(12)}
    w = UniversalWriter(root, 1 << 12, fs_sync=fs_sync, direct_io=False)
    for key, t in tensors.items():
        w.add_tensor(TensorEntry(key, "float32", tuple(t.shape), (), ("model", key)), key, "param")
    w.prepare()
    for key, t in tensors.items():
        for idx, box in w.chunks(key):
            w.write_chunk(key, idx, t[box.slices()].clone())
    w.commit(SourceInfo("test"), "0", {k: {"param": k} for k in tensors}, "now")
    every = [p for p in root.rglob("*") if p.name != "ckptconv.json"] + [root]
    if fs_sync:  # one syncfs; then only the marker's temp file and its folder
        assert calls.syncfs == [str(root)] and len(calls.fsyncs) <= 2
    else:
        assert calls.syncfs == [] and len(calls.fsyncs) >= len(every) > 32
    group = zarr.open_group(root, mode="r", zarr_format=3)["tensors"]  # stock zarr reads it back
    for key, t in tensors.items():
        assert np.array_equal(np.asarray(group[array_name(key)][...]), t.numpy())


_FAILING_SYNCFS = """import ctypes, errno, runpy, sys
from formats import durability
durability.syncfs_suits = lambda path, n: n >= durability.SYNCFS_MIN_PATHS
def failing(fd):
    ctypes.set_errno(errno.EIO)
    return -1
durability._syncfs = failing
sys.argv = ["ckptconv", *sys.argv[1:]]
runpy.run_module("converter", run_name="__main__")
"""

_SAVE = """import sys, torch, torch.distributed.checkpoint as dcp
g = torch.Generator().manual_seed(0)
dcp.save({f"w{i}": torch.randn(64, 33, generator=g) for i in range(40)}, checkpoint_id=sys.argv[1])
"""


def test_a_failed_syncfs_fails_the_run_in_one_line_and_resume_finishes_it(tmp_path):
    """A syncfs EIO at the store's commit: exit 2, one line naming the output and saying to rerun
    with --resume, no completion marker; --resume then completes the store."""
    import sys

    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", _SAVE, str(tmp_path / "ckpt")], check=True, timeout=300)
    args = ["to-universal", str(tmp_path / "ckpt"), str(tmp_path / "uni"), "--no-progress"]
    failed = subprocess.run([sys.executable, "-c", _FAILING_SYNCFS, *args], cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert failed.returncode == 2, failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert str(tmp_path / "uni") in lines[0] and "Input/output error" in lines[0] and "--resume" in lines[0]
    assert not (tmp_path / "uni" / "ckptconv.json").exists()
    done = subprocess.run([sys.executable, "-m", "converter", *args, "--resume"], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "uni" / "ckptconv.json").is_file()
    check = subprocess.run([sys.executable, "-m", "converter", "verify", str(tmp_path / "uni")], cwd=root,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
