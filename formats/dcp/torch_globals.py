"""torch's global names as data, and stand-ins that pickle as them without importing torch.

Reading and writing DCP pickles (``.metadata``, each chunk's ``data.pkl``) needs only the NAMES of
torch's dtypes, layouts, storage classes and rebuild functions. Importing torch to learn them costs
seconds, so they are static tables here (torch 2.13; ``tests/formats/test_dcp_torch_free.py`` compares them
with the installed torch).

:class:`Global` is an object that pickles as a reference to ``module.name`` (what a torch dtype or
class pickles as) and :class:`StandInPickler` is the pure-Python pickler that writes such references
without importing their modules. The C pickler cannot write them as they are: its ``save_global``
imports the module to check the name (``metadata_pickle`` gives its stand-ins private modules for
it, and renames them in the bytes). The pure-Python one memoizes exactly like the C one, so the
bytes are the same as torch's as long as the stand-ins have the same identities as torch's objects
(one object per dtype; one module-name string per family of globals, see :func:`module_name`).
"""

from __future__ import annotations

import pickle
from typing import Any

#: Every ``torch.<name>`` that is a ``torch.dtype`` (torch 2.13), aliases included.
DTYPE_NAMES: frozenset[str] = frozenset({
    "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble",
    "cfloat", "chalf", "complex128", "complex32", "complex64", "double", "float", "float16",
    "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu", "half", "int", "int1", "int16", "int2", "int3", "int32",
    "int4", "int5", "int6", "int64", "int7", "int8", "long", "qint32", "qint8", "quint2x4",
    "quint4x2", "quint8", "short", "uint1", "uint16", "uint2", "uint3", "uint32", "uint4", "uint5",
    "uint6", "uint64", "uint7", "uint8",
})

#: Alias -> canonical dtype name (``str(torch.float)`` is ``"torch.float32"``).
DTYPE_ALIASES: dict[str, str] = {
    "bit": "uint1", "cdouble": "complex128", "cfloat": "complex64", "chalf": "complex32",
    "double": "float64", "float": "float32", "half": "float16", "int": "int32", "long": "int64",
    "short": "int16",
}

#: Every ``torch.<name>`` that is a ``torch.layout`` (torch 2.13).
LAYOUT_NAMES: frozenset[str] = frozenset({
    "_mkldnn", "jagged", "sparse_bsc", "sparse_bsr", "sparse_coo", "sparse_csc", "sparse_csr",
    "strided",
})

#: ``torch.storage._dtype_to_storage_type_map()`` by dtype name: the typed storage class (in module
#: ``torch``) that ``torch.save`` names for a tensor of that dtype.
STORAGE_TYPE_BY_DTYPE: dict[str, str] = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage",
    "uint8": "ByteStorage", "bool": "BoolStorage", "bfloat16": "BFloat16Storage",
    "complex128": "ComplexDoubleStorage", "complex64": "ComplexFloatStorage", "qint8": "QInt8Storage",
    "qint32": "QInt32Storage", "quint8": "QUInt8Storage", "quint4x2": "QUInt4x2Storage",
    "quint2x4": "QUInt2x4Storage",
}

#: ``torch.storage._new_dtypes()`` by name: dtypes ``torch.save`` writes as an ``UntypedStorage``
#: with ``_rebuild_tensor_v3`` (they have no typed storage class).
NEW_DTYPES: frozenset[str] = frozenset({
    "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "complex32", "float4_e2m1fn_x2",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "uint16", "uint32", "uint64",
})


def canonical_dtype_name(name: str) -> str:
    """The canonical name of a torch dtype attribute name (``"float"`` -> ``"float32"``)."""
    return DTYPE_ALIASES.get(name, name)


def module_name(name: str) -> str:
    """A NEW string object equal to ``name``.

    The picklers memoize strings by identity, and torch's globals do not all share one module
    string: every dtype pickles with the same ``"torch"`` object (found by ``whichmodule``), while
    ``torch.Size`` brings its own ``Size.__module__``. A family of stand-ins shares one such object.
    """
    return "".join(list(name))


class Global:
    """Stands for the global ``module.name`` (a torch dtype, class or function) in a pickle.

    Keep one instance per global: like torch's singletons, the pickle memoizes it and refers back
    to it. ``module`` must be the family's string object (:func:`module_name`).
    """

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __reduce_ex__(self, protocol: int) -> str:
        return self.name  # a str: the pickler calls save_global(self, name)

    def __call__(self, *args: Any) -> Any:  # the pickler requires REDUCE functions to be callable
        raise TypeError(f"{self!r} is a stand-in for pickling; it cannot be called")

    def __repr__(self) -> str:
        return f"<{self.module}.{self.name}>"


class Named:
    """Base of stand-in CLASSES (needed where the pickle builds an instance with NEWOBJ):
    ``_pickle_as`` is the (module, name) the class pickles as."""

    _pickle_as: tuple[str, str] = ("", "")


def _target(obj: Any) -> tuple[str, str] | None:
    if isinstance(obj, Global):
        return obj.module, obj.name
    if isinstance(obj, type) and issubclass(obj, Named) and "_pickle_as" in obj.__dict__:
        return obj.__dict__["_pickle_as"]
    return None


class StandInPickler(pickle._Pickler):  # the pure-Python pickler: its save_global can be overridden
    """A pickler writing :class:`Global` and :class:`Named` stand-ins as their torch names."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        target = _target(obj)
        if target is None:
            super().save_global(obj, name)
            return
        module, qualname = target
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode("ascii") + b"\n" + qualname.encode("ascii") + b"\n")
        self.memoize(obj)


class _Sink:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, b: Any) -> int:
        self.parts.append(bytes(b))
        return len(b)


def dumps(obj: Any, protocol: int, persistent_id: Any = None) -> bytes:
    """Pickle ``obj`` with :class:`StandInPickler` (``persistent_id(obj)`` as in ``pickle``)."""
    sink = _Sink()
    pickler = StandInPickler(sink, protocol=protocol)
    if persistent_id is not None:
        pickler.persistent_id = persistent_id
    pickler.dump(obj)
    return b"".join(sink.parts)


# One module-name string per family, as in torch (see module_name).
_DTYPE_MODULE = module_name("torch")
_DTYPES: dict[str, Global] = {}


def dtype_global(name: str) -> Global:
    """The stand-in for ``torch.<name>`` (a dtype; canonical name), one object per dtype."""
    name = canonical_dtype_name(name)
    g = _DTYPES.get(name)
    if g is None:
        g = _DTYPES.setdefault(name, Global(_DTYPE_MODULE, name))
    return g
