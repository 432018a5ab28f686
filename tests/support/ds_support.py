"""DeepSpeed for the bridge tests: availability, ZeRO runs, ds_to_universal, universal loads.

DeepSpeed 0.19.8 is installed by ``.ci/install_deepspeed.sh`` (never replacing torch); without it
the tests that run DeepSpeed (``framework("deepspeed")``) skip with a reason, and fail under CI.
Every DeepSpeed process runs under a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_factory import run_world
from oracle import bits_equal
from models import ModelArgs

#: The tiny model of the checked-in fixtures (tests/data/deepspeed/).
TINY = ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=24)
DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
TIMEOUT = 300.0


#: Marks a test that runs DeepSpeed's own code: it skips without DeepSpeed (fails under CI).
requires_deepspeed = pytest.mark.framework("deepspeed")


def train_and_save(out_dir: Path, stage: int, world: int, args: ModelArgs = TINY, steps: int = 3,
                   groups: int = 1) -> Path:
    """A real ZeRO-``stage`` run of ``world`` ranks; its checkpoint tag folder (``live.pt``, the
    engine's own full state, lies in ``out_dir``)."""
    from ds_worker import train_and_save as worker

    run_world(worker, world, (stage, args.to_json(), str(out_dir), steps, groups), timeout=TIMEOUT)
    return out_dir / f"step{steps}"


def to_universal(tag_dir: Path, out_dir: Path, stage: int) -> Path:
    """DeepSpeed's own ``ds_to_universal.py`` (in a subprocess, under a timeout)."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
           "--output_folder", str(out_dir), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    if stage < 3:
        cmd.append("--inject_missing_state")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out_dir


def load_and_check(load_dir: Path, expected: Path, stage: int, world: int, report_dir: Path,
                   args: ModelArgs = TINY, groups: int = 1) -> list[dict]:
    """A ZeRO-``stage`` engine of ``world`` ranks loads ``load_dir`` (``load_universal``); every
    rank's report, after asserting none found a difference."""
    from ds_worker import load_and_check as worker

    report_dir.mkdir(parents=True, exist_ok=True)
    run_world(worker, world, (stage, args.to_json(), str(load_dir), str(expected), str(report_dir), groups),
              timeout=TIMEOUT)
    reports = [json.loads((report_dir / f"rank{r}.json").read_text()) for r in range(world)]
    for rep in reports:
        assert not rep["errors"], f"ZeRO-{stage} world {world} rank {rep['rank']}: {rep['errors']}"
        assert rep["checked"] > 0
    return reports


def save_expected(expected: dict, path: Path) -> Path:
    torch.save(expected, path)
    return path


def fsdp2_load_and_check(ckpt_dir: Path, expected: Path, world: int, report_dir: Path,
                         args: ModelArgs = TINY, groups: int = 1) -> list[dict]:
    """FSDP2 (``dp<world>``) loads the DCP checkpoint ``ckpt_dir`` with ``dcp.load``; every rank's
    report, after asserting none found a difference with ``expected``."""
    from ds_worker import fsdp2_load_and_check as worker

    report_dir.mkdir(parents=True, exist_ok=True)
    run_world(worker, world, (args.to_json(), str(ckpt_dir), str(expected), str(report_dir), groups),
              timeout=TIMEOUT)
    reports = [json.loads((report_dir / f"rank{r}.json").read_text()) for r in range(world)]
    for rep in reports:
        assert not rep["errors"], f"FSDP2 dp{world} rank {rep['rank']}: {rep['errors']}"
        assert rep["checked"] > 0
    return reports


def live_of(stage: int) -> dict:
    """DeepSpeed's live full state saved with the ZeRO-``stage`` fixture (the oracle)."""
    return torch.load(DATA / f"zero{stage}" / "live.pt", weights_only=False)


def universal_of(stage: int) -> Path:
    """The checked-in universal checkpoint of the ZeRO-``stage`` fixture."""
    return DATA / f"zero{stage}" / "universal"


def import_ds(src: Path, dst: Path) -> Any:
    """import-ds with default options."""
    from converter.commands.import_ds import import_ds as run

    return run(src, dst)


def export_ds(src: Path, dst: Path, **kw: Any) -> Any:
    """export-ds (keyword options passed on)."""
    from converter.commands.export_ds import export_ds as run

    return run(src, dst, **kw)


def assert_matches_live(ref: dict, live: dict) -> None:
    """torch's reading of a DCP checkpoint equals DeepSpeed's live state, bit for bit."""
    keys = [k for k in live if k.startswith(("model.", "optim.state."))]
    assert keys
    bad = [k for k in keys if not bits_equal(ref.get(k), live[k])]
    assert not bad, bad[:5]
    steps = [v for k, v in ref.items() if k.startswith("optim.state.") and k.endswith(".step")]
    assert len(steps) == len([k for k in ref if k.startswith("model.")])
    assert all(bits_equal(s, live["step"]) for s in steps)
    for name, value in live["param_groups"][0].items():
        assert ref[f"optim.param_groups.0.{name}"] == value, name


def assert_atoms_equal(tag_dir: Path, ref: dict) -> None:
    """Every parameter's ``fp32.pt`` and Adam ``exp_avg``/``exp_avg_sq``/``step`` atom under
    ``tag_dir/zero`` (export-ds's output) equals the source's ``model.<fqn>`` /
    ``optim.state.<fqn>.<state>`` in ``ref`` (DCP's flattened keys), bit for bit."""
    for fqn in (k[len("model."):] for k in ref if k.startswith("model.")):
        got = torch.load(tag_dir / "zero" / fqn / "fp32.pt", weights_only=True)["param"]
        assert bits_equal(got, ref[f"model.{fqn}"]), fqn
        for state in ("exp_avg", "exp_avg_sq", "step"):
            got = torch.load(tag_dir / "zero" / fqn / f"{state}.pt", weights_only=True)
            got = got["param"] if isinstance(got, dict) else got
            assert bits_equal(got, ref[f"optim.state.{fqn}.{state}"]), (fqn, state)
