"""The destination of a conversion (converter/destination.py), on real multi-process checkpoints:

- ``--resume`` never claims work it did not do: a complete output, another source, a changed
  source or other output options are refused with one line saying what differs;
- ``--overwrite`` removes only a ckptconv output (complete or partial), never anything else and
  never through a link;
- Ctrl-C / SIGTERM stop a real ``ckptconv`` process within about a second, publish nothing, and
  ``--resume`` then finishes bit-identical to an uninterrupted run;
- a destination is locked: a second run (plain, ``--overwrite`` or ``--resume``) is refused naming
  the running one, a lock of a dead process is taken over;
- advice that fits: a stopped output read as a source says ``--resume``; a torchrun rank whose
  launcher died stops and publishes nothing.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from converter import api
from converter.config import RunOptions
from formats.errors import CkptConvError, DestinationError, IncompleteCheckpointError

MARKERS = {"to-universal": "ckptconv.json", "import-hf": "ckptconv.json", "from-universal": ".metadata",
           "export-hf": "model.safetensors.index.json"}


def ckptconv(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, "CKPTCONV_JOURNAL_FLUSH_SECONDS": "0", **(env or {})}
    return subprocess.run([sys.executable, "-m", "converter", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full)


def start(*args: str, slow: float, hold: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "CKPTCONV_JOURNAL_FLUSH_SECONDS": "0", "CKPTCONV_FAULT_SLOW_PIECE_SECONDS": str(slow),
           "CKPTCONV_FAULT_HOLD_FILE": str(hold or "")}
    return subprocess.Popen([sys.executable, "-m", "converter", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    """In the child, before it starts: SIGINT back to its default. A suite started in the
    background by a non-interactive shell (``cmd &``, ``nohup``) inherits SIGINT ignored, and
    Python keeps an ignored SIGINT ignored: Ctrl-C would then do nothing to the conversion."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_progress(dst: Path, proc: subprocess.Popen, tasks: int = 2, timeout: float = 120) -> None:
    """Until ``tasks`` tasks are journaled in ``dst`` (the run is well under way)."""
    journal = dst / ".ckptconv-journal.jsonl"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        if journal.is_file() and len(journal.read_text().splitlines()) > tasks:
            return
        time.sleep(0.05)
    raise AssertionError("the conversion made no progress")


def tree_bytes(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in skip}


def output_files(root: Path) -> dict[str, bytes]:
    """Every file of an output, less what differs between two runs (creation time, save id)."""
    files = tree_bytes(root, skip=("ckptconv.json", ".metadata"))
    if (root / "ckptconv.json").is_file():
        doc = json.loads((root / "ckptconv.json").read_text())
        doc.pop("created")
        files["ckptconv.json"] = json.dumps(doc).encode()
    if (root / ".metadata").is_file():
        md = pickle.loads((root / ".metadata").read_bytes())  # our own output, in a test
        files[".metadata"] = repr((md.state_dict_metadata, md.planner_data,
                                   sorted(md.storage_data.items(), key=repr))).encode()
    return files


