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


def test_the_combined_block_is_a_small_part_of_the_memory_budget():
    """The combiner's blocks (a few per file: filling, queued, being written) stay a small part of
    the conversion's memory budget: at most 1/COMBINE_BLOCKS_PER_BUDGET of it, the full block at
    the default budget."""
    mib = 1 << 20
    assert fsutil.combine_block(1, memory=512 * mib) == fsutil.COMBINE_BLOCK
    for budget in [1 * mib, 8 * mib, 32 * mib, 100 * mib, 1 << 40]:
        for files in [1, 3, 64]:
            block = fsutil.combine_block(files, memory=budget)
            assert block % fsutil.DIRECT_ALIGN == 0 and block <= fsutil.combine_block(files)
            assert block * fsutil.COMBINE_BLOCKS_PER_BUDGET <= budget or block == fsutil.COMBINE_MIN_BLOCK, (budget, files)
    assert fsutil.combine_block(1, memory=32 * mib) == mib


class _HeldWrites:
    """Makes ``DirectWrites.write_through`` of full blocks wait until released (the disk busy)."""

    def __init__(self, monkeypatch, block: int) -> None:
        import threading

        self.release, self.entered, self.threads = threading.Event(), threading.Event(), set()
        real = DirectWrites.write_through

        def write_through(out, view, offset):
            if len(view) == block:
                self.threads.add(threading.current_thread().name)
                self.entered.set()
                assert self.release.wait(10)
            return real(out, view, offset)

        monkeypatch.setattr(DirectWrites, "write_through", write_through)


def test_full_blocks_are_written_behind_the_caller_and_a_sync_waits_for_them(tmp_path, monkeypatch):
    """The caller that fills a block goes on while the combiner's writer thread writes it (the disk
    works while the next piece is read); a sync returns only once it is on disk."""
    import threading

    block = 64 << 10
    held = _HeldWrites(monkeypatch, block)
    path, fd = _file(tmp_path, 4 * block)
    comb = fsutil.BlockCombiner(block=block)
    out = DirectWrites(fd, path, combiner=comb, size=4 * block)
    data = np.arange(4 * block, dtype=np.uint64).astype(np.uint8)
    for i in range(0, 2 * block, 1000):  # fills blocks 0 and 1 in small writes
        out.pwrite(data[i: min(i + 1000, 2 * block)], i)
    assert held.entered.wait(10)  # block 0 is being written, and the caller is back
    assert held.threads == {"ckptconv-blocks"}
    synced = threading.Event()
    syncing = threading.Thread(target=lambda: (out.sync(), synced.set()))
    syncing.start()
    assert not synced.wait(0.3)  # the sync waits for the blocks being written
    held.release.set()
    syncing.join(10)
    assert synced.is_set()
    assert np.array_equal(np.fromfile(path, dtype=np.uint8)[: 2 * block], data[: 2 * block])
    out.close()


def test_without_write_behind_the_caller_writes_its_full_blocks(tmp_path, monkeypatch):
    block = 64 << 10
    held = _HeldWrites(monkeypatch, block)
    held.release.set()
    path, fd = _file(tmp_path, block)
    out = DirectWrites(fd, path, combiner=fsutil.BlockCombiner(block=block, behind=False), size=block)
    out.pwrite(b"\x05" * block, 0)
    assert held.threads == {"MainThread"}
    out.close()
    assert open(path, "rb").read() == b"\x05" * block


def test_a_failed_write_behind_is_raised_by_the_next_sync_and_write(tmp_path, monkeypatch):
    """The writer thread's failure (a full disk) is not lost: the next sync raises it (so nothing
    is journaled as written), and so does every later write."""
    block = 64 << 10
    path, fd = _file(tmp_path, 2 * block)
    comb = fsutil.BlockCombiner(block=block)
    out = DirectWrites(fd, path, combiner=comb, size=2 * block)

    def full_disk(self, view, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DirectWrites, "write_through", full_disk)
    out.pwrite(b"\x01" * 100, 0)
    try:
        out.pwrite(b"\x01" * (block - 100), 100)  # the block filled in two writes: written behind, fails there
    except OSError as e:  # (or here, if the writer thread failed already)
        assert e.errno == errno.ENOSPC
    with pytest.raises(OSError) as e:
        out.sync()
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        out.pwrite(b"\x02" * 10, block)
    monkeypatch.undo()
    out.close(flush=False)


