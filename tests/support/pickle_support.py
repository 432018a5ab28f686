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


def two_faced(benign: bytes, evil: bytes) -> bytes:
    """One zip holding two torch.save archives' members, whose end record leads torch's reader
    (miniz: the offset the zip64 record gives) to ``evil``'s central directory while Python's
    zipfile (the directory just before the end records) reads ``benign``'s. Both archives must
    have the same members (equal directory sizes)."""
    import struct

    def split(z: bytes) -> tuple[bytes, bytes, bytes]:
        z64 = z.rindex(b"PK\x06\x06")
        size_cd, off_cd = struct.unpack_from("<QQ", z, z64 + 40)
        assert off_cd + size_cd == z64
        return z[:off_cd], z[off_cd:z64], z[z64:]

    e_local, e_dir, e_tail = split(evil)
    b_local, b_dir, _ = split(benign)
    assert len(e_dir) == len(b_dir), (len(e_dir), len(b_dir))
    b_start = len(e_local) + len(e_dir)
    concat = b_start + len(b_local) - len(e_local)  # what Python adds to every recorded offset
    shifted, pos = bytearray(b_dir), 0
    while pos < len(shifted):
        n, m, k = struct.unpack_from("<HHH", shifted, pos + 28)
        (off,) = struct.unpack_from("<L", shifted, pos + 42)
        struct.pack_into("<L", shifted, pos + 42, b_start + off - concat)
        pos += 46 + n + m + k
    tail = bytearray(e_tail)
    struct.pack_into("<Q", tail, 56 + 8, b_start + len(b_local) + len(shifted))  # locator -> the zip64 record
    return e_local + e_dir + b_local + bytes(shifted) + bytes(tail)


def renamed_member(archive: bytes, old: str, new: str) -> bytes:
    """``archive`` with member ``old`` also stored as ``new`` (same bytes; CRCs valid)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
            if info.filename == old:
                dst.writestr(new, src.read(info))
    return out.getvalue()
