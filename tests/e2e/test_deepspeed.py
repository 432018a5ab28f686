"""The DeepSpeed bridge against the real DeepSpeed 0.19.8 engine (CPU, gloo); skips without it.

FSDP2 / FSDP2+TP checkpoints -> store -> export-ds, loaded by DeepSpeed engines
(``load_universal_checkpoint``) under ZeRO-1/2/3 at several world sizes; DeepSpeed ZeRO runs ->
``ds_to_universal.py`` -> import-ds -> from-universal, loaded by FSDP2 (``dcp.load``). Every load
is compared bit for bit with torch's reading of the source or with DeepSpeed's live state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_support import (DATA, TINY, assert_matches_live, export_ds, fsdp2_load_and_check, import_ds,
                        load_and_check, requires_deepspeed, to_universal, train_and_save, universal_of)
from ds_worker import expected_from_store_reference
from oracle import torch_reference


@requires_deepspeed
def test_export_ds_loads_in_deepspeed_zero3(tmp_path: Path) -> None:
    """DeepSpeed ZeRO-2 universal -> store -> export-ds -> a ZeRO-3 engine (1 rank) loads it
    bit-exact (params, Adam states, step, hyperparameters), then trains on."""
    import_ds(universal_of(2), tmp_path / "uni")
    export_ds(tmp_path / "uni", tmp_path / "ds")
    load_and_check(tmp_path / "ds", DATA / "zero2" / "live.pt", stage=3, world=1, report_dir=tmp_path / "rep")


def _fsdp2_expected(dcp: Path, out: Path) -> Path:
    ref = torch_reference(dcp)
    groups = [{k.split(".", 3)[3]: v for k, v in ref.items()
               if k.startswith("optim.param_groups.0.") and not k.endswith(".params")}]
    torch.save(expected_from_store_reference(ref, groups), out)
    return out


@pytest.mark.slow
@requires_deepspeed
@pytest.mark.parametrize("kind", ["fsdp4", "tp2dp2", "bf16_fsdp2"])
def test_fsdp2_dcp_to_deepspeed_zero_stages_and_worlds(kind: str, dcp_checkpoint, tmp_path: Path) -> None:
    """FSDP2 (FSDP2+TP, bf16 FSDP2) DCP -> to-universal -> export-ds, loaded by DeepSpeed engines
    under ZeRO-1/2/3 at world sizes 1-3 (bf16: DeepSpeed's bf16 mode, fp32 master weights and
    states), every one bit-exact against torch's reading of the DCP."""
    from ckpt_factory import fixture_info, spec_from_info
    from converter.commands.to_universal import to_universal as to_uni

    dcp = dcp_checkpoint(kind)
    args = spec_from_info(fixture_info(dcp)).model_args
    to_uni(dcp, tmp_path / "uni")
    export_ds(tmp_path / "uni", tmp_path / "ds")
    expected = _fsdp2_expected(dcp, tmp_path / "expected.pt")
    cases = {"fsdp4": [(1, 2), (2, 1), (2, 3), (3, 2), (3, 3)], "tp2dp2": [(2, 2), (3, 2)],
             "bf16_fsdp2": [(2, 1), (3, 2)]}[kind]
    losses = set()
    for stage, world in cases:
        reps = load_and_check(tmp_path / "ds", expected, stage, world, tmp_path / f"rep{stage}x{world}", args=args)
        losses.add(reps[0]["loss"])
    assert len(losses) == 1  # the same state gives the same next loss under every stage and world


@pytest.mark.slow
@requires_deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_to_fsdp2(stage: int, tmp_path: Path) -> None:
    """A real ZeRO-``stage`` run of 2 ranks -> ds_to_universal -> import-ds -> from-universal (dp2
    and dp3) -> FSDP2 loads it with dcp.load, bit-exact against DeepSpeed's live state."""
    from converter.commands.from_universal import from_universal

    tag = train_and_save(tmp_path / "run", stage, world=2)
    uni = to_universal(tag, tmp_path / "run" / "universal", stage)
    import_ds(uni, tmp_path / "uni")
    live = tmp_path / "run" / "live.pt"
    for world in (2, 3):
        from_universal(tmp_path / "uni", tmp_path / f"dcp{world}", mesh=f"dp{world}")
        assert_matches_live(torch_reference(tmp_path / f"dcp{world}"), torch.load(live, weights_only=False))
        fsdp2_load_and_check(tmp_path / f"dcp{world}", live, world, tmp_path / f"rep{world}", args=TINY)


@pytest.mark.slow
@requires_deepspeed
def test_two_param_groups_zero3_both_ways(tmp_path: Path) -> None:
    """The usual two param groups (weight decay on matrices only): a ZeRO-3 run -> import-ds ->
    FSDP2 (same two groups) and -> export-ds -> a ZeRO-3 engine, both bit-exact against
    DeepSpeed's live state, each group keeping its hyperparameters and members.

    (Under ZeRO-2 with two groups DeepSpeed 0.19.8's own accessors and its ds_to_universal.py
    disagree on the second group's fragments, so ZeRO-3 is the oracle here.)"""
    from converter.commands.from_universal import from_universal

    tag = train_and_save(tmp_path / "run", 3, world=2, groups=2)
    uni = to_universal(tag, tmp_path / "run" / "universal", 3)
    import_ds(uni, tmp_path / "uni")
    live = tmp_path / "run" / "live.pt"
    assert [g["weight_decay"] for g in torch.load(live, weights_only=False)["param_groups"]] == [0.1, 0.0]
    from_universal(tmp_path / "uni", tmp_path / "dcp", mesh="dp2")
    ref = torch_reference(tmp_path / "dcp")
    assert ref["optim.param_groups.1.weight_decay"] == 0.0
    assert sorted(ref["optim.param_groups.1.params"]) == ["layers.0.attention_norm.weight",
                                                           "layers.0.ffn_norm.weight", "norm.weight"]
    fsdp2_load_and_check(tmp_path / "dcp", live, 2, tmp_path / "rep", groups=2)
    export_ds(tmp_path / "uni", tmp_path / "ds")
    opt = torch.load(tmp_path / "ds" / "global_step3" / "zero" / "optimizer_state.pt", weights_only=True)
    assert [g["weight_decay"] for g in opt["optimizer_state_dict"]["param_groups"]] == [0.1, 0.0]
    # DeepSpeed's ZeRO-3 universal loader gives every group the hyperparameters of group 0
    # (stage3.py: load_hp_checkpoint_state_from_checkpoint_dir_stage3); weights and states are exact
    expected = torch.load(live, weights_only=False)
    expected["param_groups"] = [expected["param_groups"][0]] * 2
    torch.save(expected, tmp_path / "expected_zero3.pt")
    load_and_check(tmp_path / "ds", tmp_path / "expected_zero3.pt", 3, 2, tmp_path / "rep2", groups=2)
