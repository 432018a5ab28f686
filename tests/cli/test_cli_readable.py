"""Issue 18.4: every human output is readable at 80 columns and when piped (keys never cut or
folded), one size unit style, one-line usage errors, zero workers / budget refused, --layout globs.

Runs the real ``python -m converter`` in a subprocess with stdout piped and ``COLUMNS`` set, on
the bundled demo (a tiny Llama saved by a real 2-rank FSDP2 job)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from converter.tools.demo import demo_checkpoint
from converter.run.sources import open_checkpoint

REPO = Path(__file__).resolve().parents[2]


def ckptconv(*args: str, columns: int | None = 80, module: str = "converter") -> subprocess.CompletedProcess:
    """``python -m converter ARGS`` with stdout/stderr piped (not a terminal) and COLUMNS set."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          timeout=300, stdin=subprocess.DEVNULL)


def ckptconv_here(*args: str) -> subprocess.CompletedProcess:
    """``ckptconv ARGS`` in this process through the real entry point (cheaper for error matrices)."""
    from cli_runner import run_cli

    return subprocess.CompletedProcess(args, *run_cli(*args))


@pytest.fixture(scope="module")
def demo() -> Path:
    return demo_checkpoint()


@pytest.fixture(scope="module")
def demo_keys(demo) -> tuple[list[str], list[str]]:
    index = open_checkpoint(demo).index()
    return sorted(index.tensors), sorted(index.objects)


def assert_keys_whole(text: str, keys: list[str]) -> None:
    """Every key appears whole, delimited (not as a prefix of a folded cell), and nothing was cut."""
    assert "…" not in text, text
    for key in keys:
        assert re.search(rf"(^|[\s│|]){re.escape(key)}($|[\s│|])", text, re.M), f"{key!r} not whole in:\n{text}"


@pytest.mark.parametrize("columns", [80, None, 60])
def test_inspect_keys_never_cut(demo, demo_keys, columns):
    proc = ckptconv("inspect", str(demo), columns=columns)
    assert proc.returncode == 0, proc.stderr
    tensors, objects = demo_keys
    assert_keys_whole(proc.stdout, tensors + objects)
    # wq, wk, wv of the same layer stay distinguishable
    for w in ("wq", "wk", "wv"):
        assert f"model.layers.0.attention.{w}.weight" in proc.stdout.splitlines()
    width = columns or 80
    long_keys = {k for k in tensors + objects if len(k) > width - 4}
    for line in proc.stdout.splitlines():  # only a whole key (or a 60-char preview) may run past the width
        assert len(line) <= width or line.strip() in long_keys or line.lstrip().startswith("preview "), line


def test_inspect_wide_terminal_is_a_table(demo, demo_keys):
    proc = ckptconv("inspect", str(demo), columns=200)
    assert proc.returncode == 0, proc.stderr
    assert_keys_whole(proc.stdout, demo_keys[0])
    row = next(ln for ln in proc.stdout.splitlines() if "model.layers.0.attention.wq.weight" in ln)
    assert "bfloat16" in row and "KiB" in row  # one row per key, sizes in binary units


def test_inspect_stats_80_columns(demo):
    proc = ckptconv("inspect", str(demo), "--stats", "model.layers.0.attention.w*")
    assert proc.returncode == 0, proc.stderr
    keys = [f"model.layers.0.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")]
    assert_keys_whole(proc.stdout, keys)
    assert "bfloat16" in proc.stdout and "bfl…" not in proc.stdout
    assert re.search(r"\bmin -?\d", proc.stdout) and re.search(r"\bstd \d", proc.stdout)  # numbers not cut
    assert all(len(ln) <= 80 or ln in keys for ln in proc.stdout.splitlines())


