"""The resumed job's load: the original checkpoint resharded online by DCP vs ckptconv's output.

For each world size W (``--worlds``) and target layout (FSDP2 ``dp<W>`` and TP2 x FSDP2
``tp2,dp<W/2>``, built as ckptconv orders the mesh: ``dp_shard`` outer, ``tp`` inner; a job whose
mesh order differs loads the dedup output correctly but slower, and from a rank-local output
silently loads only the overlap of its boxes with its rank's metadata: torch checks no coverage), the source (``make_checkpoint.py``: a 4-rank FSDP2 ``dcp.save`` of torchtitan's
Llama + AdamW) is converted by ``ckptconv from-universal --plan llama`` twice: the default
(``dedup``: one ``.metadata``, a replicated box stored once) and ``--local-files rank`` (rank-local
``__<R>.metadata``, every rank's file holds all it loads). Then a W-rank gloo job
(``torchrun --standalone --nproc-per-node W``, as a job starts; ``--launcher spawn``:
``torch.multiprocessing`` spawn; CPU) builds the target model on the meta device, materializes
its shards and AdamW state, and ``dcp.load``\\ s each of the three checkpoints with torch's own
``FileSystemReader`` and ``DefaultLoadPlanner`` (page cache of the checkpoint dropped first,
``posix_fadvise(DONTNEED)``). Per rank it records:

- ``wall_s``: ``dcp.load`` from the barrier before it to its return;
- ``plan_s``: ``read_metadata`` + the planner's ``set_up_planner``, ``create_local_plan`` (read-item
  resolution), ``create_global_plan`` and ``finish_plan``;
- ``read_s``: ``read_data``; ``bytes``: storage bytes of the items it read; ``files``: files they
  lie in; ``foreign_bytes``: bytes read from files other than ``__<rank>_0.distcp`` (what a rank
  with only its own file on local disk could not read);
- ``read_data`` split up (``PHASES``): ``io_s`` (in the file view's reads), ``load_s``
  (``torch.load`` of each item, ``io_s`` included), ``copy_s`` (narrow + ``copy_`` into the
  target), ``requests``, ``read_calls``, ``backward`` (items read after a later part of the same
  file: a seek back) and ``skipped_bytes``; ``cpu_s``: the rank's user + system CPU seconds in
  ``dcp.load``; ``cached_before`` (rank 0): the fraction of the checkpoint's pages in the page
  cache after the eviction (``mincore``).

    python bench/load_payoff.py --size 400MB --worlds 4,8 --repeats 2

Results: ``bench/results/load_payoff-<time>.json`` (every rank, every round, the load average).
The plot: ``bench/plot_load_payoff.py RESULT.json``; the load planning of one rank at scale
(synthetic 70B/405B ``.metadata``): ``bench/load_planning_scale.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from make_checkpoint import _free_port, make_checkpoint, parse_size  # noqa: E402
from run import drop_from_cache, read_through  # noqa: E402

VARIANTS = ("original", "dedup", "rank")
#: What ``read_data`` is split into, per rank: seconds in the file view's reads (``io_s``, inside
#: ``load_s``), in ``torch.load`` of each item (``load_s``), in the narrow + ``copy_`` into the
#: target (``copy_s``); counts of read items, of the view's read calls, of items that start before
#: the end of an item read earlier from the same file (``backward``: the reader seeks back) and
#: bytes jumped over forward (``skipped_bytes``).
PHASES = ("io_s", "load_s", "copy_s", "requests", "read_calls", "backward", "skipped_bytes")


def target_meshes(world: int) -> list[str]:
    return [f"dp{world}", f"tp2,dp{world // 2}"]


def convert(src: str, out: Path, mesh: str, variant: str) -> float:
    """``ckptconv from-universal`` (DCP in, DCP out); its wall seconds."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "converter", "from-universal", src, str(out), "--mesh", mesh, "--plan", "llama"]
    if variant == "rank":
        cmd += ["--local-files", "rank"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - t0


def evict(path: Path) -> None:
    """Drop ``path``'s files from the page cache (after writeback), each read once first, so that a
    VM host's page cache holds every checkpoint alike (``run.read_through``: without it, which
    checkpoint this VM's host happens to hold decides the race)."""
    files = [f for f in path.iterdir() if f.is_file()]
    os.sync()
    read_through(files)
    drop_from_cache(files)


def resident_fraction(path: Path) -> float:
    """The fraction of ``path``'s ``.distcp`` pages in the page cache (``mincore`` of a mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for f in sorted(path.glob("*.distcp")):
        size = f.stat().st_size
        if not size:
            continue
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {f}")
            try:
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {f}")
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        resident += sum(v & 1 for v in bytes(vec))
        total += pages
    return resident / total if total else 0.0


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# ----------------------------------------------------------------------------- the load job


def _target_state(args, layout: dict[str, int], mesh, device: str = "cpu"):
    """The target model's and AdamW state dict (DTensors over ``mesh``, local shards on
    ``device``), values arbitrary."""
    import torch
    from models import Transformer, apply_fsdp, apply_tp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with torch.device("meta"):
        model = Transformer(args)
    if layout.get("tp", 1) > 1:
        apply_tp(model, mesh["tp"])
    apply_fsdp(model, mesh["dp_shard"])
    model.to_empty(device=device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    for p in model.parameters():  # the state a step would create, without the step
        optim.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "extra": {"step": 0}}


def _local_nbytes(state) -> int:
    """The bytes of this rank's tensors in ``state`` (DTensors: the local shard): a load that read
    fewer stored bytes cannot have filled them."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(state)
    local = [v.to_local() if isinstance(v, DTensor) else v for v in flat.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in local)


