"""DeepSpeed pipeline-engine saves (``PipelineModule`` under ZeRO-1) read directly, against
DeepSpeed 0.19.8's own code (CPU, gloo).

The saves (``ds_layout_support``): ``pipe-z1`` (2 stages, 1 rank each), ``pipemp-z1`` (the same
on Megatron-DeepSpeed's pipe x model x data topology: ``layer_XX-model_00-model_states.pt``) and
``pipe4-z1`` (2 stages x 2 data-parallel ranks: each stage's ZeRO-1 partitions over its own dp
group), ``pipe4bf-z1`` (the same in bf16: DeepSpeed's BF16_Optimizer, ``bf16_zero_pp_rank_*`` files). DeepSpeed's consolidations do not take these folders (``zero_to_fp32``'s
``get_fp32_state_dict_from_zero_checkpoint``: ``AttributeError: 'NoneType' object has no attribute
'items'`` on the stages' ``module`` None; ``ds_to_universal.py``: ``ZeroDivisionError``: it
expects an embedding, at least one transformer layer file per stage and a final layer), so the
oracles are DeepSpeed's own gathering in the saving run (``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` of every stage's parameters, ``live-rank<r>.pt``) and
``torch.load`` of the layer files it wrote, and plain (non-pipeline) DeepSpeed engines loading the
``export-ds`` output. Each save takes ~15-25 s: slow.

Megatron-DeepSpeed's layouts (``ds_pipe_support``, 4 ranks each, ~7 s to save on 2 cores):
``tp2-fp32``, 2 stages x TP 2 on ``PipeModelDataParallelTopology`` (BLOOM's 3D layout: files
``mp_rank_<stage * 2 + tp>``, ``layer_XX-model_<tp>``), a vocabulary-parallel embedding tied
between the first and last stage, frozen column-parallel biases, ``universal_checkpoint_info``
with ``pipeline_replicated_parameter_patterns``; ``tied-bf16-dp2``, 2 stages x DP 2 in bf16, a
tied embedding (with a frozen shift) whose layer file both stages write, a frozen bias beside a
buffer and a wholly frozen layer. Oracles: DeepSpeed's ``safe_get_full_*`` on every stage's ranks (TP slices joined
as the model was cut; the last stage's copy of the tied embedding too), the layer files, and
``ds_to_universal.py``, which takes these folders (its atoms: every trainable parameter).
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
        line = _inspect_without(entry / TAG, missing, tmp_path)
        assert ("stage 1" if "model_states" in missing else "mp_rank_01_optim_states") in line, line


def _inspect_without(tag: Path, missing: str, tmp_path: Path) -> str:
    """``inspect`` of a copy of ``tag`` without the file ``missing``: exit 2 and one line, returned."""
    src = tmp_path / missing
    shutil.copytree(tag, src)
    (src / missing).chmod(0o644)
    (src / missing).unlink()
    code, _, err = run_cli("inspect", str(src))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


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


# ---------------------------------------------------------------------------------------------
# Megatron-DeepSpeed's layouts (ds_pipe_support): TP inside the stages, tied and frozen weights

#: case -> (TP ranks per stage, data-parallel ranks per stage).
PIPES3D = {"tp2-fp32": (2, 1), "tied-bf16-dp2": (1, 2)}
CASES3D = [pytest.param(n, id=n, marks=[pytest.mark.slow]) for n in PIPES3D]
TIED = "tied_modules.embed.weight"
TIED_KEYS = {f"model.{TIED}", *(f"optim.state.{TIED}.{s}" for s in ("exp_avg", "exp_avg_sq", "step"))}


def _layer_files(tag: Path, got: dict[str, torch.Tensor], tp: int) -> dict[str, torch.Tensor]:
    """Every layer file's tensors as DeepSpeed wrote them, each TP rank's slices joined as the
    test model was cut, by the parameter each is (``<l>.<name>``, or the tied module's)."""
    import re

    from ds_pipe_worker import TP_SPEC
    from ds_tp_worker import tp_join

    by_layer: dict[int, list[dict]] = {}
    for path in sorted(tag.glob("layer_*-model_states.pt")):
        layer = int(re.match(r"layer_(\d+)", path.name)[1])
        by_layer.setdefault(layer, []).append(torch.load(path, weights_only=True))
    out = {}
    for layer, ranks in by_layer.items():
        assert len(ranks) == tp
        for k in ranks[0]:
            name = f"{layer}.{k}" if f"model.{layer}.{k}" in got else f"tied_modules.embed.{k}"
            out[f"{layer}:{name}"] = tp_join([r[k] for r in ranks], TP_SPEC[name][1]) if tp > 1 else ranks[0][k]
    return out


@pytest.mark.parametrize("name", CASES3D)
def test_tp_tied_and_frozen_equal_deepspeeds_own(name: str) -> None:
    """Every fp32 master, exp_avg, exp_avg_sq and step equals DeepSpeed's own accessors on the
    stages' ranks (TP slices joined as the model was cut, the vocabulary padding dropped), bit for
    bit; the tied embedding is one parameter, equal to each stage's own copy; frozen parameters and
    buffers equal the module's own tensors in their dtype as saved (bf16 / fp32); every layer-file
    tensor equals ours (a trainable one: the fp32 master cast to the file's dtype); every atom
    ds_to_universal.py writes equals ours, which add only the frozen tensors it leaves out; one
    param group listing each parameter once."""
    from ds_pipe_support import live_global, saved
    from ds_zero_support import read_all, universal_atoms

    tp, dp = PIPES3D[name]
    entry = saved(name)
    reader = _reader(entry / "run")
    got = read_all(reader)
    want = live_global(name, entry)
    tensors = {k for k in want if k.startswith(("model.", "optim.state."))}
    assert {k for k in got if not k.endswith(".step")} == tensors
    for key in tensors:
        assert bits_equal(got[key], want[key]), key
    tied_frozen = {"tp2-fp32": set(), "tied-bf16-dp2": {"model.tied_modules.embed.shift"}}[name]
    assert set(want["copies"]) == TIED_KEYS - {f"optim.state.{TIED}.step"} | tied_frozen  # the last stage's own copy
    for key, copy in want["copies"].items():
        assert bits_equal(got[key], copy), key
    steps = [k for k in got if k.endswith(".step")]
    assert steps and all(bits_equal(got[k], want["step"]) for k in steps)
    frozen = {"tp2-fp32": {"model.1.col.bias", "model.3.col.bias"},
              "tied-bf16-dp2": {"model.1.lin.bias", "model.2.weight", "model.2.bias", "model.1.scale", *tied_frozen}}[name]
    assert {k for k in tensors if k.startswith("model.") and f"optim.state.{k[6:]}.exp_avg" not in got} == frozen
    if name.startswith("tied-bf16"):
        assert got["model.2.weight"].dtype == torch.bfloat16 and got["model.1.scale"].dtype == torch.float32
    layers = _layer_files(entry / "run" / TAG, got, tp)
    assert {k.split(":", 1)[1] for k in layers} == {k[6:] for k in got if k.startswith("model.")}
    for key, saved_tensor in layers.items():
        assert bits_equal(got[f"model.{key.split(':', 1)[1]}"].to(saved_tensor.dtype), saved_tensor), key
    atoms = universal_atoms(entry / "universal", {k[6:]: v.shape for k, v in got.items() if k.startswith("model.")})
    assert set(got) - set(atoms) == frozen
    for key, atom in atoms.items():
        assert torch.equal(got[key], atom), key
    params = reader.load_object("optim.param_groups.0.params")
    assert params[0] == TIED and len(params) == len(set(params)) == len({k for k in got if k.endswith(".exp_avg")})
    assert reader.load_object("optim.param_groups.0.lr") == want["param_groups"][0]["lr"]
    info = reader.index().info
    assert (info["pp_degree"], info["tp_degree"], info["world_size"], info["zero_stage"]) == (2, tp, dp, 1)
    assert TIED_KEYS | tied_frozen <= set(reader.replicated_keys)  # the frozen shift: both stages' layer files
    for key in reader.replicated_keys:
        reader.check_replicas(key)


@pytest.mark.parametrize("name", CASES3D)
def test_every_command_reads_it(name: str, tmp_path: Path) -> None:
    """inspect (the layout line says stages merged, TP joined), verify (every tied and
    TP-replicated copy compared), diff, to-universal then diff (identical), export-hf (every
    weight, frozen ones in their dtype), export-ds (every atom equal to ours) exit 0."""
    from ds_pipe_support import saved
    from ds_zero_support import read_all, universal_atoms

    src = str(saved(name) / "run")
    got = read_all(_reader(saved(name) / "run"))
    for argv in (["verify", src], ["to-universal", src, str(tmp_path / "u")], ["export-hf", src, str(tmp_path / "hf")],
                 ["export-ds", src, str(tmp_path / "ds")]):
        code, _, err = run_cli(*argv)
        assert code == 0, (argv, err)
    code, out, err = run_cli("inspect", src)
    assert code == 0 and "2 pipeline stages merged" in " ".join(out.split()), out + err
    assert ("tensor-parallel ranks' slices joined" in " ".join(out.split())) == name.startswith("tp2"), out
    code, out, err = run_cli("diff", "--json", src, str(tmp_path / "u"))
    doc = json.loads(out)
    assert code == 0 and doc["same"] and doc["counts"] == {"equal": len(got)}, err
    from safetensors.torch import load_file

    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(hf) == {k[6:] for k in got if k.startswith("model.")}
    for key, value in hf.items():
        assert bits_equal(value, got[f"model.{key}"]), key
    atoms = universal_atoms(tmp_path / "ds" / TAG, {k[6:]: v.shape for k, v in got.items() if k.startswith("model.")})
    assert {k for k in atoms if not k.endswith(".step")} == {k for k in got if not k.endswith(".step")}
    for key, atom in atoms.items():
        assert torch.equal(got[key].float(), atom.float()), key


@pytest.mark.parametrize("name", CASES3D)
def test_from_universal_to_dcp_loads_bit_exact_in_a_real_world(name: str, tmp_path: Path) -> None:
    """from-universal straight from the folder to DCP ``dp2``; a 2-process gloo job ``dcp.load`` s
    every weight (frozen ones and buffers included), Adam state and step into DTensors: all equal
    DeepSpeed's own (live) state, bit for bit."""
    from ds_moe_worker import dcp_load_and_check
    from ds_pipe_support import TIMEOUT, live_global, saved
    from worlds import run_world

    entry = saved(name)
    code, _, err = run_cli("from-universal", str(entry / "run"), str(tmp_path / "dcp"), "--mesh", "dp2")
    assert code == 0, err
    want = {k: v for k, v in live_global(name, entry).items() if k.startswith(("model.", "optim.state.")) or k == "step"}
    torch.save(want, tmp_path / "expected.pt")
    (tmp_path / "rep").mkdir()
    run_world(dcp_load_and_check, 2, (str(tmp_path / "dcp"), str(tmp_path / "expected.pt"), str(tmp_path / "rep")),
              timeout=TIMEOUT)
    n = sum(1 for k in want if k != "step") + sum(1 for k in want if k.endswith(".exp_avg"))
    for r in range(2):
        rep = json.loads((tmp_path / "rep" / f"rank{r}.json").read_text())
        assert not rep["errors"] and rep["checked"] == n, rep


@pytest.mark.slow
def test_a_tied_copy_that_differs_is_reported_by_verify(tmp_path: Path) -> None:
    """The last stage's fp32 master of the tied embedding changed in its optimizer file (rewritten
    by torch.save, so every zip CRC holds): ``verify`` exits 1 naming the key and the stage whose
    copy differs; conversions still take the first stage's (its values unchanged)."""
    from ds_pipe_support import live_global, saved

    entry = saved("tied-bf16-dp2")
    src = tmp_path / "run"
    shutil.copytree(entry / "run", src)
    for p in [src, *src.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    optim = src / TAG / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"
    sd = torch.load(optim, weights_only=False)
    with torch.no_grad():  # stage 1's optimizer holds only the tied weight
        sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] += 1.0
    torch.save(sd, optim)
    code, out, err = run_cli("verify", str(src))
    assert code == 1 and out.count("problem [replica]") == 1, out + err
    assert f"'model.{TIED}': pipeline stage 1's copy differs from stage 0's" in out, out
    from ds_zero_support import read_all

    got = read_all(_reader(src))
    assert bits_equal(got[f"model.{TIED}"], live_global("tied-bf16-dp2", entry)[f"model.{TIED}"])


@pytest.mark.slow
def test_a_missing_file_of_a_tp_stage_is_one_line(tmp_path: Path) -> None:
    """A copy of the pipeline x TP save without one layer file of TP rank 1, without stage 1's TP
    rank 1 model states, or without its optimizer partition: one line (exit 2) naming it."""
    from ds_pipe_support import saved

    entry = saved("tp2-fp32")
    cases = {"layer_01-model_01-model_states.pt": "no layer_01-model_01-model_states.pt (layer 1 of tensor-parallel rank 1)",
             "mp_rank_03_model_states.pt": "(pipeline stage 1 of 2, tensor-parallel rank 1 of 2)",
             "zero_pp_rank_0_mp_rank_03_optim_states.pt": "no zero_pp_rank_*_mp_rank_03_optim_states.pt"}
    for missing, says in cases.items():
        line = _inspect_without(entry / "run" / TAG, missing, tmp_path)
        assert says in line, line


@pytest.mark.slow
def test_pipeline_tp_without_info_is_read_with_rules(tmp_path: Path) -> None:
    """DeepSpeed's pipe x model save of a model that records no universal_checkpoint_info
    (``ds_layout_support`` ``pipetp-z1``, refused in one line: test_ds_zero_refusals.py) is read
    with ``--ds-tp-rules``: an empty rules file joins every slice on dim 0 (ds_to_universal's
    default), a row-parallel rule on dim 1."""
    rules = tmp_path / "rules.json"
    for text, shape in (("{}", [16, 8]), (json.dumps({"parameter_with_row_parallelism_patterns": [r"2\.weight$"]}), [8, 16])):
        rules.write_text(text)
        code, out, err = run_cli("--ds-tp-rules", str(rules), "inspect", "--json", str(saved_layout("pipetp-z1")))
        assert code == 0, err
        assert {t["key"]: t["shape"] for t in json.loads(out)["tensors"]}["model.2.weight"] == shape
