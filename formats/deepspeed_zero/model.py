"""The model-states file: ZeRO-0 weights and optimizer, buffers, frozen and tied parameters,
counters and the other training state DeepSpeed saves beside the weights."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from formats.dcp.archive import TensorDesc
from formats.deepspeed_pickle import record_int
from formats.deepspeed_zero.files import Parsed
from formats.deepspeed_zero.flat import Piece
from formats.deepspeed_zero.index import IndexBuilder
from formats.deepspeed_zero.zero import OSD, Group, add_scalar, hparams_of, is_plain, need
from formats.errors import CorruptCheckpointError, InvalidCheckpointError
from formats.dcp.safe_pickle import DTypeRef, Record

Shape = tuple[int, ...]
#: Model-states keys that describe the weights (read into tensors, not kept as objects).
STRUCTURE_KEYS = frozenset({"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
                            "shared_params", "frozen_param_fragments"})
#: Optimizer-file keys kept as objects (the loss scaler and its flags).
OPTIMIZER_OBJECT_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "zero_stage")
#: The loss-scale keys DeepSpeed's ZeRO-0 fp16/bf16 optimizers save beside their state.
ZERO0_SCALER_KEYS = ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor",
                     "scale_window", "clip_grad")


def module_of(model: Parsed) -> dict[str, Any]:
    """The saved ``module`` state dict (empty for pipeline engines, which save layer files)."""
    module = model.value.get("module") if isinstance(model.value, dict) else None
    if module is None:
        return {}
    if not isinstance(module, dict):
        raise CorruptCheckpointError(f"{model.path}: key 'module' holds {type(module).__name__}, not a state dict")
    return module


def buffer_names(model: Parsed) -> list[str]:
    names = model.value.get("buffer_names") if isinstance(model.value, dict) else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _storage_id(model: Parsed, desc: TensorDesc) -> tuple:
    return model.storage_key(desc), desc.storage_offset, tuple(desc.size), tuple(desc.stride)


def module_params(model: Parsed) -> tuple[list[tuple[str, TensorDesc]], dict[str, str]]:
    """The module's parameters in order (buffers left out) and its tied ones: a later name whose
    tensor is the same view of the same storage as an earlier one (alias -> first name)."""
    skip = set(buffer_names(model))
    params, first, tied = [], {}, {}
    for name, desc in module_of(model).items():
        if name in skip or not isinstance(desc, TensorDesc):
            continue
        ident = _storage_id(model, desc)
        if ident in first and math.prod(desc.size):
            tied[name] = first[ident]
            continue
        first.setdefault(ident, name)
        params.append((name, desc))
    return params, tied


def add_buffers(b: IndexBuilder, model: Parsed) -> None:
    """``model.<buffer>`` for each persistent buffer the module state dict holds."""
    module = module_of(model)
    for name in buffer_names(model):
        if isinstance(module.get(name), TensorDesc):
            b.add_whole(f"model.{name}", ("model", name), model, module[name], f"module[{name!r}]")


def add_shared(b: IndexBuilder, model: Parsed) -> None:
    """Tied parameters DeepSpeed saved once (``shared_params``: alias -> the name holding data)."""
    shared = model.value.get("shared_params") if isinstance(model.value, dict) else None
    if isinstance(shared, dict):
        for alias, target in shared.items():
            if isinstance(alias, str) and isinstance(target, str) and f"model.{target}" in b.tensors \
                    and f"model.{alias}" not in b.tensors:
                b.alias(f"model.{alias}", ("model", alias), f"model.{target}")


def add_frozen_from_module(b: IndexBuilder, model: Parsed) -> None:
    """ZeRO-1/2 parameters outside the optimizer: ``frozen_param_fragments`` (full tensors), else
    the module's own (16-bit) copy of every parameter not added yet."""
    frags = model.value.get("frozen_param_fragments") if isinstance(model.value, dict) else None
    if isinstance(frags, dict) and frags:
        for name, desc in frags.items():
            if isinstance(name, str) and isinstance(desc, TensorDesc) and f"model.{name}" not in b.tensors:
                b.add_whole(f"model.{name}", ("model", name), model, desc, f"frozen_param_fragments[{name!r}]")
        return
    params, _ = module_params(model)
    for name, desc in params:
        if f"model.{name}" not in b.tensors and math.prod(desc.size):
            b.add_whole(f"model.{name}", ("model", name), model, desc, f"module[{name!r}]")


