"""The universal store's zarr backend (the default): one Zarr v3 array per tensor, a file per chunk.

Layout (beside ``ckptconv.json`` and ``objects/``)::

    uni/zarr.json                      group
    uni/tensors/zarr.json              group
    uni/tensors/<name>/zarr.json       one array per tensor key (name = encoded key)
    uni/tensors/<name>/c/<i>/<j>...    chunks: raw little-endian C-order bytes, no codec

Arrays use the ``bytes`` codec only (no compression), so every chunk file is the chunk's raw bytes
(edge chunks padded to the full chunk shape with zeros, as zarr does); stock zarr (3.x) opens every
array. bfloat16 and float8 are stored as uint16 / uint8 bit patterns (see ``formats.dtypes``); the
array attributes ``torch_dtype`` and ``key`` name the original dtype and key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from formats.base import Box
from formats.dtypes import by_name
from formats.universal.plan import OBJECTS_DIR, TENSORS_DIR, ArrayPlan
from formats.universal_meta import TensorRecord

NAME = "zarr"
GROUP_JSON = {"zarr_format": 3, "node_type": "group", "attributes": {}}


def chunk_file(record: TensorRecord, index: tuple[int, ...]) -> str:
    """The chunk's file, relative to the store: ``<array>/c/<i>/<j>...``."""
    return "/".join([record.array, "c", *map(str, index)])


def array_json(record: TensorRecord, key: str) -> dict[str, Any]:
    """The array's ``zarr.json`` document."""
    d = by_name(record.dtype)
    codec: dict[str, Any] = {"name": "bytes"}
    if d.numpy_dtype.itemsize > 1:
        codec["configuration"] = {"endian": "little"}
    fill: Any = False if d.storage == "bool" else 0
    if d.storage.startswith("complex"):
        fill = [0.0, 0.0]
    return {
        "shape": list(record.shape),
        "data_type": d.storage,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(record.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": [codec],
        "attributes": {"torch_dtype": record.dtype, "key": key},
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }


def prepare(root: Path, records: Mapping[str, TensorRecord]) -> list[Path]:
    """Create the groups and every array's ``zarr.json`` (metadata only, no chunk); the files
    written."""
    (root / TENSORS_DIR).mkdir(parents=True, exist_ok=True)
    (root / OBJECTS_DIR).mkdir(exist_ok=True)
    written = []
    for d in (root, root / TENSORS_DIR):
        (d / "zarr.json").write_text(json.dumps(GROUP_JSON))
        written.append(d / "zarr.json")
    for key, record in records.items():
        array_dir = root / record.array
        array_dir.mkdir(parents=True, exist_ok=True)
        (array_dir / "zarr.json").write_text(json.dumps(array_json(record, key)))  # C encoder: no indent
        written.append(array_dir / "zarr.json")
    return written


def _padded_bytes(data: np.ndarray, chunk: tuple[int, ...]) -> tuple[memoryview, int]:
    """The bytes to store for one chunk and the full chunk size (edge chunks padded with zeros)."""
    full = math.prod(chunk) * data.itemsize
    if data.shape == chunk or data.ndim == 0:
        return memoryview(data).cast("B"), full
    if data.shape[1:] == chunk[1:]:  # only dim 0 is short: the data is a prefix of the chunk
        return memoryview(np.ascontiguousarray(data)).cast("B"), full
    padded = np.zeros(chunk, dtype=data.dtype)
    padded[tuple(slice(0, s) for s in data.shape)] = data
    return memoryview(padded).cast("B"), full


def chunk_file_parts(key: str, record: TensorRecord, box: Box, data: np.ndarray) -> tuple[list[tuple[int, memoryview]], int]:
    """One chunk file's bytes as (offset, bytes) parts and the file's size: the chunk at 0, edge
    chunks padded to the full chunk shape (zeros past the data: the size extends the file)."""
    payload, full = _padded_bytes(data, record.chunk_shape)
    return [(0, payload)], full


def file_size(record: TensorRecord, box: Box) -> int:
    """The size of a chunk file: every one is the full chunk (edge chunks are padded)."""
    return math.prod(record.chunk_shape) * by_name(record.dtype).itemsize


def file_prefix(record: TensorRecord, box: Box) -> bytes:
    """The bytes a chunk file starts with before the chunk's data: none."""
    return b""


def data_offset(record: TensorRecord, box: Box) -> int:
    """Where the chunk's bytes start in its file: at 0 (no header)."""
    return 0


def stored_shape(record: TensorRecord, box: Box) -> tuple[int, ...]:
    """The shape of the array a chunk file holds (the full chunk shape, padding included)."""
    return record.chunk_shape


def record_fields(plan: ArrayPlan) -> dict[str, Any]:
    """The backend's own fields of a tensor record: none."""
    return {}


def check_record(record: TensorRecord, key: str) -> str | None:
    """What is wrong with the backend's own fields of a record read from a store (None: fine)."""
    if record.files or record.tensor is not None:
        return "safetensors fields (files, tensor) in a zarr store"
    return None
