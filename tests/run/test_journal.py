"""converter/run/journal.py: the resume journal on its own (header, batches, torn lines, a
different conversion refused, the index fingerprint)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from converter.plan.copy_tasks import WriteTask
from converter.run.journal import JOURNAL_NAME, Journal, index_fingerprint, task_id
from formats.base import Box, CheckpointIndex, ChunkRef, TensorEntry
from formats.errors import DestinationError

HEADER = {"op": "to-universal", "fingerprint": "abc"}


def _task(key: str, row: int) -> WriteTask:
    return WriteTask(key, "float32", (key, row), Box((row, 0), (1, 4)), ())


def test_task_id_is_stable_and_names_key_and_box():
    a, b = _task("w", 3), _task("w", 3)
    assert task_id(a) == task_id(b) == '["w",[3,0],[1,4]]'
    assert task_id(_task("w", 4)) != task_id(a) and task_id(_task("v", 3)) != task_id(a)


class _Tagged:
    def __init__(self, tag):
        self.journal_tag = tag


@settings(max_examples=300, deadline=None)
@given(key=st.text(), offsets=st.lists(st.integers(0, 1 << 62), max_size=5),
       tag=st.one_of(st.none(), st.text(min_size=1), st.lists(st.integers(), min_size=1)))
def test_task_id_is_the_json_of_key_box_and_tag(key, offsets, tag):
    """The id is json.dumps([key, offsets, sizes(, tag)], separators=(",", ":")) (spelled out for
    speed: the journals of --resume written by earlier versions keep matching), any key."""
    box = Box(tuple(offsets), tuple(o % 7 + 1 for o in offsets))
    task = WriteTask(key, "float32", _Tagged(tag), box, ())
    ident = [key, list(box.offsets), list(box.sizes)] + ([tag] if tag else [])
    assert task_id(task) == json.dumps(ident, separators=(",", ":"))


def test_recorded_tasks_are_durable_only_after_flush(tmp_path):
    j = Journal(tmp_path, HEADER)
    assert json.loads((tmp_path / JOURNAL_NAME).read_text()) == {"header": HEADER}
    j.record(_task("w", 0), {"crc": 1})
    j.record(_task("w", 1))
    assert not j.is_done(_task("w", 0))  # recorded, not yet flushed
    synced = []
    j.flush(lambda: synced.append(True), force=True)
    assert synced == [True] and j.is_done(_task("w", 0)) and j.info(_task("w", 0)) == {"crc": 1}
    j.flush(lambda: synced.append(True), force=True)  # nothing pending: no sync
    assert synced == [True]
    again = Journal.resume(tmp_path, HEADER)
    assert again.is_done(_task("w", 1)) and again.info(_task("w", 1)) is None
    assert not again.is_done(_task("w", 2))


def test_flush_waits_for_the_batch_interval(tmp_path, monkeypatch):
    monkeypatch.setattr("converter.knobs.JOURNAL_FLUSH_SECONDS", 3600.0)
    j = Journal(tmp_path, HEADER)
    j.record(_task("w", 0))
    j.flush(lambda: None)
    assert not Journal.resume(tmp_path, HEADER).done  # not forced, interval not reached
    j.flush(lambda: None, force=True)
    assert Journal.resume(tmp_path, HEADER).is_done(_task("w", 0))


def test_a_torn_last_line_is_redone(tmp_path):
    j = Journal(tmp_path, HEADER)
    for row in range(3):
        j.record(_task("w", row))
    j.flush(lambda: None, force=True)
    with open(tmp_path / JOURNAL_NAME, "a") as f:
        f.write('{"t": "[\\"w\\",[3')  # killed mid-append
    again = Journal.resume(tmp_path, HEADER)
    assert [again.is_done(_task("w", r)) for r in range(4)] == [True, True, True, False]


def test_resume_refuses_another_conversion_or_no_journal(tmp_path):
    with pytest.raises(DestinationError, match="nothing to resume"):
        Journal.resume(tmp_path, HEADER)
    Journal(tmp_path, HEADER)
    with pytest.raises(DestinationError, match="different conversion"):
        Journal.resume(tmp_path, {**HEADER, "fingerprint": "other"})
    Journal.resume(tmp_path, HEADER).remove()
    assert not (tmp_path / JOURNAL_NAME).exists()
    j = Journal(tmp_path, HEADER)
    j.remove()
    j.remove()  # removing twice is fine
    Journal(tmp_path, HEADER, done={})  # reopened with what was done: writes no header
    assert not (tmp_path / JOURNAL_NAME).exists()


def test_index_fingerprint_changes_with_what_decides_the_output():
    def index(file: str = "__0_0.distcp", shape=(4, 4), locator=("a", 0)) -> CheckpointIndex:
        chunk = ChunkRef(Box((0, 0), shape), file, locator)
        return CheckpointIndex("dcp", "/x", {"w": TensorEntry("w", "float32", shape, (chunk,), ("w",))}, {})

    base = index_fingerprint(index())
    assert base == index_fingerprint(index())
    assert len({base, index_fingerprint(index(file="__1_0.distcp")), index_fingerprint(index(shape=(4, 5))),
                index_fingerprint(index(locator=("a", 64)))}) == 4


class _SharedSink:
    """Tasks write rows of a few shared files (as DCP rank files are); counts ``ready`` checks."""

    def __init__(self, files: int):
        self.files, self.synced, self.opened = files, [], 0

    def shared_files(self, task):
        return (task.box.offsets[0] % self.files,)

    def sync_files(self, ids):
        self.synced.extend(ids)

    def sync(self):
        pass

    def open(self, task):
        class Writer:
            def close(self):
                return None

        return Writer()


def test_a_run_judges_each_waiting_task_a_bounded_number_of_times(tmp_path, monkeypatch):
    """A batch with nothing ready must not judge every waiting task again at every loop turn:
    with a batch at each turn, that was O(tasks^2) ``ready`` checks (180,530 for the 1,472 tasks
    of a 1 GB from-universal; minutes at 10^5 tasks). Now only new tasks are judged until a file
    finishes (or is synced): at most tasks x (1 + files) checks."""
    from converter.run import executor
    from converter.run.journal import SharedFiles

    monkeypatch.setattr("converter.knobs.JOURNAL_FLUSH_SECONDS", 0.0)  # a batch at every loop turn
    monkeypatch.setattr("converter.knobs.JOURNAL_OPEN_FILE_SECONDS", 3600.0)
    calls = []
    real_ready = SharedFiles.ready
    monkeypatch.setattr(SharedFiles, "ready", lambda self, task: calls.append(1) or real_ready(self, task))
    n, files = 3000, 3
    tasks = [WriteTask("w", "float32", ("w", row), Box((row, 0), (1, 4)), ()) for row in range(n)]
    sink = _SharedSink(files)
    journal = Journal(tmp_path, HEADER)
    executor.execute(tasks, reader=None, sink=sink, workers=2, memory_budget=1 << 20, progress=False,
                     journal=journal)
    assert sorted(sink.synced) == list(range(files))  # each shared file synced once
    assert all(journal.is_done(t) for t in tasks)
    assert len(calls) <= n * (1 + files), f"{len(calls)} ready checks for {n} tasks"


def test_the_main_loop_wakes_per_batch_of_completions_not_per_task(tmp_path, monkeypatch):
    """Each wake of the main loop takes the GIL from the workers: woken once per task, 37,000 small
    tasks (a 1 GB store to tp2,dp32) cost 780,000 futex calls. It now lets completions gather
    for ``knobs.COMPLETION_BATCH_SECONDS`` before it looks."""
    from converter.run import executor

    turns = []
    real = executor._completed
    monkeypatch.setattr(executor, "_completed", lambda *a, **k: turns.append(1) or real(*a, **k))
    n = 3000
    tasks = [WriteTask("w", "float32", ("w", row), Box((row, 0), (1, 4)), ()) for row in range(n)]
    journal = Journal(tmp_path, HEADER)
    executor.execute(tasks, reader=None, sink=_SharedSink(3), workers=2, memory_budget=1 << 20, progress=False,
                     journal=journal)
    assert all(journal.is_done(t) for t in tasks)
    assert len(turns) <= n // 10, f"{len(turns)} turns of the main loop for {n} tasks"
