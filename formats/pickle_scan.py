"""Static checks of a pickle: which globals it names, read from its opcodes, never executed.

A non-tensor entry is copied as bytes, but whoever loads the copy (torch's ``dcp.load`` planner
calls ``torch.load(weights_only=False)``) runs every global the pickle names. So before any entry is
copied, :func:`scan_globals` walks the opcodes with :func:`pickletools.genops` (which builds
nothing) and lists the ``module.name`` of every ``GLOBAL``, ``INST`` and ``STACK_GLOBAL``; the
names must be in :data:`WEIGHTS_ONLY_GLOBALS` (torch's weights-only defaults, torch 2.13;
``tests/formats/test_objects_safety.py`` compares the table with the installed torch) or in the extra
plain-data classes of :data:`formats.objects.EXTRA_SAFE_GLOBALS`.

``STACK_GLOBAL`` takes its names from the stack: they are followed through string pushes and the
memo; names that cannot be followed that way (built by calls) and extension codes (``EXT1`` ...)
make the pickle unsafe. Needs no torch.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickletools
from dataclasses import dataclass

from formats.errors import clip

_TENSOR_TYPES = ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short")
_STORAGE_TYPES = (*(f"{t}Storage" for t in _TENSOR_TYPES), "ComplexDoubleStorage", "ComplexFloatStorage")
_DTYPES = (
    "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128", "complex32",
    "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2", "int3", "int32", "int4",
    "int5", "int6", "int64", "int7", "int8", "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "uint1",
    "uint16", "uint2", "uint3", "uint32", "uint4", "uint5", "uint6", "uint64", "uint7", "uint8",
)
_REBUILDS = (
    "_rebuild_device_tensor_from_cpu_tensor", "_rebuild_device_tensor_from_numpy",
    "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_tensor",
    "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_wrapper_subclass",
)

#: ``torch._weights_only_unpickler._get_allowed_globals()`` of torch 2.13, as names.
WEIGHTS_ONLY_GLOBALS: frozenset[str] = frozenset({
    "_codecs.encode", "builtins.bytearray", "builtins.complex", "builtins.set",
    "collections.Counter", "collections.OrderedDict",
    "torch.Size", "torch.Tensor", "torch.device",
    "torch.per_channel_affine", "torch.per_channel_affine_float_qparams", "torch.per_channel_symmetric",
    "torch.per_tensor_affine", "torch.per_tensor_symmetric",
    "torch._tensor._rebuild_from_type_v2", "torch.nn.parameter.Parameter", "torch.serialization._get_layout",
    "torch.storage.TypedStorage", "torch.storage.UntypedStorage",
    "torch.QInt32Storage", "torch.QInt8Storage", "torch.QUInt2x4Storage", "torch.QUInt4x2Storage",
    "torch.QUInt8Storage",
    *(f"torch.{d}" for d in _DTYPES),
    *(f"torch._utils.{f}" for f in _REBUILDS),
    *(f"{m}.{s}" for m in ("torch", "torch.cuda") for s in _STORAGE_TYPES),
    *(f"{m}.{t}Tensor" for m in ("torch", "torch.cuda") for t in _TENSOR_TYPES),
    *(f"{m}.{t}Tensor" for m in ("torch.sparse", "torch.cuda.sparse") for t in _TENSOR_TYPES if t != "Bool"),
})

_STRING_OPS = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
                         "BINUNICODE8"})
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_NEUTRAL_OPS = frozenset({"FRAME", "PROTO"})  # no effect on the stack
_MAX_PICKLES = 5  # a legacy (non-zip) torch.save file: magic, protocol, sys info, data, storage keys


@dataclass(frozen=True)
class PickleScan:
    """What a pickle names: ``globals`` (``module.name``, in order of appearance) and ``opaque``, the
    first construct whose target cannot be read without running it (else None)."""

    globals: tuple[str, ...]
    opaque: str | None = None

    def outside(self, allowed: frozenset[str]) -> list[str]:
        """The named globals not in ``allowed`` (each once, in order)."""
        return list(dict.fromkeys(g for g in self.globals if g not in allowed))


class MalformedPickle(ValueError):
    """The bytes are not a well-formed pickle (:func:`pickletools.genops` failed)."""


def scan_globals(payload: bytes, count: int = 1) -> PickleScan:
    """The globals of the first ``count`` pickles in ``payload`` (``count`` > 1 for the legacy
    torch.save layout, a sequence of pickles followed by raw storage bytes: scanning stops at the
    end of the data). Raises :class:`MalformedPickle` for bytes that do not parse."""
    stream = io.BytesIO(payload)
    found: list[str] = []
    opaque: str | None = None
    for _ in range(count):
        if stream.tell() >= len(payload):
            break
        scan = _scan_one(stream)
        found += scan.globals
        opaque = opaque or scan.opaque
    return PickleScan(tuple(found), opaque)


def scan_legacy(payload: bytes) -> PickleScan:
    """:func:`scan_globals` of a legacy (non-zip) ``torch.save`` file."""
    return scan_globals(payload, _MAX_PICKLES)


def _scan_one(stream: io.BytesIO) -> PickleScan:
    found: list[str] = []
    opaque: str | None = None
    memo: dict[int, str | None] = {}
    recent: list[str | None] = []  # the values pushed since the last other opcode (None: not a str)
    proto = 0
    try:
        for op, arg, pos in pickletools.genops(stream):
            name = op.name
            if name == "PROTO":
                proto = arg
            if name in _STRING_OPS:
                recent.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
            elif name in _GET_OPS:
                recent.append(memo.get(arg))
            elif name in _PUT_OPS or name == "MEMOIZE":
                memo[arg if name != "MEMOIZE" else len(memo)] = recent[-1] if recent else None
            elif name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                found.append(_resolved(module, attr, proto))
                recent = [None]
            elif name == "STACK_GLOBAL":
                if len(recent) >= 2 and recent[-1] is not None and recent[-2] is not None:
                    found.append(_resolved(str(recent[-2]), str(recent[-1]), proto))
                else:
                    opaque = opaque or f"STACK_GLOBAL at byte {pos} with names computed at load time"
                recent = [None]
            elif name in ("EXT1", "EXT2", "EXT4"):
                opaque = opaque or f"{name} (copyreg extension code {arg}) at byte {pos}"
                recent = [None]
            elif name not in _NEUTRAL_OPS:
                recent = [None]
    except Exception as e:  # noqa: BLE001 - genops raises ValueError, EOFError, UnicodeError, ...
        raise MalformedPickle(clip(f"{type(e).__name__}: {e}", 160)) from None
    return PickleScan(tuple(found), opaque)


def _resolved(module: str, name: str, proto: int) -> str:
    """``module.name`` as the unpickler resolves it: Python 2 names (``__builtin__.set``) are mapped
    to Python 3's for protocols < 3, as ``pickle.Unpickler.find_class`` does (fix_imports)."""
    if proto < 3:
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"
