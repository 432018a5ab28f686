"""One table for dtypes: torch <-> storage numpy dtype <-> safetensors name.

Zarr v3 (3.1) has no bfloat16 and no float8. Those are stored losslessly as unsigned integers of
the same width (bf16 -> uint16, float8 -> uint8) holding the exact bit patterns; the torch dtype is
recorded next to the array and restored with ``Tensor.view``. Stock zarr opens such arrays with
no registration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from formats.errors import UnsupportedError


@dataclass(frozen=True)
class DType:
    """One row of the dtype table."""

    name: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    torch_dtype: torch.dtype
    storage: str  # numpy dtype name the bytes are stored as, e.g. "uint16"
    safetensors: str  # safetensors dtype name, e.g. "BF16"
    itemsize: int

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of the stored bit pattern."""
        return np.dtype(self.storage)

    @property
    def encoded(self) -> bool:
        """True where the storage dtype differs from the torch dtype (a bit-pattern view)."""
        return self.storage != self.name


def _row(name: str, storage: str, st: str) -> DType:
    t = getattr(torch, name)
    return DType(name, t, storage, st, torch.empty((), dtype=t).element_size())


_TABLE: tuple[DType, ...] = (
    _row("float64", "float64", "F64"),
    _row("float32", "float32", "F32"),
    _row("float16", "float16", "F16"),
    _row("bfloat16", "uint16", "BF16"),
    _row("float8_e4m3fn", "uint8", "F8_E4M3"),
    _row("float8_e5m2", "uint8", "F8_E5M2"),
    _row("float8_e4m3fnuz", "uint8", "F8_E4M3FNUZ"),
    _row("float8_e5m2fnuz", "uint8", "F8_E5M2FNUZ"),
    *((_row("float8_e8m0fnu", "uint8", "F8_E8M0"),) if hasattr(torch, "float8_e8m0fnu") else ()),
    _row("int64", "int64", "I64"),
    _row("int32", "int32", "I32"),
    _row("int16", "int16", "I16"),
    _row("int8", "int8", "I8"),
    _row("uint8", "uint8", "U8"),
    _row("uint16", "uint16", "U16"),
    _row("uint32", "uint32", "U32"),
    _row("uint64", "uint64", "U64"),
    _row("bool", "bool", "BOOL"),
    _row("complex64", "complex64", "C64"),
    _row("complex128", "complex128", "C128"),
)

#: Dtypes ``--dtype`` casts between (float8 and integer tensors are always kept as they are).
CASTABLE_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
BY_TORCH: dict[torch.dtype, DType] = {d.torch_dtype: d for d in _TABLE}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _TABLE}


def by_name(name: str) -> DType:
    """Look a dtype up by torch name ("bfloat16" or "torch.bfloat16")."""
    key = name.removeprefix("torch.")
    try:
        return BY_NAME[key]
    except KeyError:
        raise UnsupportedError(
            f"dtype {name!r} is not supported; supported: {', '.join(BY_NAME)}"
        ) from None


def by_torch(dtype: torch.dtype) -> DType:
    """Look a dtype up by torch dtype."""
    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedError(f"dtype {dtype} is not supported") from None


def by_safetensors(name: str) -> DType:
    """Look a dtype up by safetensors name ("BF16")."""
    try:
        return BY_SAFETENSORS[name]
    except KeyError:
        raise UnsupportedError(f"safetensors dtype {name!r} is not supported") from None


def to_storage_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of the tensor's exact bits in its storage dtype (zero-copy when contiguous)."""
    d = by_torch(t.dtype)
    t = t.contiguous()
    if d.encoded:
        t = t.view(getattr(torch, d.storage))
    return t.numpy()


def from_storage_array(a: np.ndarray, name: str) -> torch.Tensor:
    """The torch tensor whose bits are ``a`` (zero-copy), with the recorded torch dtype."""
    d = by_name(name)
    t = torch.from_numpy(np.ascontiguousarray(a)).reshape(a.shape)  # ascontiguousarray makes 0-d 1-d
    if d.encoded:
        t = t.view(d.torch_dtype)
    return t
