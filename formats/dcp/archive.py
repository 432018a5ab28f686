"""The ``torch.save`` zip archive that holds each DCP chunk, parsed without loading the data.

Each item of a ``.distcp`` file is a complete ``torch.save`` archive (``archive/data.pkl`` plus
``archive/data/<key>`` entries, STORED and uncompressed). Parsing reads the zip central directory
and ``data.pkl`` (with a restricted unpickler that never builds a tensor) to learn dtype, size,
stride, storage offset and where the raw storage bytes start. A region is then one ``pread`` of
the bytes it spans, viewed with ``as_strided`` and copied to a contiguous numpy bit array (no torch
needed; :func:`read_region` wraps it as a tensor).

All offsets here are relative to the start of the item (the archive), given a ``ReadAt``
function that reads bytes of the item; see :class:`SliceReader` and :class:`BufferReader`.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from formats.dcp.safe_pickle import resolve_torch_dtype, safe_loads
from formats.dcp.torch_globals import STORAGE_TYPE_BY_DTYPE
from formats.dtypes import by_name, from_storage_array, itemsize_of
from formats.errors import CorruptCheckpointError, UnsupportedError

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]

#: Largest ``data.pkl`` accepted inside one chunk archive (bytes).
MAX_DATA_PKL_BYTES = 64 << 20
#: Bytes read at each end of an item when parsing its zip structure (one pread for small items).
_HEAD_BYTES = 4096
_TAIL_BYTES = 4 << 10  # a tensor archive's records after its data and directory: under 2 KiB
_CRC_BLOCK = 4 << 20  # CRC passes read this much at a time (one pooled buffer per thread)
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_ZSTD = "stream.zstd"


class ReadAt(Protocol):
    """Reads ``size`` bytes at ``offset`` of one item; raises CorruptCheckpointError if short."""

    length: int

    def __call__(self, offset: int, size: int) -> bytes | bytearray: ...


class SliceReader:
    """``ReadAt`` over ``[base, base + length)`` of an open file descriptor (``os.pread``)."""

    def __init__(self, fd: Any, base: int, length: int, where: str) -> None:
        """``fd``: an OS file descriptor, or a ``formats.storage.RandomFile`` (remote reads)."""
        self.fd, self.base, self.length, self.where = fd, base, length, where

    def __call__(self, offset: int, size: int) -> bytearray:
        if offset < 0 or offset + size > self.length:
            raise CorruptCheckpointError(
                f"{self.where}: archive points outside its item (bytes {offset}..{offset + size} "
                f"of {self.length})"
            )
        buf = bytearray(size)
        self._fill(memoryview(buf), offset)
        return buf

    def read_array(self, offset: int, size: int) -> np.ndarray:
        """Like ``__call__`` into an uninitialised numpy buffer (no zero-fill pass: bulk reads)."""
        if offset < 0 or offset + size > self.length:
            return self(offset, size)  # raises the bounds error
        buf = np.empty(size, dtype=np.uint8)
        self._fill(memoryview(buf), offset)
        return buf

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the item's bytes from ``offset`` (straight into the caller's buffer)."""
        if offset < 0 or offset + len(view) > self.length:
            self(offset, len(view))  # raises the bounds error
        self._fill(view, offset)

    def _fill(self, view: memoryview, offset: int) -> None:
        size, done = len(view), 0
        local = isinstance(self.fd, int)
        while done < size:
            pos = self.base + offset + done
            n = os.preadv(self.fd, [view[done:]], pos) if local else self.fd.readinto(view[done:], pos)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"{self.where}: file ends inside the item (truncated file); re-copy it"
                )
            done += n


class BufferReader:
    """``ReadAt`` over an in-memory item (a decompressed stream)."""

    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.length, self.where = data, len(data), where

    def __call__(self, offset: int, size: int) -> bytearray:
        if offset < 0 or offset + size > self.length:
            raise CorruptCheckpointError(
                f"{self.where}: archive points outside its item (bytes {offset}..{offset + size} "
                f"of {self.length})"
            )
        return bytearray(memoryview(self.data)[offset : offset + size])


