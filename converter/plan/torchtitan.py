"""``--plan torchtitan:MODEL/FLAVOR``: torchtitan's own model and parallelize function on a fake world.

Runs only inside ``python -m converter.plan.from_code`` (see there): it imports torch and torchtitan,
starts a fake process group and sets torchtitan's device type, none of which the converter process
should see.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

from converter.plan.model_placements import init_fake_world, read_model
from converter.plan.mesh import Mesh
from formats.errors import ConfigError, PlanError

_TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _prepare_imports() -> None:
    """Make torchtitan importable without an accelerator: its MoE async-EP kernels import triton at
    import time (dense models never call them), and its device type falls back to "cuda"."""
    if importlib.util.find_spec("torchtitan") is None:
        raise ConfigError("--plan torchtitan:...: torchtitan is not installed (pip install --no-deps torchtitan)")
    if importlib.util.find_spec("triton") is None:
        _stub(_TRITON_KERNELS)
    # imported at module level by torchtitan's trainer (data loading, metrics), never used to plan
    if importlib.util.find_spec("datasets") is None:
        _stub("datasets")
        _stub("datasets.distributed")
    if importlib.util.find_spec("tensorboard") is None:
        _stub("torch.utils.tensorboard")
    import torch
    from torch._utils import _get_available_device_type

    if _get_available_device_type() is None:
        import torchtitan.tools.utils as tu

        tu.device_type, tu.device_module = "cpu", torch.cpu
        for name, mod in list(sys.modules.items()):
            if name.startswith("torchtitan.") and getattr(mod, "device_type", None) == "cuda":
                mod.device_type = "cpu"


def _stub(name: str) -> None:
    """An importable placeholder for module ``name`` whose every attribute is unusable."""
    if name in sys.modules:
        return
    stub = types.ModuleType(name)
    stub.__getattr__ = _kernel_attr
    sys.modules[name] = stub
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, stub)


def _kernel_attr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _no_triton


def _no_triton(*_a: Any, **_k: Any) -> None:
    raise RuntimeError("triton kernels are not available")


def _model_spec(model: str, flavor: str):
    try:
        pkg = importlib.import_module(f"torchtitan.models.{model}")
    except ImportError as e:
        raise ConfigError(f"--plan torchtitan:{model}/{flavor}: torchtitan has no model {model!r} ({e})") from None
    registry = getattr(pkg, "model_registry", None)
    if registry is None:
        raise ConfigError(f"--plan torchtitan:{model}/{flavor}: torchtitan.models.{model} has no model_registry")
    try:
        return registry(flavor)
    except KeyError:
        configs = next((getattr(pkg, n) for n in dir(pkg) if n.endswith("_configs") and isinstance(getattr(pkg, n), dict)), {})
        raise ConfigError(f"--plan torchtitan:{model}/{flavor}: no flavor {flavor!r}; known: {', '.join(sorted(configs))}") from None


def _job_config(mesh: Mesh, backend: str):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=mesh.size("dp_replicate"),
        data_parallel_shard_degree=mesh.size("dp_shard"),
        context_parallel_degree=mesh.size("cp"),
        tensor_parallel_degree=mesh.size("tp"),
        pipeline_parallel_degree=mesh.size("pp"),
        expert_parallel_degree=mesh.ep,
        spmd_backend=backend,
    )
    return types.SimpleNamespace(parallelism=parallelism, training=TrainingConfig(), compile=CompileConfig())


def _pp_split(spec, mesh: Mesh, job) -> dict | None:
    if mesh.size("pp") == 1:
        return None
    from torchtitan.distributed import pipeline_parallel as ppmod

    pp = mesh.size("pp")
    parallel_dims = types.SimpleNamespace(pp=pp)
    stages, n_layers, first, last = ppmod._get_pipeline_metadata(parallel_dims, job.parallelism, spec.model)
    modules = job.parallelism.module_fqns_per_model_part or ppmod._generate_llm_fqn_per_model_part(
        stages, n_layers, first, last
    )
    ranks = [0] * len(modules)
    for r in range(pp):
        for s in ppmod._get_pp_rank_to_stage_indices_mapping(r, pp, job.parallelism.pipeline_parallel_schedule, len(modules)):
            ranks[s] = r
    return {"modules": [list(m) for m in modules], "ranks": ranks}


def torchtitan_plan(target: str, mesh: Mesh, backend: str = "partial_dtensor") -> dict:
    """Placements of torchtitan's ``MODEL/FLAVOR`` parallelized for ``mesh`` (JSON-able)."""
    model, sep, flavor = target.partition("/")
    if not sep or not model or not flavor:
        raise ConfigError(f"--plan torchtitan:{target}: write torchtitan:MODEL/FLAVOR, e.g. torchtitan:llama3/debugmodel")
    _prepare_imports()
    import torch
    from torchtitan.distributed import ParallelDims

    spec = _model_spec(model, flavor)
    job = _job_config(mesh, backend)
    spec.model.update_from_config(config=job)
    init_fake_world(mesh.world_size)
    dims = ParallelDims.from_config(job.parallelism, mesh.world_size)
    dims.build_mesh()
    with torch.device("meta"):
        module = spec.model.build()
    try:
        module = spec.parallelize_fn(
            module, parallel_dims=dims, training=job.training, parallelism=job.parallelism,
            compile_config=job.compile, ac_config=None, dump_folder="",
        )
    except Exception as e:
        raise PlanError(f"torchtitan's {spec.parallelize_fn.__name__} refused mesh {mesh}: {e}") from None
    return {"name": f"torchtitan:{target}", "table": read_model([module], mesh), "pp": _pp_split(spec, mesh, job)}
