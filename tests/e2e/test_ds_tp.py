"""Tensor-parallel DeepSpeed saves (``mp_rank_00`` / ``mp_rank_01``, TP 2 through an ``mpu``) read
directly, joined as their ``universal_checkpoint_info`` says (:mod:`formats.deepspeed_zero.tp`).

The saves are DeepSpeed 0.19.8's own (``ds_tp_support``: a Megatron-like model of vocabulary-,
column-, row-parallel, replicated and 2-sub-parameter tensors; TP2 ZeRO-1 fp32, TP2 ZeRO-3 bf16 and
TP2 x DP2 ZeRO-1 bf16 on 4 ranks (ZeRO-2 bf16 passed the same checks once, left out for CI time);
with Megatron-DeepSpeed's ``universal_checkpoint_info``). Oracles: DeepSpeed's own ``ds_to_universal.py``
on the same folder (every fp32 master, exp_avg, exp_avg_sq and step bit for bit) and each TP
rank's live state by DeepSpeed's ``safe_get_full_*`` joined by the test's own knowledge of the cut;
then ``from-universal`` to FSDP2 ``dp2`` and a real 2-process ``dcp.load``. The plain-``mpu`` save
(no info, ``ds_layout_support`` ``tp-z1``) is refused in one line, and read with ``--ds-tp-rules``
(its oracle: ``ds_to_universal.py --inject_missing_state``, which joins everything on dim 0).
The three saves and their ds_to_universal runs take ~20 s on a quiet 2-core machine: slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from ds_support import requires_deepspeed

pytestmark = [requires_deepspeed, pytest.mark.slow]
CASES = ["z1-fp32", "z3-bf16", "z1-bf16-dp2"]  # ZeRO-2 takes the ZeRO-1 path (both in DeepSpeed and here); kept out for CI time


def _read(src: Path, rules=None) -> dict[str, torch.Tensor]:
    from ds_zero_support import read_all
    from formats.deepspeed_zero import DeepSpeedZeroReader

    reader = DeepSpeedZeroReader(src, tp_rules=rules)
    try:
        return read_all(reader)
    finally:
        reader.close()


@pytest.mark.parametrize("name", CASES)
def test_every_state_equals_ds_to_universal_and_the_global_weights(name: str) -> None:
    """Every fp32 master, exp_avg and exp_avg_sq equals ds_to_universal.py's atom (and its step)
    and the global tensor of the TP ranks' live states, bit for bit; the vocabulary padding is
    dropped, the replicated tensors are one copy."""
    from ds_tp_support import live_global, saved
    from ds_tp_worker import SPEC, VOCAB
    from ds_zero_support import universal_atoms

    entry = saved(name)
    got = _read(entry / "run")
    live = live_global(entry)
    shapes = {k[len("model."):]: v.shape for k, v in got.items() if k.startswith("model.")}
    atoms = universal_atoms(entry / "universal", shapes)
    assert got["model.embed.weight"].shape == (VOCAB, 8)
    assert len(live) - 1 == 3 * len(SPEC)
    for key, want in live.items():
        if key == "step":
            continue
        assert torch.equal(got[key], want), key
        assert torch.equal(got[key], atoms[key]), key
    steps = {k: v for k, v in got.items() if k.endswith(".step")}
    if name.startswith("z3"):  # ds_to_universal keeps ZeRO-3's step in optimizer_state.pt only
        assert steps and all(float(v) == float(live["step"]) for v in steps.values())
    else:
        assert steps and all(torch.equal(v, atoms[k]) for k, v in steps.items())


def test_every_command_reads_it_and_fsdp2_loads_it_bit_exact(tmp_path: Path) -> None:
    """inspect, verify (every replicated copy compared too), diff, to-universal and export-hf exit 0
    on the TP save; from-universal to
    FSDP2 dp2, and a 2-process ``dcp.load`` through get/set_state_dict: torch's own full state
    equals the global weights and Adam states, and the step."""
    from ds_tp_support import TIMEOUT, live_global, saved
    from ds_tp_worker import fsdp2_load
    from worlds import run_world

    entry = saved("z3-bf16")
    src = str(entry / "run")
    for argv in (["inspect", src], ["verify", src], ["diff", src, src], ["to-universal", src, str(tmp_path / "u")],
                 ["export-hf", src, str(tmp_path / "hf")]):
        code, _, err = run_cli(*argv)
        assert code == 0, (argv, err)
    code, out, err = run_cli("diff", src, str(tmp_path / "u"))  # the store holds the joined tensors
    assert code == 0 and "44 of 44 common tensors bitwise equal" in out, out + err
    code, _, err = run_cli("from-universal", src, str(tmp_path / "dcp"), "--mesh", "dp2")
    assert code == 0, err
    torch.save(live_global(entry), tmp_path / "expected.pt")
    (tmp_path / "rep").mkdir()
    run_world(fsdp2_load, 2, (str(tmp_path / "dcp"), str(tmp_path / "expected.pt"), str(tmp_path / "rep")),
              timeout=TIMEOUT)
    for r in range(2):
        rep = json.loads((tmp_path / "rep" / f"rank{r}.json").read_text())
        assert not rep["errors"] and rep["checked"] == 33, rep


def test_rules_given_win_over_the_saved_info(tmp_path: Path) -> None:
    """``--ds-tp-rules`` replaces the save's own rules: with none of its patterns every slice is
    joined on dim 0 (ds_to_universal's default), so the row-parallel weight comes out 2H x F/2."""
    from ds_tp_support import saved

    rules = tmp_path / "rules.json"
    rules.write_text("{}")
    code, out, err = run_cli("--ds-tp-rules", str(rules), "inspect", "--json", str(saved("z1-fp32") / "run"))
    assert code == 0, err
    shapes = {t["key"]: t["shape"] for t in json.loads(out)["tensors"]}
    assert shapes["model.row.weight"] == [16, 8] and shapes["model.embed.weight"] == [32, 8]


def test_plain_mpu_save_refused_then_read_with_rules(tmp_path: Path) -> None:
    """A plain-mpu save (no universal_checkpoint_info): one line naming the model-states file,
    what is missing and --ds-tp-rules (not ds_to_universal, which joins it wrongly); with a rules
    file every state equals ds_to_universal.py --inject_missing_state's atoms (both join on dim 0
    where no pattern matches), a rules file saying row-parallel joins that weight on dim 1, and
    one calling a bias replicated that is not makes ``verify`` name it (its copies differ)."""
    from ds_layout_support import TAG, saved_layout
    from ds_zero_support import deepspeed_env, universal_atoms
    from formats.deepspeed_zero.tp import TpRules

    src = saved_layout("tp-z1")
    code, out, err = run_cli("to-universal", str(src), str(tmp_path / "out"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and not out, err
    assert lines[0].startswith(f"ckptconv: error: {src / TAG / 'mp_rank_00_model_states.pt'}: ")
    assert "without universal_checkpoint_info" in lines[0] and "--ds-tp-rules" in lines[0]
    assert "ds_to_universal.py" not in lines[0]
    assert not (tmp_path / "out").exists()

    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src / TAG),
           "--output_folder", str(tmp_path / "uni"), "--num_extract_workers", "1", "--num_merge_workers", "1",
           "--inject_missing_state"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=deepspeed_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _read(src, TpRules.parse({}, "test"))
    atoms = universal_atoms(tmp_path / "uni", {k[6:]: v.shape for k, v in got.items() if k.startswith("model.")})
    assert set(atoms) <= set(got) and len(atoms) == 16
    for key, want in atoms.items():
        assert torch.equal(got[key], want), key
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"parameter_with_row_parallelism_patterns": [r"2\.weight$"]}))
    code, out, err = run_cli("--ds-tp-rules", str(rules), "inspect", "--json", str(src))
    assert code == 0, err
    assert {t["key"]: t["shape"] for t in json.loads(out)["tensors"]}["model.2.weight"] == [8, 16]
    rules.write_text(json.dumps({"tp_replicated_parameter_patterns": [r"0\.bias$"]}))  # each rank's differs
    code, out, err = run_cli("--ds-tp-rules", str(rules), "verify", str(src))
    assert code != 0 and out.count("problem [replica]") == 3 and "'model.0.bias': tensor-parallel rank 1's copy differs" \
        in out, out + err
    rules.write_text(json.dumps({"tp_replicated_parameter_patterns": "0"}))
    code, _, err = run_cli("--ds-tp-rules", str(rules), "inspect", str(src))
    assert code == 2 and "must be a list of regex strings" in err and len(err.strip().splitlines()) == 1, err


def test_exported_loads_in_a_tp1_deepspeed_engine(tmp_path: Path) -> None:
    """export-ds of the TP2 ZeRO-1 save: the same model at TP 1 under a plain DeepSpeed ZeRO-2
    engine of 2 ranks loads it with ``load_universal``; every fp32 master and Adam state by
    DeepSpeed's own accessors equals the global one, bit for bit."""
    from ds_tp_support import TIMEOUT, live_global, saved
    from ds_tp_worker import ds_load
    from worlds import run_world

    entry = saved("z1-fp32")
    code, _, err = run_cli("export-ds", str(entry / "run"), str(tmp_path / "ds"))
    assert code == 0, err
    torch.save(live_global(entry), tmp_path / "expected.pt")
    (tmp_path / "rep").mkdir()
    run_world(ds_load, 2, (str(tmp_path / "ds"), 2, str(tmp_path / "expected.pt"), str(tmp_path / "rep")),
              timeout=TIMEOUT)
    for r in range(2):
        rep = json.loads((tmp_path / "rep" / f"rank{r}.json").read_text())
        assert not rep["errors"] and rep["checked"] == 33, rep
