"""DeepSpeed mixture-of-experts saves (``deepspeed.moe.layer.MoE``, any number of MoE layers,
experts, ``ep_size`` and data-parallel size), read as one checkpoint under global expert names.

``DeepSpeedEngine._save_moe_checkpoint`` (DeepSpeed 0.19) writes, besides the usual files::

    mp_rank_00_model_states.pt                  the NON-expert module (dp rank 0), num_experts per MoE layer,
                                                param_shapes (ZeRO-1/2: dp rank 0's groups, LOCAL expert names)
    layer_<l>_expert_<e>_mp_rank_00_model_states.pt   expert ``e`` (global id) of MoE layer ``l``: its
                                                state dict, keys ``<module>.deepspeed_moe.experts.deepspeed_experts.<e>.*``
    expp_rank_<r>_mp_rank_00_optim_states.pt    no ZeRO: ``{'optimizer': state_dict()}`` of expert-parallel rank
                                                ``r`` of the largest expert group (its local experts)
    zero_pp_rank_<d>_mp_rank_00_optim_states.pt ZeRO-1/2: dp rank ``d``'s partitions; an expert param group
                                                (``moe: True``, ``name: ep_size_<N>``) holds that rank's LOCAL
                                                experts, partitioned over its expert-data-parallel group

Expert parallelism (``groups._create_expert_and_data_parallel``): in the default expert-then-data
order dp rank ``d`` is expert-parallel rank ``d % N`` of group ``ep_size_N`` and rank ``d // N``
of its expert-data-parallel group (the ranks ``ep, ep + N, ep + 2N, ...``); with
``use_data_before_expert_parallelism`` rank ``d // (world // N)``, its group the consecutive
ranks. ``partition_count`` of the group records the group's size (``world // N``). A local expert ``k`` of a layer with
``E`` experts on expert-parallel rank ``ep`` is global expert ``ep * (E // N) + k``
(``_save_moe_checkpoint`` / ``load_moe_state_dict``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from formats.dcp.archive import TensorDesc
from formats.deepspeed_pickle import record_int
from formats.deepspeed_zero.files import Parsed, TagFiles
from formats.deepspeed_zero.flat import zero12_pieces, zero12_shortfall
from formats.deepspeed_zero.index import IndexBuilder
from formats.deepspeed_zero.model import (_names_of_ids, _zero0_states, add_frozen_from_module, buffer_names,
                                          module_params)
from formats.deepspeed_zero.zero import (OSD, Group, _zero12_group_state, add_flat_group, fp32_partitions,
                                         hparams_of, need, optimizer_dicts, param_shapes)
from formats.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidCheckpointError, UnsupportedError

Shape = tuple[int, ...]
EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."
_EXPERT = re.compile(rf"(.*{re.escape(EXPERTS)})(\d+)(\..+)")
_GROUP_NAME = re.compile(r"ep_size_(\d+)")


# ---------------------------------------------------------------------------------------------
# expert-parallel arithmetic (pure)


def split_expert(name: str) -> tuple[str, int, str] | None:
    """``(prefix through 'deepspeed_experts.', expert id, '.rest')`` of an expert parameter name."""
    m = _EXPERT.fullmatch(name)
    return (m[1], int(m[2]), m[3]) if m else None


def ep_rank_of(dp_rank: int, ep_size: int, world: int, data_first: bool = False) -> int:
    """The expert-parallel rank of a data-parallel rank in group ``ep_size_<ep_size>``
    (``data_first``: DeepSpeed's ``use_data_before_expert_parallelism`` order)."""
    return dp_rank // (world // ep_size) if data_first else dp_rank % ep_size


def expert_dp_ranks(ep_rank: int, ep_size: int, world: int, data_first: bool = False) -> list[int]:
    """The data-parallel ranks of ``ep_rank``'s expert-data-parallel group, by their rank in it:
    ``range(ep_rank, world, ep_size)`` (``data_first``: the ``world // ep_size`` consecutive ranks
    from ``ep_rank * world // ep_size``)."""
    if data_first:
        stride = world // ep_size
        return list(range(ep_rank * stride, (ep_rank + 1) * stride))
    return list(range(ep_rank, world, ep_size))


def data_first_of(model: Parsed) -> bool:
    """Whether the save's ds_config sets ``use_data_before_expert_parallelism``."""
    config = model.value.get("ds_config") if isinstance(model.value, dict) else None
    return isinstance(config, dict) and bool(config.get("use_data_before_expert_parallelism"))


def global_expert(local: int, ep_rank: int, num_experts: int, ep_size: int) -> int:
    """The global id of local expert ``local`` on ``ep_rank`` of a layer of ``num_experts``."""
    return ep_rank * (num_experts // ep_size) + local


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer: its expert name prefix, expert count and files (by global expert id)."""

    layer: int
    prefix: str
    num_experts: int
    files: tuple[str, ...]


def global_name(name: str, layers: dict[str, MoELayer], ep_rank: int, ep_size: int, where: str) -> str:
    """An expert parameter's local name (as an ep rank's optimizer lists it) -> its global name."""
    parts = split_expert(name)
    if parts is None:
        raise CorruptCheckpointError(f"{where}: {name!r} is in an expert param group but is no "
                                     f"'{EXPERTS.strip('.')}' parameter; the file is damaged")
    prefix, local, rest = parts
    layer = layers.get(prefix)
    if layer is None:
        raise CheckpointNotFoundError(f"{where}: parameter {name!r} belongs to an MoE layer without expert files "
                                      f"(no layer_*_expert_* file names {prefix}*); copy the whole tag folder")
    if layer.num_experts % ep_size or local >= layer.num_experts // ep_size:
        raise CorruptCheckpointError(f"{where}: {name!r}: local expert {local} of {layer.num_experts} experts over "
                                     f"ep_size {ep_size}; the files are from different saves")
    return f"{prefix}{global_expert(local, ep_rank, layer.num_experts, ep_size)}{rest}"


def group_ep_size(hparams: dict, count: int | None, world: int, where: str) -> int:
    """The ``ep_size`` of an expert param group: its name ``ep_size_<N>`` (checked against the
    expert-data-parallel ``count`` it was partitioned over, when saved)."""
    m = _GROUP_NAME.fullmatch(str(hparams.get("name", "")))
    ep = int(m[1]) if m else (world // count if count else 0)
    if ep < 1 or world % ep or (count is not None and count * ep != world):
        raise CorruptCheckpointError(f"{where}: expert param group {hparams.get('name')!r} partitioned over {count} "
                                     f"of {world} ranks; not an expert-parallel layout DeepSpeed writes")
    return ep


def is_moe_group(hparams: dict) -> bool:
    return hparams.get("moe") is True


# ---------------------------------------------------------------------------------------------
# the folder


def check_layout(root: Path, files: TagFiles, model: Parsed) -> None:
    """Refuse MoE layouts not read, naming a file of the layout."""
    first = root / min({**files.experts, **files.expp_optim}.values())
    if files.layers:
        raise UnsupportedError(f"{first}: a mixture-of-experts save of a pipeline engine (layer_XX-model_states.pt "
                               "beside expert files) is not supported yet")
    if files.zero3_model:
        raise UnsupportedError(f"{first}: a mixture-of-experts save with ZeRO-3 files (zero_pp_rank_*_model_states.pt)"
                               " is not supported: DeepSpeed's native MoE does not train under ZeRO-3")
    if any(layer < 0 for layer, _, _ in files.experts):
        raise UnsupportedError(f"{first}: a mixture-of-experts save of DeepSpeed before 0.5 (expert files without "
                               "layer ids) is not supported: load and save it with a newer DeepSpeed")
    if (any(mp for _, _, mp in files.experts) or any(mp for mp, _ in files.expp_optim) or set(files.model) - {0}
            or any(mp for mp, _ in files.optim)):
        raise UnsupportedError(f"{first}: a mixture-of-experts save with tensor parallelism (mp_rank_01 expert "
                               "files) is not supported yet")
    if isinstance(model.value, dict) and model.value.get("ds_autoep_layers"):
        raise UnsupportedError(f"{first}: an AutoEP mixture-of-experts save (ds_autoep_layers) is not supported yet")


def moe_layers(root: Path, files: TagFiles, model: Parsed, parse: Callable[[str, str], Parsed]) -> tuple[
        dict[str, MoELayer], list[Parsed]]:
    """The MoE layers (by expert name prefix) and every expert file parsed, in layer and expert
    order; every expert ``0 .. num_experts[l] - 1`` of every layer must have its file."""
    counts = model.value.get("num_experts") if isinstance(model.value, dict) else None
    if not isinstance(counts, list) or not all(type(c) is int and c >= 1 for c in counts):
        raise CorruptCheckpointError(f"{model.path}: expert files (layer_*_expert_*) beside it, but it records no "
                                     f"num_experts per MoE layer (holds {counts!r}); the folder mixes two saves")
    have = sorted({layer for layer, _, _ in files.experts})
    if have != list(range(len(counts))):
        extra = [la for la in have if la >= len(counts)]
        what = (f"layer_{extra[0]}_expert_* files beyond the {len(counts)} MoE layers it records" if extra else
                f"no layer_{next(la for la in range(len(counts)) if la not in have)}_expert_* files "
                f"(it records {len(counts)} MoE layers)")
        raise CheckpointNotFoundError(f"{model.path}: {what}; copy the whole tag folder")
    layers: dict[str, MoELayer] = {}
    parsed: list[Parsed] = []
    for la, count in enumerate(counts):
        names = []
        for e in range(count):
            name = files.experts.get((la, e, 0))
            if name is None:
                raise CheckpointNotFoundError(f"{root}: no layer_{la}_expert_{e}_mp_rank_00_model_states.pt (expert "
                                              f"{e} of MoE layer {la}'s {count}); copy the whole tag folder")
            names.append(name)
        extra = sorted(e for (lx, e, _) in files.experts if lx == la and e >= count)
        if extra:
            raise CorruptCheckpointError(f"{root / files.experts[(la, extra[0], 0)]}: expert {extra[0]} of MoE layer "
                                         f"{la}, which has {count} experts ({model.name}); the folder mixes two saves")
        files_of = [parse(n, "the expert weights") for n in names]
        prefix = _layer_prefix(files_of, la)
        if prefix in layers:
            raise CorruptCheckpointError(f"{files_of[0].path}: names the experts of {prefix!r}, as layer "
                                         f"{layers[prefix].layer} does; the files are damaged")
        layers[prefix] = MoELayer(la, prefix, count, tuple(names))
        parsed += files_of
    return layers, parsed


def _layer_prefix(experts: Sequence[Parsed], layer: int) -> str:
    prefixes = set()
    for e, parsed in enumerate(experts):
        if not isinstance(parsed.value, dict) or not parsed.value:
            raise CorruptCheckpointError(f"{parsed.path}: not an expert state dict")
        for key in parsed.value:
            parts = split_expert(key) if isinstance(key, str) else None
            if parts is None or parts[1] != e:
                raise CorruptCheckpointError(f"{parsed.path}: key {key!r} is not a parameter of expert {e}; the "
                                             "file is damaged or renamed")
            prefixes.add(parts[0])
    if len(prefixes) != 1:
        raise CorruptCheckpointError(f"{experts[0].path}: MoE layer {layer}'s experts name {len(prefixes)} modules")
    return prefixes.pop()


def add_expert_files(b: IndexBuilder, experts: Sequence[Parsed]) -> None:
    """Every tensor of the expert files not laid out yet (ZeRO-0's weights, buffers, frozen
    expert weights), whole, under its global name."""
    for parsed in experts:
        for key, desc in parsed.value.items():
            if isinstance(desc, TensorDesc) and f"model.{key}" not in b.tensors:
                b.add_whole(f"model.{key}", ("model", key), parsed, desc, f"key {key!r}")


def _check_no_experts(model: Parsed) -> None:
    """The model-states file of a MoE save holds no expert parameter (they are in the expert files)."""
    params, _ = module_params(model)
    experts = [n for n, _ in params if split_expert(n)]
    if experts:
        raise CorruptCheckpointError(f"{model.path}: its module holds expert parameter {experts[0]!r} beside expert "
                                     "files; the folder mixes two saves")


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2: expert groups partitioned over the expert-data-parallel groups


def build_moe_zero12(b: IndexBuilder, model: Parsed, optims: Sequence[Parsed], layers: dict[str, MoELayer],
                     data_first: bool = False) -> list[Group]:
    """Parameters, states and groups of ZeRO-1/2 partitions (``optims``: by dp rank) of a MoE
    save: non-expert groups over every rank, each expert group per expert-parallel rank over its
    expert-data-parallel group, its local experts under their global names."""
    _check_no_experts(model)
    shapes = param_shapes(model)
    osds = optimizer_dicts(optims)
    where = [str(o.path) for o in optims]
    world = len(optims)
    counts = osds[0].get("partition_count")
    counts = counts if isinstance(counts, list) else [counts] * len(shapes)
    fp32 = fp32_partitions(osds, where, model, len(shapes))
    if len(counts) != len(shapes):
        raise CorruptCheckpointError(f"{where[0]}: partition_count lists {len(counts)} param groups, {model.path} "
                                     f"lists {len(shapes)} in param_shapes; they are from different saves")
    paddings = osds[0].get("param_alignment_paddings")
    bases = [osd.get("base_optimizer_state") for osd in osds]
    groups = []
    for g, group in enumerate(shapes):
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        hp, _ = _zero12_group_state(bases[:1], g, where[:1])
        count = record_int(counts[g])
        if is_moe_group(hp):
            ep = group_ep_size(hp, count, world, where[0])
            sets = [expert_dp_ranks(e, ep, world, data_first) for e in range(ep)]
        else:
            if count is not None and count > world:
                raise CheckpointNotFoundError(f"{optims[0].root}: no *_optim_states.pt file of data-parallel rank {world} "
                                              f"(param group {g} is partitioned over {count} ranks); copy every rank's "
                                              "file of the save")
            if count != world:
                raise CorruptCheckpointError(f"{where[0]}: param group {g} partitioned over {count} ranks, the folder "
                                             f"holds {world} *_optim_states.pt files; copy every rank's file of one save")
            ep, sets = 1, [list(range(world))]
        names: list[str] = []
        for e, ranks in enumerate(sets):
            sub = [optims[r] for r in ranks]
            params = [(global_name(n, layers, e, ep, str(model.path)) if is_moe_group(hp) else n, s)
                      for n, s in group.items()]
            _add_partitions(b, sub, [fp32[r] for r in ranks], [bases[r] for r in ranks], params, pads, g)
            names += [n for n, _ in params]
        groups.append(Group(hp, tuple(names)))
    return groups


def _add_partitions(b: IndexBuilder, optims: Sequence[Parsed], fp32: Sequence[list], bases: Sequence[Any],
                    params: Sequence[tuple[str, Shape]], pads: Any, g: int) -> None:
    """Group ``g``'s parameters from the partitions of ``optims`` (one partition group)."""
    flats = [b.flat(o, f[g], f"single_partition_of_fp32_groups[{g}]") for o, f in zip(optims, fp32)]
    numels = [math.prod(s) for _, s in params]
    short = zero12_shortfall(numels, pads, [f.numel for f in flats])
    if short is not None:
        raise CorruptCheckpointError(
            f"{optims[min(short, len(optims) - 1)].path}: param group {g}'s fp32 partitions do not hold the "
            f"{sum(numels)} elements param_shapes lists; the files are from different saves")
    pieces = zero12_pieces(numels, pads, [f.numel for f in flats])
    _, states = _zero12_group_state(bases, g, [str(o.path) for o in optims])
    add_flat_group(b, optims, params, pieces, flats, states, g)


# ---------------------------------------------------------------------------------------------
# ZeRO-0: each expert-parallel rank's whole optimizer state dict (expp_rank_<r>)


def build_moe_zero0(b: IndexBuilder, model: Parsed, expps: Sequence[Parsed], layers: dict[str, MoELayer],
                    experts: Sequence[Parsed], world: int, data_first: bool = False) -> list[Group]:
    """Weights, optimizer states and groups of a MoE save without ZeRO: the non-expert
    parameters' states from expert-parallel rank 0's optimizer, each expert group's from the
    ranks of its ``ep_size``; weights from the module and the expert files (fp16/bf16 wrappers:
    the fp32 masters their optimizer keeps)."""
    opts = [need(p.value, "optimizer", str(p.path)) for p in expps]
    wrapped = ["fp32_groups" in o or "fp32_groups_flat" in o for o in opts]
    if any(w and "fp32_groups" not in o for w, o in zip(wrapped, opts)):
        raise UnsupportedError(f"{expps[0].path}: a mixture-of-experts save of DeepSpeed's fused fp16 optimizer "
                               "(fp32_groups_flat) is not supported yet")
    inners = [need(o, OSD, str(p.path)) if w else o for o, w, p in zip(opts, wrapped, expps)]
    raws = [need(i, "param_groups", f"{p.path}: optimizer", list) for i, p in zip(inners, expps)]
    if any(len(r) != len(raws[0]) for r in raws):
        raise CorruptCheckpointError(f"{expps[0].root}: the expp_rank_* optimizers hold different param groups; "
                                     "the files are from different saves")
    hps = [hparams_of(g) for g in raws[0]]
    ids = [[list(g.get("params", [])) if isinstance(g, dict) else [] for g in r] for r in raws]
    states = [i.get("state") if isinstance(i.get("state"), dict) else {} for i in inners]
    names: dict[int, list[str]] = {}
    dense = [g for g, hp in enumerate(hps) if not is_moe_group(hp)]
    params, _ = module_params(model)
    _check_no_experts(model)
    shapes0 = {i: _shape(states[0].get(i)) for g in dense for i in ids[0][g]}
    by_id = _names_of_ids(model, params, [raws[0][g] for g in dense], [ids[0][g] for g in dense], shapes0)
    for g in dense:
        names[g] = [by_id[i] for i in ids[0][g]]
        _add_group(b, expps[0], opts[0], states[0], g, ids[0][g], names[g], dict((n, tuple(d.size)) for n, d in params))
    max_ep = max([int(m[1]) for hp in hps if is_moe_group(hp) and (m := _GROUP_NAME.fullmatch(str(hp.get("name"))))]
                 or [len(expps)])
    if len(expps) != max_ep:
        what = (f"no expp_rank_{len(expps)}_mp_rank_00_optim_states.pt (the optimizer of expert-parallel rank "
                f"{len(expps)} of {max_ep})" if len(expps) < max_ep else
                f"{len(expps)} expp_rank_* optimizer files, its largest expert group has {max_ep} ranks")
        raise CheckpointNotFoundError(f"{expps[0].root}: {what}; copy every rank's file of the save")
    moe = [g for g in range(len(hps)) if g not in dense]
    for g in moe:
        ep = group_ep_size(hps[g], None, world, str(expps[0].path))
        names[g] = []
        for k in range(ep):
            e = _file_of(k, ep, max_ep, world, data_first, expps[0])
            local = _local_expert_params(layers, experts, ep, k)
            shapes = {i: _shape(states[e].get(i)) for i in ids[e][g]}
            order = _match(local, ids[e][g], shapes, str(expps[e].path), g)
            globals_ = [global_name(n, layers, k, ep, str(expps[e].path)) for n in order]
            _add_group(b, expps[e], opts[e], states[e], g, ids[e][g], globals_,
                       {global_name(n, layers, k, ep, ""): s for n, s in local})
            names[g] += globals_
    return [Group(hps[g], tuple(names[g])) for g in range(len(hps))]


def _file_of(ep_rank: int, ep: int, max_ep: int, world: int, data_first: bool, where: Parsed) -> int:
    """The ``expp_rank_<e>`` file holding ``ep_rank``'s experts of a group of ``ep`` ranks: file
    ``e`` is written by the first rank of expert-parallel rank ``e``'s group of the largest
    expert group (``max_ep``), its experts those of that rank's own ep rank in each group."""
    for e in range(max_ep):
        if ep_rank_of(expert_dp_ranks(e, max_ep, world, data_first)[0], ep, world, data_first) == ep_rank:
            return e
    raise CorruptCheckpointError(f"{where.root}: no expp_rank_* file holds expert-parallel rank {ep_rank} of "
                                 f"{ep} (the largest expert group has {max_ep} of {world} ranks)")


def _shape(state: Any) -> Shape | None:
    if isinstance(state, dict):
        for value in state.values():
            if isinstance(value, TensorDesc) and len(value.size) >= 1:
                return tuple(value.size)
    return None


def _local_expert_params(layers: dict[str, MoELayer], experts: Sequence[Parsed], ep: int, ep_rank: int) -> list[
        tuple[str, Shape]]:
    """The local expert parameters of ``ep_rank`` (local names, module order) of every layer whose
    experts spread over ``ep`` ranks, from the expert files."""
    by_file = {p.name: p for p in experts}
    out = []
    for layer in sorted(layers.values(), key=lambda la: la.layer):
        if layer.num_experts % ep:
            continue
        per = layer.num_experts // ep
        for k in range(per):
            parsed = by_file[layer.files[ep_rank * per + k]]
            for key, desc in parsed.value.items():
                prefix, _, rest = split_expert(key)
                out.append((f"{prefix}{k}{rest}", tuple(desc.size)))
    return out


def _match(local: Sequence[tuple[str, Shape]], ids: Sequence[int], shapes: dict[int, Shape | None], where: str,
           g: int) -> list[str]:
    """The local names of an expert group's ids: its layers' expert parameters in module order,
    a layer taken when the group's next state has the shape of the layer's first parameter."""
    out: list[str] = []
    pos = 0
    layers: dict[str, list[tuple[str, Shape]]] = {}
    for name, shape in local:
        layers.setdefault(split_expert(name)[0], []).append((name, shape))
    for members in layers.values():
        if pos + len(members) > len(ids):
            continue
        if all(shapes.get(i) in (None, s) for i, (_, s) in zip(ids[pos:], members)):
            out += [n for n, _ in members]
            pos += len(members)
    if pos != len(ids):
        raise InvalidCheckpointError(f"{where}: cannot tell which expert parameters the {len(ids)} entries of expert "
                                     f"param group {g} are (the expert files' parameters do not match them)")
    return out


def _add_group(b: IndexBuilder, parsed: Parsed, opt: dict, state: dict, g: int, ids: Sequence[int],
               names: Sequence[str], shapes: dict[str, Shape]) -> None:
    fp32 = opt.get("fp32_groups")
    for j, (i, fqn) in enumerate(zip(ids, names)):
        shape = shapes[fqn]
        if isinstance(fp32, list):
            b.add_whole(f"model.{fqn}", ("model", fqn), parsed, fp32[g][j], f"optimizer fp32_groups[{g}][{j}]",
                        shape=shape)
        _zero0_states(b, parsed, state.get(i), fqn, shape)


def build_moe(b: IndexBuilder, root: Path, files: TagFiles, parse: Callable[[str, str], Parsed],
              by_rank: Callable[[dict[int, str], str], list[str]]) -> tuple[list[Group], Parsed, list[Parsed], int, int]:
    """Lay out a MoE save; (groups, the model states, the ZeRO optimizer files, stage, dp world)."""
    name = files.model.get(0)
    if name is None:
        raise CheckpointNotFoundError(f"{root}: expert files but no mp_rank_00_model_states.pt (the non-expert "
                                      "weights); copy the whole tag folder")
    model = parse(name, "the model states")
    check_layout(root, files, model)
    layers, experts = moe_layers(root, files, model, parse)
    if files.optim:
        optims = [parse(n, "the optimizer partitions")
                  for n in by_rank({dp: n for (_, dp), n in files.optim.items()}, "*_optim_states.pt")]
        osd = optims[0].value.get(OSD) if isinstance(optims[0].value, dict) else None
        if not isinstance(osd, dict) or "single_partition_of_fp32_groups" not in osd:
            raise UnsupportedError(f"{optims[0].path}: a mixture-of-experts save whose optimizer is not ZeRO-1/2 "
                                   "partitions (single_partition_of_fp32_groups) is not supported")
        groups = build_moe_zero12(b, model, optims, layers, data_first_of(model))
        stage = record_int(osd.get("zero_stage")) or 1
    else:
        optims = []
        if not isinstance(model.value.get("optimizer"), dict):
            raise CheckpointNotFoundError(f"{model.path}: a mixture-of-experts save without ZeRO files and without an "
                                          "optimizer state; copy the whole tag folder")
        expps = [parse(n, "the expert-parallel optimizer")
                 for n in by_rank({ep: n for (_, ep), n in files.expp_optim.items()}, "expp_rank_*_optim_states.pt")]
        if not expps:
            raise CheckpointNotFoundError(f"{root}: no expp_rank_0_mp_rank_00_optim_states.pt (the experts' optimizer "
                                          "states of a save without ZeRO); copy the whole tag folder")
        groups = build_moe_zero0(b, model, expps, layers, experts, _dp_world(model), data_first_of(model))
        stage = 0
    if stage:
        add_frozen_from_module(b, model)
    add_expert_files(b, experts)
    for fqn in _module_rest(model):
        if f"model.{fqn}" not in b.tensors:
            desc = model.value["module"][fqn]
            b.add_whole(f"model.{fqn}", ("model", fqn), model, desc, f"module[{fqn!r}]")
    world = len(optims) if optims else _dp_world(model)
    return groups, model, optims, stage, world


def _module_rest(model: Parsed) -> list[str]:
    """The module's parameters (the weights no optimizer holds: ZeRO-0 fp32, frozen ones)."""
    params, _ = module_params(model)
    skip = set(buffer_names(model))
    return [n for n, d in params if n not in skip and math.prod(d.size)]


def _dp_world(model: Parsed) -> int:
    world = model.value.get("dp_world_size") if isinstance(model.value, dict) else None
    return world if type(world) is int and world >= 1 else 1
