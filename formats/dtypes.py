"""One table for dtypes: torch name <-> storage numpy dtype <-> safetensors name.

Zarr v3 (3.1) has no bfloat16 and no float8. Those are stored losslessly as unsigned integers of
the same width (bf16 -> uint16, float8 -> uint8) holding the exact bit patterns; the torch dtype is
recorded next to the array and restored with ``Tensor.view``. Stock zarr opens such arrays with
no registration.

The table itself needs no torch: the copy path (read bytes, write bytes) works on numpy arrays of
the storage dtype ("bit arrays"), and torch is imported only where a torch tensor is asked for
(``DType.torch_dtype``, :func:`to_storage_array`, :func:`from_storage_array`).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from formats.errors import ConfigError, UnsupportedError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    """One row of the dtype table."""

    name: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    storage: str  # numpy dtype name the bytes are stored as, e.g. "uint16"
    safetensors: str  # safetensors dtype name, e.g. "BF16"
    itemsize: int

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.name)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of the stored bit pattern."""
        return np.dtype(self.storage)

    @property
    def encoded(self) -> bool:
        """True where the storage dtype differs from the torch dtype (a bit-pattern view)."""
        return self.storage != self.name


def _row(name: str, storage: str, st: str) -> DType:
    return DType(name, storage, st, np.dtype(storage).itemsize)