class ItemFile(io.RawIOBase):
    """A read-only seekable file object over a ``ReadAt`` (an item, or ``[base, base + length)``
    of a file through :class:`SliceReader`), serving reads near either end from memory (the zip
    directory and the first local header): what :mod:`zipfile` and torch's zip reader open."""

    def __init__(self, read: ReadAt) -> None:
        self._read, self._pos, self._len = read, 0, read.length
        if self._len <= _HEAD_BYTES + _TAIL_BYTES:
            self._blocks = [(0, read(0, self._len))]
        else:
            tail = self._len - _TAIL_BYTES
            self._blocks = [(0, read(0, _HEAD_BYTES)), (tail, read(tail, _TAIL_BYTES))]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def pread(self, offset: int, size: int) -> bytes | bytearray:
        size = max(0, min(size, self._len - offset))
        for start, block in self._blocks:
            if start <= offset and offset + size <= start + len(block):
                return block[offset - start : offset - start + size]
        return self._read(offset, size)

    def readinto(self, b: Any) -> int:
        data = self.pread(self._pos, len(b))
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


# ---------------------------------------------------------------------------------------------
# Zip structure


@dataclass(frozen=True)
class Entry:
    """One stored zip entry: where its bytes start inside the item, size and CRC-32.

    ``local`` False: ``start`` is the offset of the entry's local header, not yet read (an archive
    opened with ``lazy=True``; :func:`local_data_start` gives the data's start)."""

    name: str
    start: int
    size: int
    crc: int
    local: bool = True


def _entries(f: ItemFile, where: str, lazy: bool = False) -> dict[str, Entry]:
    try:
        infos = zipfile.ZipFile(f).infolist()
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # zipfile raises many types on damaged directories
        raise CorruptCheckpointError(
            f"{where}: not a readable torch.save archive ({exc}); the file is damaged"
        ) from None
    out = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CorruptCheckpointError(f"{where}: archive entry {info.filename} is compressed")
        if lazy and info.header_offset + info.file_size > f._len:
            raise CorruptCheckpointError(
                f"{where}: archive entry {info.filename} runs past the end of its item (truncated)")
        start = info.header_offset if lazy else entry_data_start(f, info, where)
        out[info.filename] = Entry(info.filename, start, info.file_size, info.CRC, not lazy)
    return out


def local_data_start(read: Any, length: int, entry: Entry, where: str) -> int:
    """Where the data of ``entry`` starts: itself when resolved, else after its local header (one
    ``read(offset, size)``), checked to lie inside the item of ``length`` bytes."""
    if entry.local:
        return entry.start
    head = bytes(read(entry.start, _LOCAL_HEADER.size))
    if len(head) != _LOCAL_HEADER.size:
        raise CorruptCheckpointError(f"{where}: archive entry {entry.name} is cut off")
    sig, *_, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    if sig != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{where}: bad zip local header for {entry.name}")
    start = entry.start + _LOCAL_HEADER.size + name_len + extra_len
    if start + entry.size > length:
        raise CorruptCheckpointError(f"{where}: archive entry {entry.name} runs past the end of its item (truncated)")
    return start


def entry_data_start(f: ItemFile, info: zipfile.ZipInfo, where: str) -> int:
    """Where the data of zip entry ``info`` starts in the item (after its local header)."""
    head = f.pread(info.header_offset, _LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size:
        raise CorruptCheckpointError(f"{where}: archive entry {info.filename} is cut off")
    sig, *_, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    if sig != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{where}: bad zip local header for {info.filename}")
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > f._len:
        raise CorruptCheckpointError(
            f"{where}: archive entry {info.filename} runs past the end of its item (truncated)"
        )
    return start


# ---------------------------------------------------------------------------------------------
# data.pkl: a restricted unpickler that describes the tensor instead of building it

#: Typed storage class name (module ``torch``) -> dtype name.
_TYPED_STORAGES = {cls: dtype for dtype, cls in STORAGE_TYPE_BY_DTYPE.items()}


@dataclass(frozen=True)
class _StorageType:
    dtype: str | None  # None: UntypedStorage (numel counts bytes)


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: str | None
    numel: int


@dataclass(frozen=True)
class _TensorDesc:
    storage: _StorageRef
    storage_offset: int
    size: Any
    stride: Any
    dtype: str | None


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _TensorDesc:
    return _TensorDesc(storage, offset, size, stride, getattr(storage, "dtype", None))


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any,
                dtype: Any, *rest: Any) -> _TensorDesc:
    return _TensorDesc(storage, offset, size, stride, getattr(dtype, "name", None))


