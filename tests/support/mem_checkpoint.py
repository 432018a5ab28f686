"""A checkpoint held in memory for plan-level tests: tensors (each split into row chunks, a
stand-in for a sharded save) and non-tensor entries (``torch.save`` bytes, as DCP stores them),
with their object paths; and :func:`read_all`, every tensor and object of a reader (or view), whole."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from formats.base import Box, CheckpointIndex, ChunkRef, ObjectEntry, TensorEntry, TensorReader, full_box, read_box
from formats.dtypes import from_storage_array


class MemCheckpoint(TensorReader):
    """``tensors``: key -> (tensor, path); ``objects``: key -> (value, path); ``rows``: rows per
    chunk (the chunks carry rank ``r`` of their position, as a DCP save's do). ``layer_chunks``:
    the keys saved one dim-0 slice per chunk (Megatron's layer-stacked tensors)."""

    def __init__(self, tensors: dict[str, tuple[torch.Tensor, tuple]], objects: dict[str, tuple[Any, tuple]] | None = None,
                 rows: int = 3, layer_chunks: tuple[str, ...] = ()) -> None:
        self.arrays = {k: t.detach().clone() for k, (t, _) in tensors.items()}
        entries = {}
        for k, (t, path) in tensors.items():
            step = 1 if k in layer_chunks else rows
            if t.ndim == 0:
                chunks = (ChunkRef(full_box(()), "f", k, 0),)
            else:
                chunks = tuple(ChunkRef(Box((r, *(0 for _ in t.shape[1:])), (min(step, t.shape[0] - r), *t.shape[1:])),
                                        f"f{i}", k, i) for i, r in enumerate(range(0, t.shape[0], step)))
            entries[k] = TensorEntry(k, str(t.dtype).removeprefix("torch."), tuple(t.shape), chunks, tuple(path))
        self.data: dict[str, bytes] = {}
        objs = {}
        for k, (value, path) in (objects or {}).items():
            buf = io.BytesIO()
            torch.save(value, buf)
            self.data[k] = buf.getvalue()
            objs[k] = ObjectEntry(k, tuple(path), "o", k, len(self.data[k]))
        self._index = CheckpointIndex("dcp", "/mem", entries, objs)

    def index(self) -> CheckpointIndex:
        return self._index

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        assert chunk.box.contains(region), (key, chunk.box, region)
        return self.arrays[key][region.slices()].clone()

    def read_object_bytes(self, key: str) -> bytes:
        return self.data[key]

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        return torch.load(io.BytesIO(self.data[key]), weights_only=True)

    def close(self) -> None:
        pass


def read_all(reader: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor (read whole through the reader's own region reads) and object value of ``reader``."""
    index = reader.index()
    tensors = {}
    for key, entry in index.tensors.items():
        bits = read_box(reader, entry, full_box(entry.shape)) if entry.shape else _scalar(reader, entry)
        tensors[key] = from_storage_array(np.ascontiguousarray(bits).reshape(entry.shape), entry.dtype)
    objects = {key: reader.load_object(key) for key in index.objects}
    return tensors, objects


def _scalar(reader: Any, entry: TensorEntry) -> np.ndarray:
    from formats.dtypes import by_name

    out = np.empty((), dtype=by_name(entry.dtype).numpy_dtype)
    reader.read_region_into(entry.key, entry.chunks[0], full_box(()), memoryview(out.reshape(-1).view(np.uint8)))
    return out
