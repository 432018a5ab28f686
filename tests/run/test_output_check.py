"""converter/run/output_check.py on its own: the output a writer is about to publish against the
plan (every planned tensor once, its dtype and shape, nothing else, no shared bytes), and its cost
at 10^6 chunks (real outputs: tests/e2e/test_no_tensor_lost.py)."""

from __future__ import annotations

import time

import pytest

from converter.run.output_check import PlannedOutput, check_output
from formats.errors import InternalError
from formats.manifest import Manifest


def _manifest(items, extents=(), objects=()) -> Manifest:
    m = Manifest()
    for key, dtype, shape in items:
        m.tensor(key, dtype, shape)
    for key, file, begin, end in extents:
        m.extent(key, file, begin, end)
    m.objects.extend(objects)
    return m


PLAN = PlannedOutput.of([("a", "float32", (2, 3)), ("b", "bfloat16", ()), ("c", "int64", (0, 4))], ["o"])
GOOD = [("a", "float32", (2, 3)), ("b", "bfloat16", ()), ("c", "int64", (0, 4))]
EXTENTS = [("a", "f0", 0, 24), ("b", "f0", 24, 26), ("c", "f0", 26, 26), ("o", "f1", 0, 9)]


def test_the_plan_passes():
    check_output("op", PLAN, _manifest(GOOD, EXTENTS, ["o"]))
    check_output("op", PLAN, _manifest(reversed(GOOD), reversed(EXTENTS), ["o"]))  # order is free


@pytest.mark.parametrize("items, extents, objects, needle", [
    (GOOD[:2], EXTENTS, ["o"], "planned tensor 'c' (int64 [0, 4]) is not recorded"),
    (GOOD + [("d", "float32", (1,))], EXTENTS, ["o"], "tensor 'd' is recorded but not planned"),
    (GOOD + [GOOD[0]], EXTENTS, ["o"], "tensor 'a' is recorded 2 times"),
    ([("a", "float32", (3, 2))] + GOOD[1:], EXTENTS, ["o"], "'a' is recorded as float32 [3, 2], planned as float32 [2, 3]"),
    ([("a", "float16", (2, 3))] + GOOD[1:], EXTENTS, ["o"], "'a' is recorded as float16"),
    (GOOD, EXTENTS, [], "planned non-tensor entry 'o' is not recorded"),
    (GOOD, EXTENTS, ["o", "o"], "non-tensor entry 'o' is recorded 2 times"),
    (GOOD, EXTENTS, ["o", "p"], "non-tensor entry 'p' is recorded but not planned"),
    (GOOD, EXTENTS[:1] + [("b", "f0", 23, 25)] + EXTENTS[2:], ["o"], "tensors 'a' and 'b' share bytes 23-24 of f0"),
    (GOOD, EXTENTS + [("a", "f0", 10, 12)], ["o"], "two chunks of 'a' share bytes 10-12 of f0"),
    (GOOD, EXTENTS + [("b", "f1", 0, 1 << 62)], ["o"], "tensors 'o' and 'b' are both stored in f1"),
])
def test_each_mismatch_is_an_internal_error_naming_the_key(items, extents, objects, needle):
    with pytest.raises(InternalError) as e:
        check_output("export-hf", PLAN, _manifest(items, extents, objects))
    text = str(e.value)
    assert text.startswith("internal error: export-hf: the output is not its plan: ") and needle in text, text
    assert "\n" not in text and "nothing was published" in text


def test_a_writers_own_problem_is_reported():
    m = _manifest(GOOD, EXTENTS, ["o"])
    m.problem("tensor 'a': 3 of its 24 bytes written")
    with pytest.raises(InternalError, match="tensor 'a': 3 of its 24 bytes written"):
        check_output("op", PLAN, m)


def test_empty_extents_share_nothing_and_dtype_aliases_are_one_dtype():
    plan = PlannedOutput.of([("x", "float32", (0,)), ("y", "float32", (0,))])
    check_output("op", plan, _manifest([("x", "float32", (0,)), ("y", "float32", (0,))], [("x", "f", 8, 8), ("y", "f", 8, 8)]))
    with pytest.raises(InternalError, match="names tensor 'x' twice"):
        PlannedOutput.of([("x", "float32", (1,)), ("x", "float32", (1,))])


def test_a_million_chunks_are_checked_in_linear_time():
    """10^6 extents over 1,000 files (DCP rank files at 1,000 ranks): one numpy sort, no pair
    loop; the overlap found among them names its keys."""
    keys = [f"layers.{i}.w" for i in range(1000)]
    plan = PlannedOutput.of((k, "bfloat16", (1000, 8)) for k in keys)
    m = _manifest((k, "bfloat16", (1000, 8)) for k in keys)
    for r in range(1000):  # rank r's file holds row r of every key, 16 bytes each
        for i, k in enumerate(keys):
            m.extent(k, f"__{r}_0.distcp", i * 16, i * 16 + 16)
    t0 = time.process_time()
    check_output("from-universal", plan, m)
    seconds = time.process_time() - t0
    assert seconds < 10, seconds  # ~0.3 s on the 2-core machine under load
    m.begins[-1] -= 1  # the last key's chunk of the last rank now overlaps the one before it
    with pytest.raises(InternalError, match=r"tensors 'layers.998.w' and 'layers.999.w' share bytes 15983-15984 of __999_0.distcp"):
        check_output("from-universal", plan, m)
