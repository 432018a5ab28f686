"""A megatron-core model's state-dict names and the sharded keys its ``sharded_state_dict()`` gives
them (pure functions; megatron-core 0.19.2).

A rank's state dict (``state_dict_for_save_checkpoint()``, what a legacy ``model_optim_rng.pt``
holds) names tensors locally: ``decoder.layers.<i>.`` counts the layers of this pipeline stage (or
model chunk) from 0, ``mlp.experts.local_experts.<j>.`` (SequentialMLP) / ``mlp.experts.linear_fc1.weight<j>``
(TEGroupedMLP) the experts of this expert-parallel rank, and every tensor is this rank's TP shard.
megatron-core's ``sharded_state_dict()`` turns each into one global tensor:

- layers of a homogeneous block are stacked: ``decoder.layers.<rest>`` of global shape ``(L, ...)``
  (``TransformerBlock.sharded_state_dict``; heterogeneous blocks keep ``decoder.layers.<g>.<rest>``);
- experts are stacked after the layer axis: ``mlp.experts.experts.<rest>`` of shape ``(L, E, ...)``
  (``SequentialMLP``; ``TEGroupedMLP`` gives the same keys);
- the local layer spec's separate norms take the names of TE's fused ones
  (``sharded_state_dict_keys_map``: ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``,
  ``pre_mlp_layernorm.`` -> ``mlp.linear_fc1.layer_norm_``);
- TP shards are concatenated along the layer's partition dim (column-parallel: dim 0, row-parallel:
  dim 1, vocab-parallel embedding: dim 0); the gated ``linear_fc1`` of a GLU MLP holds ``[gate_r;
  up_r]`` on TP rank r, so the global tensor is ``[gate_0, ..., gate_{T-1}, up_0, ..., up_{T-1}]``
  (``apply_swiglu_sharded_factory``); the fused ``linear_qkv`` is split per query group and concatenates
  as is.

:func:`parse_name` reads a local name; :func:`tp_split` says how a tensor is split over TP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The local layer spec's norm names -> the sharded (TE) names (megatron-core's gpt_layer_specs).
LOCAL_SPEC_KEYS_MAP = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                       ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
#: Blocks whose layers are stacked along a leading layer axis.
STACKED_BLOCKS = ("decoder", "encoder")
_LAYER = re.compile(r"(?P<block>(?:.+\.)?(?:decoder|encoder))\.layers\.(?P<layer>\d+)\.(?P<rest>.+)")
_SEQ_EXPERT = re.compile(r"(?P<head>(?:.+\.)?experts)\.local_experts\.(?P<expert>\d+)\.(?P<rest>.+)")
_GROUPED_EXPERT = re.compile(r"(?P<head>(?:.+\.)?experts)\.(?P<module>linear_fc[12])\.(?P<param>weight|bias)(?P<expert>\d+)")
_LEGACY_GROUPED = re.compile(r"(?:.+\.)?experts\.weight[12]")

#: Column-parallel linear layers (weight and bias split on dim 0).
COLUMN_PARALLEL = frozenset({"linear_qkv", "linear_fc1", "output_layer", "linear_q_proj", "linear_q_up_proj",
                             "linear_kv_up_proj"})
#: Row-parallel linear layers (weight split on dim 1, bias replicated).
ROW_PARALLEL = frozenset({"linear_proj", "linear_fc2"})
#: Names of tensors replicated over TP (norms, routers, position embeddings, biases of row layers).
_REPLICATED = re.compile(
    r"(?:.*\.)?(?:[a-z_]*norm[a-z_]*\.(?:weight|bias)|layer_norm_(?:weight|bias)|router\.(?:weight|bias|expert_bias)"
    r"|expert_bias|position_embeddings\.weight|gate_weight|q_layernorm\.\w+|k_layernorm\.\w+|kv_layernorm\.\w+)"
)
#: Persistent buffers of megatron-core modules (no optimizer state).
BUFFERS = re.compile(r"(?:.*\.)?(?:expert_bias|local_tokens_per_expert)")
EXTRA_STATE = "_extra_state"


@dataclass(frozen=True)
class LocalName:
    """A rank's state-dict name, read: the block's layer (local index) and expert (local index)
    it belongs to, and the sharded key with ``{layer}`` / ``{expert}`` left out."""

    name: str
    block: str | None  # "decoder" (with any prefix) when the name is inside a layer
    layer: int | None  # local layer index
    expert: int | None  # local expert index
    rest: str  # the name inside the layer (local spec norms mapped), or the whole name
    grouped: bool = False  # a TEGroupedMLP name (``linear_fc1.weight<j>``)

    @property
    def stacked_key(self) -> str:
        """The sharded key of a homogeneous block (layers and experts stacked)."""
        return f"{self.block}.layers.{self.rest}" if self.block is not None else self.rest

    def layer_key(self, global_layer: int) -> str:
        """The sharded key of a heterogeneous block (``decoder.layers.<g>.<rest>``)."""
        return f"{self.block}.layers.{global_layer}.{self.rest}" if self.block is not None else self.rest


def map_local_spec(rest: str) -> str:
    """``rest`` with the local layer spec's norm names mapped to TE's (sharded) names."""
    for old, new in LOCAL_SPEC_KEYS_MAP:
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def parse_name(name: str, local_spec: bool) -> LocalName:
    """Read a state-dict name (see the module docstring); ``local_spec``: map the local spec's norms."""
    m = _LAYER.fullmatch(name)
    if m is None:
        return LocalName(name, None, None, None, name)
    rest, expert, grouped = m.group("rest"), None, False
    if _LEGACY_GROUPED.fullmatch(rest):
        from formats.errors import UnsupportedError

        raise UnsupportedError(f"{name}: megatron's legacy GroupedMLP weights (experts.weight1/weight2) are not "
                               "supported; save with SequentialMLP or TEGroupedMLP (--moe-grouped-gemm with TE)")
    e = _SEQ_EXPERT.fullmatch(rest)
    if e is not None:
        rest, expert = f"{e.group('head')}.experts.{e.group('rest')}", int(e.group("expert"))
    else:
        g = _GROUPED_EXPERT.fullmatch(rest)
        if g is not None:
            rest = f"{g.group('head')}.experts.{g.group('module')}.{g.group('param')}"
            expert, grouped = int(g.group("expert")), True
    if local_spec:
        rest = map_local_spec(rest)
    return LocalName(name, m.group("block"), int(m.group("layer")), expert, rest, grouped)