def add_objects(b: IndexBuilder, model: Parsed, optim: Parsed | None, left_out: list[str]) -> None:
    """``deepspeed.<key>``: the counters, scheduler and other plain values of the model-states
    file (client state included) and the loss scaler of the optimizer file; tensors among them
    (client state) as tensors; anything else is listed in ``left_out``."""
    for key, value in model.value.items():
        if not isinstance(key, str) or key in STRUCTURE_KEYS:
            continue
        _add_any(b, model, f"deepspeed.{key}", ("deepspeed", key), value, left_out)
    opt = model.value.get("optimizer")
    if isinstance(opt, dict) and OSD in opt:  # ZeRO-0's fp16/bf16 wrappers: the loss scale beside the state
        scaler = {k: v for k, v in opt.items() if k in ZERO0_SCALER_KEYS}
        if scaler:
            _add_any(b, model, "deepspeed.loss_scaler", ("deepspeed", "loss_scaler"), scaler, left_out)
    osd = optim.value.get(OSD) if optim is not None and isinstance(optim.value, dict) else None
    if isinstance(osd, dict):
        for key in OPTIMIZER_OBJECT_KEYS:
            if key in osd:
                _add_any(b, optim, f"deepspeed.{key}", ("deepspeed", key), osd[key], left_out)


def as_data(value: Any) -> Any:
    """DeepSpeed's records as plain data: an IntEnum (``ZeroStageEnum``) its int, a class
    (``LossScaler``) the dict of its fields, a torch dtype its name (``"torch.float16"``)."""
    if isinstance(value, Record):
        as_int = record_int(value)
        return as_int if as_int is not None else {k: as_data(v) for k, v in value.fields.items()}
    if isinstance(value, DTypeRef):
        return f"torch.{value.name}"
    if isinstance(value, dict) and not isinstance(value, TensorDesc):
        return {k: as_data(v) for k, v in value.items()}
    return value


def _add_any(b: IndexBuilder, parsed: Parsed, key: str, path: tuple, value: Any, left_out: list[str]) -> None:
    value = as_data(value)
    if isinstance(value, TensorDesc):
        b.add_whole(key, path, parsed, value, f"key {path[-1]!r}")
    elif is_plain(value):
        b.add_object(key, path, value, parsed.name)
    else:
        left_out.append(f"{parsed.name}: {path[-1]} ({type(value).__name__})")


# ---------------------------------------------------------------------------------------------
# ZeRO-0: the module and a plain (or DeepSpeed fp16/bf16-wrapped) torch optimizer state dict


def build_zero0(b: IndexBuilder, model: Parsed) -> list[Group]:
    """Weights (the fp32 masters where the optimizer keeps them), optimizer states and groups."""
    params, tied = module_params(model)
    opt = model.value.get("optimizer")
    groups: list[Group] = []
    if isinstance(opt, dict) and opt:
        inner = need(opt, OSD, str(model.path)) if ("fp32_groups" in opt or "fp32_groups_flat" in opt) else opt
        groups = _zero0_optimizer(b, model, params, opt, inner)
    for name, desc in params:  # weights the optimizer does not hold: as the module saved them
        if f"model.{name}" not in b.tensors:
            b.add_whole(f"model.{name}", ("model", name), model, desc, f"module[{name!r}]")
    for alias, target in tied.items():
        b.alias(f"model.{alias}", ("model", alias), f"model.{target}")
    return groups


def _zero0_optimizer(b: IndexBuilder, model: Parsed, params: Sequence[tuple[str, TensorDesc]], opt: dict,
                     inner: dict) -> list[Group]:
    where = str(model.path)
    raw_groups = need(inner, "param_groups", f"{where}: optimizer", list)
    state = inner.get("state") if isinstance(inner.get("state"), dict) else {}
    ids = [list(g.get("params", [])) if isinstance(g, dict) else [] for g in raw_groups]
    if "fp32_groups_flat" in opt:
        return _zero0_fused(b, model, params, opt, raw_groups, state, ids)
    fp32 = opt.get("fp32_groups")
    shapes = {i: _state_shape(state.get(i)) for g in ids for i in g}
    if isinstance(fp32, list):
        for g, group in zip(ids, fp32):
            for i, desc in zip(g, group if isinstance(group, list) else []):
                shapes[i] = tuple(desc.size) if isinstance(desc, TensorDesc) else shapes.get(i)
    names = _names_of_ids(model, params, raw_groups, ids, shapes)
    by_name = dict(params)
    for gi, g in enumerate(ids):
        for j, i in enumerate(g):
            fqn = names[i]
            shape = tuple(by_name[fqn].size)
            if isinstance(fp32, list):
                b.add_whole(f"model.{fqn}", ("model", fqn), model, fp32[gi][j], f"optimizer fp32_groups[{gi}][{j}]",
                            shape=shape)
            _zero0_states(b, model, state.get(i), fqn, shape)
    return [Group(hparams_of(rg), tuple(names[i] for i in g)) for rg, g in zip(raw_groups, ids)]


