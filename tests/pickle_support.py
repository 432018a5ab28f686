"""Helpers for tests that craft non-tensor entries: torch.save bytes and archives with a chosen pickle."""

from __future__ import annotations

import io
import zipfile

import torch


def saved_bytes(value, protocol: int = 2) -> bytes:
    """``torch.save(value)`` as bytes, with the given pickle protocol."""
    buf = io.BytesIO()
    torch.save(value, buf, pickle_protocol=protocol)
    return buf.getvalue()


def with_pickle(archive: bytes, payload: bytes) -> bytes:
    """``archive`` (a torch.save zip) with its data.pkl replaced by ``payload`` (CRCs valid)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = payload if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    return out.getvalue()