@dataclass(frozen=True)
class Split:
    """How a tensor is split over tensor parallelism: ``dim`` (None: replicated) and whether it is
    a GLU ``linear_fc1`` (``[gate_r; up_r]`` per rank)."""

    dim: int | None
    glu: bool = False


def _module(name: str) -> tuple[str, str]:
    head, _, param = name.rpartition(".")
    return head.rpartition(".")[2], param


def tp_split(name: str, ndim: int, gated: bool) -> Split | None:
    """How tensor ``name`` (a sharded key or local name; ``ndim`` dims, layer and expert axes not
    counted) is split over TP; None when the name is not one megatron-core's GPT layers use.
    ``gated``: the MLPs are GLUs (their ``linear_fc1`` holds gate and up halves)."""
    if _REPLICATED.fullmatch(name):
        return Split(None)
    module, param = _module(name)
    if module in ("word_embeddings",) and param == "weight":
        return Split(0)
    if module in COLUMN_PARALLEL and param in ("weight", "bias"):
        return Split(0, glu=gated and module == "linear_fc1")
    if module in ROW_PARALLEL:
        if param == "weight" and ndim == 2:
            return Split(1)
        if param == "bias":
            return Split(None)
    return None


def is_extra_state(name: str) -> bool:
    return name.endswith("." + EXTRA_STATE) or name == EXTRA_STATE


def unmap_local_spec(rest: str) -> str:
    """The inverse of :func:`map_local_spec`: TE's fused norm names back to the local spec's."""
    for old, new in LOCAL_SPEC_KEYS_MAP:
        if rest.startswith(new):
            return old + rest[len(new):]
    return rest


_STACKED_EXPERTS = re.compile(r"(?P<head>(?:.+\.)?experts)\.experts\.(?P<rest>.+)")


def local_rest(rest: str, expert: int | None, local_spec: bool, grouped: bool) -> str:
    """The name inside a layer a rank's state dict gives the sharded ``rest`` (its local expert
    ``expert``): the local spec's norm names, SequentialMLP's ``local_experts.<j>.`` or
    TEGroupedMLP's ``linear_fc1.weight<j>``."""
    if local_spec:
        rest = unmap_local_spec(rest)
    m = _STACKED_EXPERTS.fullmatch(rest)
    if m is None or expert is None:
        return rest
    if grouped:
        return f"{m.group('head')}.{m.group('rest')}{expert}"
    return f"{m.group('head')}.local_experts.{expert}.{m.group('rest')}"


def is_expert_key(key: str) -> bool:
    """Whether a sharded key holds routed experts (``...experts.experts.*``, an expert axis)."""
    return ".experts.experts." in f".{key}"
