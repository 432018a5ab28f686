"""DeepSpeed pipeline-engine saves (``PipelineModule``) under ZeRO-1: one ZeRO-1 checkpoint per
pipeline stage and tensor-parallel rank, merged over the stages and joined over the TP ranks.

A ``PipelineEngine.save_checkpoint`` folder holds (DeepSpeed 0.19.8; ``pp`` stages, ``tp``
tensor-parallel ranks per stage, ``dp`` data-parallel ranks)::

    mp_rank_<k>_model_states.pt                     module None; param_shapes of the stage's params
    [bf16_]zero_pp_rank_<d>_mp_rank_<k>_optim_states.pt   ZeRO-1 fp32 partitions over the stage's dp group
    layer_<l>[-model_<t>]-model_states.pt           each layer's module state dict (its weights as trained,
                                                    frozen ones and buffers included), written once per TP rank

where ``k = stage * tp + t`` (``PipelineParallelGrid``'s model-parallel rank on the
``[pipe, data, model]`` topology: the ranks of one data-parallel index sorted; ds_to_universal's
``meg_2d_parallel_map.simple_init`` maps file ``i`` to stage ``i // tp``, TP rank ``i % tp``). The
stages and TP ranks are the model states' ``checkpoint_parallel_dimensions`` (``pp_degree``,
``tp_degree``; else ``tp`` the layer files' model ranks and ``pp`` = ``mp_world_size / tp``).

Parameters are named as ``PipelineModule`` names them (``<global layer index>.<param>``, and
``tied_modules.<key>.<param>`` for a ``TiedLayerSpec`` module); each TP rank's stages are laid
out as ZeRO-1/2 saves (:func:`.zero.build_zero12`) and merged, param group ``g`` the union of
every stage's group ``g``; then, with ``tp`` > 1, every tensor is joined over the TP ranks by the
rules of :mod:`.tp` (``universal_checkpoint_info``, or ``--ds-tp-rules``; neither: one line naming
the model-states file and ``--ds-tp-rules``).

A ``TiedLayerSpec`` parameter is held by every stage that uses the module, each stage's optimizer
stepping its own fp32 master (the stages' gradients all-reduced first, so the copies stay equal):
the first stage's copy is taken, as ``ds_to_universal.py`` does for
``pipeline_replicated_parameter_patterns``, and ``verify`` compares the others with it bit for
bit. Frozen parameters and buffers are in the layer files only (ZeRO-1 records no
``frozen_param_shapes``): read from them in their saved dtype (:mod:`.layers`). Refused in one
line: a pipeline without ZeRO (its optimizer state is pickled whole in the model-states files)
and ZeRO-3 files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from formats.base import TensorEntry
from formats.deepspeed_zero.files import Parsed, TagFiles
from formats.deepspeed_zero.index import Copy, IndexBuilder
from formats.deepspeed_zero.layers import Later, add_layer_files, check_layer_files
from formats.deepspeed_zero.model import buffer_names
from formats.deepspeed_zero.tp import REPLICA_WHY, TpRules, check_same_keys, join_all, join_entries, join_of, param_name
from formats.deepspeed_zero.zero import OSD, Group, build_zero12, param_shapes
from formats.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedError

HINT = "convert a Megatron-DeepSpeed save with DeepSpeed's ds_to_universal.py, then ckptconv import-ds"
#: What a tied parameter's later copy that differs from the first stage's means.
TIED_WHY = ("though a TiedLayerSpec parameter is stepped alike on every stage that holds it (conversions take the first "
            "stage's, as ds_to_universal.py's pipeline_replicated_parameter_patterns do): the stages' files are from "
            "different saves")

Parse = Callable[[str, str], Parsed]


def refuse(root: Path, files: TagFiles, why: str, hint: str = HINT) -> UnsupportedError:
    """The one-line refusal of a pipeline save, naming its first layer file."""
    return UnsupportedError(f"{root / min(files.layers.values())}: a pipeline-parallel save (PipelineModule layer "
                            f"files, {len(files.layers)} of them) {why} is not supported yet: {hint}")


@dataclass
class Pipeline:
    """A pipeline save laid out: the merged param groups, stage 0's (TP rank 0's) model states and
    optimizer files, the data-parallel ranks per stage, the degrees, and the copies read once."""

    groups: list[Group]
    model: Parsed
    optims: list[Parsed]
    world: int
    pp: int
    tp: int
    copies: dict[str, list[Copy]] = field(default_factory=dict)


@dataclass
class _Rank:
    """One TP rank's stages merged (into ``b``); ``later``: the copies after the first of each key."""

    b: IndexBuilder
    groups: list[Group]
    model: Parsed
    optims: list[Parsed]
    world: int
    later: Later


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def degrees(root: Path, files: TagFiles, parse: Parse) -> tuple[int, int]:
    """(pipeline stages, TP ranks per stage) as the first model-states file records them."""
    if not files.model:
        raise CheckpointNotFoundError(f"{root}: pipeline layer files but no mp_rank_*_model_states.pt; copy the "
                                      "whole tag folder")
    model = parse(files.model[min(files.model)], "the model states")
    value = model.value if isinstance(model.value, dict) else {}
    dims = value.get("checkpoint_parallel_dimensions")
    dims = dims if isinstance(dims, dict) else {}
    tp = _count(dims.get("tp_degree")) or len({mp for _, mp in files.layers})
    pp = _count(dims.get("pp_degree"))
    if pp is None and _count(value.get("mp_world_size")) and value["mp_world_size"] % tp == 0:
        pp = value["mp_world_size"] // tp
    if pp is None:
        raise CorruptCheckpointError(f"{model.path}: records neither pp_degree nor mp_world_size; cannot tell the "
                                     "pipeline's stages")
    return pp, tp


