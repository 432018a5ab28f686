"""Making many written files durable at once: one ``syncfs`` of their filesystem where that is
as safe as an ``fsync`` of each, else an ``fsync`` of each (several at once).

A store of 10^3-10^5 chunk files and their folders costs one journal commit per ``fsync`` on
ext4 or XFS (concurrent ones share some): 2,600 paths of a 1 GB store took 0.25-0.35 s of a 2 s
conversion. Linux's ``syncfs(2)`` writes back every dirty page and inode of one filesystem and
waits for it, with one journal commit and one device flush: "sync() or syncfs() provide the same
guarantees as fsync() called on every file in the system or filesystem respectively" (the man
page), and since Linux 5.8 it reports writeback errors. It is used only where that holds and it
cannot wait long on other programs' data:

- Linux 5.8 or later (:func:`kernel_reports_errors`);
- a local disk filesystem whose ``sync_fs`` commits its journal (:data:`SYNCFS_FILESYSTEMS`: ext4,
  XFS, btrfs, f2fs; not NFS, Lustre, GPFS, FUSE or overlay, whose ``syncfs`` promises less);
- at least :data:`SYNCFS_MIN_PATHS` paths (a few files are as cheap to fsync one by one, and
  their fsyncs never wait on anyone else's writes);
- at most :data:`SYNCFS_MAX_DIRTY_BYTES` dirty or under-writeback bytes on the whole machine
  (``/proc/meminfo``): ``syncfs`` would also wait for other programs' unwritten data.

Anything else, or ``syncfs`` missing (``ENOSYS``), falls back to an ``fsync`` of every path. An
error of ``syncfs`` itself (``EIO``, ``ENOSPC``) is raised, as an ``fsync``'s would be.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Iterable

from formats.fsutil import fsync_paths

#: Filesystems whose ``syncfs`` makes every file and folder durable (journal commit + flush).
SYNCFS_FILESYSTEMS = frozenset({"ext4", "ext3", "xfs", "btrfs", "f2fs"})
#: Fewer paths than this are fsynced one by one.
SYNCFS_MIN_PATHS = 32
#: More dirty + writeback bytes than this on the machine: fsync each path instead (``syncfs``
#: would wait for other programs' data too).
SYNCFS_MAX_DIRTY_BYTES = 256 << 20
#: The first Linux release whose ``syncfs`` reports writeback errors (errseq on the superblock).
SYNCFS_MIN_KERNEL = (5, 8)

_syncfs: Callable[[int], int] | None | bool = None


def kernel_reports_errors(release: str | None = None) -> bool:
    """True on Linux at or after :data:`SYNCFS_MIN_KERNEL` (``release``: ``uname -r``'s text)."""
    if release is None:
        if os.uname().sysname != "Linux":
            return False
        release = os.uname().release
    match = re.match(r"(\d+)\.(\d+)", release)
    return bool(match) and (int(match[1]), int(match[2])) >= SYNCFS_MIN_KERNEL


def filesystem_type(path: str | os.PathLike, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem holding ``path`` (``ext4``, ``xfs``, ``nfs4``...), from the mount
    of the same device in ``/proc/self/mountinfo`` (``mountinfo``: its text); None if unknown."""
    try:
        dev = os.stat(path).st_dev
        if mountinfo is None:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
    except OSError:
        return None
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    found = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 7 or fields[2] != wanted or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if sep + 1 < len(fields):
            kind = fields[sep + 1]
            if found is not None and found != kind:  # one device, two types (bind mounts agree)
                return None
            found = kind
    return found


def dirty_bytes(meminfo: str | None = None) -> int | None:
    """Bytes the kernel has yet to write back on this machine (``Dirty`` + ``Writeback`` of
    ``/proc/meminfo``; ``meminfo``: its text); None if unknown."""
    try:
        if meminfo is None:
            with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
                meminfo = f.read()
    except OSError:
        return None
    total, seen = 0, 0
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if name in ("Dirty", "Writeback"):
            value = rest.split()
            if not value or not value[0].isdigit():
                return None
            total += int(value[0]) * (1024 if value[1:2] == ["kB"] else 1)
            seen += 1
    return total if seen == 2 else None


def syncfs_suits(path: str | os.PathLike, npaths: int) -> bool:
    """Whether one ``syncfs`` of ``path``'s filesystem may stand for fsyncs of ``npaths`` paths
    on it (the module's rules)."""
    if npaths < SYNCFS_MIN_PATHS or not kernel_reports_errors():
        return False
    if filesystem_type(path) not in SYNCFS_FILESYSTEMS:
        return False
    dirty = dirty_bytes()
    return dirty is not None and dirty <= SYNCFS_MAX_DIRTY_BYTES


def syncfs(path: str | os.PathLike) -> bool:
    """``syncfs(2)`` of the filesystem holding ``path``: True once it returned; False where the
    call does not exist (not Linux, ``ENOSYS``). Its errors are raised as ``OSError``."""
    global _syncfs
    import ctypes

    if _syncfs is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).syncfs
            fn.argtypes = (ctypes.c_int,)
            fn.restype = ctypes.c_int
            _syncfs = fn
        except (OSError, AttributeError):
            _syncfs = False
    if not _syncfs:
        return False
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if _syncfs(fd) == 0:
            return True
        err = ctypes.get_errno()
    finally:
        os.close(fd)
    if err == errno.ENOSYS:
        _syncfs = False
        return False
    raise OSError(err, f"syncfs: {os.strerror(err)}", os.fspath(path))


def make_durable(root: str | os.PathLike, paths: Iterable[str | os.PathLike], allow_syncfs: bool = True) -> str:
    """Make every file and folder in ``paths`` (all on ``root``'s filesystem) durable: one
    ``syncfs`` where :func:`syncfs_suits`, else an fsync of each, several at once. Returns
    ``"syncfs"`` or ``"fsync"``: how it was done."""
    listed = list(paths)
    if allow_syncfs and syncfs_suits(root, len(listed)) and syncfs(root):
        return "syncfs"
    fsync_paths(listed)
    return "fsync"


__all__ = ["SYNCFS_FILESYSTEMS", "dirty_bytes", "filesystem_type", "kernel_reports_errors", "make_durable",
           "syncfs", "syncfs_suits"]
