"""Make (and cache) a real DeepSpeed ZeRO checkpoint for the benchmark: DeepSpeed 0.19.8's own
engine on CPU (gloo), ``engine.save_checkpoint`` as written.

The model is the torchtitan-style Llama of ``tests/support/models.py``, sized so that the files
(fp32 master + AdamW ``exp_avg`` + ``exp_avg_sq``, plus the bf16/fp32 module under ZeRO-1/2: 12 to 16
bytes a parameter) come close to the target. Each of ``world`` ranks builds the model (seeded), runs one real training
step (batch 1, seq 32) under ZeRO-``stage`` and saves; the folder is ``ckpt/`` with ``latest`` and
``global_step1/``.

Cached under ``bench/out/ds-z<stage>-<dtype>-w<world>-<size>/`` (``ckpt/`` plus
``bench_ckpt.json``, written last).

    python bench/make_ds_checkpoint.py --size 2GB --stage 2 --world 2     # prints the info
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from make_checkpoint import INFO, OUT, SEQ, _free_port, dir_bytes, model_args_for, param_count, parse_size, size_label  # noqa: E402

def bytes_per_param(stage: int, dtype: str) -> int:
    """File bytes a parameter costs: fp32 master + 2 AdamW states, plus the module's copy (not
    saved under ZeRO-3)."""
    return 12 + (0 if stage == 3 else 2 if dtype == "bfloat16" else 4)


def _rank(rank: int, world: int, port: int, args_json: dict, stage: int, ckpt: str) -> None:
    os.environ.update(MASTER_PORT=str(port), MASTER_ADDR="127.0.0.1")
    # one fixed directory per user (a fresh mkdtemp per rank left hundreds of empty dirs in /tmp)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), f"ckptconv-ds-ext-{os.getuid()}"))
    import torch

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)  # env://: MASTER_ADDR/PORT above
    from ds_worker import _init_deepspeed
    from models import ModelArgs, build_model

    deepspeed = _init_deepspeed(rank, world)
    args = ModelArgs.from_json(args_json)
    model = build_model(args, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    if args.dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=config)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab_size, (1, SEQ + 1), generator=g)
    loss = torch.nn.functional.cross_entropy(engine(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(ckpt)


def checkpoint_dir(size: int, stage: int, dtype: str, world: int) -> Path:
    return OUT / f"ds-z{stage}-{'bf16' if dtype == 'bfloat16' else 'fp32'}-w{world}-{size_label(size)}"


def make_ds_checkpoint(size: int, stage: int = 2, dtype: str = "bfloat16", world: int = 2,
                       force: bool = False, root: Path | None = None) -> dict:
    """Build (or reuse) the checkpoint; its info (``path``: the folder holding ``latest``)."""
    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT / "tests" / "support"))
    root = root or checkpoint_dir(size, stage, dtype, world)
    if not force and (root / INFO).is_file():
        return json.loads((root / INFO).read_text())
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    args = replace(model_args_for(size * 12 // bytes_per_param(stage, dtype)), dtype=dtype)
    t0 = time.perf_counter()
    mp.spawn(_rank, args=(world, _free_port(), asdict(args), stage, str(root / "ckpt")), nprocs=world, join=True)
    info = {"path": str(root / "ckpt"), "target_bytes": size, "bytes": dir_bytes(root / "ckpt"),
            "params": param_count(args), "model_args": asdict(args), "stage": stage, "world": world,
            "build_seconds": round(time.perf_counter() - t0, 1), "cpu_count": os.cpu_count()}
    (root / INFO).write_text(json.dumps(info, indent=1))
    return info


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="2GB")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    print(json.dumps(make_ds_checkpoint(parse_size(a.size), a.stage, a.dtype, a.world, a.force), indent=1))


if __name__ == "__main__":
    main()
