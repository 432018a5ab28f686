"""Megatron-core 0.19.2's own GPTModel, DistributedOptimizer and ``dist_checkpointing`` on CPU under gloo,
for tests.

megatron-core is installed by ``.ci/install_megatron.sh`` (its cp312-only wheel unpacked, never
replacing torch); when it is missing every user of this module skips with :func:`skip_reason`.

:func:`apply_cpu_patches` lets megatron's CUDA-only code paths run on CPU; none changes what is
trained, saved or loaded:

1. ``torch.cuda.synchronize`` / ``current_device`` / ``current_stream`` -> no-ops / ``"cpu"`` / a stub
   stream (``dist_checkpointing``'s saver, DDP's buffers and grad sync call them);
2. factory calls with ``device="cuda"`` (the optimizer's overflow buffer) -> CPU, via a
   ``TorchFunctionMode``; ``Tensor.cuda()`` -> the tensor itself;
3. ``Tensor.type()`` (no argument) answers ``torch.cuda.<T>Tensor`` for CPU tensors: the
   DistributedOptimizer accepts only "cuda" parameter types;
4. the model-parallel CUDA RNG tracker's ``fork`` -> a no-op context (dropout is 0: no RNG is drawn);
5. ``DistributedOptimizer._set_main_param_and_optimizer_states`` leaves torch Adam's ``step`` tensor
   alone (without Apex/TE, torch's Adam keeps ``step`` as a state tensor, which megatron's loader
   expects among the loaded states; the step itself is restored from the param groups as usual).

The model is a small Llama-like GPT on megatron's LOCAL layer spec (no Transformer Engine): RMSNorm,
SwiGLU, grouped-query attention, RoPE, untied embeddings, no biases; bf16 weights with fp32 main params
and Adam states in the DistributedOptimizer (``fully_reshardable`` sharding: one ShardedTensor per
parameter and state, ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``). The checkpoint is what
Megatron-LM's training loop saves: ``model``, ``optimizer``, ``args`` (an ``argparse.Namespace``),
``iteration``, ``checkpoint_version``, ``rng_state`` (a ShardedObject over the (pp, tp) grid) and
``content_metadata``, through ``dist_checkpointing.save`` with the torch_dist backend.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MCORE_VERSION = "0.19.2"
SHARDING_TYPE = "fully_reshardable"
SUPPORT_DIR = Path(__file__).resolve().parent
REPO = SUPPORT_DIR.parents[1]


@dataclass(frozen=True)
class GPTSpec:
    """The test model (Llama-like GPT): sizes only; every layout builds the same global model."""

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 48
    vocab_size: int = 64
    seq_len: int = 16
    bf16: bool = True
    #: the DistributedOptimizer's checkpoint format: ``fully_reshardable`` (one tensor per parameter
    #: and state) or ``dp_reshardable`` (Megatron-LM's default: flat per-bucket buffers, DP-reshardable only)
    sharding: str = SHARDING_TYPE
    #: False: megatron's plain (non-distributed) mixed-precision optimizer
    distributed_optimizer: bool = True
    #: "llama" (above) or "gpt2": learned absolute position embeddings, LayerNorm with bias, GELU MLP
    #: without gating, biases in the linear layers, embeddings tied to the output layer
    style: str = "llama"
    #: MoE: routed experts of every layer's MLP (0: a dense MLP), megatron's SequentialMLP (the one
    #: expert implementation megatron-core builds without Transformer Engine), top-k router
    num_experts: int = 0
    moe_ffn_hidden_size: int = 24
    moe_router_topk: int = 2
    #: the weights' init std (megatron's init_method_std; larger: the experts move the logits visibly)
    init_std: float = 0.02


def skip_reason() -> str | None:
    """Why megatron tests cannot run here (None: they can)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return "megatron-core is not installed (run .ci/install_megatron.sh)"
    from importlib.metadata import PackageNotFoundError, version

    try:
        got = version("megatron-core")
    except PackageNotFoundError:
        return "megatron-core has no package metadata (run .ci/install_megatron.sh)"
    if got != MCORE_VERSION:
        return f"megatron-core {got} is installed; these tests need {MCORE_VERSION} (.ci/install_megatron.sh)"
    if importlib.util.find_spec("triton") is None:
        return "triton (imported by megatron.core) is missing (run .ci/install_megatron.sh)"
    return None


_PATCHED = False


