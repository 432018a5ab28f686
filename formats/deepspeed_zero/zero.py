"""ZeRO-1/2 and ZeRO-3 optimizer files -> parameters, optimizer states and param groups.

Keys (DCP ``get_state_dict`` style, as :mod:`formats.deepspeed` reads universal checkpoints):
``model.<fqn>`` is the fp32 master weight, ``optim.state.<fqn>.<state>`` each optimizer state of
the parameter's size (``exp_avg``, ``exp_avg_sq``, ...) and its scalar states (``step``: the
group's), ``optim.param_groups.<i>.<hparam>`` the hyperparameters and ``...params`` the FQNs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from formats.dcp.archive import TensorDesc
from formats.deepspeed_pickle import record_int
from formats.deepspeed_zero.files import Parsed
from formats.deepspeed_zero.flat import Piece, zero3_pieces, zero12_pieces, zero12_shortfall
from formats.deepspeed_zero.index import Flat, IndexBuilder, cut
from formats.errors import CorruptCheckpointError, UnsupportedError

Shape = tuple[int, ...]
OSD = "optimizer_state_dict"


@dataclass(frozen=True)
class Group:
    """One optimizer param group: its hyperparameters (as saved, ``params`` dropped) and FQNs."""

    hparams: dict
    params: tuple[str, ...]


def need(mapping: Any, key: str, where: str, kind: type | tuple = dict) -> Any:
    """``mapping[key]`` of type ``kind``; a missing or mistyped one names the file and the key."""
    if not isinstance(mapping, dict) or key not in mapping:
        raise CorruptCheckpointError(f"{where}: no key {key!r}; the file is damaged or not what "
                                     "DeepSpeed's save_checkpoint writes")
    value = mapping[key]
    if not isinstance(value, kind):
        raise CorruptCheckpointError(f"{where}: key {key!r} holds {type(value).__name__}")
    return value


def param_shapes(model: Parsed) -> list[dict[str, Shape]]:
    """``param_shapes`` of a model-states file: per group (ZeRO-3: per sub group), FQN -> shape."""
    groups = model.value.get("param_shapes") if isinstance(model.value, dict) else None
    if groups is None:
        raise CorruptCheckpointError(f"{model.path}: no 'param_shapes' (the parameter order of the flat "
                                     "partitions); the model-states file is not from a ZeRO-1/2/3 save")
    if isinstance(groups, dict):  # old DeepSpeed: one group
        groups = [groups]
    ok = isinstance(groups, list) and all(isinstance(g, dict) for g in groups) and all(
        isinstance(k, str) and isinstance(s, tuple) and all(type(d) is int and d >= 0 for d in s)
        for g in groups for k, s in g.items())
    if not ok:
        raise CorruptCheckpointError(f"{model.path}: key 'param_shapes' is not a list of {{name: shape}}")
    return [dict(g) for g in groups]


def optimizer_dicts(optims: Sequence[Parsed]) -> list[dict]:
    """Each rank's ``optimizer_state_dict`` (the ZeRO optimizer's own state dict)."""
    return [need(o.value, OSD, str(o.path)) for o in optims]


def partition_count(osd: dict, where: str) -> int:
    """The data-parallel degree the partitions were cut for."""
    count = osd.get("partition_count")
    counts = count if isinstance(count, list) else [count]
    ints = [record_int(c) for c in counts]
    if not ints or any(c is None or c < 1 for c in ints):
        raise CorruptCheckpointError(f"{where}: key 'partition_count' holds {count!r}")
    if len(set(ints)) > 1:
        raise UnsupportedError(f"{where}: param groups partitioned over different data-parallel sizes {ints} "
                               "(MoE expert groups); not supported yet: convert with ds_to_universal.py")
    return ints[0]


def check_world(optims: Sequence[Parsed], world: int) -> None:
    """One optimizer file per data-parallel rank, 0 .. world-1."""
    if len(optims) != world:
        raise CorruptCheckpointError(
            f"{optims[0].root}: {len(optims)} *_optim_states.pt files, the partitions were cut for {world} ranks; "
            "the tag folder is incomplete or mixes two saves: copy every rank's file of one save")


# ---------------------------------------------------------------------------------------------
# optimizer states of one flat group


def _state_dicts(states: Sequence[Any], where: Sequence[str], group: int) -> list[dict]:
    out = []
    for s, w in zip(states, where):
        if not isinstance(s, dict):
            raise CorruptCheckpointError(f"{w}: the optimizer state of group {group} is a {type(s).__name__}")
        out.append(s)
    return out


def add_flat_group(b: IndexBuilder, optims: Sequence[Parsed], params: Sequence[tuple[str, Shape]],
                   pieces: Sequence[Sequence[Piece]], masters: Sequence[Flat], states: Sequence[Any] | None,
                   group: int) -> None:
    """Each parameter of a flat group: ``model.<fqn>`` from the ranks' fp32 partitions
    (``masters``) and ``optim.state.<fqn>.<state>`` from the optimizer's state of the group's
    flat parameter on each rank (``states``, None without optimizer state): the states of the
    partition's size as pieces cut like the master, the others (a step) as scalars."""
    tensors: dict[str, list[Flat]] = {}
    scalars: dict[str, Any] = {}
    if states is not None:
        per_rank = _state_dicts(states, [str(o.path) for o in optims], group)
        for name, value in per_rank[0].items():
            if not isinstance(name, str):
                continue
            if isinstance(value, TensorDesc) and len(value.size) >= 1:
                tensors[name] = [_state_flat(b, o, s, name, group) for o, s in zip(optims, per_rank)]
            else:
                scalars[name] = value
    where = str(optims[0].root)
    for (fqn, shape), ps in zip(params, pieces):
        cuts = cut(shape, ps)
        b.add_cut(f"model.{fqn}", ("model", fqn), masters[0].dtype, shape, cuts, [masters[p.rank] for p in ps], where)
        for name, flats in tensors.items():
            b.add_cut(f"optim.state.{fqn}.{name}", ("optim", "state", fqn, name), flats[0].dtype, shape, cuts,
                      [flats[p.rank] for p in ps], where)
        for name, value in scalars.items():
            add_scalar(b, optims[0], value, f"optim.state.{fqn}.{name}", ("optim", "state", fqn, name),
                       f"{OSD} state {name!r} of group {group}")


