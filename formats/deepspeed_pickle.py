"""DeepSpeed's ``torch.save`` files parsed through an allowlist: inert stand-ins, nothing of
DeepSpeed runs.

DeepSpeed's checkpoint files (``*_model_states.pt``, ``*_optim_states.pt``, the universal
checkpoint's ``optimizer_state.pt``) pickle torch tensors and Parameters, ``torch.Size``,
``torch.device``, ``argparse.Namespace`` (Megatron's args) and DeepSpeed's own classes
(``LossScaler``, ``DynamicLossScaler``, ``ZeroStageEnum``, ``fragment_address``). Tensors become
descriptions of their storage (:mod:`formats.dcp.archive`); DeepSpeed's classes become
:class:`~formats.dcp.safe_pickle.Record` s holding their pickled fields (never imported, never
called); any other global is refused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from formats.dcp.archive import Entry, resolve_tensor_global
from formats.dcp.safe_pickle import SAFE_BUILTINS, Record, record_class
from formats.errors import CheckpointNotFoundError
from formats.fsutil import read_error
from formats.torch_file import read_torch_file, rebuild_from_type, rebuild_parameter


def _device(kind: Any, index: Any = None) -> str:
    """Stand-in for ``torch.device(type[, index])``: the device's name, ``"cuda:0"`` (inert data)."""
    if type(kind) is not str or (index is not None and type(index) is not int):
        raise TypeError(f"torch.device({kind!r}, {index!r})")
    return kind if index is None else f"{kind}:{index}"


class _TensorType:
    """Stands for ``torch.Tensor`` / ``torch.nn.Parameter`` (never called)."""


#: Globals outside torch's tensor machinery that DeepSpeed's pickles name: read as inert data.
_DS_TORCH = {
    ("torch._utils", "_rebuild_parameter"): rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type,
    ("torch", "Tensor"): _TensorType,
    ("torch._tensor", "Tensor"): _TensorType,
    ("torch.nn.parameter", "Parameter"): _TensorType,
    ("torch", "Size"): tuple,
    ("torch", "device"): _device,
    ("argparse", "Namespace"): record_class("argparse.Namespace"),
}
_RECORDS: dict[str, type[Record]] = {}


def resolve_global(module: str, name: str) -> Any:
    """Stand-ins for the globals DeepSpeed's pickles may name; None (refused) for anything else."""
    found = _DS_TORCH.get((module, name)) or SAFE_BUILTINS.get((module, name))
    if found is not None:
        return found
    if module == "deepspeed" or module.startswith("deepspeed."):  # LossScaler, ZeroStageEnum, ...
        kind = f"{module}.{name}"
        return _RECORDS.setdefault(kind, record_class(kind))
    return resolve_tensor_global(module, name)


def record_int(value: Any) -> int | None:
    """An int, or an IntEnum pickled as a record (``ZeroStageEnum.weights`` -> 3); None otherwise."""
    if isinstance(value, Record) and len(value.args) == 1:
        value = value.args[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_archive(path: Path, what: str, missing: str, max_pickle: int,
                 lazy: bool = False) -> tuple[Any, dict[str, Entry], str]:
    """Parse the ``torch.save`` zip ``path`` without reading tensor data: (its value through the
    allowlist, tensors as descriptions; its zip entries; its record prefix). A missing file is a
    CheckpointNotFoundError saying ``missing`` (how to get it); every error names the file.
    ``lazy``: as :func:`formats.torch_file.read_torch_file` (for folders of a thousand files)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing ({what}); {missing}") from None
    except OSError as e:
        raise read_error(path, e, what) from None
    try:
        tf = read_torch_file(fd, path.name, str(path), os.fstat(fd).st_size, resolve_global, max_pickle, what,
                             lazy=lazy)
    finally:
        os.close(fd)
    return tf.value, tf.entries, tf.prefix


def torch_save_bytes(value: Any) -> bytes:
    """``torch.save`` of a plain value, as bytes (an object entry's stored form)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()
