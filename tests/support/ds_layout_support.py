"""DeepSpeed ``save_checkpoint`` folders of the layouts the ZeRO reader refuses (tensor-parallel
``mp_rank_01``, pipeline layer files) or reads as pipelines, saved by DeepSpeed 0.19.8's own engine in a
2-rank gloo run on CPU (:mod:`ds_layout_worker`) and cached.

A layout is named ``<kind>-z<stage>``: ``tp`` (a model-parallel ``mpu``, 2 ranks), ``pipe`` (a
2-stage ``PipelineModule``), ``pipemp`` (the same on the pipe x model x data topology, as
Megatron-DeepSpeed builds it); ``pipe4``: 2 stages x 2 data-parallel ranks. An entry
is the folder ``save_checkpoint`` wrote: ``latest`` and ``global_step2/``. ``steps-z2`` is no
refused layout: a ZeRO-2 run saved twice, one training step apart (for ``diff``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

SUPPORT = Path(__file__).resolve().parent
TIMEOUT = 300.0
TAG = "global_step2"
WORLD = 2
#: The layouts: name -> (worker function, ZeRO stage, extra worker arguments).
LAYOUTS: dict[str, tuple[str, int, tuple]] = {
    "tp-z1": ("save_tp", 1, ()),
    "tp-z3": ("save_tp", 3, ()),
    "pipe-z0": ("save_pipe", 0, ()),
    "pipe-z1": ("save_pipe", 1, ()),
    "pipemp-z1": ("save_pipe", 1, (True,)),
    "pipe4-z1": ("save_pipe", 1, (False, 2)),  # 4 ranks: 2 stages x 2 data-parallel ranks
    "pipe4bf-z1": ("save_pipe", 1, (False, 2, True)),  # the same in bf16
    "pipetp-z1": ("save_pipe", 1, (True, 2, False, 2)),  # 4 ranks: 2 stages x 2 model-parallel ranks (refused)
    # not refused: ds_zero_support's case z2-fp32-w2 saved after steps 3 and 4 by one run, with
    # DeepSpeed's own consolidation of each (fp32-global_step3.pt, fp32-global_step4.pt)
    "steps-z2": ("save_twice", 2, ("z2-fp32-w2",)),
}
#: Layouts saved by more than WORLD ranks.
WORLDS = {"pipe4-z1": 4, "pipe4bf-z1": 4, "pipetp-z1": 4}
#: The tags of ``steps-z2``.
STEP_TAGS = ("global_step3", "global_step4")


def build_layout(name: str, out: Path) -> None:
    """Save layout ``name`` into ``out`` with DeepSpeed's engine (``WORLD`` gloo ranks)."""
    import ds_layout_worker
    from worlds import run_world

    fn, stage, extra = LAYOUTS[name]
    run_world(getattr(ds_layout_worker, fn), WORLDS.get(name, WORLD), (str(out), stage, *extra), timeout=TIMEOUT)
    if fn == "save_twice":
        for tag in STEP_TAGS:
            ds_layout_worker.consolidate(str(out), tag, str(out / f"fp32-{tag}.pt"))


def cache_dir() -> Path:
    import fixture_cache

    h = hashlib.sha256()
    for name in ("ds_layout_support.py", "ds_layout_worker.py", "ds_worker.py", "ds_zero_worker.py", "ds_zero_support.py",
                 "models.py"):
        h.update((SUPPORT / name).read_bytes())
    return fixture_cache.base_dir() / f"ds-layout-{torch.__version__}-{h.hexdigest()[:16]}"


_cache: Any = None


def saved_layout(name: str) -> Path:
    """The cached save of layout ``name`` (built on first use, READ-ONLY)."""
    global _cache
    import fixture_cache

    if _cache is None:
        _cache = fixture_cache.FixtureCache(cache_dir(), lambda n, tmp: build_layout(n, tmp), names=lambda: LAYOUTS)
    return _cache.get(name)