class _TimedView:
    """A file view whose reads are timed and counted into ``phases`` (``io_s``, ``read_calls``)."""

    def __init__(self, view, phases):
        self._view, self._phases = view, phases

    def read(self, *a):
        t = time.perf_counter()
        try:
            return self._view.read(*a)
        finally:
            self._phases["io_s"] += time.perf_counter() - t
            self._phases["read_calls"] += 1

    def readinto(self, b):
        t = time.perf_counter()
        try:
            return self._view.readinto(b)
        finally:
            self._phases["io_s"] += time.perf_counter() - t
            self._phases["read_calls"] += 1

    def __getattr__(self, name):
        return getattr(self._view, name)


def _served_order(plan, storage_data):
    """``plan``'s items in the order torch's ``FileSystemReader.read_data`` reads them: grouped by
    file (files in first-request order), each file's requests in plan order."""
    per_file: dict[str, list] = {}
    for item in plan.items:
        per_file.setdefault(storage_data[item.storage_index].relative_path, []).append(item)
    return [item for items in per_file.values() for item in items]


def _measured(rank: int):
    """Torch's FileSystemReader and DefaultLoadPlanner, timed and counted."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        seconds = 0.0

        def _timed(self, name, *a, **kw):
            t0 = time.perf_counter()
            try:
                return getattr(super(), name)(*a, **kw)
            finally:
                Planner.seconds += time.perf_counter() - t0

        def set_up_planner(self, *a, **kw):
            return self._timed("set_up_planner", *a, **kw)

        def create_local_plan(self, *a, **kw):
            return self._timed("create_local_plan", *a, **kw)

        def create_global_plan(self, *a, **kw):
            return self._timed("create_global_plan", *a, **kw)

        def finish_plan(self, *a, **kw):
            return self._timed("finish_plan", *a, **kw)

    class Reader(FileSystemReader):
        def __init__(self, path):
            super().__init__(path)
            self.md_s, self.read_s, self.by_file = 0.0, 0.0, Counter()
            self.phases = Counter()  # io_s, load_s, copy_s, requests, read_calls, backward, skipped_bytes

        def read_metadata(self, *args, **kwargs):  # "kwargs": dcp.load passes rank= only to that name
            t0 = time.perf_counter()
            try:
                return super().read_metadata(*args, **kwargs)
            finally:
                self.md_s += time.perf_counter() - t0

        def _slice_file(self, file, sinfo):
            return _TimedView(super()._slice_file(file, sinfo), self.phases)

        def read_data(self, plan, planner):
            import torch

            ends: dict[str, int] = {}
            for item in plan.items:  # in the order read_data serves them: grouped by file, then plan order
                info = self.storage_data[item.storage_index]
                self.by_file[info.relative_path] += info.length
            for item in _served_order(plan, self.storage_data):
                info = self.storage_data[item.storage_index]
                end = ends.get(info.relative_path)  # where the previous read in this file ended
                if end is not None and info.offset < end:
                    self.phases["backward"] += 1
                elif end is not None:
                    self.phases["skipped_bytes"] += info.offset - end
                ends[info.relative_path] = info.offset + info.length
            self.phases["requests"] += len(plan.items)
            load, phases = torch.load, self.phases

            def timed_load(*a, **kw):
                t = time.perf_counter()
                try:
                    return load(*a, **kw)
                finally:
                    phases["load_s"] += time.perf_counter() - t

            resolve, commit = planner.resolve_tensor, planner.commit_tensor
            resolved = [0.0]

            def timed_resolve(req):
                out = resolve(req)
                resolved[0] = time.perf_counter()
                return out

            def timed_commit(req, tensor):
                phases["copy_s"] += time.perf_counter() - resolved[0]
                return commit(req, tensor)

            planner.resolve_tensor, planner.commit_tensor = timed_resolve, timed_commit
            torch.load = timed_load
            t0 = time.perf_counter()
            try:
                fut = super().read_data(plan, planner)
                fut.wait()
            finally:
                torch.load = load
                del planner.resolve_tensor, planner.commit_tensor
            self.read_s += time.perf_counter() - t0
            return fut

    return Reader, Planner


def round_robin(cases: list, round_: int) -> list:
    """``cases`` in round ``round_``'s order: rotated by one case per round, so that no case is
    always loaded first (after the job's start) or always right after the same other case."""
    k = round_ % len(cases)
    return cases[k:] + cases[:k]


def _load_rank(rank: int, world: int, port: int, args_json: dict, cases: list[tuple[str, str, str]],
               repeats: int, out: str, device: str = "cpu", warmup: int = 1) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from models import ModelArgs
    from torch.distributed.device_mesh import init_device_mesh

    from converter.plan.mesh import parse_mesh

    torch.set_num_threads(1)
    if port is not None:  # spawned; under torchrun its env:// (MASTER_ADDR/PORT, RANK, WORLD_SIZE) is set
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)  # dcp.load's collectives are on CPU objects
    if device == "cuda":  # the ranks share the machine's GPUs round-robin (one GPU: all on cuda:0)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    args = ModelArgs.from_json(args_json)
    reports = []
    try:
        states = {}  # one target state per mesh, shared by its cases: the rounds interleave the cases
        for mesh_text, _, _ in cases:
            if mesh_text not in states:
                # ckptconv's order: dp_shard outer, tp inner
                layout = {d.name: d.size for d in parse_mesh(mesh_text).dims}
                mesh = init_device_mesh(device, tuple(layout.values()), mesh_dim_names=tuple(layout))
                states[mesh_text] = _target_state(args, layout, mesh, device)
        for round_ in range(-warmup, repeats):
            for mesh_text, variant, path in round_robin(cases, round_):
                state = states[mesh_text]
                if rank == 0:
                    evict(Path(path))
                Reader, Planner = _measured(rank)
                Planner.seconds = 0.0
                cached = resident_fraction(Path(path)) if rank == 0 else None
                reader = Reader(path)
                dist.barrier()
                c0, t0 = _cpu_seconds(), time.perf_counter()
                dcp.load(state, storage_reader=reader, planner=Planner())
                if device == "cuda":
                    torch.cuda.synchronize()  # the copies into the GPU shards are done
                wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
                own = f"__{rank}_0.distcp"
                needed = _local_nbytes(state)
                reports.append({"mesh": mesh_text, "variant": variant, "round": round_, "warmup": round_ < 0,
                                "rank": rank, "device": device,
                                "wall_s": wall, "plan_s": reader.md_s + Planner.seconds, "read_s": reader.read_s,
                                "bytes": sum(reader.by_file.values()), "files": len(reader.by_file),
                                "foreign_bytes": sum(n for f, n in reader.by_file.items() if f != own),
                                "needed_bytes": needed, "short": sum(reader.by_file.values()) < needed,
                                "cpu_s": cpu, "cached_before": cached,
                                **{k: reader.phases[k] for k in PHASES}})
                dist.barrier()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(reports))
        dist.barrier()
        dist.destroy_process_group()


