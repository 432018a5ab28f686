"""Whole ``torch.save`` files (``.pt``) read without ``torch.load``, and small ones written back.

A training framework's own checkpoint file (Megatron-LM's ``model_optim_rng.pt`` and
``distrib_optim.pt``, DeepSpeed's ``*_model_states.pt``) is one ``torch.save`` zip archive: a
``data.pkl`` holding the whole state (dicts, lists, numbers, ``argparse.Namespace``, numpy RNG
states, framework objects) whose tensors are references to storages ``data/<key>``. Reading it
(:func:`read_torch_file`) parses the zip directory and ``data.pkl`` only: through the allowlist
unpickler (:mod:`formats.dcp.safe_pickle`), tensors become descriptions (dtype, size, stride,
storage offset: :class:`formats.dcp.archive.TensorDesc`, located by :meth:`TorchFile.tensor`), and
the objects of named framework modules become inert :class:`PickledObject` records that keep what
the pickle said (class, arguments, state) and import nothing. Tensor regions are then read from the
storages like any chunk (:func:`formats.dcp.archive.read_region_into`).

Writing (:func:`torch_save_bytes`) pickles such a value back: records as the same globals and
arguments, descriptions as tensors whose bytes a callback supplies, every other value as itself. The
archive is the one ``torch.save`` writes (records ``data.pkl``, ``.format_version``,
``.storage_alignment``, ``byteorder``, ``data/<i>``, ``version``, ``.data/serialization_id``;
storages 64-byte aligned); ``torch.load`` reads it. Sub-values of a big file (its args, RNG state,
optimizer hyperparameters) become self-contained entries this way.
"""

from __future__ import annotations

import argparse
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from formats.dcp.archive import (ArchiveTensor, Entry, SliceReader, TensorDesc, describe_tensor, open_archive,
                                 resolve_tensor_global, storage_loader)
from formats.dcp.safe_pickle import SAFE_BUILTINS, DTypeRef, safe_loads
from formats.errors import CorruptCheckpointError
from formats.numpy_pickle import numpy_globals

#: Largest ``data.pkl`` of a whole checkpoint file parsed (its structure: keys, shapes, args).
MAX_FILE_PICKLE_BYTES = 256 << 20


class PickledObject:
    """An object of a class the reader does not import, as its pickle built it: the class
    (``module``, ``name``), the arguments it was made with (``NEWOBJ``: ``cls.__new__(cls, *args)``;
    ``REDUCE``: ``cls(*args)``) and the state ``BUILD`` gave it. Pickles back the same way."""

    module: str = ""
    name: str = ""

    def __new__(cls, *args: Any) -> PickledObject:
        obj = object.__new__(cls)
        obj.args, obj.state, obj.newobj = args, None, True
        return obj

    def __init__(self, *args: Any) -> None:  # REDUCE (cls(*args)); NEWOBJ never calls it
        self.newobj = False

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def kind(self) -> str:
        return f"{self.module}.{self.name}"

    def __repr__(self) -> str:
        return f"<{self.kind} args={self.args!r} state={self.state!r}>"


_CLASSES: dict[tuple[str, str], type] = {}


def pickled_class(module: str, name: str) -> type[PickledObject]:
    """The stand-in class of global ``module.name`` (one per global: the pickle's memo refers to it)."""
    cls = _CLASSES.get((module, name))
    if cls is None:
        from formats.dcp.torch_globals import Named

        cls = type(name, (PickledObject, Named), {"module": module, "name": name, "_pickle_as": (module, name),
                                                  "__module__": __name__})
        _CLASSES[(module, name)] = cls
    return cls


def rebuild_parameter(data: Any, *_: Any) -> Any:
    """Stand-in for ``torch._utils._rebuild_parameter*``: the (described) data itself."""
    return data


