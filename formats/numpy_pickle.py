"""numpy's pickled arrays, dtypes and scalars rebuilt from checked states only.

numpy's own unpickling trusts its pickle: ``dtype.__setstate__`` takes any item size, field
offsets and flags (a void dtype of size -5; an object field over raw bytes, i.e. pointers the
pickle chose), ``ndarray.__setstate__`` of an object array reads as many items as its shape says
from a list of any length (a segfault in numpy 2.4), and ``ndarray(shape, object)`` called by a
REDUCE fills gigabytes from a 60-byte pickle. The globals numpy's pickles name (``_reconstruct``,
``ndarray``, ``dtype``, ``scalar``, both module spellings) therefore resolve here to stand-ins:
plain dtypes only (bool, integer, float, complex or object kind and a byte order; no fields, no
sub-arrays), arrays whose data the pickle holds in full, scalars of exactly their item size. What
they build are real numpy values (arrays of :class:`CheckedArray`, an ``ndarray`` that pickles back
as one); anything else is one ValueError the unpickler reports with the file's name.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from formats.errors import clip

_CORE = getattr(np, "_core", None) or np.core
#: The dtype spellings ``numpy.dtype.__reduce__`` uses for plain kinds (``u4``, ``f8``, ``b1``, ``O8``).
_PLAIN_SPEC = re.compile(r"b1|[iu][1248]|f(2|4|8|12|16)|c(8|16|24|32)|O[48]")
_BYTE_ORDERS = ("<", ">", "|", "=")


def _refuse(what: str) -> ValueError:
    return ValueError(f"{clip(what, 160)}: not a plain numpy value (ckptconv rebuilds only plain dtypes and "
                      "arrays whose data the pickle holds)")


class NumpyDtype:
    """Stand-in for ``numpy.dtype(spec, align, copy)`` (REDUCE) and its ``__setstate__`` (BUILD): a
    plain dtype and its byte order; ``dtype`` is the real one, made from the spec alone."""

    def __init__(self, spec: Any, align: Any = False, copy: Any = False) -> None:
        if type(spec) is not str or not _PLAIN_SPEC.fullmatch(spec):
            raise _refuse(f"numpy.dtype({spec!r})")
        self.dtype = np.dtype(spec)

    def __setstate__(self, state: Any) -> None:
        if (not isinstance(state, tuple) or len(state) not in (8, 9) or state[0] not in (3, 4)
                or state[1] not in _BYTE_ORDERS or state[2:5] != (None, None, None)):
            raise _refuse(f"numpy dtype {self.dtype.str} with state {state!r}")
        if state[1] in "<>" and self.dtype.byteorder != "|":
            self.dtype = self.dtype.newbyteorder(state[1])

    def __reduce__(self) -> Any:
        return self.dtype.__reduce__()


def _dtype_of(value: Any, what: str) -> np.dtype:
    if not isinstance(value, NumpyDtype):
        raise _refuse(f"{what} with dtype {value!r}")
    return value.dtype


class NdarrayName:
    """Stands for ``numpy.ndarray`` as ``_reconstruct``'s argument; never builds an array itself."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(f"numpy.ndarray{args!r} called directly")


class CheckedArray(np.ndarray):
    """An array :func:`reconstruct` made: ``__setstate__`` checks the state (plain dtype, the
    pickle's data exactly the shape's size) before numpy reads it; pickles as a plain ndarray."""

    def __setstate__(self, state: Any) -> None:
        np.ndarray.__setstate__(self, checked_array_state(state))

    def __reduce__(self) -> Any:
        fn, (_, shape, code), state = np.ndarray.__reduce__(self)
        return fn, (np.ndarray, shape, code), state


def checked_array_state(state: Any) -> tuple:
    """``ndarray.__setstate__``'s ``(version, shape, dtype, is_fortran, data)`` (or the 4-tuple
    without the version) checked and with the real dtype; ValueError otherwise."""
    if not isinstance(state, tuple) or len(state) not in (4, 5):
        raise _refuse(f"numpy array state {type(state).__name__}")
    head, (shape, dtype, fortran, data) = state[:-4], state[-4:]
    if head and (type(head[0]) is not int or head[0] != 1):
        raise _refuse(f"numpy array state version {head[0]!r}")
    if not isinstance(shape, tuple) or len(shape) > 64 or not all(type(s) is int and s >= 0 for s in shape):
        raise _refuse(f"numpy array of shape {shape!r}")
    dt = _dtype_of(dtype, "numpy array")
    if type(fortran) is not bool:
        raise _refuse(f"numpy array with is_fortran {fortran!r}")
    numel = math.prod(shape)
    if dt.hasobject:
        if type(data) is not list or len(data) != numel:
            raise _refuse(f"numpy object array of shape {shape} with {type(data).__name__} data")
    elif type(data) is not bytes or len(data) != numel * dt.itemsize:
        raise _refuse(f"numpy {dt.str} array of shape {shape} with {type(data).__name__} data of "
                      f"{len(data) if isinstance(data, (bytes, list)) else '?'} items")
    return (*head, shape, dt, fortran, data)


def reconstruct(subtype: Any, shape: Any, dtype: Any) -> CheckedArray:
    """Stand-in for ``numpy.core.multiarray._reconstruct(ndarray, (0,), b'b')``: an empty array
    whose state BUILD sets (through :meth:`CheckedArray.__setstate__`)."""
    if subtype is not NdarrayName:
        raise _refuse(f"numpy _reconstruct of {subtype!r}")
    return np.ndarray.__new__(CheckedArray, (0,), np.uint8)


def scalar(dtype: Any, data: Any = None) -> Any:
    """Stand-in for ``numpy.core.multiarray.scalar(dtype, data)``: a numpy scalar of a plain,
    non-object dtype from exactly its item size of bytes."""
    dt = _dtype_of(dtype, "numpy scalar")
    if dt.hasobject or type(data) is not bytes or len(data) != dt.itemsize:
        raise _refuse(f"numpy {dt.str} scalar from {type(data).__name__}")
    return _CORE.multiarray.scalar(dt, data)


def numpy_globals() -> dict[tuple[str, str], Any]:
    """The stand-ins by the globals numpy's pickles name (both ``numpy.core`` and ``numpy._core``)."""
    out: dict[tuple[str, str], Any] = {("numpy", "ndarray"): NdarrayName, ("numpy", "dtype"): NumpyDtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[(mod, "_reconstruct")] = reconstruct
        out[(mod, "scalar")] = scalar
    return out
