"""The loss curve of a run moved between frameworks with its optimizer (issue 32.3): torchtitan
0.3.0's Trainer -> an FSDP2 job on transformers' ``LlamaForCausalLM`` + ``torch.optim.AdamW``.

One command (about 1.5 min on 2 shared cores; needs torchtitan, transformers, matplotlib)::

    python bench/cross_map_loss_curve.py            # -> docs/cross_map_loss_curve.png + .json
    python bench/cross_map_loss_curve.py --replot   # redraw the PNG from the .json

1. torchtitan's own Trainer (Llama 3 debugmodel, dp2, CPU, gloo; ``tests/support/titan_support``)
   trains ``--steps`` steps uninterrupted, saving at step ``--resume-at``; each step's loss and lr
   are recorded.
2. ``ckptconv from-universal STEP_DIR OUT --mesh dp2 --map torchtitan-llama --config HEADS`` of that
   save (weights, exp_avg, exp_avg_sq, step, hyperparameters).
3. The FSDP2 job (``tests/support/hf_fsdp_worker``, dp2) loads it with ``get_state_dict`` /
   ``dcp.load`` / ``set_state_dict`` and trains the remaining steps on the same batch with the same
   lr per step and the same clipping (max_norm 1.0).
4. The control: the same job from a ``--model-only`` conversion (the weights alone, as an
   ``export-hf`` would carry them) with a fresh AdamW of torchtitan's hyperparameters.

The plot shows both losses per step and their difference. Both sides train on the same data with
the same optimizer state, but their forwards are different code (torchtitan's model with
interleaved RoPE and FlexAttention patched to SDPA vs transformers' rotate-half RoPE and SDPA), so
the losses agree to fp32 rounding, not bit for bit, and the rounding difference can grow over steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support"), str(ROOT / "tests" / "e2e")]

import titan_support  # noqa: E402
import hf_fsdp_worker  # noqa: E402
from cli_runner import run_cli  # noqa: E402


def _spec_config() -> dict:
    from test_cross_framework_resume import _spec, hf_config

    return hf_config(_spec())


def run(steps: int, resume_at: int, work: Path) -> dict:
    """Both runs; their losses and lrs per step."""
    config = _spec_config()
    dump = work / "titan"
    reports = titan_support.run_job({"mesh": "dp2", "dump": str(dump), "steps": steps, "save_interval": resume_at,
                                     "record_lr": True}, work / "titan_run")
    titan = {int(k): v for k, v in reports[0]["losses"].items()}
    lrs = {int(k): v for k, v in reports[0]["lrs"].items()}
    heads = json.dumps({k: config[k] for k in ("num_attention_heads", "num_key_value_heads")})
    out = work / "hf"
    code, stdout, stderr = run_cli("from-universal", str(dump / "checkpoint" / f"step-{resume_at}"), str(out),
                                   "--mesh", "dp2", "--map", "torchtitan-llama", "--config", heads, "--no-progress")
    if code:
        raise SystemExit(stdout + stderr)
    rest = list(range(resume_at + 1, steps + 1))
    train = {"steps": rest, "lrs": [lrs[s] for s in rest], "max_norm": 1.0, "seq_len": titan_support.SEQ_LEN,
             "global_batch": titan_support.GLOBAL_BATCH}
    job = hf_fsdp_worker.run({"ckpt": str(out), "config": config, "train": train}, work / "hf_run")
    hf = {int(k): v for k, v in job["losses"].items()}
    # the control: the same job from the weights only (--model-only), a fresh AdamW (torchtitan's hyperparameters)
    code, stdout, stderr = run_cli("from-universal", str(dump / "checkpoint" / f"step-{resume_at}"), str(work / "hf_w"),
                                   "--mesh", "dp2", "--map", "torchtitan-llama", "--config", heads, "--model-only",
                                   "--no-progress")
    if code:
        raise SystemExit(stdout + stderr)
    hparams = {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    job = hf_fsdp_worker.run({"ckpt": str(work / "hf_w"), "config": config, "train": train, "model_only": True,
                              "hparams": hparams}, work / "hf_w_run")
    fresh = {int(k): v for k, v in job["losses"].items()}
    return {"resume_at": resume_at, "torchtitan": titan, "fsdp2_transformers": hf, "weights_only_fresh_adamw": fresh,
            "lr": lrs,
            "diff": {s: hf[s] - titan[s] for s in rest},
            "rel_diff": {s: (hf[s] - titan[s]) / titan[s] for s in rest}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titan, hf, r = result["torchtitan"], result["fsdp2_transformers"], result["resume_at"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[3, 1.4])
    top.plot(sorted(titan), [titan[s] for s in sorted(titan)], "o-", label="torchtitan 0.3.0 Trainer,\nuninterrupted")
    top.plot(sorted(hf), [hf[s] for s in sorted(hf)], "x--", ms=9,
             label="FSDP2 job, transformers' LlamaForCausalLM,\nresumed: ckptconv --map torchtitan-llama")
    fresh = result.get("weights_only_fresh_adamw")
    if fresh:
        top.plot(sorted(fresh), [fresh[s] for s in sorted(fresh)], "s:", ms=4, color="tab:red",
                 label="the same job from the weights only,\nfresh AdamW (optimizer state lost)")
    top.axvline(r + 0.5, color="grey", lw=0.8, ls=":")
    top.text(r + 0.6, min(titan.values()), f"resumed from step {r}'s save\n(weights + AdamW states)", va="bottom",
             fontsize=8)
    top.set_ylabel("training loss")
    top.legend(fontsize=8, loc="upper right")
    top.set_title("A torchtitan run resumed in another framework with its optimizer (dp2, CPU)", fontsize=10)
    steps = sorted(result["diff"])
    bottom.bar(steps, [result["diff"][s] for s in steps], color="tab:orange")
    bottom.axhline(0, color="black", lw=0.6)
    bottom.set_ylabel("resumed (x) minus\nuninterrupted (o)", fontsize=8)
    bottom.set_title("loss difference; one fp32 ulp of a loss in [4, 8) is 4.8e-7", fontsize=8)
    bottom.set_xlabel("step")
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--resume-at", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "cross_map_loss_curve.png")
    ap.add_argument("--replot", action="store_true", help="redraw the plot from the .json beside --out")
    args = ap.parse_args()
    if args.replot:
        raw = json.loads(args.out.with_suffix(".json").read_text())
        plot({k: ({int(s): v for s, v in x.items()} if isinstance(x, dict) else x) for k, x in raw.items()}, args.out)
        return
    work = Path(tempfile.mkdtemp(prefix="cross-map-curve-"))
    try:
        result = run(args.steps, args.resume_at, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    plot(result, args.out)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    worst = max(abs(v) for v in result["rel_diff"].values())
    print(json.dumps(result, indent=1))
    print(f"worst relative loss difference {worst:.2e}; plot {args.out}")


if __name__ == "__main__":
    main()
