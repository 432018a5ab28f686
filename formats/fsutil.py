"""Small filesystem helpers shared by the format modules: atomic publish, safe joins."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from formats.errors import DestinationError


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that renames inside it are durable (best effort on odd filesystems)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same dir, fsync, rename, fsync dir."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def safe_join(root: str | os.PathLike, relative: str) -> Path:
    """``root / relative``, refusing anything that would land outside ``root``.

    Rejects absolute paths, ``..`` components, NUL and control characters, and paths that resolve
    (through symlinks) outside ``root``.
    """
    if not relative or any(ord(c) < 32 for c in relative) or os.path.isabs(relative):
        raise DestinationError(f"refusing unsafe relative path {relative!r} under {root}")
    parts = Path(relative).parts
    if any(p in ("..", "") for p in parts):
        raise DestinationError(f"refusing path {relative!r}: it leaves {root}")
    root_resolved = Path(root).resolve()
    target = (root_resolved / relative).resolve()
    if target != root_resolved and root_resolved not in target.parents:
        raise DestinationError(f"refusing path {relative!r}: it resolves outside {root}")
    return target


def read_exact_into(fd: int, buf: memoryview, offset: int) -> int:
    """pread into ``buf`` from ``offset`` until it is full or the file ends; bytes read."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


_SYNC_FILE_RANGE_WRITE = 2
_libc_sync_file_range = None


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Start writing ``fd``'s dirty pages in ``[offset, offset + nbytes)`` (0: to the end) to disk
    without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``); no-op elsewhere.

    Writers call it right after writing, so the disk works while the conversion goes on and the
    journal's later fsync only waits for I/O already under way (not a durability guarantee).
    """
    global _libc_sync_file_range
    if _libc_sync_file_range is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
            fn.restype = ctypes.c_int
            _libc_sync_file_range = fn
        except (OSError, AttributeError):
            _libc_sync_file_range = False
    if not _libc_sync_file_range:
        return
    if nbytes:  # whole pages only: a page under writeback blocks the next write into it
        end = (offset + nbytes) & ~(_PAGE - 1)
        offset = (offset + _PAGE - 1) & ~(_PAGE - 1)
        if end <= offset:
            return
        nbytes = end - offset
    _libc_sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


_PAGE = 4096
_local = threading.local()


def pooled_buffer(slot: str, nbytes: int) -> np.ndarray:
    """A reusable per-thread uint8 buffer of exactly ``nbytes`` (contents undefined).

    Each thread keeps one buffer per ``slot``, grown to the largest size asked for, so repeated
    reads reuse warm pages instead of faulting in (and zero-filling) a fresh mapping each time.
    The buffers live as long as the thread (an executor's worker pool ends with its run). The
    result is only valid until the same thread asks for the same slot again.
    """
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf.nbytes < nbytes:
        bufs[slot] = None  # free the smaller one before allocating
        buf = bufs[slot] = np.empty(max(nbytes, 1), dtype=np.uint8)
    return buf[:nbytes]