def _zero0_states(b: IndexBuilder, model: Parsed, state: Any, fqn: str, shape: Shape) -> None:
    if not isinstance(state, dict):
        return
    for name, value in state.items():
        key, path = f"optim.state.{fqn}.{name}", ("optim", "state", fqn, name)
        if isinstance(value, TensorDesc) and math.prod(value.size) == math.prod(shape) and value.size != ():
            b.add_whole(key, path, model, value, f"optimizer state {name!r} of {fqn!r}", shape=shape)
        elif isinstance(name, str):
            add_scalar(b, model, value, key, path, f"optimizer state {name!r} of {fqn!r}")


def _state_shape(state: Any) -> Shape | None:
    if isinstance(state, dict):
        for value in state.values():
            if isinstance(value, TensorDesc) and len(value.size) >= 1:
                return tuple(value.size)
    return None


def _names_of_ids(model: Parsed, params: Sequence[tuple[str, TensorDesc]], raw_groups: Sequence[Any],
                  ids: Sequence[Sequence[int]], shapes: dict[int, Shape | None]) -> dict[int, str]:
    """Which module parameter each optimizer index is: the groups' ``param_names`` when saved,
    else the module's parameter order (each group a subsequence of it, told apart by shape)."""
    named = [g.get("param_names") for g in raw_groups if isinstance(g, dict)]
    if named and all(isinstance(n, list) and len(n) == len(g) for n, g in zip(named, ids)):
        return {i: n for g, ns in zip(ids, named) for i, n in zip(g, ns)}
    order = [(n, tuple(d.size)) for n, d in params]
    nexts = [0] * len(ids)
    out: dict[int, str] = {}
    total = sum(len(g) for g in ids)
    for name, shape in order:
        fits = [gi for gi, g in enumerate(ids) if nexts[gi] < len(g)
                and shapes.get(g[nexts[gi]]) in (None, shape)]
        if len(fits) > 1 and len(ids) > 1:
            raise InvalidCheckpointError(
                f"{model.path}: cannot tell which optimizer param group holds {name!r} (the groups save no "
                "param_names and several expect a tensor of its shape); build the optimizer from "
                "model.named_parameters() so torch saves param_names, and save again")
        if not fits:
            if total == len(order):
                raise InvalidCheckpointError(f"{model.path}: the optimizer's state does not match parameter {name!r} "
                                             f"{list(shape)}; the optimizer holds other parameters than the module")
            continue  # a parameter outside the optimizer (frozen)
        gi = fits[0]
        out[ids[gi][nexts[gi]]] = name
        nexts[gi] += 1
    if any(n < len(g) for n, g in zip(nexts, ids)):
        raise InvalidCheckpointError(f"{model.path}: the optimizer holds {total} parameters that the module's "
                                     f"{len(order)} do not account for; the module and optimizer states disagree")
    return out


def _zero0_fused(b: IndexBuilder, model: Parsed, params: Sequence[tuple[str, TensorDesc]], opt: dict,
                 raw_groups: Sequence[Any], state: dict, ids: Sequence[Sequence[int]]) -> list[Group]:
    """DeepSpeed's fused FP16/BF16 optimizer: one flat fp32 buffer (and state) per group, its
    parameters one after another in the module's order (one group only: the flat saves no names)."""
    flats = need(opt, "fp32_groups_flat", str(model.path), list)
    if len(flats) != 1:
        raise InvalidCheckpointError(f"{model.path}: {len(flats)} fused fp16 param groups; which parameters each "
                                     "holds is not saved: use one param group, or ZeRO-1 and above")
    flat = b.flat(model, flats[0], "optimizer fp32_groups_flat[0]")
    numels = [math.prod(d.size) for _, d in params]
    if sum(numels) != flat.numel:
        raise InvalidCheckpointError(f"{model.path}: the fused fp32 group holds {flat.numel} elements, the module's "
                                     f"parameters {sum(numels)}; which parameters it holds is not saved")
    pos, pieces = 0, []
    for n in numels:
        pieces.append(Piece(0, pos, 0, n))
        pos += n
    names = [n for n, _ in params]
    for (fqn, desc), p in zip(params, pieces):
        b.add_pieces(f"model.{fqn}", ("model", fqn), flat.dtype, tuple(desc.size), [(p, flat)], str(model.path))
    group_state = state.get(ids[0][0]) if ids and ids[0] else None
    if isinstance(group_state, dict):
        for name, value in group_state.items():
            if isinstance(value, TensorDesc) and len(value.size) >= 1:
                sflat = b.flat(model, value, f"optimizer state {name!r}")
                for (fqn, desc), p in zip(params, pieces):
                    b.add_pieces(f"optim.state.{fqn}.{name}", ("optim", "state", fqn, name), sflat.dtype,
                                 tuple(desc.size), [(p, sflat)], str(model.path))
            elif isinstance(name, str):
                for fqn in names:
                    add_scalar(b, model, value, f"optim.state.{fqn}.{name}", ("optim", "state", fqn, name),
                               f"optimizer state {name!r}")
    return [Group(hparams_of(raw_groups[0]) if raw_groups else {}, tuple(names))]
