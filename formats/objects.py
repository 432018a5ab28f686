"""Non-tensor entries: torch.save pickles loaded through torch's weights-only allowlist."""

from __future__ import annotations

import argparse
import datetime
import io
import pickle
import pickletools
import re
import struct
import threading
import zipfile
import zlib
from typing import Any

from formats.errors import CorruptCheckpointError, MissingClassError, UnsafePickleError, clip
from formats.pickle_scan import WEIGHTS_ONLY_GLOBALS, MalformedPickle, PickleScan, scan_globals, scan_legacy


def _numpy_globals() -> list:
    """numpy's array, scalar and dtype constructors (under both module spellings, numpy 1 and 2):
    they build plain data and run no user code; object arrays' items still go through the
    allowlist. Absent numpy: none."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch
        return []
    core = getattr(np, "_core", None) or np.core
    out: list = [np.ndarray, np.dtype]
    for name in ("_reconstruct", "scalar"):
        fn = getattr(core.multiarray, name)
        out += [(fn, f"numpy.core.multiarray.{name}"), (fn, f"numpy._core.multiarray.{name}")]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [c for c in vars(dtypes).values() if isinstance(c, type) and issubclass(c, np.dtype)]
    return out


#: Plain-data classes training scripts keep in non-tensor state, beyond torch's weights-only
#: defaults: ``io.BytesIO`` (DCP's own value type for raw bytes: ``dcp.save`` pickles it),
#: ``numpy`` arrays and RNG states, ``datetime`` values, ``frozenset``, ``range``, ``slice``, and
#: ``argparse.Namespace`` (Megatron keeps its training arguments in every checkpoint's common state:
#: the pickle builds it with ``object.__new__`` and fills its ``__dict__``; its values still go through
#: the allowlist). None runs code beyond building the value.
EXTRA_SAFE_GLOBALS: list = [
    io.BytesIO, frozenset, range, slice, argparse.Namespace,
    datetime.date, datetime.time, datetime.datetime, datetime.timedelta, datetime.timezone,
    *_numpy_globals(),
]
_SAFE_LOCK = threading.Lock()  # torch.serialization.safe_globals edits one process-wide list


def _global_name(obj: Any) -> str:
    if isinstance(obj, tuple):
        return obj[1]
    return f"{obj.__module__}.{obj.__qualname__}"


#: Every global a non-tensor entry may name without ``--trust-pickle``: torch's weights-only
#: defaults plus :data:`EXTRA_SAFE_GLOBALS`, as ``module.name`` (what the pickle spells).
SAFE_GLOBAL_NAMES: frozenset[str] = WEIGHTS_ONLY_GLOBALS | frozenset(_global_name(g) for g in EXTRA_SAFE_GLOBALS)
#: Largest uncompressed member of a non-tensor entry's archive, relative to the archive (torch
#: stores members uncompressed: a much larger declared size is a zip bomb or a damaged record).
_MAX_INFLATION = 64


def safe_torch_load(data: bytes) -> Any:
    """``torch.load`` of a ``torch.save`` payload with the weights-only unpickler plus
    :data:`EXTRA_SAFE_GLOBALS`; raises what ``torch.load`` raises (``UnpicklingError`` for a
    global outside the allowlist)."""
    import torch

    with _SAFE_LOCK, torch.serialization.safe_globals(EXTRA_SAFE_GLOBALS):
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def pickle_error_hint(message: str) -> str:
    """One line of an unpickling error (torch's weights-only messages span many lines): the line
    naming the global or opcode, else the first line."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return clip(next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[0] if lines else ""), 160)


def is_damaged_pickle(data: bytes, message: str) -> bool:
    """Whether an ``UnpicklingError`` (``message``) of ``data`` comes from malformed bytes rather
    than from a class outside the allowlist."""
    return _is_damaged(data, message)


def load_torch_object(data: bytes, where: str, trust_pickle: bool = False) -> Any:
    """Load a ``torch.save`` payload; arbitrary classes only with ``trust_pickle``.

    Without ``trust_pickle``: torch's weights-only unpickler, plus :data:`EXTRA_SAFE_GLOBALS`.
    A payload of plain Python data (numbers, strings, lists, dicts: what optimizer param groups
    and most training state hold) is read without importing torch (:func:`load_plain_object`).
    """
    check_object_bytes(data, where, trust_pickle)
    found, value = load_plain_object(data)
    if found:
        return value
    try:
        if trust_pickle:
            import torch

            return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")
        return safe_torch_load(data)
    except (AttributeError, ImportError) as e:  # after the scan: a class the pickle names is not importable here
        if not trust_pickle:
            raise CorruptCheckpointError(f"{where}: corrupt non-tensor entry ({type(e).__name__}: {clip(str(e), 160)})") from None
        raise MissingClassError(
            f"{where}: the non-tensor entry's class cannot be imported here ({type(e).__name__}: {clip(str(e), 120)}); "
            "its bytes are intact and conversions copy them as they are: load it where its class is importable"
        ) from None
    except pickle.UnpicklingError as e:
        if trust_pickle:
            raise CorruptCheckpointError(f"{where}: cannot unpickle ({clip(str(e), 160)})") from None
        hint = pickle_error_hint(str(e))
        if _is_damaged(data, str(e)):
            raise CorruptCheckpointError(
                f"{where}: damaged non-tensor entry (malformed pickle: {hint}); "
                "the checkpoint file is corrupt, restore it from a good copy"
            ) from None
        raise UnsafePickleError(
            f"{where}: non-tensor entry needs classes outside the safe allowlist ({hint}); "
            "pass --trust-pickle only if you trust this checkpoint"
        ) from None
    except Exception as e:  # damaged pickles make torch's unpickler raise many builtin types
        first = clip(str(e).splitlines()[0], 160) if str(e) else ""
        raise CorruptCheckpointError(f"{where}: corrupt non-tensor entry ({type(e).__name__}: {first})") from None


def check_object_bytes(data: bytes, where: str, trust_pickle: bool = False) -> None:
    """Refuse a non-tensor entry (a ``torch.save`` payload) before its bytes are copied or loaded,
    without running any of it: a zip member whose CRC-32 does not match or whose record is broken,
    a pickle that does not parse (:class:`CorruptCheckpointError`, always), and, unless
    ``trust_pickle``, a pickle naming a global outside :data:`SAFE_GLOBAL_NAMES` or building one
    at load time (:class:`UnsafePickleError`). Copying never needs the entry's classes."""
    scan = _scan_entry(data, where)
    if trust_pickle:
        return
    outside = scan.outside(SAFE_GLOBAL_NAMES)
    if outside or scan.opaque:
        what = ", ".join(outside[:3]) + (f" and {len(outside) - 3} more" if len(outside) > 3 else "")
        raise UnsafePickleError(
            f"{where}: non-tensor entry names globals outside the safe allowlist "
            f"({clip(what or scan.opaque or '', 160)}; not run); pass --trust-pickle only if you trust this checkpoint"
        )


def object_label(index: Any, key: str) -> str:
    """``<checkpoint>/<file>: key '<key>'``: where a non-tensor entry of a checkpoint index lives."""
    return f"{str(index.root).rstrip('/')}/{index.objects[key].file}: key {key!r}"


def read_checked_object(reader: Any, key: str, trust_pickle: bool = False) -> bytes:
    """The stored bytes of non-tensor entry ``key`` of ``reader`` (any checkpoint reader), after
    :func:`check_object_bytes`: what every path that copies an entry into an output writes."""
    data = reader.read_object_bytes(key)
    check_object_bytes(data, object_label(reader.index(), key), trust_pickle)
    return data


def preview_value(data: bytes, where: str) -> Any:
    """A JSON view (:func:`json_view`) of a checked entry, loaded without running anything outside
    the allowlist; None where that needs classes outside it (a trusted user class): copying the
    bytes never needs them."""
    try:
        return json_view(load_torch_object(data, where))
    except (UnsafePickleError, MissingClassError):
        return None


def _corrupt(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: damaged non-tensor entry ({clip(why, 160)}); the checkpoint file is corrupt, restore it from a good copy"
    )


def _scan_entry(data: bytes, where: str) -> PickleScan:
    """The globals of a torch.save payload (zip archive, or the legacy sequence of pickles), after
    its zip records and CRC-32s were checked."""
    if data[:4] != b"PK\x03\x04":
        try:
            return scan_legacy(data)
        except MalformedPickle as e:
            raise _corrupt(where, f"not a torch.save archive or pickle: {e}") from None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            why = _directory_problem(data, z.start_dir)
            if why:
                raise _corrupt(where, why)
            infos = z.infolist()
            big = next((i for i in infos if i.file_size > _MAX_INFLATION * len(data) + (1 << 20)), None)
            if big is not None:
                raise _corrupt(where, f"zip member {big.filename} declares {big.file_size} bytes")
            bad = z.testzip()
            if bad is not None:
                raise _corrupt(where, f"CRC-32 mismatch in {bad}")
            for info in infos:
                why = _local_header_problem(data, info)
                if why:
                    raise _corrupt(where, f"zip member {info.filename}: {why}")
            names = [i.filename for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(names) != 1:
                raise _corrupt(where, f"{len(names)} data.pkl records in the archive, not one")
            payload = z.read(names[0])
    except CorruptCheckpointError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, KeyError, zlib.error,
            NotImplementedError, RuntimeError) as e:
        raise _corrupt(where, f"broken zip archive: {type(e).__name__}: {e}") from None
    try:
        return scan_globals(payload)
    except MalformedPickle as e:
        raise _corrupt(where, f"malformed pickle: {e}") from None


_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_ZIP64_MARK = 0xFFFFFFFF
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_RECORD_SIZE = 56


def _directory_problem(data: bytes, start_dir: int) -> str | None:
    """Why torch's reader (miniz) could read another central directory than Python's zipfile did
    (None: both read the one at ``start_dir``). Python reads the directory just before the end
    records whatever offset they record (it allows data prepended to the archive); miniz follows the
    recorded offset, and the zip64 locator's pointer to the zip64 record: these must all agree, or a
    scanned data.pkl is not the one ``torch.load`` runs."""
    try:
        end = zipfile._EndRecData(io.BytesIO(data))  # what ZipFile itself parsed (a stable private helper)
    except OSError:
        end = None
    if not end:
        return "no end of central directory record"
    eocd = end[zipfile._ECD_LOCATION]
    if end[zipfile._ECD_OFFSET] != start_dir:
        return (f"its end record puts the central directory at byte {end[zipfile._ECD_OFFSET]}, "
                f"it lies at byte {start_dir} (data before the archive, or two directories)")
    at = eocd - _ZIP64_LOCATOR.size
    has_locator = at >= 0 and data[at:at + 4] == zipfile.stringEndArchive64Locator
    if end[zipfile._ECD_SIGNATURE] == zipfile.stringEndArchive64:
        if _ZIP64_LOCATOR.unpack_from(data, at)[2] != at - _ZIP64_RECORD_SIZE:
            return "its zip64 locator points away from the zip64 end record"
        size, offset = struct.unpack_from("<LL", data, eocd + 12)  # the 32-bit record: unset or equal
        if size not in (_ZIP64_MARK, end[zipfile._ECD_SIZE]) or offset not in (_ZIP64_MARK, start_dir):
            return "its zip64 and 32-bit end records name different central directories"
    elif has_locator:
        return "its zip64 locator points at no zip64 end record"
    return None


def _local_header_problem(data: bytes, info: zipfile.ZipInfo) -> str | None:
    """Why a member's local header disagrees with the central directory (None: it agrees).
    Python's zipfile reads sizes from the central directory only; torch's reader (miniz) refuses
    an archive whose local header says otherwise, so such an entry would not load after copying."""
    at = info.header_offset
    if at + _LOCAL_HEADER.size > len(data):
        return "local header past the end"
    sig, _, flags, _, _, _, crc, csize, usize, nlen, elen = _LOCAL_HEADER.unpack_from(data, at)
    if sig != b"PK\x03\x04":
        return "no local header signature"
    if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
        return f"stored member's compressed size {info.compress_size} differs from its size {info.file_size}"
    if at + _LOCAL_HEADER.size + nlen + elen + info.compress_size > len(data):
        return f"its {info.compress_size} bytes run past the end of the archive"
    if data[at + _LOCAL_HEADER.size:at + _LOCAL_HEADER.size + nlen] != info.orig_filename.encode("utf-8", "replace") \
            and data[at + _LOCAL_HEADER.size:at + _LOCAL_HEADER.size + nlen] != info.orig_filename.encode("cp437", "replace"):
        return "local header names another file"
    if flags & 0x08:  # sizes and CRC in a data descriptor after the data
        return None
    for name, local, central in (("CRC-32", crc, info.CRC), ("compressed size", csize, info.compress_size),
                                 ("size", usize, info.file_size)):
        if local != central and not (local == _ZIP64_MARK and central >= _ZIP64_MARK and name != "CRC-32"):
            return f"local header {name} {local} differs from the central directory's {central}"
    return None


def _crc_mismatch(data: bytes) -> str | None:
    """The first member of a ``torch.save`` zip archive whose CRC-32 does not match its bytes
    (``torch.load`` never checks them), else None (also for bytes that are not a zip archive:
    the loaders report those)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return z.testzip()
    except Exception:  # noqa: BLE001 - not a readable zip: left to the loaders' own errors
        return None


class _NotPlain(Exception):
    """The pickle refers to a class, function or storage: not plain data."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle opcodes build by themselves (None, bools, numbers, str, bytes,
    tuples, lists, dicts, sets): every global and persistent id is refused, so no code runs."""

    def find_class(self, module: str, name: str) -> Any:
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _NotPlain("persistent id")


def load_plain_object(data: bytes) -> tuple[bool, Any]:
    """``(True, value)`` when ``data`` is a ``torch.save`` zip archive whose pickle holds only
    plain Python data (the value ``torch.load`` returns for it), else ``(False, None)``.

    Needs no torch; anything else (tensors, numpy, damaged bytes, legacy format) is left to
    :func:`load_torch_object`'s torch path.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(names) != 1:
                return False, None
            payload = z.read(names[0])
        return True, _PlainUnpickler(io.BytesIO(payload)).load()
    except Exception:  # noqa: BLE001 - any failure: not plain, let torch's path decide and report
        return False, None