def _fill_block(out, value: int, k: int, block: int) -> None:
    """Block ``k`` of ``out`` written in two small writes (gathered, not written through)."""
    out.pwrite(bytes([value]) * 100, k * block)
    out.pwrite(bytes([value]) * (block - 100), k * block + 100)


def test_a_dropped_file_forgets_its_queued_blocks(tmp_path, monkeypatch):
    """A file being removed (drop) loses its queued full blocks, not another file's; the block of
    it under way is waited for."""
    import threading

    block = 64 << 10
    held = _HeldWrites(monkeypatch, block)
    comb = fsutil.BlockCombiner(block=block, queue_bytes=4 * block)  # room for the two queued behind the held one
    pa, fa = _file(tmp_path, 3 * block)
    (tmp_path / "g").mkdir()
    pb, fb = _file(tmp_path / "g", block)
    a = DirectWrites(fa, pa, combiner=comb, size=3 * block)
    b = DirectWrites(fb, pb, combiner=comb, size=block)
    _fill_block(a, 1, 0, block)  # the writer thread holds it
    assert held.entered.wait(10)
    _fill_block(b, 2, 0, block)  # queued behind it
    _fill_block(a, 3, 1, block)  # queued behind that
    dropping = threading.Thread(target=a.close, kwargs={"flush": False})
    dropping.start()
    dropping.join(0.3)
    assert dropping.is_alive()  # waits for a's block under way
    held.release.set()
    dropping.join(10)
    assert not dropping.is_alive()
    b.close()
    assert open(pb, "rb").read() == b"\x02" * block  # the other file's queued block was written
    on_disk = open(pa, "rb").read()
    assert on_disk[:block] == b"\x01" * block and on_disk[block: 2 * block] == b"\x00" * block  # a's queued one was not


def test_a_caller_waits_while_the_write_behind_queue_is_full(tmp_path, monkeypatch):
    """The blocks queued for the writer thread are bounded (memory stays a few blocks): past
    ``queue_bytes`` the caller waits for the disk."""
    import threading

    block = 64 << 10
    held = _HeldWrites(monkeypatch, block)
    path, fd = _file(tmp_path, 6 * block)
    comb = fsutil.BlockCombiner(block=block, queue_bytes=2 * block)
    out = DirectWrites(fd, path, combiner=comb, size=6 * block)
    filled = []

    def fill_all():
        for k in range(6):
            _fill_block(out, k + 1, k, block)
            filled.append(k)

    filler = threading.Thread(target=fill_all)
    filler.start()
    assert held.entered.wait(10)
    filler.join(0.3)
    assert filler.is_alive() and len(filled) <= 3, filled
    assert comb._queued <= 3 * block
    held.release.set()
    filler.join(10)
    out.close()
    assert open(path, "rb").read() == b"".join(bytes([k + 1]) * block for k in range(6))


def test_after_a_failed_write_behind_every_wait_ends(tmp_path, monkeypatch):
    """A write that fills a block and pushes another out (past the cap) after the writer thread
    failed: the write raises, and a later sync raises too instead of waiting for ever."""
    import threading

    block = 64 << 10
    path, fd = _file(tmp_path, 8 * block)
    comb = fsutil.BlockCombiner(block=block, cap=block)
    out = DirectWrites(fd, path, combiner=comb, size=8 * block)
    real = DirectWrites.write_through

    def fail_full_blocks(self, view, offset):
        if len(view) == block and threading.current_thread().name == "ckptconv-blocks":
            raise OSError(errno.EIO, "Input/output error")
        return real(self, view, offset)

    monkeypatch.setattr(DirectWrites, "write_through", fail_full_blocks)
    try:
        _fill_block(out, 1, 0, block)  # written behind: fails (raised here if it failed already)
    except OSError as e:
        assert e.errno == errno.EIO
    outcome = []

    def more():
        try:
            out.pwrite(b"\x02" * 10, 3 * block)  # a partly filled block...
            _fill_block(out, 3, 5, block)  # ...pushed out by this one, which fills its block
        except OSError as e:
            outcome.append(e.errno)
        try:
            out.sync()
        except OSError as e:
            outcome.append(e.errno)

    t = threading.Thread(target=more)
    t.start()
    t.join(10)
    assert not t.is_alive() and outcome == [errno.EIO, errno.EIO], outcome
    monkeypatch.undo()
    out.close(flush=False)


