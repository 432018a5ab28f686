"""Load planning at scale: torch's own ``DefaultLoadPlanner`` for ONE rank of a ``tp8`` job, against
the original synthetic checkpoint and against the ``.metadata`` ckptconv would write for that job.

Sources: synthetic torchtitan-Llama ``dcp.save`` checkpoints (:mod:`synthetic_metadata`: the
``.metadata`` of FSDP2 over ``--world`` ranks, data files sparse), e.g. 70B DP128 (278k chunks).
Target: ``--mesh tp8,dp16`` (128 ranks; ckptconv's mesh order, ``dp_shard`` outer, ``tp`` inner:
FSDP2 over torchtitan's TP plan), rank ``--rank`` (default 77: dp 9, tp 5; any rank but 0, which
holds the objects in the dedup layout).

Per source, three metadata files, each planned in a fresh child process (peak RSS from
``wait4``; a guard kills a child whose RSS passes ``--max-rss-gb``):

- ``original``: the source's ``.metadata`` (what a user who does not convert hands ``dcp.load``);
- ``dedup``: the ``.metadata`` ``ckptconv from-universal SRC OUT --mesh M --plan llama`` writes
  (one file, every target chunk);
- ``rank``: the ``__<rank>.metadata`` that ``--local-files rank`` writes for that rank.

The converted files come from ckptconv's own planning, no data: ``from_universal`` runs up to the
:class:`formats.dcp.writer.DCPWriter` its commit would use (the pipeline is not run), and the
writer's ``metadata_bytes()`` / ``rank_metadata_bytes(rank)`` are the very bytes ``commit`` writes.

The planning child builds the rank's state dict as torch would hold it: a fake process group of
the target's world (``FakeStore``, backend ``fake``), a ``(dp_shard, tp)`` DeviceMesh, and every
parameter and AdamW ``exp_avg``/``exp_avg_sq`` as a meta-device DTensor with FSDP2-over-TP
placements (``_StridedShard(0, tp)`` x ``Shard(0)``, ``Shard(0)`` x ``Shard(1)``, ``Shard(0)`` x
``Replicate()``), 0-d ``step`` tensors and the param group's values; then times what
``dcp.load`` does before reading data: ``FileSystemReader.read_metadata`` (``pickle.load``),
``set_up_planner`` (which materializes the meta DTensors' local shards: ``torch.empty``, untouched
pages), ``create_local_plan`` (read-item resolution), ``create_global_plan`` and ``finish_plan``.
``create_global_plan`` gets what torch's coordinator gets: the rank's plan once per rank of the
world (``original``/``dedup``: ``dcp.load`` gathers every rank's plan), or only the rank's own
(``rank``: rank-local metadata makes ``dcp.load`` plan without collectives). It checks that the
read items cover the rank's local elements exactly.

    python bench/load_planning_scale.py                                   # 70b:128 and 405b:512
    python bench/load_planning_scale.py --cases 70b:128 405b:1024 --max-rss-gb 6

Results: ``bench/results/load_planning-<time>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

import synthetic_metadata as syn  # noqa: E402

VARIANTS = ("original", "dedup", "rank")
DEFAULT_CASES = ["70b:128", "405b:512"]


# ----------------------------------------------------------------------------- the converted metadata


def converted_metadata(src: str | os.PathLike, mesh: str, local_files: str, rank: int) -> tuple[bytes, int]:
    """The metadata ckptconv writes for ``from-universal SRC --mesh MESH --plan llama --local-files
    LOCAL_FILES`` (``dedup``: ``.metadata``; ``rank``: rank ``rank``'s ``__<rank>.metadata``), from
    its planning alone, and the number of chunk entries the whole output's metadata holds."""
    import converter.commands.from_universal as fu

    captured: dict = {}
    run, output = fu.run_conversion, fu.dcp_output
    fu.run_conversion = lambda conversion, options: captured.setdefault("conversion", conversion)
    fu.dcp_output = lambda writer, **kw: writer  # the writer open_output builds (pure until prepare)
    try:
        fu.from_universal(src, Path(src).parent / "never-written", mesh, plan="llama", local_files=local_files)
        writer = captured["conversion"].open_output(Path(src).parent / "never-written")
    finally:
        fu.run_conversion, fu.dcp_output = run, output
    if local_files == "dedup":
        data = writer.metadata_bytes()
        return data, -1  # counted from the metadata itself
    items = writer.rank_items()
    return writer.rank_metadata_bytes(rank, items[rank]), sum(len(c) for c, _ in items.values())


# ----------------------------------------------------------------------------- the rank's state dict


def rank_state(shape: syn.Shape, mesh, extra: list[str]) -> dict:
    """``{"model", "optim"[, "extra"]}`` as ``get_state_dict(model, AdamW)`` holds it on this rank of
    ``mesh`` (``(dp_shard, tp)``): meta-device DTensors with FSDP2-over-TP placements."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    tp = mesh["tp"].size()

    def dtensor(fqn: str, gshape: tuple[int, ...]) -> DTensor:
        placements = syn.fsdp_tp_placements(syn.tp_dim(fqn), tp)
        local, _ = compute_local_shape_and_global_offset(gshape, mesh, placements)
        stride = tuple(math.prod(gshape[i + 1:]) for i in range(len(gshape)))
        return DTensor.from_local(torch.empty(local, device="meta"), mesh, placements, shape=torch.Size(gshape),
                                  stride=stride, run_check=False)

    params = syn.parameters(shape)
    model = {fqn: dtensor(fqn, s) for fqn, s in params}
    state = {fqn: {"step": torch.zeros(()), "exp_avg": dtensor(fqn, s), "exp_avg_sq": dtensor(fqn, s)}
             for fqn, s in params}
    group = {**syn.param_group(), "params": [fqn for fqn, _ in params]}
    out = {"model": model, "optim": {"state": state, "param_groups": [group]}}
    if extra:
        out["extra"] = {name: 0 for name in extra}
    return out


def plan_rank(metadata_path: str, shape: syn.Shape, mesh_text: str, rank: int, world_plans: int,
              extra: Sequence[str] = (), repeats: int = 1) -> dict:
    """Torch's load planning for ``rank`` of a job on ``mesh_text`` against ``metadata_path`` (a
    ``.metadata``, or a rank's ``__<rank>.metadata``), in this process under a fake process group of
    the job's world: wall and CPU seconds per step (each the minimum over ``repeats`` rounds),
    chunk counts and the coverage check."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from converter.plan.mesh import parse_mesh

    layout = {d.name: d.size for d in parse_mesh(mesh_text).dims}  # ckptconv's order: dp_shard outer, tp inner
    if tuple(layout) != ("dp_shard", "tp"):
        raise SystemExit(f"--mesh {mesh_text}: the rank's state dict is built for FSDP2 over TP (tpN,dpM)")
    world = math.prod(layout.values())
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))
        t0 = time.perf_counter()
        state = rank_state(shape, mesh, list(extra))
        build_s = time.perf_counter() - t0
        folder, name = os.path.split(metadata_path)
        wall: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for _ in range(repeats):
            reader, planner, resolve = FileSystemReader(folder), DefaultLoadPlanner(), _Resolution()
            steps = {"read_metadata": lambda: reader.read_metadata(rank=rank) if name != ".metadata"
                     else reader.read_metadata(),
                     "set_up_planner": lambda: planner.set_up_planner(state, md, rank == 0),
                     "create_local_plan": lambda: planner.create_local_plan(),
                     "create_global_plan": lambda: planner.create_global_plan([local] * world_plans)[0],
                     "finish_plan": lambda: planner.finish_plan(central)}
            got: dict[str, object] = {}
            for step, fn in steps.items():
                w, c = time.perf_counter(), time.process_time()
                with resolve if step == "create_local_plan" else contextlib.nullcontext():
                    got[step] = fn()
                w, c = time.perf_counter() - w, time.process_time() - c
                wall[step], cpu[step] = min(w, wall.get(step, w)), min(c, cpu.get(step, c))
                md = got.get("read_metadata")
                local = got.get("create_local_plan")
                central = got.get("create_global_plan")
            wall["resolve"] = min(resolve.wall, wall.get("resolve", resolve.wall))
            cpu["resolve"] = min(resolve.cpu, cpu.get("resolve", resolve.cpu))
        flat = planner.state_dict
        own = sum(1 for v in flat.values() if isinstance(v, torch.Tensor))
        need = sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel()
                   for v in flat.values() if isinstance(v, torch.Tensor))
        read = sum(math.prod(it.lengths) for it in local.items if it.type.name != "BYTE_IO")
        chunks = sum(len(m.chunks) for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata))
    finally:
        dist.destroy_process_group()
    resolve_s, resolve_cpu = wall.pop("resolve"), cpu.pop("resolve")
    return {"seconds": {k: round(v, 4) for k, v in wall.items()}, "cpu_seconds": {k: round(v, 4) for k, v in cpu.items()},
            "planning_s": round(sum(wall.values()), 4), "planning_cpu_s": round(sum(cpu.values()), 4),
            "resolve_s": round(resolve_s, 4), "resolve_cpu_s": round(resolve_cpu, 4),
            "metadata_dependent_s": round(wall["read_metadata"] + resolve_s, 4),
            "metadata_dependent_cpu_s": round(cpu["read_metadata"] + resolve_cpu, 4),
            "build_state_s": round(build_s, 3), "own_chunks": own, "read_items": len(local.items),
            "metadata_chunks": chunks, "metadata_keys": len(md.state_dict_metadata), "covered": read == need,
            "needed_elements": need, "read_elements": read, "global_plans": world_plans, "repeats": repeats}