_VALID_OPCODES = {ord(op.code) for op in pickletools.opcodes}
_UNSAFE_HINTS = ("GLOBAL", "global", "allowlist", "Can only", "persistent", "DTensor", "NJT")


def _is_damaged(data: bytes, message: str) -> bool:
    """True when an UnpicklingError comes from malformed bytes, not from a disallowed class."""
    if any(h in message for h in _UNSAFE_HINTS):
        return False
    m = re.search(r"Unsupported operand (\d+)", message)
    if m and int(m.group(1)) not in _VALID_OPCODES:
        return True
    if "String is too long" in message:
        return True
    return not _pickle_parses(data)


def _pickle_parses(data: bytes) -> bool:
    """Whether the pickle of a torch.save payload (zip ``*/data.pkl`` or legacy) is well formed."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            name = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            payload = z.read(name) if name else data
    except (zipfile.BadZipFile, KeyError, OSError, ValueError, EOFError):
        payload = data
    try:
        for _ in pickletools.genops(payload):
            pass
    except Exception:  # noqa: BLE001 - any parse failure means malformed bytes
        return False
    return True


def json_view(value: Any) -> Any:
    """A JSON-able view of a value, or None when it has none (tensors, custom classes, NaN)."""
    import json

    def conv(v: Any) -> Any:
        if isinstance(v, (str, bool, int)) or v is None:
            return v
        if isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                raise ValueError
            return v
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {k: conv(x) for k, x in v.items()}
        if type(v) is argparse.Namespace:  # Megatron's args: shown as their fields
            return {k: conv(x) for k, x in vars(v).items()}
        raise ValueError

    try:
        out = conv(value)
        json.dumps(out)
        return {"value": out}
    except (ValueError, TypeError, RecursionError):
        return None