def rebuild_from_type(func: Any, _new_type: Any, args: Any, _state: Any) -> Any:
    """Stand-in for ``torch._tensor._rebuild_from_type_v2`` (tensors with attributes, e.g. ZeRO-3's flat
    groups with their ds_id): only the inner (allowlisted) tensor rebuild runs."""
    return func(*args)


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for ``bytes`` values (``latin1`` text)."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise TypeError(f"_codecs.encode({type(text).__name__}, {encoding!r})")
    return text.encode("latin1")


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()``, as protocol-2 pickles spell an empty ``bytes`` value (an empty numpy array's
    data); never ``bytes(n)`` (``n`` zero bytes from a few bytes of pickle)."""
    if args:
        raise TypeError(f"bytes{args!r}")
    return b""


#: Plain-data globals a checkpoint file may name, read as themselves (``argparse.Namespace`` is
#: rebuilt with ``object.__new__`` and its ``__dict__`` filled: no code of its own runs).
_PLAIN = {
    **SAFE_BUILTINS,
    ("argparse", "Namespace"): argparse.Namespace,
    ("torch._utils", "_rebuild_parameter"): rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type,
    ("torch", "Size"): tuple,
    ("_codecs", "encode"): _encode,
    ("builtins", "bytes"): _empty_bytes,
}


def file_resolver(framework_modules: Iterable[str] = (), trust_pickle: bool = False) -> Callable[[str, str], Any]:
    """The globals of a checkpoint file: torch's tensor machinery as descriptions, plain data
    (:data:`_PLAIN`) as itself, numpy's arrays, dtypes and scalars through checked stand-ins
    (:mod:`formats.numpy_pickle`), classes of ``framework_modules`` (and, with
    ``trust_pickle``, of any module) as :func:`pickled_class` records; None (refused) otherwise."""
    prefixes = tuple(framework_modules)
    plain = {**_PLAIN, **numpy_globals()}

    def resolve(module: str, name: str) -> Any:
        found = plain.get((module, name))
        if found is not None:
            return found
        found = resolve_tensor_global(module, name)
        if found is not None:
            return found
        if trust_pickle or any(module == p or module.startswith(p + ".") for p in prefixes):
            return pickled_class(module, name)
        return None

    return resolve


@dataclass(frozen=True)
class TorchFile:
    """One parsed ``torch.save`` file: its value (tensors as descriptions) and zip entries."""

    name: str  # relative to the checkpoint root (ChunkRef.file)
    where: str  # for messages: the full path or URL
    size: int
    value: Any
    entries: dict[str, Entry]
    prefix: str

    def tensor(self, desc: Any, what: str) -> ArchiveTensor:
        """Where the bytes of tensor description ``desc`` lie (bounds checked; ``what`` names it)."""
        return describe_tensor(desc, self.entries, self.prefix, f"{self.where}: {what}")


def read_torch_file(fd: Any, name: str, where: str, size: int, resolve: Callable[[str, str], Any],
                    max_pickle: int = MAX_FILE_PICKLE_BYTES, what: str = "", lazy: bool = False) -> TorchFile:
    """Parse the ``torch.save`` file open as ``fd`` (an OS fd or a ``formats.storage.RandomFile``)
    of ``size`` bytes: zip directory and ``data.pkl`` through ``resolve`` (:func:`file_resolver`),
    nothing else read. ``what`` names the file's role in messages.

    ``lazy``: the storages' local headers are not read (their ``Entry.local`` is False: see
    :func:`formats.dcp.archive.local_data_start`), nor is the pickle prescanned (it loads under
    the address-space cap): a folder of a thousand ranks' files opens in a few reads each."""
    entries, prefix, pkl = open_archive(SliceReader(fd, 0, size, where), where, lazy)
    if len(pkl) > max_pickle:
        raise CorruptCheckpointError(f"{where}: data.pkl of {len(pkl)} bytes is too large for "
                                     f"{what or 'a checkpoint file'} (over the {max_pickle} byte limit)")
    value = safe_loads(pkl, f"{where} ({what or 'data.pkl'})", resolve, storage_loader(where), capped=lazy)
    return TorchFile(name, where, size, value, entries, prefix)


