"""The universal store's layout, planned before any I/O: array names and chunk grids (pure).

:func:`plan_store` maps every tensor (key, dtype, shape) and the chunk size to its array name and
regular chunk grid. The dry run and the real run take their copy tasks from the same plan, and the
writer (:class:`formats.universal.store.UniversalWriter`) lays the store out from it; nothing here
touches a file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import quote

import xxhash

from formats.base import Box
from formats.dtypes import by_name

TENSORS_DIR = "tensors"
OBJECTS_DIR = "objects"
#: The store's backends: where the chunks' bytes go (``formats.universal.zarr_backend`` and
#: ``formats.universal.safetensors_backend``); the metadata, objects and checksums are the same.
BACKENDS = ("zarr", "safetensors")
DEFAULT_BACKEND = "zarr"


def array_name(key: str) -> str:
    """The array name for a tensor key: the key, percent-encoded where it is unsafe.

    '/' and control characters are encoded, a leading '.' or '__' too, so that a key can never
    name a path outside ``tensors/`` or a name zarr reserves; overlong names get a hash suffix.
    """
    if not key:
        return "%00empty"
    name = quote(key, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if name.startswith("__"):
        name = "%5F" + name[1:]
    if name.lower() == "zarr.json":  # the group's own metadata file lives beside the arrays
        name = "zarr%2Ejson"
    if len(name.encode()) > 200:
        name = name[:160] + "~" + xxhash.xxh3_64_hexdigest(key.encode())
    return name


def chunk_shape_for(shape: tuple[int, ...], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """A chunk shape of about ``target_bytes``: split the outermost dims first, balanced.

    Chunks are row blocks (whole trailing dims) whenever one row fits the target, so reads for
    any target mesh touch few chunks; the blocks are balanced so the last one is not a sliver.
    """
    chunk = [max(1, s) for s in shape]
    for d in range(len(shape)):
        inner = math.prod(chunk[d + 1 :]) * itemsize
        if inner * chunk[d] <= target_bytes:
            break
        if inner <= target_bytes:
            per = max(1, target_bytes // inner)
            n = math.ceil(shape[d] / per)
            chunk[d] = math.ceil(shape[d] / n)
            break
        chunk[d] = 1
    return tuple(chunk)


def chunk_grid(shape: tuple[int, ...], chunk: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], Box]]:
    """Every (chunk index, global box clipped to the shape) of a regular grid, in C order."""
    counts = [math.ceil(s / c) if s else 0 for s, c in zip(shape, chunk)]
    for flat in range(math.prod(counts)):
        idx = []
        for n in reversed(counts):
            idx.append(flat % n)
            flat //= n
        idx = tuple(reversed(idx))
        offsets = tuple(i * c for i, c in zip(idx, chunk))
        sizes = tuple(min(c, s - o) for c, s, o in zip(chunk, shape, offsets))
        yield idx, Box(offsets, sizes)


def chunk_id(index: tuple[int, ...]) -> str:
    """The checksum key of a chunk: indices joined by '.', 'c' for a 0-d array."""
    return ".".join(map(str, index)) if index else "c"


@dataclass(frozen=True)
class ArrayPlan:
    """One tensor's array in the store: its path under the store, dtype, shape and chunk shape."""

    key: str
    array: str  # "tensors/<name>"
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]

    def grid(self) -> list[tuple[tuple[int, ...], Box]]:
        """The (chunk index, box) pairs of the array, in C order; each is one write task."""
        return list(chunk_grid(self.shape, self.chunk_shape))


@dataclass(frozen=True)
class StorePlan:
    """The layout of a whole store: the backend, the chunk size, and every tensor's array."""

    backend: str
    chunk_bytes: int
    arrays: Mapping[str, ArrayPlan]


def plan_array(key: str, dtype: str, shape: tuple[int, ...], chunk_bytes: int, taken: set[str]) -> ArrayPlan:
    """The array of one tensor; ``taken`` (array names already used) gets its name added. Two
    keys that encode to one name are told apart by a hash suffix."""
    name = array_name(key)
    if name in taken:
        name = f"{name}~{xxhash.xxh3_64_hexdigest(key.encode())}"
    taken.add(name)
    shape = tuple(shape)
    return ArrayPlan(key, f"{TENSORS_DIR}/{name}", by_name(dtype).name, shape,
                     chunk_shape_for(shape, by_name(dtype).itemsize, chunk_bytes))


def plan_store(tensors: Iterable[tuple[str, str, tuple[int, ...]]], chunk_bytes: int,
               backend: str = DEFAULT_BACKEND) -> StorePlan:
    """The store's layout for ``tensors`` ((key, torch dtype name, shape), in store order)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown universal store backend {backend!r} (one of {', '.join(BACKENDS)})")
    taken: set[str] = set()
    arrays = {key: plan_array(key, dtype, shape, chunk_bytes, taken) for key, dtype, shape in tensors}
    return StorePlan(backend, chunk_bytes, arrays)
