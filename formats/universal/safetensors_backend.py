"""The universal store's safetensors backend (``--backend safetensors``): a safetensors file per chunk.

Layout (beside ``ckptconv.json`` and ``objects/``)::

    uni/tensors/<name>/<chunk id>.safetensors   one file per chunk of the tensor's grid

A tensor is chunked exactly as the zarr backend chunks it (:mod:`formats.universal.plan`: row
blocks of about ``--chunk-size``); a tensor up to that size is one file, ``0.safetensors`` (a 0-d
one ``c.safetensors``), a larger one a file per row block (``0.safetensors``, ``1.safetensors``,
...; ``<i>.<j>.safetensors`` where one row is over the chunk size). Each file holds ONE tensor:
the chunk, of its clipped shape (no padding), named by the tensor's key, with the dtype's
safetensors name (bfloat16 as ``BF16``, float8 as ``F8_E4M3`` ...), so ``safetensors.safe_open``
reads every chunk with no ckptconv and no zarr. ``ckptconv.json`` maps each chunk id to its file
(``files``) and names the tensor inside (``tensor``); the file's ``__metadata__`` repeats where the
chunk lies (``offsets``, ``shape`` of the whole tensor, as JSON lists).

Why a file per chunk (not per atom or per size-bounded group): every file is then written whole by
one task, header first, through a temp file and a rename, exactly like a zarr chunk, so torchrun
ranks, URL uploads (a file goes up as soon as it is final) and ``--resume`` (a file is there or
not) need nothing more; the header is computed from the record (pure), so a reader knows every
chunk's data offset without reading a header.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from formats.base import Box
from formats.dtypes import by_name, raw_bytes
from formats.hf import TensorSpec, build_header
from formats.universal.plan import OBJECTS_DIR, TENSORS_DIR, ArrayPlan, chunk_id
from formats.universal_meta import TensorRecord

NAME = "safetensors"
SUFFIX = ".safetensors"


def tensor_name(key: str) -> str:
    """The name of a tensor's chunks inside their files: the key ('__metadata__' is the header's)."""
    return key if key != "__metadata__" else "__metadata__#"


def chunk_file(record: TensorRecord, index: tuple[int, ...]) -> str:
    """The chunk's file, relative to the store: ``<array>/<chunk id>.safetensors``."""
    return f"{record.array}/{chunk_id(index)}{SUFFIX}"


def record_fields(plan: ArrayPlan) -> dict[str, Any]:
    """The backend's own fields of a tensor record: the chunk files and the tensor name in them."""
    files = {chunk_id(idx): f"{plan.array}/{chunk_id(idx)}{SUFFIX}" for idx, _ in plan.grid()}
    return {"files": files, "tensor": tensor_name(plan.key)}


def check_record(record: TensorRecord, key: str) -> str | None:
    """What is wrong with the backend's own fields of a record read from a store (None: fine):
    every chunk has its file, named as the writer names it (so no file lies outside the array's
    folder), and the tensor name is the one the writer gives."""
    if record.tensor != tensor_name(key):
        return f"tensor name {record.tensor!r} in its safetensors files is not {tensor_name(key)!r}"
    if record.files.keys() != record.checksums.keys():
        return f"{len(record.files)} chunk files for {len(record.checksums)} chunks"
    for cid, file in record.files.items():
        if file != f"{record.array}/{cid}{SUFFIX}":
            return f"chunk {cid} names the file {file[:200]!r}, not {record.array}/{cid}{SUFFIX}"
    return None


def file_prefix(record: TensorRecord, box: Box) -> bytes:
    """The bytes a chunk's file starts with before the chunk's data: its header."""
    return header(record, box)


def header(record: TensorRecord, box: Box) -> bytes:
    """The exact header (length prefix and JSON) of a chunk's file: a pure function of the record."""
    meta = {"format": "pt", "offsets": json.dumps(list(box.offsets)), "shape": json.dumps(list(record.shape))}
    spec = TensorSpec(record.tensor or "", record.dtype, tuple(box.sizes))
    return build_header([spec], meta)[0]


def data_offset(record: TensorRecord, box: Box) -> int:
    """Where the chunk's bytes start in its file: right after the header."""
    return len(header(record, box))


def file_size(record: TensorRecord, box: Box) -> int:
    """The size of a chunk's file: header and the chunk's bytes (no padding)."""
    return data_offset(record, box) + math.prod(box.sizes) * by_name(record.dtype).itemsize


def stored_shape(record: TensorRecord, box: Box) -> tuple[int, ...]:
    """The shape of the tensor a chunk's file holds: the chunk's own (clipped) shape."""
    return tuple(box.sizes)


def prepare(root: Path, records: Mapping[str, TensorRecord]) -> list[Path]:
    """Create the store's folders and every tensor's folder (no file yet: none written)."""
    (root / TENSORS_DIR).mkdir(parents=True, exist_ok=True)
    (root / OBJECTS_DIR).mkdir(exist_ok=True)
    for record in records.values():
        if record.files:
            (root / record.array).mkdir(exist_ok=True)
    return []


def chunk_file_parts(key: str, record: TensorRecord, box: Box, data: np.ndarray) -> tuple[list[tuple[int, memoryview]], int]:
    """One chunk's file as (offset, bytes) parts and its size: the header, then the chunk's bytes
    (C order, little-endian)."""
    if tuple(data.shape) != tuple(box.sizes):
        raise ValueError(f"{key!r}: chunk data of shape {list(data.shape)}, the chunk is {list(box.sizes)}")
    head = header(record, box)
    body = memoryview(raw_bytes(data)).cast("B")
    return [(0, memoryview(head)), (len(head), body)], len(head) + len(body)
