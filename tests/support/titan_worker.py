"""One torchrun rank of torchtitan's own Trainer (CPU, gloo): ``torchrun ... titan_worker.py JOB.json``.

JOB keys: ``mesh`` ("dp4", "tp2,dp2"), ``dump`` (the Trainer's dump folder; checkpoints go to
``dump/checkpoint/step-N``), ``steps``, ``save_interval`` (or null), ``exclude`` (torchtitan's
``checkpoint.exclude_from_loading``), ``reference`` (a ``torch.save`` file of the full source state,
from torch's ``dcp_to_torch_save``: the state right after loading is compared with it),
``skip_compare`` (flattened key prefixes not compared), ``out`` (this rank writes ``out.<rank>.json``),
``model`` (``MODEL/FLAVOR`` of an MoE model, :mod:`titan_moe_support`; absent: Llama 3 debugmodel),
``last_save_in_hf`` (torchtitan's ``checkpoint.last_save_in_hf`` with ``last_save_model_only``: the
last step is saved through its state dict adapter with DCP's ``HuggingFaceStorageWriter``),
``initial_load_hf`` (a folder loaded at start through ``checkpoint.initial_load_in_hf``: DCP's
``HuggingFaceStorageReader`` and the adapter's ``from_hf``; nothing else is loaded),
``capture_step`` (a ``torch.save`` path: rank 0 writes the first optimizer step's full gradients as the
optimizer sees them, after clipping, and every parameter and Adam state right after that step, by the
model's parameter names, through :func:`_capture_step`), ``inject_grads`` (with ``capture_step``: a
``torch.save`` of full gradients by FQN that replace the first step's own just before it),
``record_lr`` (report each step's learning rate, as the optimizer holds it just before stepping).

Each rank reports the losses of the steps it ran, the bytes ``CheckpointManager.load`` read from each
checkpoint file (counted in torch's ``FileSystemReader.read_data``), and the keys whose loaded value
differs from the reference.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import titan_support  # noqa: E402


def _count_reads(counter: dict[str, dict[str, int]]) -> None:
    """Count the bytes each load reads per file, split by whether the key is sharded (saved in more
    than one chunk) or whole."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    real = FileSystemReader.read_data

    def read_data(self, plan, planner):
        meta = planner.metadata.state_dict_metadata
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            md = meta.get(item.storage_index.fqn)
            kind = "sharded" if isinstance(md, TensorStorageMetadata) and len(md.chunks) > 1 else "whole"
            name = os.path.basename(info.relative_path)
            counter[kind][name] += info.length
            if kind == "sharded":
                counter["items"].append([item.storage_index.fqn, list(item.storage_index.offset or ()), name, info.length])
        return real(self, plan, planner)

    FileSystemReader.read_data = read_data


def _state_dict(trainer) -> dict:
    """The flattened state CheckpointManager saves/loads, as plain values (Statefuls expanded)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    sd = trainer.checkpointer._flattened_model_states_sd()
    sd = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in sd.items()}
    flat, _ = flatten_state_dict(sd)
    return flat


def _local_of(full, value):
    """The part of the full reference tensor ``value`` (a DTensor or tensor) holds."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(value, DTensor):
        return full, value
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    idx = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full[idx], value.to_local()


