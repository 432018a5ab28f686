"""The placement plan a ``--plan`` name means: a built-in plan (:mod:`converter.plan.placement_rules`,
:mod:`converter.plan.megatron_plan`), a plan read from code (:mod:`converter.plan.from_code`) or a
plan file. Apart from the rules themselves, so that the rules import no plan reader."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from converter.plan.from_code import is_code_plan, load_code_plan
from converter.plan.megatron_plan import megatron_plan
from converter.plan.mesh import Mesh
from converter.plan.placement_rules import (BUILTIN_PLANS, FSDP_PLAN, LLAMA_PLAN, MOE_PLAN, PlacementPlan, SourcePlan,
                                            SourceSplits, load_plan_file)
from formats.base import Shape
from formats.errors import ConfigError


def get_plan(name_or_path: str, source_splits: SourceSplits | Mapping[str, int | None] | None = None,
             mesh: Mesh | None = None, params: Mapping[str, Shape] | None = None) -> PlacementPlan:
    """A built-in plan (``fsdp``, ``llama``, ``moe``, ``megatron``: ``params``, FQN -> shape, tell
    its gated MLPs; ``source``), a plan read from code (``torchtitan:MODEL/FLAVOR``,
    ``python:MODULE:FUNCTION``; needs ``mesh``) or a plan file."""
    if is_code_plan(name_or_path):
        if mesh is None:
            raise ConfigError(f"--plan {name_or_path}: a plan read from code needs the target mesh")
        return load_code_plan(name_or_path, mesh)
    if name_or_path == "fsdp":
        return FSDP_PLAN
    if name_or_path == "llama":
        return LLAMA_PLAN
    if name_or_path == "moe":
        return MOE_PLAN
    if name_or_path == "megatron":
        return megatron_plan(params or {})
    if name_or_path == "auto":
        raise ConfigError("--plan auto is chosen from the checkpoint (converter.plan.auto_plan.choose_plan); "
                          "get_plan takes the plan it chose")
    if name_or_path == "source":
        if source_splits is None:
            raise ConfigError("--plan source needs the source's detected layout; convert from a sharded source or pick --plan fsdp")
        if not isinstance(source_splits, SourceSplits):
            source_splits = SourceSplits(dict(source_splits))
        return SourcePlan(source_splits)
    path = Path(name_or_path)
    if path.suffix.lower() in (".json", ".yaml", ".yml") or path.exists():
        return load_plan_file(path)
    raise ConfigError(f"--plan {name_or_path!r}: unknown plan; use {', '.join(BUILTIN_PLANS)}, torchtitan:MODEL/FLAVOR, "
                      "python:MODULE:FUNCTION or a path to a plan file")