class _Resolution:
    """Times torch's read-item resolution while entered (``create_read_items_for_chunk_list``: each
    local chunk against the stored chunks of its key), the part of ``create_local_plan`` that
    reads the metadata; the rest of it computes the rank's own chunks from its DTensors."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> _Resolution:
        from torch.distributed.checkpoint import planner_helpers as ph

        self._orig = orig = ph.create_read_items_for_chunk_list

        def timed(*a, **kw):
            w, c = time.perf_counter(), time.process_time()
            try:
                return orig(*a, **kw)
            finally:
                self.wall += time.perf_counter() - w
                self.cpu += time.process_time() - c

        ph.create_read_items_for_chunk_list = timed
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed.checkpoint import planner_helpers as ph

        ph.create_read_items_for_chunk_list = self._orig


# ----------------------------------------------------------------------------- children, guarded


def run_guarded(cmd: list[str], max_rss_gb: float) -> dict:
    """Run ``cmd``; its exit status, wall seconds, output, and whether the guard killed it for
    passing ``max_rss_gb`` (its RSS polled every 0.2 s)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    killed: dict = {}

    def guard() -> None:
        status = Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:
            try:
                rss = int(status.read_text().split("VmRSS:")[1].split()[0]) * 1024
            except (OSError, IndexError, ValueError):
                return
            if rss > max_rss_gb * (1 << 30):
                killed.update(at_gib=round(rss / (1 << 30), 2), after_s=round(time.perf_counter() - t0, 1))
                proc.kill()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=guard, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    watcher.join()
    return {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 2), "stdout": out, "stderr": err[-3000:],
            "killed": killed or None}