def _bits(t):
    """The tensor's bytes (bit-exact comparison: NaN payloads and -0.0 count)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _compare(trainer, reference: str, skip: list[str]) -> tuple[list[str], int]:
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    ref, _ = flatten_state_dict(torch.load(reference, weights_only=False))
    got = _state_dict(trainer)
    bad, compared = [], 0
    keys = set(ref) | set(got)
    for key in sorted(keys):
        if any(key.startswith(p) for p in skip):
            continue
        if key not in got and key.startswith("dataloader.dp_rank_"):
            continue  # another DP rank's dataloader state: this rank neither holds nor loads it
        if key not in ref or key not in got:
            bad.append(f"{key}: only in {'loaded' if key in got else 'reference'}")
            continue
        r, g = ref[key], got[key]
        if isinstance(g, torch.Tensor):
            r, g = _local_of(r, g)
            same = r.dtype == g.dtype and r.shape == g.shape and torch.equal(_bits(r), _bits(g))
        else:
            same = r == g
        compared += 1
        if not same:
            bad.append(f"{key}: differs")
    return bad, compared


def _capture_step(trainer, path: str, inject: str | None = None) -> None:
    """Hooks on torchtitan's ``OptimizersContainer``: the first step's gradients (pre-hook; replaced
    first by the full gradients of the ``inject`` file, each distributed like its parameter) and the
    parameters, ``exp_avg``, ``exp_avg_sq`` and ``step`` after it (post-hook), full tensors by FQN
    (``full_tensor()`` on every rank: a collective), saved by rank 0 to ``path``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    named = [(n, p) for part in trainer.model_parts for n, p in part.named_parameters()]
    full = (lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
    got: dict = {}

    def pre(_opt, _args, _kwargs):
        if "grad" not in got and inject:
            grads = torch.load(inject, weights_only=True)
            for n, p in named:
                g = grads[n].to(p.dtype)
                p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
        if "grad" not in got:
            got["grad"] = {n: full(p.grad).detach().clone() for n, p in named}

    def post(_opt, _args, _kwargs):
        if "after" in got:
            return
        states = {}
        for opt in trainer.optimizers.optimizers:
            states.update(opt.state)
        got["after"] = {n: full(p).detach().clone() for n, p in named}
        for role in ("exp_avg", "exp_avg_sq", "step"):
            got[role] = {n: full(states[p][role]).detach().clone() for n, p in named}
        got["lr"] = [g["lr"] for opt in trainer.optimizers.optimizers for g in opt.param_groups]
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(got, path)

    trainer.optimizers.register_step_pre_hook(pre)
    trainer.optimizers.register_step_post_hook(post)


def _hf_options(config, job: dict) -> None:
    """torchtitan's own HF save / initial HF load options, as a user sets them."""
    ck = config.checkpoint
    if job.get("last_save_in_hf"):
        ck.last_save_in_hf = True
        ck.last_save_model_only = True
    if job.get("initial_load_hf"):
        ck.initial_load_path = job["initial_load_hf"]
        ck.initial_load_in_hf = True
        ck.initial_load_model_only = True


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    kw = dict(save_interval=job.get("save_interval"), exclude=tuple(job.get("exclude", ())))
    if job.get("model"):  # an MoE model (titan_moe_support); ep in the mesh
        import titan_moe_support

        config, _ = titan_moe_support.trainer_config(job["mesh"], job["dump"], job["steps"], model=job["model"], **kw)
    else:
        config, _ = titan_support.trainer_config(job["mesh"], job["dump"], job["steps"], **kw)
    _hf_options(config, job)
    reads: dict = {"sharded": defaultdict(int), "whole": defaultdict(int), "items": []}
    _count_reads(reads)
    trainer = config.build()
    titan_support.force_sum_reduction(trainer.model_parts)
    losses: dict[int, float] = {}
    real_log = trainer.metrics_processor.log

    def log(step, global_avg_loss, *a, **k):
        losses[step] = float(global_avg_loss)
        return real_log(step, global_avg_loss, *a, **k)

    trainer.metrics_processor.log = log
    report: dict = {"rank": rank}
    real_load = trainer.checkpointer.load

    def load(step: int = -1) -> bool:
        loaded = real_load(step)
        report["loaded"] = loaded
        report["loaded_step"] = trainer.step
        if loaded and job.get("reference"):
            report["mismatch"], report["compared"] = _compare(trainer, job["reference"], job.get("skip_compare", []))
        return loaded

    trainer.checkpointer.load = load
    if job.get("capture_step"):
        _capture_step(trainer, job["capture_step"], job.get("inject_grads"))
    lrs: dict[str, float] = {}
    if job.get("record_lr"):
        def record(_opt, _args, _kwargs):
            lrs[str(trainer.step)] = trainer.optimizers.optimizers[0].param_groups[0]["lr"]

        trainer.optimizers.register_step_pre_hook(record)
    try:
        trainer.train()
    finally:
        trainer.close()
    report["losses"] = {str(k): v for k, v in losses.items()}
    report["lrs"] = lrs
    report["reads"] = {k: (v if k == "items" else dict(v)) for k, v in reads.items()}
    Path(f"{job['out']}.{rank}.json").write_text(json.dumps(report))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
