"""Streaming writer of the ``torch.save`` zip archive that holds one DCP tensor chunk.

``torch.save(t, f)`` (torch 2.13, a file object, so the archive folder is ``archive/``) writes, in
this order, STORED (uncompressed) records whose data start on 64-byte boundaries of the archive:
``data.pkl``, ``.format_version`` (``1``), ``.storage_alignment`` (``64``), ``byteorder``
(``little``), ``data/0`` (the raw storage bytes), ``version`` (``3\\n``) and
``.data/serialization_id``, then the central directory, a zip64 end record and its locator, and the
end record. Every local header carries zero CRC and sizes; records with data are followed by a
data descriptor holding them (miniz's writer, ``MZ_ZIP_FLAG_WRITE_ZIP64``; see ``_RecordLayout``).

Everything except the CRC-32 of ``data/0`` (and the serialization id derived from it) depends only
on (dtype, shape). So the archive's size and layout are known up front, the part before the tensor
bytes is written at construction, the bytes stream in through :meth:`TensorArchiveWriter.write`,
and :meth:`TensorArchiveWriter.close` writes the tail. All writes are ``os.pwrite`` at absolute
offsets, so many archives of one file can be written concurrently from different threads; the
large aligned part of each piece may go straight to the device (``O_DIRECT``,
:class:`formats.fsutil.DirectWrites`), the rest through the page cache, or gathered with the
neighbouring archives' bytes into whole aligned blocks first (the writer's
:class:`formats.fsutil.BlockCombiner`, as :class:`formats.dcp.writer.DCPWriter` sets it up).

The output is byte-identical to ``torch.save`` (tests compare), serialization id included, and is
produced without importing torch: ``data.pkl`` is pickled from stand-ins
(:mod:`formats.dcp.torch_globals`) and pieces are numpy bit arrays (torch tensors are accepted too).
"""

from __future__ import annotations

import math
import struct
import sys
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from formats.integrity import crc32 as _data_crc32  # ISA-L's when installed (same values as zlib's)

from formats.dcp.torch_globals import NEW_DTYPES, STORAGE_TYPE_BY_DTYPE, Global, dtype_global, dumps, module_name
from formats.dtypes import by_name, is_torch_tensor, itemsize_of, raw_bytes
from formats.fsutil import DIRECT_MIN_BYTES, DirectWrites, pwrite_all, start_writeback
from formats.errors import IncompleteCheckpointError, InvalidCheckpointError, UnsupportedError

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]

ALIGNMENT = 64
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_PREFIX = b"archive/"
_LOCAL_SIG = b"PK\x03\x04"
_DESCRIPTOR_SIG = b"PK\x07\x08"
_CENTRAL_SIG = b"PK\x01\x02"
_FLAG_UTF8 = 0x0800
_FLAG_DESCRIPTOR = 0x0008
_ZIP64_EXTRA_ID = 0x0001

# Record contents that never change (torch.save on a little-endian host).
_FORMAT_VERSION = b"1"
_STORAGE_ALIGNMENT = str(ALIGNMENT).encode()
_BYTEORDER = b"little"
_VERSION = b"3\n"
_SERIALIZATION_ID_LEN = 40
#: First half of ``.data/serialization_id``: torch combines std::hash of every record name; the
#: record names are the same for every tensor archive, so this is a constant (libstdc++ builds).
_RECORD_NAME_HASH = 15728199511854643026

_RECORD_NAMES = (
    b"data.pkl",
    b".format_version",
    b".storage_alignment",
    b"byteorder",
    b"data/0",
    b"version",
    b".data/serialization_id",
)
_DATA = 4  # index of data/0 in _RECORD_NAMES


# ----------------------------------------------------------------------------- data.pkl


_UTILS = "torch._utils"
_REBUILD_V2 = Global(_UTILS, "_rebuild_tensor_v2")
_REBUILD_V3 = Global(_UTILS, "_rebuild_tensor_v3")
_UNTYPED_STORAGE = Global("torch.storage", "UntypedStorage")  # UntypedStorage.__module__
_TORCH = module_name("torch")
_TYPED_STORAGES = {d: Global(_TORCH, n) for d, n in STORAGE_TYPE_BY_DTYPE.items()}


