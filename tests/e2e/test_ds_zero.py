"""DeepSpeed checkpoint folders as ``engine.save_checkpoint`` writes them, read directly (no
``ds_to_universal`` step), against DeepSpeed 0.19.8's own code (CPU, gloo); skips without it.

Each case (``ds_zero_support``) is a real ZeRO-0/1/2/3 run saved by DeepSpeed's engine. The oracles
are DeepSpeed's: ``get_fp32_state_dict_from_zero_checkpoint`` for every fp32 weight, what
``ds_to_universal.py`` writes for every optimizer state, the engine's own live state
(``safe_get_full_*``), ``torch.load`` of the files (ZeRO-0, buffers, frozen weights), and DeepSpeed
/ FSDP2 engines loading the converted checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_support import requires_deepspeed
from ds_zero_support import TAG, Case, live, next_loss, read_all, saved, universal_atoms
from oracle import bits_equal

pytestmark = [requires_deepspeed, pytest.mark.framework]

#: The matrix: ZeRO-0/1/2/3 x {fp32, bf16} x world {1, 2, 3}, plus two param groups, the rich
#: model (buffers of every dtype, tied and frozen parameters) and DeepSpeed's BF16_Optimizer.
MATRIX = [f"z{s}-{d}-w{w}" for s in range(4) for d in ("fp32", "bf16") for w in (1, 2, 3)]
EXTRA = ["z2-fp32-w2-g2", "z3-bf16-w3-g2", "z1-bf16-w2-rich", "z2-bf16-w3-rich", "z3-fp32-w2-rich",
         "z0-fp32-w1-rich", "z1-bf16-w2-bf16opt"]
#: The cases of the default suite (every other one is slow).
DEFAULT = {"z2-bf16-w3", "z3-fp32-w2", "z0-bf16-w1", "z3-bf16-w2-rich"}


def _cases(names: list[str]) -> list:
    return [pytest.param(n, id=n, marks=() if n in DEFAULT else pytest.mark.slow) for n in names]


def _reader(entry: Path):
    from formats.deepspeed_zero import DeepSpeedZeroReader

    return DeepSpeedZeroReader(entry / "run", verify=True)


def _module_state(entry: Path, case: Case) -> dict:
    """``torch.load`` of the rank-0 model-states file (DeepSpeed's own serialization)."""
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if case.stage == 3 else "mp_rank_00_model_states.pt"
    return torch.load(entry / "run" / TAG / name, weights_only=False)


@pytest.mark.parametrize("name", _cases(MATRIX + EXTRA))
def test_every_weight_equals_deepspeeds_consolidation(name: str) -> None:
    """Every ``model.<fqn>`` equals DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``
    bit for bit (buffers: in their saved dtype, which DeepSpeed's consolidation casts to fp32);
    weights DeepSpeed leaves out of it (ZeRO-1's frozen ones) and ZeRO-0's equal the saved module;
    every fp32 master and optimizer state equals the engine's live state."""
    entry, case = saved(name), Case.parse(name)
    got = read_all(_reader(entry))
    module = _module_state(entry, case)["module"]
    buffers = set(_module_state(entry, case)["buffer_names"])
    if case.stage:
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


@pytest.mark.parametrize("name", _cases([n for n in MATRIX + EXTRA if not n.startswith("z0")]))
def test_optimizer_states_equal_ds_to_universal(name: str) -> None:
    """Every trained fp32 weight, exp_avg, exp_avg_sq and step equals what DeepSpeed's own
    ``ds_to_universal.py`` writes (where it runs; its failure is recorded, not ours)."""
    entry = saved(name)
    if not (entry / "universal").is_dir():
        pytest.skip(f"ds_to_universal.py fails on this checkpoint: {(entry / 'universal.err').read_text()[-300:]}")
    got = read_all(_reader(entry))
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
