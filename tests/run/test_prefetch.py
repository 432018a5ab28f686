"""Read-ahead of the source (converter/run/prefetch.py): the kernel is asked to read the source
chunks of the next tasks, in the workers' order, at most ``ahead`` bytes in front of them; a hint
that changes no byte of the output and whose failures never stop a conversion."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from converter import api, knobs
from converter.config import RunOptions
from converter.plan.copy_tasks import CopyItem, Piece, WriteTask
from converter.run import executor
from converter.run.prefetch import Prefetcher, task_source_chunks
from formats.base import Box, ChunkRef


def _chunk(name: str, rows: int, at: int) -> ChunkRef:
    return ChunkRef(box=Box((at, 0), (rows, 4)), file=name, locator=(name, at))


def _task(key: str, chunks: list[ChunkRef]) -> WriteTask:
    rows = sum(c.box.sizes[0] for c in chunks)
    box = Box((chunks[0].box.offsets[0], 0), (rows, 4))
    return WriteTask(key, "float32", key, box, (Piece(box, tuple(CopyItem(c, c.box) for c in chunks)),))


class _Recorder:
    """A reader whose ``prefetch`` records each hint (and can fail)."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.hints: list[ChunkRef] = []
        self.fail_on = fail_on

    def prefetch(self, key: str, chunk: ChunkRef) -> None:
        if chunk.file == self.fail_on:
            raise OSError("gone")
        self.hints.append(chunk)


def _wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_every_source_chunk_is_hinted_once_in_task_order():
    shared = _chunk("f0", 2, 0)
    tasks = [_task("a", [shared, _chunk("f1", 2, 2)]), _task("b", [shared]), _task("c", [_chunk("f2", 4, 0)])]
    reader = _Recorder()
    p = Prefetcher.start_for(reader, tasks, ahead=1 << 30)
    _wait_for(lambda: p.hinted == 3)
    p.stop()
    assert [c.file for c in reader.hints] == ["f0", "f1", "f2"]  # f0 once, though two tasks read it


def test_the_hints_stay_within_ahead_bytes_of_the_tasks_started():
    """With nothing started only the first window is hinted; each task started moves it on."""
    tasks = [_task(f"t{i}", [_chunk(f"f{i}", 4, 0)]) for i in range(10)]  # 64 bytes each
    reader = _Recorder()
    p = Prefetcher.start_for(reader, tasks, ahead=3 * 64)
    _wait_for(lambda: p.hinted == 3)
    time.sleep(0.1)
    assert p.hinted == 3
    for i in range(4):
        p.started(tasks[i])
    _wait_for(lambda: p.hinted == 7)
    time.sleep(0.1)
    assert [c.file for c in reader.hints] == [f"f{i}" for i in range(7)]
    p.stop()


def test_a_failing_hint_is_skipped_and_stop_ends_the_thread():
    tasks = [_task(f"t{i}", [_chunk(f"f{i}", 4, 0)]) for i in range(4)]
    reader = _Recorder(fail_on="f1")
    p = Prefetcher.start_for(reader, tasks, ahead=1 << 30)
    _wait_for(lambda: len(reader.hints) == 3)
    assert [c.file for c in reader.hints] == ["f0", "f2", "f3"]
    p.stop()
    assert not p._thread.is_alive()


def test_chunks_over_the_largest_size_are_not_hinted():
    """A large chunk is read efficiently on its own: only the small ones are read ahead."""
    tasks = [_task("a", [_chunk("small", 4, 0), _chunk("big", 64, 4)]), _task("b", [_chunk("small2", 4, 0)])]
    reader = _Recorder()
    p = Prefetcher.start_for(reader, tasks, ahead=1 << 30, largest=4 * 4 * 4)  # 4 rows of 4 float32
    _wait_for(lambda: len(reader.hints) == 2)
    p.stop()
    assert [c.file for c in reader.hints] == ["small", "small2"]


def test_no_prefetcher_without_a_prefetch_method_or_a_window():
    tasks = [_task("a", [_chunk("f0", 4, 0)])]
    assert Prefetcher.start_for(object(), tasks, 1 << 20) is None
    assert Prefetcher.start_for(_Recorder(), tasks, 0) is None
    assert Prefetcher.start_for(_Recorder(), [], 1 << 20) is None


