"""Megatron-LM's legacy checkpoint (``--ckpt-format torch``) as a target, planned (pure).

From a checkpoint indexed under megatron-core's sharded keys (a torch_dist save, a legacy one read
by :mod:`formats.megatron.legacy`, or their universal store) to what Megatron-LM's
``save_checkpoint`` writes on a target layout (TP x PP x virtual pipeline x EP): per rank folder
``mp_rank_<tp>[_<pp>][_<ep>]`` a ``model_optim_rng.pt`` holding each model chunk's
``state_dict_for_save_checkpoint()`` (local layer and expert numbers, TP shards, the local spec's or
TE's names) and the common state, and a ``distrib_optim.pt`` holding the DistributedOptimizer's
flat fp32 buffers as ``get_parameter_state_dp_zero`` makes them (:mod:`formats.megatron.buffers`).

Layers are split evenly over the virtual stages ``chunk * PP + pp`` (megatron's default layout);
``embedding.*`` lives on the first virtual stage, ``decoder.final_layernorm`` / ``output_layer`` on
the last (with tied embeddings over several stages, the last one holds ``output_layer.weight``, a
copy of the embedding). :func:`plan_legacy` returns each file as a value whose tensors are
:class:`formats.torch_file.SlotTensor` s and the :class:`Fill` s that copy global boxes into them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from formats.base import Box, CheckpointIndex
from formats.dcp.safe_pickle import DTypeRef
from formats.errors import ConfigError, UnsupportedError
from formats.megatron.buffers import buffer_layout, ddp_bucket_size
from formats.megatron.folders import MODEL_FILE, OPTIM_FILE, iteration_dir_name
from formats.megatron.names import BUFFERS, Split, is_expert_key, local_rest, tp_split
from formats.torch_file import SlotTensor

OPTIMIZER_STATE = re.compile(r"optimizer\.state\.(?P<state>[A-Za-z_][A-Za-z0-9_]*)\.(?P<key>.+)")
_STACKED = re.compile(r"(?P<block>(?:.+\.)?decoder)\.layers\.(?P<rest>(?!\d+\.).+)")
_PER_LAYER = re.compile(r"(?P<block>(?:.+\.)?decoder)\.layers\.(?P<layer>\d+)\.(?P<rest>.+)")
_EXTRA = re.compile(r"(?P<module>.+)\._extra_state/shard_(?P<offsets>[\d.]+)_(?P<grid>[\d.]+)")
FIRST_STAGE = ("embedding.",)
#: The training arguments a target layout changes (Megatron-LM's names).
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "data_parallel_size", "world_size")


@dataclass(frozen=True)
class LegacyLayout:
    """The target: degrees, how the model names its tensors, and the DDP settings that shape the
    optimizer's buffers (``bucket_size`` / ``overlap_grad_reduce`` as Megatron-LM's args; grads
    reduced in fp32 by default, as Megatron-LM does for bf16/fp16)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int = 1
    local_spec: bool = False
    grouped_experts: bool = False
    overlap_grad_reduce: bool = False
    bucket_size: int | None = None
    grad_fp32: bool = True

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def check(self) -> None:
        """Refuse layouts Megatron's legacy format cannot hold (before any I/O)."""
        for name in ("tp", "pp", "vpp", "ep", "dp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"megatron-legacy target: {name} must be >= 1")
        if self.expert_tp != self.tp:
            raise UnsupportedError(f"megatron-legacy target: expert TP {self.expert_tp} other than TP {self.tp} is not "
                                   "written (Megatron-LM's legacy folders mp_rank_<tp>[_<pp>][_<ep>] are named by the "
                                   "dense TP and the EP rank, not the expert TP rank); write torch_dist with --plan "
                                   "megatron-core")
        if self.dp % self.ep:
            raise ConfigError(f"megatron-legacy target: ep{self.ep} must divide the data-parallel size {self.dp} "
                              "(megatron carves the expert ranks out of DP)")

    @property
    def chained(self) -> bool:
        """Whether the experts have their own optimizer (megatron: expert-parallel parameters)."""
        return self.ep > 1 or self.expert_tp != self.tp


@dataclass(frozen=True)
class StorageTarget:
    """Where a write task's bytes go: storage ``storage`` of file ``file`` (the plan's file index),
    from byte ``offset``, as ``dtype``."""

    file: int
    storage: int
    offset: int
    dtype: str

    @property
    def journal_tag(self) -> str:
        """Told apart from the tasks that copy the same source box elsewhere (the journal's id)."""
        return f"{self.file}:{self.storage}:{self.offset}"


@dataclass(frozen=True)
class Fill:
    """Copy the global ``box`` of tensor ``key`` into a slot, from element ``offset`` on (C order)."""

    key: str
    box: Box
    offset: int


@dataclass
class LocalTensor:
    """One tensor of a rank's state dict: its local name, the sharded key it comes from, its
    slot and fills; ``param``: it has optimizer state (not a buffer)."""

    name: str
    key: str
    slot: SlotTensor
    fills: list[Fill]
    param: bool
    expert: bool
    shared_embedding: bool = False


@dataclass
class LegacyFile:
    """A file to write: its path, the value ``torch.save`` writes (SlotTensors for tensors) and the
    fills of its slots."""

    rel: str
    value: Any
    fills: list[tuple[SlotTensor, Fill]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# the model


@dataclass(frozen=True)
class _Key:
    key: str
    rest: str | None  # inside a layer (None: a top-level tensor)
    layer: int | None  # a heterogeneous block's layer (None: stacked, or top-level)
    lead: int  # leading axes: layer (stacked), expert


def _classify(index: CheckpointIndex) -> tuple[list[_Key], int]:
    """The model keys (optimizer states and objects left out) and the number of layers."""
    keys, layers = [], set()
    n_layers = 0
    for key, entry in index.tensors.items():
        if key.startswith("optimizer."):
            continue
        m = _STACKED.fullmatch(key)
        if m is not None:
            n_layers = max(n_layers, int(entry.shape[0]))
            keys.append(_Key(key, m.group("rest"), None, 2 if is_expert_key(key) else 1))
            continue
        m = _PER_LAYER.fullmatch(key)
        if m is not None:
            layers.add(int(m.group("layer")))
            keys.append(_Key(key, m.group("rest"), int(m.group("layer")), 1 if is_expert_key(key) else 0))
            continue
        keys.append(_Key(key, None, None, 0))
    return keys, max(n_layers, max(layers, default=-1) + 1)


def _gated(index: CheckpointIndex, key: str, lead: int) -> bool:
    """A GLU ``linear_fc1``: twice the rows its ``linear_fc2`` reads."""
    if ".linear_fc1." not in key:
        return False
    fc2 = index.tensors.get(key.replace(".linear_fc1.", ".linear_fc2.").replace(".bias", ".weight"))
    return fc2 is not None and index.tensors[key].shape[lead] == 2 * fc2.shape[-1]


def _local(index: CheckpointIndex, k: _Key, degree: int) -> tuple[tuple[int, ...], Split]:
    """(local shape, split) of key ``k`` on one of ``degree`` TP ranks."""
    shape = tuple(index.tensors[k.key].shape[k.lead:])
    split = tp_split(k.key, len(shape), _gated(index, k.key, k.lead))
    if split is None:
        if degree > 1:
            raise UnsupportedError(f"key {k.key!r}: how megatron splits this tensor over TP is not known here; "
                                   "only megatron-core's GPT / MoE layer names are supported at TP > 1")
        split = Split(None)
    if split.dim is None or degree == 1:
        return shape, split
    d = split.dim
    parts = degree * (2 if split.glu else 1)
    if shape[d] % parts:
        raise ConfigError(f"key {k.key!r}: {shape[d]} rows on dim {d} do not split over TP {degree}"
                          f"{' (two GLU halves each)' if split.glu else ''}")
    return tuple(s // degree if i == d else s for i, s in enumerate(shape)), split


def _fills(key: str, lead: tuple[int, ...], local: tuple[int, ...], split: Split, degree: int,
           rank: int) -> list[Fill]:
    """The global boxes of a local TP shard and where each starts in it (GLU: two halves)."""
    ones = tuple(1 for _ in lead)
    zero = tuple(0 for _ in local)
    if split.dim is None or degree == 1:
        return [Fill(key, Box(lead + zero, ones + local), 0)]
    d = split.dim
    if not split.glu:
        offs = tuple(rank * s if i == d else 0 for i, s in enumerate(local))
        return [Fill(key, Box(lead + offs, ones + local), 0)]
    half = local[0] // 2
    sizes = (half, *local[1:])
    inner = 1
    for s in local[1:]:
        inner *= s
    return [Fill(key, Box(lead + (rank * half, *zero[1:]), ones + sizes), 0),
            Fill(key, Box(lead + (degree * half + rank * half, *zero[1:]), ones + sizes), half * inner)]


def _layer_order(keys: list[_Key], experts: int, grouped: bool) -> list[tuple[_Key, int | None]]:
    """(key, local expert) of one layer in state-dict order: index order, each run of expert keys
    expanded expert by expert (SequentialMLP) or key by key (TEGroupedMLP)."""
    out: list[tuple[_Key, int | None]] = []
    run: list[_Key] = []

    def flush() -> None:
        if grouped:
            out.extend((k, j) for k in run for j in range(experts))
        else:
            out.extend((k, j) for j in range(experts) for k in run)
        run.clear()

    for k in keys:
        if is_expert_key(k.key):
            run.append(k)
            continue
        flush()
        out.append((k, None))
    flush()
    return out


@dataclass(frozen=True)
class RankFolder:
    tp: int
    pp: int
    ep: int

    def path(self, layout: LegacyLayout, iteration: int | str) -> str:
        name = f"mp_rank_{self.tp:02d}"
        if layout.pp > 1:
            name += f"_{self.pp:03d}"
        if layout.ep > 1:
            name += f"_{self.ep:03d}"
        return f"{iteration_dir_name(iteration)}/{name}"


def folders(layout: LegacyLayout) -> list[RankFolder]:
    """Every rank folder of the target, as Megatron-LM numbers them."""
    return [RankFolder(t, p, e) for p in range(layout.pp) for e in range(layout.ep) for t in range(layout.tp)]


def rank_chunks(index: CheckpointIndex, layout: LegacyLayout, folder: RankFolder,
                tied: bool) -> list[list[LocalTensor]]:
    """Each model chunk's tensors on ``folder``, in state-dict order."""
    keys, n_layers = _classify(index)
    per_stage = n_layers // layout.stages if n_layers else 0
    if n_layers and n_layers % layout.stages:
        raise UnsupportedError(f"{n_layers} layers do not split evenly over {layout.pp} pipeline stages x {layout.vpp} "
                               "model chunks; only megatron's even layer split is written")
    experts = _expert_count(index, keys)
    if experts % layout.ep:
        raise ConfigError(f"{experts} experts do not split over ep{layout.ep}")
    local_experts = experts // layout.ep
    top_first = [k for k in keys if k.rest is None and k.key.startswith(FIRST_STAGE)]
    top_last = [k for k in keys if k.rest is None and not k.key.startswith(FIRST_STAGE)]
    layer_keys = [k for k in keys if k.rest is not None]
    chunks = []
    for c in range(layout.vpp):
        stage = c * layout.pp + folder.pp
        out: list[LocalTensor] = []
        if stage == 0:
            out += [_tensor(index, layout, folder, k, (), None) for k in top_first]
        for local in range(per_stage):
            g = stage * per_stage + local
            mine = [k for k in layer_keys if k.layer is None or k.layer == g]
            for k, j in _layer_order(mine, local_experts, layout.grouped_experts):
                lead = ((g,) if k.layer is None else ()) + (() if j is None else (folder.ep * local_experts + j,))
                out.append(_tensor(index, layout, folder, k, lead, (local, j)))
        if stage == layout.stages - 1:
            out += [_tensor(index, layout, folder, k, (), None) for k in top_last]
            if tied and layout.stages > 1 and "output_layer.weight" not in index.tensors:
                emb = _tensor(index, layout, folder, _Key("embedding.word_embeddings.weight", None, None, 0), (), None)
                emb.name, emb.shared_embedding = "output_layer.weight", layout.pp > 1
                out.append(emb)
        if stage == 0 and tied and layout.pp > 1:
            for t in out:
                if t.key == "embedding.word_embeddings.weight":
                    t.shared_embedding = True
        chunks.append(out)
    return chunks


def _expert_count(index: CheckpointIndex, keys: list[_Key]) -> int:
    counts = {int(index.tensors[k.key].shape[k.lead - 1]) for k in keys if is_expert_key(k.key) and k.lead}
    if len(counts) > 1:
        raise ConfigError(f"expert tensors disagree on the number of experts ({sorted(counts)})")
    return counts.pop() if counts else 0


def _tensor(index: CheckpointIndex, layout: LegacyLayout, folder: RankFolder, k: _Key, lead: tuple[int, ...],
            at: tuple[int, int | None] | None) -> LocalTensor:
    expert = is_expert_key(k.key)
    degree, rank = (layout.expert_tp, folder.tp % layout.expert_tp) if expert else (layout.tp, folder.tp)
    shape, split = _local(index, k, degree)
    if at is None:
        name = k.key
    else:
        local, j = at
        block = k.key.split(".layers.", 1)[0]
        name = f"{block}.layers.{local}.{local_rest(k.rest, j, layout.local_spec, layout.grouped_experts)}"
    entry = index.tensors[k.key]
    return LocalTensor(name, k.key, SlotTensor(entry.dtype, shape), _fills(k.key, lead, shape, split, degree, rank),
                       BUFFERS.fullmatch(k.key) is None, expert)


# ---------------------------------------------------------------------------------------------
# extra states


def extra_states(objects: Mapping[str, Any], layout: LegacyLayout, folder: RankFolder, chunk: int,
                 n_layers: int, local_experts: int, output_layer: bool) -> list[tuple[str, Any]]:
    """(local name, value) of the ``_extra_state`` entries of one model chunk: the layers' from the
    checkpoint's ShardedObjects (``objects``: key -> value), and the output layer's (megatron's
    torch_dist drops it; its module has one, None) when the chunk holds ``output_layer``."""
    per_stage = n_layers // layout.stages if n_layers else 0
    stage = chunk * layout.pp + folder.pp
    first = stage * per_stage
    out = []
    for key, value in objects.items():
        m = _EXTRA.fullmatch(key)
        if m is None:
            continue
        stacked = _STACKED.fullmatch(m.group("module") + "._extra_state")
        offs = [int(x) for x in m.group("offsets").split(".")]
        if stacked is None or not first <= offs[0] < first + per_stage:
            continue
        j = None
        if len(offs) > 1:
            if not folder.ep * local_experts <= offs[1] < (folder.ep + 1) * local_experts:
                continue
            j = offs[1] - folder.ep * local_experts
        rest = local_rest(stacked.group("rest"), j, layout.local_spec, layout.grouped_experts)
        out.append((f"{stacked.group('block')}.layers.{offs[0] - first}.{rest}", value))
    if output_layer and stage == layout.stages - 1:
        out.append(("output_layer._extra_state", None))
    return out


# ---------------------------------------------------------------------------------------------
# the distributed optimizer


def optimizer_states(index: CheckpointIndex) -> dict[str, dict[str, str]]:
    """param key -> {state: optimizer key} (``optimizer.state.<state>.<key>``)."""
    out: dict[str, dict[str, str]] = {}
    for key in index.tensors:
        m = OPTIMIZER_STATE.fullmatch(key)
        if m is not None and m.group("key") in index.tensors:
            out.setdefault(m.group("key"), {})[m.group("state")] = key
    return out


def optimizer_buffers(chunks: list[list[LocalTensor]], experts: bool | None) -> list[tuple[int, str, list[LocalTensor]]]:
    """(chunk, param dtype, members) of each buffer one optimizer covers, in megatron's order."""
    out = []
    for c, tensors in enumerate(chunks):
        groups: dict[tuple[bool, str], list[LocalTensor]] = {}
        for t in tensors:
            if t.param and (experts is None or t.expert == experts):
                groups.setdefault((t.expert, t.slot.dtype), []).append(t)
        for dense in (False, True):
            out += [(c, dtype, m) for (is_expert, dtype), m in groups.items() if is_expert == dense]
    return out


def optimizer_value(chunks: list[list[LocalTensor]], layout: LegacyLayout, folder: RankFolder,
                    states: Mapping[str, Mapping[str, str]], index: CheckpointIndex,
                    fills: list[tuple[SlotTensor, Fill]]) -> Any:
    """What ``distrib_optim.pt`` holds for ``folder`` (None: nothing for it), its slot fills
    appended to ``fills``: ``{"buckets_coalesced": True, <buffer>: {(param dtype, grad dtype):
    {"param": flat, "exp_avg": flat, ..., "numel_unpadded": n}}}``, a list of two (dense, experts)
    when the experts have their own optimizer."""
    if not layout.chained:
        return _one_optimizer(optimizer_buffers(chunks, None), layout, folder, states, index, fills)
    dense = _one_optimizer(optimizer_buffers(chunks, False), layout, folder, states, index, fills) if folder.ep == 0 else None
    expert = _one_optimizer(optimizer_buffers(chunks, True), layout, folder, states, index, fills)
    return [dense, expert]


def _one_optimizer(buffers: list, layout: LegacyLayout, folder: RankFolder, states: Mapping[str, Mapping[str, str]],
                   index: CheckpointIndex, fills: list[tuple[SlotTensor, Fill]]) -> dict | None:
    if not buffers:
        return None
    names = None
    value: dict[Any, Any] = {"buckets_coalesced": True}
    for g, (c, dtype, members) in enumerate(buffers):
        shared = [t.shared_embedding for t in members]
        size = ddp_bucket_size(layout.overlap_grad_reduce, layout.bucket_size, layout.dp, folder.pp, c)
        placed = buffer_layout([(str(i), t.slot.nbytes // _itemsize(t.slot.dtype), s)
                                for i, (t, s) in enumerate(zip(members, shared))], size)
        for t in members:
            have = tuple(sorted(states.get(t.key, {})))
            if names is None:
                names = have
            if have != names or not have:
                raise UnsupportedError(f"key {t.key!r}: optimizer states {list(have)}, other parameters have "
                                       f"{list(names or ())}; the DistributedOptimizer keeps the same states for all")
        slots = {s: SlotTensor("float32", (placed.numel_unpadded,)) for s in _state_order(names)}
        for p in placed.params:
            t = members[int(p.name)]
            for s, slot in slots.items():
                okey = states[t.key][s]
                fills += [(slot, Fill(okey, f.box, p.start + f.offset)) for f in t.fills]
        grad = "float32" if layout.grad_fp32 else dtype
        value[g] = {(DTypeRef(dtype), DTypeRef(grad)): {**slots, "numel_unpadded": placed.numel_unpadded}}
    return value


def _state_order(names: tuple[str, ...]) -> list[str]:
    """``param`` first (as ``("param",) + optimizer_state_keys``), then the moments."""
    return sorted(names, key=lambda s: (s != "param", s != "exp_avg", s != "exp_avg_sq", s))


def _itemsize(dtype: str) -> int:
    from formats.dtypes import itemsize_of

    return itemsize_of(dtype)


# ---------------------------------------------------------------------------------------------
# the files


def layout_args(args: Any, layout: LegacyLayout, folder: RankFolder | None = None) -> Any:
    """A copy of the training arguments (``argparse.Namespace``) with the target's degrees (and
    ``rank``, where the arguments have one: the rank that writes ``folder``, DP rank 0 of its group
    in megatron's rank order tp-cp-ep-dp-pp)."""
    import argparse
    import copy

    values = {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
              "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
              "expert_model_parallel_size": layout.ep, "expert_tensor_parallel_size": layout.expert_tp,
              "data_parallel_size": layout.dp, "world_size": layout.tp * layout.pp * layout.dp}
    if folder is not None and hasattr(args, "rank"):
        values["rank"] = folder.tp + layout.tp * folder.ep + layout.tp * layout.dp * folder.pp
    if isinstance(args, argparse.Namespace):
        out = copy.copy(args)
        for name, value in values.items():
            setattr(out, name, value)
        return out
    return args


def legacy_optimizer(common_optimizer: Any, layout: LegacyLayout) -> tuple[Any, str | None]:
    """(the optimizer's ``state_dict()`` as the legacy file keeps it, why it cannot be kept): the
    torch_dist common state's (``param_state_sharding_type`` dropped; a chained optimizer's
    ``{0: ..., 1: ...}`` as a list)."""
    def strip(v: Any) -> Any:
        return {k: x for k, x in v.items() if k != "param_state_sharding_type"} if isinstance(v, dict) else v

    if not isinstance(common_optimizer, dict):
        return None, "the checkpoint has no optimizer hyperparameters (common_state['optimizer'])"
    chained = all(isinstance(k, int) for k in common_optimizer) and bool(common_optimizer)
    if chained != layout.chained:
        return None, (f"the source's optimizer is {'two' if chained else 'one'} DistributedOptimizer(s) (dense and "
                      f"experts), the target's {'two' if layout.chained else 'one'} (EP {layout.ep})")
    if chained:
        return [strip(common_optimizer[k]) for k in sorted(common_optimizer)], None
    return strip(common_optimizer), None


def plan_legacy(index: CheckpointIndex, layout: LegacyLayout, common: Mapping[str, Any],
                objects: Mapping[str, Any], tied: bool, iteration: int | str) -> tuple[list[LegacyFile], list[str]]:
    """Every file of the target (``model_optim_rng.pt`` and, with optimizer state,
    ``distrib_optim.pt`` per rank folder) and the warnings. ``common``: the source's common state;
    ``objects``: its ShardedObjects' values (extra states, ``rng_state`` of an unchanged layout)."""
    layout.check()
    warnings: list[str] = []
    states = optimizer_states(index)
    opt_common, why = legacy_optimizer(common.get("optimizer"), layout) if states else (None, None)
    if states and why:
        warnings.append(f"optimizer state not written: {why}; load with --no-load-optim")
        states = {}
    _, n_layers = _classify(index)
    experts = _expert_count(index, _classify(index)[0])
    files = []
    for folder in folders(layout):
        chunks = rank_chunks(index, layout, folder, tied)
        model, fills = _model_value(chunks, layout, folder, objects, n_layers, experts // layout.ep,
                                    output_layer=any(k.startswith("output_layer.") for k in index.tensors) or tied)
        value = _file_value(common, layout, folder, model, opt_common if states else None, objects)
        rel = folder.path(layout, iteration)
        files.append(LegacyFile(f"{rel}/{MODEL_FILE}", value, fills))
        if states:
            ofills: list[tuple[SlotTensor, Fill]] = []
            optim = optimizer_value(chunks, layout, folder, states, index, ofills)
            if optim is not None and (not isinstance(optim, list) or any(x is not None for x in optim)):
                files.append(LegacyFile(f"{rel}/{OPTIM_FILE}", optim, ofills))
    return files, warnings


def _model_value(chunks: list[list[LocalTensor]], layout: LegacyLayout, folder: RankFolder, objects: Mapping[str, Any],
                 n_layers: int, local_experts: int, output_layer: bool) -> tuple[dict, list]:
    from collections import OrderedDict

    model, fills = {}, []
    for c, tensors in enumerate(chunks):
        entries: list[tuple[str, Any]] = []
        for t in tensors:
            entries.append((t.name, t.slot))
            fills += [(t.slot, f) for f in t.fills]
        for name, value in extra_states(objects, layout, folder, c, n_layers, local_experts, output_layer):
            module = name[: -len("_extra_state")]  # after the module's own tensors, as state_dict() puts it
            at = max((i + 1 for i, (n, _) in enumerate(entries) if n.startswith(module)), default=len(entries))
            entries.insert(at, (name, value))
        model["model" if layout.vpp == 1 else f"model{c}"] = OrderedDict(entries)
    return model, fills


def _file_value(common: Mapping[str, Any], layout: LegacyLayout, folder: RankFolder, model: dict,
                optimizer: Any, objects: Mapping[str, Any]) -> dict:
    """A rank's ``model_optim_rng.pt``: Megatron-LM's ``generate_state_dict`` order."""
    value: dict[str, Any] = {"args": layout_args(common.get("args"), layout, folder)}
    for k in ("checkpoint_version", "iteration"):
        if k in common:
            value[k] = common[k]
    value.update(model)
    if optimizer is not None:
        value["optimizer"] = optimizer
    if "opt_param_scheduler" in common:
        value["opt_param_scheduler"] = common["opt_param_scheduler"]
    rng = objects.get(f"rng_state/shard_{folder.pp}.{folder.tp}_{layout.pp}.{layout.tp}")
    if rng is not None:  # (every expert rank of a (pp, tp) cell: the cell's states)
        value["rng_state"] = rng
    skip = {"args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler", "content_metadata"}
    value.update({k: v for k, v in common.items() if k not in skip})
    return value