class _StorageRef:
    """Stands for the tensor's storage in the pickle (emitted as a persistent id)."""

    def __init__(self, storage_type: Global, numel: int) -> None:
        self.pid = ("storage", storage_type, "0", "cpu", numel)


def _persistent_id(obj: object) -> tuple | None:
    return obj.pid if isinstance(obj, _StorageRef) else None


class _TensorRef:
    """Pickles exactly as ``Tensor._reduce_ex_internal`` does for a contiguous CPU tensor."""

    def __init__(self, dtype_name: str, shape: Shape) -> None:
        self.dtype_name = dtype_name
        self.shape = shape

    def __reduce_ex__(self, proto):  # noqa: ARG002 - pickle protocol hook
        numel = math.prod(self.shape)
        size = tuple(list(self.shape))  # fresh tuples: the pickle memoizes by identity
        stride = tuple(list(contiguous_strides(self.shape)))
        if self.dtype_name in NEW_DTYPES:
            storage = _StorageRef(_UNTYPED_STORAGE, numel * itemsize_of(self.dtype_name))
            args = (storage, 0, size, stride, False, OrderedDict(), dtype_global(self.dtype_name))
            return (_REBUILD_V3, args)
        storage = _StorageRef(_TYPED_STORAGES[self.dtype_name], numel)
        return (_REBUILD_V2, (storage, 0, size, stride, False, OrderedDict()))


def contiguous_strides(shape: Shape) -> Shape:
    """The strides torch gives a contiguous tensor of ``shape`` (size-0 dims count as 1)."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def tensor_ref(dtype_name: str, shape: Shape) -> Any:
    """A stand-in that pickles (with :func:`pickle_with_tensor`) as a contiguous tensor whose
    storage is the archive's ``data/0``: put it inside any picklable value."""
    return _TensorRef(by_name(dtype_name).name, tuple(int(s) for s in shape))


def pickle_with_tensor(value: Any) -> bytes:
    """``data.pkl`` (protocol 2, as ``torch.save``) of ``value`` holding one :func:`tensor_ref`."""
    return dumps(value, protocol=2, persistent_id=_persistent_id)


@lru_cache(maxsize=4096)
def data_pkl(dtype_name: str, shape: Shape) -> bytes:
    """The ``archive/data.pkl`` that ``torch.save`` writes for a contiguous tensor (protocol 2),
    built without importing torch."""
    ref = _TensorRef(by_name(dtype_name).name, tuple(int(s) for s in shape))
    return dumps(ref, protocol=2, persistent_id=_persistent_id)


# ----------------------------------------------------------------------------- zip layout


