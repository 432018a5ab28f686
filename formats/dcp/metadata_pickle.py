"""Pickle a DCP ``.metadata`` without importing ``torch.distributed.checkpoint``.

Importing ``torch.distributed.checkpoint`` costs ~1.5 CPU-seconds, which is a large share of a
small conversion. The pickle only needs the NAMES of its classes, so the writer builds small
stand-ins that pickle exactly like torch's dataclasses (same class names, same state, in the
same order). Unpickling (``dcp.load``, ``FileSystemReader.read_metadata``) yields torch's own
objects; a test compares them with the objects torch builds.

:func:`dumps` uses the C pickler (~9 us an item; the pure-Python one takes ~70: 2 s for a 25,000-chunk
``--mesh tp2,dp32`` checkpoint, a minute at 10^6 chunks). The C pickler writes a global only once it
has found it by its module's name, so every stand-in here also lives in a private module of this
process (:class:`_PrivateModules`) whose random name is as long as the torch module it stands for;
the private names in the pickle are then replaced by torch's, byte for byte (the frames keep their
lengths). Where that cannot be done exactly (a private name also in the data), the pure-Python
pickler (:func:`formats.dcp.torch_globals.dumps`) writes it, with the same bytes.
"""

from __future__ import annotations

import copyreg
import importlib.metadata
import io
import pickle
import random
import re
import string
import sys
import threading
import types
from typing import Any

from formats.dcp.torch_globals import _DTYPES, Global, Named, dtype_global, module_name
from formats.dcp.torch_globals import dumps as _dumps

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"

def _stand_in(module: str, name: str) -> type:
    return type(f"_{name}", (Named,), {"_pickle_as": (module, name)})


_Metadata = _stand_in(_MD, "Metadata")
_StorageMeta = _stand_in(_MD, "StorageMeta")
_TensorStorageMetadata = _stand_in(_MD, "TensorStorageMetadata")
_BytesStorageMetadata = _stand_in(_MD, "BytesStorageMetadata")
_ChunkStorageMetadata = _stand_in(_MD, "ChunkStorageMetadata")
_MetadataIndexType = _stand_in(_MD, "MetadataIndex")
_MemFormatEncoding = Global(_MD, "_MEM_FORMAT_ENCODING")
_StorageInfoType = _stand_in(_FS, "_StorageInfo")
_SizeType = Global(module_name("torch"), "Size")  # Size.__module__: not the dtypes' "torch" string
_GetLayout = Global(module_name("torch.serialization"), "_get_layout")


class Size(tuple):
    """``torch.Size(dims)``: pickles as ``torch.Size((d0, d1, ...))`` (a fresh args tuple each
    time, like ``torch.Size.__reduce__``)."""

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (_SizeType, (tuple(self),))


class _Singleton:
    """A torch singleton (an enum member, a layout) pickled once and referred back to after."""

    def __init__(self, func: Global, args: tuple) -> None:
        self._reduced = (func, tuple(list(args)))  # an args tuple of its own (memoized by id)

    def __reduce_ex__(self, protocol: int) -> tuple:
        return self._reduced


#: ``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`` (an Enum member: ``cls(0)``).
_CONTIGUOUS_FORMAT = _Singleton(_MemFormatEncoding, (0,))
#: ``torch.strided`` (copyreg pickles layouts as ``torch.serialization._get_layout(name)``).
_STRIDED = _Singleton(_GetLayout, ("torch.strided",))


def _obj(cls: type, **state: Any) -> Any:
    o = cls.__new__(cls)
    o.__dict__.update(state)
    return o


class _TensorProperties(Named):
    """``TensorProperties`` pickles its ``__getstate__`` tuple
    ``(dtype, layout, requires_grad, memory_format, pin_memory)``."""

    _pickle_as = (_MD, "TensorProperties")

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype  # its name (not pickled: the state below is)
        self.state = (dtype_global(dtype), _STRIDED, False, _CONTIGUOUS_FORMAT, False)

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (copyreg.__newobj__, (type(self),), self.state)


class MetadataIndex(Named):
    """``MetadataIndex(fqn, offset, index)``: a dict key whose state is torch's (``offset`` only
    when given)."""

    _pickle_as = (_MD, "MetadataIndex")

    def __init__(self, fqn: str, offset: tuple[int, ...] | None = None, index: int | None = None) -> None:
        self.fqn = fqn
        self.index = index
        if offset is not None:
            self.offset = Size(offset)

    def _key(self) -> tuple:
        return (self.fqn, self.__dict__.get("offset"))

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """``filesystem._StorageInfo`` (None fields are left out of its state, as torch does)."""
    return _obj(_StorageInfoType, relative_path=relative_path, offset=offset, length=length)


def tensor_storage_metadata(dtype: str, size: tuple[int, ...], chunks: list[tuple[tuple, tuple]]) -> Any:
    """``TensorStorageMetadata(TensorProperties(dtype), Size(size), [ChunkStorageMetadata...])``;
    ``dtype`` is a torch dtype name (``"bfloat16"``)."""
    return _obj(_TensorStorageMetadata, properties=_TensorProperties(dtype), size=Size(size),
                chunks=[_obj(_ChunkStorageMetadata, offsets=Size(o), sizes=Size(s)) for o, s in chunks])


def bytes_storage_metadata() -> Any:
    """``BytesStorageMetadata()``."""
    return _obj(_BytesStorageMetadata)


