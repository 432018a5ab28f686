"""Make (and cache) a real DCP checkpoint for the benchmark: a 4-rank gloo FSDP2 training run.

The model is the torchtitan-style Llama of ``tests/support/models.py`` (so ``--plan llama`` applies),
sized so that params + AdamW ``exp_avg`` + ``exp_avg_sq`` (3x params, fp32) hit the target bytes.
Each rank builds its shard on the meta device (no rank ever holds the full model), fills it with
random values, runs one real training step (batch 1, seq 32) and ``dcp.save``s
``get_state_dict(model, optim)``.

Cached under ``bench/out/ckpt-<size>/`` (``ckpt/`` plus ``bench_ckpt.json``, written last).

    python bench/make_checkpoint.py make --size 2GB          # prints the checkpoint path
    python bench/make_checkpoint.py load --src CKPT --world 3  # online reshard: dcp.load into dp3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT = BENCH / "out"
INFO = "bench_ckpt.json"
SEQ, VOCAB = 32, 32000
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the fixtures' torchtitan-style Llama (models.py)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000 (decimal units; KiB/MiB/GiB binary)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"bad size {text!r}; use e.g. 2GB, 500MB, 1GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def size_label(n: int) -> str:
    """2_000_000_000 -> '2GB', 500_000_000 -> '0.5GB'."""
    return f"{n / 1e9:g}GB"


def model_args_for(target_bytes: int):
    """Llama hyperparameters whose params + 2 AdamW states (fp32) come closest to ``target_bytes``.

    Picks the widest model that still has at least 8 layers (else the deepest one), then the layer
    count.
    """
    from models import ModelArgs

    target_params = target_bytes / 12
    best, deepest = None, None
    for dim in (128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096):
        heads = max(4, dim // 128)
        base = ModelArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=heads // 2, vocab_size=VOCAB,
                         multiple_of=256, max_seq_len=SEQ)
        one = param_count(base)
        per_layer = param_count(ModelArgs(**{**asdict(base), "n_layers": 2})) - one
        layers = round((target_params - (one - per_layer)) / per_layer)
        if layers < 1:
            break
        args = ModelArgs(**{**asdict(base), "n_layers": layers})
        deepest = deepest or args
        if layers >= 8:
            best = args
    if deepest is None:
        raise ValueError(f"checkpoint size {target_bytes} too small for the benchmark model")
    return best or deepest


# ----------------------------------------------------------------------------- ranks


def param_count(args) -> int:
    """Parameters of the full model (built on the meta device: no memory, no init)."""
    import torch
    from models import Transformer

    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(args).parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(rank: int, world: int, port: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def _sharded_model(args, mesh, seed: int):
    """FSDP2 model built on meta, materialized shard by shard with random values."""
    import torch
    from models import Transformer, apply_fsdp, precompute_freqs_cis

    with torch.device("meta"):
        model = Transformer(args)
    apply_fsdp(model, mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed * 1000 + mesh.get_local_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=g)
        model.freqs_cis = precompute_freqs_cis(args.head_dim, args.max_seq_len * 2, args.rope_theta)
    return model


def _train_step(model, optim, args, step: int) -> float:
    import torch
    from models import compute_loss

    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, args.vocab_size, (1, SEQ + 1), generator=g)
    loss = compute_loss(model, tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def _save_rank(rank: int, world: int, port: int, args_json: dict, ckpt: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from models import ModelArgs
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = _setup(rank, world, port)
    try:
        args = ModelArgs.from_json(args_json)
        model = _sharded_model(args, mesh, seed=0)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
        for step in range(steps):
            _train_step(model, optim, args, step)
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd, "extra": {"step": steps}}, checkpoint_id=ckpt)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _load_rank(rank: int, world: int, port: int, args_json: dict, ckpt: str, out: str) -> None:
    """Online reshard: build the dp<world> model + AdamW state, dcp.load the checkpoint."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from models import ModelArgs
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _setup(rank, world, port)
    try:
        args = ModelArgs.from_json(args_json)
        model = _sharded_model(args, mesh, seed=1)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
        _train_step(model, optim, args, 0)  # creates the optimizer state the load fills
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        Path(out, f"rank{rank}.json").write_text(json.dumps({"load_seconds": time.perf_counter() - t0}))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _spawn(fn, world: int, *args) -> None:
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(world, _free_port(), *args), nprocs=world, join=True)


# ----------------------------------------------------------------------------- public API


def checkpoint_dir(size: int) -> Path:
    """Where the checkpoint of ``size`` bytes is cached."""
    return OUT / f"ckpt-{size_label(size)}"


def cached_info(size: int) -> dict | None:
    """The info of a complete cached checkpoint, or None."""
    path = checkpoint_dir(size) / INFO
    return json.loads(path.read_text()) if path.exists() else None


def make_checkpoint(size: int, world: int = 4, steps: int = 1, force: bool = False) -> dict:
    """Build (or reuse) the checkpoint; returns its info (``path``, ``bytes``, ``model_args``...)."""
    info = None if force else cached_info(size)
    if info is not None:
        return info
    root = checkpoint_dir(size)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    args = model_args_for(size)
    t0 = time.perf_counter()
    _spawn(_save_rank, world, asdict(args), str(root / "ckpt"), steps)
    info = {
        "path": str(root / "ckpt"),
        "target_bytes": size,
        "bytes": dir_bytes(root / "ckpt"),
        "files": len(list((root / "ckpt").iterdir())),
        "params": param_count(args),
        "model_args": asdict(args),
        "world": world,
        "train_steps": steps,
        "build_seconds": round(time.perf_counter() - t0, 1),
        "cpu_count": os.cpu_count(),
    }
    (root / INFO).write_text(json.dumps(info, indent=1))
    return info


def online_reshard(ckpt: str, args_json: dict, world: int) -> dict:
    """Load ``ckpt`` into a dp<world> FSDP2 job with dcp.load; returns per-rank load seconds."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _spawn(_load_rank, world, args_json, ckpt, tmp)
        secs = [json.loads(Path(tmp, f"rank{r}.json").read_text())["load_seconds"] for r in range(world)]
    return {"world": world, "load_seconds": secs}


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="build (or reuse) the checkpoint of --size")
    mk.add_argument("--size", default="2GB")
    mk.add_argument("--force", action="store_true")
    ld = sub.add_parser("load", help="online reshard: dcp.load SRC into a dp<WORLD> FSDP2 job")
    ld.add_argument("--src", required=True)
    ld.add_argument("--world", type=int, default=3)
    a = p.parse_args(argv)
    if a.cmd == "make":
        print(json.dumps(make_checkpoint(parse_size(a.size), force=a.force), indent=1))
    else:
        info = json.loads((Path(a.src).parent / INFO).read_text())
        print(json.dumps(online_reshard(a.src, info["model_args"], a.world)))


if __name__ == "__main__":
    main()