def _resolve_data_pkl(module: str, name: str) -> Any:
    if module == "torch._utils" and name == "_rebuild_tensor_v2":
        return _rebuild_v2
    if module == "torch._utils" and name == "_rebuild_tensor_v3":
        return _rebuild_v3
    if module in ("torch", "torch.storage") and name == "UntypedStorage":
        return _StorageType(None)
    if module == "torch" and name in _TYPED_STORAGES:
        return _StorageType(_TYPED_STORAGES[name])
    if module == "collections" and name == "OrderedDict":
        return OrderedDict
    return resolve_torch_dtype(module, name)


def _persistent(where: str):
    def load(pid: Any) -> _StorageRef:
        ok = isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
        if not ok or not isinstance(pid[1], _StorageType) or not isinstance(pid[4], int):
            raise CorruptCheckpointError(f"{where}: unexpected storage reference {pid!r}")
        return _StorageRef(str(pid[2]), pid[1].dtype, pid[4])

    return load


# ---------------------------------------------------------------------------------------------
# The parsed archive


@dataclass(frozen=True)
class ArchiveTensor:
    """A chunk's tensor as stored: dtype, size, stride and storage offset (elements), and the
    raw storage bytes ``[data_start, data_start + data_length)`` inside the item, with their CRC-32.
    """

    dtype: str
    size: Shape
    stride: Shape
    storage_offset: int
    storage_numel: int
    data_start: int
    data_length: int
    data_crc: int

    @property
    def itemsize(self) -> int:
        return itemsize_of(self.dtype)


def _ints(value: Any, what: str, where: str) -> Shape:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise CorruptCheckpointError(f"{where}: bad tensor {what} {value!r} in data.pkl")
    return tuple(value)


def _check_byteorder(f: ItemFile, entries: dict[str, Entry], prefix: str, where: str) -> None:
    e = entries.get(prefix + "byteorder")
    if e is not None and e.size <= 16:
        order = bytes(f.pread(e.start, e.size)).decode("ascii", "replace")
        if order == "big":
            raise UnsupportedError(f"{where}: big-endian archive; only little-endian is supported")
        if order != "little":
            raise CorruptCheckpointError(f"{where}: damaged archive (byte order {order!r})")


