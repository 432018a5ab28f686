"""Bad input: one line naming the path and the fix, non-zero exit, no traceback, SRC untouched."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cli_runner import run_cli as run_in_process


def run_subprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "converter", *args], capture_output=True, text=True, timeout=300)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """Run ``ckptconv ARGS`` in this process through the real entry point (exit status, streams)."""
    return subprocess.CompletedProcess(args, *run_in_process(*args))


def snapshot(path: Path) -> dict:
    return {p.relative_to(path): (p.stat().st_size, p.read_bytes()) for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture()
def small_ckpt(tmp_path) -> Path:
    src = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.arange(64, dtype=torch.float32).view(8, 8), "b": torch.ones(3)},
              "extra": {"step": 3}}, checkpoint_id=str(src))
    return src


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckptconv: error: ") and "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_path(tmp_path):
    assert_one_line_error(run_cli("to-universal", str(tmp_path / "nope"), str(tmp_path / "u")), "nope", "check the path")


def test_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run_cli("inspect", str(tmp_path / "empty")), "empty")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("hello")
    assert_one_line_error(run_cli("to-universal", str(tmp_path / "d"), str(tmp_path / "u")), "not a checkpoint")


def test_truncated_distcp(small_ckpt, tmp_path):
    f = next(small_ckpt.glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:-200])
    before = snapshot(small_ckpt)
    assert_one_line_error(run_cli("to-universal", str(small_ckpt), str(tmp_path / "u")), f.name)
    assert snapshot(small_ckpt) == before
    assert not (tmp_path / "u" / "ckptconv.json").exists()


def test_missing_distcp(small_ckpt, tmp_path):
    f = next(small_ckpt.glob("*.distcp"))
    f.unlink()
    assert_one_line_error(run_cli("to-universal", str(small_ckpt), str(tmp_path / "u")), f.name)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupted_metadata(small_ckpt, tmp_path, damage):
    meta = small_ckpt / ".metadata"
    data = meta.read_bytes()
    meta.write_bytes(os.urandom(300) if damage == "garbage" else data[: len(data) // 2])
    assert_one_line_error(run_cli("inspect", str(small_ckpt)), ".metadata")


def test_malicious_pickle_is_never_executed(small_ckpt, tmp_path):
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (small_ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    proc = run_cli("to-universal", str(small_ckpt), str(tmp_path / "u"))
    assert_one_line_error(proc, "system")
    assert not marker.exists()


def test_non_empty_destination(small_ckpt, tmp_path):
    dst = tmp_path / "u"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    assert_one_line_error(run_cli("to-universal", str(small_ckpt), str(dst)), "--overwrite")
    assert (dst / "precious.txt").read_text() == "keep me"


def test_destination_inside_source(small_ckpt):
    before = snapshot(small_ckpt)
    assert_one_line_error(run_cli("to-universal", str(small_ckpt), str(small_ckpt / "uni")), "inside the source")
    assert snapshot(small_ckpt) == before


def test_debug_shows_traceback(tmp_path):
    proc = run_subprocess("--debug", "inspect", str(tmp_path / "nope"))
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_happy_path_and_overwrite(small_ckpt, tmp_path):
    dst = tmp_path / "u"
    proc = run_subprocess("to-universal", str(small_ckpt), str(dst))
    assert proc.returncode == 0, proc.stderr
    assert (dst / "ckptconv.json").is_file()
    proc = run_subprocess("inspect", str(tmp_path / "nope"))
    assert proc.returncode == 2 and proc.stderr.startswith("ckptconv: error:") and "Traceback" not in proc.stderr
    assert run_cli("to-universal", str(small_ckpt), str(dst)).returncode == 2
    proc = run_cli("to-universal", "--overwrite", str(small_ckpt), str(dst))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("inspect", "--json", str(dst))
    assert proc.returncode == 0 and '"format": "universal"' in proc.stdout


def test_api_names_are_the_functions():
    """Submodules that share an API name (verify, diff) never shadow the functions."""
    import converter.tools.diff  # noqa: F401
    import converter.tools.verify  # noqa: F401
    import converter

    for name in ("to_universal", "from_universal", "export_hf", "import_hf", "verify", "diff"):
        assert callable(getattr(converter, name)), name


def test_more_source_files_than_the_soft_open_file_limit(tmp_path):
    """A 100-file DCP read with a soft limit of 40 open files (the usual 1,024 is below a 1,024-rank
    checkpoint's file count): the CLI raises its soft limit to the hard one and converts."""
    import resource

    src = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.arange(800, dtype=torch.float32).view(200, 4)}}, checkpoint_id=str(src))
    wide = tmp_path / "dp100"
    assert run_subprocess("from-universal", str(src), str(wide), "--mesh", "dp100").returncode == 0
    assert len(list(wide.glob("*.distcp"))) == 100

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = subprocess.run([sys.executable, "-m", "converter", "to-universal", str(wide), str(tmp_path / "uni")],
                          capture_output=True, text=True, timeout=300, preexec_fn=low_soft_limit)
    assert proc.returncode == 0, proc.stderr
    from formats.universal_dcp import UniversalStorageReader

    out = {"model": {"w": torch.zeros(200, 4)}}
    dcp.load(out, storage_reader=UniversalStorageReader(str(tmp_path / "uni")))
    assert torch.equal(out["model"]["w"], torch.arange(800, dtype=torch.float32).view(200, 4))
