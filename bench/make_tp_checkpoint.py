"""Make a DCP checkpoint laid out dp x tp (2-D blocks), for the data path benches' other shape.

``make_checkpoint.py`` makes FSDP-only checkpoints (every chunk a block of rows). This one saves,
from ``dp * tp`` gloo processes, DTensors on a (dp, tp) mesh the way torchtitan's TP plan places
Llama weights: ``wq wk wv w1 w3`` split by rows over tp, ``wo w2`` by columns, the norms
replicated over tp; every tensor also split by rows over dp (FSDP2). Parameters are bf16 and their
two AdamW states fp32 (random values: the bench measures the copy, not the numbers), so each
tensor's chunks are 2-D blocks and a reshard gathers strided pieces. ``dcp.save`` writes it, as a
job would.

    python bench/make_tp_checkpoint.py bench/out/ckpt-tp --layers 8 --dim 1024 --dp 4 --tp 2   # ~1 GB, ~30 s
    python bench/ab.py --base ../old --step reshard --source bench/out/ckpt-tp --mesh tp4,dp2
"""

from __future__ import annotations

import argparse
import os
import sys


def _worker(rank: int, world: int, out: str, layers: int, dim: int, dp: int, tp: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(rank)

    def dtensor(shape: tuple[int, ...], tp_dim: int | None, dtype: torch.dtype) -> DTensor:
        local = list(shape)
        local[0] //= dp
        if tp_dim is not None:
            local[tp_dim] //= tp
        placements = [Shard(0), Shard(tp_dim) if tp_dim is not None else Replicate()]
        data = torch.randn(local, generator=gen).to(dtype)
        return DTensor.from_local(data, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    ffn = dim * 11 // 4 // 64 * 64
    weights = [("attention.wq", (dim, dim), 0), ("attention.wk", (dim, dim), 0), ("attention.wv", (dim, dim), 0),
               ("attention.wo", (dim, dim), 1), ("feed_forward.w1", (ffn, dim), 0),
               ("feed_forward.w3", (ffn, dim), 0), ("feed_forward.w2", (dim, ffn), 1), ("attention_norm", (dim,), None)]
    model, state = {}, {}
    for layer in range(layers):
        for name, shape, tp_dim in weights:
            key = f"layers.{layer}.{name}.weight"
            model[key] = dtensor(shape, tp_dim, torch.bfloat16)
            state[key] = {"step": torch.tensor(10.0), "exp_avg": dtensor(shape, tp_dim, torch.float32),
                          "exp_avg_sq": dtensor(shape, tp_dim, torch.float32)}
    sd = {"model": model, "optim": {"state": state, "param_groups": [{"lr": 1e-3, "params": list(state)}]}}
    dcp.save(sd, checkpoint_id=out)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="checkpoint folder to write (must not exist)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024, help="hidden size (a multiple of 64 * dp * tp)")
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--port", type=int, default=29533)
    args = p.parse_args(argv)
    if os.path.exists(args.out):
        raise SystemExit(f"{args.out} exists: give a new folder")
    if args.dim % (64 * args.dp * args.tp):
        raise SystemExit(f"--dim {args.dim}: make it a multiple of {64 * args.dp * args.tp} (64 * dp * tp)")
    import torch.multiprocessing as mp

    world = args.dp * args.tp
    mp.spawn(_worker, args=(world, args.out, args.layers, args.dim, args.dp, args.tp, args.port), nprocs=world)
    print(args.out)


if __name__ == "__main__":
    sys.exit(main())
