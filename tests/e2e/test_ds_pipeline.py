"""DeepSpeed pipeline-engine saves (``PipelineModule`` under ZeRO-1) read directly, against
DeepSpeed 0.19.8's own code (CPU, gloo).

The saves (``ds_layout_support``): ``pipe-z1`` (2 stages, 1 rank each), ``pipemp-z1`` (the same
on Megatron-DeepSpeed's pipe x model x data topology: ``layer_XX-model_00-model_states.pt``) and
``pipe4-z1`` (2 stages x 2 data-parallel ranks: each stage's ZeRO-1 partitions over its own dp
group), ``pipe4bf-z1`` (the same in bf16: DeepSpeed's BF16_Optimizer, ``bf16_zero_pp_rank_*`` files). DeepSpeed's consolidations do not take these folders (``zero_to_fp32``'s
``get_fp32_state_dict_from_zero_checkpoint``: ``AttributeError: 'NoneType' object has no attribute
'items'`` on the stages' ``module`` None; ``ds_to_universal.py``: ``ZeroDivisionError``), so the
oracles are DeepSpeed's own gathering in the saving run (``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` of every stage's parameters, ``live-rank<r>.pt``) and
``torch.load`` of the layer files it wrote, and plain (non-pipeline) DeepSpeed engines loading the
``export-ds`` output. Each save takes ~15-25 s: slow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from ds_layout_support import TAG, saved_layout
from ds_support import requires_deepspeed
from oracle import bits_equal

pytestmark = [requires_deepspeed]

#: layout -> (stages, data-parallel ranks per stage, layer-file suffix).
PIPES = {"pipe-z1": (2, 1, ""), "pipemp-z1": (2, 1, "-model_00"), "pipe4-z1": (2, 2, ""), "pipe4bf-z1": (2, 2, "")}
CASES = [pytest.param(n, id=n, marks=[pytest.mark.slow]) for n in PIPES]


def _reader(path: Path):
    from formats.deepspeed_zero import DeepSpeedZeroReader

    return DeepSpeedZeroReader(path, verify=True)


def _lives(entry: Path) -> list[dict]:
    return [torch.load(p, weights_only=False) for p in sorted(entry.glob("live-rank*.pt"))]


@pytest.mark.parametrize("name", CASES)
def test_every_weight_and_state_equals_deepspeeds_own(name: str) -> None:
    """Every fp32 master, exp_avg, exp_avg_sq and step equals what DeepSpeed's own accessors give
    on every rank of every stage, bit for bit; each weight equals the layer file DeepSpeed wrote
    (bf16: the fp32 master cast to bf16 equals it);
    one param group holding every stage's parameters, with the saved hyperparameters."""
    from ds_zero_support import read_all

    stages, dp, suffix = PIPES[name]
    entry = saved_layout(name)
    reader = _reader(entry)
    got = read_all(reader)
    lives = _lives(entry)
    assert len(lives) == stages * dp
    want_keys = {k for live in lives for k in live if k.startswith(("model.", "optim.state."))}
    assert {k for k in got if not k.endswith(".step")} == want_keys
    for live in lives:
        for key, want in live.items():
            if key.startswith(("model.", "optim.state.")):
                assert bits_equal(got[key], want), key
        steps = [k for k in got if k.endswith(".step")]
        assert steps and all(bits_equal(got[k], live["step"]) for k in steps)
    for layer in (0, 2):  # the Linear layers (1 is a ReLU: its file holds nothing)
        saved = torch.load(entry / TAG / f"layer_{layer:02d}{suffix}-model_states.pt", weights_only=True)
        for param, want in saved.items():
            assert bits_equal(got[f"model.{layer}.{param}"].to(want.dtype), want), (layer, param)  # bf16: the master cast
    assert reader.load_object("optim.param_groups.0.params") == ["0.weight", "0.bias", "2.weight", "2.bias"]
    hparams = lives[0]["param_groups"][0]
    assert reader.load_object("optim.param_groups.0.lr") == hparams["lr"]
    assert reader.load_object("optim.param_groups.0.betas") in (hparams["betas"], list(hparams["betas"]))
    assert reader.index().info["world_size"] == dp and reader.index().info["zero_stage"] == 1


@pytest.mark.parametrize("name", CASES)
def test_to_universal_output_equals_the_folder(name: str, tmp_path: Path) -> None:
    """``to-universal`` of the folder as saved, then ``diff``: identical (exit 0), every tensor
    and object; ``inspect --json`` names the format and the data-parallel world of a stage."""
    entry = saved_layout(name)
    code, _, err = run_cli("to-universal", str(entry), str(tmp_path / "uni"))
    assert code == 0, err
    code, out, err = run_cli("diff", "--json", str(entry), str(tmp_path / "uni"))
    doc = json.loads(out)
    assert code == 0 and doc["same"] and doc["counts"] == {"equal": 16}, err
    code, out, err = run_cli("inspect", "--json", str(entry))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["format"] == "deepspeed-zero" and doc["world_size"] == PIPES[name][1]


@pytest.mark.parametrize("name", CASES)
def test_a_missing_stage_or_rank_file_is_one_line(name: str, tmp_path: Path) -> None:
    """A copy without stage 1's model states, or without one optimizer partition of stage 1:
    one line naming what is missing."""
    entry = saved_layout(name)
    optim = next((entry / TAG).glob("*zero_pp_rank_0_mp_rank_01_optim_states.pt")).name
    for missing in ("mp_rank_01_model_states.pt", optim):
        src = tmp_path / missing
        shutil.copytree(entry / TAG, src)
        (src / missing).chmod(0o644)
        (src / missing).unlink()
        code, _, err = run_cli("inspect", str(src))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert ("stage 1" if "model_states" in missing else "mp_rank_01_optim_states") in lines[0], lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("stage,world", [(2, 2), (3, 3), (1, 1)], ids=["z2-w2", "z3-w3", "z1-w1"])
def test_exported_loads_in_a_plain_deepspeed_engine(stage: int, world: int, tmp_path: Path) -> None:
    """``export-ds`` of the 2-stage x dp2 pipeline save; the same model as a plain
    ``nn.Sequential`` under a DeepSpeed ZeRO-``stage`` engine of ``world`` ranks (no pipeline)
    loads it with ``load_universal``: every fp32 master, Adam state and step equals the pipeline
    run's own (DeepSpeed's accessors on both sides), bit for bit, and it trains on."""
    from ds_layout_support import TIMEOUT
    from ds_layout_worker import load_flat
    from worlds import run_world

    entry = saved_layout("pipe4-z1")
    code, _, err = run_cli("export-ds", str(entry), str(tmp_path / "ds"))
    assert code == 0, err
    expected: dict = {}
    for live in _lives(entry):
        expected.update(live)
    torch.save(expected, tmp_path / "expected.pt")
    (tmp_path / "rep").mkdir()
    run_world(load_flat, world, (str(tmp_path / "ds"), stage, str(tmp_path / "expected.pt"), str(tmp_path / "rep")),
              timeout=TIMEOUT)
    for r in range(world):
        rep = json.loads((tmp_path / "rep" / f"rank{r}.json").read_text())
        assert not rep["errors"] and rep["checked"] == 12, rep
