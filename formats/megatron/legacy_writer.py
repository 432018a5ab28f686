"""Writes a Megatron-LM legacy checkpoint (``iter_*/mp_rank_*/{model_optim_rng,distrib_optim}.pt``
and ``latest_checkpointed_iteration.txt``), streaming.

Each file is a ``torch.save`` archive (:class:`formats.dcp.archive_writer.TorchFileWriter`) whose
layout the plan fixes up front: its ``data.pkl`` (the whole state dict, tensors as storages) and the
sizes of its storages. Rank 0 creates every file at its final size; tensor bytes are then written at
their offsets by any process and thread; :meth:`LegacyWriter.commit` finishes every archive (CRC-32s,
central directories) and writes the tracker file last, as Megatron-LM does: a checkpoint without
it is not complete.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from formats.dcp.archive_writer import TorchFileWriter
from formats.errors import DestinationError
from formats.fsutil import atomic_write_bytes, safe_join
from formats.manifest import Manifest
from formats.megatron.folders import TRACKER


def storage_key(rel: str, storage: int) -> str:
    """How storage ``storage`` of file ``rel`` is named in a manifest (and in the plan's)."""
    return f"{rel}:data/{storage}"


class LegacyWriter:
    """The files of one legacy checkpoint: ``files`` = ``(relative path, data.pkl, storages)``
    (a storage: its bytes, or its size when tasks fill it); ``tracker``: the tracker file's text."""

    def __init__(self, root: str | os.PathLike, files: Sequence[tuple[str, bytes, list]], tracker: str) -> None:
        self.root = Path(root)
        self._files = list(files)
        self._tracker = tracker
        self._fds: dict[int, int] = {}
        self._writers: dict[int, TorchFileWriter] = {}
        self._lock = threading.Lock()

    def prepare(self, resume: bool = False) -> None:
        """Create every file at its final size with its fixed records (idempotent); ``resume`` keeps
        the bytes already written."""
        with self._lock:
            if self._writers:
                return
            if (self.root / TRACKER).exists() and not resume:
                raise DestinationError(f"{self.root} already holds a checkpoint ({TRACKER}); write to an empty directory")
            flags = os.O_RDWR | os.O_CREAT | (0 if resume else os.O_TRUNC)
            try:
                for i, (rel, pkl, storages) in enumerate(self._files):
                    path = safe_join(self.root, rel)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fd = self._fds[i] = os.open(path, flags, 0o644)
                    writer = TorchFileWriter(fd, 0, pkl, storages)
                    os.ftruncate(fd, writer.size)
                    self._writers[i] = writer
            except BaseException:
                self._close_fds()
                raise

    def write(self, file: int, storage: int, offset: int, data: Any) -> int:
        """Write ``data`` at byte ``offset`` of a storage; its CRC-32."""
        if not self._writers:
            self.prepare(resume=True)
        return self._writers[file].write(storage, offset, data)

    def add_crc(self, file: int, storage: int, offset: int, length: int, crc: int) -> None:
        """Account for bytes another process (or an earlier run) wrote."""
        if not self._writers:
            self.prepare(resume=True)
        self._writers[file].add_crc(storage, offset, length, crc)

    def sync(self) -> None:
        for fd in self._fds.values():
            os.fsync(fd)

    def manifest(self) -> Manifest:
        """What :meth:`commit` is about to publish: each file's storages that tasks fill (a
        tensor's bytes; recorded as ``<file>:data/<i>``, ``uint8`` of its size) and where each lies
        in its file (the archive's record layout, fixed by the pickle and the storage sizes)."""
        m = Manifest()
        if not self._writers:
            self.prepare(resume=True)
        for i, (rel, _, _) in enumerate(self._files):
            for storage, begin, size in self._writers[i].filled_storages():
                key = storage_key(rel, storage)
                m.tensor(key, "uint8", (size,))
                m.extent(key, os.path.normpath(rel), begin, begin + size)
        return m

    def commit(self) -> None:
        """Finish every archive, sync, then write the tracker file (last)."""
        for writer in self._writers.values():
            writer.close()
        self.sync()
        self._close_fds()
        atomic_write_bytes(self.root / TRACKER, self._tracker.encode())

    def close(self) -> None:
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._writers.clear()