def apply_cpu_patches() -> None:
    """The patches of the module docstring (idempotent; call before importing megatron.core)."""
    global _PATCHED
    if _PATCHED:
        return
    import contextlib

    import torch
    from torch.overrides import TorchFunctionMode

    class _Stream:
        def wait_event(self, *_: Any) -> None: ...
        def wait_stream(self, *_: Any) -> None: ...
        def synchronize(self) -> None: ...

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: _Stream()

    def _cpu(device: Any) -> Any:
        if device is None:
            return device
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        return torch.device("cpu") if d.type == "cuda" else device

    class _CpuMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return func(*args, **kwargs)

    _CpuMode().__enter__()
    torch.Tensor.cuda = lambda self, *a, **k: self
    real_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kw):
        if dtype is None:
            name = real_type(self)
            return name if name.startswith("torch.cuda.") else "torch.cuda." + name[len("torch."):]
        return real_type(self, dtype, non_blocking, **kw)

    torch.Tensor.type = _type
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    real_set = DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_states(self, model_param, tensors):  # patch 5
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            real_set(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_states
    _PATCHED = True


# ---------------------------------------------------------------- building (inside a torchrun rank)


def init_parallel(tp: int, pp: int, vpp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    """gloo process group (from torchrun's env) and megatron's model-parallel groups (``vpp``: model
    chunks per pipeline stage, ``ep`` / ``etp``: expert model / tensor parallel sizes)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def build(spec: GPTSpec, seed: int) -> tuple[Any, Any, Any]:
    """(GPTModel, its megatron DDP wrapper, DistributedOptimizer) for this rank's stage and TP shard."""
    models, ddps, opt = build_chunks(spec, seed)
    return models[0], ddps[0], opt


def transformer_config(spec: GPTSpec) -> Any:
    """megatron's TransformerConfig of ``spec`` on the current parallel layout."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    gpt2 = spec.style == "gpt2"
    moe = dict(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
               moe_router_topk=spec.moe_router_topk, moe_token_dispatcher_type="allgather",
               moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
               expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
               expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size()) if spec.num_experts else {}
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, ffn_hidden_size=spec.ffn_hidden_size, gated_linear_unit=not gpt2,
        activation_func=F.gelu if gpt2 else F.silu, normalization="LayerNorm" if gpt2 else "RMSNorm",
        add_bias_linear=gpt2, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=spec.bf16,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp, init_method_std=spec.init_std, **moe,
    )


def build_chunks(spec: GPTSpec, seed: int) -> tuple[list, list, Any]:
    """([GPTModel per model chunk], [its megatron DDP wrapper], the optimizer over all chunks) for
    this rank's stage, TP shard and (with a virtual pipeline) its model chunks."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    gpt2 = spec.style == "gpt2"
    config = transformer_config(spec)
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts or None,
                                          normalization="LayerNorm" if gpt2 else "RMSNorm")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    models, ddps = [], []
    for chunk in range(vpp):
        stage = chunk if vpp > 1 else None
        model = GPTModel(
            config, layer_spec, vocab_size=spec.vocab_size, max_sequence_length=spec.seq_len,
            position_embedding_type="learned_absolute" if gpt2 else "rope",
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=gpt2, vp_stage=stage,
        )
        wrapped = Float16Module(config, model) if spec.bf16 else model
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=spec.distributed_optimizer,
                                                  grad_reduce_in_fp32=True), wrapped,
            disable_bucketing=chunk > 0,
        )
        models.append(model)
        ddps.append(ddp)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=spec.distributed_optimizer, bf16=spec.bf16,
                        clip_grad=0.0),
        ddps,
    )
    return models, ddps, opt


