"""Small filesystem helpers shared by the format modules: atomic publish, safe joins."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from formats.errors import CorruptCheckpointError, DestinationError


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


def short(text: object, limit: int = 160) -> str:
    """``text`` for a one-line message: cut in the middle (with ``...``) past ``limit`` characters."""
    text = str(text)
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-(limit // 2):]}"


def os_reason(exc: BaseException) -> str:
    """A short reason for an error raised while resolving or opening a path (no path in it)."""
    if isinstance(exc, RuntimeError) and "loop" in str(exc).lower():
        return "symlink loop"
    if isinstance(exc, OSError):
        import errno

        if exc.errno == errno.ELOOP:
            return "symlink loop"
        return exc.strerror or type(exc).__name__
    return f"{type(exc).__name__}: {short(str(exc).splitlines()[0] if str(exc) else '', 80)}"


def _join_problem(root: str | os.PathLike, relative: str, noun: str) -> tuple[Path | None, str]:
    """``(root / relative resolved, "")`` or ``(None, why it is refused)``: the one rule for every
    file a checkpoint names (and every file ckptconv writes): no absolute paths, ``..``, empty
    parts, NUL or control characters, nothing that resolves (through symlinks) outside ``root``
    (``noun`` names it in the reason), no symlink loops."""
    if os.path.isabs(relative):
        return None, f"an absolute path leads outside {noun}"
    if not relative or any(ord(c) < 32 for c in relative):
        return None, "not a safe relative name (empty or with control characters)"
    parts = Path(relative).parts
    if any(p in ("..", "") for p in parts):
        return None, f"'..' leads outside {noun}"
    try:
        root_resolved = Path(root).resolve()
        target = (root_resolved / relative).resolve()
    except (RuntimeError, OSError) as e:  # 3.11 raises RuntimeError("Symlink loop ...")
        return None, f"cannot resolve it ({os_reason(e)})"
    if target != root_resolved and root_resolved not in target.parents:
        return None, f"it resolves outside {noun} (a symlink out of it)"
    return target, ""


def safe_join(root: str | os.PathLike, relative: str) -> Path:
    """``root / relative``, refusing anything that would land outside ``root``.

    Rejects absolute paths, ``..`` components, NUL and control characters, symlink loops and
    paths that resolve (through symlinks) outside ``root`` (DestinationError).
    """
    path, why = _join_problem(root, relative, short(root))
    if path is None:
        raise DestinationError(f"refusing path {short(repr(relative))} under {short(root)}: {why}")
    return path


def source_path(root: str | os.PathLike, relative: str, what: str = "") -> Path:
    """The path of a file a checkpoint's metadata names (``relative`` to the checkpoint ``root``),
    under the rule of :func:`safe_join`: the one check every reader applies before reading a file.

    A refused name raises CorruptCheckpointError naming the file and ``what`` (e.g. ``key 'w'``).
    """
    path, why = _join_problem(root, relative, "the checkpoint directory")
    if path is None:
        plain = relative and not os.path.isabs(relative) and all(ord(c) >= 32 for c in relative)
        where = short(os.path.join(os.fspath(root), relative)) if plain else f"{short(root)} (names {short(repr(relative))})"
        where += f": {what}" if what else ""
        raise CorruptCheckpointError(f"{where}: refusing to read it: {why}; the checkpoint is damaged or was "
                                     "tampered with")
    return path


def pwrite_all(fd: int, data: object, offset: int) -> None:
    """Write all of ``data`` (bytes or any C-contiguous buffer) at ``offset`` of ``fd`` (pwrite may
    write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


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


def loads_json(raw: bytes | str, where: str, error: type[Exception] = CorruptCheckpointError,
               fix: str = "the file is damaged") -> object:
    """``json.loads`` whose failures (bad syntax, bad UTF-8, nesting deep enough to exhaust
    Python's recursion limit) are one ``error`` naming ``where`` and ``fix``."""
    import json

    try:
        return json.loads(raw)
    except RecursionError:
        raise error(f"{short(where)}: not JSON ckptconv can read (nested too deeply); {fix}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{short(where)}: not JSON ({short(e, 120)}); {fix}") from None


def read_error(path: object, exc: OSError, what: str = "") -> Exception:
    """The one-line ckptconv error for an OSError raised while reading a checkpoint's file
    ``path``: a missing file (CheckpointNotFoundError), a path the checkpoint should never name
    (symlink loop, name too long, a directory: CorruptCheckpointError), or another OS failure
    (StorageError: permissions, I/O errors). ``what`` (e.g. ``key 'w'``) is added after the path."""
    import errno

    from formats.errors import CheckpointNotFoundError, CkptConvError, StorageError

    if isinstance(exc, CkptConvError):
        return exc
    where = short(path) + (f": {what}" if what else "")
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError(f"{where}: no such file; copy the whole checkpoint")
    if exc.errno in (errno.ELOOP, errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR):
        return CorruptCheckpointError(f"{where}: cannot read it ({os_reason(exc)}); the checkpoint names a bad "
                                      "path: it is damaged or was tampered with")
    return StorageError(f"{where}: cannot read it ({os_reason(exc)}); check the file's permissions and the storage")
