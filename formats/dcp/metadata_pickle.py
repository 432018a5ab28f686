"""Pickle a DCP ``.metadata`` without importing ``torch.distributed.checkpoint``.

Importing ``torch.distributed.checkpoint`` costs ~1.5 CPU-seconds, which is a large share of a
small conversion. The pickle only needs the NAMES of its classes, so the writer builds small
stand-ins that pickle exactly like torch's dataclasses (same class names, same state, in the
same order) and dumps them with a pure-Python pickler that writes those names without importing
their modules. Unpickling (``dcp.load``, ``FileSystemReader.read_metadata``) yields torch's own
objects; a test compares them with the objects torch builds.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


class _Named:
    """Base of the stand-ins: ``_pickle_as`` is the (module, name) the pickle refers to."""

    _pickle_as: tuple[str, str] = ("", "")


def _stand_in(module: str, name: str) -> type:
    return type(f"_{name}", (_Named,), {"_pickle_as": (module, name)})


_Metadata = _stand_in(_MD, "Metadata")
_StorageMeta = _stand_in(_MD, "StorageMeta")
_TensorStorageMetadata = _stand_in(_MD, "TensorStorageMetadata")
_BytesStorageMetadata = _stand_in(_MD, "BytesStorageMetadata")
_ChunkStorageMetadata = _stand_in(_MD, "ChunkStorageMetadata")
_MetadataIndexType = _stand_in(_MD, "MetadataIndex")
_MemFormatEncoding = _stand_in(_MD, "_MEM_FORMAT_ENCODING")
_StorageInfoType = _stand_in(_FS, "_StorageInfo")


def _obj(cls: type, **state: Any) -> Any:
    o = cls.__new__(cls)
    o.__dict__.update(state)
    return o


class _MemFormat:
    """``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`` (an Enum: pickled as ``cls(0)``)."""

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (_MemFormatEncoding, (0,))


class _TensorProperties(_Named):
    """``TensorProperties`` pickles its ``__getstate__`` tuple."""

    _pickle_as = (_MD, "TensorProperties")

    def __init__(self, dtype: Any) -> None:
        import torch

        self.state = (dtype, torch.strided, False, _MemFormat(), False)

    def __reduce_ex__(self, protocol: int) -> tuple:
        import copyreg

        return (copyreg.__newobj__, (type(self),), self.state)


class MetadataIndex(_Named):
    """``MetadataIndex(fqn, offset, index)``: a dict key whose state is torch's (``offset`` only
    when given)."""

    _pickle_as = (_MD, "MetadataIndex")

    def __init__(self, fqn: str, offset: tuple[int, ...] | None = None, index: int | None = None) -> None:
        self.fqn = fqn
        self.index = index
        if offset is not None:
            import torch

            self.offset = torch.Size(offset)

    def _key(self) -> tuple:
        return (self.fqn, self.__dict__.get("offset"))

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """``filesystem._StorageInfo`` (None fields are left out of its state, as torch does)."""
    return _obj(_StorageInfoType, relative_path=relative_path, offset=offset, length=length)


def tensor_storage_metadata(dtype: Any, size: tuple[int, ...], chunks: list[tuple[tuple, tuple]]) -> Any:
    """``TensorStorageMetadata(TensorProperties(dtype), Size(size), [ChunkStorageMetadata...])``."""
    import torch

    return _obj(_TensorStorageMetadata, properties=_TensorProperties(dtype), size=torch.Size(size),
                chunks=[_obj(_ChunkStorageMetadata, offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])


def bytes_storage_metadata() -> Any:
    return _obj(_BytesStorageMetadata)


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


class _Pickler(pickle._Pickler):  # the pure-Python pickler: its save_global can be overridden
    def save_global(self, obj: Any, name: str | None = None) -> None:
        if not (isinstance(obj, type) and issubclass(obj, _Named) and "_pickle_as" in obj.__dict__):
            super().save_global(obj, name)
            return
        target = obj.__dict__["_pickle_as"]
        module, qualname = target
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def dumps(md: Any) -> bytes:
    """The pickle (protocol 4) of a stand-in ``Metadata``."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=4).dump(md)
    return buf.getvalue()


def torch_fields() -> tuple[bool, bool]:
    """(has storage_meta, has version): ``Metadata`` fields of this torch (2.4 and 2.9 added them)."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 4), (major, minor) >= (2, 9)
