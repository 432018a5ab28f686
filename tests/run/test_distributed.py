"""Scale-out under torchrun (gloo): every conversion split across 2 and 4 local ranks writes output
bit-identical to the single-process run; one rank's failure fails every rank with nothing
published; --resume continues with the same world size and refuses another.

The torchrun jobs run ``tests/support/dist_worker.py``, which drives the real click CLI for several
commands in one job (a torchrun start costs seconds on a loaded machine); one job runs
``python -m converter`` itself, the documented entry point.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from converter.run.distributed import RUNS_PER_RANK, TASK_OVERHEAD_BYTES, assign, node_place, share
from converter.run.journal import task_id
from converter.plan.copy_tasks import Piece, WriteTask
from formats.base import Box

WORKER = Path(__file__).resolve().parents[1] / "support" / "dist_worker.py"
CHUNK = "64KiB"


# ------------------------------------------------------------------------------ share (pure)


def _task(key: str, rows: int) -> WriteTask:
    box = Box((0, 0), (rows, 16))
    return WriteTask(key, "float32", key, box, (Piece(box, ()),))


def test_share_is_a_balanced_deterministic_partition():
    tasks = [_task(f"t{i}", (i * 37) % 101 + 1) for i in range(200)]
    for world in (1, 2, 3, 4, 7):
        shares = [share(tasks, r, world) for r in range(world)]
        ids = sorted(task_id(t) for s in shares for t in s)
        assert ids == sorted(task_id(t) for t in tasks)  # every task exactly once
        loads = [sum(t.nbytes for t in s) for s in shares]
        biggest = max(t.nbytes for t in tasks)
        run = sum(t.nbytes + TASK_OVERHEAD_BYTES for t in tasks) // (RUNS_PER_RANK * world)
        assert max(loads) - min(loads) <= max(biggest, run)  # greedy largest-first bound over runs
        assert shares == [share(tasks, r, world) for r in range(world)]  # deterministic
        # the owner does not depend on the order the plan lists its tasks
        rev = assign(list(reversed(tasks)), world)[::-1]
        assert rev == assign(tasks, world)


def test_share_keeps_a_tensors_neighbouring_tasks_together():
    """A tensor's tasks in box order change rank only between runs of about 1/RUNS_PER_RANK of a
    rank's share: neighbours (which read the same source chunks) stay in one process."""
    tasks = []
    for k in range(6):
        for r in range(0, 64, 4):  # 16 tasks of 4 rows each per tensor, listed shuffled
            box = Box((r, 0), (4, 1024))
            tasks.append(WriteTask(f"t{k}", "float32", (k, r), box, (Piece(box, ()),)))
    tasks = tasks[::3] + tasks[1::3] + tasks[2::3]
    for world in (2, 3, 4):
        owners = assign(tasks, world)
        by_key: dict[str, list[tuple[int, int]]] = {}
        for t, o in zip(tasks, owners):
            by_key.setdefault(t.key, []).append((t.box.offsets[0], o))
        changes = sum(sum(1 for a, b in zip(sorted(v), sorted(v)[1:]) if a[1] != b[1]) for v in by_key.values())
        total = sum(t.nbytes + TASK_OVERHEAD_BYTES for t in tasks)
        assert changes <= total // (total // (RUNS_PER_RANK * world)) + len(by_key), (world, changes)


def test_share_ties_go_to_the_lowest_rank_and_keep_plan_order():
    tasks = [_task("b", 4), _task("a", 4), _task("c", 4)]
    assert assign(tasks, 2) == [1, 0, 0]  # by id: a -> 0, b -> 1, c -> 0 (loads tied again)
    assert [t.key for t in share(tasks, 0, 2)] == ["a", "c"]
    assert share(tasks, 0, 1) == tasks


# ------------------------------------------------------------------------------ fixtures


def _make_source(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    sd = {"model": {f"layers.{i}.w": torch.randn(48 * (i + 1), 96, generator=g) for i in range(5)},
          "optim": {"state": {"layers.0.w": {"step": torch.tensor(3.0)}}}, "extra": {"epoch": 2}}
    sd["model"]["half"] = torch.randn(100, 70, generator=g).to(torch.bfloat16)
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)