def _find_data_pkl(entries: dict[str, Entry], where: str) -> tuple[str, Entry]:
    found = [e for n, e in entries.items() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(found) != 1:
        raise CorruptCheckpointError(f"{where}: archive has no single <name>/data.pkl entry")
    return found[0].name[: -len("data.pkl")], found[0]


_DATA_PKL_CACHE: dict[bytes, Any] = {}
_DATA_PKL_CACHE_ENTRIES = 4096


def _load_data_pkl(data: bytes, where: str) -> Any:
    """The (immutable) description ``data.pkl`` unpickles to, memoized by its bytes: the chunks
    of same-shaped tensors share one ``data.pkl``, and the restricted unpickler is slow."""
    desc = _DATA_PKL_CACHE.get(data)
    if desc is None:
        desc = safe_loads(data, f"{where} (data.pkl)", _resolve_data_pkl, _persistent(where), scan=True)
        if len(_DATA_PKL_CACHE) >= _DATA_PKL_CACHE_ENTRIES:
            _DATA_PKL_CACHE.clear()
        _DATA_PKL_CACHE[data] = desc
    return desc


def open_archive(read: ReadAt, where: str, lazy: bool = False) -> tuple[dict[str, Entry], str, bytes]:
    """The stored entries of any ``torch.save`` archive read by ``read``, its record prefix
    (``"<name>/"``) and its ``data.pkl`` bytes (nothing unpickled; big-endian archives refused).

    ``lazy``: read only the zip directory and the local headers of ``data.pkl`` and
    ``byteorder``; the other entries' data starts are left to :func:`local_data_start` (an
    archive of thousands of storages, opened by the thousand, is then a few reads)."""
    f = ItemFile(read)
    if bytes(f.pread(0, 4)) != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{where}: not a torch.save zip archive (damaged, or saved with "
                                     "_use_new_zipfile_serialization=False)")
    entries = _entries(f, where, lazy)
    if lazy:
        for name, e in entries.items():
            if name.endswith(("/data.pkl", "/byteorder")):
                entries[name] = Entry(name, local_data_start(f.pread, f._len, e, where), e.size, e.crc)
    prefix, pkl = _find_data_pkl(entries, where)
    if pkl.size > MAX_DATA_PKL_BYTES:
        raise CorruptCheckpointError(f"{where}: data.pkl is {pkl.size} bytes; too large to be checkpoint metadata")
    _check_byteorder(f, entries, prefix, where)
    return entries, prefix, bytes(f.pread(pkl.start, pkl.size))


#: Globals of a tensor inside any ``data.pkl``: the inert stand-ins :func:`parse_tensor_archive`
#: uses (tensors become descriptions, never tensors).
resolve_tensor_global = _resolve_data_pkl
storage_loader = _persistent
TensorDesc = _TensorDesc


def describe_tensor(desc: Any, entries: dict[str, Entry], prefix: str, where: str) -> ArchiveTensor:
    """The :class:`ArchiveTensor` of one tensor description found in an archive's ``data.pkl``
    (dtype and size as pickled; storage bounds checked)."""
    if not isinstance(desc, _TensorDesc) or not isinstance(desc.storage, _StorageRef) or desc.dtype is None:
        raise CorruptCheckpointError(f"{where}: not a plain tensor")
    return _describe(desc, entries, prefix, where, desc.dtype, _ints(desc.size, "size", where))


def parse_tensor_archive(read: ReadAt, where: str, dtype: str, size: Shape) -> ArchiveTensor:
    """Parse the chunk archive read by ``read`` and check it holds a ``dtype`` tensor of ``size``.

    ``where`` names the file and key in error messages.
    """
    f = ItemFile(read)
    if bytes(f.pread(0, 4)) != b"PK\x03\x04":
        raise CorruptCheckpointError(
            f"{where}: item does not start with a torch.save zip archive (damaged file, or a "
            "checkpoint written with another serialization format)"
        )
    entries = _entries(f, where)
    prefix, pkl = _find_data_pkl(entries, where)
    if pkl.size > MAX_DATA_PKL_BYTES:
        raise CorruptCheckpointError(f"{where}: data.pkl is {pkl.size} bytes; not a tensor chunk")
    _check_byteorder(f, entries, prefix, where)
    desc = _load_data_pkl(bytes(f.pread(pkl.start, pkl.size)), where)
    if not isinstance(desc, _TensorDesc) or not isinstance(desc.storage, _StorageRef):
        raise CorruptCheckpointError(f"{where}: chunk archive does not hold a plain tensor")
    return _describe(desc, entries, prefix, where, dtype, size)


def _describe(desc: _TensorDesc, entries: dict[str, Entry], prefix: str, where: str,
              dtype: str, size: Shape) -> ArchiveTensor:
    if desc.dtype != dtype:
        raise CorruptCheckpointError(f"{where}: chunk holds {desc.dtype}, metadata says {dtype}")
    got_size = _ints(desc.size, "size", where)
    stride = _ints(desc.stride, "stride", where)
    if got_size != tuple(size) or len(stride) != len(got_size):
        raise CorruptCheckpointError(
            f"{where}: chunk has shape {list(got_size)}, metadata says {list(size)}"
        )
    offset = desc.storage_offset
    if not isinstance(offset, int) or offset < 0:
        raise CorruptCheckpointError(f"{where}: bad storage offset {offset!r}")
    entry = entries.get(f"{prefix}data/{desc.storage.key}")
    if entry is None:
        raise CorruptCheckpointError(f"{where}: archive lacks storage {desc.storage.key!r}")
    itemsize = itemsize_of(dtype)
    nbytes = desc.storage.numel * (1 if desc.storage.dtype is None else itemsize)
    if entry.size != nbytes or nbytes % itemsize:
        raise CorruptCheckpointError(
            f"{where}: storage holds {entry.size} bytes, expected {nbytes} (damaged archive)"
        )
    numel_storage = nbytes // itemsize
    if 0 not in got_size:
        last = offset + sum((s - 1) * st for s, st in zip(got_size, stride))
        if last >= numel_storage:
            raise CorruptCheckpointError(f"{where}: tensor view runs past its storage")
    return ArchiveTensor(dtype, got_size, stride, offset, numel_storage, entry.start, entry.size,
                         entry.crc)


# ---------------------------------------------------------------------------------------------
# Reading regions, CRC checks, transforms


def _check_region(at: ArchiveTensor, offsets: Shape, sizes: Shape) -> None:
    if len(sizes) != len(at.size) or len(offsets) != len(at.size) or any(
        o < 0 or o + s > d for o, s, d in zip(offsets, sizes, at.size)
    ):
        raise ValueError(f"region {offsets}+{sizes} is not inside the chunk {at.size}")


def _is_c_contiguous(sizes: Shape, stride: Shape) -> bool:
    """True when a view of ``sizes`` with ``stride`` (elements) is one dense C-order run."""
    expected = 1
    for s, st in zip(reversed(sizes), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


#: ``seen(offset, data)``: told the storage bytes a region read read (``offset`` into the storage),
#: for the integrity check (:class:`formats.integrity.CRCRanges`).
Seen = Callable[[int, memoryview], None]


def _stored_view(at: ArchiveTensor, read: ReadAt, offsets: Shape, sizes: Shape,
                 seen: Seen | None = None) -> np.ndarray:
    """The non-empty box as a numpy view (storage dtype, stored strides) over a new buffer holding
    only the bytes between its first and last element."""
    npdt = by_name(at.dtype).numpy_dtype
    isz = npdt.itemsize
    first = at.storage_offset + sum(o * st for o, st in zip(offsets, at.stride))
    span = 1 + sum((s - 1) * st for s, st in zip(sizes, at.stride))
    bulk = getattr(read, "read_array", None)
    start, nbytes = at.data_start + first * isz, span * isz
    buf = bulk(start, nbytes) if bulk else np.frombuffer(read(start, nbytes), dtype=np.uint8)
    if seen is not None:
        seen(first * isz, memoryview(buf))
    flat = buf.view(npdt)
    if span == math.prod(sizes) and _is_c_contiguous(sizes, at.stride):
        return flat.reshape(sizes)
    strides = tuple(st * isz for st in at.stride)
    return np.lib.stride_tricks.as_strided(flat, shape=sizes, strides=strides, writeable=False)


def read_region_array(at: ArchiveTensor, read: ReadAt, offsets: Shape, sizes: Shape,
                      seen: Seen | None = None) -> np.ndarray:
    """A new C-contiguous bit array (the storage dtype of :mod:`formats.dtypes`: bfloat16 as
    uint16, float8 as uint8) with the box (``offsets``, ``sizes``) in chunk-local coordinates.

    Reads only the bytes between the box's first and last element (stored strides honoured);
    ``seen`` is told them.
    """
    _check_region(at, offsets, sizes)
    if 0 in sizes:
        return np.empty(sizes, dtype=by_name(at.dtype).numpy_dtype)
    view = _stored_view(at, read, offsets, sizes, seen)
    return view if view.flags.c_contiguous and view.flags.writeable else np.ascontiguousarray(view)


def read_region(at: ArchiveTensor, read: ReadAt, offsets: Shape, sizes: Shape) -> torch.Tensor:
    """:func:`read_region_array` as a torch tensor of the chunk's dtype (imports torch)."""
    return as_tensor(read_region_array(at, read, offsets, sizes), at.dtype)


def as_tensor(data: np.ndarray, dtype: str) -> torch.Tensor:
    """A bit array (storage dtype) as a torch tensor of ``dtype`` (imports torch)."""
    if not data.size:  # numpy gives empty arrays zero strides; torch's own are C strides
        import torch

        return torch.empty(data.shape, dtype=by_name(dtype).torch_dtype)
    return from_storage_array(data, dtype)


def read_region_into(at: ArchiveTensor, read: ReadAt, offsets: Shape, sizes: Shape, out: memoryview,
                     seen: Seen | None = None) -> None:
    """Fill ``out`` (writable bytes, exactly the box's size) with the box (``offsets``, ``sizes``,
    chunk-local) in C order: read straight into ``out`` when the box is one dense run of the
    storage, else gather the strided elements into it. ``seen`` is told the storage bytes read."""
    _check_region(at, offsets, sizes)
    out = memoryview(out).cast("B")
    isz = at.itemsize
    numel = math.prod(sizes)
    if out.nbytes != numel * isz:
        raise ValueError(f"buffer of {out.nbytes} bytes for a region of {numel * isz}")
    if not numel:
        return
    if _is_c_contiguous(sizes, at.stride):
        first = at.storage_offset + sum(o * st for o, st in zip(offsets, at.stride))
        fill = getattr(read, "read_into", None)
        if fill is not None:
            fill(at.data_start + first * isz, out)
        else:
            out[:] = memoryview(read(at.data_start + first * isz, numel * isz)).cast("B")
        if seen is not None:
            seen(first * isz, out)
        return
    view = _stored_view(at, read, offsets, sizes, seen)
    np.copyto(np.frombuffer(out, dtype=np.uint8).view(view.dtype).reshape(sizes), view)


def stores_exactly(at: ArchiveTensor) -> bool:
    """True when the chunk's storage bytes are exactly the chunk in C order (no storage offset,
    no extra storage, dense C strides): a read of the whole chunk then reads exactly the bytes the
    zip CRC-32 covers, so it can be checked on them without another read."""
    numel = math.prod(at.size)
    return (at.storage_offset == 0 and at.data_length == numel * at.itemsize
            and (numel == 0 or _is_c_contiguous(at.size, at.stride)))


def check_crc(at: ArchiveTensor, crc: int, where: str) -> None:
    """Compare the CRC-32 of the chunk's storage bytes with the one its zip entry records."""
    if crc != at.data_crc:
        raise CorruptCheckpointError(
            f"{where}: CRC-32 mismatch in the chunk data ({crc:08x} != {at.data_crc:08x}); the bytes are "
            "damaged: restore the file from a good copy (--no-verify-source copies them anyway)"
        )


def storage_crc(at: ArchiveTensor, read: ReadAt) -> int:
    """The CRC-32 of the chunk's storage bytes, read in bounded blocks (one pooled buffer)."""
    from formats.fsutil import pooled_buffer
    from formats.integrity import crc32

    data = getattr(read, "data", None)
    if data is not None:  # a decoded item in memory: no copy
        return crc32(memoryview(data)[at.data_start: at.data_start + at.data_length])
    crc, pos, end = 0, at.data_start, at.data_start + at.data_length
    fill = getattr(read, "read_into", None)
    while pos < end:
        n = min(_CRC_BLOCK, end - pos)
        if fill is not None:
            block = memoryview(pooled_buffer("crc", n))
            fill(pos, block)
        else:
            block = read(pos, n)
        crc = crc32(block, crc)
        pos += n
    return crc


def storage_reader(at: ArchiveTensor, read: ReadAt) -> Callable[[int, memoryview], None]:
    """``read_into(offset, view)`` over the chunk's storage bytes (``offset`` into the storage)."""
    fill = getattr(read, "read_into", None)
    if fill is not None:
        return lambda offset, view: fill(at.data_start + offset, view)

    def copy(offset: int, view: memoryview) -> None:
        view[:] = memoryview(read(at.data_start + offset, len(view))).cast("B")

    return copy


def verify_crc(at: ArchiveTensor, read: ReadAt, where: str) -> None:
    """Check the zip CRC-32 of the chunk's storage bytes (``torch.load`` never does)."""
    check_crc(at, storage_crc(at, read), where)


def check_transforms(transforms: Sequence[str], where: str) -> None:
    """Refuse stream transforms other than ``stream.zstd/1`` (UnsupportedError)."""
    for desc in transforms:
        name, _, version = desc.partition("/")
        if name != _ZSTD or version.partition(".")[0] != "1":
            raise UnsupportedError(
                f"{where}: unsupported stream transform {desc!r} (supported: stream.zstd/1)"
            )


def decode_item(data: bytes, transforms: Sequence[str], where: str, limit: int) -> bytes:
    """Undo the item's stream transforms (in the listed order), refusing output over ``limit``."""
    check_transforms(transforms, where)
    for _ in transforms:
        data = _unzstd(data, where, limit)
    return data


def _unzstd(data: bytes, where: str, limit: int) -> bytes:
    import zstandard

    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
        with reader:
            while chunk := reader.read(1 << 20):
                out += chunk
                if len(out) > limit:
                    raise CorruptCheckpointError(
                        f"{where}: zstd stream expands past {limit} bytes (damaged or hostile)"
                    )
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: damaged zstd stream ({exc})") from None
    return bytes(out)
