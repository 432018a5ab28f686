"""``export-hf RUN_DIR/ OUT/ --all-steps`` (or a glob): every step folder of a run, each resumable,
checked, and skipped once converted.

The steps are copies of real multi-process DCP saves (the FSDP4 and TP2 x DP2 fixtures); each
step's output is compared with a plain export of that step, and the interrupted step is a real
SIGKILL of the CLI mid-write (``CKPTCONV_FAULT_KILL_AFTER_BYTES``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from converter import api
from converter.config import RunOptions
from formats.errors import CkptConvError, ConfigError

OPTS = RunOptions(workers=2)
REPO = Path(__file__).resolve().parents[2]


def ckptconv(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "converter", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=600)


@pytest.fixture
def run_dir(dcp_checkpoint, tmp_path):
    """run/step-2 (TP2 x DP2), run/step-10 (FSDP4), run/step-30 (being written: no .metadata), run/logs."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(dcp_checkpoint("tp2dp2"), run / "step-2")
    shutil.copytree(dcp_checkpoint("fsdp4"), run / "step-10")
    shutil.copytree(dcp_checkpoint("fsdp4"), run / "step-30")
    (run / "step-30" / ".metadata").unlink()
    (run / "logs").mkdir()
    (run / "logs" / "train.log").write_text("loss 1.0\n")
    return run


def single_exports(run: Path, tmp_path: Path, names=("step-2", "step-10")) -> dict[str, Path]:
    out = {}
    for name in names:
        out[name] = tmp_path / "ref" / name
        api.export_hf(run / name, out[name], options=OPTS)
    return out


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_all_steps_converts_each_skips_done_ones(run_dir, tmp_path):
    out = tmp_path / "out"
    result = api.export_hf(run_dir, out, all_steps=True, options=OPTS)
    assert [(s.name, s.status) for s in result.steps] == [("step-2", "converted"), ("step-10", "converted"),
                                                          ("step-30", "incomplete")]
    assert any("step-30" in w and "still being written" in w for w in result.warnings)
    assert sorted(p.name for p in out.iterdir()) == ["step-10", "step-2"]
    for name, ref in single_exports(run_dir, tmp_path).items():
        assert same_files(out / name, ref), name
    again = api.export_hf(run_dir, out, all_steps=True, options=OPTS)
    assert [s.status for s in again.steps] == ["skipped", "skipped", "incomplete"]
    forced = api.export_hf(run_dir, out, all_steps=True, options=RunOptions(workers=2, overwrite=True))
    assert [s.status for s in forced.steps] == ["converted", "converted", "incomplete"]


def test_glob_selects_the_steps(run_dir, tmp_path):
    result = api.export_hf(str(run_dir / "step-1*"), tmp_path / "out", options=OPTS)
    assert [(s.name, s.status) for s in result.steps] == [("step-10", "converted")]


def test_an_interrupted_step_is_resumed_and_the_rest_skipped(run_dir, tmp_path):
    out = tmp_path / "out"
    args = ("export-hf", str(run_dir), str(out), "--all-steps", "--workers", "1")
    first = ckptconv(*args)  # step-2 and step-10 done
    assert first.returncode == 0, first.stderr
    shutil.rmtree(out / "step-10")
    killed = ckptconv(*args, env={"CKPTCONV_FAULT_KILL_AFTER_BYTES": "20000"})
    assert killed.returncode == -9
    assert (out / "step-10" / ".ckptconv-journal.jsonl").exists() or any((out / "step-10").iterdir())
    rerun = ckptconv(*args)
    assert rerun.returncode == 0, rerun.stderr
    lines = rerun.stdout.splitlines()
    assert lines[0].startswith("step-2: skipped") and lines[1].startswith("step-10: resumed: wrote"), lines
    assert "step-30: incomplete" in lines[2]
    ref = single_exports(run_dir, tmp_path, ("step-10",))["step-10"]
    assert same_files(out / "step-10", ref)


def test_a_failed_step_leaves_the_others_done(run_dir, tmp_path):
    out = tmp_path / "out"
    (run_dir / "step-2" / "__1_0.distcp").write_bytes(b"garbage")  # step-2 cannot be read
    with pytest.raises(CkptConvError, match=r"^step step-2: .*rerun the same command"):
        api.export_hf(run_dir, out, all_steps=True, options=OPTS)
    assert (out / "step-10" / "model.safetensors").is_file()


def test_bad_run_dirs(dcp_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="is itself a checkpoint"):
        api.export_hf(dcp_checkpoint("fsdp4"), tmp_path / "out", all_steps=True, options=OPTS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no step folder holds a checkpoint"):
        api.export_hf(tmp_path / "empty", tmp_path / "out", all_steps=True, options=OPTS)
    with pytest.raises(ConfigError, match="no folder matches"):
        api.export_hf(str(tmp_path / "nothing-*"), tmp_path / "out", options=OPTS)


def test_a_step_converted_otherwise_is_refused_until_overwrite(run_dir, tmp_path):
    out = tmp_path / "out"
    api.export_hf(run_dir, out, all_steps=True, dtype="bf16", options=OPTS)
    with pytest.raises(CkptConvError, match=r"^step step-2: .*--dtype .*\(2 of 3 steps failed"):
        api.export_hf(run_dir, out, all_steps=True, options=OPTS)
    again = api.export_hf(run_dir, out, all_steps=True, options=RunOptions(workers=2, overwrite=True))
    assert [s.status for s in again.steps] == ["converted", "converted", "incomplete"]