def commands(src: Path, work: Path, hf_ref: Path) -> list[list[str]]:
    """The conversions every world size runs (the same options for the reference run)."""
    return [
        ["to-universal", "--chunk-size", CHUNK, str(src), str(work / "uni")],
        ["from-universal", "--mesh", "tp2,dp3", "--memory-budget", "2MiB", str(work / "uni"), str(work / "dcp")],
        ["export-hf", "--max-shard-size", "100KB", str(work / "uni"), str(work / "hf")],
        ["import-hf", "--chunk-size", CHUNK, str(hf_ref), str(work / "uni2")],
        # the safetensors backend: its store, and a DCP output read from it (equal to the zarr store's)
        ["to-universal", "--backend", "safetensors", "--chunk-size", CHUNK, str(src), str(work / "unist")],
        ["from-universal", "--mesh", "tp2,dp3", "--memory-budget", "2MiB", str(work / "unist"), str(work / "dcpst")],
        ["verify", str(work / "uni")],
    ]


def _run_cli(args: list[str]) -> None:
    from converter.cli import cli

    cli.main(args=args, prog_name="ckptconv", standalone_mode=False)


@pytest.mark.parametrize("env,answer", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, 1),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, "--ranks-per-node 2, but torchrun started 4 process"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "launch --nnodes 2 --nproc-per-node 2"),
    ({}, "run it under torchrun --nnodes 2 --nproc-per-node 2"),
])
def test_node_place_needs_the_target_jobs_launcher_shape(monkeypatch, env, answer):
    """--node-local-dst: the node a process writes is RANK // K, on a launcher of the target's shape
    (--nproc-per-node K, --nnodes world / K); anything else is one line, from the environment alone
    (every process refuses alike, before any collective)."""
    from formats.errors import ConfigError

    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if isinstance(answer, int):
        assert node_place(2, 4) == answer
        return
    with pytest.raises(ConfigError) as e:
        node_place(2, 4)
    assert answer in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    src, work = root / "src", root / "ref"
    _make_source(src)
    for cmd in commands(src, work, work / "hf")[:-1]:
        _run_cli(cmd)
    return {"src": src, "ref": work, "root": root}


def torchrun(nproc: int, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, "CKPTCONV_JOURNAL_FLUSH_SECONDS": "0", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full)


