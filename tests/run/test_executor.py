"""converter/run/executor.py: ``execute`` over a real ``dcp.save`` checkpoint, every target box
filled bit for bit (the oracle: the tensors torch saved), under a memory budget; a full disk
stops the run with a one-line error while the journal keeps what finished, and the resumed run
does only the rest; ``fill_piece`` reads through the protocol's ``read_region_into`` whatever the
reader (a tensor-only reader through :class:`formats.base.TensorReader`)."""

from __future__ import annotations

import errno
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from converter.plan.copy_tasks import plan_tensor
from converter.run.executor import MemoryBudget, execute, fill_piece, storage_error
from converter.run.journal import Journal
from formats.base import Box, TensorReader
from formats.dcp import DCPReader
from formats.dtypes import to_storage_array
from formats.errors import StorageError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("executor")
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(29, 6, generator=g).to(torch.bfloat16),
        "ids": torch.arange(60, dtype=torch.int64).reshape(3, 4, 5),
        "mask": torch.rand(7, generator=g) > 0.5,
        "s": torch.tensor(1.25, dtype=torch.float64),
        "empty": torch.empty(0, 3),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(root / "dcp"))
    return state, root / "dcp"


def _targets(shape: tuple[int, ...]) -> list[tuple[int, Box]]:
    """Uneven row blocks (the whole tensor when 0-d or empty)."""
    if not shape or shape[0] < 3:
        return [(0, Box((0,) * len(shape), shape))]
    cuts = [0, 1, shape[0] // 2, shape[0]]
    return [(i, Box((a, *(0,) * (len(shape) - 1)), (b - a, *shape[1:]))) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]


class _Sink:
    """Assembles every target box of every tensor in memory (a copy of each piece's bits)."""

    def __init__(self, fail_on=None):
        self.out: dict[tuple, np.ndarray] = {}
        self.opened: list[tuple] = []
        self.fail_on = fail_on
        self._lock = threading.Lock()

    def open(self, task):
        with self._lock:
            self.opened.append((task.key, task.target))
        if (task.key, task.target) == self.fail_on:
            raise OSError(errno.ENOSPC, "No space left on device", "/out/x")
        sink, buf = self, {}

        class Writer:
            def write(self, piece, data):
                buf[piece.box] = data.copy()

            def close(self):
                full = None
                for box, data in buf.items():
                    if full is None:
                        full = np.empty(task.box.sizes, dtype=data.dtype)
                    full[box.relative_to(task.box).slices()] = data
                with sink._lock:
                    sink.out[(task.key, task.target)] = full
                return {"pieces": len(buf)}

        return Writer()

    def sync(self):
        pass


def _tasks(reader, piece_bytes=24):
    index = reader.index()
    return [t for key, e in sorted(index.tensors.items()) for t in plan_tensor(e, _targets(tuple(e.shape)), piece_bytes)]


def _check(sink, state):
    for key, want in state.items():
        for target, box in _targets(tuple(want.shape)):
            got = sink.out[(key, target)]
            bits = to_storage_array(want[box.slices()] if want.dim() else want)
            assert got.dtype == bits.dtype and got.shape == bits.shape and np.array_equal(got, bits), key


def test_execute_fills_every_target_bit_exact_under_the_budget(saved):
    state, root = saved
    with DCPReader(root) as reader:
        tasks = _tasks(reader)
        sink = _Sink()
        stats = execute(tasks, reader, sink, workers=3, memory_budget=256, progress=False)
    _check(sink, state)
    assert stats.tasks == len(tasks) and stats.bytes_written == sum(t.nbytes for t in tasks)
    assert 0 < stats.peak_reserved <= 256


def test_full_disk_stops_keeps_the_journal_and_resume_does_the_rest(saved, tmp_path):
    state, root = saved
    header = {"op": "test"}
    with DCPReader(root) as reader:
        tasks = _tasks(reader)
        failing = (tasks[4].key, tasks[4].target)
        first = _Sink(fail_on=failing)
        with pytest.raises(StorageError) as e:
            execute(tasks, reader, first, workers=1, memory_budget=1 << 20, progress=False,
                    journal=Journal(tmp_path, header))
        assert "out of space" in str(e.value) and "--resume" in str(e.value) and "\n" not in str(e.value)
        journal = Journal.resume(tmp_path, header)
        assert len(journal.done) == 4  # one worker: the four tasks before the failing one
        second = _Sink()
        execute(tasks, reader, second, workers=2, memory_budget=1 << 20, progress=False, journal=journal)
    assert len(second.opened) == len(tasks) - 4 and failing in second.opened
    second.out.update(first.out)
    _check(second, state)


def test_storage_error_says_how_to_continue():
    full = storage_error(OSError(errno.EDQUOT, "Disk quota exceeded", "/o/f"), "writing 'w'")
    assert isinstance(full, StorageError) and "out of space (/o/f)" in str(full) and "--resume" in str(full)
    io = storage_error(OSError(errno.EIO, "Input/output error"), "writing 'w'")
    assert "I/O error" in str(io) and "rerun with --resume" in str(io)


def test_memory_budget_caps_a_request_at_the_limit():
    budget = MemoryBudget(10)
    assert budget.acquire(25) == 10  # larger than the budget: runs alone
    budget.release(10)
    assert budget.acquire(4) == 4 and budget.acquire(6) == 6 and budget.peak == 10


class _Tensors(TensorReader):
    """A tensor-only reader over the saved tensors, cut into the DCP reader's chunks."""

    def __init__(self, state, index):
        self.state, self._index = state, index

    def index(self):
        return self._index

    def read_region(self, key, chunk, region):
        t = self.state[key]
        return t[region.slices()].clone() if t.dim() else t.clone()


def test_fill_piece_is_the_same_through_any_reader(saved):
    state, root = saved
    with DCPReader(root) as reader:
        tensors = _Tensors(state, reader.index())
        for task in _tasks(reader, piece_bytes=16):
            for piece in task.pieces:
                a = fill_piece(reader, task, piece).copy()
                b = fill_piece(tensors, task, piece)
                assert a.dtype == b.dtype and np.array_equal(a, b), (task.key, piece.box)
