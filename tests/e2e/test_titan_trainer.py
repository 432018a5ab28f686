"""torchtitan 0.3.0's own Trainer: its checkpoints converted by ckptconv load in its own Trainer on the
target mesh through ``CheckpointManager.load`` (``-m slow``: multi-process gloo runs).

Sources: torchtitan's saves at FSDP4 (``dp4``), TP2 x FSDP2 (``tp2,dp2``) and HSDP (``dp_replicate2,dp2``), step 2 of 3
(``titan_checkpoint`` fixture). Each conversion (``from-universal`` straight from the DCP) is loaded
by a fresh Trainer on the target mesh, which then runs step 3. Checked, per rank: the loaded state
equals torch's own ``dcp_to_torch_save`` of the source bit for bit (model, optimizer states and
hyper-parameters, lr_scheduler, train_state, and the dataloader where the DP degree is unchanged);
step 3's loss equals the source run's step 3 (every step sees the same global batch whatever the
DP degree); and every chunk of a sharded tensor that only one rank loads is read from that rank's
own file (bytes counted in torch's ``FileSystemReader.read_data``). A box several ranks hold (a
sharded tensor replicated over another mesh dim, e.g. norms over tp) has one storage entry in DCP,
so all but one of its holders read it from another holder's file, as in torchtitan's own saves
(``test_native_baseline`` measures those).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import titan_support
from cli_runner import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.framework("torchtitan")]

CASES = [  # (source mesh, target mesh, plan, drop the dataloader state)
    ("dp4", "dp4", "torchtitan:llama3/debugmodel", False),
    ("dp4", "tp2,dp2", "torchtitan:llama3/debugmodel", True),
    ("dp4", "dp2", "llama", True),
    ("tp2,dp2", "dp2", "llama", False),
    ("tp2,dp2", "dp4", "torchtitan:llama3/debugmodel", True),
    ("tp2,dp2", "tp2,dp2", "llama", False),
    ("tp2,dp2", "tp2,dp2", "source", False),  # the fused wqkv's states by their own split (issue 24.3)
    # HSDP source and targets, DDP-only target: every box replicated over dp_replicate has one
    # storage entry, read by both replicas (as in torchtitan's own HSDP save, same bytes per rank)
    ("dp_replicate2,dp2", "tp2,dp2", "torchtitan:llama3/debugmodel", True),
    ("dp4", "dp_replicate2,dp2", "llama", False),  # same DP degree: the dataloader state is kept
    ("tp2,dp2", "dp_replicate2", "torchtitan:llama3/debugmodel", True),
    # No --plan (auto, the default), as a new user runs it: TP target from a TP x FSDP source (the
    # source's own splits, Llama rules for the rest) and from an FSDP-only source (Llama rules)
    ("tp2,dp2", "tp2,dp2", "", False),
    ("dp4", "tp2,dp2", "", True),
    # No pp target: torchtitan 0.3.0 calls PipelineSchedule.step(arg_mbs=..., kwarg_mbs=...), which
    # torch 2.13's schedules do not take ("Expecting 4 arg_mbs but got 1"); its PP needs a newer torch.
]


def _rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _chunk_readers(reports: list[dict]) -> dict[tuple, set[int]]:
    """(key, chunk offsets) -> the ranks that read that chunk of a sharded tensor."""
    out: dict[tuple, set[int]] = {}
    for rep in reports:
        for fqn, offsets, _, _ in rep["reads"]["items"]:
            out.setdefault((fqn, tuple(offsets)), set()).add(rep["rank"])
    return out


def _classify(rep: dict, readers: dict[tuple, set[int]]) -> tuple[int, int, list]:
    """(bytes of chunks only this rank reads, read from its own file; bytes of chunks several ranks
    read (a box replicated over a mesh dim has one storage entry in DCP, so all but one holder read
    it from another file); chunks only this rank reads that came from another rank's file)."""
    own, shared, foreign = 0, 0, []
    for fqn, offsets, name, n in rep["reads"]["items"]:
        sharers = readers[(fqn, tuple(offsets))]
        if len(sharers) > 1:
            assert any(name == _rank_file(s) for s in sharers), (fqn, offsets, name, sharers)
            shared += n
        elif name == _rank_file(rep["rank"]):
            own += n
        else:
            foreign.append((fqn, offsets, name, n))
    return own, shared, foreign


@pytest.mark.parametrize("src_mesh,dst_mesh,plan,drop", CASES,
                         ids=[f"{a}-to-{b}-{p.split(':')[0] or 'auto'}" for a, b, p, _ in CASES])
def test_converted_checkpoint_loads_in_torchtitan(titan_checkpoint, tmp_path, src_mesh, dst_mesh, plan, drop):
    src = titan_checkpoint(src_mesh)
    dump = tmp_path / "job"
    out = dump / "checkpoint" / "step-2"
    args = ["from-universal", str(src / "ckpt"), str(out), "--mesh", dst_mesh, *(["--plan", plan] if plan else [])]
    code, stdout, stderr = run_cli(*args, *(["--drop-dataloader-state"] if drop else []))
    assert code == 0, stdout + stderr
    assert "matched no rule" not in stderr and "warning: mesh dim" not in stderr
    if not plan:  # the plan --plan auto chose, and why, in one line
        chosen = [line for line in stderr.splitlines() if "(--plan auto)" in line]
        assert len(chosen) == 1 and ("plan source+llama" if "tp" in src_mesh else "plan llama") in chosen[0], stderr
    job = {"mesh": dst_mesh, "dump": str(dump), "steps": 3, "reference": str(src / "reference.pt"),
           "skip_compare": ["dataloader"] if drop else []}
    reports = titan_support.run_job(job, tmp_path / "run")
    source = json.loads((src / "train.json").read_text())
    want_loss = source["losses"]["3"]
    lines = []
    readers = _chunk_readers(reports)
    for rep in reports:
        r = rep["rank"]
        assert rep["loaded"] and rep["loaded_step"] == 2, rep
        assert rep["mismatch"] == [], rep["mismatch"][:5]
        assert rep["compared"] > 100
        own, shared, foreign = _classify(rep, readers)
        assert foreign == [], f"rank {r} read chunks only it loads from other ranks' files: {foreign[:5]}"
        got = rep["losses"]["3"]
        same_mesh = src_mesh == dst_mesh
        assert got == want_loss if same_mesh else math.isclose(got, want_loss, rel_tol=2e-5), (got, want_loss)
        lines.append(f"rank {r}: sharded tensors: {own} B of its own chunks from its file, {shared} B of chunks "
                     f"it shares with other ranks (one DCP storage entry per box); whole tensors "
                     f"{sum(rep['reads']['whole'].values())} B; loss3 {got!r} (source {want_loss!r})")
    Path(tmp_path / "summary.txt").write_text("\n".join(lines))
    print(f"\n{src_mesh} -> {dst_mesh} ({plan}{', dataloader dropped' if drop else ''}):\n" + "\n".join(lines))


def test_plan_source_places_the_fused_wqkv_states_by_their_own_split(titan_checkpoint, tmp_path):
    """torchtitan 0.3.0's fused ``qkv_linear.wqkv.weight`` has optimizer states only (the model's
    save hook writes wq/wk/wv): ``--plan source`` to the saved mesh gives its states the boxes
    torchtitan saved them with (TP x FSDP, strided), none replicated (issue 24, point 3)."""
    from torch.distributed.checkpoint import FileSystemReader

    src = titan_checkpoint("tp2,dp2")
    code, out, err = run_cli("from-universal", str(src / "ckpt"), str(tmp_path / "out"), "--mesh", "tp2,dp2",
                             "--plan", "source", "--dry-run", "--json")
    assert code == 0, err
    assert "matched no rule" not in err and "replicated" not in err
    doc = json.loads(out)
    md = FileSystemReader(str(src / "ckpt")).read_metadata().state_dict_metadata
    fused = [t for t in doc["tensors"] if ".qkv_linear.wqkv." in t["key"]]
    assert len(fused) >= 2 and all(t["key"].startswith("optimizer.state.") for t in fused)
    for t in (t for t in fused if t["key"].endswith(("exp_avg", "exp_avg_sq"))):
        got = {(tuple(c["offsets"]), tuple(c["sizes"]), c["rank"]) for c in t["chunks"]}
        want = {(tuple(c.offsets), tuple(c.sizes)) for c in md[t["key"]].chunks}
        assert {(o, s) for o, s, _ in got} == want and len(got) == 4, t["key"]
        assert t["rule"] == "source" and [p["placement"] for p in t["placement"]] == ["_StridedShard(dim=0, sf=2)",
                                                                                     "Shard(0)"]


def test_dp_change_without_drop_warns_and_torchtitan_refuses(titan_checkpoint, tmp_path):
    """Without --drop-dataloader-state a DP change keeps the state and says so; torchtitan itself then
    refuses it (the assertion the warning quotes), and loads with exclude_from_loading."""
    src = titan_checkpoint("dp4")
    dump = tmp_path / "job"
    code, _, stderr = run_cli("from-universal", str(src / "ckpt"), str(dump / "checkpoint" / "step-2"), "--mesh", "dp2",
                              "--plan", "llama")
    assert code == 0 and "DP degree 4" in stderr and "exclude_from_loading" in stderr
    with pytest.raises(RuntimeError, match="dp_degree is inconsistent"):
        titan_support.run_job({"mesh": "dp2", "dump": str(dump), "steps": 3}, tmp_path / "run")
    reports = titan_support.run_job({"mesh": "dp2", "dump": str(dump), "steps": 3, "exclude": ["dataloader"],
                                     "reference": str(src / "reference.pt"), "skip_compare": ["dataloader"]},
                                    tmp_path / "run2")
    assert all(r["loaded"] and r["mismatch"] == [] for r in reports)


@pytest.mark.parametrize("mesh", ["tp2,dp2"])
def test_native_baseline(titan_checkpoint, tmp_path, mesh):
    """torchtitan's own save loaded on its own mesh: the same read accounting, for comparison."""
    import shutil

    src = titan_checkpoint(mesh)
    dump = tmp_path / "job"
    shutil.copytree(src / "ckpt", dump / "checkpoint" / "step-2")
    reports = titan_support.run_job({"mesh": mesh, "dump": str(dump), "steps": 3, "reference": str(src / "reference.pt")},
                                    tmp_path / "run")
    readers = _chunk_readers(reports)
    for rep in reports:
        own, shared, foreign = _classify(rep, readers)
        assert rep["mismatch"] == [] and foreign == []
        print(f"native {mesh} rank {rep['rank']}: own {own} B, shared {shared} B, whole {sum(rep['reads']['whole'].values())} B")