def _state_flat(b: IndexBuilder, parsed: Parsed, state: dict, name: str, group: int) -> Flat:
    if name not in state:
        raise CorruptCheckpointError(f"{parsed.path}: optimizer state {name!r} of group {group} is missing on this "
                                     "rank; the files are from different runs")
    return b.flat(parsed, state[name], f"optimizer state {name!r} of group {group}")


def add_scalar(b: IndexBuilder, parsed: Parsed, value: Any, key: str, path: tuple, what: str) -> None:
    """A scalar state (a step): a one-element tensor read from the file, or a number (float32,
    as the universal checkpoint keeps it)."""
    import numpy as np

    if isinstance(value, TensorDesc):
        if math.prod(value.size) != 1:
            raise CorruptCheckpointError(f"{parsed.path}: {what} has {math.prod(value.size)} elements, not 1")
        b.add_whole(key, path, parsed, value, what, shape=())
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            data = np.asarray(float(value), dtype=np.float32)
        except OverflowError:
            raise CorruptCheckpointError(f"{parsed.path}: {what} holds an integer too large for a float") from None
        b.add_value(key, path, data, "float32", parsed.name)


def add_groups(b: IndexBuilder, groups: Sequence[Group], file: str) -> None:
    """``optim.param_groups.<i>.<hparam>`` and ``.params`` (plain values only)."""
    for i, g in enumerate(groups):
        for name, value in [*g.hparams.items(), ("params", list(g.params))]:
            if isinstance(name, str) and is_plain(value):
                b.add_object(f"optim.param_groups.{i}.{name}", ("optim", "param_groups", i, name), value, file)


