"""DCP's per-rank safetensors storage (``HuggingFaceStorageWriter(save_distributed=True)``) as the
source of every command: verify, diff, to-universal, from-universal, export-hf, export-ds.

Sources are real multi-process saves (:mod:`hf_storage_factory`: FSDP2 on 3 ranks with uneven
shards, TP x FSDP, an MoE block under expert parallelism, every dtype). Oracles: the values the
saving job held (``reference.pt``), torch's ``dcp_to_torch_save`` of DCP outputs, the safetensors
library's reading of HF outputs, ``torch.load`` of DeepSpeed atoms.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hf_storage_factory as hfs
from cli_runner import run_cli
from ds_support import assert_atoms_equal
from oracle import bits_equal, torch_reference

SOURCES = ["fsdp3", "tp2dp2", "ep2dp2", "dtypes3"]
#: The target mesh and plan of each source's from-universal (the MoE one keeps its experts on ep).
TARGETS = {"fsdp3": ("tp2,dp2", "llama"), "tp2dp2": ("dp3", "fsdp"), "ep2dp2": ("dp2,ep2", "moe"),
           "dtypes3": ("dp2", "fsdp")}


def _ok(*args: str) -> str:
    code, out, err = run_cli(*args)
    assert code == 0, f"{args}: {err}"
    return out


def _assert_all_equal(got: dict, want: dict, keys=None) -> None:
    keys = sorted(want) if keys is None else keys
    assert set(keys) <= set(got), sorted(set(keys) - set(got))[:5]
    bad = [k for k in keys if not bits_equal(got[k], want[k])]
    assert not bad, bad[:5]


@pytest.mark.parametrize("kind", SOURCES)
def test_to_universal_and_back_to_dcp(kind, tmp_path):
    """per-rank safetensors -> store -> DCP on another mesh: torch reads every key bit for bit as
    the saving job held it; verify and diff agree."""
    src, ref = str(hfs.shards(kind)), hfs.reference(kind)
    _ok("to-universal", src, str(tmp_path / "uni"))
    assert "same:" in _ok("diff", src, str(tmp_path / "uni"))
    mesh, plan = TARGETS[kind]
    _ok("from-universal", str(tmp_path / "uni"), str(tmp_path / "dcp"), "--mesh", mesh, "--plan", plan)
    _ok("verify", str(tmp_path / "dcp"))
    _assert_all_equal(torch_reference(tmp_path / "dcp"), ref)


@pytest.mark.parametrize("kind", ["tp2dp2", "ep2dp2"])
def test_from_universal_straight_from_the_per_rank_form(kind, tmp_path):
    mesh, plan = TARGETS[kind]
    _ok("from-universal", str(hfs.shards(kind)), str(tmp_path / "dcp"), "--mesh", mesh, "--plan", plan)
    _assert_all_equal(torch_reference(tmp_path / "dcp"), hfs.reference(kind))
    assert "same:" in _ok("diff", str(hfs.shards(kind)), str(tmp_path / "dcp"))


@pytest.mark.parametrize("kind", ["fsdp3", "ep2dp2", "dtypes3"])
def test_export_hf(kind, tmp_path):
    """The model weights as HF safetensors (``model.`` stripped; a source without a model root keeps
    every tensor): what the safetensors library loads is the saving job's value."""
    from safetensors.torch import load_file

    _ok("export-hf", str(hfs.shards(kind)), str(tmp_path / "hf"), "--max-shard-size", "2KB")
    got: dict = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        got.update(load_file(str(f)))
    ref = hfs.reference(kind)
    model = {k.removeprefix("model."): v for k, v in ref.items() if k.startswith("model.")} or ref
    _assert_all_equal(got, model)
    assert set(got) == set(model)


def test_export_ds_keeps_weights_and_adam_states(tmp_path):
    _ok("export-ds", str(hfs.shards("tp2dp2")), str(tmp_path / "ds"), "--tag", "t")
    assert_atoms_equal(tmp_path / "ds" / "t", hfs.reference("tp2dp2"))


def test_dry_run_names_the_per_rank_files(tmp_path):
    out = _ok("from-universal", str(hfs.shards("fsdp3")), str(tmp_path / "dcp"), "--mesh", "dp2", "--dry-run",
              "--keys", "model.tok_embeddings.weight")
    assert "shard-00001-model-00001-of-00001.safetensors" in out, out
    assert not (tmp_path / "dcp").exists()