@dataclass(frozen=True)
class _RecordLayout:
    """Where one record lies in the archive, exactly as miniz + PyTorchStreamWriter place it."""

    name: bytes  # full name, "archive/..."
    header_offset: int
    size: int

    @property
    def zip64(self) -> bool:
        return self.size >= _U32 or self.header_offset >= _U32

    @property
    def flags(self) -> int:
        return _FLAG_UTF8 | (_FLAG_DESCRIPTOR if self.size else 0)

    def _zip64_extra(self, comp_size: int) -> bytes:
        if not self.zip64:
            return b""
        fields = b""
        if self.size >= _U32:
            fields += struct.pack("<QQ", self.size, comp_size)
        if self.header_offset >= _U32:
            fields += struct.pack("<Q", self.header_offset)
        return struct.pack("<HH", _ZIP64_EXTRA_ID, len(fields)) + fields

    @property
    def padding(self) -> int:
        start = self.header_offset + 30 + len(self.name) + 4 + len(self._zip64_extra(0))
        return -start % ALIGNMENT

    @property
    def data_offset(self) -> int:
        return self.header_offset + 30 + len(self.name) + len(self._zip64_extra(0)) + 4 + self.padding

    @property
    def descriptor_size(self) -> int:
        if not self.size:
            return 0
        return 24 if self.zip64 else 16

    @property
    def end(self) -> int:
        return self.data_offset + self.size + self.descriptor_size

    def local_header(self) -> bytes:
        """Local header + name + zip64 extra + the ``FB`` alignment extra (CRC/sizes are 0)."""
        extra = self._zip64_extra(0) + b"FB" + struct.pack("<H", self.padding) + b"Z" * self.padding
        head = struct.pack(
            "<4sHHHHHIIIHH", _LOCAL_SIG, 0, self.flags, 0, 0, 0, 0, 0, 0, len(self.name), len(extra)
        )
        return head + self.name + extra

    def descriptor(self, crc: int) -> bytes:
        if not self.size:
            return b""
        if self.zip64:
            return _DESCRIPTOR_SIG + struct.pack("<IQQ", crc, self.size, self.size)
        return _DESCRIPTOR_SIG + struct.pack("<III", crc, self.size, self.size)

    def central_header(self, crc: int) -> bytes:
        extra = self._zip64_extra(self.size)
        head = struct.pack(
            "<4sHHHHHHIIIHHHHHII",
            _CENTRAL_SIG,
            0,  # version made by
            0,  # version needed (STORED)
            self.flags,
            0,  # method
            0,  # time
            0,  # date
            crc,
            min(self.size, _U32),
            min(self.size, _U32),
            len(self.name),
            len(extra),
            0,  # comment length
            0,  # disk
            0,  # internal attributes
            0,  # external attributes
            min(self.header_offset, _U32),
        )
        return head + self.name + extra


@dataclass(frozen=True)
class ArchiveLayout:
    """The full layout of one tensor archive (a pure function of dtype and shape)."""

    records: tuple[_RecordLayout, ...]
    central_offset: int
    central_size: int

    @property
    def size(self) -> int:
        return self.central_offset + self.central_size + 56 + 20 + 22

    @property
    def data_offset(self) -> int:
        """Offset of the first tensor byte relative to the archive start (64-byte aligned)."""
        return self.records[_DATA].data_offset

    @property
    def nbytes(self) -> int:
        return self.records[_DATA].size

    def end_records(self) -> bytes:
        """zip64 end-of-central-directory record, its locator, and the classic end record."""
        n = len(self.records)
        z64_offset = self.central_offset + self.central_size
        z64 = struct.pack(
            "<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 0x002D, 0, 0, n, n,
            self.central_size, self.central_offset,
        )
        locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, z64_offset, 1)
        eocd = struct.pack(
            "<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
            min(self.central_size, _U32), min(self.central_offset, _U32), 0,
        )
        return z64 + locator + eocd


@lru_cache(maxsize=4096)
def archive_layout(dtype_name: str, shape: Shape, pkl_size: int | None = None) -> ArchiveLayout:
    """The layout of the archive ``torch.save`` writes for a contiguous tensor of this kind
    (``pkl_size``: the size of another ``data.pkl`` holding that one tensor, e.g. in a dict)."""
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * by_name(dtype_name).itemsize
    sizes = (
        len(data_pkl(dtype_name, shape)) if pkl_size is None else pkl_size,
        len(_FORMAT_VERSION),
        len(_STORAGE_ALIGNMENT),
        len(_BYTEORDER),
        nbytes,
        len(_VERSION),
        _SERIALIZATION_ID_LEN,
    )
    records, cursor = [], 0
    for name, size in zip(_RECORD_NAMES, sizes):
        rec = _RecordLayout(_PREFIX + name, cursor, size)
        records.append(rec)
        cursor = rec.end
    central_size = sum(len(r.central_header(0)) for r in records)
    return ArchiveLayout(tuple(records), cursor, central_size)


def archive_size(dtype_name: str, shape: Shape) -> int:
    """Total size in bytes of the archive holding a tensor of ``dtype_name`` and ``shape``."""
    return archive_layout(dtype_name, tuple(shape)).size


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit size_t."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _U64)) & _U64