def _torch_has_e8m0() -> bool:
    """Whether the installed torch has ``float8_e8m0fnu`` (2.7+), read from its version, not imported."""
    from importlib import metadata

    try:
        major, minor = (int(x) for x in re.findall(r"\d+", metadata.version("torch"))[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return True
    return (major, minor) >= (2, 7)


_TABLE: tuple[DType, ...] = (
    _row("float64", "float64", "F64"),
    _row("float32", "float32", "F32"),
    _row("float16", "float16", "F16"),
    _row("bfloat16", "uint16", "BF16"),
    _row("float8_e4m3fn", "uint8", "F8_E4M3"),
    _row("float8_e5m2", "uint8", "F8_E5M2"),
    _row("float8_e4m3fnuz", "uint8", "F8_E4M3FNUZ"),
    _row("float8_e5m2fnuz", "uint8", "F8_E5M2FNUZ"),
    *((_row("float8_e8m0fnu", "uint8", "F8_E8M0"),) if _torch_has_e8m0() else ()),
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
        return BY_NAME[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise UnsupportedError(f"dtype {dtype} is not supported") from None


def by_safetensors(name: str) -> DType:
    """Look a dtype up by safetensors name ("BF16")."""
    try:
        return BY_SAFETENSORS[name]
    except KeyError:
        raise UnsupportedError(f"safetensors dtype {name!r} is not supported") from None


def itemsize_of(name: str) -> int:
    """Bytes per element of a torch dtype name, also for dtypes outside the table (e.g. ``bits8``)."""
    d = BY_NAME.get(name.removeprefix("torch."))
    if d is not None:
        return d.itemsize
    import torch

    return getattr(torch, name.removeprefix("torch.")).itemsize


def is_torch_tensor(data: Any) -> bool:
    """Whether ``data`` is a torch tensor (without importing torch when it is not loaded)."""
    import sys

    # a module another thread is still importing has no ``Tensor`` yet (and no tensor exists)
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
    return isinstance(tensor_type, type) and isinstance(data, tensor_type)


def to_storage_array(t: Any) -> np.ndarray:
    """A numpy view of the tensor's exact bits in its storage dtype (zero-copy when contiguous).

    A numpy array is taken to hold bits already and is returned C-contiguous.
    """
    if not is_torch_tensor(t):
        return np.require(t, requirements="C")  # keeps 0-d arrays 0-d
    import torch

    d = by_torch(t.dtype)
    t = t.contiguous()
    if d.encoded:
        t = t.view(getattr(torch, d.storage))
    return t.numpy()


def raw_bytes(data: Any) -> memoryview:
    """The exact bytes of a bit array or torch tensor, C order, as a flat ``uint8`` memoryview."""
    a = to_storage_array(data)
    return memoryview(a.reshape(-1).view(np.uint8))


def from_storage_array(a: np.ndarray, name: str) -> torch.Tensor:
    """The torch tensor whose bits are ``a`` (zero-copy), with the recorded torch dtype."""
    import torch

    d = by_name(name)
    if a.size == 0:  # numpy gives empty arrays zero strides, which torch's .view refuses
        return torch.empty(a.shape, dtype=d.torch_dtype)
    t = torch.from_numpy(np.ascontiguousarray(a)).reshape(a.shape)  # ascontiguousarray makes 0-d 1-d
    if d.encoded:
        t = t.view(d.torch_dtype)
    return t


#: Spellings ``--dtype`` accepts for each dtype it casts to (every command: from-universal,
#: export-hf, ...). The canonical torch names and ``torch.<name>`` are accepted too.
CAST_ALIASES: dict[str, str] = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32",
    "fp64": "float64", "f64": "float64", "double": "float64", "float64": "float64",
}
_CAST_CHOICES = "bf16 (bfloat16), fp16 (float16, half), fp32 (float32, float), fp64 (float64, double)"


def cast_dtype(text: str) -> str:
    """The canonical name (``"bfloat16"``) of a ``--dtype`` value (``"bf16"``, ``"BF16"``,
    ``"torch.bfloat16"``); :class:`ConfigError` naming every accepted spelling otherwise
    (float8 and integer targets included: a cast to them would clip or round values away)."""
    key = str(text).strip().lower().removeprefix("torch.")
    name = CAST_ALIASES.get(key)
    if name is None:
        raise ConfigError(
            f"--dtype {text}: not a floating-point dtype ckptconv casts to; use one of {_CAST_CHOICES} "
            "(float8 and integer tensors always keep their dtype)"
        )
    return name


def cast_bits(data: Any, src: str, dst: str) -> np.ndarray:
    """The bit array of ``data`` (a bit array, or tensor, of dtype ``src``) cast to dtype ``dst``
    as torch's ``Tensor.to`` rounds it; ``data``'s bits when the dtypes are equal. Needs no torch.

    Between float16, bfloat16, float32 and float64 every non-NaN value (infinities, subnormals,
    -0 included) gets torch's exact bits: float32 -> bfloat16 rounds to nearest even, float64 ->
    float16/bfloat16 rounds through float32 as torch does. A NaN stays a NaN (quiet, sign and top
    payload bits kept where torch keeps them; torch itself gives different NaN bits in its
    vectorised and scalar lanes). Other dtype pairs: :class:`UnsupportedError`.
    """
    s, d = by_name(src).name, by_name(dst).name
    bits = to_storage_array(data)
    if s == d:
        return bits
    if s not in CASTABLE_FLOATS or d not in CASTABLE_FLOATS:
        raise UnsupportedError(f"cannot cast {s} to {d}: only {', '.join(sorted(CASTABLE_FLOATS))} are cast")
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        if s == "float64" and d == "float32":
            return bits.view(np.float64).astype(np.float32)
        return _from_float32(_as_float32(bits, s), d, nan_bf16=0x7FC0 if s == "float16" else 0xFFFF)


_HIGH = 1 if sys.byteorder == "little" else 0  # which uint16 of a uint32 holds its high half


def _as_float32(bits: np.ndarray, src: str) -> np.ndarray:
    """float32 values of ``src`` bits: exact for float16/bfloat16 (float16 NaNs quieted, as
    torch's scalar path does), rounded to nearest for float64 (the hardware conversion)."""
    if src == "float32":
        return bits.view(np.float32) if bits.dtype != np.float32 else bits
    if src == "bfloat16":  # the 16 bits become the high half of a float32 (zeros below): exact
        out = np.zeros((*bits.shape, 2), dtype=np.uint16)
        out[..., _HIGH] = bits.view(np.uint16)
        return out.view(np.float32).reshape(bits.shape)
    if src == "float16":
        half = bits.view(np.float16)
        out = half.astype(np.float32)
        nan = np.isnan(half)
        if nan.any():
            out.view(np.uint32)[nan] |= np.uint32(0x00400000)
        return out
    return bits.view(np.float64).astype(np.float32)


def _from_float32(f: np.ndarray, dst: str, nan_bf16: int) -> np.ndarray:
    """The storage bits of float32 values ``f`` cast to ``dst`` as torch rounds them."""
    if dst == "float32":
        return np.require(f, requirements="C")
    if dst == "float64":
        return f.astype(np.float64)
    nan = np.isnan(f)
    u = f.view(np.uint32)
    if dst == "float16":
        out = f.astype(np.float16)
        if nan.any():  # quiet NaN, sign and top 9 payload bits kept (numpy would keep a signalling NaN)
            quiet = ((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7E00) | ((u >> np.uint32(13)) & np.uint32(0x1FF))
            out.view(np.uint16)[nan] = quiet[nan].astype(np.uint16)
        return out
    # bfloat16: round to nearest even on the upper 16 bits (c10::round_to_nearest_even), in place
    r = u >> np.uint32(16)
    r &= np.uint32(1)
    r += np.uint32(0x7FFF)
    r += u
    out = np.ascontiguousarray(r.view(np.uint16).reshape(*r.shape, 2)[..., _HIGH]) if r.ndim else \
        np.array(r >> np.uint32(16), dtype=np.uint16)
    if nan.any():
        out[nan] = np.uint16(nan_bf16)
    return out