def load_world(world: int, args_json: dict, cases: list[tuple[str, str, str]], repeats: int,
               launcher: str = "torchrun", device: str = "cpu", warmup: int = 1) -> list[dict]:
    """Every rank's reports of a ``world``-rank load job: ``torchrun --standalone --nproc-per-node
    world`` running this file's ``--rank-worker`` (the default, as a job starts), or
    ``torch.multiprocessing`` spawn."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if launcher == "torchrun":
            spec = Path(tmp, "spec.json")
            spec.write_text(json.dumps({"args_json": args_json, "cases": cases, "repeats": repeats, "out": tmp,
                                        "device": device, "warmup": warmup}))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   str(Path(__file__).resolve()), "--rank-worker", str(spec)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            subprocess.run(cmd, check=True, env=env)
        else:
            import torch.multiprocessing as mp

            mp.spawn(_load_rank, args=(world, _free_port(), args_json, cases, repeats, tmp, device, warmup),
                     nprocs=world,
                     join=True)
        return [r for k in range(world) for r in json.loads(Path(tmp, f"rank{k}.json").read_text())]


def rank_worker(spec_path: str) -> None:
    """One rank of the torchrun load job (RANK / WORLD_SIZE from torchrun)."""
    spec = json.loads(Path(spec_path).read_text())
    _load_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, spec["args_json"],
               [tuple(c) for c in spec["cases"]], spec["repeats"], spec["out"], spec.get("device", "cpu"),
               spec.get("warmup", 1))


# ----------------------------------------------------------------------------- report


def summarize(rows: list[dict]) -> list[dict]:
    """Per (world, mesh, variant), over the timed rounds (warm-up rounds left out): medians of the
    slowest rank's wall and of the per-rank maxima of planning, bytes, files and foreign bytes; the
    best round (``best_s``); and ``x_original``, the median over rounds of the slowest rank's wall
    divided by the original's in the same round (a paired ratio: the rounds interleave the cases,
    so the machine's slow spells fall on both)."""
    out = []
    rows = [r for r in rows if not r.get("warmup")]
    slowest = {}  # (world, mesh, variant, round) -> the slowest rank's wall
    for r in rows:
        k = (r["world"], r["mesh"], r["variant"], r["round"])
        slowest[k] = max(slowest.get(k, 0.0), r["wall_s"])
    keys = sorted({(r["world"], r["mesh"], r["variant"]) for r in rows}, key=lambda k: (k[0], k[1], VARIANTS.index(k[2])))
    for world, mesh, variant in keys:
        mine = [r for r in rows if (r["world"], r["mesh"], r["variant"]) == (world, mesh, variant)]
        rounds = sorted({r["round"] for r in mine})

        def med(field, agg=max):
            return statistics.median(agg(r[field] for r in mine if r["round"] == k) for k in rounds)

        paired = [slowest[(world, mesh, variant, k)] / slowest[(world, mesh, "original", k)] for k in rounds
                  if (world, mesh, "original", k) in slowest]
        out.append({"world": world, "mesh": mesh, "variant": variant, "wall_s": round(med("wall_s"), 3),
                    "best_s": round(min(slowest[(world, mesh, variant, k)] for k in rounds), 3),
                    **({"x_original": round(statistics.median(paired), 3),
                        "x_original_ci90": [round(x, 3) for x in median_ci90(paired)]} if paired else {}),
                    "plan_s": round(med("plan_s"), 3), "read_s": round(med("read_s"), 3),
                    "max_rank_MB": round(med("bytes") / 1e6, 1), "total_MB": round(med("bytes", sum) / 1e6, 1),
                    "max_files": int(med("files")), "foreign_MB": round(med("foreign_bytes", sum) / 1e6, 1),
                    "short_ranks": sum(r["short"] for r in mine),
                    **({"io_s": round(med("io_s"), 3), "copy_s": round(med("copy_s"), 3),
                        "cpu_s_all": round(med("cpu_s", sum), 2), "backward": int(med("backward"))}
                       if all("io_s" in r for r in mine) else {})})
    return out