def run_worker(nproc: int, out: Path, cmds: list[list[str]], *extra: str) -> list[dict]:
    flat: list[str] = []
    for c in cmds:
        flat += [*c, ";;"]
    proc = torchrun(nproc, str(WORKER), str(out), *extra, "--", *flat[:-1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(nproc)]


# ------------------------------------------------------------------------------ comparisons


def tree_bytes(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    skip = (*skip, ".written-by-ckptconv.json")  # the record names the source path (a copy's differs)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in skip}


def universal_files(root: Path) -> dict[str, bytes]:
    files = tree_bytes(root, skip=("ckptconv.json",))
    doc = json.loads((root / "ckptconv.json").read_text())
    doc.pop("created")
    files["ckptconv.json"] = json.dumps(doc).encode()  # key order kept: the file itself must match
    return files


def dcp_files(root: Path) -> dict[str, bytes]:
    files = tree_bytes(root, skip=(".metadata",))
    md = pickle.loads((root / ".metadata").read_bytes())  # our own output, in a test
    files[".metadata"] = repr((md.state_dict_metadata, md.planner_data, list(md.storage_data.items()))).encode()
    return files


def assert_same_outputs(ref: Path, work: Path) -> None:
    assert universal_files(work / "uni") == universal_files(ref / "uni")
    assert dcp_files(work / "dcp") == dcp_files(ref / "dcp")
    assert tree_bytes(work / "hf") == tree_bytes(ref / "hf")
    assert universal_files(work / "uni2") == universal_files(ref / "uni2")
    assert universal_files(work / "unist") == universal_files(ref / "unist")
    assert dcp_files(work / "dcpst") == dcp_files(ref / "dcp")  # from the safetensors store = from the zarr one


def _check_dcp_loads(ref_src: Path, dcp_dir: Path) -> None:
    """torch itself reads the converted DCP (one process): the oracle, not our reader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    a, b = dcp_dir.parent / "a.pt", dcp_dir.parent / "b.pt"
    dcp_to_torch_save(str(ref_src), str(a))
    dcp_to_torch_save(str(dcp_dir), str(b))
    sa, sb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k


# ------------------------------------------------------------------------------ torchrun runs


def _to_uni(ref: dict, dst: Path, *extra: str) -> list[str]:
    return ["to-universal", *extra, "--chunk-size", CHUNK, str(ref["src"]), str(dst)]


def _single_process_failure(ref: dict, dst: Path, monkeypatch) -> None:
    """A one-process to-universal that fails midway (a journal for world size 1 is left)."""
    import converter.run.sinks as sinks
    from formats.errors import StorageError

    calls = []
    real = sinks.ChunkSink._One.close

    def close(self):
        calls.append(1)
        if len(calls) > 3:
            raise StorageError("injected (test)")
        return real(self)

    monkeypatch.setattr(sinks.ChunkSink._One, "close", close)
    with pytest.raises(StorageError):
        _run_cli(_to_uni(ref, dst, "--workers", "1"))
    monkeypatch.undo()
    assert not (dst / "ckptconv.json").exists()


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_torchrun_bit_identical_fails_cleanly_and_resumes(ref, tmp_path, nproc, monkeypatch):
    """One job: every conversion, bit-identical to one process; then rank 1 fails a to-universal
    (every rank fails, nothing is published); --resume with the same world size finishes it
    bit-identical; --resume of a one-process run's output is refused."""
    work, failing, single = tmp_path / "w", tmp_path / "failing", tmp_path / "single"
    _single_process_failure(ref, single, monkeypatch)
    n = len(commands(ref["src"], work, ref["ref"] / "hf"))
    cmds = commands(ref["src"], work, ref["ref"] / "hf") + [
        ["@fail", "1"], _to_uni(ref, failing), ["@fail", "-1"],
        ["verify", str(failing)],  # n + 3: no store was published
        _to_uni(ref, failing, "--resume"),  # n + 4
        _to_uni(ref, single, "--resume", "--workers", "1"),  # n + 5: refused, another world size
    ]
    reports = run_worker(nproc, tmp_path / "result", cmds)
    for rep in reports:
        assert rep["world"] == nproc
        assert all(r["ok"] for r in rep["results"][:n]), rep
    assert_same_outputs(ref["ref"], work)
    assert not [p for p in work.rglob(".ckptconv-*") if p.name != ".ckptconv-loads.json"]  # no journal left (the manifest is output)
    _check_dcp_loads(ref["src"], work / "dcp")

    failed = [rep["results"][n + 1] for rep in reports]
    assert all(not r["ok"] and r["error"] == "StorageError" for r in failed), failed
    assert "injected" in failed[1]["message"]
    assert all("rank 1 of" in r["message"] and "nothing was published" in r["message"]
               for i, r in enumerate(failed) if i != 1)
    for rep in reports:
        check = rep["results"][n + 3]
        assert not check["ok"] and "incomplete" in (check.get("message", "") + check["output"]).lower(), check
        assert rep["results"][n + 4]["ok"], rep["results"][n + 4]
        refused = rep["results"][n + 5]
        assert refused["error"] == "DestinationError" and "same world size" in refused["message"], refused
    assert universal_files(failing) == universal_files(ref["ref"] / "uni")
    assert not list(failing.glob(".ckptconv-*"))


@pytest.mark.slow
def test_entry_point_resumes_a_sigkilled_job(ref, tmp_path):
    """``torchrun -m converter``: a SIGKILLed job publishes nothing; --resume finishes it; only rank 0 prints."""
    uni = tmp_path / "uni"
    args = ["-m", "converter", *_to_uni(ref, uni)]
    killed = torchrun(2, *args, env={"CKPTCONV_FAULT_KILL_AFTER_BYTES": str(60_000)})
    assert killed.returncode != 0
    assert not (uni / "ckptconv.json").exists()
    done = torchrun(2, "-m", "converter", *_to_uni(ref, uni, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1  # only rank 0 prints
    assert universal_files(uni) == universal_files(ref["ref"] / "uni")
    assert not list(uni.glob(".ckptconv-*"))