def child_rss(cmd: list[str], max_rss_gb: float) -> dict:
    """:func:`run_guarded` with the child's own peak RSS (it prints ``RSS <KiB>`` last)."""
    r = run_guarded(cmd, max_rss_gb)
    lines = r["stdout"].strip().splitlines()
    if r["rc"] == 0 and lines and lines[-1].startswith("RSS "):
        r["peak_rss_gib"] = round(int(lines[-1].split()[1]) / (1 << 20), 3)
        r["result"] = json.loads(lines[-2])
    return r


def _print_result(doc: dict) -> None:
    print(json.dumps(doc))
    print(f"RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)


# ----------------------------------------------------------------------------- the cases


def source(cache: Path, model: str, world: int, max_rss_gb: float) -> dict:
    """The cached synthetic checkpoint (built in a guarded child when missing)."""
    root = cache / f"{model}_dp{world}"
    if not (root / ".metadata").is_file():
        r = run_guarded([sys.executable, str(BENCH / "synthetic_metadata.py"), str(root), "--model", model,
                         "--world", str(world)], max_rss_gb)
        if r["rc"] != 0:
            return {"path": str(root), "error": r["killed"] and f"killed at {r['killed']['at_gib']} GiB" or r["stderr"]}
    return {"path": str(root), "metadata_bytes": (root / ".metadata").stat().st_size}


def run_case(spec: str, mesh: str, rank: int, cache: Path, max_rss_gb: float) -> dict:
    model, world = spec.split(":")
    src = source(cache, model, int(world), max_rss_gb)
    row: dict = {"case": spec, "model": model, "source_world": int(world), "target": mesh, "rank": rank,
                 "source": src, "variants": {}}
    if "error" in src:
        row["error"] = f"synthetic source not built: {src['error']}"
        return row
    me = [sys.executable, str(Path(__file__).resolve())]
    for variant in VARIANTS:
        entry: dict = {}
        if variant == "original":
            path = Path(src["path"]) / ".metadata"
        else:
            path = Path(src["path"] + f"-{mesh.replace(',', '_')}-{variant}") / (
                ".metadata" if variant == "dedup" else f"__{rank}.metadata")
            conv = child_rss([*me, "--convert", src["path"], mesh, variant, str(rank), str(path)], max_rss_gb)
            entry["convert"] = {k: conv.get(k) for k in ("rc", "wall_s", "peak_rss_gib", "killed", "result")}
            if conv["rc"] != 0:
                entry["error"] = conv["killed"] and f"conversion planning killed at {conv['killed']['at_gib']} GiB" \
                    or conv["stderr"][-800:]
                row["variants"][variant] = entry
                continue
        entry["metadata_bytes"] = path.stat().st_size
        plan = child_rss([*me, "--plan-child", str(path), model, mesh, str(rank), variant], max_rss_gb)
        entry.update({k: plan.get(k) for k in ("rc", "wall_s", "peak_rss_gib", "killed")})
        if plan["rc"] == 0:
            entry.update(plan["result"])
        else:
            entry["error"] = plan["killed"] and (f"killed at {plan['killed']['at_gib']} GiB after "
                                                 f"{plan['killed']['after_s']} s") or plan["stderr"][-800:]
        row["variants"][variant] = entry
        print(f"{spec} {variant}: {_cells(row, variant)}", flush=True)
    return row


def _cells(row: dict, variant: str) -> str:
    e = row["variants"].get(variant, {})
    if "error" in e:
        return f"{e['error']}"
    s = e["seconds"]
    ckpt = e.get("checkpoint_chunks", e["metadata_chunks"])
    return (f"{e['planning_s']:.2f} s (read_metadata {s['read_metadata']:.2f}, set_up {s['set_up_planner']:.2f}, "
            f"local {s['create_local_plan']:.2f} of which resolution {e['resolve_s']:.2f}, global {s['create_global_plan']:.3f}, finish {s['finish_plan']:.3f}) "
            f"| {e['peak_rss_gib']:.2f} GiB | own chunks {e['own_chunks']} | read items {e['read_items']} | "
            f"chunks in the metadata read {e['metadata_chunks']} | in the checkpoint {ckpt} | covered {e['covered']}")


def table(rows: list[dict]) -> str:
    out = ["| source | target rank | metadata | .metadata read MB | planning s (read_metadata / set_up / local [of "
           "which read-item resolution] / global / finish) | peak RSS GiB | rank's own chunks | read items | chunks in the metadata read | "
           "chunks in the checkpoint |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for v in VARIANTS:
            e = r["variants"].get(v)
            head = f"| {r['model'].upper()} DP{r['source_world']} | {r['target']} rank {r['rank']} | {v} |"
            if e is None or "error" in e:
                out.append(f"{head} | {(e or {}).get('error', r.get('error', 'not run'))} | | | | | | |")
                continue
            s = e["seconds"]
            out.append(f"{head} {e['metadata_bytes'] / 1e6:.1f} | **{e['planning_s']:.2f}** ({s['read_metadata']:.2f} / "
                       f"{s['set_up_planner']:.2f} / {s['create_local_plan']:.2f} [{e['resolve_s']:.2f}] / "
                       f"{s['create_global_plan']:.3f} / "
                       f"{s['finish_plan']:.3f}) | {e['peak_rss_gib']:.2f} | {e['own_chunks']} | {e['read_items']} | "
                       f"{e['metadata_chunks']} | {e.get('checkpoint_chunks', e['metadata_chunks'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--convert"]:  # child: SRC MESH VARIANT RANK OUT
        src, mesh, variant, rank, out = argv[1:]
        t0 = time.perf_counter()
        data, entries = converted_metadata(src, mesh, variant, int(rank))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_bytes(data)
        _print_result({"seconds": round(time.perf_counter() - t0, 2), "checkpoint_chunk_entries": entries})
        return
    if argv[:1] == ["--plan-child"]:  # child: METADATA MODEL MESH RANK VARIANT
        path, model, mesh, rank, variant = argv[1:]
        world = math.prod(d.size for d in __import__("converter.plan.mesh", fromlist=["x"]).parse_mesh(mesh).dims)
        _print_result(plan_rank(path, syn.PRESETS[model], mesh, int(rank), 1 if variant == "rank" else world))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="MODEL:SOURCE_DP (synthetic FSDP2 source)")
    p.add_argument("--mesh", default="tp8,dp16", help="the target job's mesh")
    p.add_argument("--rank", type=int, default=77)
    p.add_argument("--cache", default=str(BENCH / "out" / "scale"), help="synthetic sources and converted metadata")
    p.add_argument("--max-rss-gb", type=float, default=6.0, help="kill a child whose RSS passes this")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = []
    for spec in a.cases:
        load = os.getloadavg()[0]
        row = run_case(spec, a.mesh, a.rank, Path(a.cache), a.max_rss_gb)
        for e in row["variants"].values():  # the whole output's chunk entries, from the conversion
            n = ((e.get("convert") or {}).get("result") or {}).get("checkpoint_chunk_entries", -1)
            if n >= 0:
                e["checkpoint_chunks"] = n
        row["load_avg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        rows.append(row)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = Path(a.out) if a.out else BENCH / "results" / f"load_planning-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"commit": commit, "cpus": os.cpu_count(), "mesh": a.mesh, "rank": a.rank,
                               "max_rss_gb": a.max_rss_gb, "rows": rows}, indent=1))
    print(table(rows))
    print(out)


if __name__ == "__main__":
    main()
