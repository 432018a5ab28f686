"""Issue 18.10: README's first screen, its commands copy-pasteable, and the claims a newcomer
checked (``--spool-dir`` vs streaming, one-line errors) true of the code."""

from __future__ import annotations

import re
import shlex

from test_cli_readable import REPO, ckptconv

README = (REPO / "README.md").read_text()


def test_first_screen_is_the_resume_example():
    first = "\n".join(README.splitlines()[:40])
    for needle in ("4 GPUs with FSDP", "TP2 x DP2", "ckptconv to-universal ckpt/step-1000 uni/",
                   "ckptconv from-universal uni/ --mesh tp2,dp2 ckpt-tp2dp2/", "(--plan auto)", "dcp.load(",
                   "ckptconv demo", "python -m pytest -q"):
        assert needle in first, needle
    test_cmd = next(i for i, ln in enumerate(first.splitlines()) if ln.startswith("python -m pip install -q -e '.[test]'"))
    assert re.search(r"about \d+ minutes", first.splitlines()[test_cmd - 1]), "the test command says how long it takes"


def test_regex_examples_copy_paste(tmp_path):
    patterns = re.findall(r"'(re:[^']*)'", README)
    assert len(patterns) >= 3
    for p in patterns:
        assert "\\|" not in p, f"{p!r}: a markdown-escaped pipe is a literal pipe once pasted"
        re.compile(p[3:])
    lines = [ln.split("  #")[0] for ln in README.splitlines() if ln.startswith("ckptconv inspect converter/demo_data")]
    assert lines, "README shows a runnable inspect command on the bundled demo"
    for ln in lines:  # run exactly what a newcomer pastes (ckptconv -> python -m converter)
        argv = shlex.split(ln)
        proc = ckptconv(*argv[1:])
        assert proc.returncode == 0, (ln, proc.stderr)
        assert "attention.wq.weight" in proc.stdout and "attention.wk.weight" in proc.stdout
        assert "attention.wv.weight" not in proc.stdout


def test_spool_dir_help_matches_readme():
    proc = ckptconv("to-universal", "--help", columns=200)
    text = " ".join(proc.stdout.split())
    assert "Universal outputs stream through it" in text and "DCP and HF outputs need room for the whole output" in text
    assert "**Universal outputs** (`to-universal`, `import-hf`) stream" in README


def test_errors_line_claim():
    assert "usage errors (a missing argument, an unknown option, a typo in a command) included" in README
    for args in (["to-universal"], ["to-universal", "a", "b", "--no-such"], ["to-univrsal"]):
        proc = ckptconv(*args)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("ckptconv: error: ")
