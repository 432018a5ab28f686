"""Read-ahead of the source: the kernel reads the chunks of the next tasks while the workers copy.

A worker reads its task's source chunks, checks and writes them, and reads again: the disk idles
while it checks and writes, and a chunk read in parts (a reshard reads a DCP item in two, a
from-universal reads each store chunk file once per target rank) is read from the disk in
several small reads. A :class:`Prefetcher` thread walks the tasks in the order the workers take
them and asks the reader to start reading each task's source chunks (``reader.prefetch``: a
``posix_fadvise(WILLNEED)`` of the chunk's bytes, a hint that never waits for the disk), staying at
most ``ahead`` bytes (of target data) in front of the tasks started. The page cache holds what it
read, not this process: peak RSS is unchanged. Readers without ``prefetch`` (remote stores, mapped
views) get none.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from converter.plan.copy_tasks import PlannedPieces, WriteTask
from formats.base import ChunkRef
from formats.dtypes import by_name

#: Source chunks remembered as already hinted (consecutive tasks often read the same chunk).
_RECENT = 256


def task_source_chunks(task: WriteTask) -> Iterable[ChunkRef]:
    """The source chunks ``task`` reads (one index query for planned pieces)."""
    pieces = task.pieces
    if isinstance(pieces, PlannedPieces):
        return pieces.source_chunks()
    return [c.src for piece in pieces for c in piece.copies]


class Prefetcher:
    """Hints the reader to read ahead the source chunks of ``tasks`` (in order), at most ``ahead``
    bytes of task data before the tasks :meth:`started` so far. :meth:`stop` ends it."""

    def __init__(self, reader: Any, tasks: Sequence[WriteTask], ahead: int, largest: int = 1 << 62) -> None:
        self._hint = reader.prefetch
        self._tasks = tasks
        self._ahead = ahead
        self._largest = largest
        self._started = 0
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ckptconv-prefetch", daemon=True)
        self.hinted = 0  # chunks hinted (tests)

    @classmethod
    def start_for(cls, reader: Any, tasks: Sequence[WriteTask], ahead: int,
                  largest: int = 1 << 62) -> Prefetcher | None:
        """A running prefetcher, or None when the reader has no ``prefetch`` or ``ahead`` is 0.
        Chunks over ``largest`` bytes are not hinted (a large read is efficient on its own)."""
        if ahead <= 0 or not tasks or not callable(getattr(reader, "prefetch", None)):
            return None
        p = cls(reader, tasks, ahead, largest)
        p._thread.start()
        return p

    def started(self, task: WriteTask) -> None:
        """A worker took ``task``: the window moves on."""
        with self._cond:
            self._started += task.nbytes
            self._cond.notify()

    def stop(self) -> None:
        """End the thread (it finishes the hint under way)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        recent: deque[int] = deque()
        seen: set[int] = set()
        issued = 0
        for task in self._tasks:
            with self._cond:
                while not self._stopped and issued - self._started >= self._ahead:
                    self._cond.wait()
                if self._stopped:
                    return
            try:
                chunks = task_source_chunks(task)
                itemsize = by_name(task.dtype).itemsize
                for chunk in chunks:
                    if id(chunk) in seen or chunk.box.numel * itemsize > self._largest:
                        continue
                    seen.add(id(chunk))
                    recent.append(id(chunk))
                    if len(recent) > _RECENT:
                        seen.discard(recent.popleft())
                    self._hint(task.key, chunk)
                    self.hinted += 1
            except Exception:  # noqa: BLE001 - a hint only: the workers' own reads report any error
                pass
            issued += task.nbytes
