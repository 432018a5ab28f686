"""Small filesystem helpers shared by the format modules: atomic publish, safe joins, pooled
buffers, large aligned (direct) writes, fsyncs of many files at once."""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def atomic_write_bytes(path: str | os.PathLike, data: bytes, sync_dir: bool = True) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same dir, fsync, rename, fsync dir
    (``sync_dir=False``: the caller's next atomic write in the same dir makes the rename durable)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
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
        root_resolved = _resolved(os.fspath(root))
        target = _resolve_under(root_resolved, parts)
    except (RuntimeError, OSError) as e:  # 3.11 raises RuntimeError("Symlink loop ...")
        return None, f"cannot resolve it ({os_reason(e)})"
    if target != root_resolved and root_resolved not in target.parents:
        return None, f"it resolves outside {noun} (a symlink out of it)"
    return target, ""


#: Resolved paths of roots and of directories under them (a checkpoint's thousands of files share a
#: few directories: each file then costs one ``lstat``, not one per component of its whole path).
_RESOLVED: dict[str, Any] = {}
_RESOLVED_LIMIT = 1 << 16


def _resolved(path: str) -> Path:
    hit = _RESOLVED.get(path)
    if hit is None:
        hit = Path(path).resolve()
        if len(_RESOLVED) >= _RESOLVED_LIMIT:
            _RESOLVED.clear()
        _RESOLVED[path] = hit
    return hit


def _resolve_under(root: Path, parts: tuple[str, ...]) -> Path:
    """``(root / *parts).resolve()`` for a resolved ``root``, with the directories on the way
    resolved once each (cached): what is not a symlink needs no further resolution."""
    if not parts:
        return root
    return Path(_step(_resolved_dir(root, parts[:-1]), parts[-1]))


def _resolved_dir(root: Path, parts: tuple[str, ...]) -> str:
    if not parts:
        return str(root)
    key = f"{root}\0{'/'.join(parts)}"
    hit = _RESOLVED.get(key)
    if hit is None:
        hit = _step(_resolved_dir(root, parts[:-1]), parts[-1])
        if len(_RESOLVED) >= _RESOLVED_LIMIT:
            _RESOLVED.clear()
        _RESOLVED[key] = hit
    return hit


def _step(parent: str, name: str) -> str:
    """``name`` under the resolved directory ``parent``, resolved: itself unless it is a symlink."""
    candidate = os.path.join(parent, name)
    return str(Path(candidate).resolve()) if os.path.islink(candidate) else candidate


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


def prefetch(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Ask the kernel to start reading ``[offset, offset + nbytes)`` of ``fd`` (0: to the end) into
    the page cache without waiting (``posix_fadvise(WILLNEED)``); a hint: no-op where there is
    none, errors ignored (the read that follows reports them)."""
    if _FADV_WILLNEED is None:
        return
    try:
        os.posix_fadvise(fd, offset, nbytes, _FADV_WILLNEED)
    except OSError:
        pass


def prefetch_file(path: str | os.PathLike) -> None:
    """:func:`prefetch` of a whole file by path (errors ignored)."""
    if _FADV_WILLNEED is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        prefetch(fd)
    finally:
        os.close(fd)


_FADV_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None) if hasattr(os, "posix_fadvise") else None


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


def pooled_buffer(slot: str, nbytes: int, align_to: int | None = None) -> np.ndarray:
    """A reusable per-thread uint8 buffer of exactly ``nbytes`` (contents undefined).

    Each thread keeps one buffer per ``slot``, grown to the largest size asked for, so repeated
    reads reuse warm pages instead of faulting in (and zero-filling) a fresh mapping each time.
    The buffers live as long as the thread (an executor's worker pool ends with its run). The
    result is only valid until the same thread asks for the same slot again.

    ``align_to``: place the result so that its address is ``align_to`` modulo
    :data:`DIRECT_ALIGN`: a buffer that will be written at file offset ``align_to`` is then
    aligned as a direct write needs (:class:`DirectWrites`).
    """
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(slot)
    need = nbytes + (DIRECT_ALIGN if align_to is not None else 0)
    if buf is None or buf.nbytes < need:
        bufs[slot] = None  # free the smaller one before allocating
        buf = bufs[slot] = np.empty(max(nbytes + DIRECT_ALIGN, 1), dtype=np.uint8)
    if align_to is None:
        return buf[:nbytes]
    start = (align_to - buf.ctypes.data) % DIRECT_ALIGN
    return buf[start: start + nbytes]


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


# ----------------------------------------------------------------------------- large aligned writes

#: O_DIRECT alignment used for buffers, offsets and lengths (the page size; covers 512-byte and
#: 4 KiB logical blocks).
DIRECT_ALIGN = 4096
#: Writes whose aligned middle is smaller than this go through the page cache (one copy is cheaper
#: than a synchronous device write for small runs).
DIRECT_MIN_BYTES = 256 << 10
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def open_direct(path: str | os.PathLike) -> int | None:
    """A second, write-only descriptor of the existing file ``path`` opened with ``O_DIRECT``
    (writes go from the caller's buffer to the device: no page-cache copy, no writeback later);
    None where the platform or file system refuses it (tmpfs on older kernels, macOS)."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(os.fspath(path), os.O_WRONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def buffer_address(view: memoryview) -> int:
    """The address of the first byte of ``view`` (any C-contiguous buffer)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


class DirectWrites:
    """A file's buffered descriptor ``fd`` and :meth:`pwrite`, which sends the 4 KiB-aligned
    middle of a large write straight to the device through a second, ``O_DIRECT`` descriptor of
    ``path`` (opened at the first such write; none when ``path`` is None) when the buffer is
    aligned like the file offset (pooled buffers are placed so: :func:`pooled_buffer`'s
    ``align_to``), the rest through ``fd``. Where the file system refuses direct writes (open or
    write EINVAL) the data goes buffered.

    The data is durable only after ``fsync(fd)`` (it flushes the device cache and the metadata
    of both descriptors' writes), as for buffered writes. ``dirty`` is set by every write (the
    owner clears it when it syncs). Thread-safe: concurrent writes go to disjoint ranges.
    """

    def __init__(self, fd: int, path: str | os.PathLike | None = None, *, combiner: BlockCombiner | None = None,
                 size: int | None = None, dirty: bool = True) -> None:
        """``combiner``: gather writes smaller than its block into whole aligned blocks first
        (:class:`BlockCombiner`; ``size``, the file's final size, lets it know the last block
        full); ``dirty``: whether the file needs a sync before anything is written (created or
        resized: its size and entry)."""
        self.fd = fd
        self._path = path
        self._direct: int | None = None
        self._refused = path is None or not _O_DIRECT
        self._lock = threading.Lock()
        self._combiner = combiner
        self.size = size
        self.dirty = dirty

    def _direct_fd(self) -> int | None:
        if self._refused:
            return None
        if self._direct is None:
            with self._lock:
                if self._direct is None and not self._refused:
                    self._direct = open_direct(self._path)
                    self._refused = self._direct is None
        return self._direct

    def pwrite(self, data: object, offset: int) -> int:
        """Write all of ``data`` at ``offset``; the number of bytes that went through the page
        cache now (all of them unless the aligned middle went direct; with a combiner, the parts
        outside whole blocks are gathered instead and count 0: see :class:`BlockCombiner`)."""
        try:
            return self._pwrite(memoryview(data).cast("B"), offset)
        finally:
            # set once the bytes are written or gathered: a sync that ran meanwhile may have
            # missed them (gathered bytes are lost with the process, unlike the page cache's)
            self.dirty = True

    def _pwrite(self, view: memoryview, offset: int) -> int:
        comb = self._combiner
        if comb is None:
            return self.write_through(view, offset)
        n, block = len(view), comb.block
        lo = min(n, -offset % block)  # bytes before the first block boundary
        hi = max(lo, (offset + n) // block * block - offset)  # end of the whole blocks
        if hi == lo:  # inside one or two blocks: gathered
            comb.gather(self, view, offset)
            return 0
        comb.gather(self, view[:lo], offset)
        comb.gather(self, view[hi:], offset + hi)
        return self.write_through(view[lo:hi], offset + lo)

    def write_through(self, view: memoryview, offset: int) -> int:
        """:meth:`pwrite` without the combiner; the bytes that went through the page cache."""
        n = len(view)
        lo = -offset % DIRECT_ALIGN  # bytes before the first aligned file offset
        hi = (offset + n) // DIRECT_ALIGN * DIRECT_ALIGN - offset  # end of the aligned middle
        if self._refused or hi - lo < DIRECT_MIN_BYTES or (buffer_address(view) - offset) % DIRECT_ALIGN:
            pwrite_all(self.fd, view, offset)
            return n
        direct = self._direct_fd()
        if direct is None:
            pwrite_all(self.fd, view, offset)
            return n
        pwrite_all(self.fd, view[:lo], offset)
        try:
            pwrite_all(direct, view[lo:hi], offset + lo)
        except OSError as e:
            import errno

            if e.errno != errno.EINVAL:
                raise
            self._refused = True  # no direct writes here: buffered from now on (closed by close())
            pwrite_all(self.fd, view[lo:], offset + lo)
            return n
        pwrite_all(self.fd, view[hi:], offset + hi)
        return n - (hi - lo)

    def sync(self, data_only: bool = True) -> None:
        """Make what was written durable (``fdatasync``, or ``fsync``), if anything was since the
        last sync."""
        if not self.dirty:
            return
        self.dirty = False  # before the sync: a write racing with it sets it again
        if self._combiner is not None:
            try:
                self._combiner.flush(self)  # gathered bytes and blocks being written: on disk first
            except BaseException:
                self.dirty = True
                raise
        try:
            (os.fdatasync if data_only and hasattr(os, "fdatasync") else os.fsync)(self.fd)
        except BaseException:
            self.dirty = True
            raise

    def close(self, flush: bool = True) -> None:
        """Write what the combiner still holds of this file (unless ``flush`` is false: the file
        is about to be removed), then close the direct descriptor and ``fd``; no write may be
        running."""
        try:
            if self._combiner is not None:
                if flush:
                    self._combiner.flush(self)
                else:
                    self._combiner.drop(self)
        finally:
            self._close_fds()

    def _close_fds(self) -> None:
        direct, self._direct = self._direct, None
        self._refused = True
        for fd in (direct, self.fd):
            if fd is not None:
                os.close(fd)


#: Block of :class:`BlockCombiner`: the size of the writes it makes (at most; see :func:`combine_block`).
COMBINE_BLOCK = 4 << 20
#: A combiner's block is at most this fraction of the memory budget (its blocks, filling, queued and
#: being written, are a few per file: 4 MiB at the default 512 MiB budget, 1 MiB at 32 MiB).
COMBINE_BLOCKS_PER_BUDGET = 32
#: Most bytes a :class:`BlockCombiner` holds in partly filled blocks before it writes the oldest.
COMBINE_CAP = 32 << 20
#: Bytes of full blocks a :class:`BlockCombiner` queues for its writer thread before the caller
#: waits (at least ``WRITE_BEHIND_MIN_BLOCKS`` blocks; a writer passes less under a small memory
#: budget). Workers fill blocks in bursts (a tensor's chunk into each rank file) between their
#: reads; a queue of a burst's size keeps the writer busy through the reads, where 2 blocks made
#: the workers wait for it and then it for them (8 rank files, 2 MiB blocks: 1.97-2.45 s with 2
#: blocks, 1.82-1.88 s with 16, cold, the same runs alternating).
WRITE_BEHIND_BYTES = 32 << 20
#: ... and at most this fraction of the conversion's memory budget (32 MiB at the default 512 MiB).
WRITE_BEHIND_PER_BUDGET = 16
#: The fewest full blocks queued for the writer thread before the caller waits: the device always
#: has the next block while one is written.
WRITE_BEHIND_MIN_BLOCKS = 2
#: Blocks smaller than this (many files written at once) are written by the workers that fill them,
#: not behind them: one writer thread would send them to the disk one small write at a time (64 rank
#: files, 256 KiB blocks: 12.7 s with the workers writing, 14.0-15.7 s behind them).
WRITE_BEHIND_MIN_BLOCK = 1 << 20
#: Seconds the write-behind thread of a :class:`BlockCombiner` waits for a block before it ends.
WRITE_BEHIND_IDLE_SECONDS = 1.0
#: The smallest block :func:`combine_block` picks (many files written at once).
COMBINE_MIN_BLOCK = 64 << 10


def combine_block(files: int, block: int = COMBINE_BLOCK, cap: int = COMBINE_CAP, memory: int | None = None) -> int:
    """The block for a :class:`BlockCombiner` gathering the writes of ``files`` files at once.

    A conversion writes every target file a little at a time (a tensor's chunk into each rank's
    file, then the next tensor's), so each file has a partly filled block open: with more open
    blocks than ``cap`` holds, nearly every block is written out partly filled, in pieces (64 rank
    files, 1 MiB blocks: 25,925 such writes for 63 whole ones). The block is halved (down to
    ``COMBINE_MIN_BLOCK``) until two per file fit in ``cap``, and until it is at most
    1/``COMBINE_BLOCKS_PER_BUDGET`` of ``memory`` (the conversion's memory budget, when given)."""
    while block > COMBINE_MIN_BLOCK and (2 * files * block > cap
                                         or (memory is not None and block * COMBINE_BLOCKS_PER_BUDGET > memory)):
        block //= 2
    return block


_NO_ENTRY = (None, None, None)


class _Block:
    __slots__ = ("buf", "length", "filled", "runs", "copying")

    def __init__(self, buf: np.ndarray, length: int) -> None:
        self.buf, self.length, self.filled, self.runs = buf, length, 0, []
        self.copying = 0  # copies into it under way (outside the lock)


class BlockCombiner:
    """Gathers the small writes of one or more files (:class:`DirectWrites` with this combiner)
    into whole ``block``-sized blocks at block-aligned offsets, each written with one aligned
    write (``O_DIRECT`` where the file takes it) as soon as it is full, so that a file made of
    many small records (a DCP rank file: a zip archive per chunk, each a few hundred bytes of
    headers around the tensor bytes) is written in large aligned writes, whatever the size of
    the pieces. Writes must go to disjoint ranges (each byte written once).

    A block that is never filled (the bytes of an adopted chunk left unwritten on ``--resume``,
    a file's last block without its size known) stays until :meth:`flush` (each file's sync and
    close) writes its filled runs; past ``cap`` held bytes the oldest partly filled block is
    written so (:attr:`evicted` counts them). Thread-safe.
    """

    def __init__(self, block: int = COMBINE_BLOCK, cap: int = COMBINE_CAP, behind: bool = True,
                 queue_bytes: int | None = None) -> None:
        """``behind``: full blocks are written by a writer thread of the combiner while the caller
        goes on (at most ``queue_bytes`` of them queued, default ``WRITE_BEHIND_BYTES``, at least
        ``WRITE_BEHIND_MIN_BLOCKS`` blocks); else by the caller that fills them."""
        if block % DIRECT_ALIGN:
            raise ValueError(f"block must be a multiple of {DIRECT_ALIGN}")
        self.block, self.cap = block, cap
        self.queue_bytes = max(WRITE_BEHIND_MIN_BLOCKS * block,
                               WRITE_BEHIND_BYTES if queue_bytes is None else queue_bytes)
        self._blocks: dict[tuple[int, int], tuple[DirectWrites, int, _Block]] = {}  # insertion order: oldest first
        self._free: list[np.ndarray] = []
        self._held = 0
        self._writing: dict[int, int] = {}  # id(file) -> full blocks queued or being written now
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[DirectWrites, int, _Block]] = collections.deque()
        self._queued = 0  # bytes of full blocks queued or being written by the writer thread
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None  # the writer thread's first failure
        self.behind = behind
        self._copy_waiters = 0  # flushes and drops waiting for copies into their blocks
        self.evicted = 0
        self.full_blocks = 0

    def _buffer(self) -> np.ndarray:
        if self._free:
            return self._free.pop()
        raw = np.empty(self.block + DIRECT_ALIGN, dtype=np.uint8)
        start = -raw.ctypes.data % DIRECT_ALIGN
        return raw[start: start + self.block]

    def gather(self, owner: DirectWrites, view: memoryview, offset: int) -> None:
        """Copy ``view`` (to be written at ``offset`` of ``owner``) into its blocks; write the
        blocks it fills (and the oldest partly filled ones past the cap)."""
        if not len(view):
            return
        self._raise_error()
        done, ready, evict, spans = 0, [], [], []
        with self._cond:  # reserve the ranges: the copies are made outside the lock, side by side
            while done < len(view):
                at = offset + done
                k, lo = divmod(at, self.block)
                n = min(len(view) - done, self.block - lo)
                key = (id(owner), k)
                entry = self._blocks.get(key)
                if entry is None:
                    length = self.block if owner.size is None else min(self.block, owner.size - k * self.block)
                    entry = self._blocks[key] = (owner, k, _Block(self._buffer(), max(length, lo + n)))
                    self._held += self.block
                entry[2].copying += 1
                spans.append((key, entry[2], lo, n, done))
                done += n
        try:
            for _, blk, lo, n, at in spans:
                np.frombuffer(blk.buf, dtype=np.uint8)[lo: lo + n] = np.frombuffer(view[at: at + n], dtype=np.uint8)
        except BaseException:
            with self._cond:
                for _, blk, _, _, _ in spans:
                    blk.copying -= 1
                if self._copy_waiters:
                    self._cond.notify_all()
            raise
        with self._cond:
            for key, blk, lo, n, _ in spans:
                blk.copying -= 1
                blk.filled += n
                blk.runs.append((lo, lo + n))
                if blk.filled == blk.length and self._blocks.get(key, _NO_ENTRY)[2] is blk:
                    ready.append(self._take(key))
            if self._copy_waiters:  # a flush or drop waits for the copies into its blocks
                self._cond.notify_all()
            if self._held > self.cap:  # the oldest partly filled blocks that no copy is filling
                for key, entry in list(self._blocks.items()):
                    if self._held <= self.cap:
                        break
                    if not entry[2].copying:
                        evict.append(self._take(key))
                        self.evicted += 1
            for f, _, _ in ready + evict:  # a flush of f waits for these writes
                self._writing[id(f)] = self._writing.get(id(f), 0) + 1
            self.full_blocks += len(ready)
            if self.behind and ready:
                self._enqueue(ready)
                ready = []
        try:
            for f, k, blk in ready:
                f.write_through(memoryview(blk.buf)[: blk.length], k * self.block)
            self._write_runs(evict)
        finally:
            with self._cond:
                for f, _, blk in ready + evict:
                    self._writing[id(f)] -= 1
                    self._free_block(blk)
                self._cond.notify_all()
        self._raise_error()

    def _enqueue(self, ready: list[tuple[DirectWrites, int, _Block]]) -> None:
        """Hand full blocks to the writer thread (started when none runs); waits while more than
        ``queue_bytes`` are queued (not past a failure of the writer: the caller raises it once its
        own writes are accounted for). Called with the lock held."""
        self._queue.extend(ready)
        self._queued += sum(blk.length for _, _, blk in ready)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_behind, name="ckptconv-blocks", daemon=True)
            self._writer.start()
        self._cond.notify_all()
        while self._queued > self.queue_bytes and self._error is None:
            self._cond.wait()

    def _write_behind(self) -> None:
        """The writer thread: writes queued full blocks in order; ends once the queue stayed empty
        for ``WRITE_BEHIND_IDLE_SECONDS`` (a later block starts another). Its first failure is
        kept and raised by the next :meth:`gather` or :meth:`flush` (the blocks after it are
        dropped: nothing is journaled or published before a flush returns)."""
        import time

        while True:
            with self._cond:
                idle_until = time.monotonic() + WRITE_BEHIND_IDLE_SECONDS
                while not self._queue and time.monotonic() < idle_until:
                    self._cond.wait(idle_until - time.monotonic())
                if not self._queue:
                    self._writer = None
                    return
                f, k, blk = self._queue.popleft()
            try:
                if self._error is None:
                    f.write_through(memoryview(blk.buf)[: blk.length], k * self.block)
            except BaseException as e:  # noqa: BLE001 - kept for the callers, the thread ends its queue
                self._error = e
            finally:
                with self._cond:
                    self._writing[id(f)] -= 1
                    self._queued -= blk.length
                    self._free_block(blk)
                    self._cond.notify_all()

    def _wait_copies(self, owner: DirectWrites) -> None:
        """Wait until no copy fills a block of ``owner`` (called with the lock held)."""
        while any(entry[2].copying for key, entry in self._blocks.items() if key[0] == id(owner)):
            self._copy_waiters += 1
            try:
                self._cond.wait()
            finally:
                self._copy_waiters -= 1

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _take(self, key: tuple[int, int]) -> tuple[DirectWrites, int, _Block]:
        entry = self._blocks.pop(key)
        self._held -= self.block
        return entry

    def _free_block(self, blk: _Block) -> None:
        if len(self._free) * self.block < self.cap:
            self._free.append(blk.buf)

    def _write_runs(self, entries: list[tuple[DirectWrites, int, _Block]]) -> None:
        """Write the filled runs of partly filled blocks (merged where they touch)."""
        for f, k, blk in entries:
            runs = sorted(blk.runs)
            start, end = runs[0]
            for lo, hi in [*runs[1:], (None, None)]:
                if lo == end:
                    end = hi
                    continue
                f.write_through(memoryview(blk.buf)[start:end], k * self.block + start)
                if lo is not None:
                    start, end = lo, hi

    def flush(self, owner: DirectWrites) -> None:
        """Write every block of ``owner`` this combiner holds and wait for the full blocks other
        threads are writing to it: on return, every byte :meth:`gather` took for it is written."""
        with self._cond:
            self._wait_copies(owner)
            mine = [key for key in self._blocks if key[0] == id(owner)]
            entries = [self._take(key) for key in mine]
        try:
            self._write_runs(entries)
        finally:
            with self._cond:
                for _, _, blk in entries:
                    self._free_block(blk)
        with self._cond:
            while self._writing.get(id(owner)):
                self._cond.wait()
            self._raise_error()

    def drop(self, owner: DirectWrites) -> None:
        """Forget what this combiner holds of ``owner`` (a file being removed): its partly filled
        blocks, and its full blocks still queued (one being written is waited for)."""
        with self._cond:
            self._wait_copies(owner)
            for key in [key for key in self._blocks if key[0] == id(owner)]:
                self._free_block(self._take(key)[2])
            mine = [e for e in self._queue if e[0] is owner]
            for e in mine:
                self._queue.remove(e)
                self._writing[id(owner)] -= 1
                self._queued -= e[2].length
                self._free_block(e[2])
            while self._writing.get(id(owner)):
                self._cond.wait()


def run_parallel(fn: Callable[[Any], None], items: list, workers: int = 8) -> None:
    """``fn(item)`` for every item, up to ``workers`` at once (for fsyncs: each mostly waits on the
    device, and concurrent ones share journal commits). The first failure is raised after all ran."""
    if len(items) <= 1 or workers <= 1:
        for item in items:
            fn(item)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="ckptconv-sync") as pool:
        futures = [pool.submit(fn, item) for item in items]
    for f in futures:
        f.result()


def fsync_path(path: str | os.PathLike) -> None:
    """fsync one file or directory by path (a directory best effort, as :func:`fsync_dir`)."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        import stat

        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise
    finally:
        os.close(fd)


def fsync_paths(paths: list, workers: int = 8) -> None:
    """fsync every file or directory in ``paths``, several at once (:func:`run_parallel`)."""
    run_parallel(fsync_path, list(paths), workers)
