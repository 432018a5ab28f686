"""A universal store read without ckptconv: stock zarr (zarr backend) or the safetensors library
(safetensors backend) for the tensors, ``torch.load`` for the non-tensor entries' exact
``torch.save`` bytes, and ``ckptconv.json`` as plain JSON for which key is where. The oracle for
what to-universal / import-hf / import-ds wrote (ckptconv's own reader is what is under test)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch


def store_tensor(root: Path, rec: dict[str, Any], backend: str) -> torch.Tensor:
    """One tensor of the store, whole, as the backend's own library reads it."""
    dtype, shape = getattr(torch, rec["dtype"]), tuple(rec["shape"])
    if backend == "zarr":
        import zarr

        arr = zarr.open_array(str(root / rec["array"]), mode="r", zarr_format=3)
        assert tuple(arr.shape) == shape and arr.attrs["torch_dtype"] == rec["dtype"], rec["array"]
        data = torch.from_numpy(np.array(arr[...], order="C"))  # (a copy; keeps a 0-d array 0-d)
        return data if data.dtype == dtype else data.view(dtype)  # bf16 / fp8 stored as their bits
    from safetensors import safe_open

    out = torch.empty(shape, dtype=dtype)
    for file in rec["files"].values():  # a file per chunk, placed by its own __metadata__
        with safe_open(root / file, "pt") as f:
            chunk = f.get_tensor(rec["tensor"])
            offsets = json.loads(f.metadata()["offsets"])
            assert json.loads(f.metadata()["shape"]) == list(shape)
        out[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))] = chunk
    return out


def read_store(root: str | Path) -> dict[str, Any]:
    """Every entry of the store at ``root``: tensors whole, objects as ``torch.load`` gives them."""
    root = Path(root)
    meta = json.loads((root / "ckptconv.json").read_text())
    backend = meta.get("backend", "zarr")
    out: dict[str, Any] = {key: store_tensor(root, rec, backend) for key, rec in meta["tensors"].items()}
    for key, rec in meta["objects"].items():  # the source's own bytes (our fixtures: trusted)
        out[key] = torch.load(io.BytesIO((root / rec["file"]).read_bytes()), weights_only=False)
    return out
