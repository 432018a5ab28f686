"""DeepSpeed ``save_checkpoint`` folders for the direct-reader tests, saved by DeepSpeed 0.19.8's
own engine (CPU, gloo) and cached with DeepSpeed's own consolidations beside them.

A case is named ``[hf-]z<stage>-<dtype>-w<world>[-g2][-rich][-bf16opt]`` (dtype ``fp32`` /
``bf16`` / ``fp16``; ``g2``: two param groups; ``rich``: buffers of every dtype, a tied and a
frozen parameter; ``bf16opt``: DeepSpeed's BF16_Optimizer; ``hf-``: a ``transformers.Trainer``
run, :mod:`ds_trainer_run`, saved in ``run/checkpoint-3/``). Its cache entry holds::

    run/latest, run/global_step3/...   what engine.save_checkpoint wrote (3 AdamW steps)
    run/live.pt                        DeepSpeed's own full state after the save (safe_get_full_*)
    run/next.json                      the loss of a fixed next batch from the saved state
    fp32.pt                            DeepSpeed's get_fp32_state_dict_from_zero_checkpoint (ZeRO>=1)
    universal/ or universal.err        ds_to_universal.py's output, or why it failed (ZeRO>=1)

Entries live in ``<cache>/ds-zero-<torch>-<hash of this file, the workers and models.py>/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORT = Path(__file__).resolve().parent
TIMEOUT = 300.0
TAG = "global_step3"
_NAME = re.compile(r"(?P<hf>hf-)?z(?P<stage>[0-3])-(?P<dtype>fp32|bf16|fp16)-w(?P<world>[1-9])(?P<extra>(?:-[a-z0-9]+)*)")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Case:
    """One DeepSpeed run: ZeRO stage, dtype, data-parallel world, param groups, model variant."""

    stage: int
    dtype: str
    world: int
    groups: int = 1
    model: str = "pad"  # "pad", "rich" or "hf" (the Trainer's Llama)
    bf16_optimizer: bool = False

    @classmethod
    def parse(cls, name: str) -> Case:
        m = _NAME.fullmatch(name)
        if m is None:
            raise KeyError(f"bad case name {name!r}")
        extras = set(filter(None, m["extra"].split("-")))
        unknown = extras - {"g2", "rich", "bf16opt"}
        if unknown:
            raise KeyError(f"case {name!r}: unknown parts {sorted(unknown)}")
        if m["hf"]:
            return cls(int(m["stage"]), _DTYPES[m["dtype"]], int(m["world"]), 2, "hf")
        return cls(int(m["stage"]), _DTYPES[m["dtype"]], int(m["world"]), 2 if "g2" in extras else 1,
                   "rich" if "rich" in extras else "pad", "bf16opt" in extras)

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "dtype": self.dtype, "world": self.world, "groups": self.groups,
                "model": self.model, "bf16_optimizer": self.bf16_optimizer}

    def at(self, stage: int, world: int) -> Case:
        """The same model and optimizer under another stage and world (for loading)."""
        from dataclasses import replace

        return replace(self, stage=stage, world=world, bf16_optimizer=self.bf16_optimizer and stage == 1)


def deepspeed_env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(
        [str(SUPPORT.parents[1]), str(SUPPORT), os.environ.get("PYTHONPATH", "")])}


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env=deepspeed_env())


_FP32 = """
import contextlib, io, sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
with contextlib.redirect_stdout(io.StringIO()):
    sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
