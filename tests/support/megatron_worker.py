"""One torchrun rank of megatron-core on CPU (gloo): ``torchrun ... megatron_worker.py JOB.json``.

JOB keys: ``mode`` ("save" or "compare"), ``tp``, ``pp`` (DP is the rest of the world), ``spec``
(:class:`megatron_support.GPTSpec` fields), ``out`` (this rank writes ``out.<rank>.json``).

- save: builds the GPTModel + DistributedOptimizer, runs ``steps`` optimizer steps and saves with
  ``dist_checkpointing.save`` (torch_dist) into ``ckpt``.
- compare: builds two GPTModels (different seeds) on the job's layout, loads ``reference`` into the
  first and ``converted`` into the second with megatron's own ``dist_checkpointing.load`` (then
  ``load_state_dict`` on model and optimizer, as Megatron-LM does), and reports every parameter,
  main param, optimizer state and common-state value that differs bit for bit (``rng``: rng_state
  is loaded too and compared).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron_support as ms  # noqa: E402

ms.apply_cpu_patches()


def _bits(t):
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a).__name__ == "Namespace":
        return type(b).__name__ == "Namespace" and _same(vars(a), vars(b))
    try:
        import numpy as np

        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return bool(np.array_equal(a, b))
    except ImportError:
        pass
    return a == b


def _optimizer_tensors(opt) -> list[tuple[str, object]]:
    """(label, tensor) of every main param and Adam state of this rank's DistributedOptimizer shards."""
    out = []
    for i, o in enumerate(getattr(opt, "chained_optimizers", [opt])):
        inner = o.optimizer
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                out.append((f"opt{i}.group{g}.param{j}", p))
                for k, v in sorted(inner.state.get(p, {}).items()):
                    out.append((f"opt{i}.group{g}.param{j}.{k}", v))
            hyper = {k: v for k, v in group.items() if k != "params"}
            out.append((f"opt{i}.group{g}.hyper", hyper))
    return out


def _load(spec, path: str, seed: int, rng: bool):
    """(model chunks, optimizer, loaded common values) after megatron's own ``dist_checkpointing.load``
    of ``path`` and ``load_state_dict`` on every model chunk and the optimizer, as Megatron-LM does
    (the optimizer's sharding type from the checkpoint's content metadata)."""
    import dataclasses

    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_content_metadata(path) or {}  # as Megatron-LM: the checkpoint's own format
    sharding = meta.get("distrib_optim_sharding_type")
    if spec.distributed_optimizer and sharding:
        spec = dataclasses.replace(spec, sharding=sharding)
    models, ddps, opt = ms.build_chunks(spec, seed)
    for o in getattr(opt, "chained_optimizers", [opt]):  # as Megatron-LM before a load: states exist
        if hasattr(o, "_init_optimizer_states_with_dummy_values"):  # the plain optimizers init on is_loading
            o._init_optimizer_states_with_dummy_values()
    sd = ms.sharded_state_dict(spec, models if len(models) > 1 else models[0], opt, iteration=0, loading=True, rng=rng)
    loaded = dist_checkpointing.load(sd, path)
    for i, m in enumerate(models):
        m.load_state_dict(loaded["model" if len(models) == 1 else f"model{i}"])
    opt.load_state_dict(loaded["optimizer"])
    return models, opt, loaded


def _count_reads(items: list) -> None:
    """Record (key, chunk offsets, file, bytes) of every item torch's FileSystemReader reads."""
    from torch.distributed.checkpoint import FileSystemReader

    real = FileSystemReader.read_data

    def read_data(self, plan, planner):
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            items.append([item.storage_index.fqn, list(item.storage_index.offset or ()),
                          os.path.basename(info.relative_path), info.length])
        return real(self, plan, planner)

    FileSystemReader.read_data = read_data


