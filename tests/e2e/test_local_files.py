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


def test_node_local_dst_needs_node_files_and_a_launcher(dcp_checkpoint, tmp_path):
    """--node-local-dst: refused in one line without --local-files node, and outside a torchrun of
    the target's shape (before anything is written); its dry run plans the whole output."""
    from formats.errors import ConfigError

    src = dcp_checkpoint("fsdp4")
    with pytest.raises(ConfigError, match="add --local-files node --ranks-per-node K"):
        api.from_universal(src, tmp_path / "a", "tp2,dp2", plan="llama", local_files="rank", node_local_dst=True)
    with pytest.raises(ConfigError, match="run it under torchrun --nnodes 2 --nproc-per-node 2"):
        api.from_universal(src, tmp_path / "b", "tp2,dp2", plan="llama", local_files="node", ranks_per_node=2,
                           node_local_dst=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    plan = api.from_universal(src, tmp_path / "c", "tp2,dp2", plan="llama", local_files="node", ranks_per_node=2,
                              node_local_dst=True, options=RunOptions(dry_run=True))
    assert [r["rank"] for r in plan.preview["ranks"]] == [0, 1, 2, 3]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path: Path, argvs: list[list[str]], nproc: int = 2, rdzv_id: str = "ckptconv-two-nodes",
              envs: list[dict[str, str]] | None = None, pinned: bool = False,
              short_exit: bool = False) -> list[tuple[int, str, str]]:
    """Run one torchrun launcher per entry of ``argvs`` (its script / ``-m module`` and arguments),
    together a job of ``len(argvs)`` nodes of ``nproc`` processes (c10d rendezvous on localhost,
    which numbers the nodes in arrival order; ``pinned``: static, launcher i is node i; ``envs``:
    launcher i's extra environment; ``short_exit``: a node whose processes succeeded waits seconds,
    not torchrun's 300, for a failed node's agent, ``tests/support/torchrun_short_exit.py``); each
    launcher's (status, stdout, stderr)."""
    import os

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")])}
    port = _free_port()
    def rendezvous(i: int) -> list[str]:
        if pinned:
            return ["--node-rank", str(i), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", rdzv_id]

    launcher = [str(ROOT / "tests" / "support" / "torchrun_short_exit.py")] if short_exit else \
        ["-m", "torch.distributed.run"]
    launchers = [subprocess.Popen(
        [sys.executable, *launcher, "--nnodes", str(len(argvs)), "--nproc-per-node", str(nproc),
         *rendezvous(i), *argv],
        cwd=tmp_path, env={**env, **(envs[i] if envs else {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for i, argv in enumerate(argvs)]
    done = []
    for proc in launchers:
        out, err = proc.communicate(timeout=600)
        done.append((proc.returncode, out, err))
    return done


def _load_on_two_nodes(src: Path, tmp_path: Path, mesh: str, listed: dict[int, list[str]]) -> None:
    """A 2-node, 4-rank job (two torchrun launchers) dcp.loads from ``tmp_path/disk<node>`` with
    torch's default planner: every entry bit for bit == torch's reading of the source, every file
    opened listed and in the rank's own node's folder."""
    import json
    import pickle

    ref = tmp_path / "ref.pt"
    torch.save(torch_reference(src), ref)
    job = LoadJob("2 nodes", str(tmp_path / "disk{node}"), "dcp", str(ref), spec_from_info(fixture_info(src)),
                  train=False)
    jobs, reports = tmp_path / "jobs.pkl", tmp_path / "reports"
    jobs.write_bytes(pickle.dumps((_layout(mesh), [job])))
    reports.mkdir()
    script = [str(ROOT / "tests" / "support" / "node_load_job.py"), str(jobs), str(reports)]
    for status, _, err in _torchrun(tmp_path, [script, script], rdzv_id="ckptconv-two-nodes-load"):
        assert status == 0, err[-3000:]
    per_rank = {r: json.loads((reports / f"job0_rank{r}.json").read_text()) for r in range(4)}
    _check(job.name, per_rank, listed, "node", 2)
    for rank, rep in per_rank.items():
        disk = tmp_path / f"disk{rank // 2}"
        assert rep["opened_paths"] and all(Path(p).parent == disk for p in rep["opened_paths"]), (rank, rep["opened_paths"])


@pytest.mark.slow
def test_two_nodes_each_load_only_their_own_folder(dcp_checkpoint, tmp_path):
    """Two torchrun launchers on this machine (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on
    localhost), each a node: an FSDP4 save converted to TP2 x FSDP2 with ``--local-files node
    --ranks-per-node 2``; each node's local folder gets only what ``ckptconv files --node N`` lists;
    every rank of the 4-rank world dcp.loads from its node's folder (torch's default planner),
    bit for bit == torch's reading of the source, and opens nothing outside that folder."""
    src, out, mesh = dcp_checkpoint("fsdp4"), tmp_path / "out", "tp2,dp2"
    _convert(src, out, mesh, "llama", "node", 2)
    listed = {}
    for node in range(2):
        disk = tmp_path / f"disk{node}"
        disk.mkdir()
        for name in node_files(out, node):
            shutil.copy2(out / name, disk / name)
        listed.update({r: rank_files(disk, r) for r in (2 * node, 2 * node + 1)})  # read from the node's own copy
    _load_on_two_nodes(src, tmp_path, mesh, listed)


def _node_conversion(src: Path, dst: Path, *extra: str) -> list[str]:
    return ["-m", "converter", "from-universal", str(src), str(dst), "--mesh", "tp2,dp2", "--plan", "llama",
            "--local-files", "node", "--ranks-per-node", "2", "--node-local-dst", "--workers", "1", *extra]


@pytest.mark.slow
def test_two_nodes_each_convert_into_their_own_folder(dcp_checkpoint, tmp_path):
    """The conversion itself under two torchrun launchers (``--nnodes 2 --nproc-per-node 2``), each
    a node with its own DST (``local<i>``: the same ``/local/ckpt`` on a real cluster, here a
    folder per launcher, which the other launcher never names): ``from-universal --local-files
    node --ranks-per-node 2 --node-local-dst``.

    Each node is a conversion of its own: one launcher's processes SIGKILLed mid-copy leave its
    folder with a journal and no marker while the other node completes. Rerun (nodes pinned by
    a static rendezvous): refused in one line without --resume (partial) / --overwrite (complete);
    --resume finishes the partial node and writes nothing on the complete one; --resume with the
    folders swapped is refused as another conversion. Each folder then holds exactly what
    ``ckptconv files OUT --node N`` lists for its node of a one-process conversion (data files
    byte-identical), its marker and record, nothing of the other node; the 2-node load job reads
    only its node's folder, bit for bit == torch's reading of the source. A launcher whose
    --nproc-per-node is not --ranks-per-node is refused in one line."""
    import json

    from converter.run.destination import OUTPUT_RECORD
    from converter.run.journal import JOURNAL_NAME
    from converter.tools.files import MARKER

    def errors(err: str) -> list[str]:
        return [ln for ln in err.splitlines() if ln.startswith("ckptconv: error:")]

    def stamps(d: Path) -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in d.iterdir()}

    src, whole, mesh = dcp_checkpoint("fsdp4"), tmp_path / "whole", "tp2,dp2"
    _convert(src, whole, mesh, "llama", "node", 2)  # the shared-file-system output, one process
    partial, done = tmp_path / "local0", tmp_path / "local1"
    smallest = min((whole / f"__{r}_0.distcp").stat().st_size for r in range(4))
    (killed, _, err0), (ok, _, err1) = _torchrun(
        tmp_path, [_node_conversion(src, partial), _node_conversion(src, done)], rdzv_id="killed",
        envs=[{"CKPTCONV_FAULT_KILL_AFTER_BYTES": str(smallest // 3)}, {}], short_exit=True)
    assert killed != 0 and ok == 0, (err0[-2000:], err1[-2000:])
    assert (partial / JOURNAL_NAME).is_file() and not (partial / MARKER).exists()
    assert (done / MARKER).is_file() and not (done / JOURNAL_NAME).exists()
    node_of = {done: json.loads((done / MARKER).read_text())["node"]}
    node_of[partial] = 1 - node_of[done]
    local = sorted(node_of, key=node_of.get)  # launcher i of a pinned run is node i
    before = stamps(done)

    for d, (status, _, err) in zip(local, _torchrun(tmp_path, [_node_conversion(src, d) for d in local], pinned=True)):
        want = "pass --resume to continue it" if d == partial else "already holds a complete"
        assert status != 0 and errors(err) and all(want in ln for ln in errors(err)), err[-3000:]
    for d, (status, out, err) in zip(local, _torchrun(tmp_path, [_node_conversion(src, d, "--resume") for d in local],
                                                      pinned=True)):
        assert status == 0, err[-3000:]
        assert ("already complete" in out) == (d == done), out  # each node's first process reports its folder
    assert stamps(done) == before

    for disk in local:
        n = node_of[disk]
        own = (2 * n, 2 * n + 1)
        marker = json.loads((disk / MARKER).read_text())
        assert marker["node"] == n and marker["nodes"] == 2, marker
        assert marker["files"] == [*(f"__{r}.metadata" for r in own), *(f"__{r}_0.distcp" for r in own)], marker
        expected = node_files(whole, n)
        held = sorted(p.name for p in disk.iterdir())
        assert held == sorted([*expected, MARKER, OUTPUT_RECORD]), (n, held)
        assert node_files(disk, n) == expected  # what ckptconv files --node N lists, read on the node
        for name in expected:
            if name.endswith(".distcp"):
                assert (disk / name).read_bytes() == (whole / name).read_bytes(), (n, name)
    before = {d: stamps(d) for d in local}
    swapped = _torchrun(tmp_path, [_node_conversion(src, d, "--resume") for d in local[::-1]], pinned=True)
    for i, (status, _, err) in enumerate(swapped):  # launcher i (node i) given node 1-i's folder
        assert status != 0 and errors(err) and all(f"--node-local-dst node {1 - i} of 2, this run with "
                                                   f"--node-local-dst node {i} of 2" in ln for ln in errors(err)), err
    assert {d: stamps(d) for d in local} == before

    for disk in local:
        disk.rename(tmp_path / f"disk{node_of[disk]}")  # the load job's launchers meet in any order
    listed = {r: rank_files(tmp_path / f"disk{r // 2}", r) for r in range(4)}
    _load_on_two_nodes(src, tmp_path, mesh, listed)

    (status, _, err), = _torchrun(tmp_path, [_node_conversion(src, tmp_path / "four")], nproc=4, rdzv_id="four")
    assert status != 0 and len(set(errors(err))) == 1, err[-3000:]  # (torchrun may stop a process before it prints)
    assert "--ranks-per-node 2, but torchrun started 4 process(es) per node" in errors(err)[0], err[-3000:]
    assert not (tmp_path / "four").exists()
