"""Large aligned writes (formats/fsutil.py ``DirectWrites``): the bytes on disk are exactly the
bytes written, whichever part went straight to the device; the aligned middle of a large write
from a buffer placed like its file offset goes through ``O_DIRECT``, everything else (small
writes, misaligned buffers, the unaligned ends, a file system that refuses it) through the page
cache."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from formats import fsutil
from formats.fsutil import DIRECT_ALIGN, DIRECT_MIN_BYTES, DirectWrites, pooled_buffer


@pytest.fixture()
def spied(monkeypatch):
    """Every pwrite_all call as (which descriptor: 'direct' or 'buffered', offset, length)."""
    calls, directs = [], set()
    opened = fsutil.open_direct
    write = fsutil.pwrite_all

    def open_direct(path):
        fd = opened(path)
        if fd is not None:
            directs.add(fd)
        return fd

    def pwrite_all(fd, data, offset):
        calls.append(("direct" if fd in directs else "buffered", offset, len(memoryview(data).cast("B"))))
        return write(fd, data, offset)

    monkeypatch.setattr(fsutil, "open_direct", open_direct)
    monkeypatch.setattr(fsutil, "pwrite_all", pwrite_all)
    return calls


def _direct_supported(path) -> bool:
    try:
        os.close(os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0)))
    except OSError:
        return False
    return hasattr(os, "O_DIRECT")


def _file(tmp_path, size):
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, size)
    return path, fd


@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 12345])
@pytest.mark.parametrize("n", [10, DIRECT_MIN_BYTES + 4097, 3 * DIRECT_MIN_BYTES])
def test_bytes_on_disk_are_the_bytes_written(tmp_path, spied, offset, n):
    rng = np.random.default_rng(n + offset)
    path, fd = _file(tmp_path, offset + n + 100)
    out = DirectWrites(fd, path)
    buf = pooled_buffer("test-direct", n, align_to=offset)
    buf[:] = rng.integers(0, 256, n, dtype=np.uint8)
    buffered = out.pwrite(buf, offset)
    out.sync()
    out.close()
    data = path.read_bytes()
    assert data[offset: offset + n] == buf.tobytes() and data[:offset] == bytes(offset)
    direct = sum(c[2] for c in spied if c[0] == "direct")
    assert buffered + direct == n
    if _direct_supported(path) and n >= DIRECT_MIN_BYTES + DIRECT_ALIGN:
        assert direct >= n - 2 * DIRECT_ALIGN  # all but the unaligned ends went direct
        assert all(c[1] % DIRECT_ALIGN == 0 and c[2] % DIRECT_ALIGN == 0 for c in spied if c[0] == "direct")
    else:
        assert direct == 0 or n < DIRECT_MIN_BYTES


def test_a_misaligned_buffer_goes_through_the_page_cache(tmp_path, spied):
    n = 2 * DIRECT_MIN_BYTES
    path, fd = _file(tmp_path, n + 1)
    out = DirectWrites(fd, path)
    buf = pooled_buffer("test-direct", n + 1, align_to=0)[1:]  # one byte off the file offset's alignment
    buf[:] = 7
    assert out.pwrite(buf, 0) == n
    out.close()
    assert path.read_bytes()[:n] == bytes([7]) * n
    assert {c[0] for c in spied} == {"buffered"}


def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path, spied, monkeypatch):
    n = 2 * DIRECT_MIN_BYTES
    path, fd = _file(tmp_path, n)
    out = DirectWrites(fd, path)
    write = fsutil.pwrite_all

    def refuse(fd_, data, offset):
        if fd_ == out._direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return write(fd_, data, offset)

    monkeypatch.setattr(fsutil, "pwrite_all", refuse)
    buf = pooled_buffer("test-direct", n, align_to=0)
    buf[:] = 3
    assert out.pwrite(buf, 0) == n
    assert out.pwrite(buf, 0) == n  # refused once: buffered from then on
    out.close()
    assert path.read_bytes() == bytes([3]) * n


def test_no_direct_descriptor_without_a_path(tmp_path, spied):
    n = 2 * DIRECT_MIN_BYTES
    path, fd = _file(tmp_path, n)
    out = DirectWrites(fd)
    assert out.pwrite(pooled_buffer("test-direct", n, align_to=0), 0) == n
    out.close()
    assert {c[0] for c in spied} == {"buffered"}


def test_sync_only_when_written(tmp_path, monkeypatch):
    path, fd = _file(tmp_path, 10)
    out = DirectWrites(fd, path)
    synced = []
    monkeypatch.setattr(os, "fdatasync", lambda f: synced.append(f))
    out.sync()
    out.sync()
    out.pwrite(b"abc", 0)
    out.sync()
    out.close()
    assert synced == [fd, fd]


def test_pooled_buffers_are_placed_like_the_file_offset():
    for offset in (0, 1, 63, 4096, 4097, 123457):
        buf = pooled_buffer("test-place", 5000, align_to=offset)
        assert buf.nbytes == 5000 and (buf.ctypes.data - offset) % DIRECT_ALIGN == 0