def is_bytes_entry(entry: Any) -> bool:
    """True for a stand-in ``BytesStorageMetadata`` (a non-tensor entry)."""
    return type(entry) is _BytesStorageMetadata


def metadata(sd_md: dict, planner_data: dict, storage: dict, checkpoint_id: Any, save_id: str,
             version: str | None, with_storage_meta: bool) -> Any:
    """``Metadata`` with ``storage_meta`` / ``version`` when this torch has those fields."""
    state: dict[str, Any] = {"state_dict_metadata": sd_md, "planner_data": planner_data, "storage_data": storage}
    if with_storage_meta:
        state["storage_meta"] = _obj(_StorageMeta, checkpoint_id=checkpoint_id, save_id=save_id, load_id=None,
                                     modules=[])
    if version is not None:
        state["version"] = version
    return _obj(_Metadata, **state)


def dumps(md: Any) -> bytes:
    """The pickle (protocol 4, what ``FileSystemWriter`` writes) of a stand-in ``Metadata``."""
    fast = _fast_dumps(md)
    return fast if fast is not None else slow_dumps(md)


def slow_dumps(md: Any) -> bytes:
    """:func:`dumps` by the pure-Python pickler (the same bytes, ~8x slower)."""
    return _dumps(md, protocol=4)


class _PrivateModules:
    """Importable homes for the stand-ins, so that the C pickler finds them: for each torch module
    a module in ``sys.modules`` under a random name of the same length (the pickle's bytes are
    then renamed in place), holding the stand-ins of that module under their torch names.

    A family of stand-ins shares one module-name string object (:func:`module_name`): the pickle
    writes a module name once per such object, so each family gets its own private string."""

    _CHARS = string.ascii_letters + string.digits

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.private: dict[str, str] = {}  # torch module -> private module name
        self._families: dict[int, tuple[str, str]] = {}  # id(family string) -> (it, its private string)
        self.families_of: dict[str, int] = {}  # private module name -> family strings using it
        self._classes: dict[int, type] = {}  # id(family string) -> the Global subclass of that family

    def _module(self, real: str) -> types.ModuleType:
        name = self.private.get(real)
        if name is None:
            rng = random.SystemRandom()
            while True:
                name = "_" + "".join(rng.choice(self._CHARS) for _ in range(len(real) - 1))
                if name not in sys.modules:
                    break
            sys.modules[name] = types.ModuleType(name, "ckptconv: stand-ins of torch's " + real)
            self.private[real] = name
            self.families_of[name] = 0
        return sys.modules[name]

    def _family(self, family: str) -> str:
        entry = self._families.get(id(family))
        if entry is None:
            module = self._module(family)
            entry = self._families[id(family)] = (family, module_name(module.__name__))
            self.families_of[module.__name__] += 1
        return entry[1]

    def add_class(self, cls: type, family: str, name: str) -> None:
        """Home the stand-in class ``cls`` (pickled as ``family.name``)."""
        with self._lock:
            private = self._family(family)
            cls.__module__, cls.__qualname__ = private, name
            setattr(sys.modules[private], name, cls)

    def add_global(self, g: Global) -> None:
        """Home the stand-in global ``g`` (its class becomes one whose ``__module__`` is its
        family's private string; it stays a :class:`Global`)."""
        with self._lock:
            if getattr(sys.modules.get(self.private.get(g.module, "")), g.name, None) is g:
                return
            private = self._family(g.module)
            cls = self._classes.get(id(g.module))
            if cls is None:
                cls = self._classes[id(g.module)] = type("Global", (Global,), {"__slots__": (), "__module__": private})
            g.__class__ = cls
            setattr(sys.modules[private], g.name, g)

    def rename(self, data: bytes) -> bytes | None:
        """The pickle with every private module name replaced by torch's (None: a private name
        shows up more often than its families can write it, i.e. also inside the data)."""
        for real, private in self.private.items():
            ours = b"\x8c" + bytes([len(private)]) + private.encode()  # SHORT_BINUNICODE
            found = data.count(ours)
            if found > self.families_of[private]:
                return None
            if found:
                data = data.replace(ours, b"\x8c" + bytes([len(real)]) + real.encode())
        return data


_PRIVATE = _PrivateModules()
for _cls in (_Metadata, _StorageMeta, _TensorStorageMetadata, _BytesStorageMetadata, _ChunkStorageMetadata,
             _MetadataIndexType, _StorageInfoType, _TensorProperties, MetadataIndex):
    _PRIVATE.add_class(_cls, *_cls.__dict__["_pickle_as"])
for _g in (_MemFormatEncoding, _SizeType, _GetLayout):
    _PRIVATE.add_global(_g)


def _fast_dumps(md: Any) -> bytes | None:
    """:func:`dumps` by the C pickler, or None where only the pure-Python one writes it exactly."""
    for g in list(_DTYPES.values()):  # made on first use (dtype_global)
        _PRIVATE.add_global(g)
    out = io.BytesIO()
    try:
        pickle.Pickler(out, protocol=4).dump(md)
    except (pickle.PicklingError, AttributeError, TypeError):
        return None
    return _PRIVATE.rename(out.getvalue())


def torch_fields() -> tuple[bool, bool]:
    """(has storage_meta, has version): ``Metadata`` fields of the installed torch (2.4 and 2.9
    added them), read from the package version without importing torch. Without torch installed:
    the newest layout."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return True, True
    try:
        major, minor = (int(x) for x in re.findall(r"\d+", version)[:2])
    except ValueError:
        return True, True
    return (major, minor) >= (2, 4), (major, minor) >= (2, 9)
