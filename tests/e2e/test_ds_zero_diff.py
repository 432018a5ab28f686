"""``ckptconv diff`` on DeepSpeed ``save_checkpoint`` folders read directly, against DeepSpeed
0.19.8's own saves and consolidation (CPU, gloo).

* A ZeRO folder and its own ``to-universal`` output: identical, exit 0 (``ds_zero_support`` cases).
* One run saved after step 3 and after step 4 (``ds_layout_support`` entry ``steps-z2``, ZeRO-2,
  2 ranks): exit 1, and exactly the weights DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``
  shows changed are listed as different, with the number of elements whose bits differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from ds_support import requires_deepspeed

pytestmark = [requires_deepspeed]

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "diff.schema.json"


def _diff_json(a: Path, b: Path) -> tuple[int, dict]:
    import jsonschema

    code, out, err = run_cli("diff", "--json", str(a), str(b))
    doc = json.loads(out)
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    return code, doc


@pytest.mark.parametrize("name", ["z2-bf16-w3", "z3-fp32-w2", "z0-bf16-w1"])
def test_zero_folder_equals_its_own_to_universal_output(name: str, tmp_path: Path) -> None:
    """``diff SRC OUT`` after ``to-universal SRC OUT``: every tensor bitwise equal, every object
    equal, no key on one side only; exit 0 (text and ``--json``, which follows the schema)."""
    from ds_zero_support import saved

    src = saved(name) / "run"
    out = tmp_path / "uni"
    code, _, err = run_cli("to-universal", str(src), str(out))
    assert code == 0, err
    code, text, err = run_cli("diff", str(src), str(out))
    assert code == 0, text + err
    assert "same:" in text
    code, doc = _diff_json(src, out)
    assert code == 0 and doc["same"]
    assert doc["a"]["format"] == "deepspeed-zero" and doc["b"]["format"] == "universal"
    assert not doc["only_a"] and not doc["only_b"]
    assert set(doc["counts"]) == {"equal"} and doc["counts"]["equal"] == len(doc["tensors"]) > 0
    assert doc["objects"] and all(o["status"] == "equal" for o in doc["objects"])
    keys = {t["key"] for t in doc["tensors"]}
    assert any(k.startswith("model.") for k in keys) and any(k.endswith(".exp_avg_sq") for k in keys)


@pytest.mark.slow
def test_one_more_training_step_is_listed(tmp_path: Path) -> None:
    """``diff global_step3 global_step4`` of one DeepSpeed run: exit 1 (the CLI's status for
    differences, like ``cmp``); the ``model.*`` keys listed different are exactly those whose fp32
    weight differs in DeepSpeed's own consolidation of the two tags, each with the count of
    elements whose bits differ; every Adam state and step differs; ``global_steps`` 3 vs 4. The
    text report lists them too. (``--json`` follows the schema; the same against the folder
    holding ``latest``, which names global_step4.)"""
    from ds_layout_support import STEP_TAGS, saved_layout

    entry = saved_layout("steps-z2")
    a, b = (entry / t for t in STEP_TAGS)
    fp32 = [torch.load(entry / f"fp32-{t}.pt", weights_only=False) for t in STEP_TAGS]
    changed = {f"model.{k}": int((fp32[0][k].view(torch.int32) != fp32[1][k].view(torch.int32)).sum())
               for k in fp32[0]}
    changed = {k: n for k, n in changed.items() if n}
    assert changed  # the step trained something
    for other in (b, entry):
        code, doc = _diff_json(a, other)
        assert code == 1 and not doc["same"]
        assert not doc["only_a"] and not doc["only_b"]
        tensors = {t["key"]: t for t in doc["tensors"]}
        different = {k: t["mismatched"] for k, t in tensors.items() if t["status"] == "different"}
        assert {k: n for k, n in different.items() if k.startswith("model.")} == changed
        assert {k for k in tensors if k.startswith("model.")} == {f"model.{k}" for k in fp32[0]}
        states = [k for k in tensors if k.startswith("optim.state.")]
        assert states and all(tensors[k]["status"] == "different" for k in states)
        objects = {o["key"]: o["status"] for o in doc["objects"]}
        assert objects["deepspeed.global_steps"] == "different"
        assert objects["optim.param_groups.0.lr"] == "equal"
    code, text, _ = run_cli("diff", str(a), str(b))
    assert code == 1
    assert f"different ({len(different)}):" in text
    assert all(k in text for k in changed)