# ----------------------------------------------------------------------------- the writer


class TensorArchiveWriter:
    """Writes one tensor's ``torch.save`` archive at ``file_offset`` of ``fd``, streaming.

    Construction writes everything before the tensor bytes. :meth:`write` takes contiguous pieces
    in C order (any sizes, summing to the whole tensor); :meth:`close` writes the tail (data
    descriptor, ``version``, serialization id, central directory). One writer is used by one
    thread at a time; different writers may share ``fd`` across threads.
    """

    def __init__(self, fd: int | DirectWrites, file_offset: int, dtype_name: str, shape: Shape,
                 pkl: bytes | None = None) -> None:
        """``fd``: the file (a descriptor, or :class:`formats.fsutil.DirectWrites` to send the
        large aligned part of each piece straight to the device); ``pkl``: another ``data.pkl``
        whose one storage (key ``"0"``) is this tensor's (see :func:`tensor_ref`); default: the
        bare tensor's, as ``torch.save(tensor)`` writes it."""
        if sys.byteorder != "little":
            raise UnsupportedError("writing DCP archives needs a little-endian host (the bytes are raw)")
        self._out = fd if isinstance(fd, DirectWrites) else DirectWrites(fd, None)
        self._fd = self._out.fd
        self._base = file_offset
        self._dtype = by_name(dtype_name)
        self._shape = tuple(int(s) for s in shape)
        self._layout = archive_layout(self._dtype.name, self._shape, None if pkl is None else len(pkl))
        self._template = _archive_template(self._dtype.name, self._shape, pkl)
        self._written = 0
        self._crc = 0
        self._head = b""  # first bytes of data/0 (torch's serialization id peeks at them)
        self._closed = False
        self._write_prefix()

    @property
    def size(self) -> int:
        """Total archive size in bytes."""
        return self._layout.size

    @property
    def nbytes(self) -> int:
        """Number of tensor bytes the archive holds."""
        return self._layout.nbytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def next_offset(self) -> int:
        """The file offset the next piece's first byte is written at (place its buffer so:
        :func:`formats.fsutil.pooled_buffer`'s ``align_to``)."""
        return self._base + self._layout.data_offset + self._written

    @property
    def _what(self) -> str:
        return f"{self._dtype.name}{list(self._shape)}"

    def _write_prefix(self) -> None:
        self._out.pwrite(self._template.prefix, self._base)

    def write(self, piece: np.ndarray | torch.Tensor) -> None:
        """Append the bytes of ``piece``, in C order: a C-contiguous numpy bit array of the
        archive's storage dtype (:mod:`formats.dtypes`: bfloat16 as uint16, float8 as uint8), or a
        contiguous CPU tensor of the archive's dtype."""
        if self._closed:
            raise InvalidCheckpointError(f"write after close of a {self._what} archive")
        data = self._piece_bytes(piece)
        if not data.nbytes:
            return
        if self._written + data.nbytes > self.nbytes:
            raise InvalidCheckpointError(f"pieces exceed the {self.nbytes} bytes of a {self._what} chunk")
        if len(self._head) < 8:
            self._head += data[: 8 - len(self._head)].tobytes()
        at = self._base + self._layout.data_offset + self._written
        if self._out.pwrite(data, at) >= DIRECT_MIN_BYTES:  # through the page cache: start its writeback
            start_writeback(self._fd, at, data.nbytes)
        self._crc = _data_crc32(data, self._crc)
        self._written += data.nbytes

    def _piece_bytes(self, piece: Any) -> np.ndarray:
        """The piece's bytes as a flat uint8 array (zero-copy), after checking dtype and layout."""
        if is_torch_tensor(piece):
            if piece.dtype != self._dtype.torch_dtype or piece.device.type != "cpu":
                raise InvalidCheckpointError(
                    f"piece is {piece.dtype} on {piece.device}, archive expects {self._dtype.name} on cpu; "
                    "convert the piece before writing"
                )
            if not piece.is_contiguous():
                raise InvalidCheckpointError("piece is not contiguous; pass piece.contiguous() in C order")
            return np.asarray(raw_bytes(piece))
        if not isinstance(piece, np.ndarray):
            raise InvalidCheckpointError(
                f"piece is a {type(piece).__name__}; pass a numpy array or a torch tensor"
            )
        if piece.dtype != self._dtype.numpy_dtype:
            raise InvalidCheckpointError(
                f"piece is a numpy {piece.dtype} array, archive of {self._dtype.name} expects its bits as "
                f"{self._dtype.storage}; view or convert the piece before writing"
            )
        if not piece.flags.c_contiguous:
            raise InvalidCheckpointError("piece is not C-contiguous; pass np.ascontiguousarray(piece)")
        return piece.reshape(-1).view(np.uint8)

    def close(self) -> None:
        """Write the tail: data descriptor, ``version``, serialization id, central directory."""
        if self._closed:
            return
        if self._written != self.nbytes:
            raise IncompleteCheckpointError(
                f"{self._what} chunk got {self._written} of {self.nbytes} bytes; "
                "write every piece before close()"
            )
        self._out.pwrite(self._tail(), self._base + self._layout.data_offset + self.nbytes)
        self._closed = True

    def _serialization_id(self, crcs: list[int]) -> bytes:
        combined = 0
        for i, crc in enumerate(crcs):
            # torch folds in the CRC from every write that starts with a data-descriptor signature,
            # which includes a data/0 payload that happens to start with one.
            if i == _DATA and len(self._head) >= 8 and self._head[:4] == _DESCRIPTOR_SIG:
                combined = _hash_combine(combined, struct.unpack("<I", self._head[4:8])[0])
            if self._layout.records[i].size:
                combined = _hash_combine(combined, crc)
        return f"{_RECORD_NAME_HASH:020d}{combined:020d}".encode()

    def _tail(self) -> bytes:
        t, recs = self._template, self._layout.records
        sid = self._serialization_id([*t.small_crcs, self._crc, t.version_crc])
        sid_crc = zlib.crc32(sid)
        return b"".join((recs[_DATA].descriptor(self._crc), t.version_record, t.sid_header, sid,
                         recs[_SID].descriptor(sid_crc), t.central_small, recs[_DATA].central_header(self._crc),
                         t.central_version, recs[_SID].central_header(sid_crc), t.end_records))


