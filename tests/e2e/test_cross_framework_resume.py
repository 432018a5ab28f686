"""A torchtitan 0.3.0 training run resumed as an FSDP2 job on transformers' ``LlamaForCausalLM`` with
``torch.optim.AdamW`` (issue 32.3): ``ckptconv from-universal --map torchtitan-llama`` of torchtitan's
own Trainer checkpoint, loaded by the job with ``get_state_dict`` / ``dcp.load`` / ``set_state_dict``.

The oracle is the frameworks' own code, never ckptconv's tables: torchtitan's Trainer resumes the
same checkpoint and takes its next step (its gradients after clipping, and the parameters and Adam
states after the step, captured by hooks on its ``OptimizersContainer``); those are mapped to HF
names by torchtitan's own code (``FusedQKVLinear._split_qkv_on_save`` and
``Llama3StateDictAdapter.to_hf``, RoPE rows permuted). The FSDP2 job takes its first step with the
same gradients so mapped: its parameters, ``exp_avg``, ``exp_avg_sq`` and ``step`` after the step must
equal torchtitan's mapped ones within fp32 rounding, and its param groups must hold torchtitan's
hyperparameters (the lr torchtitan's scheduler set for that step).

The reverse (issue 32.3's second case): the FSDP2 job saves its state after that step as such a job
does (``dcp.save`` of ``get_state_dict``), takes one more step with seeded gradients, and
``ckptconv from-universal --map torchtitan-llama3`` (from HF names into torchtitan 0.3.0's: the states of q/k/v fused back
into the optimizer's ``wqkv``, torchtitan's flattened keys) of its save is loaded by torchtitan's
Trainer (``CheckpointManager.load``; the job saved no train_state, lr_scheduler or dataloader, so
those are excluded from loading), whose first step, with the same gradients mapped by torchtitan's
own ``from_hf`` and ``_merge_qkv_on_load``, must equal the job's second step.

The third case: a DeepSpeed 0.19.8 ZeRO-2 engine (2 ranks) trains the same ``LlamaForCausalLM`` with
``torch.optim.AdamW`` (torchtitan's hyperparameters), saves with ``engine.save_checkpoint``, and takes
one more step with seeded gradients (:mod:`ds_cross_worker`). ``ckptconv from-universal --map
torchtitan-llama3`` of the saved folder, read directly, is loaded by torchtitan's Trainer, whose first
step with the same gradients mapped by torchtitan's ``from_hf`` / ``_merge_qkv_on_load`` must equal
DeepSpeed's step (its own ``get_full_hp_param`` fragments of the fp32 masters and Adam states).
"""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

import ds_cross_worker
import hf_fsdp_worker
import titan_support
from cli_runner import run_cli
from worlds import run_world

pytestmark = [pytest.mark.slow, pytest.mark.framework("torchtitan", "transformers")]

MESH = "dp2"


def _spec():
    titan_support.apply_cpu_patches()
    from torchtitan.models.llama3 import model_registry

    return model_registry("debugmodel")


