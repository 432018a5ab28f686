"""``--plan megatron-core``: a torch_dist target laid out where megatron-core's own
``sharded_state_dict()`` puts every chunk, each in its main replica's file.

The pure part (any boxes -> chunks, optimizer states following their parameter) runs in the default
suite; megatron-core's own plan (the model built from the checkpoint's args on meta over a fake
process group) is checked against megatron's own save of the same layout (``-m slow``, framework), and
megatron's load of conversions, with the bytes each rank reads from each file counted, is in
``tests/e2e/test_megatron_legacy_e2e.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import megatron_support as ms
from cli_runner import run_cli
from converter.plan.megatron_code import RankBoxes, _alike, _ranks, code_layout, load_rank_boxes
from converter.plan.mesh import parse_mesh
from converter.run.sources import open_checkpoint
from formats.base import Box, CheckpointIndex, ChunkRef, TensorEntry
from formats.errors import PlanError

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "megatron" / "legacy_tp2_pp2_vpp2" / "torch_dist"
NO_ARGS = FIXTURE.parents[1] / "gpt_tp2_dp2"  # (saved before its args held Megatron-LM's training argument names)


def _entry(key: str, shape: tuple) -> TensorEntry:
    return TensorEntry(key, "float32", shape, (ChunkRef(Box((0,) * len(shape), shape), "f", key),), (key,))


def test_boxes_go_to_their_main_replica_and_states_follow():
    w = "decoder.layers.self_attention.linear_qkv.weight"
    index = CheckpointIndex("dcp", "/x", {k: _entry(k, (2, 8, 4)) for k in (w, f"optimizer.state.exp_avg.{w}")}
                            | {"odd": _entry("odd", (3,))}, {}, {})
    boxes = RankBoxes({w: (2, 8, 4)}, {w: ((Box((0, 0, 0), (1, 4, 4)), 0, (0, 4)), (Box((0, 4, 0), (1, 4, 4)), 1, (1, 5)),
                                           (Box((1, 0, 0), (1, 4, 4)), 2, (2, 6)), (Box((1, 4, 0), (1, 4, 4)), 3, (3, 7)))})
    rows, warnings = code_layout(index, boxes)
    by_key = {}
    for key, box, rank, loaders in rows:
        by_key.setdefault(key, []).append((box.offsets, rank, loaders))
    assert by_key[w] == by_key[f"optimizer.state.exp_avg.{w}"] == [((0, 0, 0), 0, (0, 4)), ((0, 4, 0), 1, (1, 5)),
                                                                    ((1, 0, 0), 2, (2, 6)), ((1, 4, 0), 3, (3, 7))]
    assert by_key["odd"] == [((0,), 0, None)] and "odd" in warnings[0]
    bad = RankBoxes({w: (2, 8, 8)}, boxes.boxes)
    with pytest.raises(PlanError, match="built from the checkpoint's args"):
        code_layout(index, bad)


def test_each_rank_loads_what_its_representative_loads():
    """megatron's rank order (tp fastest, then dp, pp; ep carved out of dp, its rank dp mod ep): the
    models built are one per (tp, pp, expert rank), and every rank maps to the one with its
    coordinates."""
    layout = dict(tp=2, dp=4, pp=2, ep=2, world=16)
    assert _ranks(layout) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert _alike(layout) == [0, 1, 2, 3, 0, 1, 2, 3, 8, 9, 10, 11, 8, 9, 10, 11]
    assert _alike(dict(tp=1, dp=2, pp=1, ep=1, world=2)) == [0, 0]
    # expert TP other than TP: the experts' ranks etp-ep-edp-pp over the same world (megatron's
    # expert rank generator); one model per distinct (tp, pp, etp, ep), the lowest rank of each
    etp = dict(tp=1, dp=4, pp=1, ep=2, etp=2, world=4)  # TP1 x DP4, experts ETP2 x EP2: every rank differs
    assert _ranks(etp) == [0, 1, 2, 3] and _alike(etp) == [0, 1, 2, 3]
    etp1 = dict(tp=2, dp=2, pp=1, ep=2, etp=1, world=4)  # TP2 x DP2, experts ETP1 x EP2: rank r's ep is r % 2 = its tp
    assert _ranks(etp1) == [0, 1] and _alike(etp1) == [0, 1, 0, 1]
    assert _alike(dict(etp1, etp=2)) == _alike(dict(tp=2, dp=2, pp=1, ep=2, world=4)) == [0, 1, 2, 3]


def test_expert_tp_must_fit_megatrons_expert_ranks():
    from converter.plan.megatron_code import layout_degrees
    from formats.errors import ConfigError

    assert layout_degrees(parse_mesh("dp4,ep2,etp2"), 1)["etp"] == 2
    assert layout_degrees(parse_mesh("tp2,dp2,ep2"), 1)["etp"] == 2  # (megatron's default: the tp)
    with pytest.raises(ConfigError, match="etp4 x ep2 must divide tp x dp = 4"):
        layout_degrees(parse_mesh("dp4,ep2,etp4"), 1)


@pytest.mark.slow
@pytest.mark.framework("megatron")
def test_megatrons_plan_of_the_saved_layout_is_its_own_save():
    """For the layout the fixture was saved on (TP2 x PP2 x VPP2), megatron-core's plan gives exactly
    the chunks megatron's own dist_checkpointing.save wrote, each in the file of the rank that wrote it."""
    reason = ms.skip_reason()
    if reason:
        pytest.skip(reason)
    with open_checkpoint(FIXTURE) as r:
        index = r.index()
        (common,) = r.load_object("common_state/shard_0_1", trust_pickle=True)
    boxes = load_rank_boxes(vars(common["args"]), parse_mesh("pp2,tp2", None), vpp=2)
    model = {k: e for k, e in index.tensors.items() if not k.startswith("optimizer.")}
    assert set(boxes.boxes) == set(model)
    for key, entry in model.items():
        saved = sorted((c.box.offsets, c.box.sizes, int(c.file.split("_")[2])) for c in entry.chunks)
        planned = sorted((b.offsets, b.sizes, rank) for b, rank, _ in boxes.boxes[key])
        assert planned == saved, key