@dataclass(frozen=True)
class _ArchiveTemplate:
    """The bytes of one kind of archive (dtype, shape, ``data.pkl``) that do not depend on the
    tensor's bytes, made once per kind: a conversion writes thousands of archives of few kinds."""

    prefix: bytes  # the small records, then data/0's local header
    small_crcs: tuple[int, ...]  # CRC-32 of each small record (data.pkl, .format_version, ...)
    version_crc: int
    version_record: bytes  # the ``version`` record: local header, body, descriptor
    sid_header: bytes  # the serialization id record's local header
    central_small: bytes  # the central headers of the small records
    central_version: bytes
    end_records: bytes


_SID = 6  # index of the serialization id record


@lru_cache(maxsize=4096)
def _archive_template(dtype_name: str, shape: Shape, pkl: bytes | None) -> _ArchiveTemplate:
    layout = archive_layout(dtype_name, shape, None if pkl is None else len(pkl))
    recs = layout.records
    small = (data_pkl(dtype_name, shape) if pkl is None else pkl, _FORMAT_VERSION, _STORAGE_ALIGNMENT, _BYTEORDER)
    crcs = tuple(zlib.crc32(b) for b in small)
    parts = []
    for rec, body, crc in zip(recs, small, crcs):
        parts += [rec.local_header(), body, rec.descriptor(crc)]
    parts.append(recs[_DATA].local_header())
    version_crc = zlib.crc32(_VERSION)
    version = recs[_DATA + 1]
    return _ArchiveTemplate(
        prefix=b"".join(parts), small_crcs=crcs, version_crc=version_crc,
        version_record=version.local_header() + _VERSION + version.descriptor(version_crc),
        sid_header=recs[_SID].local_header(),
        central_small=b"".join(rec.central_header(crc) for rec, crc in zip(recs, crcs)),
        central_version=version.central_header(version_crc), end_records=layout.end_records())


