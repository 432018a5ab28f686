"""One torchrun rank of an FSDP2 job on transformers' ``LlamaForCausalLM`` with ``torch.optim.AdamW``
(CPU, gloo): ``torchrun ... hf_fsdp_worker.py JOB.json``.

It resumes as such a job does: every decoder layer and the root ``fully_shard``-ed over all ranks,
the templates from ``get_state_dict(model, optim)``, ``dcp.load`` of ``JOB["ckpt"]`` into
``{"model": ..., "optim": ...}`` and ``set_state_dict``. Then it takes one optimizer step with the
gradients of ``JOB["grads"]`` (a ``torch.save`` of full tensors by HF FQN, each distributed like its
parameter) and rank 0 saves to ``JOB["out"]`` the full parameters, ``exp_avg``, ``exp_avg_sq`` and
``step`` after the step, and each param group's hyperparameters as loaded.

With ``JOB["save"]`` the job then saves its state as such a job does (``dcp.save`` of
``{"model": ..., "optim": ...}`` from ``get_state_dict``: a transformers FSDP2 checkpoint), and with
``JOB["grads2"]`` it takes a second step with those gradients, saved under ``after2``, ``exp_avg2``, ...

With ``JOB["train"]`` (``{"steps": [...], "lrs": [...], "max_norm": ..., "seq_len": ..., "global_batch": ...}``)
it instead trains on, after the load, as torchtitan's Trainer does in the tests
(:mod:`titan_support`'s synthetic data: sample ``i`` of the global batch seeded ``1000 + i``, rank
``r`` of ``D`` taking its ``r``-th slice, the same batch every step): the mean token cross-entropy,
FSDP2's gradient averaging, ``clip_grad_norm_`` at ``max_norm``, each step's lr set from ``lrs``;
``losses`` holds each step's global mean loss.

With ``JOB["model_only"]`` only the weights are loaded and the AdamW starts fresh with the
hyperparameters of ``JOB["hparams"]`` (a restart that loses the optimizer).

JOB keys: ``ckpt``, ``config`` (``LlamaConfig`` keyword arguments), ``grads``, ``out``, ``save``, ``grads2``,
``train``, ``model_only``, ``hparams``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import LlamaConfig, LlamaForCausalLM

    job = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(1234)  # the initial weights are overwritten by the load
    model = LlamaForCausalLM(LlamaConfig(**job["config"])).float()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(0.5, 0.5), eps=1.0, weight_decay=0.0)
    if job.get("model_only"):  # weights only (a --model-only conversion): a fresh AdamW with JOB["hparams"]
        state = {"model": get_model_state_dict(model)}  # not get_state_dict: it would initialise optim's state
        dcp.load(state, checkpoint_id=job["ckpt"])
        set_model_state_dict(model, state["model"])
        for group in optim.param_groups:
            group.update({k: tuple(v) if k == "betas" else v for k, v in job["hparams"].items()})
    else:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=job["ckpt"])
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    named = list(model.named_parameters())
    full = (lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
    got: dict = {"groups": [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]}

    def step(grads_file: str, suffix: str) -> None:
        grads = torch.load(grads_file, weights_only=True)
        missing = [n for n, _ in named if n not in grads]
        if missing:
            raise SystemExit(f"no gradient for {missing[:3]}")
        for name, p in named:
            g = grads[name].to(p.dtype)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
        optim.step()
        optim.zero_grad()
        got["after" + suffix] = {n: full(p).detach().clone() for n, p in named}
        for role in ("exp_avg", "exp_avg_sq", "step"):
            got[role + suffix] = {n: full(optim.state[p][role]).detach().clone() for n, p in named}

    if job.get("train"):
        got["losses"] = _train(model, optim, job["train"], job["config"]["vocab_size"])
        if dist.get_rank() == 0:
            torch.save(got, job["out"])
        dist.barrier()
        dist.destroy_process_group()
        return
    step(job["grads"], "")
    if job.get("save"):
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=job["save"])
    if job.get("grads2"):
        step(job["grads2"], "2")
    if dist.get_rank() == 0:
        torch.save(got, job["out"])
    dist.barrier()
    dist.destroy_process_group()


def _train(model, optim, train: dict, vocab: int) -> dict[str, float]:
    """Train the steps of ``train`` on titan_support's synthetic batch; each step's global mean loss."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    world, rank = dist.get_world_size(), dist.get_rank()
    local = train["global_batch"] // world
    seqs = []
    for i in range(rank * local, rank * local + local):
        g = torch.Generator().manual_seed(1000 + i)
        seqs.append(torch.randint(2, vocab, (train["seq_len"] + 1,), generator=g))
    toks = torch.stack(seqs)
    inputs, labels = toks[:, :-1], toks[:, 1:]
    losses = {}
    for step, lr in zip(train["steps"], train["lrs"]):
        for group in optim.param_groups:
            group["lr"] = lr
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train["max_norm"])
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[str(step)] = float(mean) / world
    return losses


def run(job: dict, out_dir: "os.PathLike[str] | str", ranks: int = 2, timeout: int = 900) -> dict:
    """Run this worker under torchrun on ``ranks`` ranks; rank 0's saved result."""
    import subprocess

    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    job = dict(job, out=str(out_dir / "after.pt"))
    job_file = out_dir / "job.json"
    job_file.write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           str(Path(__file__).resolve()), str(job_file)]
    proc = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True, timeout=timeout)
    (out_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"FSDP2 job failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return torch.load(out_dir / "after.pt", weights_only=False)


if __name__ == "__main__":
    main()
