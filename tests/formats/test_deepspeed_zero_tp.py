"""The TP join rules of :mod:`formats.deepspeed_zero.tp` on metadata alone: each rank's chunks
placed where ds_to_universal's ``merge_tp_slices`` puts their elements (checked against
``torch.cat`` / ``torch.chunk`` of numbered slices), and the rules' validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from formats.base import Box, ChunkRef, TensorEntry, full_box
from formats.deepspeed_zero.flat import flat_boxes
from formats.deepspeed_zero.tp import Join, TpRules, join_entries
from formats.errors import InvalidCheckpointError, UnsupportedError

INFO = {"tp_replicated_parameter_patterns": [r"ln\."], "parameter_with_row_parallelism_patterns": [r".*dense_4h\.w"],
        "vocabulary_parameter_patterns": [r"embed\."], "original_vocab_size": 5,
        "parameter_with_2_sub_params_cat_dim_0": [r".*h_to_4h\."]}


def _entry(shape: tuple[int, ...], storage: int, cuts: int) -> TensorEntry:
    """A rank's tensor stored flat in storage ``storage`` and cut in ``cuts`` flat pieces (as ZeRO
    cuts a parameter across data-parallel ranks): chunks of flat ranges, locator (slot, offset)."""
    n = int(np.prod(shape))
    bounds = np.linspace(0, n, cuts + 1).astype(int)
    chunks = [ChunkRef(box, "f", (storage, first), dp) for dp, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))
              for box, first in flat_boxes(shape, int(lo), int(hi))]
    return TensorEntry("model.x", "float32", shape, tuple(chunks), ("model", "x"))


def _materialize(entry: TensorEntry, storages: list[np.ndarray]) -> np.ndarray:
    """What a reader returns: each chunk's elements read by its locator's strides."""
    out = np.full(entry.shape, np.nan)
    strides = np.cumprod((entry.shape[1:] + (1,))[::-1])[::-1] if entry.shape else ()
    covered = np.zeros(entry.shape, dtype=int)
    for c in entry.chunks:
        slot, base, *st = c.locator
        st = tuple(st[0]) if st else tuple(int(s) for s in strides)
        flat = storages[slot]
        idx = np.indices(c.box.sizes).reshape(len(c.box.sizes), -1)
        pos = base + sum(i * s for i, s in zip(idx, st))
        out[c.box.slices()] = flat[pos].reshape(c.box.sizes)
        covered[c.box.slices()] += 1
    assert (covered == 1).all()
    return out


@pytest.mark.parametrize("join,shape,oracle", [
    (Join("cat", 0), (3, 4), lambda s: np.concatenate(s, 0)),
    (Join("cat", 1), (3, 4), lambda s: np.concatenate(s, 1)),
    (Join("two_sub", 0), (5, 3), lambda s: np.concatenate([np.concatenate([x[:3] for x in s]),
                                                           np.concatenate([x[3:] for x in s])])),
    (Join("cat", 0, rows=5), (3, 2), lambda s: np.concatenate(s, 0)[:5]),
    (Join("replicated"), (3, 4), lambda s: s[0]),
])
@pytest.mark.parametrize("cuts", [1, 3])
def test_join_places_every_element_where_merge_tp_slices_does(join: Join, shape, oracle, cuts: int) -> None:
    tp = 2
    storages = [np.arange(np.prod(shape)) + 1000 * t for t in range(tp)]
    slices = [s.reshape(shape).astype(float) for s in storages]
    entries = [_entry(shape, t, cuts) for t in range(tp)]
    joined = join_entries("model.x", entries, join, [[t + tp * d for d in range(cuts)] for t in range(tp)], "here")
    want = oracle(slices)
    assert joined.shape == want.shape
    np.testing.assert_array_equal(_materialize(joined, storages), want)
    assert {c.rank for c in joined.chunks} <= set(range(tp * cuts))


def test_rules_follow_ds_to_universal_order() -> None:
    rules = TpRules.parse(INFO, "info")
    assert rules.join_of("ln.weight") == Join("replicated")
    assert rules.join_of("layers.0.dense_4h.weight") == Join("cat", 1)
    assert rules.join_of("layers.0.h_to_4h.weight") == Join("two_sub", 0)
    assert rules.join_of("embed.weight") == Join("cat", 0, rows=5)
    assert rules.join_of("other") == Join("cat", 0)


@pytest.mark.parametrize("info,match", [
    ({"tp_replicated_parameter_patterns": "ln"}, "must be a list of regex strings"),
    ({"parameter_with_row_parallelism_patterns": ["("]}, "is not a regex"),
    ({"vocabulary_parameter_patterns": ["embed"]}, "without 'original_vocab_size'"),
    ([], "not a mapping"),
])
def test_bad_rules_are_one_line(info, match: str) -> None:
    with pytest.raises(InvalidCheckpointError, match=match):
        TpRules.parse(info, "rules.json")


def test_unsupported_categories_refused() -> None:
    rules = TpRules.parse({"parameter_to_average_patterns": ["avg"]}, "info")
    with pytest.raises(UnsupportedError, match="mean"):
        rules.join_of("avg.weight")
    with pytest.raises(UnsupportedError, match="parameter_with_sub_params"):
        TpRules.parse({"parameter_with_sub_params": [{"patterns": ["q"], "shape": [3, -1], "partition_dim": 0}]},
                      "info").join_of("q")
    with pytest.raises(InvalidCheckpointError, match="matches 2"):
        TpRules.parse({"tp_replicated_parameter_patterns": ["a", "ab"]}, "info").join_of("abc")


def test_rules_file_and_a_join_that_does_not_fit(tmp_path: Path) -> None:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"tp_replicated_parameter_patern": []}))
    with pytest.raises(InvalidCheckpointError, match="unknown TP rules key"):
        TpRules.load(path)
    path.write_text(json.dumps(INFO))
    assert TpRules.load(path).join_of("ln.bias").kind == "replicated"
    one = TensorEntry("model.b", "float32", (4,), (ChunkRef(full_box((4,)), "f", (0, 0)),), ("model", "b"))
    with pytest.raises(InvalidCheckpointError, match="joins on dim 1"):
        join_entries("model.b", [one, one], Join("cat", 1), [[0], [1]], "here")
    other = TensorEntry("model.b", "float32", (5,), (ChunkRef(Box((0,), (5,)), "f", (0, 0)),), ("model", "b"))
    with pytest.raises(Exception, match="TP rank 1 holds"):
        join_entries("model.b", [one, other], Join("replicated"), [[0], [1]], "here")
