"""DeepSpeed mixture-of-experts saves (``deepspeed.moe.layer.MoE``) read directly, against
DeepSpeed 0.19.8's own code (CPU, gloo).

The saves (``ds_moe_support``, one cached save per layout shared by every test here): two MoE
layers of different ``ep_size`` (``z2-bf16-w2``: ep 2 with 2 experts per rank and ep 1 with
both experts on both ranks, ZeRO-2 in bf16; ``z1-fp32-w4``: ep 2 x expert-data-parallel 2 and
ep 4, ZeRO-1; ``z0-fp32-w2`` / ``z0-bf16-w2``: no ZeRO, ``expp_rank_*`` optimizer files, bf16:
DeepSpeed's unfused bf16 optimizer with its fp32 masters; ``z2-fp32-w4-de`` / ``z0-fp32-w4-de``:
the world-4 shape in DeepSpeed's data-then-expert rank order, ``use_data_before_expert_parallelism``,
whose expert-data-parallel groups are consecutive ranks). DeepSpeed's own
``ds_to_universal.py`` fails on MoE folders (DeepSpeed #5716) and ``zero_to_fp32`` knows no expert
files, so the oracles are DeepSpeed's own gathering on every rank of the saving run
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, the local experts under the
global ids DeepSpeed's ``_save_moe_checkpoint`` gives them: ``live-rank<r>.pt``), ``torch.load``
of the expert and model files it wrote, and a multi-process ``dcp.load`` of the from-universal
output. Each save takes 20-60 s: slow (CI's framework step runs them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from ds_moe_support import LAYOUTS, TAG, expected, lives, saved_moe
from ds_support import requires_deepspeed
from oracle import bits_equal

pytestmark = [requires_deepspeed, pytest.mark.slow]
#: The layouts every test reads; the data-then-expert ones (``-de``) only the first test.
CASES = [n for n in LAYOUTS if not n.endswith("-de")]


def _reader(path: Path):
    from formats.deepspeed_zero import DeepSpeedZeroReader

    return DeepSpeedZeroReader(path, verify=True)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_master_and_adam_state_equals_deepspeeds_own_on_every_rank(name: str) -> None:
    """Every fp32 master, exp_avg, exp_avg_sq and step equals what DeepSpeed's accessors give on
    every rank (each rank's local experts by global id), bit for bit, and nothing else is read as
    a weight or state; every tensor of every expert file and of the module DeepSpeed wrote equals
    the weight read (bf16: the fp32 master cast to bf16); the expert param groups list every
    global expert, with the saved hyperparameters."""
    from ds_zero_support import read_all

    stage, dtype, world, (ep_a, experts_a, ep_b, experts_b) = LAYOUTS[name]
    entry = saved_moe(name)
    reader = _reader(entry)
    got = read_all(reader)
    ranks = lives(entry)
    assert len(ranks) == world
    want = {k for live in ranks for k in live if k.startswith(("model.", "optim.state."))}
    assert {k for k in got if not k.endswith(".step")} == want
    for live in ranks:
        for key, value in live.items():
            if key.startswith(("model.", "optim.state.")):
                assert bits_equal(got[key], value), key
    steps = [k for k in got if k.endswith(".step")]
    assert steps and all(bits_equal(got[k], ranks[0]["step"]) for k in steps)
    files = sorted((entry / TAG).glob("layer_*_expert_*_mp_rank_00_model_states.pt"))
    assert len(files) == experts_a + experts_b
    seen = set()
    for path in [*files, entry / TAG / "mp_rank_00_model_states.pt"]:
        saved = torch.load(path, weights_only=False)
        for key, value in saved.get("module", saved).items():
            assert bits_equal(got[f"model.{key}"].to(value.dtype), value), (path.name, key)
            seen.add(key)
    assert {k[len("model."):] for k in got if k.startswith("model.")} == seen
    names = [reader.load_object(f"optim.param_groups.{g}.name") for g in range(3)]
    assert names[0] == "params" and set(names[1:]) == {f"ep_size_{ep_a}", f"ep_size_{ep_b}"}  # (a set's order)
    for g, (ep, layer, count) in ((names.index(f"ep_size_{ep_a}"), (ep_a, "moe1", experts_a)),
                                  (names.index(f"ep_size_{ep_b}"), (ep_b, "moe2", experts_b))):
        assert reader.load_object(f"optim.param_groups.{g}.moe") is True
        params = reader.load_object(f"optim.param_groups.{g}.params")
        assert {p.split(".deepspeed_experts.")[1].split(".")[0] for p in params} == {str(e) for e in range(count)}
        assert all(p.startswith(f"{layer}.") for p in params)
    assert reader.load_object("optim.param_groups.0.lr") == ranks[0]["param_groups"][0]["lr"]
    assert reader.index().info["zero_stage"] == stage and reader.index().info["world_size"] == world


@pytest.mark.parametrize("name", CASES)
def test_every_command_reads_it(name: str, tmp_path: Path) -> None:
    """inspect, verify, to-universal (then diff: identical), export-hf (every weight, global
    expert names) run on the folder as saved; export-ds refuses in one line naming the layout."""
    from safetensors.torch import load_file

    entry = saved_moe(name)
    code, out, err = run_cli("inspect", "--json", str(entry))
    assert code == 0, err
    assert json.loads(out)["format"] == "deepspeed-zero"
    code, _, err = run_cli("verify", str(entry))
    assert code == 0, err
    code, _, err = run_cli("to-universal", str(entry), str(tmp_path / "uni"))
    assert code == 0, err
    code, out, err = run_cli("diff", "--json", str(entry), str(tmp_path / "uni"))
    doc = json.loads(out)
    assert code == 0 and doc["same"], err
    code, _, err = run_cli("export-hf", str(entry), str(tmp_path / "hf"))
    assert code == 0, err
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(f))
    want = expected(entry)
    assert set(hf) == {k[len("model."):] for k in want if k.startswith("model.")}
    for key, value in hf.items():
        assert bits_equal(value, want[f"model.{key}"].to(value.dtype)), key
    code, out, err = run_cli("export-ds", str(entry), str(tmp_path / "ds"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "a mixture-of-experts checkpoint" in lines[0], err
    assert "local names" in lines[0] and not (tmp_path / "ds").exists()


@pytest.mark.parametrize("name,world", [("z2-bf16-w2", 2), ("z1-fp32-w4", 2)])
def test_from_universal_to_dcp_loads_bit_exact_in_a_real_world(name: str, world: int, tmp_path: Path) -> None:
    """from-universal straight from the MoE folder to a DCP checkpoint (``dp<world>``); a
    ``world``-process gloo job ``dcp.load`` s every weight, Adam state and step into DTensors:
    all equal the DeepSpeed run's live state, bit for bit."""
    from ds_moe_support import TIMEOUT
    from ds_moe_worker import dcp_load_and_check
    from worlds import run_world

    entry = saved_moe(name)
    code, _, err = run_cli("from-universal", str(entry), str(tmp_path / "dcp"), "--mesh", f"dp{world}")
    assert code == 0, err
    want = expected(entry)
    torch.save(want, tmp_path / "expected.pt")
    (tmp_path / "rep").mkdir()
    run_world(dcp_load_and_check, world, (str(tmp_path / "dcp"), str(tmp_path / "expected.pt"), str(tmp_path / "rep")),
              timeout=TIMEOUT)
    n = sum(1 for k in want if k.startswith(("model.", "optim.state."))) + sum(1 for k in want if k.endswith(".exp_avg"))
    for r in range(world):
        rep = json.loads((tmp_path / "rep" / f"rank{r}.json").read_text())
        assert not rep["errors"] and rep["checked"] == n, rep


@pytest.mark.parametrize("name", CASES)
def test_a_missing_file_is_one_line_naming_it(name: str, tmp_path: Path) -> None:
    """A copy without one expert file, one optimizer file or the model states: one line (exit 2)
    naming what is missing, no traceback."""
    entry = saved_moe(name)
    optim = "expp_rank_1_mp_rank_00_optim_states.pt" if name.startswith("z0") else next(
        p.name for p in (entry / TAG).glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    cases = {"layer_0_expert_3_mp_rank_00_model_states.pt": "layer_0_expert_3_mp_rank_00_model_states.pt",
             "layer_1_expert_1_mp_rank_00_model_states.pt": "layer_1_expert_1_mp_rank_00_model_states.pt",
             optim: "rank 1", "mp_rank_00_model_states.pt": "mp_rank_00_model_states.pt"}
    for missing, said in cases.items():
        src = tmp_path / missing
        shutil.copytree(entry / TAG, src)
        (src / missing).chmod(0o644)
        (src / missing).unlink()
        code, _, err = run_cli("inspect", str(src))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert said in lines[0], lines[0]


def test_a_zero3_looking_moe_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    """DeepSpeed's native MoE does not train under ZeRO-3: a MoE folder with ZeRO-3 model-states
    files (here a ZeRO-2 save with one added, as ``_get_zero_ckpt_name`` names them) is refused in
    one line naming an expert file and the layout, for every command; nothing written."""
    entry = saved_moe("z2-bf16-w2")
    src = tmp_path / "src"
    shutil.copytree(entry / TAG, src)
    for p in [src, *src.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    shutil.copy(src / "mp_rank_00_model_states.pt", src / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    for argv in (["inspect", str(src)], ["to-universal", str(src), str(tmp_path / "out")],
                 ["from-universal", str(src), str(tmp_path / "out"), "--mesh", "dp2"]):
        code, out, err = run_cli(*argv)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and not out.strip(), err
        assert lines[0].startswith(f"ckptconv: error: {src / 'layer_0_expert_0_mp_rank_00_model_states.pt'}: "), lines[0]
        assert "mixture-of-experts save with ZeRO-3 files" in lines[0] and "not supported" in lines[0], lines[0]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
