"""CI's guarantees about the frameworks' tests (tests/support/framework_plugin.py, .ci/install_*.sh):
under ``CKPTCONV_REQUIRE_FRAMEWORKS=1`` a skipped ``framework`` test, a skip that names a missing
framework and a module skipped for one fail; other skips and xfails stay as they are; the
framework tests' time past the budget fails the session; an install that cannot be done exits 1.

Each case runs a fresh pytest (a subprocess) on a few made-up tests with the real plugin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import frameworks

SUPPORT = Path(__file__).resolve().parents[1] / "support"
REPO = SUPPORT.parents[1]

CONFTEST = f"""
import sys
sys.path.insert(0, {str(SUPPORT)!r})
import framework_plugin

def pytest_configure(config):
    config.pluginmanager.register(framework_plugin.FrameworkPlugin(), "ckptconv-frameworks")
"""
INI = """[pytest]
markers =
    framework(*names): runs a framework's own code
xfail_strict = true
addopts = -p no:cacheprovider -rfEsxX --strict-markers
"""
TESTS = """
import pytest

@pytest.mark.framework
def test_marked_skip():
    pytest.skip("the trainer could not start")

def test_missing_framework_skip():
    pytest.skip("megatron-core is not installed (run .ci/install_megatron.sh)")

def test_other_skip():
    pytest.skip("needs a GPU")

@pytest.mark.xfail(reason="known bug")
def test_known_bug():
    assert False

@pytest.mark.framework("transformers")
def test_passes():
    pass
"""


def pytest_run(tmp_path: Path, files: dict[str, str], *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` in ``tmp_path`` holding ``files`` (plus the plugin's conftest)."""
    for name, text in {"conftest.py": CONFTEST, "pytest.ini": INI, **files}.items():
        (tmp_path / name).write_text(text)
    full = {k: v for k, v in os.environ.items() if k not in (frameworks.REQUIRE_ENV, frameworks.BUDGET_ENV)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**full, **env})


def test_skips_pass_without_the_requirement(tmp_path):
    proc = pytest_run(tmp_path, {"test_x.py": TESTS})
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 3 skipped, 1 xfailed" in proc.stdout, proc.stdout
    assert "SKIPPED [1] test_x.py:9: megatron-core is not installed" in proc.stdout  # -rs: the reasons
    assert "framework tests" in proc.stdout and "transformers" in proc.stdout


def test_framework_skips_fail_under_the_requirement(tmp_path):
    proc = pytest_run(tmp_path, {"test_x.py": TESTS}, **{frameworks.REQUIRE_ENV: "1"})
    assert proc.returncode == 1, proc.stdout
    assert "2 failed, 1 passed, 1 skipped, 1 xfailed" in proc.stdout, proc.stdout
    assert "FAILED test_x.py::test_marked_skip" in proc.stdout
    assert "FAILED test_x.py::test_missing_framework_skip" in proc.stdout
    assert "it skipped because: megatron-core is not installed" in proc.stdout
    assert "SKIPPED [1] test_x.py:12: needs a GPU" in proc.stdout


def test_a_module_skipped_for_a_framework_fails_under_the_requirement(tmp_path):
    files = {"test_m.py": "import pytest\npytest.importorskip('megatron_is_not_here')\n\ndef test_x():\n    pass\n"}
    relaxed = pytest_run(tmp_path, files)
    assert relaxed.returncode == pytest.ExitCode.NO_TESTS_COLLECTED and "1 skipped" in relaxed.stdout, relaxed.stdout
    proc = pytest_run(tmp_path, files, **{frameworks.REQUIRE_ENV: "1"})
    assert proc.returncode != 0 and "a module of framework tests may not skip" in proc.stdout, proc.stdout


def test_xfail_is_strict(tmp_path):
    proc = pytest_run(tmp_path, {"test_x.py": "import pytest\n\n@pytest.mark.xfail(reason='fixed?')\ndef test_x():\n"
                                              "    pass\n"})
    assert proc.returncode == 1 and "XPASS(strict)" in proc.stdout, proc.stdout


def test_over_the_budget_fails_under_the_requirement(tmp_path):
    files = {"test_x.py": TESTS}
    relaxed = pytest_run(tmp_path, files, "-k", "passes", **{frameworks.BUDGET_ENV: "0"})
    assert relaxed.returncode == 0 and "over the 0 s budget" in relaxed.stdout, relaxed.stdout
    proc = pytest_run(tmp_path, files, "-k", "passes", **{frameworks.BUDGET_ENV: "0", frameworks.REQUIRE_ENV: "1"})
    assert proc.returncode == 1 and "1 passed" in proc.stdout and "over the 0 s budget" in proc.stdout, proc.stdout


def test_unknown_framework_name_is_refused(tmp_path):
    files = {"test_x.py": "import pytest\n\n@pytest.mark.framework('tensorflow')\ndef test_x():\n    pass\n"}
    proc = pytest_run(tmp_path, files)
    assert proc.returncode == 4 and "unknown framework 'tensorflow'" in proc.stdout + proc.stderr


@pytest.mark.parametrize("script,var", [("install_megatron.sh", "CKPTCONV_MEGATRON_VERSION"),
                                        ("install_titan.sh", "CKPTCONV_TITAN_VERSION"),
                                        ("install_deepspeed.sh", "CKPTCONV_DEEPSPEED_VERSION")])
def test_an_install_that_cannot_be_done_fails_under_the_requirement(script, var, tmp_path):
    """The scripts with pip pointed at an index that does not exist (no network needed): exit 0 and
    a reason (the tests then skip), or exit 1 under the requirement. torch must import first."""
    env = {**os.environ, var: "0.0.0", "PIP_INDEX_URL": (tmp_path / "no-index").as_uri(), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": ""}
    env.pop(frameworks.REQUIRE_ENV, None)
    cmd = ["bash", str(REPO / ".ci" / script)]
    relaxed = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert relaxed.returncode == 0 and "tests will skip" in relaxed.stderr, relaxed.stderr
    strict = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**env, frameworks.REQUIRE_ENV: "1"})
    assert strict.returncode == 1 and "fails the run" in strict.stderr, strict.stderr