def test_layout_glob_and_suggestions(demo):
    proc = ckptconv("inspect", str(demo), "--layout", "model.layers.0.attention.w[qk].weight")
    assert proc.returncode == 0, proc.stderr
    heads = [ln for ln in proc.stdout.splitlines() if "  bfloat16  (" in ln]
    assert [h.split()[0] for h in heads] == ["model.layers.0.attention.wk.weight", "model.layers.0.attention.wq.weight"]
    assert "2 chunks" in heads[0]
    proc = ckptconv("inspect", str(demo), "--layout", "model.layers.0.attention.wq")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: "), proc.stderr
    assert "did you mean 'model.layers.0.attention.wq.weight'" in lines[0]


def test_one_chunk_is_singular(demo):
    proc = ckptconv("inspect", str(demo), "--layout", "optim.state.layers.0.attention.wq.weight.step")
    assert proc.returncode == 0, proc.stderr
    assert "  1 chunk  " in proc.stdout and "1 chunks" not in proc.stdout


def test_sizes_in_binary_units(demo, tmp_path):
    uni = tmp_path / "uni"
    proc = ckptconv("to-universal", str(demo), str(uni), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\d+\.\d (KiB|MiB|GiB)\b", proc.stdout) and " MB" not in proc.stdout, proc.stdout
    proc = ckptconv("from-universal", str(uni), str(tmp_path / "o"), "--mesh", "dp2", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"__0_0\.distcp  \d+ chunks  \d+\.\d KiB", proc.stdout), proc.stdout
    proc = ckptconv("verify", str(uni))
    assert "KiB checked" in proc.stdout and " MB" not in proc.stdout


@pytest.mark.parametrize("args", [
    ["inspect"],
    ["inspect", "{demo}", "--bogus"],
    ["frobnicate"],
    ["from-universal", "{demo}", "{tmp}/o"],
    ["to-universal", "{demo}", "{tmp}/u", "--workers", "abc"],
    ["to-universal", "{demo}", "{tmp}/u", "--memory-budget", "lots"],
    ["diff", "{demo}"],
    ["inspect", "{demo}", "--stats"],
])
def test_usage_errors_are_one_line(demo, tmp_path, args):
    proc = ckptconv_here(*[a.format(demo=demo, tmp=tmp_path) for a in args])
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckptconv: error: ") and "--help'" in lines[0] and "Usage:" not in proc.stderr
    assert not (tmp_path / "u").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("args", [
    ["to-universal", "{demo}", "{tmp}/u", "--workers", "0"],
    ["to-universal", "{demo}", "{tmp}/u", "--memory-budget", "0"],
    ["to-universal", "{demo}", "{tmp}/u", "--chunk-size", "0"],
    ["export-hf", "{demo}", "{tmp}/u", "--max-shard-size", "0B"],
    ["from-universal", "{demo}", "{tmp}/u", "--mesh", "dp2", "--workers", "0"],
    ["from-universal", "{demo}", "{tmp}/u", "--mesh", "dp2", "--memory-budget", "0"],
    ["export-hf", "{demo}", "{tmp}/u", "--workers", "0"],
    ["verify", "{demo}", "--workers", "0"],
    ["diff", "{demo}", "{demo}", "--workers", "0"],
])
def test_zero_workers_and_budget_refused(demo, tmp_path, args):
    proc = ckptconv_here(*[a.format(demo=demo, tmp=tmp_path) for a in args])
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: "), proc.stderr
    assert args[-2] in lines[0] and ("at least" in lines[0] or "must be positive" in lines[0]), lines[0]
    assert not (tmp_path / "u").exists()


def test_demo_piped_is_readable(tmp_path):
    proc = ckptconv("demo", "--workdir", str(tmp_path / "work"))
    assert proc.returncode == 0, proc.stderr
    assert "UserWarning" not in proc.stderr + proc.stdout and "torch.distributed is disabled" not in proc.stderr
    assert "…" not in proc.stdout
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("== ")]
    assert len(steps) == 4 and all(str(tmp_path / "work") in s for s in steps[1:]), steps
    assert "model.layers.0.attention.wq.weight" in proc.stdout.splitlines()
