"""DeepSpeed pipeline-engine saves (``PipelineModule``) under ZeRO-1: one ZeRO-1 checkpoint per
pipeline stage, merged.

A ``PipelineEngine.save_checkpoint`` folder holds, per stage ``s`` (DeepSpeed names the stage's
files with its ``mp_rank``)::

    mp_rank_<s>_model_states.pt                     module None; param_shapes of the stage's params
    zero_pp_rank_<dp>_mp_rank_<s>_optim_states.pt   the stage's ZeRO-1 fp32 partitions over its dp group
    layer_<l>[-model_00]-model_states.pt            each layer's module state dict (the low-precision weights)

Parameters are named as ``PipelineModule`` names them (``<global layer index>.<param>``), so the
stages' names are disjoint; the fp32 masters and optimizer states come from each stage's
partitions exactly as for a ZeRO-1/2 save (:func:`.zero.build_zero12`), and param group ``g`` is
the union of every stage's group ``g``. Refused in one line: pipeline without ZeRO (its optimizer
state is pickled whole in the model-states files), tensor parallelism inside the stages
(``tp_degree`` > 1), frozen parameters (only in the layer files), and a name in two stages
(``TiedLayerSpec`` weights).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from formats.deepspeed_zero.files import Parsed, TagFiles
from formats.deepspeed_zero.index import IndexBuilder
from formats.deepspeed_zero.zero import OSD, Group, build_zero12, param_shapes
from formats.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedError

HINT = "convert a Megatron-DeepSpeed save with DeepSpeed's ds_to_universal.py, then ckptconv import-ds"


#: Pipeline x TP: ds_to_universal joins the slices right only as universal_checkpoint_info says.
TP_HINT = ("with universal_checkpoint_info in the model states (Megatron-DeepSpeed records it) convert it with "
           "DeepSpeed's ds_to_universal.py, then ckptconv import-ds; without it no converter knows how the slices join")


def refuse(root: Path, files: TagFiles, why: str, hint: str = HINT) -> UnsupportedError:
    """The one-line refusal of a pipeline save, naming its first layer file."""
    return UnsupportedError(f"{root / min(files.layers.values())}: a pipeline-parallel save (PipelineModule layer "
                            f"files, {len(files.layers)} of them) {why} is not supported yet: {hint}")


def _refuse_tp(root: Path, files: TagFiles, model: Parsed) -> None:
    """Refuse a stage whose model states record tensor parallelism (``tp_degree`` > 1)."""
    dims = model.value.get("checkpoint_parallel_dimensions") if isinstance(model.value, dict) else None
    tp = dims.get("tp_degree") if isinstance(dims, dict) else None
    if isinstance(tp, int) and tp > 1:
        raise refuse(root, files, f"with tensor parallelism inside the stages (tp_degree {tp})", TP_HINT)


def _stage_count(root: Path, files: TagFiles, parse: Callable[[str, str], Parsed]) -> int:
    """The pipeline's stages as the save records them (``checkpoint_parallel_dimensions.pp_degree``,
    else ``mp_world_size``) in the first model-states file, so a missing last stage is told."""
    if not files.model:
        raise CheckpointNotFoundError(f"{root}: pipeline layer files but no mp_rank_*_model_states.pt; copy the "
                                      "whole tag folder")
    model = parse(files.model[min(files.model)], "the model states")
    _refuse_tp(root, files, model)
    value = model.value
    dims = value.get("checkpoint_parallel_dimensions") if isinstance(value, dict) else None
    for count in (dims.get("pp_degree") if isinstance(dims, dict) else None, value.get("mp_world_size")):
        if isinstance(count, int) and not isinstance(count, bool) and count >= 1:
            return count
    raise CorruptCheckpointError(f"{root / files.model[min(files.model)]}: records neither pp_degree nor "
                                 "mp_world_size; cannot tell the pipeline's stages")


def build_pipeline(b: IndexBuilder, root: Path, files: TagFiles, parse: Callable[[str, str], Parsed],
                   by_rank: Callable[[dict[int, str], str], list[str]]) -> tuple[list[Group], Parsed, list[Parsed], int]:
    """Lay out every stage's parameters and states; (merged groups, stage 0's model states,
    stage 0's optimizer files, data-parallel ranks per stage)."""
    tps = {mp for _, mp in files.layers}
    if tps - {0}:
        raise refuse(root, files, f"with tensor parallelism inside the stages ({len(tps)} model-parallel ranks "
                                  "per layer, layer_*-model_01-*)", TP_HINT)
    stages = list(range(_stage_count(root, files, parse)))
    missing = [s for s in stages if s not in files.model]
    if missing or sorted(files.model) != stages:
        what = (f"no mp_rank_{missing[0]:02d}_model_states.pt (pipeline stage {missing[0]} of {len(stages)})" if missing
                else f"{files.model[max(files.model)]} beyond the {len(stages)} stages the save records")
        raise CheckpointNotFoundError(f"{root}: {what}; copy every stage's files of one save")
    if files.zero3_model:
        raise refuse(root, files, "with ZeRO-3 files")
    if not files.optim:
        raise refuse(root, files, "without ZeRO (its optimizer pickled whole in the model states)")
    merged: list[Group] = []
    first: tuple[Parsed, list[Parsed]] | None = None
    world = 0
    for s in stages:
        model = parse(files.model[s], "the model states")
        if model.value.get("module") is not None:
            raise CorruptCheckpointError(f"{model.path}: holds a module beside pipeline layer files "
                                         f"({min(files.layers.values())}); the folder mixes two saves, keep the files of one")
        _refuse_tp(root, files, model)
        if model.value.get("frozen_param_shapes"):
            raise refuse(root, files, "with frozen parameters (they are only in the layer files)")
        optim_names = {dp: n for (mp, dp), n in files.optim.items() if mp == s}
        if not optim_names:
            raise CheckpointNotFoundError(f"{root}: no zero_pp_rank_*_mp_rank_{s:02d}_optim_states.pt (pipeline stage "
                                          f"{s}'s optimizer partitions); copy every stage's files of the save")
        optims = [parse(n, "the optimizer partitions") for n in by_rank(optim_names, f"*_mp_rank_{s:02d}_optim_states.pt")]
        osd = optims[0].value.get(OSD) if isinstance(optims[0].value, dict) else None
        if not isinstance(osd, dict) or "single_partition_of_fp32_groups" not in osd:
            raise refuse(root, files, f"whose optimizer is not ZeRO-1 ({optims[0].name})")
        if world and len(optims) != world:
            raise CorruptCheckpointError(f"{root}: stage {s} has {len(optims)} data-parallel optimizer files, stage 0 "
                                         f"{world}; the files are from different saves")
        world = len(optims)
        for name in (n for group in param_shapes(model) for n in group):
            if f"model.{name}" in b.tensors:
                raise refuse(root, files, f"with parameter {name!r} in two stages (a TiedLayerSpec weight)")
        groups = build_zero12(b, model, optims)
        merged = _merge(merged, groups, root / files.model[s])
        if first is None:
            first = (model, optims)
    assert first is not None
    return merged, first[0], first[1], world


def _merge(merged: list[Group], groups: list[Group], where: Path) -> list[Group]:
    """Group ``g`` of every stage is one optimizer param group: the same hyperparameters."""
    if not merged:
        return list(groups)
    if len(groups) != len(merged):
        raise CorruptCheckpointError(f"{where}: {len(groups)} param groups, stage 0 has {len(merged)}; the files "
                                     "are from different saves")
    out = []
    for g, (a, other) in enumerate(zip(merged, groups)):
        if a.hparams != other.hparams:
            raise CorruptCheckpointError(f"{where}: param group {g}'s hyperparameters differ from stage 0's; the "
                                         "files are from different saves")
        out.append(Group(a.hparams, a.params + other.params))
    return out
