"""Per-rank dataloader state in from-universal: kept where the DP degree is unchanged (each DP rank's
entry in that rank's file), a warning naming both ways on where it changes, and
``--drop-dataloader-state`` (torchtitan gets an empty state per new DP rank). The real torchtitan
load of all three is in test_titan_trainer.py (``-m slow``)."""

from __future__ import annotations

import io
import pickle

import torch

from cli_runner import run_cli
from converter.plan import dataloader_state as dl
from converter.plan.mesh import parse_mesh
from formats.base import CheckpointIndex, ObjectEntry


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _titan_index(dp: int, extra: dict | None = None):
    """The dataloader entries torchtitan's ParallelAwareDataloader saves at DP degree ``dp``."""
    values = {"dataloader.world_size": dp} | {f"dataloader.dp_rank_{r}": pickle.dumps({"served": r}) for r in range(dp)}
    values |= extra or {}
    objects = {k: ObjectEntry(k, tuple(k.split(".", 1)), "__0_0.distcp", k) for k in values}
    data = {k: _saved(v) for k, v in values.items()}
    return CheckpointIndex("dcp", "ckpt", {}, objects), data.__getitem__


def test_find_torchtitan_layout():
    index, read = _titan_index(4, {"train_state.step": 2})
    state = dl.find(index, read)
    assert state.is_torchtitan and state.dp_degree == 4 and state.per_rank[3] == "dataloader.dp_rank_3"
    assert "train_state.step" not in state.keys and len(state.keys) == 5
    assert dl.find(CheckpointIndex("dcp", "c", {}, {}), read) is None


def test_same_dp_keeps_bytes_and_puts_each_rank_state_in_its_file():
    index, read = _titan_index(2)
    mesh = parse_mesh("tp2,dp2")  # dp rank 1 = ranks 2, 3
    specs, kept, warnings = dl.plan_objects(index, read, mesh, drop=False)
    assert warnings == [] and kept is index
    by_key = {k: (data, rank) for k, _, data, rank in specs}
    assert by_key["dataloader.dp_rank_0"] == (read("dataloader.dp_rank_0"), 0)
    assert by_key["dataloader.dp_rank_1"] == (read("dataloader.dp_rank_1"), 2)
    assert dl.dp_owner(parse_mesh("dp_replicate2,dp2,tp2"), 3) == 6


def test_dp_change_warns_with_both_ways_out():
    index, read = _titan_index(4)
    specs, _, warnings = dl.plan_objects(index, read, parse_mesh("tp2,dp2"), drop=False)
    assert len(specs) == 5 and all(data == read(k) for k, _, data, _ in specs)
    assert len(warnings) == 1
    assert "DP degree 4" in warnings[0] and "--drop-dataloader-state" in warnings[0]
    assert "exclude_from_loading" in warnings[0]


def test_drop_writes_an_empty_state_per_new_dp_rank():
    index, read = _titan_index(4, {"train_state.step": 2})
    specs, kept, notes = dl.plan_objects(index, read, parse_mesh("dp_replicate2,dp3"), drop=True)
    assert set(kept.objects) == {"train_state.step"} and "dropped 5 entries" in notes[0]
    by_key = {k: (path, data, rank) for k, path, data, rank in specs}
    assert torch.load(io.BytesIO(by_key["dataloader.world_size"][1])) == 6
    for r in range(6):
        path, data, rank = by_key[f"dataloader.dp_rank_{r}"]
        assert path == ("dataloader", f"dp_rank_{r}") and rank == r
        assert pickle.loads(torch.load(io.BytesIO(data))) == {}  # StatefulDataLoader: "no state"


def test_drop_on_a_checkpoint_without_dataloader_state(dcp_checkpoint, tmp_path):
    code, out, err = run_cli("from-universal", str(dcp_checkpoint("fsdp4")), str(tmp_path / "o"), "--mesh", "dp2",
                             "--drop-dataloader-state")
    assert code == 0, err
    assert "no dataloader state; nothing dropped" in err