def hf_config(spec) -> dict:
    """``LlamaConfig`` arguments of torchtitan's Llama 3 debugmodel."""
    m = spec.model
    att = m.layers[0].attention
    return {"vocab_size": m.vocab_size, "hidden_size": m.dim, "num_hidden_layers": len(m.layers),
            "num_attention_heads": att.n_heads, "num_key_value_heads": att.qkv_linear.n_kv_heads,
            "head_dim": att.qkv_linear.head_dim, "intermediate_size": m.layers[0].feed_forward.w1.out_features,
            "rms_norm_eps": m.norm.eps, "rope_theta": float(att.rope.theta), "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False}


def to_hf(spec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's own mapping of model-named tensors (the fused ``wqkv`` as its parameter is) to
    HF names: the module's save hook splits ``wqkv``, the state dict adapter renames and permutes."""
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    qkv = spec.model.layers[0].attention.qkv_linear
    module = types.SimpleNamespace(head_dim=qkv.head_dim, heads_per_kv=qkv.n_heads // qkv.n_kv_heads,
                                   r_dim=qkv.n_heads // qkv.n_kv_heads + 2)
    split: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if key.endswith("qkv_linear.wqkv.weight"):
            prefix = key[:-len("wqkv.weight")]
            part = {key: t.clone()}
            FusedQKVLinear._split_qkv_on_save(module, part, prefix, None)
            split.update(part)
        else:
            split[key] = t.clone()
    return Llama3StateDictAdapter(spec.model, None).to_hf(split)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """The largest distance between ``got`` and ``want`` in fp32 units in the last place."""
    a = got.float().contiguous().view(torch.int32).long()
    b = want.float().contiguous().view(torch.int32).long()
    a = torch.where(a < 0, -(a & 0x7FFFFFFF), a)
    b = torch.where(b < 0, -(b & 0x7FFFFFFF), b)
    return int((a - b).abs().max()) if a.numel() else 0


def from_hf(spec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's own mapping of HF-named tensors to its model's parameters: the adapter's
    ``from_hf``, then the module's load hook fusing ``wq``/``wk``/``wv`` into ``wqkv``."""
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    qkv = spec.model.layers[0].attention.qkv_linear
    module = types.SimpleNamespace(head_dim=qkv.head_dim, heads_per_kv=qkv.n_heads // qkv.n_kv_heads)
    out = Llama3StateDictAdapter(spec.model, None).from_hf({k: v.clone() for k, v in state.items()})
    for key in [k for k in out if k.endswith("qkv_linear.wq.weight")]:
        FusedQKVLinear._merge_qkv_on_load(module, out, key[:-len("wq.weight")])
    return out


def _compare(got: dict, want: dict, what: str) -> tuple[int, int]:
    """(tensors bit-exact, worst ulps) of ``got`` against ``want`` (same keys, shapes, dtypes)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    worst = 0
    for name, t in want.items():
        assert got[name].shape == t.shape and got[name].dtype == t.dtype, name
        ulps = _ulps(got[name], t)
        assert ulps <= 2, f"{what} of {name}: {ulps} ulps from the other framework's step"
        worst = max(worst, ulps)
    return sum(torch.equal(got[n], t) for n, t in want.items()), worst


@pytest.fixture(scope="module")
def forward(titan_checkpoint, tmp_path_factory):
    """torchtitan's own step 3 (captured), the conversion to the FSDP2 job's names, the job's step 3
    with the same gradients, its save, and its step 4 with seeded gradients."""
    src = titan_checkpoint(MESH)
    tmp_path = tmp_path_factory.mktemp("titan_to_hf")
    spec = _spec()
    config = hf_config(spec)

    # the source side: torchtitan's Trainer resumes step 2 and takes step 3
    dump = tmp_path / "titan"
    shutil.copytree(src / "ckpt", dump / "checkpoint" / "step-2")
    for p in [dump, *dump.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    captured = tmp_path / "titan_step.pt"
    titan_support.run_job({"mesh": MESH, "dump": str(dump), "steps": 3, "capture_step": str(captured)},
                          tmp_path / "titan_run")
    titan = torch.load(captured, weights_only=False)

    # the conversion, and its dry run
    out = tmp_path / "hf"
    heads = json.dumps({k: config[k] for k in ("num_attention_heads", "num_key_value_heads")})
    args = ["from-universal", str(src / "ckpt"), str(out), "--mesh", MESH, "--map", "torchtitan-llama",
            "--config", heads]
    code, stdout, stderr = run_cli(*args, "--dry-run")
    assert code == 0, stdout + stderr
    assert ("optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg -> "
            "optim.state.model.layers.0.self_attn.k_proj.weight.exp_avg") in stdout
    code, stdout, stderr = run_cli(*args)
    assert code == 0, stdout + stderr

    # the target side: the FSDP2 job loads it and takes its first step with the same gradients
    grads = to_hf(spec, titan["grad"])
    grads_file = tmp_path / "grads_hf.pt"
    torch.save(grads, grads_file)
    g = torch.Generator().manual_seed(32)
    grads2 = {k: 1e-2 * torch.randn(t.shape, generator=g) for k, t in grads.items()}
    torch.save(grads2, tmp_path / "grads2_hf.pt")
    job = hf_fsdp_worker.run({"ckpt": str(out), "config": config, "grads": str(grads_file),
                              "save": str(tmp_path / "hf_save"), "grads2": str(tmp_path / "grads2_hf.pt")},
                             tmp_path / "hf_run")
    return types.SimpleNamespace(src=src, spec=spec, config=config, titan=titan, job=job, dir=tmp_path,
                                 grads2=grads2, heads=heads)


def test_titan_trainer_checkpoint_resumes_in_an_fsdp2_transformers_job(forward):
    src, spec, titan, job = forward.src, forward.spec, forward.titan, forward.job

    before = to_hf(spec, {k: v for k, v in torch.load(src / "reference.pt", weights_only=False).items()
                          if not k.startswith(("optimizer", "lr_scheduler", "dataloader", "train_state"))})
    lines, worst = [], 0
    for role in ("after", "exp_avg", "exp_avg_sq"):
        exact, ulps = _compare(job[role], to_hf(spec, titan[role]), role)
        worst = max(worst, ulps)
        lines.append(f"{role}: {exact}/{len(job[role])} tensors bit-exact")
    moved = sum(not torch.equal(job["after"][n], t) for n, t in before.items())
    assert moved == len(before), "the step left parameters unchanged: the comparison would be vacuous"
    steps = {float(t) for t in job["step"].values()}
    assert steps == {float(t) for t in titan["step"].values()} == {3.0}
    assert [g["lr"] for g in job["groups"]] == titan["lr"][:1] * len(job["groups"]), (job["groups"], titan["lr"])
    want_group = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    for g in job["groups"]:
        assert {k: tuple(g[k]) if k == "betas" else g[k] for k in want_group} == want_group, g
    print("\n" + "; ".join(lines) + f"; worst {worst} ulp; lr {titan['lr'][0]!r}; {moved} parameters moved")


def test_the_fsdp2_jobs_save_resumes_in_torchtitans_trainer(forward, tmp_path):
    spec, job = forward.spec, forward.job
    dump = tmp_path / "titan"
    out = dump / "checkpoint" / "step-3"
    args = ["from-universal", str(forward.dir / "hf_save"), str(out), "--mesh", MESH, "--map", "torchtitan-llama3",
            "--config", forward.heads]
    code, stdout, stderr = run_cli(*args, "--dry-run")
    assert code == 0, stdout + stderr
    assert "key map torchtitan-llama3 (from-hf), key style torchtitan" in stdout
    fused = "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"
    line = next(x for x in stdout.splitlines() if x.endswith("]") and f"-> {fused} " in x)
    assert "optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg" in line and "fused" in line, line
    code, stdout, stderr = run_cli(*args)
    assert code == 0, stdout + stderr

    inject = tmp_path / "grads2_titan.pt"
    torch.save(from_hf(spec, forward.grads2), inject)
    captured = tmp_path / "titan_step.pt"
    reports = titan_support.run_job({"mesh": MESH, "dump": str(dump), "steps": 1, "capture_step": str(captured),
                                     "inject_grads": str(inject),
                                     "exclude": ["dataloader", "lr_scheduler", "train_state"]}, tmp_path / "run")
    assert all(r["loaded"] for r in reports), reports
    titan = torch.load(captured, weights_only=False)
    lines, worst = [], 0
    for role in ("after", "exp_avg", "exp_avg_sq"):
        exact, ulps = _compare(to_hf(spec, titan[role]), job[role + "2"], role)
        worst = max(worst, ulps)
        lines.append(f"{role}: {exact}/{len(job[role + '2'])} tensors bit-exact")
    moved = sum(not torch.equal(job["after2"][n], t) for n, t in job["after"].items())
    assert moved == len(job["after"])
    assert {float(t) for t in titan["step"].values()} == {float(t) for t in job["step2"].values()} == {4.0}
    assert titan["lr"] == [job["groups"][0]["lr"]] * len(titan["lr"])
    print("\nreverse: " + "; ".join(lines) + f"; worst {worst} ulp; {moved} parameters moved")


@pytest.mark.framework("deepspeed", "torchtitan", "transformers")
def test_a_deepspeed_zero2_run_resumes_in_torchtitans_trainer(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = _spec()
    config = hf_config(spec)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(LlamaConfig(**config)).named_parameters()}
    g = torch.Generator().manual_seed(33)
    grads = {n: 2e-4 * torch.randn(s, generator=g) for n, s in shapes.items()}
    # below DeepSpeed's gradient_clipping (default 1.0, as torchtitan's max_norm): the engine's step
    # sees them unclipped, as torchtitan's optimizer sees the ones injected after its clipping
    assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in grads.values()])) < 0.9
    torch.save(grads, tmp_path / "grads_hf.pt")
    job = {"config": config, "steps": 2, "save": str(tmp_path / "ds"), "grads": str(tmp_path / "grads_hf.pt"),
           "out": str(tmp_path / "ds_step.pt")}
    run_world(ds_cross_worker.train_save_step, 2, (json.dumps(job),), timeout=900)
    ds = torch.load(tmp_path / "ds_step.pt", weights_only=False)
    assert (tmp_path / "ds" / "global_step2" / "mp_rank_00_model_states.pt").is_file()

    dump = tmp_path / "titan"
    heads = json.dumps({k: config[k] for k in ("num_attention_heads", "num_key_value_heads")})
    args = ["from-universal", str(tmp_path / "ds"), str(dump / "checkpoint" / "step-2"), "--mesh", MESH,
            "--map", "torchtitan-llama3", "--config", heads]
    code, stdout, stderr = run_cli(*args, "--dry-run")
    assert code == 0, stdout + stderr
    fused = "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg_sq"
    line = next(x for x in stdout.splitlines() if x.endswith("]") and f"-> {fused} " in x)
    assert "optim.state.model.layers.0.self_attn.k_proj.weight.exp_avg_sq" in line and "fused" in line, line
    code, stdout, stderr = run_cli(*args)
    assert code == 0, stdout + stderr

    inject = tmp_path / "grads_titan.pt"
    torch.save(from_hf(spec, grads), inject)
    captured = tmp_path / "titan_step.pt"
    reports = titan_support.run_job({"mesh": MESH, "dump": str(dump), "steps": 1, "capture_step": str(captured),
                                     "inject_grads": str(inject),
                                     "exclude": ["dataloader", "lr_scheduler", "train_state"]}, tmp_path / "run")
    assert all(r["loaded"] for r in reports), reports
    titan = torch.load(captured, weights_only=False)
    lines, worst = [], 0
    for role in ("after", "exp_avg", "exp_avg_sq"):
        exact, ulps = _compare(to_hf(spec, titan[role]), ds[role], role)
        worst = max(worst, ulps)
        lines.append(f"{role}: {exact}/{len(ds[role])} tensors bit-exact")
    assert {float(t) for t in titan["step"].values()} == set(ds["step"]) == {3.0}
    assert titan["lr"] == [ds["groups"][0]["lr"]] * len(titan["lr"]) == [ds_cross_worker.ADAMW["lr"]] * len(titan["lr"])
    print("\ndeepspeed zero-2 -> torchtitan: " + "; ".join(lines) + f"; worst {worst} ulp; "
          f"deepspeed losses {ds['losses']}")
