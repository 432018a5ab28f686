"""DeepSpeed folders the ZeRO reader does not read yet, refused in one line by every command.

The folders are saved by DeepSpeed 0.19.8's own engine in 2-rank gloo runs on CPU
(``ds_layout_support``): a model-parallel engine (``mpu``, as Megatron-DeepSpeed passes its
tensor-parallel groups: ``mp_rank_01_*``, ZeRO-1 and ZeRO-3) that records no
``universal_checkpoint_info`` (with it, or with ``--ds-tp-rules``, it is read: ``test_ds_tp.py``), a 2-stage ``PipelineModule`` without
ZeRO (``layer_XX-model_states.pt``; under ZeRO-1 it is read: ``test_ds_pipeline.py``), and one with 2
tensor-parallel ranks per stage (4 ranks, ``layer_XX-model_01-model_states.pt``) that records no
``universal_checkpoint_info`` either (with it, or with ``--ds-tp-rules``, it is read:
``test_ds_pipeline.py``); MoE saves, refused here before, are read (``test_ds_moe.py``). Each command exits 2 with one line naming a
file of the layout, what it is, that it is not supported and what to do; no traceback (one with ``--debug``); nothing written at the output.

The default suite's cases (:func:`test_refused_when_added_to_a_real_zero_folder`) copy a real ZeRO-2
save (``ds_zero_support`` case ``z2-bf16-w3``) and add files named the way DeepSpeed names them
(``DeepSpeedEngine._get_expert_ckpt_name`` /
``_get_ckpt_name`` with an mp rank of 1); the DeepSpeed-saved layouts, ~15 s each to save, are slow.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from ds_layout_support import TAG, saved_layout
from ds_support import requires_deepspeed

pytestmark = [requires_deepspeed]

#: layout -> (files DeepSpeed wrote that make it, the file the error names, what it says, the hint).
LAYOUTS = {
    "tp-z1": (["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"],
              "mp_rank_00_model_states.pt", "a tensor-parallel save (2 ranks mp_rank_*) without "
              "universal_checkpoint_info", "--ds-tp-rules"),
    "tp-z3": (["zero_pp_rank_0_mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"],
              "zero_pp_rank_0_mp_rank_00_model_states.pt", "a tensor-parallel save (2 ranks mp_rank_*) without "
              "universal_checkpoint_info", "--ds-tp-rules"),
    "pipe-z0": (["layer_00-model_states.pt", "layer_02-model_states.pt", "mp_rank_01_model_states.pt"],
                "layer_00-model_states.pt", "a pipeline-parallel save (PipelineModule layer files, 3 of them)",
                "ds_to_universal.py"),
    "pipetp-z1": (["layer_00-model_01-model_states.pt", "mp_rank_03_model_states.pt"],
                  "mp_rank_00_model_states.pt", "a pipeline-parallel save with tensor parallelism inside the stages "
                  "(2 stages x 2 tensor-parallel ranks, mp_rank_*) without universal_checkpoint_info", "--ds-tp-rules"),
}
#: Every command that takes a checkpoint to read, with its arguments (OUT: the output path).
COMMANDS = {
    "inspect": ["inspect", "SRC"],
    "inspect-json": ["inspect", "--json", "SRC"],
    "to-universal": ["to-universal", "SRC", "OUT"],
    "export-hf": ["export-hf", "SRC", "OUT"],
    "from-universal": ["from-universal", "SRC", "OUT", "--mesh", "dp2"],
    "export-ds": ["export-ds", "SRC", "OUT"],
    "diff": ["diff", "SRC", "SRC"],
}


def _argv(command: str, src: Path, out: Path) -> list[str]:
    return [str(src) if a == "SRC" else str(out) if a == "OUT" else a for a in COMMANDS[command]]


def assert_refused(code: int, stdout: str, stderr: str, path: Path, what: str, hint: str) -> None:
    """Exit 2, nothing on stdout, one stderr line naming ``path`` (the file), ``what``, that it is
    not supported, and ``hint`` (what to do); no traceback."""
    lines = stderr.strip().splitlines()
    assert code == 2, (code, stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    line = lines[0]
    assert line.startswith(f"ckptconv: error: {path}: "), line
    assert what in line and "not supported yet" in line and hint in line, line
    assert not stdout.strip(), stdout


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_refused_as_deepspeed_saves_it(layout: str, command: str, tmp_path: Path) -> None:
    """DeepSpeed's own save of the layout (the folder with ``latest``, and the tag folder): the
    command exits 2 with the one line, and leaves nothing where its output would go."""
    files, named, what, hint = LAYOUTS[layout]
    src = saved_layout(layout)
    assert set(files) <= {p.name for p in (src / TAG).iterdir()}  # the layout is DeepSpeed's
    for given in (src, src / TAG):
        out = tmp_path / "out"
        assert_refused(*run_cli(*_argv(command, given, out)), src / TAG / named, what, hint)
        assert list(tmp_path.iterdir()) == []  # no output, no temp or journal beside it


@pytest.mark.slow
def test_refusal_is_one_line_in_a_real_process_and_a_traceback_with_debug(tmp_path: Path) -> None:
    """Through ``python -m converter`` (the installed entry point): the same one line and exit 2;
    ``--debug`` shows the traceback of the UnsupportedError instead."""
    _, named, what, hint = LAYOUTS["tp-z1"]
    src = saved_layout("tp-z1")
    argv = [sys.executable, "-m", "converter", "to-universal", str(src), str(tmp_path / "out")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert_refused(proc.returncode, proc.stdout, proc.stderr, src / TAG / named, what, hint)
    proc = subprocess.run([*argv[:3], "--debug", *argv[3:]], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "UnsupportedError" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def _add_expert_file(tag: Path) -> str:
    """An expert file as ``DeepSpeedEngine._save_moe_checkpoint`` writes it: ``torch.save`` of the
    expert's parameters (``deepspeed_moe.experts.deepspeed_experts.<e>.*`` keys) at
    ``_get_expert_ckpt_name``: ``layer_<moe layer>_expert_<global expert>_mp_rank_<mp>_model_states.pt``."""
    expert = {f"moe.deepspeed_moe.experts.deepspeed_experts.1.{k}": v for k, v in torch.nn.Linear(4, 4).state_dict().items()}
    torch.save(expert, tag / "layer_0_expert_1_mp_rank_00_model_states.pt")
    return "layer_0_expert_1_mp_rank_00_model_states.pt"


def _add_tp(tag: Path) -> tuple[str, str, str]:
    """Tensor-parallel rank 1's files as ``_get_ckpt_name`` / ``_get_zero_ckpt_name`` name them
    (mp rank 1): here copies of rank 0's (only the names decide the refusal)."""
    for p in sorted(tag.glob("*mp_rank_00*")):
        shutil.copy(p, tag / p.name.replace("mp_rank_00", "mp_rank_01"))
    return ("mp_rank_00_model_states.pt", "a tensor-parallel save (2 ranks mp_rank_*) without universal_checkpoint_info",
            "--ds-tp-rules")


