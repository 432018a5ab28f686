"""Tensor-parallel DeepSpeed saves of a Megatron-like model (:mod:`ds_tp_worker`), by DeepSpeed
0.19.8's own engine in gloo runs (TP 2 x data parallelism 1 or N), cached with DeepSpeed's own
``ds_to_universal.py`` output beside them.

A case is named ``z<stage>-<fp32|bf16>[-dp<N>]`` (``dp<N>``: N data-parallel ranks, 2 x N in all); its entry holds ``run/latest``, ``run/global_step2/``
(what ``save_checkpoint`` wrote, with ``universal_checkpoint_info``), ``run/live-rank<r>.pt``
(each TP rank's full state by DeepSpeed's accessors) and ``universal/`` (ds_to_universal.py of
the tag folder) or ``universal.err``.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import torch

SUPPORT = Path(__file__).resolve().parent
TIMEOUT = 300.0
TAG = "global_step2"
TP = 2
_NAME = re.compile(r"z(?P<stage>[0-3])-(?P<dtype>fp32|bf16)(?:-dp(?P<dp>[1-9]))?")


def build(name: str, out: Path) -> None:
    import ds_tp_worker
    from ds_zero_support import _ds_to_universal
    from worlds import run_world

    m = _NAME.fullmatch(name)
    assert m is not None, name
    stage = int(m["stage"])
    world = TP * int(m["dp"] or 1)
    run_world(ds_tp_worker.save_tp_megatron, world, (str(out / "run"), stage, m["dtype"] == "bf16", TP), timeout=TIMEOUT)
    _ds_to_universal(out / "run" / TAG, out, stage)


def cache_dir() -> Path:
    import fixture_cache

    h = hashlib.sha256()
    for name in ("ds_tp_support.py", "ds_tp_worker.py", "ds_worker.py", "ds_layout_worker.py"):
        h.update((SUPPORT / name).read_bytes())
    return fixture_cache.base_dir() / f"ds-tp-{torch.__version__}-{h.hexdigest()[:16]}"


_cache: Any = None


def saved(name: str) -> Path:
    """The cached entry of case ``name`` (built on first use, READ-ONLY)."""
    global _cache
    import fixture_cache

    if _NAME.fullmatch(name) is None:
        raise KeyError(name)
    if _cache is None:
        _cache = fixture_cache.FixtureCache(cache_dir(), build)
    return _cache.get(name)


def live_global(entry: Path) -> dict[str, torch.Tensor]:
    """The global fp32 masters and Adam states: each TP rank's live state (DeepSpeed's
    ``safe_get_full_*``) joined as the test model was cut (``ds_tp_worker.tp_join``), and ``step``."""
    from ds_tp_worker import SPEC, tp_join

    ranks = [torch.load(entry / "run" / f"live-rank{r}.pt", weights_only=False) for r in range(TP)]
    out: dict[str, torch.Tensor] = {}
    for name, (_, how) in SPEC.items():
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"):
            out[key] = tp_join([r[key] for r in ranks], how)
    out["step"] = ranks[0]["step"]
    return out
