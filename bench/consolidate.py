"""Benchmark: consolidating DCP's per-rank safetensors, torch's consolidation vs ``ckptconv consolidate``.

One command (rerun it as is; ~10-20 min on 2 shared cores at the default 1GB)::

    python bench/consolidate.py                      # 1GB, layouts fsdp4 and tp2dp2, 1 round
    python bench/consolidate.py --size 2GB --repeats 3 --layouts tp2dp2

The input is a real save: a 4-rank gloo job (``torch.multiprocessing``) ``dcp.save``-s a
Llama-shaped fp32 state (dim 1024, vocab 32000, layers to reach the size) through
``HuggingFaceStorageWriter(save_distributed=True)``: ``fsdp4`` (every tensor ``Shard(0)`` over 4
ranks: row shards) or ``tp2dp2`` (2-D: FSDP rows x TP, row-wise weights split on columns, norms
replicated over tp: the column shards torch's consolidation copies row by row). Cached under
``bench/out/consolidate-<size>-<layout>/``.

Steps, each a subprocess timed from start to exit (``run.measure``: the input evicted from the
page cache first, peak RSS of the process tree, CPU seconds), outputs compared byte for byte:

| step | what runs |
| --- | --- |
| torch, 1 file | ``consolidate_safetensors_files(sharded, out, mapping)`` (what ``HuggingFaceStorageWriter(enable_consolidation=True)`` runs on rank 0) |
| torch, split | the same with ``--split`` files and ``num_threads=2`` |
| torch, split, 2 ranks | ``consolidate_safetensors_files_on_every_rank`` under ``torchrun --nproc-per-node 2`` (what torchtitan runs with a hub index) |
| ckptconv, 1 file / split / split 2 ranks | ``ckptconv consolidate sharded out [--max-shard-size S]``, the last under torchrun |

The mapping handed to torch is ckptconv's own file split and order (its index), so both write the
same files. Results: ``bench/results/<date>-consolidate-<size>.json`` (with the machine's load).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from make_checkpoint import parse_size, size_label  # noqa: E402
from run import PY, ROOT, machine, measure  # noqa: E402

OUT = BENCH / "out"
LAYOUTS = ("fsdp4", "tp2dp2")
DIM, VOCAB, KV, HIDDEN = 1024, 32000, 256, 2816


# ----------------------------------------------------------------------------- the checkpoint (a torch job)


def shapes(size: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, kind) of a Llama-shaped state of about ``size`` bytes in fp32; kind is
    ``col`` (column-wise TP), ``row`` (row-wise TP), ``norm`` or ``embed``."""
    per_layer = 4 * (2 * DIM * DIM + 2 * KV * DIM + 3 * HIDDEN * DIM + 2 * DIM)
    layers = max(1, (size - 4 * 2 * VOCAB * DIM) // per_layer)
    out = [("model.tok_embeddings.weight", (VOCAB, DIM), "embed")]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "attention.wq.weight", (DIM, DIM), "col"), (p + "attention.wk.weight", (KV, DIM), "col"),
                (p + "attention.wv.weight", (KV, DIM), "col"), (p + "attention.wo.weight", (DIM, DIM), "row"),
                (p + "feed_forward.w1.weight", (HIDDEN, DIM), "col"), (p + "feed_forward.w2.weight", (DIM, HIDDEN), "row"),
                (p + "feed_forward.w3.weight", (HIDDEN, DIM), "col"), (p + "attention_norm.weight", (DIM,), "norm"),
                (p + "ffn_norm.weight", (DIM,), "norm")]
    return out + [("model.norm.weight", (DIM,), "norm"), ("model.output.weight", (VOCAB, DIM), "col")]


