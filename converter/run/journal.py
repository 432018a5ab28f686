"""The resume journal: which write tasks of a conversion are durably finished.

A conversion writes ``<dst>/.ckptconv-journal.jsonl``: a header line naming the operation and a
fingerprint of its inputs and plan, then one line per finished task. Entries are appended in
batches: the sink's data is fsynced first, then the lines are appended and the journal fsynced,
so every journaled task is on disk. Tasks finished after the last batch are simply redone.
The journal is removed once the output is committed.

A file that many tasks write (a DCP rank file) is synced once, when this run's last task into it
is done, and its tasks are journaled then (:class:`SharedFiles`); only a file open for longer than
``knobs.JOURNAL_OPEN_FILE_SECONDS`` is synced in between. A file that one task writes (a store
chunk) is synced at the first batch after it is written, once.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from converter import knobs
from converter.plan.copy_tasks import WriteTask
from formats.errors import DestinationError

JOURNAL_NAME = ".ckptconv-journal.jsonl"

_json_string = json.encoder.encode_basestring_ascii  # how json.dumps writes a str (ensure_ascii)


def task_id(task: WriteTask) -> str:
    """A stable id of a task: its key and target box (unique within a conversion), and the tag of
    its target when it has one (a target kind whose boxes can repeat another's: the consolidated
    files of ``--format dcp-safetensors``; a ``--format megatron-legacy`` target's TP-replicated
    tensors, written into every rank's file)."""
    box = task.box  # json.dumps([key, offsets, sizes(, tag)], separators=(",", ":")), spelled out: ~4 calls a task
    text = f'[{_json_string(task.key)},[{",".join(map(str, box.offsets))}],[{",".join(map(str, box.sizes))}]'
    tag = getattr(task.target, "journal_tag", None)
    if tag:
        text += "," + json.dumps(tag, separators=(",", ":"))
    return text + "]"


class Journal:
    """Append-only record of finished tasks for one destination."""

    def __init__(self, dst: Path, header: dict[str, Any], done: dict[str, Any] | None = None) -> None:
        self.path = Path(dst) / JOURNAL_NAME
        self.header = header
        self.done: dict[str, Any] = dict(done or {})
        self._pending: list[tuple[str, Any, WriteTask]] = []  # recorded since the last flush
        self._waiting: list[tuple[str, Any, WriteTask]] = []  # recorded earlier, not yet ready
        self._epoch: Any = None  # ``ready_epoch()`` when ``_waiting`` was last judged
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        if done is None:
            self._append([{"header": header}], truncate=True)

    @classmethod
    def resume(cls, dst: Path, header: dict[str, Any]) -> Journal:
        """Reopen the journal of an interrupted run of the same conversion."""
        path = Path(dst) / JOURNAL_NAME
        if not path.is_file():
            raise DestinationError(
                f"{dst}: nothing to resume (no {JOURNAL_NAME}); run without --resume (add --overwrite to replace it)"
            )
        lines = path.read_text().splitlines()
        try:
            first = json.loads(lines[0])["header"] if lines else None
        except (ValueError, KeyError, TypeError):
            first = None
        if first != header:
            raise DestinationError(
                f"{dst}: the interrupted run there was a different conversion (source, options or plan "
                "changed); pass --overwrite to start over"
            )
        done: dict[str, Any] = {}
        for line in lines[1:]:
            try:
                entry = json.loads(line)
                done[entry["t"]] = entry.get("i")
            except (ValueError, KeyError, TypeError):
                break  # a torn last line: everything after it is redone
        return cls(dst, header, done)

    def is_done(self, task: WriteTask) -> bool:
        return task_id(task) in self.done

    def info(self, task: WriteTask) -> Any:
        return self.done.get(task_id(task))

    def record(self, task: WriteTask, info: Any = None) -> None:
        """Note a finished task; it becomes durable at the next :meth:`flush` that may take it."""
        with self._lock:
            self._pending.append((task_id(task), info, task))

    def flush(self, make_durable: Callable[[], None], force: bool = False,
              ready: Callable[[WriteTask], bool] | None = None,
              ready_epoch: Callable[[], Any] | None = None) -> None:
        """fsync the data (``make_durable``), then append the pending entries durably; only the
        entries of tasks ``ready`` says ``make_durable`` makes durable now (default: all), the
        others stay pending.

        ``ready_epoch()``: a value that changes whenever a task ``ready`` refused may have become
        ready (:meth:`SharedFiles.epoch`); while it stays the same only newly recorded tasks are
        judged, so a run's flushes cost O(tasks) in all, not O(tasks) each."""
        with self._lock:
            if not (self._pending or self._waiting) or (
                    not force and time.monotonic() - self._last_flush < knobs.JOURNAL_FLUSH_SECONDS):
                return
            if ready is None:
                pending, self._pending, self._waiting = self._waiting + self._pending, [], []
            else:
                epoch = ready_epoch() if ready_epoch is not None else object()
                judged = self._pending if epoch == self._epoch else self._waiting + self._pending
                kept = self._waiting if epoch == self._epoch else []
                pending = []
                for p in judged:
                    (pending if ready(p[2]) else kept).append(p)
                self._pending, self._waiting, self._epoch = [], kept, epoch
            if not pending:
                # nothing this batch can make durable: look again a batch interval from now
                self._last_flush = time.monotonic()
                return
        make_durable()
        self._append([{"t": t, "i": i} for t, i, _ in pending])
        with self._lock:
            self.done.update((t, i) for t, i, _ in pending)
            self._last_flush = time.monotonic()

    def _append(self, entries: list[dict[str, Any]], truncate: bool = False) -> None:
        data = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else os.O_APPEND), 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Drop the journal once the output is committed."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class SharedFiles:
    """When the files that many tasks write (a sink's ``shared_files(task)``: a DCP rank file) are made
    durable: each once, when this run's last task into it is done, unless it stays open for
    longer than ``knobs.JOURNAL_OPEN_FILE_SECONDS`` (then also at a batch that long after its last
    sync, so that ``--resume`` keeps the finished tasks of a long run). A task is journaled once
    every file it wrote is durable (:meth:`ready`); :meth:`make_durable` syncs the files that are
    due (``sink.sync_files``)."""

    def __init__(self, tasks: Sequence[WriteTask], sink: Any) -> None:
        from collections import Counter

        self._files_of = sink.shared_files
        self._sync = sink.sync_files
        self._left: Counter = Counter(f for t in tasks for f in self._files_of(t))
        self._synced_at = dict.fromkeys(self._left, time.monotonic())
        self._clean: set = set()  # done and synced: never synced again
        self._lock = threading.Lock()
        open_s = knobs.JOURNAL_OPEN_FILE_SECONDS
        self._open_s = 30 * knobs.JOURNAL_FLUSH_SECONDS if open_s is None else open_s
        self._changes = 0  # files that became due by finishing, or were synced
        self._next_due = min(self._synced_at.values(), default=0.0) + self._open_s  # the first open file due by time

    def finished(self, task: WriteTask) -> None:
        """``task`` is written and closed."""
        with self._lock:
            for f in self._files_of(task):
                self._left[f] -= 1
                if self._left[f] == 0:
                    self._changes += 1

    def _due(self, f: Any, now: float) -> bool:
        return f in self._clean or self._left[f] <= 0 or now - self._synced_at[f] >= self._open_s

    def ready(self, task: WriteTask) -> bool:
        """Whether the next :meth:`make_durable` makes all of ``task``'s files durable."""
        now = time.monotonic()
        with self._lock:
            return all(self._due(f, now) for f in self._files_of(task))

    def epoch(self) -> tuple[int, bool]:
        """Changes whenever a task :meth:`ready` refused may have become ready: a file finished, a
        sync, or an open file's interval passed (the journal's cue to judge its waiting tasks again)."""
        with self._lock:
            return self._changes, time.monotonic() >= self._next_due

    def make_durable(self) -> None:
        """Sync the files that are done (once) or open past the interval."""
        now = time.monotonic()
        with self._lock:
            due = [f for f in self._left if f not in self._clean and self._due(f, now)]
            for f in due:
                self._synced_at[f] = now
                if self._left[f] <= 0:
                    self._clean.add(f)
            if due:
                self._changes += 1
                open_files = [t for f, t in self._synced_at.items() if f not in self._clean]
                self._next_due = min(open_files, default=now) + self._open_s
        if due:
            self._sync(due)


def index_fingerprint(index: Any) -> str:
    """A hash of everything in a source index that decides a conversion's output."""
    import xxhash

    h = xxhash.xxh3_128()
    for key, e in sorted(index.tensors.items()):
        h.update(json.dumps([key, e.dtype, list(e.shape), [[list(c.box.offsets), list(c.box.sizes), c.file,
                                                           repr(c.locator)] for c in e.chunks]]).encode())
    for key, o in sorted(index.objects.items()):
        h.update(json.dumps([key, o.file, repr(o.locator), o.nbytes]).encode())
    return h.hexdigest()