def test_copies_into_blocks_run_outside_the_combiners_lock(tmp_path, monkeypatch):
    """Each caller copies its bytes into the blocks without holding the combiner's lock, so two
    workers fill blocks side by side: a copy that stalls does not stop another file's writes."""
    import threading

    block = 64 << 10
    comb = fsutil.BlockCombiner(block=block, behind=False)
    pa, fa = _file(tmp_path, block)
    (tmp_path / "g").mkdir()
    pb, fb = _file(tmp_path / "g", block)
    a = DirectWrites(fa, pa, combiner=comb, size=block)
    b = DirectWrites(fb, pb, combiner=comb, size=block)
    inside, release = threading.Event(), threading.Event()
    real = np.frombuffer

    def frombuffer(buf, *args, **kwargs):  # the copy of a's bytes into its block stalls
        if isinstance(buf, np.ndarray) and buf.nbytes == block and threading.current_thread().name == "stalled":
            inside.set()
            assert release.wait(10)
        return real(buf, *args, **kwargs)

    monkeypatch.setattr(fsutil.np, "frombuffer", frombuffer)
    stalled = threading.Thread(target=a.pwrite, args=(memoryview(b"\x01" * 1000), 0), name="stalled")
    stalled.start()
    assert inside.wait(10)
    other = threading.Thread(target=b.pwrite, args=(b"\x02" * 100, 0))  # gathered while a's copy is under way
    other.start()
    other.join(5)
    stuck = other.is_alive()
    if stuck:
        release.set()
        other.join(10)
    assert not stuck, "a stalled copy held the combiner's lock"
    flushing = threading.Thread(target=a.sync)
    flushing.start()
    flushing.join(0.3)
    assert flushing.is_alive()  # a's sync waits for the copy into its block
    release.set()
    stalled.join(10)
    flushing.join(10)
    assert not flushing.is_alive()
    assert open(pa, "rb").read(1000) == b"\x01" * 1000
    a.close()
    b.close()
    assert open(pb, "rb").read(100) == b"\x02" * 100


def test_a_block_being_filled_is_not_pushed_out_past_the_cap(tmp_path):
    """Past the cap the oldest partly filled block that no copy is filling is written out; one a
    copy is filling stays (its bytes are not all there yet)."""
    block = 64 << 10
    comb = fsutil.BlockCombiner(block=block, cap=2 * block, behind=False)
    path, fd = _file(tmp_path, 4 * block)
    out = DirectWrites(fd, path, combiner=comb, size=4 * block)
    out.pwrite(b"\x01" * 10, 0)  # block 0, the oldest
    out.pwrite(b"\x02" * 10, block)  # block 1
    comb._blocks[(id(out), 0)][2].copying += 1  # a copy into block 0 under way
    out.pwrite(b"\x03" * 10, 2 * block)  # block 2: past the cap
    assert (id(out), 0) in comb._blocks and (id(out), 1) not in comb._blocks and comb.evicted == 1
    comb._blocks[(id(out), 0)][2].copying -= 1
    out.close()
    data = open(path, "rb").read()
    assert data[:10] == b"\x01" * 10 and data[block: block + 10] == b"\x02" * 10 and data[2 * block: 2 * block + 10] == b"\x03" * 10


def test_the_write_behind_queue_is_bounded_in_bytes():
    """The queue for the writer thread holds WRITE_BEHIND_BYTES (a burst of full blocks), never
    fewer than WRITE_BEHIND_MIN_BLOCKS blocks."""
    block = 4 << 20
    assert fsutil.BlockCombiner(block=block).queue_bytes == fsutil.WRITE_BEHIND_BYTES
    assert fsutil.BlockCombiner(block=block, queue_bytes=1).queue_bytes == fsutil.WRITE_BEHIND_MIN_BLOCKS * block
    assert fsutil.BlockCombiner(block=block, queue_bytes=64 << 20).queue_bytes == 64 << 20