def train_steps(spec: GPTSpec, model: Any, ddp: Any, opt: Any, steps: int) -> None:
    """``steps`` optimizer steps (``model`` / ``ddp``: one model chunk or the list of them). Without
    pipeline parallelism, virtual pipeline or experts: a real forward/backward on a fixed batch;
    with them (megatron's pipeline schedules need CUDA streams; no token all-to-all on CPU):
    gradients set from a seeded generator per parameter shard (the same on every rank holding it: TP
    replicas alike, expert parameters seeded by their expert-parallel rank too), then megatron's own
    grad sync and optimizer step."""
    import zlib

    import torch
    from megatron.core import parallel_state as ps

    models = model if isinstance(model, list) else [model]
    ddps = ddp if isinstance(ddp, list) else [ddp]
    real = len(models) == 1 and ps.get_pipeline_model_parallel_world_size() == 1 and not spec.num_experts
    for step in range(steps):
        for d in ddps:
            d.zero_grad_buffer()
        opt.zero_grad()
        if real:
            g = torch.Generator().manual_seed(1000 + step)
            tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len), generator=g)
            pos = torch.arange(spec.seq_len).unsqueeze(0).expand(2, -1)
            loss = ddps[0](tokens, pos, None, labels=tokens).float().mean()
            loss.backward()
        else:
            for chunk, m in enumerate(models):
                for name, p in m.named_parameters():
                    split = getattr(p, "tensor_model_parallel", False)  # TP replicas get the same gradient
                    if getattr(p, "allreduce", True):
                        where = f"{ps.get_tensor_model_parallel_rank() if split else '-'}"
                    else:
                        where = f"{ps.get_expert_tensor_parallel_rank() if split else '-'}/e{ps.get_expert_model_parallel_rank()}"
                    key = f"{chunk}/{name}/{step}/{where}/{ps.get_pipeline_model_parallel_rank()}"
                    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                    p.main_grad.copy_(torch.randn(p.shape, generator=g) * 1e-2)
        for d in ddps:
            d.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok, "optimizer step skipped"


def rng_state_object() -> Any:
    """Megatron-LM's ``rng_state`` ShardedObject: this rank's RNG states over the (pp, tp) grid,
    one replica per DP rank (layout-bound: its key names the grid)."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
              "torch_rng_state": torch.get_rng_state()}]
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", state, (pp, tp),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank())


def sharded_state_dict(spec: GPTSpec, model: Any, opt: Any, iteration: int, loading: bool, rng: bool) -> dict:
    """The state Megatron-LM's ``generate_state_dict`` saves / loads (``rng``: include rng_state;
    ``model``: one model chunk, or the list of chunks of a virtual pipeline: ``model0``, ``model1``, ...)."""
    import argparse

    from megatron.core import parallel_state as ps

    meta = {"distrib_optim_sharding_type": spec.sharding, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}
    models = model if isinstance(model, list) else [model]
    sd: dict[str, Any] = {}
    for i, m in enumerate(models):
        sd["model" if len(models) == 1 else f"model{i}"] = m.sharded_state_dict()
    sd.update({
        "optimizer": opt.sharded_state_dict(sd, is_loading=loading, metadata=meta),
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "args": megatron_args(spec, iteration, "torch_dist"),
        "content_metadata": meta,
    })
    if rng:
        sd["rng_state"] = rng_state_object()
    return sd


def megatron_args(spec: GPTSpec, iteration: int, ckpt_format: str) -> Any:
    """An ``argparse.Namespace`` with the names of Megatron-LM's own training arguments
    (``megatron/training/arguments.py``) for ``spec`` on the current layout, as its checkpoints keep them."""
    import argparse

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    gpt2 = spec.style == "gpt2"
    return argparse.Namespace(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, group_query_attention=spec.num_query_groups
        != spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.hidden_size // spec.num_attention_heads, max_position_embeddings=spec.seq_len,
        seq_length=spec.seq_len, padded_vocab_size=spec.vocab_size, swiglu=not gpt2,
        normalization="LayerNorm" if gpt2 else "RMSNorm", position_embedding_type="learned_absolute" if gpt2 else "rope",
        untie_embeddings_and_output_weights=not gpt2, add_bias_linear=gpt2, params_dtype=torch.bfloat16
        if spec.bf16 else torch.float32, bf16=spec.bf16, fp16=False,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        num_experts=spec.num_experts or None, moe_ffn_hidden_size=spec.moe_ffn_hidden_size if spec.num_experts else None,
        moe_router_topk=spec.moe_router_topk, use_distributed_optimizer=spec.distributed_optimizer,
        overlap_grad_reduce=False, ddp_bucket_size=None, data_parallel_size=ps.get_data_parallel_world_size(),
        world_size=dist.get_world_size(), rank=dist.get_rank(), ckpt_format=ckpt_format, iteration=iteration,
        transformer_impl="local", accumulate_allreduce_grads_in_fp32=True,
        lr=1e-2, optimizer="adam", consumed_train_samples=iteration * 2,
    )


def legacy_checkpoint_dir(root: "os.PathLike[str] | str", iteration: int) -> Path:
    """This rank's folder of a legacy checkpoint, named as Megatron-LM's ``get_checkpoint_name``:
    ``iter_<7 digits>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]`` (pp when PP > 1, ep when EP > 1)."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return Path(root) / f"iter_{iteration:07d}" / name


