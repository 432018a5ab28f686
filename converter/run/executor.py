"""The one I/O loop: run a plan's write tasks with a worker pool under a memory budget.

Workers fill each target piece from source regions and hand it to the sink; pieces of one task
are written in C order by one worker, so every target chunk has exactly one writer. Buffers in
flight are bounded by the budget (each task reserves twice its largest piece: the piece and
one source read), whatever the checkpoint's size.

A failure or an interrupt (Ctrl-C, SIGTERM under the CLI) stops the run within one piece: tasks not
started are dropped, and running workers stop before their next piece without finishing their
task (it is not journaled, so ``--resume`` redoes it).
"""

from __future__ import annotations

import gc
import queue
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from converter import knobs
from converter.plan.copy_tasks import Piece, WriteTask
from formats.base import Box, CheckpointReader
from formats.dtypes import by_name, to_storage_array
from formats.errors import CkptConvError, StorageError
from converter.run.journal import SharedFiles
from converter.run.prefetch import Prefetcher
from formats.fsutil import pooled_buffer

if TYPE_CHECKING:
    from converter.run.journal import Journal


def _pin_malloc_threshold() -> None:
    """Keep glibc from caching freed piece buffers on its heaps.

    glibc raises its mmap threshold after large buffers are freed, so later pieces come from the
    heap and freed pieces stay in RSS. A fixed threshold (128 KiB) returns every piece buffer to
    the OS on free, so RSS follows the budget. No-op where glibc is absent.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


_pin_malloc_threshold()


class PieceWriter(Protocol):
    """Receives one task's pieces in C order, then ``close``.

    A piece's data is its bit array: a C-contiguous numpy array of the tensor's storage dtype
    (:mod:`formats.dtypes`: bf16 as uint16, float8 as uint8) shaped like the piece; valid only
    during ``write`` (the buffer is reused for the next piece).

    ``close`` returns what the journal must remember to resume without the task (e.g. a
    checksum), or None.
    """

    def write(self, piece: Piece, data: np.ndarray) -> None: ...

    def close(self) -> Any: ...

    # Optional: ``file_offset(piece) -> int | None``, where ``write`` will put the piece's first
    # byte in its file (None: unknown, or the data is converted first); the executor then places
    # the piece's buffer to match it, so a large aligned part can be written straight to the
    # device (:class:`formats.fsutil.DirectWrites`).


class TaskSink(Protocol):
    """Opens a :class:`PieceWriter` for each write task; ``sync`` makes closed tasks durable.

    A sink whose files many tasks write may also have ``shared_files(task)`` (the ids of the files the
    task writes) and ``sync_files(ids)`` (sync only those): the journal then syncs each such file
    once, when its tasks are done (:class:`converter.run.journal.SharedFiles`)."""

    def open(self, task: WriteTask) -> PieceWriter: ...

    def sync(self) -> None: ...


class _Stopped(Exception):
    """A worker gave up its task because the run is stopping (never escapes :func:`execute`)."""


class _FaultInjector:
    """SIGKILLs the process after ``knobs.FAULT_KILL_AFTER_BYTES`` written bytes (tests only)."""

    def __init__(self) -> None:
        from converter import knobs

        self.limit = knobs.FAULT_KILL_AFTER_BYTES
        self.written = 0
        self._lock = threading.Lock()

    def wrote(self, n: int) -> None:
        if not self.limit:
            return
        with self._lock:
            self.written += n
            if self.written >= self.limit:
                import os
                import signal

                os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class ExecStats:
    """What an execution did."""

    tasks: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    peak_reserved: int = 0


class MemoryBudget:
    """A byte-counting semaphore; a request larger than the budget waits until it runs alone."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        with self._cond:
            self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)
        return n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


def storage_error(e: OSError, what: str) -> StorageError:
    """A one-line project error for an OS-level failure, saying how to continue."""
    import errno

    where = f" ({e.filename})" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return StorageError(
            f"{what}: out of space{where}: {e.strerror}; free space (or raise the file size limit), "
            "then rerun the same command with --resume"
        )
    return StorageError(f"{what}: I/O error{where}: {e.strerror or e}; fix the storage, then rerun with --resume")


