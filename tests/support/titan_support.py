"""torchtitan 0.3.0's own Trainer on CPU under gloo, for tests.

torchtitan is installed by ``.ci/install_titan.sh`` (``--no-deps``, never replacing torch); when it is
missing every user of this module skips with :func:`skip_reason`.

:func:`apply_cpu_patches` applies the six small patches of ``/work/shared/notes/frameworks.md`` that
let torchtitan's Trainer run and save on CPU (none changes what is trained or saved):

1. a stub ``torchtitan.distributed.minimal_async_ep.kernels`` (it imports triton; MoE only);
2. ``torchtitan.tools.utils.device_type = "cpu"`` (it falls back to "cuda" without an accelerator);
3. ``metrics.build_device_memory_monitor`` -> a CPU stub;
4. FlexAttention's compiled kernel -> ``F.scaled_dot_product_attention`` with the dense mask of the
   same BlockMask (torch 2.13's FlexAttention has no CPU backward);
5. every FSDP module ``set_force_sum_reduction_for_comms(True)`` (gloo has no PREMUL_SUM);
6. ``distributed.utils.set_pg_timeouts`` -> a no-op (``barrier(device_ids=...)`` fails on gloo).

``datasets`` (torchtitan's HF text dataset) is not installed: it would downgrade fsspec under s3fs.
The Trainer gets a small in-memory :class:`SyntheticLoader` instead: torchtitan's own
``ParallelAwareDataloader`` (so the checkpoint's per-rank ``dataloader`` state is the real one) over
a stateful dataset whose global batch is the same for every DP degree (so losses compare across
meshes), and a trivial tokenizer.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

TITAN_VERSION = "0.3.0"
GLOBAL_BATCH = 8
SEQ_LEN = 64


def skip_reason() -> str | None:
    """Why torchtitan tests cannot run here (None: they can)."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed (run .ci/install_titan.sh)"
    from importlib.metadata import version

    got = version("torchtitan")
    if got != TITAN_VERSION:
        return f"torchtitan {got} is installed; these tests need {TITAN_VERSION} (.ci/install_titan.sh)"
    for mod in ("torchdata", "tyro", "spmd_types", "einops", "tensorboard", "torch_checkpointing"):
        if importlib.util.find_spec(mod) is None:
            return f"torchtitan's dependency {mod} is missing (run .ci/install_titan.sh)"
    return None


_PATCHED = False


def _stub_modules() -> None:
    kernels = "torchtitan.distributed.minimal_async_ep.kernels"
    if kernels not in sys.modules:  # patch 1
        stub = types.ModuleType(kernels)

        def _no_kernel(*_a: Any, **_k: Any) -> None:
            raise RuntimeError("MoE async-EP triton kernels are stubbed out on CPU")

        for name in (
            "copy_full_counts_to_peers_kernel",
            "copy_rows_to_peers_kernel",
            "expand_topk_grad_kernel",
            "fill_combine_metadata_kernel",
            "fill_dispatch_metadata_kernel",
            "invert_flat_indices_kernel",
            "reduce_topk_slots_kernel",
            "topk_scores_grad_kernel",
        ):
            setattr(stub, name, _no_kernel)
        sys.modules[kernels] = stub
    if importlib.util.find_spec("datasets") is None and "datasets" not in sys.modules:
        # torchtitan.hf_datasets imports datasets at module level; the tests never use it
        ds = types.ModuleType("datasets")
        ds.Dataset = type("Dataset", (), {})
        ds.load_dataset = None
        dist = types.ModuleType("datasets.distributed")
        dist.split_dataset_by_node = None
        ds.distributed = dist
        sys.modules["datasets"], sys.modules["datasets.distributed"] = ds, dist


def _dense_sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """Patch 4: FlexAttention's kernel as SDPA over the BlockMask's dense mask."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask

    assert score_mod is None, "score_mod is not supported by the CPU attention patch"
    mask = None
    if block_mask is not None:
        b = block_mask.shape[0]
        mask = create_mask(block_mask.mask_mod, b, None, q.shape[-2], k.shape[-2], device=q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    lse = None
    if getattr(return_aux, "lse", False):
        raise NotImplementedError("lse is not supported by the CPU attention patch")
    return out, types.SimpleNamespace(lse=lse)


def apply_cpu_patches() -> None:
    """Apply the six CPU patches (idempotent; call before building a Trainer)."""
    global _PATCHED
    if _PATCHED:
        return
    _stub_modules()
    import torch
    import torchtitan.tools.utils as tu

    tu.device_type, tu.device_module = "cpu", torch.cpu  # patch 2 (before anything imports it)
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as du
    import torchtitan.models.common.attention as attn

    for mod in (metrics, du):
        mod.device_type, mod.device_module = "cpu", torch.cpu
    metrics.build_device_memory_monitor = _cpu_memory_monitor  # patch 3
    attn.FlexAttention.compiled_flex_attn = staticmethod(_dense_sdpa)  # patch 4
    du.set_pg_timeouts = lambda *a, **k: None  # patch 6
    # patch 5 is per model: force_sum_reduction(model_parts) after the Trainer is built
    _PATCHED = True


def _cpu_memory_monitor():
    @dataclass
    class _Stats:
        max_active_gib: float = 0.0
        max_active_pct: float = 0.0
        max_reserved_gib: float = 0.0
        max_reserved_pct: float = 0.0
        num_alloc_retries: int = 0
        num_ooms: int = 0

    class _Monitor:
        device_name = "cpu"
        device_capacity_gib = 0.0

        def get_peak_stats(self) -> _Stats:
            return _Stats()

        def reset_peak_stats(self) -> None:
            pass

    return _Monitor()


def force_sum_reduction(model_parts) -> None:
    """Patch 5: FSDP reduce-scatter with SUM (gloo lacks PREMUL_SUM)."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)