@pytest.mark.parametrize("command", ["inspect", "to-universal", "export-hf"])
@pytest.mark.parametrize("add", [_add_tp], ids=["tp"])
def test_refused_when_added_to_a_real_zero_folder(add, command: str, tmp_path: Path) -> None:
    """A real ZeRO-2 save (3 ranks) with one layout's files added as DeepSpeed names them: the
    same one-line refusal, and no output."""
    from ds_zero_support import TAG as ZERO_TAG
    from ds_zero_support import saved

    src = tmp_path / "src"
    shutil.copytree(saved("z2-bf16-w3") / "run", src)
    for p in [src, *src.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    named, what, hint = add(src / ZERO_TAG)
    out = tmp_path / "out"
    assert_refused(*run_cli(*_argv(command, src, out)), src / ZERO_TAG / named, what, hint)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("command", ["inspect", "to-universal"])
def test_an_expert_file_added_to_a_dense_zero_folder_is_one_line(command: str, tmp_path: Path) -> None:
    """A real ZeRO-2 save (no MoE) with one expert file added: one line naming the model-states
    file, which records no MoE layers (``num_experts``); exit 2, no output."""
    from ds_zero_support import TAG as ZERO_TAG
    from ds_zero_support import saved

    src = tmp_path / "src"
    shutil.copytree(saved("z2-bf16-w3") / "run", src)
    for p in [src, *src.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    _add_expert_file(src / ZERO_TAG)
    code, out, err = run_cli(*_argv(command, src, tmp_path / "out"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err and not out.strip(), err
    assert lines[0].startswith(f"ckptconv: error: {src / ZERO_TAG / 'mp_rank_00_model_states.pt'}: "), lines[0]
    assert "records no num_experts" in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