def _check_model_files(root: Path, files: TagFiles, pp: int, tp: int) -> None:
    """One model-states file per (stage, TP rank): ``mp_rank_<stage * tp + t>``."""
    want = list(range(pp * tp))
    missing = [k for k in want if k not in files.model]
    if missing:
        s, t = divmod(missing[0], tp)
        where = f"pipeline stage {s} of {pp}" + (f", tensor-parallel rank {t} of {tp}" if tp > 1 else "")
        raise CheckpointNotFoundError(f"{root}: no mp_rank_{missing[0]:02d}_model_states.pt ({where}); copy every "
                                      "stage's files of one save")
    if sorted(files.model) != want:
        what = f"{pp} stages" + (f" x {tp} tensor-parallel ranks" if tp > 1 else "")
        raise CheckpointNotFoundError(f"{root}: {files.model[max(files.model)]} beyond the {what} the save records; "
                                      "copy every stage's files of one save")


def build_pipeline(b: IndexBuilder, root: Path, files: TagFiles, parse: Parse,
                   by_rank: Callable[[dict[int, str], str], list[str]], rules_of: Callable[[Parsed, str], TpRules],
                   left_out: list[str]) -> Pipeline:
    """Lay out every stage's parameters, states, frozen parameters and buffers into ``b``, joined
    over the TP ranks (``rules_of(model, what)``: the join rules, or the one-line refusal)."""
    pp, tp = degrees(root, files, parse)
    _check_model_files(root, files, pp, tp)
    check_layer_files(root, files, tp)
    if files.zero3_model:
        raise refuse(root, files, "with ZeRO-3 files")
    if not files.optim:
        raise refuse(root, files, "without ZeRO (its optimizer pickled whole in the model states)")
    ranks = [_build_rank(b if tp == 1 else b.fork(), root, files, parse, by_rank, t, tp, pp, left_out if t == 0 else [])
             for t in range(tp)]
    first = ranks[0]
    if any(r.world != first.world for r in ranks):
        raise CorruptCheckpointError(f"{root}: the tensor-parallel ranks' stages have {sorted({r.world for r in ranks})} "
                                     "data-parallel optimizer files; the files are from different saves")
    out = Pipeline(first.groups, first.model, first.optims, first.world, pp, tp)
    if tp == 1:
        out.copies = {key: [Copy(who, of, e.chunks, why) for who, of, why, e in later] for key, later in first.later.items()}
        return out
    rules = rules_of(first.model, f"a pipeline-parallel save with tensor parallelism inside the stages ({pp} stages x "
                                  f"{tp} tensor-parallel ranks, mp_rank_*)")
    check_same_keys([r.b.tensors for r in ranks], [root / r.model.name for r in ranks])
    owners = [[t + tp * d for d in range(first.world)] for t in range(tp)]
    joined, out.copies = join_all([r.b.tensors for r in ranks], rules, owners, str(root))
    b.tensors.update(joined)
    _join_later(out.copies, ranks, rules, owners, root)
    return out


