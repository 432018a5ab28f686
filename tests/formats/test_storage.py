"""formats/storage.py ``CachedFds``: the descriptors a store reader keeps open between reads."""

from __future__ import annotations

import os

import pytest


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_cached_fds_keep_files_open_within_the_capacity(tmp_path):
    """A file read again uses the descriptor kept from its last read; past the capacity the least
    recently used idle one is closed, never one in use; close() closes them all."""
    from formats.storage import CachedFds

    paths = []
    for i in range(6):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 10)
        paths.append(tmp_path / f"f{i}")
    before = _open_fds()
    cache = CachedFds(capacity=3)
    fd0 = cache.acquire(paths[0])
    cache.release(paths[0])
    assert cache.acquire(paths[0]) == fd0  # kept open, reused (and in use now)
    for p in paths[1:5]:
        cache.acquire(p)
        cache.release(p)
    assert len(cache) == 3 and os.pread(fd0, 1, 0) == b"\x00"  # f0 is in use: never closed
    assert str(paths[0]) in cache._fds and str(paths[4]) in cache._fds and str(paths[1]) not in cache._fds
    cache.release(paths[0])
    assert _open_fds() == before + 3
    cache.close()
    assert _open_fds() == before and len(cache) == 0
    with pytest.raises(FileNotFoundError):
        cache.acquire(tmp_path / "missing")


def test_cached_fds_from_many_threads_read_the_right_files(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from formats.storage import CachedFds

    paths = []
    for i in range(40):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 4096)
        paths.append(tmp_path / f"f{i}")
    cache = CachedFds(capacity=4)
    before = _open_fds()

    def read(i: int) -> bool:
        p = paths[i % 40]
        fd = cache.acquire(p)
        try:
            return os.pread(fd, 4096, 0) == bytes([i % 40]) * 4096
        finally:
            cache.release(p)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, range(4000)))
    assert len(cache) <= 4 and all(e[1] == 0 for e in cache._fds.values())
    cache.close()
    assert _open_fds() == before


def test_a_store_reader_keeps_few_files_open_under_a_low_open_file_limit():
    """The chunk files a store reader keeps open stay a small part of the soft open-file limit
    (a reader inside a training job leaves the job its descriptors)."""
    import subprocess
    import sys

    from formats.universal import store

    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "from formats.universal.store import _read_fds; print(_read_fds())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert int(out.stdout) == 64 // store.READ_FDS_PER_LIMIT
    assert 1 <= store._read_fds() <= store.READ_FDS