def _load_legacy(spec, root: str, seed: int):
    """(model chunks, optimizer, the file's values) after Megatron-LM's legacy load
    (``load_checkpoint`` with ``--ckpt-format torch``): this rank's ``model_optim_rng.pt`` through
    ``torch.load``, every model chunk's ``load_state_dict(strict=True)``, the optimizer's
    ``load_state_dict`` and, for the DistributedOptimizer, ``load_parameter_state(distrib_optim.pt)``."""
    import torch

    models, ddps, opt = ms.build_chunks(spec, seed)
    iteration = int((Path(root) / "latest_checkpointed_iteration.txt").read_text())
    folder = ms.legacy_checkpoint_dir(root, iteration)
    sd = torch.load(folder / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    for i, m in enumerate(models):
        m.load_state_dict(sd["model" if len(models) == 1 else f"model{i}"], strict=True)
    opt.load_state_dict(sd["optimizer"])
    if spec.distributed_optimizer:
        opt.load_parameter_state(str(folder / "distrib_optim.pt"))
    return models, opt, sd


def _model_state(models) -> dict:
    return {f"{i}/{k}": v for i, m in enumerate(models) for k, v in m.state_dict().items()}


def _compare(job: dict, spec) -> dict:
    """The reference loaded once, then the converted checkpoint and each of ``also`` (more converted
    checkpoints, each compared to the same reference: ``also`` in the report)."""
    ref_models, ref_opt, ref = _load(spec, job["reference"], 11, job.get("rng", False))
    reads: list = []
    if job.get("count_reads"):
        _count_reads(reads)  # (the converted checkpoints' loads only)
    out = _compare_one(job, spec, ref_models, ref_opt, ref, job["converted"], job.get("converted_format"), reads)
    extra = []
    for path in job.get("also", ()):
        del reads[:]
        extra.append(_compare_one(job, spec, ref_models, ref_opt, ref, path, "torch_dist", reads))
    return dict(out, also=extra)


def _compare_one(job: dict, spec, ref_models, ref_opt, ref, path: str, fmt: str | None, reads: list) -> dict:
    """What differs between the loaded reference and ``path`` loaded the same way (``fmt`` "legacy":
    Megatron-LM's legacy load), and what that load read."""
    if fmt == "legacy":
        got_models, got_opt, got = _load_legacy(spec, path, 22)
    else:
        got_models, got_opt, got = _load(spec, path, 22, job.get("rng", False))
    bad, compared = [], 0
    ref_sd, got_sd = _model_state(ref_models), _model_state(got_models)
    for key in sorted(set(ref_sd) | set(got_sd)):
        if key.endswith("_extra_state"):
            continue
        compared += 1
        if key not in ref_sd or key not in got_sd or not _same(ref_sd[key], got_sd[key]):
            bad.append(f"model {key}")
    for (label, a), (_, b) in zip(_optimizer_tensors(ref_opt), _optimizer_tensors(got_opt), strict=True):
        compared += 1
        if not _same(a, b):
            bad.append(label)
    for key in job.get("common", ("iteration", "checkpoint_version", "args", "content_metadata", "rng_state")):
        if key in ref or key in got:
            compared += 1
            if not _same(ref.get(key), got.get(key)):
                bad.append(f"common {key}: {ref.get(key)!r} != {got.get(key)!r}"[:300])
    return {"mismatch": bad, "compared": compared, "iteration": got.get("iteration"), "reads": list(reads),
            "params": sum(int(t.numel()) for t in got_sd.values() if hasattr(t, "numel"))}


def _forward(job: dict, spec) -> dict:
    """Logits of the model loaded from ``ckpt`` (megatron's own load, model only) on ``tokens``,
    saved as float32 to ``logits``."""
    import torch
    from megatron.core import dist_checkpointing

    model, _, _ = ms.build(spec, 33)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, job["ckpt"])
    model.load_state_dict(loaded["model"])
    model.eval()
    tokens = torch.tensor(job["tokens"], dtype=torch.long)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = model(tokens, pos, None)
    torch.save(logits.float().contiguous(), job["logits"])
    return {"shape": list(logits.shape)}


def _save(job: dict, spec) -> None:
    """Train and save: ``format`` "torch_dist" (default) into ``ckpt``; "legacy" (Megatron-LM's
    ``--ckpt-format torch``) into ``legacy``; "both": the same trained state into both."""
    from megatron.core import dist_checkpointing

    models, ddps, opt = ms.build_chunks(spec, 1234)
    ms.train_steps(spec, models, ddps, opt, job["steps"])
    fmt = job.get("format", "torch_dist")
    if fmt in ("torch_dist", "both"):
        os.makedirs(job["ckpt"], exist_ok=True)
        sd = ms.sharded_state_dict(spec, models if len(models) > 1 else models[0], opt, iteration=job["steps"],
                                   loading=False, rng=True)
        dist_checkpointing.save(sd, job["ckpt"], content_metadata=sd.pop("content_metadata"))
    if fmt in ("legacy", "both"):
        ms.save_legacy(job["legacy"], spec, models, opt, job["steps"])
    for sharding, path in job.get("also", {}).items():  # the same state again, another optimizer format
        import dataclasses

        other = dataclasses.replace(spec, sharding=sharding)
        os.makedirs(path, exist_ok=True)
        sd = ms.sharded_state_dict(other, models if len(models) > 1 else models[0], opt, iteration=job["steps"],
                                   loading=False, rng=True)
        dist_checkpointing.save(sd, path, content_metadata=sd.pop("content_metadata"))


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    spec = ms.GPTSpec(**job["spec"])
    ms.init_parallel(job["tp"], job["pp"], job.get("vpp", 1), job.get("ep", 1), job.get("etp"))
    import torch.distributed as dist

    report: dict = {"rank": rank}
    if job["mode"] == "save":
        _save(job, spec)
    elif job["mode"] == "compare":
        report.update(_compare(job, spec))
    elif job["mode"] == "forward":
        report.update(_forward(job, spec))
    else:
        raise SystemExit(f"unknown mode {job['mode']!r}")
    Path(f"{job['out']}.{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