def _saved_chunks(root: Path) -> dict[str, list]:
    """Per model key: (offsets, sizes, the rank whose file holds it) of megatron's own save."""
    with open_checkpoint(root) as r:
        index = r.index()
    return {k: sorted((c.box.offsets, c.box.sizes, int(c.file.split("_")[2])) for c in e.chunks)
            for k, e in index.tensors.items() if not k.startswith("optimizer.")}


def _planned_chunks(doc: dict) -> dict[str, list]:
    return {t["key"]: sorted((tuple(c["offsets"]), tuple(c["sizes"]), c["rank"]) for c in t["chunks"])
            for t in doc["tensors"] if not t["key"].startswith("optimizer.")}


def test_auto_without_training_args_is_the_name_rules_and_says_why(tmp_path):
    """--plan auto on Megatron names whose args cannot build megatron's model (no padded_vocab_size):
    the name-rule plan, its one line saying why megatron-core's own plan is not used; --vpp, which
    only megatron-core's plan (or a legacy target) takes, is then refused in one line."""
    code, out, err = run_cli("from-universal", str(NO_ARGS), str(tmp_path / "out"), "--mesh", "tp2,dp2", "--dry-run",
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan"] == "megatron" and "megatron-core's own plan not used: " in doc["plan_reason"], doc["plan_reason"]
    code, _, err = run_cli("from-universal", str(NO_ARGS), str(tmp_path / "out"), "--mesh", "pp2,tp2", "--vpp", "2",
                           "--dry-run")
    assert code == 2 and "--vpp is for megatron-core's own plan" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.framework("megatron")
def test_auto_on_megatron_names_with_training_args_is_megatron_cores_plan(tmp_path):
    """No --plan on the fixture (its args are Megatron-LM's): the plan is megatron-core's own, said in
    one line, and on the layout it was saved on (--vpp 2) every model chunk is where megatron's own
    save put it; --plan megatron-core plans the same chunks."""
    reason = ms.skip_reason()
    if reason:
        pytest.skip(reason)
    docs = {}
    for plan in ("auto", "megatron-core"):
        code, out, err = run_cli("from-universal", str(FIXTURE), str(tmp_path / plan), "--mesh", "pp2,tp2",
                                 "--vpp", "2", "--plan", plan, "--dry-run", "--json")
        assert code == 0, err
        docs[plan] = json.loads(out)
    assert docs["auto"]["plan"] == "megatron-core", docs["auto"]["plan_reason"]
    assert "Megatron-core names with their training args" in docs["auto"]["plan_reason"]
    assert _planned_chunks(docs["auto"]) == _planned_chunks(docs["megatron-core"]) == _saved_chunks(FIXTURE)


def test_a_state_shaped_unlike_its_parameter_is_whole_without_a_warning():
    w = "decoder.layers.mlp.linear_fc2.weight"
    index = CheckpointIndex("dcp", "/x", {w: _entry(w, (2, 4)), f"optimizer.state.step.{w}": _entry("s", ())}, {}, {})
    boxes = RankBoxes({w: (2, 4)}, {w: ((Box((0, 0), (2, 2)), 0, (0,)), (Box((0, 2), (2, 2)), 1, (1,)))})
    rows, warnings = code_layout(index, boxes)
    assert [(k, b.sizes, r, q) for k, b, r, q in rows] == [(w, (2, 2), 0, (0,)), (w, (2, 2), 1, (1,)),
                                                           (f"optimizer.state.step.{w}", (), 0, None)]
    assert warnings == []


def test_etp_is_refused_by_the_name_rules_in_one_line(tmp_path):
    """etp is megatron-core's own plan's: the name rules (and torchtitan's plans) cannot place it."""
    code, _, err = run_cli("from-universal", str(NO_ARGS), str(tmp_path / "out"), "--mesh", "dp2,ep2,etp2",
                           "--plan", "megatron")
    assert code != 0 and "etp (megatron's expert tensor parallel size) is planned only by --plan megatron-core" in err
    assert not (tmp_path / "out").exists() and len(err.strip().splitlines()) == 1, err