def read_torch_bytes(data: bytes, where: str, resolve: Callable[[str, str], Any],
                     max_pickle: int = MAX_FILE_PICKLE_BYTES) -> tuple[Any, Callable[[Any], bytes]]:
    """A ``torch.save`` payload in memory parsed as :func:`read_torch_file` does: (its value,
    ``data_of``: a tensor description -> the bytes of its whole storage, for :func:`plan_value`)."""
    from formats.dcp.archive import BufferReader

    entries, prefix, pkl = open_archive(BufferReader(data, where), where)
    if len(pkl) > max_pickle:
        raise CorruptCheckpointError(f"{where}: data.pkl of {len(pkl)} bytes is over the {max_pickle} byte limit")
    value = safe_loads(pkl, f"{where} (data.pkl)", resolve, storage_loader(where))
    file = TorchFile(where, where, len(data), value, entries, prefix)

    def data_of(desc: Any) -> bytes:
        at = file.tensor(desc, "tensor")
        return bytes(memoryview(data)[at.data_start: at.data_start + at.data_length])

    return value, data_of


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor description of a parsed file."""
    return isinstance(value, TensorDesc)


# ---------------------------------------------------------------------------------------------
# writing small values back


class _Storage:
    """A storage of the written archive (emitted as a persistent id, as torch does)."""

    def __init__(self, key: str, storage_type: Any, numel: int) -> None:
        self.pid = ("storage", storage_type, key, "cpu", numel)


def _make_value_pickler():  # noqa: ANN202 - built lazily: torch_globals' pickler class
    from formats.dcp.torch_globals import NEW_DTYPES, STORAGE_TYPE_BY_DTYPE, Global, StandInPickler, dtype_global
    from formats.dtypes import itemsize_of

    rebuild_v2, rebuild_v3 = Global("torch._utils", "_rebuild_tensor_v2"), Global("torch._utils", "_rebuild_tensor_v3")
    untyped = Global("torch.storage", "UntypedStorage")
    typed = {d: Global("torch", n) for d, n in STORAGE_TYPE_BY_DTYPE.items()}

    class ValuePickler(StandInPickler):
        """Pickles a parsed value: tensor descriptions as tensors (storage bytes from ``data_of``),
        records as their globals and arguments, dtype references as torch dtypes."""

        def __init__(self, sink: Any, data_of: Callable[[Any], bytes]) -> None:
            super().__init__(sink, protocol=2)
            self.data_of = data_of
            self.storages: list[bytes | int] = []  # bytes, or the size of a slot's storage
            self._by_ref: dict[str, _Storage] = {}

        def persistent_id(self, obj: Any) -> Any:
            return obj.pid if isinstance(obj, _Storage) else None

        def save(self, obj: Any, save_persistent_id: bool = True) -> None:
            if isinstance(obj, DTypeRef):
                obj = dtype_global(obj.name)
            super().save(obj, save_persistent_id)

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, TensorDesc):
                return self._tensor(obj)
            if isinstance(obj, SlotTensor):
                return self._slot(obj)
            if isinstance(obj, PickledObject):
                cls = type(obj)
                if obj.newobj:
                    return (_newobj, (cls, *obj.args), obj.state)
                return (cls, tuple(obj.args), obj.state)
            return NotImplemented

        def _slot(self, slot: SlotTensor) -> tuple:
            numel = math.prod(slot.shape)
            new = slot.dtype in NEW_DTYPES
            storage = _Storage(str(len(self.storages)), untyped if new else typed[slot.dtype],
                               numel * itemsize_of(slot.dtype) if new else numel)
            slot.storage = len(self.storages)
            self.storages.append(numel * itemsize_of(slot.dtype))
            return self._rebuild(slot.dtype, storage, 0, slot.shape, contiguous_strides(slot.shape))

        def _rebuild(self, dtype: str, storage: _Storage, offset: int, size: tuple, stride: tuple) -> tuple:
            if dtype in NEW_DTYPES:
                return rebuild_v3, (storage, offset, size, stride, False, OrderedDict(), dtype_global(dtype))
            return rebuild_v2, (storage, offset, size, stride, False, OrderedDict())

        def _tensor(self, desc: Any) -> tuple:
            storage = self._by_ref.get(desc.storage.key)
            if storage is None:
                data = self.data_of(desc)
                new = desc.dtype in NEW_DTYPES
                numel = len(data) if new else len(data) // itemsize_of(desc.dtype)
                storage = _Storage(str(len(self.storages)), untyped if new else typed[desc.dtype], numel)
                self.storages.append(data)
                self._by_ref[desc.storage.key] = storage
            return self._rebuild(desc.dtype, storage, desc.storage_offset, tuple(desc.size), tuple(desc.stride))

    from formats.dcp.archive_writer import contiguous_strides

    return ValuePickler


def _newobj(cls: Any, *args: Any) -> Any:
    """Stands for ``copyreg.__newobj__``: a reduce value naming it makes the pickler write NEWOBJ."""
    raise TypeError("a stand-in for pickling")


_newobj.__name__ = "__newobj__"


class SlotTensor:
    """A contiguous tensor of ``dtype`` and ``shape`` inside a value to write (:func:`plan_value`)
    whose bytes come later: pickled as a tensor on a storage of its own (``storage``, its index,
    is set when pickled)."""

    def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape, self.storage = dtype, tuple(int(s) for s in shape), -1

    @property
    def nbytes(self) -> int:
        from formats.dtypes import itemsize_of

        return math.prod(self.shape) * itemsize_of(self.dtype)


def plan_value(value: Any, data_of: Callable[[Any], bytes] | None = None) -> tuple[bytes, list[bytes | int]]:
    """``(data.pkl, storages)`` of ``torch.save(value)``: each storage its bytes (tensor descriptions,
    through ``data_of``) or, for a :class:`SlotTensor`, its size (the bytes are written later)."""
    from formats.dcp.torch_globals import _Sink

    def no_tensors(desc: Any) -> bytes:
        raise ValueError("a tensor inside the value, and no data_of to read it")

    sink = _Sink()
    pickler = _make_value_pickler()(sink, data_of or no_tensors)
    pickler.dump(value)
    return b"".join(sink.parts), pickler.storages


def torch_save_bytes(value: Any, data_of: Callable[[Any], bytes] | None = None) -> bytes:
    """The bytes ``torch.save(value)`` would write for a parsed value (tensor descriptions' storage
    bytes from ``data_of(desc)``: the whole storage of each distinct storage, C order)."""
    from formats.dcp.archive_writer import write_torch_archive

    pkl, storages = plan_value(value, data_of)
    return write_torch_archive(pkl, storages)
