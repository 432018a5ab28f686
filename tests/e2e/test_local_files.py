"""``from-universal --local-files rank|node`` and ``ckptconv files``, proved by real loads.

Each case converts a shared fixture, then stages for every target rank ONLY the files
``ckptconv files OUT --rank R`` lists into a fresh folder of its own, and a gloo world of the
target layout ``dcp.load``\\ s with torch's default planner from that folder (``checkpoint_id`` =
the rank's folder). Every entry is compared bit for bit with torch's own reading of the source;
the files each rank's reader opened must be exactly the listed ones, and (locality) with
``rank`` only the rank's own two files, with ``node`` only files of ranks of its node. A job that
needed an unlisted file would fail: it is not there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_factory import fixture_info, spec_from_info
from converter import api
from converter.config import RunOptions
from converter.plan.mesh import parse_mesh
from converter.tools.files import node_files, rank_files
from load_worker import LoadJob, run_jobs
from oracle import torch_reference

ROOT = Path(__file__).resolve().parents[2]


def _layout(mesh: str) -> dict[str, int]:
    return {d.name: d.size for d in parse_mesh(mesh).dims}


def _convert(src: Path, out: Path, mesh: str, plan: str, mode: str, k: int | None) -> None:
    api.from_universal(src, out, mesh, plan=plan, options=RunOptions(workers=2), local_files=mode, ranks_per_node=k)


def _stage(out: Path, stage: Path, world: int) -> dict[int, list[str]]:
    """Copy to ``stage/rank<R>/`` only what ``ckptconv files`` lists for rank R; the lists."""
    listed = {}
    for rank in range(world):
        names = rank_files(out, rank)
        folder = stage / f"rank{rank}"
        folder.mkdir(parents=True)
        for name in names:
            shutil.copy2(out / name, folder / name)
        listed[rank] = names
    return listed


def _check(name: str, per_rank: dict[int, dict], listed: dict[int, list[str]], mode: str, k: int | None) -> None:
    for rank, rep in per_rank.items():
        assert "exception" not in rep, f"{name} rank {rank}: {rep['exception']}"
        assert not rep["errors"], f"{name} rank {rank}: {rep['errors'][:3]}"
        opened = [Path(p).name for p in rep["opened_paths"]]
        assert sorted(set(opened)) == sorted(listed[rank]), (name, rank, opened, listed[rank])
        data = [n for n in opened if n.endswith(".distcp")]
        if mode == "rank":
            assert set(opened) == {f"__{rank}.metadata", f"__{rank}_0.distcp"}, (name, rank, opened)
        elif mode == "node":
            assert all(int(n.split("_")[2]) // k == rank // k for n in data), (name, rank, data)
        for it in rep["reads"]:  # every read lies in a file this rank was given
            assert it["file"] in listed[rank], (name, rank, it)


def _run_cases(dcp_checkpoint, tmp_path: Path, mesh: str, plan: str, cases: list[tuple[str, str, int | None]]) -> None:
    world = parse_mesh(mesh).world_size
    jobs, lists = [], {}
    refs: dict[str, Path] = {}
    for source, mode, k in cases:
        name = f"{source}->{mesh} --local-files {mode}" + (f" --ranks-per-node {k}" if k else "")
        src = dcp_checkpoint(source)
        out = tmp_path / f"out-{source}-{mode}"
        _convert(src, out, mesh, plan, mode, k)
        lists[name] = _stage(out, tmp_path / f"stage-{source}-{mode}", world)
        if source not in refs:
            refs[source] = tmp_path / f"ref-{source}.pt"
            torch.save(torch_reference(src), refs[source])
        spec = spec_from_info(fixture_info(src))
        jobs.append(LoadJob(name, str(tmp_path / f"stage-{source}-{mode}" / "rank{rank}"), "dcp", str(refs[source]),
                            spec, train=False, own_dataloader=spec.style == "titan"))
    results = run_jobs(_layout(mesh), jobs)
    for (source, mode, k), job in zip(cases, jobs):
        _check(job.name, results[job.name], lists[job.name], mode, k)


def test_each_rank_loads_from_only_its_listed_files(dcp_checkpoint, tmp_path):
    """TP2 x FSDP2 from an FSDP4 save: norms are replicated over TP (stored once in dedup, whose
    ranks then open their neighbours' files and rank 0's for the non-tensor entries); rank and node
    copies make every rank (node) self-contained; torchtitan's per-DP-rank dataloader entries go only
    to the ranks that load them."""
    _run_cases(dcp_checkpoint, tmp_path, "tp2,dp2", "llama",
               [("fsdp4", "rank", None), ("fsdp4", "node", 2), ("fsdp4", "dedup", None), ("titan_flat", "rank", None)])


@pytest.mark.slow
def test_replicas_and_stages_load_from_only_their_files(dcp_checkpoint, tmp_path):
    """HSDP (everything replicated over dp_replicate: a copy per rank or per node) and PP (each
    rank's metadata names only its stage's keys)."""
    _run_cases(dcp_checkpoint, tmp_path, "dp_replicate2,dp2", "fsdp",
               [("fsdp4", "rank", None), ("fsdp4", "node", 2), ("tp2dp2", "node", 2)])
    _run_cases(dcp_checkpoint, tmp_path / "pp", "pp2,dp2", "fsdp", [("fsdp4", "rank", None), ("fsdp4", "node", 2)])


def test_files_command_prints_one_path_per_line(dcp_checkpoint, tmp_path):
    out = tmp_path / "out"
    _convert(dcp_checkpoint("fsdp4"), out, "tp2,dp2", "llama", "node", 2)
    run = subprocess.run([sys.executable, "-m", "converter", "files", str(out), "--node", "1"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [str(out / n) for n in node_files(out, 1)]
    assert node_files(out, 1) == ["__2.metadata", "__3.metadata", "__2_0.distcp", "__3_0.distcp"]
    bad = subprocess.run([sys.executable, "-m", "converter", "files", str(out), "--rank", "9"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "__9.metadata" in bad.stderr and "4 ranks" in bad.stderr, bad.stderr


@pytest.mark.parametrize("mode,k", [("dedup", None), ("rank", None), ("node", 2)])
def test_dry_run_lists_what_each_rank_opens(dcp_checkpoint, tmp_path, mode, k):
    """``--dry-run --json``'s ``ranks[].loads`` is what ``ckptconv files`` reads back from the written
    output (the manifest, or the rank-local metadata); plan document and manifest validate."""
    import json

    from schemas import validation_errors

    src = dcp_checkpoint("titan_flat")
    plan = api.from_universal(src, tmp_path / "x", "tp2,dp2", plan="llama", local_files=mode, ranks_per_node=k,
                              options=RunOptions(dry_run=True))
    assert validation_errors("target-plan", plan.preview) == []
    assert plan.preview["local_files"] == {"mode": mode, "ranks_per_node": k}
    out = tmp_path / "out"
    _convert(src, out, "tp2,dp2", "llama", mode, k)
    assert [r["loads"] for r in plan.preview["ranks"]] == [rank_files(out, r) for r in range(4)]
    if mode == "dedup":
        assert validation_errors("loads", json.loads((out / ".ckptconv-loads.json").read_text())) == []
        assert any(len(r["loads"]) > 2 for r in plan.preview["ranks"])  # replicated norms, rank 0's objects
    else:
        assert not (out / ".metadata").exists() and not (out / ".ckptconv-loads.json").exists()
        copies = [c for t in plan.preview["tensors"] for c in t["chunks"] if c["bytes"]]  # (an empty box: stored once)
        assert all(set(c["readers"]) <= set(c["holders"]) for c in copies)
        assert all(c["rank"] // (k or 1) == r // (k or 1) for c in copies for r in c["readers"])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_each_load_only_their_own_folder(dcp_checkpoint, tmp_path):
    """Two torchrun launchers on this machine (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on
    localhost), each a node: an FSDP4 save converted to TP2 x FSDP2 with ``--local-files node
    --ranks-per-node 2``; each node's local folder gets only what ``ckptconv files --node N`` lists;
    every rank of the 4-rank world dcp.loads from its node's folder (torch's default planner),
    bit for bit == torch's reading of the source, and opens nothing outside that folder."""
    import json
    import os
    import pickle

    src, out, mesh = dcp_checkpoint("fsdp4"), tmp_path / "out", "tp2,dp2"
    _convert(src, out, mesh, "llama", "node", 2)
    listed = {}
    for node in range(2):
        disk = tmp_path / f"disk{node}"
        disk.mkdir()
        for name in node_files(out, node):
            shutil.copy2(out / name, disk / name)
        listed.update({r: rank_files(disk, r) for r in (2 * node, 2 * node + 1)})  # read from the node's own copy
    ref = tmp_path / "ref.pt"
    torch.save(torch_reference(src), ref)
    job = LoadJob("2 nodes", str(tmp_path / "disk{node}"), "dcp", str(ref), spec_from_info(fixture_info(src)),
                  train=False)
    jobs, reports = tmp_path / "jobs.pkl", tmp_path / "reports"
    jobs.write_bytes(pickle.dumps((_layout(mesh), [job])))
    reports.mkdir()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")])}
    port = _free_port()
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "ckptconv-two-nodes",
         str(ROOT / "tests" / "support" / "node_load_job.py"), str(jobs), str(reports)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in launchers:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    per_rank = {r: json.loads((reports / f"job0_rank{r}.json").read_text()) for r in range(4)}
    _check(job.name, per_rank, listed, "node", 2)
    for rank, rep in per_rank.items():
        disk = tmp_path / f"disk{rank // 2}"
        assert rep["opened_paths"] and all(Path(p).parent == disk for p in rep["opened_paths"]), (rank, rep["opened_paths"])