# ---------------------------------------------------------------- data: torchtitan's loader, synthetic samples


def _define_data_classes():
    """The tokenizer and dataloader Configurables (defined lazily: they subclass torchtitan's)."""
    import torch
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.tokenizer import BaseTokenizer

    class TinyTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 2048

        def __init__(self, config: Config, **_: Any) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size
            self.eos_id = 1

        def encode(self, text: str, **_: Any) -> list[int]:
            return [2 + (ord(c) % (self.vocab_size - 2)) for c in text]

        def decode(self, ids: list[int], **_: Any) -> str:
            return "".join(chr(i) for i in ids)

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class SyntheticTokens(IterableDataset, Stateful):
        """Sample ``i`` of every global batch is a fixed token sequence; rank ``r`` of ``D`` yields
        the samples ``r*b .. r*b+b-1`` of each global batch (``b = GLOBAL_BATCH / D``), so the global
        batch is identical whatever the DP degree, and every step sees the same batch, so the next
        step's loss compares whether the dataloader state was kept or dropped. The state counts the
        batches served."""

        def __init__(self, dp_rank: int, dp_world: int, seq_len: int, vocab: int) -> None:
            self.local = GLOBAL_BATCH // dp_world
            self.first = dp_rank * self.local
            self.seq_len, self.vocab = seq_len, vocab
            self.served = 0

        def _sample(self, i: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            g = torch.Generator().manual_seed(1000 + i)
            toks = torch.randint(2, self.vocab, (self.seq_len + 1,), generator=g)
            pos = torch.arange(self.seq_len)
            return {"input": toks[:-1], "positions": pos}, toks[1:]

        def __iter__(self):
            while True:
                for j in range(self.local):
                    yield self._sample(self.first + j, self.served)
                self.served += 1

        def state_dict(self) -> dict[str, Any]:
            return {"served": self.served, "first": self.first}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.served = state["served"]

    class SyntheticLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            dataset: str = "synthetic"

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                     local_batch_size: int, snapshot_every_n_steps: int | None = 1, **_: Any) -> None:
            ds = SyntheticTokens(dp_rank, dp_world_size, seq_len, tokenizer.get_vocab_size())
            super().__init__(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                             num_workers=0, snapshot_every_n_steps=snapshot_every_n_steps)

    return TinyTokenizer, SyntheticLoader


# ---------------------------------------------------------------- trainer config


def degrees(mesh: str) -> dict[str, int]:
    """``"tp2,dp2"`` -> torchtitan degrees ``{"tp": 2, "dp_shard": 2, ...}``."""
    out = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    for tok in mesh.split(","):
        name = tok.rstrip("0123456789")
        out["dp_shard" if name == "dp" else name] = int(tok[len(name):])
    return out


def trainer_config(mesh: str, dump_folder: str, steps: int, *, flavor: str = "debugmodel",
                   save_interval: int | None = None, exclude: tuple[str, ...] = ()):
    """torchtitan's ``llama3_debugmodel`` config for ``mesh``, CPU-sized, saving every
    ``save_interval`` steps (None: never)."""
    apply_cpu_patches()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    tokenizer_cls, loader_cls = _define_data_classes()
    spec = model_registry(flavor)
    d = degrees(mesh)
    world = 1
    for v in d.values():
        world *= v
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
    ), world


# ---------------------------------------------------------------- running jobs


def world_of(mesh: str) -> int:
    """Number of ranks of ``mesh``."""
    n = 1
    for v in degrees(mesh).values():
        n *= v
    return n


def run_job(job: dict, out_dir: "os.PathLike[str] | str", timeout: int = 1200) -> list[dict]:
    """Run ``titan_worker.py`` on ``world_of(job["mesh"])`` ranks under torchrun; the per-rank reports."""
    import json
    import subprocess
    from pathlib import Path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    job = dict(job, out=str(out_dir / "report"))
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
        raise RuntimeError(f"torchtitan job {job['mesh']} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return [json.loads((out_dir / f"report.{r}.json").read_text()) for r in range(n)]


def build_checkpoint(mesh: str, dest: "os.PathLike[str] | str") -> None:
    """torchtitan's Trainer on ``mesh``: 3 steps, its CheckpointManager saving step 2. ``dest`` gets
    ``ckpt/`` (the step-2 checkpoint), ``reference.pt`` (its full state by torch's
    ``dcp_to_torch_save``) and ``train.json`` (every step's loss; step 3 is the next step after the save)."""
    import json
    import shutil
    from pathlib import Path

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dest = Path(dest)
    work = dest / "run"
    reports = run_job({"mesh": mesh, "dump": str(work), "steps": 3, "save_interval": 2}, work)
    shutil.move(str(work / "checkpoint" / "step-2"), str(dest / "ckpt"))
    dcp_to_torch_save(str(dest / "ckpt"), str(dest / "reference.pt"))
    (dest / "train.json").write_text(json.dumps({"mesh": mesh, "losses": reports[0]["losses"]}))
    shutil.rmtree(work)
