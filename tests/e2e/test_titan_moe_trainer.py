"""torchtitan 0.3.0's own Trainer on its smallest MoE model (``deepseek_v3/debugmodel``: 8 routed
experts, 2 shared, top-3, the first layer dense), trained on CPU under gloo with expert parallelism
(``-m slow``: multi-process runs; issue 17, point 2).

torchtitan's MoE trains on CPU with no patch beyond the dense six (titan_support.py): the grouped
experts' ``torch._grouped_mm`` runs forward and backward on CPU in bf16, the EP token exchange is
``all_to_all_single`` (gloo has it), FSDP over ``efsdp`` reduces with the same SUM patch.

The source is its save at ``dp4,ep2`` (FSDP4; experts on the sparse mesh efsdp2 x ep2, so each
rank holds 2 of the 8 experts of every MoE layer, ``_StridedShard(0, 2)`` x ``Shard(0)``), step 2
of 3. Each conversion goes straight from that DCP to the target mesh and is loaded by a fresh
Trainer on it through ``CheckpointManager.load``, which then runs step 3. Checked, per rank: the
loaded state equals torch's own ``dcp_to_torch_save`` of the source bit for bit (model with
``expert_bias_E``, optimizer states, lr_scheduler, train_state, dataloader); step 3's loss equals the
source's; every chunk of a sharded tensor only that rank loads is read from its own file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import titan_moe_support
from cli_runner import run_cli
from test_titan_trainer import _chunk_readers, _classify

pytestmark = [pytest.mark.slow, pytest.mark.framework("torchtitan")]

SOURCE = "dp4,ep2"
CASES = [  # (target mesh, plan, DP degree changes: drop the dataloader state)
    ("dp4,ep2", "moe", False),  # same layout: the conversion is a byte-level identity of the data
    ("dp4,ep4", "moe", False),  # another EP degree: 2 of 8 experts per rank, on other ranks
    ("dp4", "torchtitan:deepseek_v3/debugmodel", False),  # EP off: experts FSDP-sharded on the dense mesh
    ("dp2,tp2,ep2", "torchtitan:deepseek_v3/debugmodel", True),  # TP on the dense parts, EP over the tp ranks
    # No --plan (auto, the default: torchtitan's MoE rules from the names): EP, TP, TP x EP targets
    ("dp4,ep4", "", False),
    ("dp2,tp2", "", True),
    ("dp2,tp2,ep2", "", True),
]


@pytest.mark.parametrize("dst_mesh,plan,drop", CASES,
                         ids=[f"{SOURCE}-to-{m}-{p.split(':')[0] or 'auto'}" for m, p, _ in CASES])
def test_converted_moe_checkpoint_loads_in_torchtitan(titan_moe_checkpoint, tmp_path, dst_mesh, plan, drop):
    src = titan_moe_checkpoint(SOURCE)
    dump = tmp_path / "job"
    out = dump / "checkpoint" / "step-2"
    code, stdout, stderr = run_cli("from-universal", str(src / "ckpt"), str(out), "--mesh", dst_mesh,
                                   *(["--plan", plan] if plan else []), *(["--drop-dataloader-state"] if drop else []))
    assert code == 0, stdout + stderr
    assert "matched no rule" not in stderr and "warning: mesh dim" not in stderr
    if not plan:
        assert "ckptconv: plan moe (--plan auto): torchtitan" in stderr, stderr
    reports = titan_moe_support.run_job({"mesh": dst_mesh, "dump": str(dump), "steps": 3, "reference": str(src / "reference.pt"),
                                         "skip_compare": ["dataloader"] if drop else []}, tmp_path / "run")
    want_loss = json.loads((src / "train.json").read_text())["losses"]["3"]
    readers = _chunk_readers(reports)
    lines = []
    for rep in reports:
        r = rep["rank"]
        assert rep["loaded"] and rep["loaded_step"] == 2, rep
        assert rep["mismatch"] == [], rep["mismatch"][:5]
        assert rep["compared"] > 300
        own, shared, foreign = _classify(rep, readers)
        assert foreign == [], f"rank {r} read chunks only it loads from other ranks' files: {foreign[:5]}"
        got = rep["losses"]["3"]
        assert got == want_loss if dst_mesh == SOURCE else math.isclose(got, want_loss, rel_tol=2e-5), (got, want_loss)
        lines.append(f"rank {r}: own sharded {own} B, shared {shared} B, whole {sum(rep['reads']['whole'].values())} B; "
                     f"loss3 {got!r} (source {want_loss!r})")
    Path(tmp_path / "summary.txt").write_text("\n".join(lines))
    print(f"\n{SOURCE} -> {dst_mesh} ({plan}):\n" + "\n".join(lines))


def test_source_layout_is_torchtitans_sparse_mesh(titan_moe_checkpoint):
    """The saved experts' chunks are the boxes ``--plan moe`` gives on the source mesh (torchtitan's
    own save as the oracle for the layout)."""
    from torch.distributed.checkpoint import FileSystemReader

    from converter.plan.mesh import parse_mesh
    from converter.plan.placement_rules import MOE_PLAN

    src = titan_moe_checkpoint(SOURCE)
    md = FileSystemReader(str(src / "ckpt")).read_metadata().state_dict_metadata
    mesh = parse_mesh(SOURCE)
    experts = [k for k in titan_moe_support.expert_keys(md) if len(getattr(md[k], "size", ())) == 3]
    assert len(experts) == 5 * 3 * 3  # 5 MoE layers x w1/w2/w3 x (param, exp_avg, exp_avg_sq)
    for key in experts:
        fqn = key.removeprefix("optimizer.state.").rsplit(".exp_avg", 1)[0]
        shape = tuple(md[key].size)
        want = {(b.offsets, b.sizes) for b, _ in MOE_PLAN.place(fqn, shape, mesh).unique_boxes(shape, mesh)}
        got = {(tuple(c.offsets), tuple(c.sizes)) for c in md[key].chunks}
        assert got == want, key


def test_trainer_save_exports_as_its_adapter(titan_moe_checkpoint, tmp_path):
    """export-hf of the real EP save equals torchtitan's own DeepSeekV3StateDictAdapter.to_hf of the
    full state (torch's dcp_to_torch_save) tensor for tensor; import-hf stacks the experts back
    equal to its from_hf."""
    import importlib

    import torch
    from safetensors.torch import load_file

    src = titan_moe_checkpoint(SOURCE)
    code, _, err = run_cli("export-hf", str(src / "ckpt"), str(tmp_path / "hf"), "--map", "torchtitan-deepseek-v3")
    assert code == 0, err
    ref = torch.load(src / "reference.pt", weights_only=False)
    model = {k: v for k, v in ref.items() if isinstance(v, torch.Tensor) and not k.startswith(
        ("optimizer", "lr_scheduler", "dataloader", "train_state"))}
    titan_moe_support.titan_support.apply_cpu_patches()
    adapter_cls = importlib.import_module("torchtitan.models.deepseek_v3.state_dict_adapter").DeepSeekV3StateDictAdapter
    adapter = adapter_cls(titan_moe_support.model_spec(titan_moe_support.DEFAULT_MODEL).model, None)
    want = adapter.to_hf(dict(model))
    got = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        got |= load_file(str(f))
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k].contiguous()) for k in want)
    assert len([k for k in got if ".mlp.experts." in k]) == 5 * 8 * 3
    assert any(float(v.abs().sum()) > 0 for k, v in got.items() if k.endswith("e_score_correction_bias"))  # trained
    code, _, err = run_cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "uni"), "--map", "torchtitan-deepseek-v3")
    assert code == 0, err
    code, _, err = run_cli("export-hf", str(tmp_path / "uni"), str(tmp_path / "native"))
    assert code == 0, err
    back = {}
    for f in sorted((tmp_path / "native").glob("*.safetensors")):
        back |= load_file(str(f))
    assert sorted(back) == sorted(model)
    assert all(torch.equal(back[k], model[k]) for k in model)


def test_inspect_reports_ep(titan_moe_checkpoint):
    """inspect on the real EP save: FSDP4 with ep2 (not TP), the experts' layout 'experts', and its
    --json valid against schemas/inspect.schema.json."""
    import jsonschema

    src = titan_moe_checkpoint(SOURCE)
    code, out, err = run_cli("inspect", str(src / "ckpt"), "--json")
    assert code == 0, err
    doc = json.loads(out)
    jsonschema.validate(doc, json.loads((Path(__file__).resolve().parents[2] / "schemas" / "inspect.schema.json").read_text()))
    assert doc["layout"]["mesh"] == {"dp": 4, "ep": 2}
    assert "grouped experts: 45 tensors split on dim 0, ep2" in doc["layout"]["summary"]
