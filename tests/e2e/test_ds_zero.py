"""DeepSpeed checkpoint folders as ``engine.save_checkpoint`` writes them, read directly (no
``ds_to_universal`` step), against DeepSpeed 0.19.8's own code (CPU, gloo); skips without it.

Each case (``ds_zero_support``) is a real ZeRO-0/1/2/3 run saved by DeepSpeed's engine. The oracles
are DeepSpeed's: ``get_fp32_state_dict_from_zero_checkpoint`` for every fp32 weight, what
``ds_to_universal.py`` writes for every optimizer state, the engine's own live state
(``safe_get_full_*``), ``torch.load`` of the files (ZeRO-0, buffers, frozen weights), and DeepSpeed
/ FSDP2 engines loading the converted checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_support import requires_deepspeed
from ds_zero_support import TAG, Case, live, next_loss, read_all, save_dir, saved, universal_atoms
from oracle import bits_equal

pytestmark = [requires_deepspeed]

#: The matrix: ZeRO-0/1/2/3 x {fp32, bf16} x world {1, 2, 3}, plus two param groups, the rich
#: model (buffers of every dtype, tied and frozen parameters) and DeepSpeed's BF16_Optimizer.
MATRIX = [f"z{s}-{d}-w{w}" for s in range(4) for d in ("fp32", "bf16") for w in (1, 2, 3)]
EXTRA = ["z2-fp32-w2-g2", "z3-bf16-w3-g2", "z1-bf16-w2-rich", "z2-bf16-w3-rich", "z3-fp32-w2-rich",
         "z0-fp32-w1-rich", "z1-bf16-w2-bf16opt", "z2-fp16-w2", "z3-fp16-w3", "z0-fp16-w1"]
#: transformers.Trainer runs with a DeepSpeed config (its own AdamW, two groups, tied embeddings).
TRAINER = ["hf-z2-bf16-w2", "hf-z3-bf16-w2", "hf-z1-bf16-w1"]
#: The cases of the default suite (every other one is slow).
DEFAULT = {"z2-bf16-w3", "z0-bf16-w1"}  # the rest (HF Trainer, ZeRO-3: ~90 s) run in CI's framework step


def _marks(name: str, default: set[str]) -> list:
    marks = [] if name in default else [pytest.mark.slow]
    return marks + ([pytest.mark.framework("deepspeed", "transformers")] if name.startswith("hf-") else [])


def _cases(names: list[str]) -> list:
    return [pytest.param(n, id=n, marks=_marks(n, DEFAULT)) for n in names]


def _saved(name: str) -> tuple[Path, Case]:
    case = Case.parse(name)
    if case.model == "hf":
        pytest.importorskip("accelerate", reason="transformers.Trainer with DeepSpeed needs accelerate "
                                          "(run bash .ci/install_deepspeed.sh)")
    return saved(name), case


def _reader(entry: Path, case: Case):
    from formats.deepspeed_zero import DeepSpeedZeroReader

    return DeepSpeedZeroReader(save_dir(entry, case), verify=True)


def _module_state(entry: Path, case: Case) -> dict:
    """``torch.load`` of the rank-0 model-states file (DeepSpeed's own serialization)."""
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if case.stage == 3 else "mp_rank_00_model_states.pt"
    return torch.load(save_dir(entry, case) / TAG / name, weights_only=False)


@pytest.mark.parametrize("name", _cases(MATRIX + EXTRA + TRAINER))
def test_every_weight_equals_deepspeeds_consolidation(name: str) -> None:
    """Every ``model.<fqn>`` equals DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``
    bit for bit (buffers: in their saved dtype, which DeepSpeed's consolidation casts to fp32);
    weights DeepSpeed leaves out of it (ZeRO-1's frozen ones) and ZeRO-0's equal the saved module;
    every fp32 master and optimizer state equals the engine's live state. (The consolidation
    refuses the BF16 optimizer's files, "not a zero checkpoint": there the live state is the oracle.)"""
    entry, case = _saved(name)
    got = read_all(_reader(entry, case))
    module = _module_state(entry, case)["module"]
    buffers = set(_module_state(entry, case)["buffer_names"])
    if case.bf16_optimizer:
        assert "is not a zero checkpoint" in (entry / "fp32.err").read_text()
    if case.stage and not case.bf16_optimizer:
        oracle = torch.load(entry / "fp32.pt", weights_only=False)
        for fqn, want in oracle.items():
            have = got[f"model.{fqn}"]
            assert bits_equal(have.float() if fqn in buffers and have.is_floating_point() else have, want), fqn
        rest = {k[len("model."):] for k in got if k.startswith("model.")} - set(oracle)
    else:
        rest = {k[len("model."):] for k in got if k.startswith("model.")}
    for fqn in rest:  # not in DeepSpeed's consolidation: as saved in the module (or the live masters)
        want = live(entry).get(f"model.{fqn}", module.get(fqn))
        assert bits_equal(got[f"model.{fqn}"], want), fqn
    for key, want in live(entry).items():
        if key.startswith(("model.", "optim.state.")):
            assert bits_equal(got[key], want), key
    steps = [k for k in got if k.endswith(".step")]
    assert steps and all(bits_equal(got[k], live(entry)["step"]) for k in steps)
    assert set(module) - buffers <= {k[len("model."):] for k in got}  # every parameter, tied ones too


@pytest.mark.parametrize("name", _cases([n for n in MATRIX + EXTRA + TRAINER if "z0" not in n]))
def test_optimizer_states_equal_ds_to_universal(name: str) -> None:
    """Every trained fp32 weight, exp_avg, exp_avg_sq and step equals what DeepSpeed's own
    ``ds_to_universal.py`` writes. It runs on every case here (ZeRO-1/2 with
    ``--inject_missing_state``, the Trainer's saves and the BF16 optimizer's included; ZeRO-0, which
    it does not support, is not a case of this test): its failure fails the test, never skips it."""
    entry, case = _saved(name)
    err = entry / "universal.err"
    assert (entry / "universal").is_dir(), f"ds_to_universal.py failed: {err.read_text()[-600:] if err.is_file() else '?'}"
    got = read_all(_reader(entry, case))
    shapes = {k[len("model."):]: v.shape for k, v in got.items() if k.startswith("model.")}
    atoms = universal_atoms(entry / "universal", shapes)
    trained = {k for k in live(entry) if k.startswith("model.")}  # its buffer/frozen atoms are cast to fp32
    atoms = {k: v for k, v in atoms.items() if k in trained or k.startswith("optim.state.")}
    assert atoms
    for key, want in atoms.items():
        have = got[key]
        if key.endswith(".step"):  # ZeRO-1/2 atoms keep the step as saved (a 0-d tensor)
            want = torch.as_tensor(want)
        assert bits_equal(have, want), key


#: The cases whose conversions run in the default suite.
CONVERT_DEFAULT = {"z2-bf16-w3"}


def _convert_cases(names: list[str]) -> list:
    return [pytest.param(n, id=n, marks=_marks(n, CONVERT_DEFAULT)) for n in names]


def _target(case: Case) -> tuple[int, int]:
    """Another ZeRO stage and world size to load a case in (two groups: ZeRO-3, whose accessors
    see every group's states; DeepSpeed 0.19.8's ZeRO-1/2 fragment maps miss the second's)."""
    return (3 if case.groups > 1 else [2, 2, 3, 1][case.stage]), {1: 2, 2: 3, 3: 2}[case.world]


def _expected(entry: Path, case: Case, path: Path, frozen_as: torch.dtype | None = None) -> Path:
    """DeepSpeed's live state (``frozen_as``: plus the weight it does not train, from its own
    consolidation or the saved module, in that dtype), as a file the load workers compare against."""
    state = live(entry)
    frozen = "layers.0.ffn_norm.weight"
    state.pop(f"model.{frozen}", None)  # ZeRO-0's live state holds it (the optimizer lists it)
    if case.model == "rich" and frozen_as is not None:
        fp32 = torch.load(entry / "fp32.pt", weights_only=False) if (entry / "fp32.pt").is_file() else {}
        want = fp32.get(frozen, _module_state(entry, case)["module"].get(frozen))
        state[f"model.{frozen}"] = want.to(frozen_as)
    torch.save(state, path)
    return path


@pytest.mark.parametrize("name", _convert_cases(MATRIX + EXTRA + TRAINER))
def test_converted_to_dcp_loads_in_fsdp2_bit_exact(name: str, tmp_path: Path) -> None:
    """from-universal straight from the ZeRO folder to an FSDP2 checkpoint of another world size;
    FSDP2 ``dcp.load`` s it: every weight, Adam state and step equals DeepSpeed's live state."""
    from converter.commands.from_universal import from_universal
    from ds_zero_support import TIMEOUT
    from ckpt_factory import run_world
    from ds_zero_worker import fsdp2_load_and_check

    entry, case = _saved(name)
    _, world = _target(case)
    from_universal(save_dir(entry, case), tmp_path / "dcp", mesh=f"dp{world}")
    expected = _expected(entry, case, tmp_path / "expected.pt", torch.float32)
    (tmp_path / "rep").mkdir()
    run_world(fsdp2_load_and_check, world, (case.to_json(), str(tmp_path / "dcp"), str(expected),
                                            str(tmp_path / "rep")), timeout=TIMEOUT)
    for r in range(world):
        rep = json.loads((tmp_path / "rep" / f"rank{r}.json").read_text())
        assert not rep["errors"] and rep["checked"] > 0, rep["errors"]


@pytest.mark.parametrize("name", _convert_cases(MATRIX + EXTRA + TRAINER))
def test_exported_loads_in_deepspeed_at_another_stage_and_world(name: str, tmp_path: Path) -> None:
    """export-ds straight from the ZeRO folder; a DeepSpeed engine at another ZeRO stage and world
    size loads it (``load_universal``): every weight, Adam state and step bit-exact, and the loss
    of the next batch equals the source run's."""
    from converter.commands.export_ds import export_ds
    from ds_zero_support import TIMEOUT
    from ckpt_factory import run_world
    from ds_zero_worker import load_and_check

    entry, case = _saved(name)
    stage, world = _target(case)
    export_ds(save_dir(entry, case), tmp_path / "ds")
    expected = _expected(entry, case, tmp_path / "expected.pt")
    (tmp_path / "rep").mkdir()
    run_world(load_and_check, world, (case.at(stage, world).to_json(), str(tmp_path / "ds"), str(expected),
                                      str(tmp_path / "rep")), timeout=TIMEOUT)
    for r in range(world):
        rep = json.loads((tmp_path / "rep" / f"rank{r}.json").read_text())
        assert not rep["errors"] and rep["checked"] > 0, rep["errors"]
        assert rep["next_loss"] == next_loss(entry)


@pytest.mark.parametrize("name", _cases(["z2-fp16-w2", "z0-fp16-w1"]))
def test_fp16_loss_scaler_state_is_kept(name: str) -> None:
    """fp16 runs: the dynamic loss scaler's state (DeepSpeed's ``DynamicLossScaler``, read as
    inert data; ZeRO-0's wrapper keeps it beside its state) is the object ``deepspeed.loss_scaler``."""
    entry, case = _saved(name)
    reader = _reader(entry, case)
    scaler = reader.load_object("deepspeed.loss_scaler")
    if case.stage:
        optim = torch.load(save_dir(entry, case) / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
        want = vars(optim["optimizer_state_dict"]["loss_scaler"])
        assert scaler == {k: (f"torch.{str(v).split('.')[-1]}" if isinstance(v, torch.dtype) else v) for k, v in want.items()}
    else:
        opt = _module_state(entry, case)["optimizer"]
        assert scaler == {k: opt[k] for k in ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter",
                                              "scale_factor", "scale_window")}
    assert scaler["cur_scale"] > 1  # a real dynamic scale, not the fp32 default
