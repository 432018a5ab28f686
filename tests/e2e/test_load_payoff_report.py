"""bench/load_payoff.py's report (issue 29): the paired ratio to the original that its verdict rests
on, the warm-up rounds it leaves out, and the rotated order that keeps any case from always
loading first. Pure functions over rows; the bench itself runs in bench/."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import load_payoff  # noqa: E402

FIELDS = {"plan_s": 0.1, "read_s": 1.0, "bytes": 10, "files": 1, "foreign_bytes": 0, "short": False}


def _rows(walls: dict[str, list[float]], warmup: dict[str, float]) -> list[dict]:
    rows = []
    for variant, per_round in walls.items():
        for k, wall in enumerate(per_round):
            for rank, share in ((0, 1.0), (1, 0.5)):  # the slowest rank decides a round
                rows.append({"world": 2, "mesh": "dp2", "variant": variant, "round": k, "warmup": False,
                             "rank": rank, "wall_s": wall * share, **FIELDS})
        rows.append({"world": 2, "mesh": "dp2", "variant": variant, "round": -1, "warmup": True, "rank": 0,
                     "wall_s": warmup[variant], **FIELDS})
    return rows


def test_the_ratio_to_the_original_is_paired_by_round_and_leaves_the_warm_up_out():
    # the machine's slow spell (round 1) hits both: paired, the converted one is 0.5x in every round
    walls = {"original": [2.0, 8.0, 2.0], "rank": [1.0, 4.0, 1.0]}
    summary = {s["variant"]: s for s in load_payoff.summarize(_rows(walls, {"original": 1.0, "rank": 99.0}))}
    assert summary["rank"]["x_original"] == 0.5 and summary["rank"]["x_original_ci90"] == [0.5, 0.5]
    assert summary["original"]["x_original"] == 1.0
    assert summary["rank"]["wall_s"] == 1.0 and summary["rank"]["best_s"] == 1.0  # 99 s warm-up not counted
    assert summary["original"]["wall_s"] == 2.0


def test_the_interval_spans_the_rounds_ratios():
    walls = {"original": [1.0] * 9, "dedup": [0.8, 0.9, 1.0, 1.1, 1.2, 0.9, 1.0, 1.05, 0.95]}
    s = {r["variant"]: r for r in load_payoff.summarize(_rows(walls, {"original": 1.0, "dedup": 1.0}))}["dedup"]
    low, high = s["x_original_ci90"]
    assert 0.8 <= low <= s["x_original"] <= high <= 1.2 and low < high


def test_the_rounds_rotate_the_cases():
    cases = ["a", "b", "c"]
    orders = [load_payoff.round_robin(cases, k) for k in range(-1, 3)]
    assert orders == [["c", "a", "b"], ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {o[0] for o in orders} == set(cases)
