"""DeepSpeed MoE ``save_checkpoint`` folders (``deepspeed.moe.layer.MoE``, two MoE layers of
different ``ep_size``) saved by DeepSpeed 0.19.8's own engine in gloo runs on CPU
(:mod:`ds_moe_worker`) and cached, with each rank's live state (``live-rank<r>.pt``, global expert
names) as the oracle.

A layout is ``z<stage>-<dtype>-w<world>``; :data:`LAYOUTS` gives the MoE shape
``(ep_a, experts_a, ep_b, experts_b)``: at world 2 ``moe1`` has ep 2 (4 experts, 2 per rank, its
expert-data-parallel group one rank) and ``moe2`` ep 1 (2 experts on every rank, partitioned over
both); at world 4 ``moe1`` has ep 2 x expert-data-parallel 2 and ``moe2`` ep 4 (``-de``: in
DeepSpeed's data-then-expert rank order, ``use_data_before_expert_parallelism``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

SUPPORT = Path(__file__).resolve().parent
TIMEOUT = 300.0
TAG = "global_step2"
#: name -> (ZeRO stage, dtype, world, MoE shape); ``-de``: ``use_data_before_expert_parallelism``.
LAYOUTS: dict[str, tuple[int, str, int, tuple[int, int, int, int]]] = {
    "z2-bf16-w2": (2, "bf16", 2, (2, 4, 1, 2)),
    "z1-fp32-w4": (1, "fp32", 4, (2, 4, 4, 4)),
    "z0-fp32-w2": (0, "fp32", 2, (2, 4, 1, 2)),
    "z0-bf16-w2": (0, "bf16", 2, (2, 4, 1, 2)),
    "z2-fp32-w4-de": (2, "fp32", 4, (2, 4, 4, 4)),
    "z0-fp32-w4-de": (0, "fp32", 4, (2, 4, 4, 4)),
}


def build(name: str, out: Path) -> None:
    import ds_moe_worker
    from worlds import run_world

    stage, dtype, world, shape = LAYOUTS[name]
    run_world(ds_moe_worker.save_moe, world, (str(out), stage, dtype, list(shape), name.endswith("-de")),
              timeout=TIMEOUT)


def cache_dir() -> Path:
    import fixture_cache

    h = hashlib.sha256()
    for name in ("ds_moe_support.py", "ds_moe_worker.py", "ds_worker.py"):
        h.update((SUPPORT / name).read_bytes())
    return fixture_cache.base_dir() / f"ds-moe-{torch.__version__}-{h.hexdigest()[:16]}"


_cache: Any = None


def saved_moe(name: str) -> Path:
    """The cached save of layout ``name`` (``latest``, ``global_step2/``, ``live-rank<r>.pt``),
    built on first use, READ-ONLY."""
    global _cache
    import fixture_cache

    if _cache is None:
        _cache = fixture_cache.FixtureCache(cache_dir(), build, names=lambda: LAYOUTS)
    return _cache.get(name)


def lives(entry: Path) -> list[dict]:
    """Each rank's live state (DeepSpeed's own accessors, global expert names)."""
    return [torch.load(p, weights_only=False) for p in sorted(entry.glob("live-rank*.pt"))]


def expected(entry: Path) -> dict[str, Any]:
    """The union of the ranks' live states (replicated and expert-data-parallel copies agree)."""
    out: dict[str, Any] = {}
    for live in lives(entry):
        out.update({k: v for k, v in live.items() if k.startswith(("model.", "optim.state."))})
    out["step"] = lives(entry)[0]["step"]
    return out