def _save_worker(rank: int, world: int, size: int, layout: str, out: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if layout == "fsdp4":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        place = {k: [Shard(0)] for k in ("col", "row", "norm", "embed")}
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        place = {"col": [Shard(0), Shard(0)], "row": [Shard(0), Shard(1)], "norm": [Shard(0), Replicate()],
                 "embed": [Shard(0), Shard(0)]}
    state = {}
    for i, (key, shape, kind) in enumerate(shapes(size)):
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, place[kind])
        g = torch.Generator().manual_seed(i * 131 + sum(offset))
        local = torch.randn(local_shape, generator=g)
        stride = tuple(int(torch.tensor(shape[d + 1:]).prod()) for d in range(len(shape)))
        state[key] = DTensor.from_local(local, mesh, place[kind], run_check=False, shape=torch.Size(shape),
                                        stride=stride)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
    dist.barrier()
    dist.destroy_process_group()


def make(size: int, layout: str) -> Path:
    """The cached per-rank save of ``size`` bytes in ``layout`` (built by a 4-rank job when missing)."""
    root = OUT / f"consolidate-{size_label(size)}-{layout}"
    done = root / "_done.json"
    if done.is_file():
        return root / "sharded"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    code = ("import sys, socket, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); import consolidate as c\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
            "mp.start_processes(c._save_worker, args=(4, int(sys.argv[2]), sys.argv[3], sys.argv[4], port), nprocs=4,"
            " start_method='spawn')\n")
    subprocess.run([PY, "-c", code, str(BENCH), str(size), layout, str(root / "sharded")], check=True, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    done.write_text(json.dumps({"size": size, "layout": layout}))
    return root / "sharded"


# ----------------------------------------------------------------------------- the steps


TORCH_ONE = ("import json, os, sys\n"
             "from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files\n"
             "m = json.load(open(sys.argv[3])); os.makedirs(sys.argv[2])\n"
             "consolidate_safetensors_files(sys.argv[1], sys.argv[2], m, num_threads=int(sys.argv[4]))\n")
TORCH_RANKS = ("import json, os, sys, torch.distributed as dist\n"
               "from torch.distributed.checkpoint._consolidate_hf_safetensors import "
               "consolidate_safetensors_files_on_every_rank as c\n"
               "dist.init_process_group('gloo'); m = json.load(open(sys.argv[3])); os.makedirs(sys.argv[2], exist_ok=True)\n"
               "c(sys.argv[1], sys.argv[2], m, num_threads=int(sys.argv[4])); dist.destroy_process_group()\n")


def _torchrun(n: int) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]


def steps(src: Path, work: Path, split: str, mappings: dict[str, Path]) -> list[tuple[str, list[str], Path, str]]:
    """(name, command, output dir, output kind) of every step."""
    ck = [PY, "-m", "converter", "consolidate", str(src)]
    out = []
    for kind, extra in (("one", []), ("split", ["--max-shard-size", split])):
        out.append((f"ckptconv consolidate ({kind})", [*ck, str(work / f"ck-{kind}"), *extra], work / f"ck-{kind}", kind))
    out.append(("ckptconv consolidate (split), torchrun 2 ranks",
                [*_torchrun(2), "-m", "converter", "consolidate", str(src), str(work / "ck-split2"),
                 "--max-shard-size", split], work / "ck-split2", "split"))
    out.append(("torch consolidate_safetensors_files (one)",
                [PY, "-c", TORCH_ONE, str(src), str(work / "t-one"), str(mappings["one"]), "1"], work / "t-one", "one"))
    out.append(("torch consolidate_safetensors_files (split, num_threads=2)",
                [PY, "-c", TORCH_ONE, str(src), str(work / "t-split"), str(mappings["split"]), "2"], work / "t-split",
                "split"))
    rank_script = work / "torch_ranks.py"
    rank_script.write_text(TORCH_RANKS)
    out.append(("torch consolidate_safetensors_files_on_every_rank (split), torchrun 2 ranks",
                [*_torchrun(2), str(rank_script), str(src), str(work / "t-split2"), str(mappings["split"]), "1"],
                work / "t-split2", "split"))
    return out


def _mapping(index_json: Path, dst: Path) -> Path:
    wmap = json.loads(index_json.read_text())["weight_map"]
    dst.write_text(json.dumps({k: int(v.split("-")[1]) for k, v in wmap.items()}))
    return dst