def _join_later(copies: dict[str, list[Copy]], ranks: list[_Rank], rules: TpRules, owners: list[list[int]],
                root: Path) -> None:
    """Each later copy (a tied parameter's later stage) joined over the TP ranks like the first,
    and, replicated over TP, each TP rank's copy of it."""
    first = ranks[0]
    if any(set(r.later) != set(first.later) or any(len(r.later[k]) != len(v) for k, v in first.later.items())
           for r in ranks):
        raise CorruptCheckpointError(f"{root}: the tensor-parallel ranks' stages hold other tied parameters; the files "
                                     "are from different saves")
    for key, later in first.later.items():
        for i, (who, of, why, entry) in enumerate(later):
            entries = [r.later[key][i][3] for r in ranks]
            join = join_of(rules, entry)
            found = copies.setdefault(key, [])
            found.append(Copy(who, of, join_entries(key, entries, join, owners, str(root)).chunks, why))
            if join.kind == "replicated" and entry.shape and join.rows is None:
                found += [Copy(f"{who}, tensor-parallel rank {t}", of, e.chunks, REPLICA_WHY)
                          for t, e in enumerate(entries[1:], 1)]


def _build_rank(b: IndexBuilder, root: Path, files: TagFiles, parse: Parse,
                by_rank: Callable[[dict[int, str], str], list[str]], t: int, tp: int, pp: int,
                left_out: list[str]) -> _Rank:
    """TP rank ``t``'s stages merged into ``b``, then its layer files' frozen parameters and buffers."""
    merged: list[Group] = []
    later: Later = {}
    first_stage: dict[str, int] = {}
    recorded: set[str] = set()
    first: tuple[Parsed, list[Parsed]] | None = None
    world = 0
    for s in range(pp):
        k = s * tp + t
        model = parse(files.model[k], "the model states")
        if model.value.get("module") is not None:
            raise CorruptCheckpointError(f"{model.path}: holds a module beside pipeline layer files "
                                         f"({min(files.layers.values())}); the folder mixes two saves, keep the files of one")
        optim_names = {dp: n for (mp, dp), n in files.optim.items() if mp == k}
        if not optim_names:
            raise CheckpointNotFoundError(f"{root}: no zero_pp_rank_*_mp_rank_{k:02d}_optim_states.pt (pipeline stage "
                                          f"{s}'s optimizer partitions); copy every stage's files of the save")
        optims = [parse(n, "the optimizer partitions") for n in by_rank(optim_names, f"*_mp_rank_{k:02d}_optim_states.pt")]
        osd = optims[0].value.get(OSD) if isinstance(optims[0].value, dict) else None
        if not isinstance(osd, dict) or "single_partition_of_fp32_groups" not in osd:
            raise refuse(root, files, f"whose optimizer is not ZeRO-1 ({optims[0].name})")
        if world and len(optims) != world:
            raise CorruptCheckpointError(f"{root}: stage {s} has {len(optims)} data-parallel optimizer files, stage 0 "
                                         f"{world}; the files are from different saves")
        world = len(optims)
        stage = b.fork()
        groups = build_zero12(stage, model, optims)
        for key, entry in stage.tensors.items():
            _take(b, key, entry, s, first_stage, later, model)
        merged = _merge(merged, groups, root / files.model[k])
        recorded.update(n for group in param_shapes(model) for n in group)
        recorded.update(buffer_names(model))
        first = first or (model, optims)
    assert first is not None
    add_layer_files(b, root, files, parse, t, recorded, later, left_out)
    return _Rank(b, merged, first[0], first[1], world, later)


def _take(b: IndexBuilder, key: str, entry: TensorEntry, stage: int, first_stage: dict[str, int], later: Later,
          model: Parsed) -> None:
    """Add stage ``stage``'s ``entry``, or, held by an earlier stage (a TiedLayerSpec parameter),
    keep it as a later copy of the first."""
    held = b.tensors.get(key)
    if held is None:
        b.tensors[key] = entry
        first_stage[key] = stage
        return
    name = param_name(entry) or key
    if not name.startswith("tied_modules."):
        raise CorruptCheckpointError(f"{model.path}: parameter {name!r} is in the partitions of stages {first_stage[key]} "
                                     f"and {stage}, and is no TiedLayerSpec module's (tied_modules.*); the folder "
                                     "mixes two saves, keep the files of one")
    if (held.dtype, held.shape) != (entry.dtype, entry.shape):
        raise CorruptCheckpointError(f"{model.path}: key {key!r} is {entry.dtype} {list(entry.shape)} here, "
                                     f"{held.dtype} {list(held.shape)} on stage {first_stage[key]}; the files are from "
                                     "different saves")
    later.setdefault(key, []).append((f"pipeline stage {stage}", f"stage {first_stage[key]}", TIED_WHY, entry))


def _merge(merged: list[Group], groups: list[Group], where: Path) -> list[Group]:
    """Group ``g`` of every stage is one optimizer param group: the same hyperparameters; a tied
    parameter listed once."""
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
        out.append(Group(a.hparams, a.params + tuple(n for n in other.params if n not in a.params)))
    return out