def test_task_source_chunks_of_planned_pieces(dcp_checkpoint):
    """Planned pieces (computed when iterated) name their source chunks with one index query."""
    from converter.run.sources import open_checkpoint
    from converter.plan.copy_tasks import plan_universal, store_tasks

    reader = open_checkpoint(dcp_checkpoint("fsdp4"))
    index = reader.index()
    tasks = store_tasks(index.tensors, plan_universal(index.tensors, 1 << 20), 1 << 20)
    for task in tasks[:50]:
        want = {id(c.src) for p in task.pieces for c in p.copies}
        assert {id(c) for c in task_source_chunks(task)} == want, task.key


# ------------------------------------------------------------------------------- in a conversion


@pytest.fixture()
def advised(monkeypatch):
    """Every posix_fadvise(WILLNEED) as (path, offset, length)."""
    calls: list[tuple[str, int, int]] = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    return calls


def _items(ckpt: Path) -> set[tuple[str, int, int]]:
    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    return {(str((ckpt / sd.relative_path).resolve()), sd.offset, sd.length) for idx, sd in md.storage_data.items()
            if isinstance(md.state_dict_metadata[idx.fqn], dcp.metadata.TensorStorageMetadata)}


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not Path("/proc/self/fd").is_dir(),
                    reason="needs posix_fadvise and /proc")
def test_conversions_read_every_source_chunk_ahead_and_write_the_same_bytes(dcp_checkpoint, tmp_path, advised,
                                                                             monkeypatch):
    """to-universal hints every tensor item of the DCP source, from-universal every chunk file of
    the store; with the window 0 nothing is hinted, and the outputs are byte-identical."""
    src = dcp_checkpoint("fsdp4")
    opts = RunOptions(workers=2)
    api.to_universal(src, tmp_path / "uni", opts)
    assert _items(src) <= set(advised)
    advised.clear()
    api.from_universal(tmp_path / "uni", tmp_path / "dp3", "dp3", options=opts)
    chunk_files = {str(p.resolve()) for p in (tmp_path / "uni" / "tensors").rglob("*")
                   if p.is_file() and p.name != "zarr.json"}
    assert {path for path, _, _ in advised} == chunk_files
    advised.clear()
    monkeypatch.setattr(knobs, "PREFETCH_BYTES", 0)
    api.to_universal(src, tmp_path / "uni0", opts)
    api.from_universal(tmp_path / "uni0", tmp_path / "dp3-0", "dp3", options=opts)
    assert advised == []
    for a, b in (("uni", "uni0"), ("dp3", "dp3-0")):
        files = sorted(p.relative_to(tmp_path / a) for p in (tmp_path / a).rglob("*") if p.is_file()
                       and p.name not in ("ckptconv.json", ".metadata", ".written-by-ckptconv.json"))
        assert files and all((tmp_path / a / f).read_bytes() == (tmp_path / b / f).read_bytes() for f in files)


def test_the_executor_runs_a_prefetcher_and_stops_it(monkeypatch):
    """execute() starts the read-ahead for its tasks and ends it, also when a task fails."""
    made = []
    real = Prefetcher.start_for

    def start_for(reader, tasks, ahead, largest):
        p = real(reader, tasks, ahead, largest)
        made.append(p)
        return p

    monkeypatch.setattr(Prefetcher, "start_for", staticmethod(start_for))

    class Reader(_Recorder):
        def read_region_into(self, key, chunk, region, out):
            raise OSError(5, "Input/output error")

    tasks = [_task(f"t{i}", [_chunk(f"f{i}", 4, 0)]) for i in range(3)]
    reader = Reader()
    with pytest.raises(OSError, match="Input/output error"):
        executor.execute(tasks, reader, _FailingSink(), workers=2, memory_budget=1 << 20, progress=False)
    assert made and made[0] is not None and not made[0]._thread.is_alive()
    assert reader.hints


class _FailingSink:
    """A sink whose writers take anything (the reads fail first)."""

    def sync(self) -> None:
        pass

    def open(self, task):
        class W:
            def write(self, piece, data):
                pass

            def close(self):
                return None

        return W()
