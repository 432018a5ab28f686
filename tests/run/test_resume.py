"""Interrupted conversions: SIGKILL at many points, refuse without --resume, resume bit-identical;
``--resume`` is idempotent, so a shell retry loop (``until ckptconv ... --resume; do :; done``)
killed at random points (before the destination exists, mid-copy, after the marker) ends with
the uninterrupted run's output.

Every command that copies is interrupted mid-copy (to-universal, from-universal, export-hf,
import-hf, import-ds, export-ds) and compared file for file with an uninterrupted run, its
metadata included; the only field allowed to differ is ``ckptconv.json``'s ``created`` (the time
of the commit).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

_MAKE = """
import sys, torch, torch.distributed.checkpoint as dcp
g = torch.Generator().manual_seed(0)
sd = {"model": {f"layers.{i}.w": torch.randn(256 * (i + 1), 1024, generator=g) for i in range(6)},
      "optim": {"state": {"layers.0.w": {"step": torch.tensor(3.0)}}}, "extra": {"epoch": 2, "name": "x"}}
sd["model"]["half"] = torch.randn(1000, 300, generator=g).to(torch.bfloat16)
dcp.save(sd, checkpoint_id=sys.argv[1])
"""


def ckptconv(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "CKPTCONV_JOURNAL_FLUSH_SECONDS": "0", **(env or {})}
    return subprocess.run([sys.executable, "-m", "converter", *args], capture_output=True, text=True,
                          timeout=300, env=full_env)


def tree_bytes(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in skip}


def universal_without_timestamp(root: Path) -> dict[str, bytes]:
    files = tree_bytes(root, skip=("ckptconv.json",))
    doc = json.loads((root / "ckptconv.json").read_text())
    doc.pop("created")
    files["ckptconv.json"] = json.dumps(doc, sort_keys=True).encode()
    return files


def dcp_without_save_id(root: Path) -> dict[str, bytes]:
    files = tree_bytes(root, skip=(".metadata",))
    md = pickle.loads((root / ".metadata").read_bytes())  # our own output, in a test
    files[".metadata"] = repr((md.state_dict_metadata, md.planner_data, sorted(md.storage_data.items(), key=repr))).encode()
    return files


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("resume") / "ckpt"
    subprocess.run([sys.executable, "-c", _MAKE, str(path)], check=True, timeout=300)
    return path


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("reference")
    uni, out = root / "uni", root / "out"
    assert ckptconv("to-universal", "--chunk-size", "256KiB", str(source), str(uni)).returncode == 0
    assert ckptconv("from-universal", "--memory-budget", "2MiB", "--mesh", "tp2,dp3", str(uni), str(out)).returncode == 0
    return uni, out


TOTAL = 21 * 256 * 1024 * 4 + 1000 * 300 * 2  # tensor bytes of the source
SLOW = pytest.mark.slow
#: Six kill points per conversion; a representative few run in the default suite, all with -m slow.
TO_UNIVERSAL_POINTS = [1, pytest.param(TOTAL // 7, marks=SLOW), pytest.param(TOTAL // 3, marks=SLOW), TOTAL // 2,
                       pytest.param((4 * TOTAL) // 5, marks=SLOW), TOTAL]
FROM_UNIVERSAL_POINTS = [pytest.param(1, marks=SLOW), pytest.param(TOTAL // 7, marks=SLOW), TOTAL // 3,
                         pytest.param(TOTAL // 2, marks=SLOW), pytest.param((4 * TOTAL) // 5, marks=SLOW), TOTAL]


@pytest.mark.parametrize("kill_after", TO_UNIVERSAL_POINTS)
def test_to_universal_resumes_bit_identical(source, reference, tmp_path, kill_after):
    dst = tmp_path / "uni"
    args = ("to-universal", "--chunk-size", "256KiB", str(source), str(dst))
    killed = ckptconv(*args, env={"CKPTCONV_FAULT_KILL_AFTER_BYTES": str(kill_after)})
    assert killed.returncode == -9
    assert not (dst / "ckptconv.json").exists()
    refused = ckptconv(*args)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    second_kill = ckptconv(*args, "--resume", env={"CKPTCONV_FAULT_KILL_AFTER_BYTES": str(TOTAL // 4)})
    assert second_kill.returncode in (0, -9)
    if second_kill.returncode == -9:
        done = ckptconv(*args, "--resume")
        assert done.returncode == 0, done.stderr
    again = ckptconv(*args, "--resume")  # the same conversion is complete: nothing to do, say so
    assert again.returncode == 0 and "already complete" in again.stdout, again.stderr
    assert universal_without_timestamp(dst) == universal_without_timestamp(reference[0])


@pytest.mark.parametrize("kill_after", FROM_UNIVERSAL_POINTS)
def test_from_universal_resumes_bit_identical(reference, tmp_path, kill_after):
    dst = tmp_path / "out"
    args = ("from-universal", "--memory-budget", "2MiB", "--mesh", "tp2,dp3", str(reference[0]), str(dst))
    killed = ckptconv(*args, env={"CKPTCONV_FAULT_KILL_AFTER_BYTES": str(kill_after)})
    assert killed.returncode == -9
    assert not (dst / ".metadata").exists()
    refused = ckptconv(*args)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    done = ckptconv(*args, "--resume")
    assert done.returncode == 0, done.stderr
    assert dcp_without_save_id(dst) == dcp_without_save_id(reference[1])


def test_resume_refuses_another_conversion(source, reference, tmp_path):
    dst = tmp_path / "uni"
    args = ("to-universal", "--chunk-size", "256KiB", str(source), str(dst))
    assert ckptconv(*args, env={"CKPTCONV_FAULT_KILL_AFTER_BYTES": str(TOTAL // 2)}).returncode == -9
    other = ckptconv("to-universal", "--chunk-size", "512KiB", "--resume", str(source), str(dst))
    assert other.returncode == 2 and "different conversion" in other.stderr
    assert ckptconv("to-universal", "--resume", "--overwrite", str(source), str(dst)).returncode == 2


@pytest.mark.parametrize("kill_after", [TOTAL // 3, pytest.param(1, marks=SLOW), pytest.param(TOTAL // 7, marks=SLOW),
                                        pytest.param(TOTAL // 2, marks=SLOW), pytest.param(TOTAL, marks=SLOW)])
def test_export_hf_resumes_bit_identical(reference, tmp_path, kill_after):
    ref, dst = tmp_path / "ref", tmp_path / "hf"
    base = ("export-hf", "--memory-budget", "2MiB", "--max-shard-size", "3MB", str(reference[0]))
    assert ckptconv(*base, str(ref)).returncode == 0
    killed = ckptconv(*base, str(dst), env={"CKPTCONV_FAULT_KILL_AFTER_BYTES": str(kill_after)})
    assert killed.returncode == -9
    assert not (dst / "model.safetensors.index.json").exists()
    refused = ckptconv(*base, str(dst))
    assert refused.returncode == 2 and "--resume" in refused.stderr
    done = ckptconv(*base, str(dst), "--resume")
    assert done.returncode == 0, done.stderr
    assert tree_bytes(dst) == tree_bytes(ref)


def kill_points(seed: int, attempts: int) -> list[str]:
    """The env assignment that kills each attempt of a retry loop: first ``planned`` (the
    destination does not exist yet), then ``prepared`` and byte counts whose sum stays below the
    conversion's bytes (so every attempt is killed where it says) in a random order, then
    ``committed`` (after the marker); the last attempt is not killed (it finds the output complete)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, TOTAL), attempts - 3))
    middle = ["CKPTCONV_FAULT_KILL_AT=prepared", *(f"CKPTCONV_FAULT_KILL_AFTER_BYTES={b - a}"
                                                  for a, b in zip([0, *cuts], cuts))]
    rng.shuffle(middle)
    return ["CKPTCONV_FAULT_KILL_AT=planned", *middle, "CKPTCONV_FAULT_KILL_AT=committed", "CKPTCONV_FAULT_KILL_AT="]