# ----------------------------------------------------------------------------- whole small archives


def torch_save_records(pkl: bytes, storages: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The records ``torch.save`` writes for a ``data.pkl`` whose storages are ``data/0``,
    ``data/1``, ... (in this order), with their contents; the serialization id last."""
    records = [(b"data.pkl", pkl), (b".format_version", _FORMAT_VERSION),
               (b".storage_alignment", _STORAGE_ALIGNMENT), (b"byteorder", _BYTEORDER)]
    records += [(f"data/{i}".encode(), bytes(data)) for i, data in enumerate(storages)]
    records.append((b"version", _VERSION))
    combined = 0
    for _, body in records:
        if body:
            combined = _hash_combine(combined, zlib.crc32(body))
    # torch's first half hashes the record names with std::hash; torch.load never reads the id
    records.append((b".data/serialization_id", f"{0:020d}{combined:020d}".encode()))
    return records


def write_torch_archive(pkl: bytes, storages: list[bytes]) -> bytes:
    """A complete ``torch.save`` archive (in memory) of ``data.pkl`` ``pkl`` and its storages:
    STORED records, data 64-byte aligned, data descriptors and zip64 end records as torch writes
    them; ``torch.load`` reads it."""
    parts, layouts, cursor = [], [], 0
    for name, body in torch_save_records(pkl, storages):
        rec = _RecordLayout(_PREFIX + name, cursor, len(body))
        crc = zlib.crc32(body)
        parts += [rec.local_header(), body, rec.descriptor(crc)]
        layouts.append((rec, crc))
        cursor = rec.end
    central = [rec.central_header(crc) for rec, crc in layouts]
    layout = ArchiveLayout(tuple(r for r, _ in layouts), cursor, sum(map(len, central)))
    return b"".join(parts + central) + layout.end_records()


class TorchFileWriter:
    """Streams a whole ``torch.save`` file (a ``data.pkl`` and its storages ``data/<i>``) at
    ``file_offset`` of ``fd``: the layout is fixed by the pickle and the storage sizes, so every
    record's header is written at construction, storages given as bytes too; the others are
    filled by :meth:`write` at byte offsets in any order and from any thread (their CRC-32 from the
    parts, :class:`formats.integrity.CRCRanges`; bytes never written are zeros). :meth:`close`
    writes the data descriptors, the serialization id and the central directory."""

    def __init__(self, fd: int, file_offset: int, pkl: bytes, storages: list[bytes | int]) -> None:
        from formats.integrity import CRCRanges

        if sys.byteorder != "little":
            raise UnsupportedError("writing torch.save files needs a little-endian host (the bytes are raw)")
        self._fd, self._base = fd, file_offset
        sizes = [len(s) if isinstance(s, (bytes, bytearray)) else int(s) for s in storages]
        names = [b"data.pkl", b".format_version", b".storage_alignment", b"byteorder",
                 *(f"data/{i}".encode() for i in range(len(sizes))), b"version", b".data/serialization_id"]
        fixed = {b"data.pkl": pkl, b".format_version": _FORMAT_VERSION, b".storage_alignment": _STORAGE_ALIGNMENT,
                 b"byteorder": _BYTEORDER, b"version": _VERSION}
        lens = [len(fixed[n]) if n in fixed else _SERIALIZATION_ID_LEN for n in names[:4]] + sizes + \
            [len(_VERSION), _SERIALIZATION_ID_LEN]
        self.records: list[_RecordLayout] = []
        cursor = 0
        for name, size in zip(names, lens):
            rec = _RecordLayout(_PREFIX + name, cursor, size)
            self.records.append(rec)
            cursor = rec.end
        self._central = cursor
        self._fixed, self._crcs = fixed, {}
        self._ledgers = {i: CRCRanges(n) for i, (s, n) in enumerate(zip(storages, sizes))
                         if not isinstance(s, (bytes, bytearray))}
        self._lock = threading.Lock()
        self._closed = False
        self._write_fixed(storages)

    @property
    def size(self) -> int:
        """The file's size: records, central directory and end records."""
        central = sum(len(r.central_header(0)) for r in self.records)
        return self._central + central + 56 + 20 + 22

    def storage_offset(self, storage: int) -> int:
        """Where storage ``storage``'s bytes start, relative to the file."""
        return self.records[4 + storage].data_offset

    def filled_storages(self) -> list[tuple[int, int, int]]:
        """``(storage, first byte, size)`` in the file of each storage the writes fill (the others
        were given as bytes)."""
        return [(s, self.records[4 + s].data_offset, self.records[4 + s].size) for s in sorted(self._ledgers)]

    def _write_fixed(self, storages: list[bytes | int]) -> None:
        parts: list[tuple[int, bytes]] = []
        for rec in self.records:
            name = rec.name[len(_PREFIX):]
            parts.append((rec.header_offset, rec.local_header()))
            body = self._fixed.get(name)
            if name.startswith(b"data/"):
                data = storages[int(name[5:])]
                body = bytes(data) if isinstance(data, (bytes, bytearray)) else None
            if body is not None:
                crc = zlib.crc32(body)
                self._crcs[name] = crc
                parts.append((rec.data_offset, body + rec.descriptor(crc)))
        for offset, data in parts:
            pwrite_all(self._fd, data, self._base + offset)

    def write(self, storage: int, offset: int, data: np.ndarray) -> int:
        """Write ``data`` (a C-contiguous array: its raw bytes) at byte ``offset`` of storage
        ``storage``; the bytes' CRC-32 (what another process passes to :meth:`add_crc`)."""
        from formats.integrity import crc32

        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        rec = self.records[4 + storage]
        if offset < 0 or offset + len(view) > rec.size:
            raise InvalidCheckpointError(f"{len(view)} bytes at {offset} of a {rec.size}-byte storage")
        pwrite_all(self._fd, view, self._base + rec.data_offset + offset)
        crc = crc32(view)
        self.add_crc(storage, offset, len(view), crc)
        return crc

    def add_crc(self, storage: int, offset: int, length: int, crc: int) -> None:
        """Account for ``length`` bytes at ``offset`` of ``storage`` written elsewhere, CRC ``crc``."""
        with self._lock:
            try:
                self._ledgers[storage].add_crc(offset, length, crc)
            except ValueError as e:
                raise InvalidCheckpointError(f"storage {storage}: {e}; the plan's tasks overlap") from None

    def close(self) -> None:
        """Zero-filled gaps accounted for, then the data descriptors, serialization id, central
        directory and end records."""
        if self._closed:
            return
        for storage, ledger in self._ledgers.items():
            ledger.finish(lambda a, b, add: add(a, memoryview(bytes(b - a))))
            self._crcs[f"data/{storage}".encode()] = ledger.value()
        parts = []
        combined = 0
        for rec in self.records[:-1]:
            name = rec.name[len(_PREFIX):]
            if rec.size:
                combined = _hash_combine(combined, self._crcs[name])
            if name.startswith(b"data/") and int(name[5:]) in self._ledgers:
                parts.append((rec.data_offset + rec.size, rec.descriptor(self._crcs[name])))
        sid = f"{0:020d}{combined:020d}".encode()
        last = self.records[-1]
        self._crcs[b".data/serialization_id"] = zlib.crc32(sid)
        parts.append((last.data_offset, sid + last.descriptor(zlib.crc32(sid))))
        central = [r.central_header(self._crcs[r.name[len(_PREFIX):]]) for r in self.records]
        layout = ArchiveLayout(tuple(self.records), self._central, sum(map(len, central)))
        parts.append((self._central, b"".join(central) + layout.end_records()))
        for offset, data in parts:
            pwrite_all(self._fd, data, self._base + offset)
        self._closed = True
