"""The test oracle: torch's own reading of a DCP checkpoint, and bit-exact comparisons.

Never built on our readers: :func:`torch_reference` goes through
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` and ``torch.load`` and flattens with
torch's own ``flatten_state_dict``, so its keys are DCP's flattened keys
(``model.layers.0.attention.wq.weight``, ``optim.state.<fqn>.exp_avg``, ``extra.nested.a.b``).
"""

from __future__ import annotations

import io
import struct
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def torch_reference(ckpt_dir: str | Path) -> dict[str, Any]:
    """The whole checkpoint as torch reads it, flattened to DCP's keys (tensors are contiguous)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to ... single process"
            dcp_to_torch_save(str(ckpt_dir), str(out))
        nested = torch.load(out, weights_only=False)
    flat, _ = flatten_state_dict(nested)
    return flat


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def bits_equal(a: Any, b: Any) -> bool:
    """True when both are tensors of the same dtype and shape with identical raw bytes.

    NaN payloads, -0.0, bool, 0-d and float8 tensors compare by their bits; strides and storage
    offsets do not matter.
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(_raw_bytes(a), _raw_bytes(b))


def _describe(t: torch.Tensor) -> str:
    return f"tensor(dtype={t.dtype}, shape={tuple(t.shape)})"


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    ra, rb = _raw_bytes(a), _raw_bytes(b)
    idx = int((ra != rb).nonzero()[0]) // max(1, a.element_size())
    flat_a, flat_b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    return f"first differing element #{idx}: {flat_a[idx]!r} vs {flat_b[idx]!r}"


def _assert_tensor(a: torch.Tensor, b: Any, path: str) -> None:
    if not isinstance(b, torch.Tensor):
        raise AssertionError(f"{path}: {_describe(a)} vs {type(b).__name__} {b!r:.80}")
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        raise AssertionError(f"{path}: {_describe(a)} vs {_describe(b)}")
    if not bits_equal(a, b):
        raise AssertionError(f"{path}: bits differ, {_first_diff(a, b)}")


def _assert_float(a: float, b: Any, path: str) -> None:
    if type(b) is not float or struct.pack("<d", a) != struct.pack("<d", b):
        raise AssertionError(f"{path}: {a!r} vs {b!r} (compared bitwise)")


def assert_same_value(a: Any, b: Any, path: str = "value") -> None:
    """Assert ``a`` and ``b`` are the same value: tensors bit for bit, floats bitwise, containers
    recursively with equal types and keys; raises AssertionError naming the first differing path."""
    if isinstance(a, torch.Tensor):
        _assert_tensor(a, b, path)
    elif isinstance(a, np.ndarray):
        if not isinstance(b, np.ndarray) or a.dtype != b.dtype or a.shape != b.shape:
            raise AssertionError(f"{path}: ndarray {a.dtype}{a.shape} vs {b!r:.80}")
        if np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
            raise AssertionError(f"{path}: ndarray bits differ")
    elif isinstance(a, Mapping):
        if not isinstance(b, Mapping):
            raise AssertionError(f"{path}: mapping vs {type(b).__name__}")
        if set(a) != set(b):
            raise AssertionError(
                f"{path}: keys differ: only left {sorted(map(str, set(a) - set(b)))[:10]}, "
                f"only right {sorted(map(str, set(b) - set(a)))[:10]}"
            )
        for k in a:
            assert_same_value(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            raise AssertionError(f"{path}: {type(a).__name__}[{len(a)}] vs {b!r:.80}")
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_value(x, y, f"{path}[{i}]")
    elif type(a) is float:
        _assert_float(a, b, path)
    elif isinstance(a, io.BytesIO):
        if not isinstance(b, io.BytesIO) or a.getvalue() != b.getvalue():
            raise AssertionError(f"{path}: BytesIO contents differ")
    else:
        if type(a) is not type(b) or a != b:
            raise AssertionError(f"{path}: {a!r:.80} vs {b!r:.80}")


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path``, read by the safetensors library."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                assert k not in out, f"{k} in two files"
                out[k] = st.get_tensor(k)
    return out