def is_plain(value: Any) -> bool:
    """Numbers, strings, None, and lists/tuples/dicts of them (what carries over to any framework)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and is_plain(v) for k, v in value.items())
    return False


def hparams_of(group: Any) -> dict:
    return {k: v for k, v in group.items() if k != "params"} if isinstance(group, dict) else {}


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2 (and DeepSpeed's BF16 optimizer): one flat buffer per param group, cut in partitions


def fp32_partitions(osds: Sequence[dict], where: Sequence[str], model: Parsed, groups: int) -> list[list]:
    """Each rank's ``single_partition_of_fp32_groups``, checked to list one partition per param group
    of ``model``'s ``param_shapes`` (``groups``)."""
    fp32 = [need(osd, "single_partition_of_fp32_groups", w, list) for osd, w in zip(osds, where)]
    if any(len(f) != groups for f in fp32):
        raise CorruptCheckpointError(f"{where[0]}: {len(fp32[0])} fp32 partitions, {model.path} lists "
                                     f"{groups} param groups in param_shapes; they are from different saves")
    return fp32


def build_zero12(b: IndexBuilder, model: Parsed, optims: Sequence[Parsed]) -> list[Group]:
    """Parameters, states and groups of ZeRO-1/2 partitions (``optims``: by dp rank)."""
    shapes = param_shapes(model)
    osds = optimizer_dicts(optims)
    where = [str(o.path) for o in optims]
    check_world(optims, partition_count(osds[0], where[0]))
    fp32 = fp32_partitions(osds, where, model, len(shapes))
    paddings = osds[0].get("param_alignment_paddings")
    bases = [osd.get("base_optimizer_state") for osd in osds]
    groups = []
    for g, group in enumerate(shapes):
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        names, dims = list(group), list(group.values())
        flats = [b.flat(o, f[g], f"single_partition_of_fp32_groups[{g}]") for o, f in zip(optims, fp32)]
        numels = [math.prod(s) for s in dims]
        short = zero12_shortfall(numels, pads, [f.numel for f in flats])
        if short is not None:
            raise CorruptCheckpointError(
                f"{optims[min(short, len(optims) - 1)].path}: param group {g}'s fp32 partitions do not hold the "
                f"{sum(numels)} elements param_shapes lists; the files are from different saves")
        pieces = zero12_pieces(numels, pads, [f.numel for f in flats])
        hp, states = _zero12_group_state(bases, g, where)
        add_flat_group(b, optims, list(group.items()), pieces, flats, states, g)
        groups.append(Group(hp, tuple(names)))
    return groups


def _zero12_group_state(bases: Sequence[Any], g: int, where: Sequence[str]) -> tuple[dict, list | None]:
    """(hyperparameters, per-rank state of group ``g``) from ``base_optimizer_state``: torch's
    optimizer state dict, or (elastic checkpoints) a list of per-group states without them."""
    if all(b is None for b in bases):
        return {}, None
    if isinstance(bases[0], list):  # elastic: lean per-group states
        return {}, [b[g] if isinstance(b, list) and g < len(b) else None for b in bases]
    states = []
    hp: dict = {}
    for base, w in zip(bases, where):
        groups = need(base, "param_groups", f"{w}: base_optimizer_state", list)
        if g >= len(groups):
            raise CorruptCheckpointError(f"{w}: base_optimizer_state has {len(groups)} param groups, not {g + 1}")
        ids = groups[g].get("params") if isinstance(groups[g], dict) else None
        state = need(base, "state", f"{w}: base_optimizer_state")
        states.append(state.get(ids[0], {}) if isinstance(ids, list) and len(ids) == 1 else state.get(g, {}))
        hp = hp or hparams_of(groups[g])
    return hp, states


# ---------------------------------------------------------------------------------------------
# ZeRO-3: each parameter cut on its own; one flat buffer per rank and sub group


