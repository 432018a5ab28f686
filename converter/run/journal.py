"""The resume journal: which write tasks of a conversion are durably finished.

A conversion writes ``<dst>/.ckptconv-journal.jsonl``: a header line naming the operation and a
fingerprint of its inputs and plan, then one line per finished task. Entries are appended in
batches: the sink's data is fsynced first, then the lines are appended and the journal fsynced,
so every journaled task is on disk. Tasks finished after the last batch are simply redone.
The journal is removed once the output is committed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from converter import knobs
from converter.plan.copy_tasks import WriteTask
from formats.errors import DestinationError

JOURNAL_NAME = ".ckptconv-journal.jsonl"


def task_id(task: WriteTask) -> str:
    """A stable id of a task: its key and target box (unique within a conversion), and the tag of
    its target when it has one (a target kind whose boxes can repeat another's: the consolidated
    files of ``--format dcp-safetensors``; a ``--format megatron-legacy`` target's TP-replicated
    tensors, written into every rank's file)."""
    ident = [task.key, list(task.box.offsets), list(task.box.sizes)]
    tag = getattr(task.target, "journal_tag", None)
    if tag:
        ident.append(tag)
    return json.dumps(ident, separators=(",", ":"))


class Journal:
    """Append-only record of finished tasks for one destination."""

    def __init__(self, dst: Path, header: dict[str, Any], done: dict[str, Any] | None = None) -> None:
        self.path = Path(dst) / JOURNAL_NAME
        self.header = header
        self.done: dict[str, Any] = dict(done or {})
        self._pending: list[tuple[str, Any]] = []
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
        """Note a finished task; it becomes durable at the next :meth:`flush`."""
        with self._lock:
            self._pending.append((task_id(task), info))

    def flush(self, make_durable: Callable[[], None], force: bool = False) -> None:
        """fsync the data (``make_durable``), then append the pending entries durably."""
        with self._lock:
            if not self._pending or (not force and time.monotonic() - self._last_flush < knobs.JOURNAL_FLUSH_SECONDS):
                return
            pending, self._pending = self._pending, []
        make_durable()
        self._append([{"t": t, "i": i} for t, i in pending])
        with self._lock:
            self.done.update(pending)
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