torch.save({k: v.contiguous() for k, v in sd.items()}, sys.argv[2])
"""


def save_dir(entry: Path, case: Case) -> Path:
    """The folder holding ``latest`` (a Trainer's ``checkpoint-3/``)."""
    from ds_trainer_run import TRAINER_TAG

    return entry / "run" / TRAINER_TAG if case.model == "hf" else entry / "run"


def build_case(name: str, out: Path) -> None:
    """Train and save case ``name`` into ``out`` with DeepSpeed, then DeepSpeed's consolidations."""
    case = Case.parse(name)
    if case.model == "hf":
        _run_trainer(case, out / "run")
    else:
        from ckpt_factory import run_world
        from ds_zero_worker import train_and_save

        run_world(train_and_save, case.world, (case.to_json(), str(out / "run")), timeout=TIMEOUT)
    if case.stage == 0:
        return
    proc = _run_python(_FP32, str(save_dir(out, case)), str(out / "fp32.pt"))
    if proc.returncode:
        (out / "fp32.err").write_text(proc.stderr[-4000:])
    _ds_to_universal(save_dir(out, case) / TAG, out, case.stage)


def _run_trainer(case: Case, out: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.world}",
           str(SUPPORT / "ds_trainer_run.py"), str(out), str(case.stage)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=deepspeed_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _ds_to_universal(tag: Path, out: Path, stage: int) -> None:
    """``out/universal``: ds_to_universal.py's output, or ``out/universal.err``. It runs in a
    plain temp path: it matches its temp files' names with regexes built from their paths
    (a '+' of the cache's torch version breaks them)."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ds2u") as tmp:
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
               "--output_folder", f"{tmp}/universal", "--num_extract_workers", "1", "--num_merge_workers", "1"]
        if stage < 3:
            cmd.append("--inject_missing_state")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=deepspeed_env())
        if proc.returncode:
            (out / "universal.err").write_text((proc.stdout[-2000:] + proc.stderr[-4000:]).strip())
        else:
            shutil.move(f"{tmp}/universal", out / "universal")


def cache_dir() -> Path:
    import fixture_cache

    h = hashlib.sha256()
    for name in ("ds_zero_support.py", "ds_zero_worker.py", "ds_worker.py", "ds_trainer_run.py", "models.py"):
        h.update((SUPPORT / name).read_bytes())
    return fixture_cache.base_dir() / f"ds-zero-{torch.__version__}-{h.hexdigest()[:16]}"


_cache: Any = None


def saved(name: str) -> Path:
    """The cached entry of case ``name`` (built on first use, READ-ONLY)."""
    global _cache
    import fixture_cache

    Case.parse(name)
    if _cache is None:
        _cache = fixture_cache.FixtureCache(cache_dir(), lambda n, tmp: build_case(n, tmp))
    return _cache.get(name)


def live(entry: Path) -> dict[str, Any]:
    return torch.load(entry / "run" / "live.pt", weights_only=False)


def next_loss(entry: Path) -> float:
    return json.loads((entry / "run" / "next.json").read_text())["loss"]


def read_all(reader: Any) -> dict[str, torch.Tensor]:
    """Every tensor of ``reader``, whole (assembled from its chunks)."""
    from formats.dtypes import by_name

    out = {}
    for key, entry in reader.index().tensors.items():
        t = torch.empty(entry.shape, dtype=by_name(entry.dtype).torch_dtype)
        for c in entry.chunks:
            t[c.box.slices()] = reader.read_region(key, c, c.box)
        out[key] = t
    return out


def universal_atoms(universal: Path, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """What ds_to_universal.py wrote, as ``model.<fqn>`` / ``optim.state.<fqn>.<state>`` tensors
    (ZeRO-3's flat atoms reshaped to ``shapes[fqn]``, the parameter's shape)."""
    out = {}
    for folder in sorted(p for p in (universal / "zero").iterdir() if p.is_dir()):
        fqn = folder.name
        for atom in sorted(folder.glob("*.pt")):
            value = torch.load(atom, weights_only=False)
            t = value["param"] if isinstance(value, dict) else value
            if atom.stem != "step" and fqn in shapes and t.numel() == shapes[fqn].numel():
                t = t.reshape(shapes[fqn])
            out[f"model.{fqn}" if atom.stem == "fp32" else f"optim.state.{fqn}.{atom.stem}"] = t
    return out