def build_zero3(b: IndexBuilder, model: Parsed, optims: Sequence[Parsed]) -> list[Group]:
    """Parameters, states and groups of ZeRO-3 partitions (``optims``: by dp rank)."""
    shapes = param_shapes(model)
    osds = optimizer_dicts(optims)
    where = [str(o.path) for o in optims]
    if any("ds_zero_partition_groups" in osd for osd in osds):
        raise UnsupportedError(f"{where[0]}: ZeRO-3 sub groups partitioned over expert groups (AutoEP); not "
                               "supported yet: convert with ds_to_universal.py")
    world = partition_count(osds[0], where[0])
    check_world(optims, world)
    flats_by_rank = [need(osd, "fp32_flat_groups", w, list) for osd, w in zip(osds, where)]
    inners = [need(osd, OSD, w) for osd, w in zip(osds, where)]
    if any(len(f) != len(shapes) for f in flats_by_rank):
        raise CorruptCheckpointError(f"{where[0]}: {len(flats_by_rank[0])} fp32 flat groups, {model.path} lists "
                                     f"{len(shapes)} sub groups in param_shapes; they are from different saves")
    sub_names: list[list[str]] = []
    for k, group in enumerate(shapes):
        names, dims = list(group), list(group.values())
        pieces, length = zero3_pieces([math.prod(s) for s in dims], world)
        flats = [b.flat(o, f[k], f"fp32_flat_groups[{k}]") for o, f in zip(optims, flats_by_rank)]
        bad = next((r for r, f in enumerate(flats) if f.numel < length), None)
        if bad is not None:
            raise CorruptCheckpointError(f"{optims[bad].path}: fp32_flat_groups[{k}] holds {flats[bad].numel} elements, "
                                         f"the sub group's parameters need {length}; the files are from different saves")
        states = [need(inner, "state", w).get(k) for inner, w in zip(inners, where)]
        add_flat_group(b, optims, list(group.items()), pieces, flats, states if states[0] is not None else None, k)
        sub_names.append(names)
    return _zero3_groups(inners[0], sub_names, where[0])


def _zero3_groups(inner: dict, sub_names: Sequence[Sequence[str]], where: str) -> list[Group]:
    """Param groups: each lists the sub groups (flat buffers) it optimizes."""
    groups = need(inner, "param_groups", where, list)
    out, seen = [], set()
    for g in groups:
        ids = g.get("params") if isinstance(g, dict) else None
        if not isinstance(ids, list) or any(type(i) is not int or not 0 <= i < len(sub_names) for i in ids):
            raise CorruptCheckpointError(f"{where}: a param group lists sub groups {ids!r}; the file is damaged")
        seen.update(ids)
        out.append(Group(hparams_of(g), tuple(n for i in ids for n in sub_names[i])))
    missing = [i for i in range(len(sub_names)) if i not in seen]
    if missing and out:  # sub groups the saved groups do not list (none expected): the first group's
        out[0] = Group(out[0].hparams, out[0].params + tuple(n for i in missing for n in sub_names[i]))
    return out


def frozen_zero3(b: IndexBuilder, models: Sequence[Parsed], world: int) -> list[str]:
    """ZeRO-3 frozen parameters: each rank's model-states file holds its partition of each."""
    shapes = models[0].value.get("frozen_param_shapes") if isinstance(models[0].value, dict) else None
    if not isinstance(shapes, Mapping) or not shapes:
        return []
    names = []
    for fqn, shape in shapes.items():
        if not isinstance(fqn, str) or not isinstance(shape, tuple):
            continue
        pieces, _ = zero3_pieces([math.prod(shape)], world)
        flats = []
        for m in models:
            frags = need(m.value, "frozen_param_fragments", str(m.path))
            if fqn not in frags:
                raise CorruptCheckpointError(f"{m.path}: frozen_param_fragments lacks {fqn!r}")
            flats.append(b.flat(m, frags[fqn], f"frozen_param_fragments[{fqn!r}]"))
        b.add_pieces(f"model.{fqn}", ("model", fqn), flats[0].dtype, shape,
                     [(p, flats[p.rank]) for p in pieces[0]], str(models[0].root))
        names.append(fqn)
    return names
