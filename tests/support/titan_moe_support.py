"""torchtitan 0.3.0's MoE models (deepseek_v3, qwen3 MoE flavors) on its own Trainer, CPU and gloo.

Builds on :mod:`titan_support` (the six CPU patches, the synthetic dataloader and tokenizer) and adds
what MoE needs:

- the model is ``MODEL/FLAVOR`` (default ``deepseek_v3/debugmodel``: 6 layers, the first dense, 8
  routed experts of hidden 256, 2 shared experts, top-3 softmax routing, an ``expert_bias_E``
  load-balancing buffer);
- ``ep`` in the mesh text (``"dp4,ep2"``) is torchtitan's ``expert_parallel_degree``: EP borrows its
  ranks from ``dp_shard * cp * tp`` (the sparse mesh is ``(pp, dp_replicate, efsdp, ep)`` with
  ``efsdp = dp_shard * cp * tp / ep``), so it does not add to the world size.

Nothing more is patched for MoE: ``torch._grouped_mm`` runs forward and backward on CPU in bf16 (torch
2.13), the EP token exchange is ``all_to_all_single`` (gloo has all-to-all), and FSDP's
reduce-scatter over ``efsdp`` is the same SUM patch (5) as the dense parts.
"""

from __future__ import annotations

import os
from typing import Any

import titan_support
from titan_support import GLOBAL_BATCH, SEQ_LEN

DEFAULT_MODEL = "deepseek_v3/debugmodel"


def degrees(mesh: str) -> dict[str, int]:
    """``"dp4,ep2"`` -> torchtitan degrees (``ep`` included; it does not multiply the world)."""
    out = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}
    for tok in mesh.split(","):
        name = tok.rstrip("0123456789")
        out["dp_shard" if name == "dp" else name] = int(tok[len(name):])
    return out


def world_of(mesh: str) -> int:
    """Ranks of ``mesh`` (ep is carved out of dp_shard * cp * tp)."""
    d = degrees(mesh)
    return d["pp"] * d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"]


def model_spec(model: str):
    """torchtitan's ModelSpec of ``MODEL/FLAVOR``."""
    import importlib

    name, _, flavor = model.partition("/")
    return importlib.import_module(f"torchtitan.models.{name}").model_registry(flavor)


def trainer_config(mesh: str, dump_folder: str, steps: int, *, model: str = DEFAULT_MODEL,
                   save_interval: int | None = None, exclude: tuple[str, ...] = ()):
    """The Trainer config of ``model`` on ``mesh`` (CPU-sized, as ``titan_support.trainer_config``)."""
    titan_support.apply_cpu_patches()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.trainer import Trainer

    tokenizer_cls, loader_cls = titan_support._define_data_classes()
    spec = model_spec(model)
    d = degrees(mesh)
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        hf_assets_path=dump_folder,
        dump_folder=dump_folder,
        model_spec=spec,
        tokenizer=tokenizer_cls.Config(),
        dataloader=loader_cls.Config(),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(
            local_batch_size=GLOBAL_BATCH // (d["dp_shard"] * d["dp_replicate"]),
            global_batch_size=GLOBAL_BATCH,
            seq_len=SEQ_LEN,
            steps=steps,
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=d["dp_shard"],
            data_parallel_replicate_degree=d["dp_replicate"],
            tensor_parallel_degree=d["tp"],
            pipeline_parallel_degree=d["pp"],
            context_parallel_degree=d["cp"],
            expert_parallel_degree=d["ep"],
            spmd_backend="partial_dtensor",
            pipeline_parallel_schedule="1F1B",
        ),
        checkpoint=CheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=save_interval or 10**9,
            last_save_model_only=False,
            keep_latest_k=0,
            exclude_from_loading=list(exclude),
        ),
        activation_checkpoint=None,
        validator=Validator.Config(enable=False),
    ), world_of(mesh)


def run_job(job: dict, out_dir: "os.PathLike[str] | str", timeout: int = 1800) -> list[dict]:
    """``titan_worker.py`` on ``world_of(job["mesh"])`` ranks under torchrun with ``job["model"]``
    (default :data:`DEFAULT_MODEL`); the per-rank reports."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    job = dict(job, out=str(out_dir / "report"))
    job.setdefault("model", DEFAULT_MODEL)
    job_file = out_dir / "job.json"
    job_file.write_text(json.dumps(job))
    n = world_of(job["mesh"])
    worker = Path(__file__).resolve().parent / "titan_worker.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(worker.parent.parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(worker), str(job_file)]
    proc = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True, timeout=timeout)
    (out_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"torchtitan job {job['model']} {job['mesh']} failed (rc {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-6000:]}")
    return [json.loads((out_dir / f"report.{r}.json").read_text()) for r in range(n)]


def build_checkpoint(mesh: str, dest: "os.PathLike[str] | str", model: str = DEFAULT_MODEL) -> None:
    """torchtitan's Trainer with ``model`` on ``mesh``: 3 steps, step 2 saved by its CheckpointManager.
    ``dest`` gets ``ckpt/`` (step 2), ``reference.pt`` (torch's ``dcp_to_torch_save`` of it) and
    ``train.json`` (every step's loss; step 3 is the step after the save)."""
    import json
    import shutil
    from pathlib import Path

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dest = Path(dest)
    work = dest / "run"
    reports = run_job({"mesh": mesh, "model": model, "dump": str(work), "steps": 3, "save_interval": 2}, work)
    shutil.move(str(work / "checkpoint" / "step-2"), str(dest / "ckpt"))
    dcp_to_torch_save(str(dest / "ckpt"), str(dest / "reference.pt"))
    (dest / "train.json").write_text(json.dumps({"mesh": mesh, "model": model, "losses": reports[0]["losses"]}))
    shutil.rmtree(work)


def expert_keys(keys: Any) -> list[str]:
    """The grouped-expert parameter FQNs among ``keys``."""
    return [k for k in keys if ".moe.routed_experts.inner_experts." in k]
