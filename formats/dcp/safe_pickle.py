"""Allowlist unpickling: globals outside an allowlist raise and are never imported or called.

The allowlisted globals resolve to inert stand-ins defined here (records, dtype names, plain
tuples), not to torch classes, so unpickling runs no torch code at all and does not import torch
(dtype and layout names come from the static tables of :mod:`formats.dcp.torch_globals`).
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import os
import pickle
import pickletools
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from formats.dcp.torch_globals import DTYPE_NAMES, LAYOUT_NAMES, canonical_dtype_name
from formats.errors import CorruptCheckpointError, UnsafePickleError, clip


@dataclass(frozen=True)
class DTypeRef:
    """A torch dtype as named in a pickle (``torch.float32`` -> ``DTypeRef("float32")``)."""

    name: str


class Record:
    """Stand-in for an allowlisted class: keeps positional args, keyword args and pickled state.

    NEWOBJ builds it with ``object.__new__`` (no Python call) and BUILD calls ``__setstate__``;
    REDUCE calls ``__init__`` with the pickled args. Class-level defaults are never mutated.
    """

    _kind = "Record"
    args: tuple = ()
    kwargs: dict = {}
    state: Any = None
    fields: dict = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state
        if isinstance(state, dict):
            self.fields = state
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            self.fields = {**(state[0] if isinstance(state[0], dict) else {}), **state[1]}

    def get(self, name: str, position: int | None = None, default: Any = None) -> Any:
        """A field from the pickled state (dict or (dict, slots)), kwargs or positional args."""
        fields = self.fields
        if name in fields:
            return fields[name]
        if name in self.kwargs:
            return self.kwargs[name]
        if position is not None and position < len(self.args):
            return self.args[position]
        return default

    def __repr__(self) -> str:
        return f"<{self._kind} args={self.args!r} state={self.state!r}>"


class _Reduced(tuple):
    """The REDUCE arguments of a :class:`FastRecord` (kept as its first element)."""


class FastRecord(list):
    """A :class:`Record` the C unpickler fills without calling Python code, in little memory.

    NEWOBJ makes an empty instance and BUILD calls ``__setstate__``, here ``list.append`` (a C
    method): the record is a one-element list holding the pickled state, the very object the
    unpickler's memo holds anyway (a large ``.metadata`` has millions of these records: no
    instance dict, no copy of the state, no Python call). REDUCE (``cls(*args)``) stores its
    arguments as a first element of their own type.
    """

    __slots__ = ()
    _kind = "Record"
    __setstate__ = list.append

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.append(_Reduced((args, kwargs)))

    def _reduced(self) -> tuple[tuple, dict]:
        return tuple(self[0]) if self and type(self[0]) is _Reduced else ((), {})

    @property
    def args(self) -> tuple:
        return self._reduced()[0]

    @property
    def kwargs(self) -> dict:
        return self._reduced()[1]

    @property
    def state(self) -> Any:
        return self[-1] if self and type(self[-1]) is not _Reduced else None

    @property
    def fields(self) -> dict:
        state = self.state
        if isinstance(state, dict):
            return state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            return {**(state[0] if isinstance(state[0], dict) else {}), **state[1]}
        return {}

    def get(self, name: str, position: int | None = None, default: Any = None) -> Any:
        """A field from the pickled state, kwargs or positional args (as :meth:`Record.get`)."""
        fields = self.fields
        if name in fields:
            return fields[name]
        kwargs = self.kwargs
        if name in kwargs:
            return kwargs[name]
        args = self.args
        if position is not None and position < len(args):
            return args[position]
        return default

    __eq__ = object.__eq__  # records compare by identity, like Record (dict keys: MetadataIndex)
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<{self._kind} args={self.args!r} state={self.state!r}>"


def record_class(kind: str, fast: bool = False) -> type[Record]:
    """A fresh :class:`Record` subclass named ``kind`` (so parsed objects say what they were);
    ``fast``: a :class:`FastRecord` (filled by C code; use it for records pickled by the million)."""
    return type(kind, (FastRecord if fast else Record,), {"_kind": kind})


#: Safe builtins a container-only pickle may name (none runs code or allocates by a count).
SAFE_BUILTINS: Mapping[tuple[str, str], Any] = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("builtins", "tuple"): tuple,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("collections", "OrderedDict"): OrderedDict,
}


#: How torch names dtypes; a name of this shape that torch 2.13 lacks is a newer torch's dtype.
_DTYPE_NAME_SHAPE = re.compile(r"(u?int|float|bfloat|complex|bits|qu?int)[0-9][0-9a-z_]*")


def resolve_torch_dtype(module: str, name: str) -> DTypeRef | None:
    """``DTypeRef(canonical name)`` when ``module.name`` is a torch dtype, else None.

    A dtype-shaped name this table does not know (a newer torch's dtype) still resolves, to plain
    data: the reader then names the key and the dtype it cannot convert, instead of calling the
    pickle unsafe.
    """
    if module == "torch" and name in DTYPE_NAMES:
        return DTypeRef(canonical_dtype_name(name))
    if module == "torch" and _DTYPE_NAME_SHAPE.fullmatch(name):
        return DTypeRef(name)
    return None


def resolve_torch_layout(module: str, name: str) -> str | None:
    """The layout name when ``module.name`` is a torch layout, else None."""
    if module == "torch" and name in LAYOUT_NAMES:
        return name
    return None


class _Source:
    """A read-only file over bytes. Unlike ``io.BytesIO`` it offers no ``readinto``, which keeps
    CPython's unpickler off a path that mishandles damaged BYTEARRAY8 lengths."""

    def __init__(self, data: bytes) -> None:
        self._data, self._pos = bytes(data), 0

    def read(self, size: int = -1) -> bytes:
        stop = len(self._data) if size < 0 else min(len(self._data), self._pos + size)
        out, self._pos = self._data[self._pos : stop], max(self._pos, stop)
        return out

    def readline(self) -> bytes:
        nl = self._data.find(b"\n", self._pos)
        return self.read(-1 if nl < 0 else nl + 1 - self._pos)

    def peek(self, size: int = 1) -> bytes:
        """The next bytes without consuming them: the C unpickler then reads ahead in blocks
        instead of calling :meth:`read` once per opcode (6x faster on torch.save's protocol-2
        pickles, which have no frames)."""
        return self._data[self._pos : self._pos + max(1, size)]


def _python3_name(module: str, name: str) -> tuple[str, str]:
    """Python 3's ``(module, name)`` for a Python 2 global (``__builtin__.set`` -> ``builtins.set``),
    the mapping ``pickle.Unpickler.find_class`` applies (fix_imports) to protocol < 3 pickles such
    as ``torch.save``'s; an overriding ``find_class`` loses it. The result is still allowlisted."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class AllowlistUnpickler(pickle.Unpickler):
    """Unpickler resolving globals through ``resolve``; anything it does not know is refused.

    ``resolve(module, name)`` returns the stand-in object or None (refused). Persistent ids go to
    ``persistent`` (refused when None).
    """

    def __init__(
        self,
        data: bytes,
        source: str,
        resolve: Callable[[str, str], Any],
        persistent: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(_Source(data))
        self._source = source
        self._resolve = resolve
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        found = self._resolve(module, name)
        if found is None:
            found = self._resolve(*_python3_name(module, name))
        if found is None:
            raise UnsafePickleError(
                f"{self._source}: pickle references {clip(f'{module}.{name}', 160)}, which is not on the "
                "allowlist; it was not imported or executed (the file may be malicious)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise CorruptCheckpointError(f"{self._source}: unexpected persistent id in pickle")
        return self._persistent(pid)


_REFUSED_OPS = frozenset({"BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER"})
_MEMO_OPS = frozenset({"BINPUT", "LONG_BINPUT", "PUT"})
#: Deepest MARK nesting a pickle may use (DCP's pickles nest a handful of levels).
MAX_PICKLE_NESTING = 1000
#: Pickles up to this size are walked opcode by opcode before unpickling (:func:`prescan`, pure
#: Python, ~2 MB/s: at most ~0.1 s); larger ones (a big ``.metadata``) unpickle under an address-space cap instead.
PRESCAN_MAX_BYTES = 256 << 10
#: Address space a capped unpickling may add: this much plus ``CAP_PER_BYTE`` per pickle byte
#: (a DCP ``.metadata`` needs ~10 bytes of objects per pickle byte: its memo keeps every record).
CAP_BASE_BYTES = 1 << 30
CAP_PER_BYTE = 16


def prescan(data: bytes, source: str) -> None:
    """Walk the opcodes of a small pickle before unpickling it (pure Python, ~1 MB/s).

    Refuses what could make CPython's unpickler allocate far more memory than the pickle's size,
    or build what later code cannot walk: memo indices beyond the number of opcodes read (the C
    memo table grows to twice the index), out-of-band buffers, MARK nesting deeper than
    :data:`MAX_PICKLE_NESTING`. Truncated arguments and declared sizes past the end are caught
    here too (``genops`` reads every argument).
    """
    depth = 0
    try:
        for n, (op, arg, _) in enumerate(pickletools.genops(data)):
            name = op.name
            if name in _REFUSED_OPS:
                raise CorruptCheckpointError(f"{source}: pickle uses {name}; not a DCP pickle")
            if name in _MEMO_OPS and int(arg) > n:
                raise CorruptCheckpointError(f"{source}: pickle memo index {arg} is out of range")
            if name == "MARK":
                depth += 1
                if depth > MAX_PICKLE_NESTING:
                    raise CorruptCheckpointError(f"{source}: pickle nests deeper than {MAX_PICKLE_NESTING} levels")
            elif op.stack_before and pickletools.markobject in op.stack_before:
                depth -= 1
    except CorruptCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{source}: damaged pickle ({clip(str(exc), 160)})") from None


@contextlib.contextmanager
def address_space_cap(extra: int) -> Iterator[None]:
    """Let this process's address space grow by at most ``extra`` bytes inside the block (Linux:
    ``RLIMIT_AS``; elsewhere no cap): an allocation past it raises MemoryError at once instead of
    paging in gigabytes (a damaged memo index asks the C unpickler for 16 bytes per index)."""
    try:
        import resource

        with open("/proc/self/statm", "rb") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        yield
        return
    cap = vm + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield  # already capped tighter
        return
    try:
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def safe_loads(
    data: bytes,
    source: str,
    resolve: Callable[[str, str], Any],
    persistent: Callable[[Any], Any] | None = None,
    scan: bool = False,
    capped: bool = False,
) -> Any:
    """Unpickle ``data`` with the allowlist; damaged pickles raise CorruptCheckpointError.

    ``scan`` runs :func:`prescan` first (use it for small pickles such as ``data.pkl``); without
    it, pickles up to :data:`PRESCAN_MAX_BYTES` are prescanned and larger ones unpickle under
    :func:`address_space_cap` (memory bounded by their size, whatever their memo indices say).
    ``capped`` unpickles any size under the cap, without the prescan (pickles parsed by the
    thousand, e.g. the per-rank files of a DeepSpeed folder, where the pure-Python opcode walk
    would cost as much again as the load).
    """
    if not capped and (scan or len(data) <= PRESCAN_MAX_BYTES):
        prescan(data, source)
        cap = contextlib.nullcontext()
    else:
        cap = address_space_cap(CAP_BASE_BYTES + CAP_PER_BYTE * len(data))
    try:
        with cap:
            return AllowlistUnpickler(data, source, resolve, persistent).load()
    except (UnsafePickleError, CorruptCheckpointError):
        raise
    except RecursionError:
        raise CorruptCheckpointError(f"{source}: pickle nests too deeply") from None
    except MemoryError:
        raise CorruptCheckpointError(f"{source}: pickle asks for too much memory") from None
    except Exception as exc:  # truncated / garbage pickles raise many builtin types
        raise CorruptCheckpointError(
            f"{source}: damaged pickle ({type(exc).__name__}: {clip(str(exc), 160)}); the file is truncated "
            "or not a pickle"
        ) from None
