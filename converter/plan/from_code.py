"""Plans read from a framework's own parallelize code, not from name rules.

``--plan torchtitan:llama3/debugmodel`` builds torchtitan's model (name and flavor from the installed
torchtitan) on the meta device, starts a fake process group of the target world size in one process
(``torch.testing._internal.distributed.fake_pg.FakeStore``, backend ``"fake"``: no data, no peers),
builds torchtitan's device meshes, applies its own ``parallelize_fn`` and reads every DTensor's
placements and mesh. ``--plan python:MODULE:FUNCTION`` does the same with ``FUNCTION(mesh)``, which
gets a ``DeviceMesh`` with ckptconv's dim names (``pp, dp_replicate, dp_shard, cp, tp``, those of
``--mesh``) and returns the model parallelized on meta (or a list of model parts).

Both the parameters (``named_parameters``: the names the optimizer states use) and the model's
``state_dict`` entries (the names its save hooks write, e.g. torchtitan 0.3.0's ``wq``/``wk``/``wv``
gathered whole from the fused ``wqkv``) are read. A DTensor mesh dim is matched to the ``--mesh``
dims it spans by the global ranks along it, so flattened dims (torchtitan's ``fsdp`` = ``dp_shard``
x ``cp``) need no name table. PP stages come from torchtitan's own pipeline split.

The work runs in a subprocess (``python -m converter.plan.from_code SPEC MESH``): torch and the framework
are imported only there, the process group and the framework's module state never touch the
converter process (which may run under torchrun), and the result is cached per (plan, mesh, versions)
on disk (``$CKPTCONV_PLAN_CACHE``, default ``~/.cache/ckptconv/plans``) and in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from converter import knobs
from converter.plan.placements import parse_placement
from converter.plan.mesh import Mesh, parse_mesh
from converter.plan.model_placements import init_fake_world, read_model
from converter.plan.placement_rules import PipelineSplit, TensorPlacement, module_owner, replicated
from formats.base import Shape
from formats.errors import ConfigError, PlanError

PREFIXES = ("torchtitan:", "python:")


def is_code_plan(name: str) -> bool:
    """Whether ``--plan name`` is read from code."""
    return isinstance(name, str) and name.startswith(PREFIXES)


@dataclass(frozen=True)
class CodePlan:
    """Placements read from a parallelized model: FQN -> (shape, placement), and PP owners."""

    name: str
    table: Mapping[str, tuple[Shape, TensorPlacement]]
    stages: Mapping[str, int] = field(default_factory=dict)
    stage_modules: tuple[tuple[str, ...], ...] | None = None
    stage_ranks: tuple[int, ...] | None = None

    def place(self, param_fqn: str, shape: Shape, mesh: Mesh) -> TensorPlacement:
        hit = self.table.get(param_fqn)
        if hit is None:
            return replicated(mesh)
        want, placement = hit
        if tuple(want) != tuple(shape):
            raise PlanError(
                f"plan {self.name}: {param_fqn} has shape {tuple(want)} in the model but {tuple(shape)} in the "
                "checkpoint; pick the model flavor the checkpoint was trained with"
            )
        return placement

    def assign_stages(self, fqns: Sequence[str], pp: int) -> tuple[dict[str, int | None], list[str]]:
        if self.stage_modules is None:
            return PipelineSplit(last=("norm", "output", "lm_head")).assign(fqns, pp)
        owner = {m: self.stage_ranks[s] for s, mods in enumerate(self.stage_modules) for m in mods}
        out = {f: module_owner(f, owner) for f in fqns}
        lost = [f for f, r in out.items() if r is None]
        more = f", ... {len(lost) - 5} more" if len(lost) > 5 else ""
        warnings = [f"plan {self.name}: {len(lost)} tensors belong to no pipeline stage ({', '.join(lost[:5])}{more}); "
                    "they are written for every stage"] if lost else []
        return out, warnings

    def unused_rule_warnings(self, used: set[str]) -> list[str]:
        return []


# ---------------------------------------------------------------- converter side (no torch)


def load_code_plan(spec: str, mesh: Mesh) -> CodePlan:
    """The plan ``spec`` gives on ``mesh`` (computed in a subprocess, cached)."""
    return _load(spec, str(mesh), mesh.names)


@lru_cache(maxsize=32)
def _load(spec: str, mesh_text: str, order: tuple[str, ...]) -> CodePlan:
    mesh = parse_mesh(mesh_text, ",".join(order))
    doc = _cached_doc(spec, mesh)
    return plan_from_json(doc, mesh)


def _cache_path(spec: str, mesh: Mesh) -> Path | None:
    if spec.startswith("python:"):
        return None  # user code may change under the same name
    return cache_file([spec, str(mesh)])


def cache_file(key: Sequence[Any]) -> Path:
    """Where the answer for ``key`` (a JSON-able list; the installed torch and torchtitan versions
    are added) is cached: ``$CKPTCONV_PLAN_CACHE`` (default ``~/.cache/ckptconv/plans``)."""
    base = os.environ.get("CKPTCONV_PLAN_CACHE") or Path.home() / ".cache" / "ckptconv" / "plans"
    text = json.dumps([*key, _versions()])
    return Path(base) / (hashlib.sha256(text.encode()).hexdigest()[:24] + ".json")


def _versions() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("torch", "torchtitan"):
        try:
            out.append(f"{pkg}={version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg}=none")
    return out


def cached_json(path: Path | None, compute: Callable[[], dict]) -> dict:
    """The JSON document cached at ``path``, else ``compute()`` (then cached, atomically; a cache
    that cannot be written is only slower)."""
    if path is not None and path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    doc = compute()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(doc))
            tmp.replace(path)
        except OSError:
            pass
    return doc


def _cached_doc(spec: str, mesh: Mesh) -> dict:
    return cached_json(_cache_path(spec, mesh), lambda: _run_subprocess(spec, mesh))


def _run_subprocess(spec: str, mesh: Mesh) -> dict:
    cmd = ["converter.plan.from_code", spec, str(mesh), ",".join(mesh.names)]
    return run_module(cmd, f"--plan {spec}", f"--plan {spec} on mesh {mesh}",
                      "building the model's plan", "check that the model builds on the meta device")


def run_module(cmd: Sequence[str], option: str, where: str, doing: str, fix: str, stdin: str | None = None) -> dict:
    """The last stdout line, as JSON, of ``python -m CMD...`` run apart from this process (this
    checkout first on ``PYTHONPATH``, no torchrun variables, ``knobs.CODE_PLAN_TIMEOUT_S``); its
    one-line error as a PlanError (``where: ...`` unless it names ``option`` itself)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)  # never join the converter's own torchrun job
    try:
        proc = subprocess.run([sys.executable, "-m", *cmd], env=env, capture_output=True, text=True, input=stdin,
                              timeout=knobs.CODE_PLAN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PlanError(f"{option}: {doing} took over {knobs.CODE_PLAN_TIMEOUT_S} s; {fix}") from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        last = last.removeprefix("ckptconv-plan: ")
        raise PlanError(last if last.startswith(option.split()[0]) else f"{where}: {last}")
    out = proc.stdout.strip().splitlines()
    return json.loads(out[-1])


def plan_from_json(doc: Mapping[str, Any], mesh: Mesh) -> CodePlan:
    """A :class:`CodePlan` from the subprocess's JSON answer."""
    table = {}
    for fqn, row in doc["table"].items():
        placements = tuple(parse_placement(p) for p in row["placements"])
        dims = tuple(tuple(g) for g in row["dims"])
        table[fqn] = (tuple(row["shape"]), TensorPlacement(placements, None, dims, "model"))
    stages = doc.get("pp")
    return CodePlan(
        doc["name"],
        table,
        stage_modules=None if not stages else tuple(tuple(m) for m in stages["modules"]),
        stage_ranks=None if not stages else tuple(stages["ranks"]),
    )


# ---------------------------------------------------------------- subprocess side (torch, framework)


def _python_plan(target: str, mesh: Mesh) -> dict:
    import importlib

    module, _, func = target.partition(":")
    if not module or not func:
        raise ConfigError(f"--plan python:{target}: write python:MODULE:FUNCTION")
    fn = getattr(importlib.import_module(module), func, None)
    if fn is None:
        raise ConfigError(f"--plan python:{target}: {module} has no function {func}")
    from torch.distributed.device_mesh import init_device_mesh

    init_fake_world(mesh.world_size)
    dm = init_device_mesh("cpu", mesh.shape, mesh_dim_names=mesh.names)
    built = fn(dm)
    parts = list(built) if isinstance(built, (list, tuple)) else [built]
    return {"name": f"python:{target}", "table": read_model(parts, mesh)}


def main(argv: Sequence[str]) -> int:
    """``python -m converter.plan.from_code SPEC MESH ORDER``: print the plan as one JSON line."""
    spec, mesh_text, order = argv

    def plan() -> dict:
        mesh = parse_mesh(mesh_text, order)
        if spec.startswith("torchtitan:"):
            from converter.plan.torchtitan import torchtitan_plan

            return torchtitan_plan(spec[len("torchtitan:"):], mesh)
        if spec.startswith("python:"):
            return _python_plan(spec[len("python:"):], mesh)
        raise ConfigError(f"--plan {spec!r}: code plans start with torchtitan: or python:")

    return answer(plan)


def answer(compute: Callable[[], dict]) -> int:
    """A subprocess's end: ``compute()`` printed as one JSON line (exit 0), or its error as one
    ``ckptconv-plan:`` line on stderr for :func:`run_module` (exit 2; ``CKPTCONV_DEBUG`` re-raises)."""
    try:
        doc = compute()
    except Exception as e:  # one line for the parent, which raises PlanError with it
        if os.environ.get("CKPTCONV_DEBUG"):
            raise
        from formats.errors import CkptConvError

        text = str(e).splitlines()[0] if str(e) else ""
        print(f"ckptconv-plan: {text if isinstance(e, CkptConvError) else f'{type(e).__name__}: {text}'}", file=sys.stderr)
        return 2
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
