"""Issue 18.9: ``python -m ckptconv`` is the ``ckptconv`` command, and shell completion works
as README documents it (click's ``_CKPTCONV_COMPLETE``)."""

from __future__ import annotations

import tomllib

import pytest

from converter.tools.demo import demo_checkpoint
from test_cli_readable import REPO, ckptconv


def test_python_m_ckptconv_runs_the_cli():
    proc = ckptconv("--version", module="ckptconv")
    assert proc.returncode == 0 and "ckptconv, version" in proc.stdout, proc.stderr
    proc = ckptconv("inspect", str(demo_checkpoint()), "--layout", "model.norm.weight", module="ckptconv")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("model.norm.weight  bfloat16  (32,)  2 chunks")


def test_python_m_ckptconv_errors_like_the_script(tmp_path):
    proc = ckptconv("inspect", str(tmp_path / "nope"), module="ckptconv")
    assert proc.returncode == 2 and proc.stderr.startswith("ckptconv: error: ") and len(proc.stderr.splitlines()) == 1


def test_ckptconv_package_is_installed_and_exports_the_api():
    import ckptconv
    import converter

    assert ckptconv.to_universal is converter.to_universal and ckptconv.__version__ == converter.__version__
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "ckptconv*" in project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert project["project"]["scripts"]["ckptconv"] == "converter.cli:main"


@pytest.mark.parametrize("shell,needle", [("bash", "complete -o nosort -F"), ("zsh", "compdef"), ("fish", "complete")])
def test_completion_script(shell, needle, monkeypatch):
    monkeypatch.setenv("_CKPTCONV_COMPLETE", f"{shell}_source")
    proc = ckptconv(module="ckptconv")
    assert proc.returncode == 0 and needle in proc.stdout and "_CKPTCONV_COMPLETE" in proc.stdout, proc


def test_completion_answers_commands_and_options(monkeypatch):
    monkeypatch.setenv("_CKPTCONV_COMPLETE", "bash_complete")
    monkeypatch.setenv("COMP_WORDS", "ckptconv from-universal --me")
    monkeypatch.setenv("COMP_CWORD", "2")
    proc = ckptconv()
    assert proc.returncode == 0 and "plain,--mesh" in proc.stdout.splitlines(), proc
    monkeypatch.setenv("COMP_WORDS", "ckptconv ex")
    monkeypatch.setenv("COMP_CWORD", "1")
    assert ckptconv().stdout.split() == ["plain,export-ds", "plain,export-hf"]


def test_readme_documents_completion_and_python_m():
    readme = (REPO / "README.md").read_text()
    assert "python -m ckptconv" in readme
    for shell in ("bash", "zsh", "fish"):
        assert f"_CKPTCONV_COMPLETE={shell}_source ckptconv" in readme