@pytest.fixture(scope="module")
def work(dcp_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """Two real FSDP checkpoints (4 and 2x2 ranks), a store and an HF export of the first."""
    root = tmp_path_factory.mktemp("dest")
    src, other = dcp_checkpoint("fsdp4"), dcp_checkpoint("tp2dp2")
    api.to_universal(src, root / "uni", RunOptions(workers=2), chunk_bytes=16 << 10)
    api.export_hf(root / "uni", root / "hf", max_shard_size="100KB", options=RunOptions(workers=2))
    return {"src": src, "other": other, "uni": root / "uni", "hf": root / "hf", "root": root}


def command(op: str, work: dict, dst: Path, *extra: str) -> list[str]:
    """The CLI arguments of ``op`` into ``dst`` (a fixed set of options per operation)."""
    if op == "to-universal":
        return ["to-universal", "--chunk-size", "16KiB", *extra, work["src"], dst]
    if op == "from-universal":
        return ["from-universal", "--mesh", "dp2", "--memory-budget", "1MiB", *extra, work["uni"], dst]
    if op == "export-hf":
        return ["export-hf", "--max-shard-size", "100KB", *extra, work["uni"], dst]
    return ["import-hf", "--chunk-size", "16KiB", *extra, work["hf"], dst]


def convert(op: str, work: dict, dst: Path, options: RunOptions, src: Path | None = None, **kw):
    """The same conversions through the Python API; their result."""
    if op == "to-universal":
        return api.to_universal(src or work["src"], dst, options, chunk_bytes=kw.get("chunk_bytes", 16 << 10))
    if op == "from-universal":
        return api.from_universal(src or work["uni"], dst, kw.get("mesh", "dp2"), dtype=kw.get("dtype"), options=options)
    if op == "export-hf":
        return api.export_hf(src or work["uni"], dst, max_shard_size="100KB", dtype=kw.get("dtype"), options=options)
    return api.import_hf(src or work["hf"], dst, options=options, chunk_bytes=kw.get("chunk_bytes", 16 << 10))


def interrupted(op: str, work: dict, dst: Path, monkeypatch, **kw) -> None:
    """Leave ``dst`` as a stopped run would: data written and journaled, nothing published."""
    from formats.dcp.writer import DCPWriter
    from formats.hf import HFWriter
    from formats.universal import UniversalWriter

    monkeypatch.setenv("CKPTCONV_JOURNAL_FLUSH_SECONDS", "0")
    cls = {"from-universal": DCPWriter, "export-hf": HFWriter}.get(op, UniversalWriter)
    with monkeypatch.context() as m:
        m.setattr(cls, "commit", lambda self, *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt, match="--resume"):
            convert(op, work, dst, RunOptions(workers=2), **kw)
    assert not (dst / MARKERS[op]).exists() and (dst / ".ckptconv-journal.jsonl").is_file()
    assert not (dst / ".ckptconv-lock").exists()


OPS = ["to-universal", "from-universal", "export-hf", "import-hf"]


# ------------------------------------------------------------------------------ --resume


#: Per operation: an option that makes another conversion of the same source.
OTHER_OPTIONS = {"to-universal": {"chunk_bytes": 32 << 10}, "from-universal": {"mesh": "dp4"},
                 "export-hf": {"dtype": "bf16"}, "import-hf": {"chunk_bytes": 32 << 10}}


@pytest.mark.parametrize("op", OPS)
def test_resume_of_a_complete_output_is_done_or_refused(work, tmp_path, op):
    """--resume is idempotent: onto the complete output of the same conversion it does nothing and
    says so (exit 0); onto a complete output of another conversion (other options, another source
    for to-universal) or one without a completion record it is refused, naming what differs.
    (The first issue's reproducer: --resume onto another checkpoint's store printed "wrote ...".)"""
    dst = tmp_path / "out"
    convert(op, work, dst, RunOptions(workers=2))
    before = tree_bytes(dst)
    assert ".written-by-ckptconv.json" in before and ".ckptconv-journal.jsonl" not in before
    again = convert(op, work, dst, RunOptions(resume=True))
    assert again.already_complete and again.bytes == 0 and tree_bytes(dst) == before
    with pytest.raises(DestinationError, match="already holds a complete .*of another conversion .*it ran with "
                                               ".*nothing to resume.*--overwrite"):
        convert(op, work, dst, RunOptions(resume=True), **OTHER_OPTIONS[op])
    assert tree_bytes(dst) == before
    record = dst / ".written-by-ckptconv.json"
    record.write_text(json.dumps({"written_by": "ckptconv", "op": op, "tool": "0.1.0"}))  # as older versions wrote it
    with pytest.raises(DestinationError, match="written-by-ckptconv.json names no conversion.*nothing to resume.*--overwrite"):
        convert(op, work, dst, RunOptions(resume=True))
    if op == "to-universal":
        other = tmp_path / "other"
        api.to_universal(work["other"], other, RunOptions(workers=2))
        with pytest.raises(DestinationError, match="of another conversion .*this run converts"):
            convert(op, work, other, RunOptions(resume=True))


def test_resume_drops_the_journal_a_run_stopped_after_its_marker_left(work, tmp_path, monkeypatch):
    """Stopped between the commit and the journal's removal: the output is complete; --resume
    finds it done and drops the leftover journal."""
    from converter.run.journal import Journal

    dst = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(Journal, "remove", lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            convert("from-universal", work, dst, RunOptions(workers=2))
    assert (dst / ".metadata").is_file() and (dst / ".ckptconv-journal.jsonl").is_file()
    again = convert("from-universal", work, dst, RunOptions(resume=True))
    assert again.already_complete and not (dst / ".ckptconv-journal.jsonl").exists()


@pytest.mark.parametrize("state", ["missing", "empty", "lock only", "empty journal", "rank folders"])
def test_resume_starts_where_nothing_was_written(work, tmp_path, state):
    """A retry loop's first --resume, or one after a stop before the journal's first line: the
    conversion starts (and its output equals a plain run's)."""
    ref, dst = tmp_path / "ref", tmp_path / "out"
    convert("from-universal", work, ref, RunOptions(workers=2))
    if state != "missing":
        dst.mkdir()
    if state == "lock only":
        (dst / ".ckptconv-lock").write_text("{}")
    if state == "empty journal":
        (dst / ".ckptconv-journal.jsonl").touch()
    if state == "rank folders":
        (dst / ".ckptconv-rank-1").mkdir()
    result = convert("from-universal", work, dst, RunOptions(resume=True))
    assert not result.already_complete and result.bytes > 0
    assert output_files(dst) == output_files(ref)


def test_resume_onto_a_complete_store_cli(work, tmp_path):
    dst = tmp_path / "uni"
    assert ckptconv("to-universal", work["other"], dst).returncode == 0
    proc = ckptconv("to-universal", work["src"], dst, "--resume")
    assert proc.returncode == 2 and "wrote" not in proc.stdout
    assert proc.stderr.startswith("ckptconv: error:") and len(proc.stderr.strip().splitlines()) == 1
    assert "complete universal store" in proc.stderr and "--overwrite" in proc.stderr


@pytest.mark.parametrize("op,change,needle", [
    ("to-universal", {"src": "other"}, "this run converts"),
    ("to-universal", {"chunk_bytes": 32 << 10}, "--chunk-size 16384, this run with --chunk-size 32768"),
    ("from-universal", {"mesh": "dp4"}, "--mesh dp_shard2, this run with --mesh dp_shard4"),
    ("from-universal", {"dtype": "bfloat16"}, "no --dtype, this run with --dtype bfloat16"),
    ("export-hf", {"dtype": "bf16"}, "--dtype bfloat16"),
    ("export-hf", {"op": "from-universal"}, "it ran export-hf, this run is from-universal"),
    ("import-hf", {"chunk_bytes": 32 << 10}, "--chunk-size"),
])
def test_resume_refuses_another_conversion(work, tmp_path, monkeypatch, op, change, needle):
    dst = tmp_path / "out"
    interrupted(op, work, dst, monkeypatch)
    before = tree_bytes(dst)
    kw = {k: v for k, v in change.items() if k not in ("src", "op")}
    src = work[change["src"]] if "src" in change else None
    with pytest.raises(DestinationError) as e:
        convert(change.get("op", op), work, dst, RunOptions(resume=True), src=src, **kw)
    assert "cannot resume" in str(e.value) and needle in str(e.value) and "--overwrite" in str(e.value)
    assert tree_bytes(dst) == before
    convert(op, work, dst, RunOptions(resume=True))  # the same conversion resumes
    assert (dst / MARKERS[op]).is_file()


def test_resume_refuses_a_changed_source(dcp_checkpoint_copy, tmp_path, monkeypatch, work):
    src = dcp_checkpoint_copy("fsdp4")
    dst = tmp_path / "uni"
    interrupted("to-universal", work, dst, monkeypatch, src=src)
    data = src / "__1_0.distcp"
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # rewritten since
    with pytest.raises(DestinationError, match=r"changed since .*__1_0\.distcp"):
        convert("to-universal", work, dst, RunOptions(resume=True), src=src)


@pytest.mark.parametrize("op", ["import-hf"])
def test_import_hf_resumes_bit_identical(work, tmp_path, monkeypatch, op):
    ref, dst = tmp_path / "ref", tmp_path / "out"
    convert(op, work, ref, RunOptions(workers=2))
    interrupted(op, work, dst, monkeypatch)
    with pytest.raises(DestinationError, match="--resume"):
        convert(op, work, dst, RunOptions())
    convert(op, work, dst, RunOptions(resume=True))
    assert output_files(dst) == output_files(ref)


# ------------------------------------------------------------------------------ --overwrite


@pytest.mark.parametrize("op", OPS)
def test_overwrite_refuses_what_is_not_ckptconvs(work, tmp_path, op):
    """The issue's reproducer: `to-universal ck notckpt/ --overwrite` deleted important.txt and sub/."""
    dst = tmp_path / "notckpt"
    (dst / "sub").mkdir(parents=True)
    (dst / "important.txt").write_text("keep")
    (dst / "sub" / "x").write_text("keep")
    with pytest.raises(DestinationError, match=r"not a ckptconv output \(found important\.txt, sub/\)"):
        convert(op, work, dst, RunOptions(overwrite=True))
    assert tree_bytes(dst) == {"important.txt": b"keep", "sub/x": b"keep"}


@pytest.mark.parametrize("op", ["from-universal", "to-universal"])
def test_overwrite_never_deletes_a_checkpoint_torch_wrote(work, tmp_path, op):
    """`from-universal uni/ ck_original/ --overwrite` onto a real 4-rank torch save (no ckptconv
    output record, no journal) is refused and the checkpoint is left byte for byte; a DCP output
    of ckptconv (which carries the record) is replaced."""
    original = tmp_path / "ck_original"
    shutil.copytree(work["src"], original)
    before = tree_bytes(original)
    with pytest.raises(DestinationError, match=r"ckptconv did not write \(found \.metadata, __0_0\.distcp"):
        convert(op, work, original, RunOptions(overwrite=True))
    assert tree_bytes(original) == before
    ours = tmp_path / "ours"
    convert("from-universal", work, ours, RunOptions())
    assert (ours / ".written-by-ckptconv.json").is_file()
    convert(op, work, ours, RunOptions(overwrite=True))


def test_overwrite_refuses_a_foreign_file_inside_a_store(work, tmp_path):
    dst = tmp_path / "uni"
    convert("to-universal", work, dst, RunOptions())
    array = next((dst / "tensors").iterdir())
    (array / "notes.txt").write_text("mine")
    proc = ckptconv(*command("to-universal", work, dst, "--overwrite"))
    assert proc.returncode == 2 and f"tensors/{array.name}/notes.txt" in proc.stderr
    assert (array / "notes.txt").read_text() == "mine" and (dst / "ckptconv.json").is_file()


@pytest.mark.parametrize("previous,op", [
    ("to-universal", "from-universal"), ("from-universal", "export-hf"),
    pytest.param("export-hf", "to-universal", marks=pytest.mark.slow),
    pytest.param("to-universal", "import-hf", marks=pytest.mark.slow)])
def test_overwrite_replaces_a_ckptconv_output(work, tmp_path, monkeypatch, previous, op):
    ref, dst, partial = tmp_path / "ref", tmp_path / "out", tmp_path / "partial"
    convert(op, work, ref, RunOptions())
    convert(previous, work, dst, RunOptions())  # a complete output of another kind
    convert(op, work, dst, RunOptions(overwrite=True))
    assert output_files(dst) == output_files(ref)
    interrupted(previous, work, partial, monkeypatch)  # a partial one
    convert(op, work, partial, RunOptions(overwrite=True))
    assert output_files(partial) == output_files(ref)


@pytest.mark.parametrize("partial", [False, True])
def test_an_interrupted_overwrite_leaves_no_complete_or_resumable_output(work, tmp_path, monkeypatch, partial):
    """Ctrl-C while --overwrite clears the old output (a big one takes a while), whatever order the
    directory lists in: what is left is never marked complete (the old marker over deleted data),
    --resume of it never publishes a store with missing data, and --overwrite again clears it."""
    from converter.run import destination

    dst = tmp_path / "uni"
    if partial:
        interrupted("to-universal", work, dst, monkeypatch)
    else:
        convert("to-universal", work, dst, RunOptions())
    removed = []

    def stop_after_one(remove):
        def run(path, *a, **k):
            if os.fspath(path).endswith(destination.LOCK_NAME):
                return remove(path, *a, **k)  # the lock's own release
            if removed:  # stopped as soon as one entry went
                raise KeyboardInterrupt()
            removed.append(os.fspath(path))
            return remove(path, *a, **k)
        return run

    with monkeypatch.context() as m:
        own_os = types.SimpleNamespace(**{**vars(os), "unlink": stop_after_one(os.unlink),  # any listing order:
                                          "scandir": lambda p: sorted(os.scandir(p), key=lambda e: e.name, reverse=True)})
        m.setattr(destination, "os", own_os)  # the destination module's removals only
        m.setattr(destination.shutil, "rmtree", stop_after_one(shutil.rmtree))
        with pytest.raises(KeyboardInterrupt):
            convert("from-universal", work, dst, RunOptions(overwrite=True))
    assert destination.complete_marker(dst) is None, removed
    try:  # refused, or a chunk recorded as written is missing; if it goes through, the output is whole
        convert("to-universal", work, dst, RunOptions(resume=True))
        assert api.verify(dst).ok
    except CkptConvError:
        pass
    ref = tmp_path / "ref"
    convert("from-universal", work, ref, RunOptions())
    convert("from-universal", work, dst, RunOptions(overwrite=True))  # what was left is still ckptconv's to clear
    assert output_files(dst) == output_files(ref)


def test_overwrite_never_follows_a_link_out(work, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    dst = tmp_path / "uni"
    convert("to-universal", work, dst, RunOptions())
    array = next((dst / "tensors").iterdir())
    (array / "c" / "9").symlink_to(outside, target_is_directory=True)  # ckptconv writes no links: not its own
    with pytest.raises(DestinationError, match=f"not a ckptconv output .*{array.name}/c/9/"):
        convert("to-universal", work, dst, RunOptions(overwrite=True))
    (array / "c" / "9").unlink()
    shutil.rmtree(dst / "objects")
    (dst / "objects").symlink_to(outside, target_is_directory=True)  # a link where a store folder goes: unlinked
    convert("to-universal", work, dst, RunOptions(overwrite=True))
    assert (outside / "victim").read_bytes() == b"precious" and sorted(os.listdir(outside)) == ["victim"]
    assert not any(p.is_symlink() for p in dst.rglob("*")) and api.verify(dst).ok


# ------------------------------------------------------------------------------ Ctrl-C / SIGTERM


@pytest.mark.parametrize("op,sig,slow", [
    ("to-universal", signal.SIGINT, 0.2),
    ("from-universal", signal.SIGTERM, 0.2),
    pytest.param("export-hf", signal.SIGINT, 0.6, marks=pytest.mark.slow),
    pytest.param("import-hf", signal.SIGTERM, 0.2, marks=pytest.mark.slow),
    pytest.param("from-universal", signal.SIGINT, 0.2, marks=pytest.mark.slow),
])
def test_signal_stops_at_once_and_resume_finishes(work, tmp_path, op, sig, slow):
    ref, dst = tmp_path / "ref", tmp_path / "out"
    assert ckptconv(*command(op, work, ref)).returncode == 0
    proc = start(*command(op, work, dst, "--workers", "2"), slow=slow)
    wait_for_progress(dst, proc)
    sent = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert took < 2.0, (took, err)
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1].startswith("ckptconv: aborted (") and "--resume" in err, err
    assert "wrote" not in out and not (dst / MARKERS[op]).exists()
    assert not (dst / ".ckptconv-lock").exists()
    done = ckptconv(*command(op, work, dst, "--resume"))
    assert done.returncode == 0, done.stderr
    assert output_files(dst) == output_files(ref)


# ------------------------------------------------------------------------------ the lock


def test_a_second_run_is_refused_while_the_first_runs(work, tmp_path):
    ref, dst = tmp_path / "ref", tmp_path / "uni"
    assert ckptconv(*command("to-universal", work, ref)).returncode == 0
    hold = tmp_path / "hold"  # while it exists the first run waits between pieces: alive however slow the others start
    first = start(*command("to-universal", work, dst, "--workers", "2"), slow=0.2, hold=hold)
    wait_for_progress(dst, first)
    hold.touch()
    env = {**os.environ, "CKPTCONV_JOURNAL_FLUSH_SECONDS": "0"}
    others = [subprocess.Popen([sys.executable, "-m", "converter", *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env) for args in (
        command("to-universal", work, dst), command("to-universal", work, dst, "--overwrite"),
        command("to-universal", work, dst, "--resume"), ["verify", dst])]
    for proc in others:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        assert f"pid {first.pid}" in err and "interrupted" not in err and "stopped" not in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert first.poll() is None  # still running, untouched
    hold.unlink()
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert output_files(dst) == output_files(ref)
    assert not (dst / ".ckptconv-lock").exists()


def test_a_dead_process_lock_is_taken_over(work, tmp_path):
    dst = tmp_path / "uni"
    dst.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (dst / ".ckptconv-lock").write_text(json.dumps({"pid": int(dead.stdout), "host": "h", "command": "ckptconv x",
                                                    "since": "2020-01-01T00:00:00+00:00"}))
    convert("to-universal", work, dst, RunOptions())
    assert (dst / "ckptconv.json").is_file() and not (dst / ".ckptconv-lock").exists()


def test_lock_is_released_after_a_failure(work, tmp_path, monkeypatch):
    import converter.run.sinks as sinks

    dst = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(sinks.RankChunkSink._One, "write", lambda *a: (_ for _ in ()).throw(OSError(5, "disk on fire")))
        with pytest.raises(CkptConvError, match="disk on fire"):
            convert("from-universal", work, dst, RunOptions())
    assert not (dst / ".ckptconv-lock").exists()
    convert("from-universal", work, dst, RunOptions(resume=True))
    assert (dst / ".metadata").is_file() and not (dst / ".ckptconv-lock").exists()


# ------------------------------------------------------------------------------ advice that fits


@pytest.mark.parametrize("op", OPS)
def test_a_stopped_output_read_as_a_source_says_resume(work, tmp_path, monkeypatch, op):
    dst = tmp_path / "out"
    interrupted(op, work, dst, monkeypatch)
    with pytest.raises(IncompleteCheckpointError, match=f"incomplete .*ckptconv {op} .*--resume"):
        api.verify(dst)
    proc = ckptconv(*command(op, work, dst))  # the same command without --resume
    assert proc.returncode == 2 and "--resume" in proc.stderr and "interrupted" in proc.stderr


@pytest.mark.slow  # a torchrun start costs seconds
def test_torchrun_ranks_stop_when_the_launcher_dies(work, tmp_path):
    """SIGKILL torchrun mid-run: both ranks stop within seconds and nothing is published, then or later."""
    dst = tmp_path / "uni"
    env = {**os.environ, "CKPTCONV_JOURNAL_FLUSH_SECONDS": "0", "CKPTCONV_FAULT_SLOW_PIECE_SECONDS": "0.3",
           "GLOO_SOCKET_IFNAME": "lo"}
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", "-m", "converter", *map(str, command("to-universal", work, dst))],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_for_progress(dst, launcher, tasks=1, timeout=180)
        ranks = _children(launcher.pid)
        assert len(ranks) == 2, ranks
        launcher.kill()
        launcher.wait()
        end = time.monotonic() + 15
        while any(_alive(p) for p in ranks) and time.monotonic() < end:
            time.sleep(0.1)  # polls the ranks' /proc state: they are not our children, nothing to wait on
        assert not any(_alive(p) for p in ranks)
        # every process of the job is gone (a zombie writes nothing): nothing can be published later
        assert not (dst / "ckptconv.json").exists()
    finally:
        launcher.kill()
        for p in _children(launcher.pid):
            os.kill(p, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_hostile_journal_in_a_source_is_never_read(tmp_path):
    """A source directory's journal is read only as a bounded regular file (never /dev/zero by a link)."""
    from formats.errors import InvalidCheckpointError

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / ".ckptconv-journal.jsonl").symlink_to("/dev/zero")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / ".ckptconv-journal.jsonl").write_text('{"header":' * 100_000)
    for d in ("a", "b"):
        with pytest.raises(InvalidCheckpointError, match="not a checkpoint ckptconv knows"):
            api.detect_format(tmp_path / d)