def retry_loop(args: tuple[str, ...], points: list[str]) -> subprocess.CompletedProcess:
    """``until ckptconv ARGS --resume; do ...; done`` in bash, attempt i killed at ``points[i]``;
    it fails (exit 99) when an attempt exits other than by that SIGKILL (137) or 0."""
    cmd = " ".join(map(shlex.quote, [sys.executable, "-m", "converter", *args, "--resume"]))
    script = f"""
points=({" ".join(map(shlex.quote, points))}); i=0
until env "${{points[$i]}}" {cmd}; do
  rc=$?; [ $rc -eq 137 ] || {{ echo "attempt $i exited $rc" >&2; exit 99; }}
  i=$((i+1)); [ $i -lt ${{#points[@]}} ] || exit 98
done
echo "attempts $((i+1))"
"""
    env = {**os.environ, "CKPTCONV_JOURNAL_FLUSH_SECONDS": "0"}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=SLOW), pytest.param(2, marks=SLOW)])
def test_a_retry_loop_killed_at_random_points_ends_bit_identical(source, reference, tmp_path, seed):
    """The issue's loop: a preemption before the destination exists, mid-copy or after the
    marker never makes --resume fail; the loop ends with the uninterrupted run's output, and one
    more --resume says it is already complete."""
    uni, out = tmp_path / "uni", tmp_path / "out"
    to_args = ("to-universal", "--chunk-size", "256KiB", str(source), str(uni))
    from_args = ("from-universal", "--memory-budget", "2MiB", "--mesh", "tp2,dp3", str(reference[0]), str(out))
    for args, attempts in ((to_args, 5), (from_args, 6)):
        points = kill_points(seed, attempts)
        loop = retry_loop(args, points)
        assert loop.returncode == 0, loop.stderr
        assert loop.stdout.strip().endswith(f"attempts {len(points)}")  # each kill point hit once
        assert "already complete" in loop.stdout  # the attempt after the kill past the marker
        again = ckptconv(*args, "--resume")
        assert again.returncode == 0 and "already complete" in again.stdout, again.stderr
    assert universal_without_timestamp(uni) == universal_without_timestamp(reference[0])
    assert dcp_without_save_id(out) == dcp_without_save_id(reference[1])
    assert not list(uni.glob(".ckptconv-journal*")) and not list(out.glob(".ckptconv-journal*"))