def os_errors_as_storage_errors(what: str):
    """Decorator: an OSError that escapes a conversion becomes a :class:`StorageError`."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except OSError as e:
                if isinstance(e, CkptConvError):
                    raise
                raise storage_error(e, what) from e

        return run

    return wrap


def _dense_offset(rel: Box, sizes: tuple[int, ...]) -> int | None:
    """The C-order element offset of ``rel`` inside a box of ``sizes`` when ``rel`` is one dense
    run of it (leading dims of size 1, one partial dim, whole trailing dims); else None."""
    k = len(sizes) - 1
    while k >= 0 and rel.offsets[k] == 0 and rel.sizes[k] == sizes[k]:
        k -= 1
    if any(s != 1 for s in rel.sizes[:max(k, 0)]):
        return None
    offset, stride = 0, 1
    for o, n in zip(reversed(rel.offsets), reversed(sizes)):
        offset += o * stride
        stride *= n
    return offset


def _byte_shape(sizes: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    return (*sizes[:-1], sizes[-1] * itemsize) if sizes else (itemsize,)


def fill_piece(reader: CheckpointReader, task: WriteTask, piece: Piece, file_offset: int | None = None) -> np.ndarray:
    """The piece's data as a bit array (numpy, storage dtype, the piece's shape), read from its
    source regions.

    Every region is read (``read_region_into``) straight into a pooled per-thread buffer at its
    place in the piece (regions that are not one dense run of the piece go through a pooled
    scratch buffer); the result is a view of that buffer, valid until this thread fills its next
    piece. ``file_offset``: where the writer puts the piece's first byte; the buffer is placed
    to match it modulo the page size, so the writer can send it straight to the device.
    """
    into = reader.read_region_into
    d = by_name(task.dtype)
    isz = d.itemsize
    buf = pooled_buffer("piece", piece.box.numel * isz, file_offset)
    view = memoryview(buf)
    sizes = piece.box.sizes
    for c in piece.copies:
        rel = c.region.relative_to(piece.box)
        n = c.region.numel * isz
        start = _dense_offset(rel, sizes)
        if start is not None:
            into(task.key, c.src, c.region, view[start * isz: start * isz + n])
            continue
        tmp = pooled_buffer("scratch", n)
        into(task.key, c.src, c.region, memoryview(tmp))
        sel = (*rel.slices()[:-1], slice(rel.offsets[-1] * isz, rel.ends[-1] * isz))
        buf.reshape(_byte_shape(sizes, isz))[sel] = tmp.reshape(_byte_shape(rel.sizes, isz))
    return buf.view(d.numpy_dtype).reshape(sizes)


def _fill_piece_tensors(reader: CheckpointReader, task: WriteTask, piece: Piece) -> np.ndarray:
    """The piece assembled from ``read_region`` tensors: the reference :func:`fill_piece` is
    tested against (tests/test_perf_paths.py)."""
    if len(piece.copies) == 1 and piece.copies[0].region == piece.box:
        c = piece.copies[0]
        return to_storage_array(reader.read_region(task.key, c.src, c.region))
    buf = np.empty(piece.box.sizes, dtype=by_name(task.dtype).numpy_dtype)
    for c in piece.copies:
        buf[c.region.relative_to(piece.box).slices()] = to_storage_array(reader.read_region(task.key, c.src, c.region))
    return buf


#: Seconds between plain progress lines when stderr is not a terminal (``knobs``; tests patch it here).
PROGRESS_LINE_SECONDS = knobs.PROGRESS_LINE_SECONDS


def _fmt_bytes(n: float) -> str:
    from converter.units import human_bytes

    return human_bytes(n)


def _rate_column():
    """A rich column with the transfer rate in binary units (rich's own says MB/s)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{_fmt_bytes(speed)}/s", style="progress.data.speed")

    return RateColumn()


class _Progress:
    """Bytes done, rate and ETA on stderr.

    On a terminal: a rich progress bar (unless ``enabled`` is False). Otherwise, unless
    ``enabled`` is False: a plain line such as ``converting: 1.2/2.0 GiB (60 %), 410.5 MiB/s,
    ETA 2 s`` every :data:`PROGRESS_LINE_SECONDS` (the first one after that long, so short runs
    print nothing), and once the run completes a last line at 100 %. Under torchrun
    (``prefix`` like ``[rank 1/4]``) every rank prints plain lines of its own share, prefixed, so
    no rank's numbers appear to undo another's (a bar per process would overwrite each other).
    """

    def __init__(self, total: int, label: str, enabled: bool | None, prefix: str = "") -> None:
        self._bar = None
        self._lines = False
        self._printed: int | None = None  # bytes done at the last line printed
        self._label, self._total, self._done = (f"{prefix} {label}" if prefix else label), total, 0
        self._lock = threading.Lock()
        self._start = self._last = time.monotonic()
        if enabled is False or not total:
            return
        if sys.stderr.isatty() and not prefix:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn(label), BarColumn(), DownloadColumn(binary_units=True), _rate_column(),
                TimeRemainingColumn(), console=Console(stderr=True), transient=False,
            )
            self._task = self._bar.add_task(label, total=total)
            self._bar.start()
        else:
            self._lines = True

    def advance(self, n: int) -> None:
        if n <= 0:
            return
        if self._bar is not None:
            with self._lock:
                self._bar.advance(self._task, n)
        elif self._lines:
            with self._lock:
                self._done += n
                now = time.monotonic()
                if now - self._last < PROGRESS_LINE_SECONDS:
                    return
                self._last = now
                self._line(now)

    def _line(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = self._done / elapsed
        total = _fmt_bytes(self._total)
        unit = total.split()[-1]
        scale = {"TiB": 1 << 40, "GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}.get(unit, 1)
        pct = 100.0 * self._done / self._total
        if self._done >= self._total:
            tail = f"done in {elapsed:.1f} s"
        else:
            tail = f"ETA {(self._total - self._done) / rate:.0f} s" if rate else "ETA ?"
        pct = min(pct, 99.0) if self._done < self._total else 100.0  # 100 % only when complete
        # one write per line: under torchrun the ranks share stderr, and a line must not be split
        sys.stderr.write(f"{self._label}: {self._done / scale:.1f}/{total} ({pct:.0f} %), {_fmt_bytes(rate)}/s, {tail}\n")
        sys.stderr.flush()
        self._printed = self._done

    def stop(self) -> None:
        """End the display; a run that printed lines and completed ends on its 100 % line."""
        if self._bar is not None:
            self._bar.stop()
        elif self._lines and self._printed is not None and self._printed < self._total <= self._done:
            with self._lock:
                self._line(time.monotonic())


class _CheckedJournal:
    """Journals a finished task only once every source chunk it read is verified.

    A source chunk read in parts (by several tasks) is verified when its parts cover it
    (:mod:`formats.integrity`), possibly after the first of those tasks finished: journaling that
    task at once would let ``--resume``, after the damaged file was restored, keep the bytes it
    copied. Such tasks wait here until the reader says their chunks are verified (at the next
    journal batch, or after :meth:`CheckpointReader.finish_checks` at the end of the run).
    """

    def __init__(self, journal: Journal | None, reader: CheckpointReader) -> None:
        self.journal = journal
        self._pending = getattr(reader, "pending_checks", None) if journal is not None else None
        self._waiting: list[tuple[WriteTask, Any, list]] = []
        self._lock = threading.Lock()

    @property
    def tracks_sources(self) -> bool:
        """Whether a task's source chunks must be collected for :meth:`record`."""
        return self._pending is not None

    def record(self, task: WriteTask, info: Any, sources: list) -> None:
        if self.journal is None:
            return
        if self._pending is not None and self._pending(sources):
            with self._lock:
                self._waiting.append((task, info, sources))
            return
        self.journal.record(task, info)

    def release(self, everything: bool = False) -> None:
        """Journal the waiting tasks whose chunks are verified now (all of them: ``everything``,
        once the reader finished its checks)."""
        if self.journal is None:
            return
        with self._lock:
            waiting, self._waiting = self._waiting, []
        still = []
        for task, info, sources in waiting:
            if not everything and self._pending(sources):
                still.append((task, info, sources))
            else:
                self.journal.record(task, info)
        if still:
            with self._lock:
                self._waiting.extend(still)


def _task_sources_of(piece: Piece, into: dict[int, Any]) -> None:
    """Add the source chunks ``piece`` reads to ``into`` (keyed by identity)."""
    for c in piece.copies:
        into[id(c.src)] = c.src


def finish_checks(reader: CheckpointReader, workers: int = 1) -> None:
    """Complete the reader's open source checks (bytes no read covered), raising on a mismatch."""
    finish = getattr(reader, "finish_checks", None)
    if finish is not None:
        finish(workers)


def execute(
    tasks: Sequence[WriteTask],
    reader: CheckpointReader,
    sink: TaskSink,
    *,
    workers: int,
    memory_budget: int,
    progress: bool | None = None,
    label: str = "converting",
    journal: Journal | None = None,
    progress_prefix: str = "",
) -> ExecStats:
    """Run every task not already in ``journal``; the first failure stops the run and is re-raised.

    Finished tasks are journaled in batches (data fsynced first), so an interrupted run resumes
    where the last batch ended.
    """
    stats = ExecStats()
    budget = MemoryBudget(memory_budget)
    todo = [t for t in tasks if journal is None or not journal.is_done(t)]
    bar = _Progress(sum(t.nbytes for t in tasks), label, progress, progress_prefix)
    bar.advance(sum(t.nbytes for t in tasks) - sum(t.nbytes for t in todo))
    failed = threading.Event()  # set on the first failure or interrupt: every worker stops
    lock = threading.Lock()
    fault = _FaultInjector()
    from converter import knobs

    slow = knobs.FAULT_SLOW_PIECE_SECONDS
    hold = Path(knobs.FAULT_HOLD_FILE) if knobs.FAULT_HOLD_FILE else None
    start = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    gc.freeze()  # the index and plan are long-lived: keep the collector off them
    gc.disable()  # the copy loop makes no cycles worth a collection pass

    checked = _CheckedJournal(journal, reader)
    shared = SharedFiles(todo, sink) if journal is not None and hasattr(sink, "shared_files") else None
    make_durable = sink.sync if shared is None else shared.make_durable
    ready = None if shared is None else shared.ready
    ready_epoch = None if shared is None else shared.epoch

    prefetcher = Prefetcher.start_for(reader, todo, knobs.PREFETCH_BYTES, knobs.PREFETCH_MAX_CHUNK_BYTES or 1 << 62)

    def run(task: WriteTask) -> None:
        if failed.is_set():
            return
        if prefetcher is not None:
            prefetcher.started(task)
        held = budget.acquire(2 * max(1, task.max_piece_bytes))
        sources: dict[int, Any] = {}
        try:
            if failed.is_set():
                raise _Stopped
            writer = sink.open(task)
            place = getattr(writer, "file_offset", None)
            for piece in task.pieces:
                while hold is not None and hold.exists() and not failed.wait(0.05):  # tests: held
                    pass
                if slow and failed.wait(slow):  # tests: a slow run, still stopped at once
                    raise _Stopped
                if failed.is_set():  # stop between pieces: the task stays undone (not journaled)
                    raise _Stopped
                data = fill_piece(reader, task, piece, None if place is None else place(piece))
                if checked.tracks_sources:
                    _task_sources_of(piece, sources)
                writer.write(piece, data)
                n = data.nbytes
                del data  # free this piece before the next one is read
                bar.advance(n)
                fault.wrote(n)
            info = writer.close()
        except _Stopped:
            return
        except OSError as e:
            failed.set()
            raise storage_error(e, f"writing {task.key!r}") from e
        except BaseException:
            failed.set()
            raise
        finally:
            budget.release(held)
        if shared is not None:
            shared.finished(task)
        checked.record(task, info, list(sources.values()))
        with lock:
            stats.tasks += 1
            stats.bytes_written += task.nbytes

    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptconv")
    try:
        finished: queue.SimpleQueue = queue.SimpleQueue()  # futures as they complete: O(1) each
        for t in todo:
            pool.submit(run, t).add_done_callback(finished.put)
        left = len(todo)
        while left:
            done = _completed(finished, timeout=1.0, left=left)
            left -= len(done)
            error = next((f.exception() for f in done if f.exception() is not None), None)
            if error is not None:
                _stop(pool, failed)
                checked.release()  # what was verified before the failure is kept for --resume
                _flush_after_failure(journal, sink)
                raise error
            if journal is not None:
                checked.release()
                journal.flush(make_durable, ready=ready, ready_epoch=ready_epoch)
        pool.shutdown(wait=True)
        finish_checks(reader, workers)
        if journal is not None:
            checked.release(everything=True)
            journal.flush(make_durable, force=True, ready=ready, ready_epoch=ready_epoch)
    except BaseException:  # an interrupt: stop the workers now; what the journal holds is kept
        _stop(pool, failed)
        raise
    finally:
        if prefetcher is not None:
            prefetcher.stop()
        bar.stop()
        if gc_was_enabled:
            gc.enable()
        gc.unfreeze()
    stats.seconds = time.perf_counter() - start
    stats.bytes_read = stats.bytes_written
    stats.peak_reserved = budget.peak
    return stats


def _completed(finished: queue.SimpleQueue, timeout: float, left: int | None = None) -> list[Future]:
    """The futures that completed since the last call: waits up to ``timeout`` for the first, then
    (unless it was the last of ``left``) ``knobs.COMPLETION_BATCH_SECONDS`` more, and takes every one
    there (a wait on the set of pending futures would cost O(tasks) per completion: quadratic in a
    run of 10^5 tasks)."""
    try:
        done = [finished.get(timeout=timeout)]
    except queue.Empty:
        return []
    if left is None or left > 1:
        time.sleep(knobs.COMPLETION_BATCH_SECONDS)
    while True:
        try:
            done.append(finished.get_nowait())
        except queue.Empty:
            return done


def _stop(pool: ThreadPoolExecutor, failed: threading.Event) -> None:
    """Drop the tasks not started and wait for the running ones to stop (within one piece)."""
    failed.set()
    pool.shutdown(wait=True, cancel_futures=True)


def _flush_after_failure(journal: Journal | None, sink: TaskSink) -> None:
    """Keep what finished before a failure (a full disk, say) for ``--resume``: every file synced,
    every finished task journaled; best effort."""
    if journal is None:
        return
    try:
        journal.flush(sink.sync, force=True)
    except OSError:
        pass