def median_ci90(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 90 % bootstrap interval of the median of ``values`` (percentile method, fixed seed)."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return meds[int(0.05 * resamples)], meds[int(0.95 * resamples) - 1]


def table(summary: list[dict]) -> str:
    cols = ["world", "mesh", "variant", "wall_s", "best_s", "x_original", "x_original_ci90", "plan_s", "read_s", "io_s", "copy_s", "cpu_s_all", "backward",
            "max_rank_MB", "total_MB", "max_files", "foreign_MB", "short_ranks"]
    cols = [c for c in cols if all(c in s for s in summary)]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(str(s[c]) for c in cols) + " |" for s in summary]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="2GB", help="source checkpoint size (make_checkpoint.py; cached in bench/out)")
    p.add_argument("--worlds", default="4,8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed rounds of every case first (this VM's host caches the guest disk: a file not "
                        "read for ~20 s reads 2-5x slower once, whoever wrote it; see bench/README)")
    p.add_argument("--work", default=str(BENCH / "out" / "load_payoff"), help="where the converted checkpoints go")
    p.add_argument("--out", default=None)
    p.add_argument("--launcher", choices=("torchrun", "spawn"), default="torchrun",
                   help="how the load job starts its ranks (torchrun --standalone, or torch.multiprocessing spawn)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the load job's DTensor shards live (cuda: the ranks share the GPUs round-robin; the "
                        "process group stays gloo, dcp.load copies each read into the GPU shard)")
    p.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rank_worker:
        return rank_worker(a.rank_worker)
    info = make_checkpoint(parse_size(a.size))
    src, work = info["path"], Path(a.work)
    rows, conversions = [], []
    for world in map(int, a.worlds.split(",")):
        cases = []
        for mesh in target_meshes(world):
            cases.append((mesh, "original", src))
            for variant in ("dedup", "rank"):
                out = work / f"{mesh.replace(',', '_')}-{variant}"
                conversions.append({"mesh": mesh, "variant": variant, "seconds": round(convert(src, out, mesh, variant), 2)})
                cases.append((mesh, variant, str(out)))
        rows += [{**r, "world": world} for r in load_world(world, info["model_args"], cases, a.repeats, a.launcher,
                                                            a.device, a.warmup)]
        for mesh in target_meshes(world):
            for variant in ("dedup", "rank"):
                shutil.rmtree(work / f"{mesh.replace(',', '_')}-{variant}", ignore_errors=True)
    summary = summarize(rows)
    doc = {"source": {k: info[k] for k in ("path", "bytes", "params", "world")}, "worlds": a.worlds,
           "repeats": a.repeats, "warmup": a.warmup, "launcher": a.launcher, "device": a.device, "loadavg": os.getloadavg(), "cpu_count": os.cpu_count(),
           "conversions": conversions, "summary": summary, "rows": rows}
    out = Path(a.out) if a.out else BENCH / "results" / f"load_payoff-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(table(summary))
    print(f"load average {os.getloadavg()}; {out}")


if __name__ == "__main__":
    main()