@pytest.mark.slow
def test_a_retry_loop_killed_at_random_times_ends_bit_identical(source, reference, tmp_path):
    """SIGKILL after a random delay (start-up, planning, mid-copy, commit, or not at all), as a
    preemption would: every attempt is --resume; the last one finishes, bit-identical."""
    rng = random.Random(7)
    out = tmp_path / "out"
    args = ("from-universal", "--memory-budget", "2MiB", "--mesh", "tp2,dp3", str(reference[0]), str(out))
    env = {**os.environ, "CKPTCONV_JOURNAL_FLUSH_SECONDS": "0", "CKPTCONV_FAULT_SLOW_PIECE_SECONDS": "0.02"}
    codes = []
    for _ in range(12):
        proc = subprocess.Popen([sys.executable, "-m", "converter", *args, "--resume"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        try:
            stdout, stderr = proc.communicate(timeout=rng.uniform(0.2, 6.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        codes.append(proc.returncode)
        assert proc.returncode in (0, -9), stderr
        if proc.returncode == 0:
            break
    else:
        done = ckptconv(*args, "--resume")
        assert done.returncode == 0, done.stderr
    assert dcp_without_save_id(out) == dcp_without_save_id(reference[1])


# ---------------------------------------------------------------------------------------------
# interrupted mid-copy (SIGKILL after N bytes written: CKPTCONV_FAULT_KILL_AFTER_BYTES), resumed, and
# compared with an uninterrupted run file for file: every byte, ckptconv.json included, less its
# one volatile field ("created", the commit's time; universal_without_timestamp)


#: A small source's tasks finish faster than the executor journals them: slowed pieces (a wait per
#: piece) let the journal record tasks before the kill, so the resume has work to adopt (without
#: them import-hf's kill at a third came before any task was journaled on a quiet machine: CI).
SLOW_PIECES = {"CKPTCONV_FAULT_SLOW_PIECE_SECONDS": "0.05"}


def _killed_then_resumed(args: tuple[str, ...], dst: Path, marker: str, kill_after: int, env: dict | None = None) -> None:
    """Run ``args`` killed after ``kill_after`` written bytes (mid-copy: tasks written and
    journaled, nothing published; at the first byte, ``kill_after=1``: only the journal's header),
    check a plain rerun is refused, then finish it with ``--resume``."""
    killed = ckptconv(*args, env={"CKPTCONV_FAULT_KILL_AFTER_BYTES": str(kill_after), **(env or {})})
    assert killed.returncode == -9, killed.stderr
    assert not (dst / marker).exists()
    journaled = (dst / ".ckptconv-journal.jsonl").read_text().splitlines()
    if kill_after > 1:
        assert len(journaled) >= 2, "no task journaled before the kill: the resume would adopt nothing"  # header + tasks
    else:
        assert len(journaled) == 1 and journaled[0].startswith('{"header"'), journaled[:2]
    refused = ckptconv(*args)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    done = ckptconv(*args, "--resume")
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def hf_source(reference, tmp_path_factory) -> tuple[Path, Path]:
    """The source as HF shards (export-hf of its store) and import-hf's uninterrupted store of it."""
    root = tmp_path_factory.mktemp("hf-resume")
    hf, ref = root / "hf", root / "ref"
    assert ckptconv("export-hf", "--max-shard-size", "3MB", str(reference[0]), str(hf)).returncode == 0
    assert ckptconv("import-hf", "--chunk-size", "256KiB", str(hf), str(ref)).returncode == 0
    return hf, ref


MODEL_BYTES = TOTAL  # export-hf takes every model tensor: all of the source's tensor bytes but the 0-d step


@pytest.mark.parametrize("kill_after", [MODEL_BYTES // 3, pytest.param(1, marks=SLOW),
                                        pytest.param((4 * MODEL_BYTES) // 5, marks=SLOW)])
def test_import_hf_resumes_mid_copy_bit_identical(hf_source, tmp_path, kill_after):
    hf, ref = hf_source
    dst = tmp_path / "uni"
    _killed_then_resumed(("import-hf", "--chunk-size", "256KiB", str(hf), str(dst)), dst, "ckptconv.json", kill_after,
                         SLOW_PIECES)
    assert universal_without_timestamp(dst) == universal_without_timestamp(ref)


def _ds_fixture() -> Path:
    from ds_support import universal_of

    return universal_of(2)


@pytest.fixture(scope="module")
def ds_reference(tmp_path_factory) -> tuple[Path, Path, int]:
    """import-ds's store of the checked-in ZeRO-2 universal checkpoint (4 KiB chunks: many tasks),
    export-ds's checkpoint of that store, and the store's tensor bytes."""
    root = tmp_path_factory.mktemp("ds-resume")
    uni, out = root / "uni", root / "ds"
    assert ckptconv("import-ds", "--chunk-size", "4KiB", str(_ds_fixture()), str(uni)).returncode == 0
    assert ckptconv("export-ds", str(uni), str(out)).returncode == 0
    total = sum(p.stat().st_size for p in (uni / "tensors").rglob("*") if p.is_file() and p.name != "zarr.json")
    return uni, out, total  # (chunk files: the tensor bytes, edge chunks padded)


@pytest.mark.parametrize("fraction", [3, pytest.param(7, marks=SLOW)])
def test_import_ds_resumes_mid_copy_bit_identical(ds_reference, tmp_path, fraction):
    uni, _, total = ds_reference
    dst = tmp_path / "uni"
    _killed_then_resumed(("import-ds", "--chunk-size", "4KiB", str(_ds_fixture()), str(dst)), dst, "ckptconv.json",
                         total // fraction, SLOW_PIECES)
    assert universal_without_timestamp(dst) == universal_without_timestamp(uni)


@pytest.mark.parametrize("fraction", [2, pytest.param(5, marks=SLOW)])
def test_export_ds_resumes_mid_copy_bit_identical(ds_reference, tmp_path, fraction):
    """Every file byte-equal to the uninterrupted export (export-ds writes no timestamp)."""
    uni, ref, total = ds_reference
    dst = tmp_path / "ds"
    _killed_then_resumed(("export-ds", str(uni), str(dst)), dst, "latest_universal", total // fraction, SLOW_PIECES)
    assert tree_bytes(dst) == tree_bytes(ref)