def cpu_rng_state() -> dict:
    """Megatron-LM's per-rank RNG state (``get_rng_state``): python, numpy and torch generators, and
    the CUDA ones (``cuda_rng_state``, the model-parallel tracker's states): without CUDA, CPU
    generator states stand for them (same type, a ByteTensor)."""
    import random

    import numpy as np
    import torch

    cuda = torch.Generator().manual_seed(7).get_state()
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": cuda,
            "rng_tracker_states": {"model-parallel-rng": cuda.clone()}}


def save_legacy(root: "os.PathLike[str] | str", spec: GPTSpec, models: list, opt: Any, iteration: int) -> None:
    """What Megatron-LM's ``save_checkpoint`` writes with ``--ckpt-format torch`` (Megatron-LM main of
    2026-08, ``megatron/training/checkpointing.py``): the DistributedOptimizer's
    ``save_parameter_state`` (``distrib_optim.pt``, DP rank 0 of each group after a gather), then on
    DP rank 0 (or expert-DP rank 0) ``torch.save`` of ``generate_state_dict`` (args, checkpoint_version,
    iteration, ``model`` / ``model<i>`` = ``state_dict_for_save_checkpoint()``, ``optimizer.state_dict()``,
    opt_param_scheduler, rng_state, num_floating_point_operations_so_far) into
    ``model_optim_rng.pt``, and ``latest_checkpointed_iteration.txt`` on rank 0 after a barrier."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    folder = legacy_checkpoint_dir(root, iteration)
    folder.mkdir(parents=True, exist_ok=True)
    if spec.distributed_optimizer:
        opt.save_parameter_state(str(folder / "distrib_optim.pt"))
    if ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0:
        sd: dict[str, Any] = {"args": megatron_args(spec, iteration, "torch"), "checkpoint_version": 3.0,
                              "iteration": iteration}
        for i, m in enumerate(models):
            sd["model" if len(models) == 1 else f"model{i}"] = m.state_dict_for_save_checkpoint()
        sd["optimizer"] = opt.state_dict()
        sd["opt_param_scheduler"] = {"max_lr": 1e-2, "min_lr": 0.0, "num_steps": iteration * 2,
                                     "warmup_steps": 0, "decay_steps": 100, "decay_style": "cosine"}
        sd["rng_state"] = [cpu_rng_state()]
        sd["num_floating_point_operations_so_far"] = 1.5e9 * iteration
        torch.save(sd, folder / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(iteration))


# ---------------------------------------------------------------- running jobs


def run_job(job: dict, out_dir: "os.PathLike[str] | str", timeout: int = 900) -> list[dict]:
    """Run ``megatron_worker.py`` on ``job["world"]`` ranks under torchrun; the per-rank reports."""
    import json
    import subprocess

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    job = dict(job, out=str(out_dir / "report"))
    job_file = out_dir / "job.json"
    job_file.write_text(json.dumps(job))
    worker = SUPPORT_DIR / "megatron_worker.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(
        [str(REPO), str(SUPPORT_DIR), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={job['world']}",
           str(worker), str(job_file)]
    proc = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True, timeout=timeout)
    (out_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"megatron job {job.get('mode')} failed (rc {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-6000:]}")
    return [json.loads((out_dir / f"report.{r}.json").read_text()) for r in range(job["world"])]


def save_checkpoint(dest: "os.PathLike[str] | str", tp: int, pp: int, dp: int, spec: GPTSpec = GPTSpec(),
                    steps: int = 2, work: "os.PathLike[str] | str | None" = None, vpp: int = 1, ep: int = 1,
                    etp: int | None = None, legacy: "os.PathLike[str] | str | None" = None,
                    torch_dist: bool = True, also: "dict[str, os.PathLike[str] | str] | None" = None) -> list[dict]:
    """A real megatron checkpoint of ``spec`` at ``tp`` x ``pp`` x ``dp`` (``vpp`` model chunks per stage,
    ``ep`` / ``etp`` expert parallel sizes) after ``steps`` optimizer steps (iteration = steps): torch_dist
    in ``dest`` (unless not ``torch_dist``) and, with ``legacy``, Megatron-LM's legacy format of the same
    trained state in that folder; ``also`` ({optimizer format: folder}): the same state saved once more
    in torch_dist with that DistributedOptimizer format (``fully_reshardable``, which megatron reshards on
    load, is the oracle for a ``dp_reshardable`` save's conversion)."""
    work = Path(work) if work is not None else Path(dest).parent / (Path(dest).name + ".run")
    fmt = "both" if legacy is not None and torch_dist else "legacy" if legacy is not None else "torch_dist"
    job = {"mode": "save", "world": tp * pp * dp, "tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "etp": etp,
           "spec": asdict(spec), "ckpt": str(Path(dest).resolve()), "steps": steps, "format": fmt}
    if legacy is not None:
        job["legacy"] = str(Path(legacy).resolve())
    if also:
        job["also"] = {k: str(Path(v).resolve()) for k, v in also.items()}
    return run_job(job, work)


#: The small model of the checked-in legacy fixture (``tests/data/megatron/legacy_*``).
SMALL = GPTSpec(num_layers=4, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
                vocab_size=32, seq_len=8)


def load_and_compare(reference: "os.PathLike[str] | str", converted: "os.PathLike[str] | str", tp: int, pp: int,
                     dp: int, work: "os.PathLike[str] | str", spec: GPTSpec = GPTSpec(), rng: bool = False,
                     vpp: int = 1, ep: int = 1, etp: int | None = None,
                     common: tuple[str, ...] | None = None, converted_format: str = "torch_dist",
                     count_reads: bool = False, also: "tuple[os.PathLike[str] | str, ...]" = ()) -> list[dict]:
    """megatron's own ``dist_checkpointing.load`` of ``reference`` and of ``converted`` into two GPTModels
    (with their DistributedOptimizers) on ``tp`` x ``pp`` x ``dp`` (``vpp`` model chunks per stage, ``ep``
    / ``etp`` expert parallel sizes); each rank reports what differs (model parameters, fp32 main
    params, Adam states and steps, param groups, the ``common`` values: iteration, checkpoint_version,
    args, content_metadata and rng_state by default). ``converted_format`` "legacy": ``converted`` is a
    legacy checkpoint, loaded as Megatron-LM's ``load_checkpoint`` does with ``--ckpt-format torch``.
    ``count_reads``: each report's ``reads`` lists what the converted checkpoint's load read
    (key, chunk offsets, file, bytes). ``also``: more torch_dist conversions, each loaded after the first
    and compared to the same reference load (each report's ``also``: their reports, in order)."""
    job = {"mode": "compare", "converted_format": converted_format, "count_reads": count_reads, "world": tp * pp * dp, "tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "etp": etp,
           "spec": asdict(spec), "reference": str(Path(reference).resolve()),
           "converted": str(Path(converted).resolve()), "rng": rng, "also": [str(Path(p).resolve()) for p in also]}
    if common is not None:
        job["common"] = list(common)
    return run_job(job, work)


def forward_logits(ckpt: "os.PathLike[str] | str", tokens: list[list[int]], work: "os.PathLike[str] | str",
                   spec: GPTSpec = GPTSpec()) -> Any:
    """float32 logits ``[batch, seq, vocab]`` of megatron's GPTModel (TP1, one process) loaded from
    ``ckpt`` by megatron's own ``dist_checkpointing.load``, on ``tokens``."""
    import torch

    work = Path(work)
    run_job({"mode": "forward", "world": 1, "tp": 1, "pp": 1, "spec": asdict(spec),
             "ckpt": str(Path(ckpt).resolve()), "tokens": tokens, "logits": str((work / "logits.pt").resolve())}, work)
    return torch.load(work / "logits.pt")


def main(argv: list[str] | None = None) -> None:
    """Regenerate a checked-in fixture: ``python tests/support/megatron_support.py DEST --tp 2 --dp 2``
    (``--legacy``: DEST/legacy in Megatron-LM's legacy format, DEST/torch_dist in torch_dist
    (``fully_reshardable`` optimizer) and DEST/dp_reshardable in torch_dist with Megatron-LM's default
    ``dp_reshardable`` optimizer format: the same trained state, of the small model :data:`SMALL`)."""
    import argparse
    import shutil

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("dest")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--legacy", action="store_true")
    a = p.parse_args(argv)
    reason = skip_reason()
    if reason:
        raise SystemExit(reason)
    dest = Path(a.dest)
    if dest.exists():
        shutil.rmtree(dest)
    work = dest.parent / (dest.name + ".run")
    if a.legacy:
        save_checkpoint(dest / "torch_dist", a.tp, a.pp, a.dp, SMALL, steps=a.steps, work=work, vpp=a.vpp,
                        legacy=dest / "legacy", also={"dp_reshardable": dest / "dp_reshardable"})
    else:
        save_checkpoint(dest, a.tp, a.pp, a.dp, steps=a.steps, work=work)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