def _same(a: Path, b: Path) -> str:
    """"yes" (every file identical), "files; index order" (the safetensors files identical, the
    index the same entries in another order: torch's every-rank variant merges ranks' parts), "NO"."""
    names = sorted(p.name for p in a.glob("model*"))
    if names != sorted(p.name for p in b.glob("model*")):
        return "NO"
    differ = [n for n in names if subprocess.run(["cmp", "-s", str(a / n), str(b / n)]).returncode != 0]
    if not differ:
        return "yes"
    index = "model.safetensors.index.json"
    if differ == [index] and json.loads((a / index).read_text()) == json.loads((b / index).read_text()):
        return "files; index order"
    return "NO"


def bench(size: int, layout: str, split: str, repeats: int) -> dict:
    src = make(size, layout)
    work = OUT / f"consolidate-work-{size_label(size)}-{layout}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    mappings = {}
    for kind, extra in (("one", []), ("split", ["--max-shard-size", split])):  # ckptconv's split, for torch
        ref = work / f"ref-{kind}"
        subprocess.run([PY, "-m", "converter", "consolidate", str(src), str(ref), *extra], check=True, cwd=ROOT,
                       capture_output=True)
        mappings[kind] = _mapping(ref / "model.safetensors.index.json", work / f"map-{kind}.json")
    rows = []
    plan = steps(src, work, split, mappings)
    runs: dict[str, list] = {name: [] for name, *_ in plan}
    identical: dict[str, bool] = {}
    for _ in range(repeats):
        for name, cmd, out, kind in plan:
            shutil.rmtree(out, ignore_errors=True)
            run = measure(cmd, src, sync=True, cold=True)
            if run.rc != 0:
                raise RuntimeError(f"{name} failed: {run.tail}")
            runs[name].append(run)
            identical[name] = _same(out, work / f"ref-{kind}")
            shutil.rmtree(out, ignore_errors=True)
    in_bytes = sum(f.stat().st_size for f in src.iterdir())
    for name, rs in runs.items():
        rows.append({"step": name, "wall_s": statistics.median(r.wall_s for r in rs), "runs": [round(r.wall_s, 2) for r in rs],
                     "cpu_s": statistics.median(r.cpu_s for r in rs),
                     "peak_rss_mib": max(r.tree_peak_rss for r in rs) / 2**20,
                     "load_avg": [list(r.load_before) for r in rs], "cold": all(r.cold for r in rs),
                     "same_bytes_as_ckptconv": identical[name]})
    shutil.rmtree(work, ignore_errors=True)
    return {"size": size, "layout": layout, "split": split, "input_bytes": in_bytes, "files": len(list(src.iterdir())),
            "rows": rows}


def table(results: list[dict]) -> str:
    lines = ["| input | step | wall s (median) | runs | CPU s | peak RSS MiB | same bytes | load avg |",
             "|---|---|---:|---|---:|---:|---|---|"]
    for res in results:
        for r in res["rows"]:
            loads = ", ".join(f"{la[0]:.1f}" for la in r["load_avg"])
            lines.append(f"| {size_label(res['size'])} {res['layout']} | {r['step']} | {r['wall_s']:.2f} | "
                         f"{', '.join(map(str, r['runs']))} | {r['cpu_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                         f"{r['same_bytes_as_ckptconv']} | {loads} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1GB")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--split", default="256MB", help="--max-shard-size of the split steps")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    started = dt.datetime.now()
    results = [bench(size, layout, args.split, args.repeats) for layout in args.layouts.split(",")]
    doc = {"started": started.isoformat(timespec="seconds"), "machine": machine(), "results": results}
    out = Path(args.out) if args.out else BENCH / "results" / f"{started:%Y-%m-%dT%H%M}-consolidate-{size_label(size)}.json"
    out.write_text(json.dumps(doc, indent=1))
    print(table(results))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
