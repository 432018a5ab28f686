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


# ----------------------------------------------------------------------------- the block combiner


def _cuts(rng, size, small):
    """Disjoint ranges covering [0, size), mostly small, some large, in a random order."""
    cuts, at = [], 0
    while at < size:
        n = int(rng.integers(1, 3 * small)) if rng.random() < 0.8 else int(rng.integers(small, 8 * small))
        cuts.append((at, min(n, size - at)))
        at += n
    rng.shuffle(cuts)
    return cuts


@pytest.mark.parametrize("cap_blocks", [1, 64])
def test_combined_writes_give_the_bytes_written_in_whole_blocks(tmp_path, spied, cap_blocks):
    """Small writes in any order, from 4 threads, land byte for byte; full blocks are written
    whole (one write per block, direct where the file takes it), and only a partly filled block
    pushed out past the cap or left at the end is written in runs."""
    from concurrent.futures import ThreadPoolExecutor

    block = 64 << 10
    size = 40 * block + 1234
    rng = np.random.default_rng(cap_blocks)
    want = rng.integers(0, 256, size, dtype=np.uint8)
    path, fd = _file(tmp_path, size)
    comb = fsutil.BlockCombiner(block=block, cap=cap_blocks * block)
    out = DirectWrites(fd, path, combiner=comb, size=size)
    cuts = _cuts(rng, size, 5000)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda c: out.pwrite(want[c[0]: c[0] + c[1]], c[0]), cuts))
    out.sync()
    assert np.array_equal(np.fromfile(path, dtype=np.uint8), want)  # on disk before close: the sync wrote it all
    out.close()
    if cap_blocks > 1:  # nothing pushed out: every write a whole block (the last one to the file's end)
        assert comb.evicted == 0 and comb.full_blocks == 41
        lengths = {n for _, _, n in spied}
        assert lengths <= {block, size - 40 * block, size - 40 * block - 1234, 1234}, sorted(lengths)
    else:
        assert comb.evicted > 0


def test_a_combined_file_reopened_keeps_the_bytes_not_rewritten(tmp_path):
    """--resume: a block whose other bytes were written by an earlier run never fills; its sync
    writes the runs it got, the rest of the block stays as it was."""
    block = 64 << 10
    size = 3 * block
    path, fd = _file(tmp_path, size)
    os.pwrite(fd, b"\x07" * size, 0)
    out = DirectWrites(fd, path, combiner=fsutil.BlockCombiner(block=block), size=size, dirty=False)
    assert not out.dirty
    out.pwrite(b"\x01" * 100, block + 10)
    out.pwrite(b"\x02" * (block + 50), 2 * block - 50)  # the end of block 1, all of block 2
    assert out.dirty
    out.sync()
    data = open(path, "rb").read()
    assert data == b"\x07" * (block + 10) + b"\x01" * 100 + b"\x07" * (block - 160) + b"\x02" * (block + 50)
    out.close()


def test_the_combined_block_keeps_two_open_blocks_per_file_within_the_cap():
    """A conversion writes every target file a little at a time, so each file has a block open:
    the block shrinks (never below the minimum, always aligned) until two per file fit the cap;
    few files keep the full block."""
    for files in [1, 2, 3, 8, 16, 17, 31, 64, 100, 128, 1000, 4096]:
        block = fsutil.combine_block(files)
        assert fsutil.COMBINE_MIN_BLOCK <= block <= fsutil.COMBINE_BLOCK and block % fsutil.DIRECT_ALIGN == 0
        assert 2 * files * block <= fsutil.COMBINE_CAP or block == fsutil.COMBINE_MIN_BLOCK, files
        assert block == fsutil.COMBINE_BLOCK or 2 * files * 2 * block > fsutil.COMBINE_CAP, files  # no smaller than needed
    assert fsutil.combine_block(3) == fsutil.COMBINE_BLOCK
