"""DeepSpeed ``PipelineModule`` saves of Megatron-DeepSpeed's layouts (:mod:`ds_pipe_worker`), by
DeepSpeed 0.19.8's own ``PipelineEngine`` in 4-rank gloo runs, cached with DeepSpeed's own
``ds_to_universal.py`` output beside them.

Cases: ``tp2-fp32`` (2 stages x TP 2 x DP 1 on ``PipeModelDataParallelTopology``, ZeRO-1 fp32,
a vocabulary-parallel embedding tied between the first and last stage, a frozen column-parallel
bias per block, Megatron-DeepSpeed's ``universal_checkpoint_info``) and ``tied-bf16-dp2`` (2
stages x DP 2, ZeRO-1 bf16, an embedding tied between the first and last stage both of which write
its layer file, a frozen bias beside a persistent buffer, a wholly frozen Linear). An entry holds
``run/latest``, ``run/global_step2/`` (what ``save_checkpoint`` wrote), ``run/live-rank<r>.pt``
(each rank's stage by DeepSpeed's accessors) and ``universal/`` (ds_to_universal.py of the tag
folder) or ``universal.err``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

SUPPORT = Path(__file__).resolve().parent
TIMEOUT = 300.0
TAG = "global_step2"
WORLD = 4
STAGES = 2
#: case -> (worker function, its arguments after the output folder, TP ranks per stage).
CASES: dict[str, tuple[str, tuple, int]] = {
    "tp2-fp32": ("save_pipe_tp", (2, 1), 2),
    "tied-bf16-dp2": ("save_pipe_tied", (True,), 1),
}


def build(name: str, out: Path) -> None:
    import ds_pipe_worker
    from ds_zero_support import _ds_to_universal
    from worlds import run_world

    fn, args, _ = CASES[name]
    run_world(getattr(ds_pipe_worker, fn), WORLD, (str(out / "run"), *args), timeout=TIMEOUT)
    _ds_to_universal(out / "run" / TAG, out, 1)


@functools.cache
def _cache() -> Any:
    import fixture_cache

    sources = ("ds_pipe_support.py", "ds_pipe_worker.py", "ds_tp_worker.py", "ds_worker.py", "ds_layout_worker.py")
    return fixture_cache.FixtureCache(fixture_cache.hashed_dir("ds-pipe", SUPPORT, sources), build, names=lambda: CASES)


def saved(name: str) -> Path:
    """The cached entry of case ``name`` (built on first use, READ-ONLY)."""
    return _cache().get(name)


def lives(entry: Path) -> list[dict[str, Any]]:
    return [torch.load(entry / "run" / f"live-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def live_global(name: str, entry: Path) -> dict[str, Any]:
    """The whole checkpoint by DeepSpeed's own accessors: each stage's fp32 masters and Adam
    states (``model.*``, ``optim.state.*``), frozen parameters and buffers (``model.*``, the
    module's tensors), its TP ranks' slices joined as the test model was cut
    (``ds_tp_worker.tp_join``, vocabulary padding dropped), from data-parallel rank 0 of each
    stage; ``step``; and ``copies``: every later stage's copy of a key (tied parameters)."""
    from ds_pipe_worker import TP_SPEC
    from ds_tp_worker import tp_join

    tp = CASES[name][2]
    ranks = lives(entry)
    dp = WORLD // STAGES // tp
    out: dict[str, Any] = {"step": ranks[0]["step"], "param_groups": ranks[0]["param_groups"], "copies": {}}
    for s in range(STAGES):
        stage = ranks[s * dp * tp: s * dp * tp + tp]  # topology [pipe, data, model]: data rank 0's TP ranks
        for key in stage[0]:
            if not key.startswith(("model.", "optim.state.", "frozen.", "buffer.")):
                continue
            name_ = key.split(".", 1)[1] if not key.startswith("optim.") else key[len("optim.state."):].rsplit(".", 1)[0]
            value = tp_join([r[key] for r in stage], TP_SPEC[name_][1]) if tp > 1 else stage[0][key]
            key = "model." + key.split(".", 1)[1] if key.startswith(("frozen.", "buffer.")) else key
            if key in out:
                out["copies"][key] = value
            else:
                out[key] = value
    return out
