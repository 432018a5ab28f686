"""The executor's sinks, one per output format: each turns a write task's pieces into bytes in
the output (:class:`converter.run.executor.TaskSink`: ``open(task)`` -> a piece writer whose
``close`` may return what the journal keeps for the task, e.g. a chunk's checksum)."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from converter.plan.copy_tasks import Piece, WriteTask, target_nbytes
from formats.dtypes import cast_bits


class ChunkSink:
    """Universal store: each task (one zarr chunk, one piece) written whole; ``close`` returns the
    chunk's checksum."""

    def __init__(self, writer: Any) -> None:  # formats.universal.UniversalWriter
        self.writer = writer

    def open(self, task: WriteTask) -> ChunkSink._One:
        return ChunkSink._One(self.writer, task)

    def sync(self) -> None:
        self.writer.sync()

    class _One:
        def __init__(self, writer: Any, task: WriteTask) -> None:
            self.writer, self.task = writer, task

        def write(self, piece: Piece, data: np.ndarray) -> None:
            self.checksum = self.writer.write_chunk(self.task.key, self.task.target, data)

        def close(self) -> str:
            return self.checksum


class RankChunkSink:
    """DCP: each task's pieces streamed into its rank file's archive, cast to the target dtype;
    counts the bytes of the chunks it closed (``written``, in the target dtype)."""

    def __init__(self, writer: Any) -> None:  # formats.dcp.writer.DCPWriter
        self.writer = writer
        self.written = 0
        self._lock = threading.Lock()

    def open(self, task: WriteTask) -> RankChunkSink._One:
        return RankChunkSink._One(self, self.writer.open_chunk(task.target), task)

    def sync(self) -> None:
        self.writer.sync()

    class _One:
        def __init__(self, owner: RankChunkSink, sink: Any, task: WriteTask) -> None:
            self.owner, self.sink, self.task = owner, sink, task
            self.src_dtype, self.dtype = task.dtype, task.target.dtype

        def write(self, piece: Piece, data: np.ndarray) -> None:
            self.sink.write(cast_bits(data, self.src_dtype, self.dtype))

        def close(self) -> None:
            self.sink.close()
            with self.owner._lock:
                self.owner.written += target_nbytes(self.task)
            return None


class HFSink:
    """HF safetensors: pwrite each piece at its offset in the tensor's file, cast to ``dtypes[key]``."""

    def __init__(self, writer: Any, dtypes: Mapping[str, str]) -> None:  # formats.hf.HFWriter
        self.writer, self.dtypes = writer, dtypes

    def open(self, task: WriteTask) -> HFSink._One:
        return HFSink._One(self.writer, task, self.dtypes[task.key])

    def sync(self) -> None:
        self.writer.sync()

    class _One:
        def __init__(self, writer: Any, task: WriteTask, dtype: str) -> None:
            self.writer, self.task, self.dtype = writer, task, dtype
            shape = task.box.sizes
            self.strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]

        def write(self, piece: Piece, data: np.ndarray) -> None:
            local = piece.box.relative_to(self.task.box)
            offset = sum(o * s for o, s in zip(local.offsets, self.strides))
            self.writer.write_tensor(self.task.key, offset, cast_bits(data, self.task.dtype, self.dtype))

        def close(self) -> None:
            pass
