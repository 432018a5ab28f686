"""Key maps between a training framework's parameter names and Hugging Face names, as data.

A map is a table in torchtitan's state-dict-adapter style, HF name -> native name, with ``{}``
standing for a layer (or expert) number and ``None`` dropping the HF key on import::

    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight"

The export direction (native -> HF) is derived from it by :meth:`KeyMap.exporter`; ``drop``
lists native names left out on export. ``transforms`` names native tensors whose rows must be
permuted between the layouts: ``"rope:<config field>"`` is the q/k permutation between
interleaved RoPE (torchtitan, Meta) and HF's rotate-half, per head, with the head count read from
``config.json`` field ``<config field>``.

Mixture-of-experts maps also have ``experts``: HF template with two ``{}`` (layer, expert) -> the
native template of the grouped tensor ``[num_experts, ...]`` with one (layer), e.g.
``"model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w1_EFD"``:
export writes expert ``e`` of the native tensor as its own HF tensor (the slice ``[e]``), import
stacks the HF experts ``0..E-1`` back (torchtitan's ``MoEStateDictAdapter`` split / ``torch.stack``).

Map files (``--map FILE``) are JSON: either the table itself, or ``{"map": {...}, "drop": [...],
"transforms": {...}, "experts": {...}}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import ConfigError

DROP = None
_MAX_LISTED = 10


# ---------------------------------------------------------------------------------------------
# templates


@dataclass(frozen=True)
class Template:
    """A name with ``{}`` placeholders, each matching one dot-free run of digits."""

    text: str

    @property
    def holes(self) -> int:
        return self.text.count("{}")

    def regex(self) -> re.Pattern[str]:
        return re.compile(r"(\d+)".join(map(re.escape, self.text.split("{}"))))

    def fill(self, values: Sequence[str]) -> str:
        parts = self.text.split("{}")
        out = [parts[0]]
        for v, p in zip(values, parts[1:]):
            out += [v, p]
        return "".join(out)


class Renamer:
    """Renames keys by a table of templates: exact entries first, then templates in table order.

    ``rename(key)`` returns the new name, ``None`` when the table drops the key, or raises
    ``KeyError`` when no entry matches.
    """

    def __init__(self, table: Mapping[str, str | None]) -> None:
        self._exact: dict[str, str | None] = {}
        self._patterns: list[tuple[re.Pattern[str], Template | None]] = []
        for src, dst in table.items():
            s = Template(src)
            d = None if dst is None else Template(dst)
            if d is not None and d.holes != s.holes:
                raise ConfigError(f"key map entry {src!r} -> {dst!r}: both sides need the same number of '{{}}'")
            if s.holes == 0:
                self._exact[src] = dst
            else:
                self._patterns.append((s.regex(), d))

    def rename(self, key: str) -> str | None:
        if key in self._exact:
            return self._exact[key]
        for rx, dst in self._patterns:
            m = rx.fullmatch(key)
            if m:
                return None if dst is None else dst.fill(m.groups())
        raise KeyError(key)


def _listing(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_MAX_LISTED])
    return shown + (f" and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else "")


def rename_all(keys: Iterable[str], renamer: Renamer | None, map_name: str, direction: str) -> dict[str, str]:
    """key -> new name for every kept key (dropped keys left out), in ``keys`` order.

    Raises ConfigError listing every key the map leaves unmapped, or two keys given one name.
    ``renamer`` None is the identity.
    """
    out: dict[str, str] = {}
    unmapped: list[str] = []
    for key in keys:
        if renamer is None:
            out[key] = key
            continue
        try:
            new = renamer.rename(key)
        except KeyError:
            unmapped.append(key)
            continue
        if new is not None:
            out[key] = new
    if unmapped:
        raise ConfigError(
            f"key map {map_name!r} ({direction}) leaves {len(unmapped)} key(s) unmapped: {_listing(unmapped)}; "
            "add them to the map (null drops a key) or use --map identity"
        )
    seen: dict[str, str] = {}
    for key, new in out.items():
        if new in seen:
            raise ConfigError(f"key map {map_name!r} ({direction}) gives {seen[new]!r} and {key!r} the same name {new!r}; fix the map")
        seen[new] = key
    return out


# ---------------------------------------------------------------------------------------------
# maps


@dataclass(frozen=True)
class KeyMap:
    """A named HF <-> native key map (see the module docstring)."""

    name: str
    from_hf: Mapping[str, str | None] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    transforms: Mapping[str, str] = field(default_factory=dict)
    identity: bool = False
    #: extra native -> HF names accepted on export only (another framework version's names)
    export_aliases: Mapping[str, str] = field(default_factory=dict)
    #: fused native tensors split on export: template -> the native names of its parts (in order)
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: import-hf refuses the map (its native names need fusing or stacking the import cannot do)
    export_only: bool = False
    #: grouped experts: HF template (layer, expert) -> native template (layer) of ``[E, ...]``
    experts: Mapping[str, str] = field(default_factory=dict)
    #: native templates exported transposed (2-D ``Linear`` ``[out, in]`` -> HF ``Conv1D`` ``[in, out]``)
    transposed: tuple[str, ...] = ()
    #: native templates of a fused qkv (weight or bias) kept whole on export, its rows regrouped
    #: from per query group (``[q heads of the group, k, v]``) to ``[all q; all k; all v]``
    regroup_qkv: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for hf, native in self.experts.items():
            if Template(hf).holes != Template(native).holes + 1:
                raise ConfigError(f"key map {self.name!r}: experts entry {hf!r} -> {native!r} needs one more '{{}}' on "
                                  "the HF side (the expert number)")

    def expert_names(self, native_key: str, count: int) -> list[str] | None:
        """The HF names of the ``count`` experts of grouped native tensor ``native_key`` (None: not
        a grouped-experts tensor of this map)."""
        for hf, native in self.experts.items():
            m = Template(native).regex().fullmatch(native_key)
            if m:
                return [Template(hf).fill((*m.groups(), str(e))) for e in range(count)]
        return None

    def expert_of(self, hf_key: str) -> tuple[str, int] | None:
        """(grouped native name, expert number) of an HF expert tensor, or None."""
        for hf, native in self.experts.items():
            m = Template(hf).regex().fullmatch(hf_key)
            if m:
                *outer, expert = m.groups()
                return Template(native).fill(outer), int(expert)
        return None

    def importer(self) -> Renamer | None:
        """HF name -> native name (None: identity)."""
        return None if self.identity else Renamer(self.from_hf)

    def export_table(self) -> dict[str, str | None]:
        """The derived native -> HF table (drops included)."""
        table: dict[str, str | None] = {}
        for hf, native in self.from_hf.items():
            if native is None:
                continue
            if native in table:
                raise ConfigError(f"key map {self.name!r}: {native!r} is the target of two HF names; the map cannot be inverted")
            table[native] = hf
        for native, hf in self.export_aliases.items():
            table.setdefault(native, hf)
        for native in self.drop:
            table.setdefault(native, None)
        return table

    def fused_parts(self, native_key: str) -> tuple[str, ...] | None:
        """The native names a fused tensor splits into on export (None: not fused)."""
        for pattern, parts in self.fused.items():
            m = Template(pattern).regex().fullmatch(native_key)
            if m:
                return tuple(Template(p).fill(m.groups()) for p in parts)
        return None

    def exporter(self) -> Renamer | None:
        """Native name -> HF name (None: identity)."""
        if self.identity:
            return _DropOnly(self.drop) if self.drop else None
        return Renamer(self.export_table())

    def is_transposed(self, native_key: str) -> bool:
        """Whether the map exports ``native_key`` transposed."""
        return any(Template(p).regex().fullmatch(native_key) for p in self.transposed)

    def regroups_qkv(self, native_key: str) -> bool:
        """Whether ``native_key`` is a fused qkv whose rows the map regroups to ``[q; k; v]``."""
        return any(Template(p).regex().fullmatch(native_key) for p in self.regroup_qkv)

    def transform_of(self, native_key: str) -> str | None:
        """The row transform of a native key (``"rope:<field>"``) or None."""
        for pattern, transform in self.transforms.items():
            if Template(pattern).regex().fullmatch(native_key):
                return transform
        return None


class _DropOnly(Renamer):
    """Identity except for dropped keys."""

    def __init__(self, drop: Sequence[str]) -> None:
        super().__init__({d: None for d in drop})

    def rename(self, key: str) -> str | None:
        try:
            return super().rename(key)
        except KeyError:
            return key


_L = "layers.{}."
_QKV = _L + "attention.qkv_linear."
#: torchtitan 0.3.0's Llama names (its Llama3StateDictAdapter): the model's save hook writes the fused
#: ``qkv_linear.wqkv`` as ``qkv_linear.wq/wk/wv``; the output projection is ``lm_head``.
_TITAN_030_EXPORT = {
    _QKV + "wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    _QKV + "wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    _QKV + "wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "lm_head.weight": "lm_head.weight",
}
_TITAN_OLD_EXPORT = {
    _L + "attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    _L + "attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    _L + "attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "output.weight": "lm_head.weight",
}
_ROPE = {
    _L + "attention.wq.weight": "rope:num_attention_heads",
    _L + "attention.wk.weight": "rope:num_key_value_heads",
    _QKV + "wq.weight": "rope:num_attention_heads",
    _QKV + "wk.weight": "rope:num_key_value_heads",
}
_FUSED = {_QKV + "wqkv.weight": (_QKV + "wq.weight", _QKV + "wk.weight", _QKV + "wv.weight")}
TORCHTITAN_LLAMA = KeyMap(
    "torchtitan-llama",
    from_hf={
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.layers.{}.self_attn.q_proj.weight": _L + "attention.wq.weight",
        "model.layers.{}.self_attn.k_proj.weight": _L + "attention.wk.weight",
        "model.layers.{}.self_attn.v_proj.weight": _L + "attention.wv.weight",
        "model.layers.{}.self_attn.o_proj.weight": _L + "attention.wo.weight",
        "model.layers.{}.self_attn.rotary_emb.inv_freq": DROP,
        "model.layers.{}.mlp.gate_proj.weight": _L + "feed_forward.w1.weight",
        "model.layers.{}.mlp.up_proj.weight": _L + "feed_forward.w3.weight",
        "model.layers.{}.mlp.down_proj.weight": _L + "feed_forward.w2.weight",
        "model.layers.{}.input_layernorm.weight": _L + "attention_norm.weight",
        "model.layers.{}.post_attention_layernorm.weight": _L + "ffn_norm.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    },
    drop=("freqs_cis",),
    transforms=_ROPE,
    export_aliases=_TITAN_030_EXPORT,
    fused=_FUSED,
)
#: torchtitan 0.3.0's own adapter table both ways (import-hf writes the names 0.3.0 loads); the export
#: also takes the older names.
TORCHTITAN_LLAMA3 = KeyMap(
    "torchtitan-llama3",
    from_hf={
        **{k: v for k, v in TORCHTITAN_LLAMA.from_hf.items() if v not in _TITAN_OLD_EXPORT},
        **{hf: native for native, hf in _TITAN_030_EXPORT.items()},
    },
    drop=("freqs_cis",),
    transforms=_ROPE,
    export_aliases=_TITAN_OLD_EXPORT,
    fused=_FUSED,
)
_MOE = _L + "moe."
_EXPERTS = _MOE + "routed_experts.inner_experts."
_HF = "model.layers.{}."
#: Grouped routed experts of torchtitan 0.3.0's MoE models (its deepseek_v3 / qwen3 adapters).
_TITAN_EXPERTS = {
    _HF + "mlp.experts.{}.gate_proj.weight": _EXPERTS + "w1_EFD",
    _HF + "mlp.experts.{}.up_proj.weight": _EXPERTS + "w3_EFD",
    _HF + "mlp.experts.{}.down_proj.weight": _EXPERTS + "w2_EDF",
}
_TITAN_MOE_COMMON = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    _HF + "self_attn.o_proj.weight": _L + "attention.wo.weight",
    _HF + "mlp.gate_proj.weight": _L + "feed_forward.w1.weight",
    _HF + "mlp.up_proj.weight": _L + "feed_forward.w3.weight",
    _HF + "mlp.down_proj.weight": _L + "feed_forward.w2.weight",
    _HF + "input_layernorm.weight": _L + "attention_norm.weight",
    _HF + "post_attention_layernorm.weight": _L + "ffn_norm.weight",
    _HF + "mlp.gate.weight": _MOE + "router.gate.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
#: torchtitan 0.3.0's DeepSeekV3StateDictAdapter (MLA with or without q LoRA; shared experts; the
#: load-balancing ``expert_bias_E`` as ``e_score_correction_bias``). MTP layers (``mtp_layers.N``,
#: HF ``layers.<n_layers + N>``) are not mapped.
TORCHTITAN_DEEPSEEK_V3 = KeyMap(
    "torchtitan-deepseek-v3",
    from_hf={
        **_TITAN_MOE_COMMON,
        _HF + "self_attn.q_proj.weight": _L + "attention.wq.weight",
        _HF + "self_attn.q_a_proj.weight": _L + "attention.wq_a.weight",
        _HF + "self_attn.q_a_layernorm.weight": _L + "attention.q_norm.weight",
        _HF + "self_attn.q_b_proj.weight": _L + "attention.wq_b.weight",
        _HF + "self_attn.kv_a_proj_with_mqa.weight": _L + "attention.wkv_a.weight",
        _HF + "self_attn.kv_a_layernorm.weight": _L + "attention.kv_norm.weight",
        _HF + "self_attn.kv_b_proj.weight": _L + "attention.wkv_b.weight",
        _HF + "mlp.shared_experts.gate_proj.weight": _MOE + "shared_experts.w1.weight",
        _HF + "mlp.shared_experts.up_proj.weight": _MOE + "shared_experts.w3.weight",
        _HF + "mlp.shared_experts.down_proj.weight": _MOE + "shared_experts.w2.weight",
        _HF + "mlp.gate.e_score_correction_bias": _MOE + "expert_bias_E",
    },
    experts=_TITAN_EXPERTS,
)
#: torchtitan 0.3.0's Qwen3StateDictAdapter (dense and MoE flavors): the save hook's unfused
#: ``qkv_linear.wq/wk/wv`` (a fused ``wqkv`` is split on export), q/k norms, router; its adapter
#: writes no ``expert_bias_E`` (dropped on export, as there).
TORCHTITAN_QWEN3 = KeyMap(
    "torchtitan-qwen3",
    from_hf={
        **_TITAN_MOE_COMMON,
        _HF + "self_attn.q_proj.weight": _QKV + "wq.weight",
        _HF + "self_attn.k_proj.weight": _QKV + "wk.weight",
        _HF + "self_attn.v_proj.weight": _QKV + "wv.weight",
        _HF + "self_attn.q_norm.weight": _L + "attention.q_norm.weight",
        _HF + "self_attn.k_norm.weight": _L + "attention.k_norm.weight",
        _HF + "self_attn.rotary_emb.inv_freq": DROP,
    },
    drop=(_MOE + "expert_bias_E",),
    fused=_FUSED,
    experts=_TITAN_EXPERTS,
)
_ML = "decoder.layers.{}."
_MQKV = _ML + "self_attention.linear_qkv."
_MFC1 = _ML + "mlp.linear_fc1."
#: Megatron-core GPT (local or Transformer Engine layer spec: the checkpoint uses TE's names either way)
#: with Llama's architecture (RMSNorm, SwiGLU, RoPE rotate-half, no biases) -> HF Llama. Layer-stacked
#: tensors (``decoder.layers.<name>``, shape (L, ...)) are unstacked into ``decoder.layers.<i>.<name>``
#: first (:mod:`converter.plan.megatron`). ``linear_qkv`` splits per query group
#: (``[q heads of the group, k, v]``, :func:`fused_qkv_rows`), ``linear_fc1`` into its ``[gate; up]``
#: halves. Megatron's RoPE is rotate-half already: no row permutation.
MEGATRON_LLAMA = KeyMap(
    "megatron-llama",
    from_hf={
        "model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.layers.{}.input_layernorm.weight": _MQKV + "layer_norm_weight",
        "model.layers.{}.self_attn.q_proj.weight": _MQKV + "q.weight",
        "model.layers.{}.self_attn.k_proj.weight": _MQKV + "k.weight",
        "model.layers.{}.self_attn.v_proj.weight": _MQKV + "v.weight",
        "model.layers.{}.self_attn.o_proj.weight": _ML + "self_attention.linear_proj.weight",
        "model.layers.{}.post_attention_layernorm.weight": _MFC1 + "layer_norm_weight",
        "model.layers.{}.mlp.gate_proj.weight": _MFC1 + "gate.weight",
        "model.layers.{}.mlp.up_proj.weight": _MFC1 + "up.weight",
        "model.layers.{}.mlp.down_proj.weight": _ML + "mlp.linear_fc2.weight",
        "model.norm.weight": "decoder.final_layernorm.weight",
        "lm_head.weight": "output_layer.weight",
    },
    # the local spec's own names, where a checkpoint keeps them (no TE-style remapping)
    export_aliases={
        _ML + "input_layernorm.weight": "model.layers.{}.input_layernorm.weight",
        _ML + "pre_mlp_layernorm.weight": "model.layers.{}.post_attention_layernorm.weight",
    },
    fused={
        _MQKV + "weight": (_MQKV + "q.weight", _MQKV + "k.weight", _MQKV + "v.weight"),
        _MFC1 + "weight": (_MFC1 + "gate.weight", _MFC1 + "up.weight"),
    },
    export_only=True,
)
_MPROJ = _ML + "self_attention.linear_proj."
_MFC2 = _ML + "mlp.linear_fc2."
_GH = "transformer.h.{}."
#: Megatron-core GPT built GPT-2 style (learned absolute position embeddings, LayerNorm with bias,
#: GELU MLP without gating, biases in the linear layers) -> HF GPT-2 (``GPT2LMHeadModel``). HF's
#: ``Conv1D`` weights are ``[in, out]``: the four linear weights are exported transposed; the fused
#: ``linear_qkv`` (weight and bias) stays whole as ``c_attn``, its rows regrouped from per head
#: (``[q_h, k_h, v_h]``, :func:`fused_qkv_rows`) to ``[all q; all k; all v]``. An untied
#: ``output_layer`` becomes ``lm_head.weight`` (``tie_word_embeddings`` false in the config).
MEGATRON_GPT2 = KeyMap(
    "megatron-gpt2",
    from_hf={
        "transformer.wte.weight": "embedding.word_embeddings.weight",
        "transformer.wpe.weight": "embedding.position_embeddings.weight",
        _GH + "ln_1.weight": _MQKV + "layer_norm_weight",
        _GH + "ln_1.bias": _MQKV + "layer_norm_bias",
        _GH + "attn.c_attn.weight": _MQKV + "weight",
        _GH + "attn.c_attn.bias": _MQKV + "bias",
        _GH + "attn.c_proj.weight": _MPROJ + "weight",
        _GH + "attn.c_proj.bias": _MPROJ + "bias",
        _GH + "ln_2.weight": _MFC1 + "layer_norm_weight",
        _GH + "ln_2.bias": _MFC1 + "layer_norm_bias",
        _GH + "mlp.c_fc.weight": _MFC1 + "weight",
        _GH + "mlp.c_fc.bias": _MFC1 + "bias",
        _GH + "mlp.c_proj.weight": _MFC2 + "weight",
        _GH + "mlp.c_proj.bias": _MFC2 + "bias",
        "transformer.ln_f.weight": "decoder.final_layernorm.weight",
        "transformer.ln_f.bias": "decoder.final_layernorm.bias",
        "lm_head.weight": "output_layer.weight",
    },
    export_aliases={
        _ML + "input_layernorm.weight": _GH + "ln_1.weight",
        _ML + "input_layernorm.bias": _GH + "ln_1.bias",
        _ML + "pre_mlp_layernorm.weight": _GH + "ln_2.weight",
        _ML + "pre_mlp_layernorm.bias": _GH + "ln_2.bias",
    },
    transposed=(_MQKV + "weight", _MPROJ + "weight", _MFC1 + "weight", _MFC2 + "weight"),
    regroup_qkv=(_MQKV + "weight", _MQKV + "bias"),
    export_only=True,
)
_MEXP = _ML + "mlp.experts.experts."
_MHF = "model.layers.{}.block_sparse_moe."
#: Megatron-core GPT with MoE layers (SequentialMLP or TEGroupedMLP experts, top-k router, SwiGLU
#: experts, no shared experts) -> HF Mixtral (``MixtralForCausalLM``). The experts are stacked on
#: the layer and expert axes (``decoder.layers.mlp.experts.experts.*``, ``(L, E, ...)``): each HF
#: expert tensor reads one (layer, expert) slice, ``linear_fc1``'s ``[gate; up]`` halves as ``w1`` /
#: ``w3``. megatron's router (top-k of the logits, softmax over them) is Mixtral's (softmax, top-k,
#: renormalised). The norm before the MoE layer: ``pre_mlp_layernorm`` (TE spec) or, in the local
#: spec's sharded names, ``mlp.linear_fc1.layer_norm_weight``.
MEGATRON_MIXTRAL = KeyMap(
    "megatron-mixtral",
    from_hf={
        "model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.layers.{}.input_layernorm.weight": _MQKV + "layer_norm_weight",
        "model.layers.{}.self_attn.q_proj.weight": _MQKV + "q.weight",
        "model.layers.{}.self_attn.k_proj.weight": _MQKV + "k.weight",
        "model.layers.{}.self_attn.v_proj.weight": _MQKV + "v.weight",
        "model.layers.{}.self_attn.o_proj.weight": _ML + "self_attention.linear_proj.weight",
        "model.layers.{}.post_attention_layernorm.weight": _ML + "pre_mlp_layernorm.weight",
        _MHF + "gate.weight": _ML + "mlp.router.weight",
        "model.norm.weight": "decoder.final_layernorm.weight",
        "lm_head.weight": "output_layer.weight",
    },
    export_aliases={
        _ML + "input_layernorm.weight": "model.layers.{}.input_layernorm.weight",
        _MFC1 + "layer_norm_weight": "model.layers.{}.post_attention_layernorm.weight",
    },
    fused={
        _MQKV + "weight": (_MQKV + "q.weight", _MQKV + "k.weight", _MQKV + "v.weight"),
        _MEXP + "linear_fc1.weight": (_MEXP + "linear_fc1.gate.weight", _MEXP + "linear_fc1.up.weight"),
    },
    experts={
        _MHF + "experts.{}.w1.weight": _MEXP + "linear_fc1.gate.weight",
        _MHF + "experts.{}.w3.weight": _MEXP + "linear_fc1.up.weight",
        _MHF + "experts.{}.w2.weight": _MEXP + "linear_fc2.weight",
    },
    export_only=True,
)
IDENTITY = KeyMap("identity", identity=True)
BUILTIN_MAPS: dict[str, KeyMap] = {m.name: m for m in (IDENTITY, TORCHTITAN_LLAMA, TORCHTITAN_LLAMA3,
                                                        TORCHTITAN_DEEPSEEK_V3, TORCHTITAN_QWEN3, MEGATRON_LLAMA,
                                                        MEGATRON_GPT2, MEGATRON_MIXTRAL)}


def get_key_map(name_or_path: Any) -> Any:
    """The one resolution of ``--map NAME|FILE|torchtitan:MODEL[/FLAVOR]`` (every command that
    renames calls it): a built-in :class:`KeyMap` (``identity``, ``torchtitan-llama``, ...), a JSON
    map file, or torchtitan's own state-dict adapter
    (:class:`converter.plan.adapter_maps.AdapterMap`, whose names and rearrangements come from
    the adapter run on the checkpoint's shapes)."""
    if name_or_path is None:
        return IDENTITY
    if isinstance(name_or_path, KeyMap) or type(name_or_path).__name__ == "AdapterMap":
        return name_or_path
    if isinstance(name_or_path, str) and name_or_path.startswith("torchtitan:"):
        from converter.plan.adapter_maps import AdapterMap

        return AdapterMap(name_or_path)
    if name_or_path in BUILTIN_MAPS:
        return BUILTIN_MAPS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"--map {name_or_path!r}: not a built-in map ({', '.join(BUILTIN_MAPS)}) nor a map file")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: map file is not JSON ({e}); see 'ckptconv export-hf --help'") from None
    return key_map_from_doc(doc, str(path))


def _str_map(doc: Any, where: str, what: str, allow_null: bool) -> dict[str, str | None]:
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: {what} must be a JSON object")
    for k, v in doc.items():
        if not (isinstance(v, str) or (allow_null and v is None)):
            raise ConfigError(f"{where}: {what} entry {k!r} must map to a string{' or null' if allow_null else ''}")
    return dict(doc)


def key_map_from_doc(doc: Any, where: str = "map") -> KeyMap:
    """A :class:`KeyMap` from a parsed map file (the table, or {"map", "drop", "transforms"})."""
    if isinstance(doc, dict) and isinstance(doc.get("map"), dict):
        extra = set(doc) - {"map", "drop", "transforms", "experts"}
        if extra:
            raise ConfigError(f"{where}: unknown map file field(s) {sorted(extra)}; allowed: map, drop, transforms, experts")
        table = _str_map(doc["map"], where, "\"map\"", True)
        drop = doc.get("drop", [])
        if not isinstance(drop, list) or not all(isinstance(d, str) for d in drop):
            raise ConfigError(f"{where}: \"drop\" must be a list of native key names")
        transforms = _str_map(doc.get("transforms", {}), where, "\"transforms\"", False)
        for k, t in transforms.items():
            parse_transform(t, f"{where}: transform of {k!r}")
        experts = _str_map(doc.get("experts", {}), where, "\"experts\"", False)
        km = KeyMap(where, table, tuple(drop), transforms, experts=experts)
    else:
        km = KeyMap(where, _str_map(doc, where, "the map", True))
    km.export_table()  # invertible?
    Renamer(km.from_hf)
    return km


# ---------------------------------------------------------------------------------------------
# row transforms


def parse_transform(text: str, where: str) -> tuple[str, str]:
    """``"rope:<config field>"`` -> ("rope", field)."""
    kind, _, arg = text.partition(":")
    if kind != "rope" or not arg:
        raise ConfigError(f"{where}: unknown transform {text!r}; the only one is 'rope:<config field with the head count>'")
    return kind, arg


def rope_permutation(rows: int, n_heads: int, to_hf: bool, key: str = "") -> np.ndarray:
    """Row permutation ``p`` (numpy int64, length ``rows``): target row ``t`` takes source row ``p[t]``.

    ``to_hf``: interleaved RoPE pairs (torchtitan / Meta) -> HF rotate-half halves, exactly
    ``w.view(n_heads, hd // 2, 2, dim).transpose(1, 2).reshape(rows, dim)`` of HF's
    ``convert_llama_weights_to_hf``; otherwise its inverse.
    """
    if n_heads <= 0 or rows % n_heads or (rows // n_heads) % 2:
        raise ConfigError(
            f"{key or 'tensor'}: {rows} rows cannot be split into {n_heads} heads of even size; "
            "check num_attention_heads / num_key_value_heads in the config"
        )
    hd = rows // n_heads
    idx = np.arange(rows, dtype=np.int64)
    if to_hf:
        return idx.reshape(n_heads, hd // 2, 2).transpose(0, 2, 1).reshape(-1)
    return idx.reshape(n_heads, 2, hd // 2).transpose(0, 2, 1).reshape(-1)


def heads_for(field_name: str, config: Mapping[str, Any] | None, map_name: str, key: str) -> int:
    """The head count a transform needs, from ``config`` (HF semantics: KV heads default to the
    attention heads)."""
    config = config or {}
    value = config.get(field_name)
    if value is None and field_name == "num_key_value_heads":
        value = config.get("num_attention_heads")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(
            f"key map {map_name!r} permutes the rows of {key!r} per head and needs {field_name!r}: pass "
            f"--config config.json (or inline JSON, e.g. '{{\"num_attention_heads\": 32, \"num_key_value_heads\": 8}}')"
        )
    return value


# ---------------------------------------------------------------------------------------------
# config.json for the built-in Llama map


def llama_config(shapes: Mapping[str, Sequence[int]], given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` completed with what the torchtitan-llama weights' shapes say (HF LlamaConfig
    names); a given value that contradicts the shapes is an error."""
    cfg = dict(given)
    derived: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    emb = shapes.get("tok_embeddings.weight")
    if emb is not None:
        derived["vocab_size"], derived["hidden_size"] = int(emb[0]), int(emb[1])
    layers = {k.split(".")[1] for k in shapes if k.startswith("layers.")}
    if layers:
        derived["num_hidden_layers"] = len(layers)
    w1 = shapes.get("layers.0.feed_forward.w1.weight")
    if w1 is not None:
        derived["intermediate_size"] = int(w1[0])
    derived["tie_word_embeddings"] = "output.weight" not in shapes and "lm_head.weight" not in shapes
    wq = shapes.get("layers.0.attention.wq.weight") or shapes.get("layers.0.attention.qkv_linear.wq.weight")
    wk = shapes.get("layers.0.attention.wk.weight") or shapes.get("layers.0.attention.qkv_linear.wk.weight")
    n_heads = cfg.get("num_attention_heads")
    if isinstance(n_heads, int) and wq is not None and wk is not None and n_heads > 0:
        head_dim = cfg.get("head_dim") or int(wq[0]) // n_heads
        if head_dim and int(wk[0]) % head_dim == 0:
            derived["num_key_value_heads"] = int(wk[0]) // head_dim
    for name, value in derived.items():
        if name in cfg and cfg[name] != value and name not in ("architectures",):
            raise ConfigError(f"config.json says {name}={cfg[name]!r} but the weights give {value!r}; fix the config")
        cfg.setdefault(name, value)
    return cfg


def megatron_llama_config(shapes: Mapping[str, Sequence[int]], given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` completed with what the megatron-llama weights' shapes say (HF LlamaConfig names,
    per-layer part shapes); a given value that contradicts the shapes is an error."""
    cfg = dict(given)
    derived: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    emb = shapes.get("embedding.word_embeddings.weight")
    if emb is not None:
        derived["vocab_size"], derived["hidden_size"] = int(emb[0]), int(emb[1])
    layers = {k.split(".")[2] for k in shapes if k.startswith("decoder.layers.") and k.split(".")[2].isdigit()}
    if layers:
        derived["num_hidden_layers"] = len(layers)
    gate = shapes.get(_MFC1.format(0) + "gate.weight")
    if gate is not None:
        derived["intermediate_size"] = int(gate[0])
    derived["tie_word_embeddings"] = "output_layer.weight" not in shapes
    q, k = shapes.get(_MQKV.format(0) + "q.weight"), shapes.get(_MQKV.format(0) + "k.weight")
    n_heads = cfg.get("num_attention_heads")
    if isinstance(n_heads, int) and n_heads > 0 and q is not None and k is not None:
        head_dim = int(q[0]) // n_heads
        if head_dim and int(k[0]) % head_dim == 0:
            derived["num_key_value_heads"] = int(k[0]) // head_dim
        if cfg.get("hidden_size", derived.get("hidden_size")) != int(q[0]):
            derived["head_dim"] = head_dim
    for name, value in derived.items():
        if name in cfg and cfg[name] != value and name not in ("architectures",):
            raise ConfigError(f"config.json says {name}={cfg[name]!r} but the weights give {value!r}; fix the config")
        cfg.setdefault(name, value)
    return cfg


def megatron_mixtral_config(shapes: Mapping[str, Sequence[int]], given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` completed with what the megatron-mixtral weights' shapes say (HF MixtralConfig
    names: the Llama fields, ``num_local_experts``, ``intermediate_size`` of one expert)."""
    cfg = megatron_llama_config(shapes, {k: v for k, v in given.items() if k not in ("architectures", "model_type")})
    cfg["architectures"], cfg["model_type"] = ["MixtralForCausalLM"], "mixtral"
    gate = shapes.get(_MEXP.format(0) + "linear_fc1.gate.weight")
    if gate is not None:
        derived = {"num_local_experts": int(gate[0]), "intermediate_size": int(gate[1])}
        for name, value in derived.items():
            if name in given and given[name] != value:
                raise ConfigError(f"config.json says {name}={given[name]!r} but the weights give {value!r}; fix the config")
            cfg[name] = value
    return cfg


def megatron_moe_args_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`megatron_args_config` and the router's ``num_experts_per_tok`` (``moe_router_topk``)."""
    out = megatron_args_config(args)
    topk = args.get("moe_router_topk")
    if isinstance(topk, int) and not isinstance(topk, bool):
        out["num_experts_per_tok"] = topk
    return out


def megatron_args_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """HF config fields from Megatron's training arguments (``vars(args)`` of the checkpoint's
    ``argparse.Namespace``): head counts first (the fused ``linear_qkv`` split needs them)."""
    out: dict[str, Any] = {}

    def take(hf: str, value: Any, kind: type | tuple = int) -> None:
        if isinstance(value, kind) and not isinstance(value, bool):
            out[hf] = value

    take("num_attention_heads", args.get("num_attention_heads"))
    groups = args.get("num_query_groups")
    if args.get("group_query_attention", True) is not False and isinstance(groups, int):
        take("num_key_value_heads", groups)
    else:
        take("num_key_value_heads", args.get("num_attention_heads"))
    take("head_dim", args.get("kv_channels"))
    take("rms_norm_eps", args.get("norm_epsilon"), float)
    take("rope_theta", args.get("rotary_base"), (int, float))
    take("max_position_embeddings", args.get("max_position_embeddings"))
    return out


def megatron_gpt2_args_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """HF GPT2Config fields from Megatron's training arguments (``vars(args)``): ``n_head``,
    ``n_positions``, ``layer_norm_epsilon``, ``activation_function`` (Megatron's ``openai_gelu`` is
    HF's ``gelu_new``, else exact ``gelu``). HF GPT-2 has no grouped-query attention: a GQA
    checkpoint is refused."""
    out: dict[str, Any] = {}
    heads, groups = args.get("num_attention_heads"), args.get("num_query_groups")
    if isinstance(heads, int) and not isinstance(heads, bool):
        out["n_head"] = heads
        if args.get("group_query_attention") and isinstance(groups, int) and groups != heads:
            raise ConfigError(f"the checkpoint uses grouped-query attention ({heads} heads, {groups} query groups); "
                              "HF GPT-2 has none: use --map megatron-llama or a map file")
    if isinstance(args.get("max_position_embeddings"), int):
        out["n_positions"] = args["max_position_embeddings"]
    if isinstance(args.get("norm_epsilon"), float):
        out["layer_norm_epsilon"] = args["norm_epsilon"]
    if "openai_gelu" in args or "swiglu" in args:
        out["activation_function"] = "gelu_new" if args.get("openai_gelu") else "gelu"
    return out


def megatron_gpt2_config(shapes: Mapping[str, Sequence[int]], given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` completed with what the megatron-gpt2 weights' shapes say (HF GPT2Config names:
    ``vocab_size``, ``n_embd``, ``n_positions``, ``n_layer``, ``n_inner``, ``tie_word_embeddings``);
    a given value that contradicts the shapes is an error. ``activation_function`` defaults to
    ``gelu`` (megatron-core's default, exact erf GELU; HF GPT-2's own default is ``gelu_new``)."""
    derived: dict[str, Any] = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    emb = shapes.get("embedding.word_embeddings.weight")
    if emb is not None:
        derived["vocab_size"], derived["n_embd"] = int(emb[0]), int(emb[1])
    pos = shapes.get("embedding.position_embeddings.weight")
    if pos is not None:
        derived["n_positions"] = int(pos[0])
    layers = {k.split(".")[2] for k in shapes if k.startswith("decoder.layers.") and k.split(".")[2].isdigit()}
    if layers:
        derived["n_layer"] = len(layers)
    fc1 = shapes.get(_MFC1.format(min(layers, key=int) if layers else 0) + "weight")
    if fc1 is not None:
        derived["n_inner"] = int(fc1[0])
    derived["tie_word_embeddings"] = "output_layer.weight" not in shapes
    cfg = _merge_derived(given, derived)
    cfg.setdefault("activation_function", "gelu")
    heads = cfg.get("n_head")
    if isinstance(heads, int) and isinstance(cfg.get("n_embd"), int) and (heads <= 0 or cfg["n_embd"] % heads):
        raise ConfigError(f"n_head={heads} does not divide n_embd={cfg['n_embd']}; fix the config")
    return cfg


#: Megatron maps: (the HF config from the checkpoint's ``args``, the config field naming the heads)
MEGATRON_ARGS_CONFIG = {"megatron-llama": (megatron_args_config, "num_attention_heads"),
                        "megatron-mixtral": (megatron_moe_args_config, "num_attention_heads"),
                        "megatron-gpt2": (megatron_gpt2_args_config, "n_head")}


def _merge_derived(given: Mapping[str, Any], derived: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` completed with ``derived``; a given value the weights contradict is an error."""
    cfg = dict(given)
    for name, value in derived.items():
        if name in cfg and cfg[name] != value and name not in ("architectures", "model_type"):
            raise ConfigError(f"config.json says {name}={cfg[name]!r} but the weights give {value!r}; fix the config")
        cfg.setdefault(name, value)
    return cfg


def _layer_ids(shapes: Mapping[str, Sequence[int]]) -> list[int]:
    return sorted({int(k.split(".")[1]) for k in shapes if k.startswith("layers.") and k.split(".")[1].isdigit()})


def _first_moe(shapes: Mapping[str, Sequence[int]], suffix: str) -> Sequence[int] | None:
    for i in _layer_ids(shapes):
        hit = shapes.get(f"layers.{i}.{suffix}")
        if hit is not None:
            return hit
    return None


def _moe_common(shapes: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    derived: dict[str, Any] = {}
    emb = shapes.get("tok_embeddings.weight")
    if emb is not None:
        derived["vocab_size"], derived["hidden_size"] = int(emb[0]), int(emb[1])
    if _layer_ids(shapes):
        derived["num_hidden_layers"] = len(_layer_ids(shapes))
    derived["tie_word_embeddings"] = "lm_head.weight" not in shapes and "output.weight" not in shapes
    return derived


def qwen3_config(shapes: Mapping[str, Sequence[int]], given: Mapping[str, Any]) -> dict[str, Any]:
    """HF Qwen3 / Qwen3-MoE config fields the torchtitan qwen3 weights' shapes give (routing
    fields, RoPE theta and norm eps are not in the weights: pass them in ``--config``)."""
    derived = _moe_common(shapes)
    w1 = _first_moe(shapes, "moe.routed_experts.inner_experts.w1_EFD")
    moe = w1 is not None
    derived["architectures"] = ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    derived["model_type"] = "qwen3_moe" if moe else "qwen3"
    if moe:
        derived["num_experts"], derived["moe_intermediate_size"] = int(w1[0]), int(w1[1])
    dense = _first_moe(shapes, "feed_forward.w1.weight")
    if dense is not None:
        derived["intermediate_size"] = int(dense[0])
    q_norm, wq, wk = (_first_moe(shapes, f"attention.{n}.weight") for n in ("q_norm", "qkv_linear.wq", "qkv_linear.wk"))
    if q_norm is not None:
        hd = int(q_norm[0])
        derived["head_dim"] = hd
        if wq is not None and int(wq[0]) % hd == 0:
            derived["num_attention_heads"] = int(wq[0]) // hd
        if wk is not None and int(wk[0]) % hd == 0:
            derived["num_key_value_heads"] = int(wk[0]) // hd
    return _merge_derived(given, derived)


def deepseek_v3_config(shapes: Mapping[str, Sequence[int]], given: Mapping[str, Any]) -> dict[str, Any]:
    """HF DeepSeek-V3 config fields the torchtitan deepseek_v3 weights' shapes give; the per-head
    sizes need ``num_attention_heads`` in ``--config`` (routing, RoPE and norm fields always do)."""
    derived = _moe_common(shapes)
    derived["architectures"], derived["model_type"] = ["DeepseekV3ForCausalLM"], "deepseek_v3"
    w1 = _first_moe(shapes, "moe.routed_experts.inner_experts.w1_EFD")
    if w1 is not None:
        derived["n_routed_experts"], derived["moe_intermediate_size"] = int(w1[0]), int(w1[1])
        shared = _first_moe(shapes, "moe.shared_experts.w1.weight")
        if shared is not None and int(shared[0]) % int(w1[1]) == 0:
            derived["n_shared_experts"] = int(shared[0]) // int(w1[1])
        ids = _layer_ids(shapes)
        derived["first_k_dense_replace"] = next(
            (n for n, i in enumerate(ids) if f"layers.{i}.moe.routed_experts.inner_experts.w1_EFD" in shapes), len(ids))
    dense = _first_moe(shapes, "feed_forward.w1.weight")
    if dense is not None:
        derived["intermediate_size"] = int(dense[0])
    kv_norm, wkv_a = _first_moe(shapes, "attention.kv_norm.weight"), _first_moe(shapes, "attention.wkv_a.weight")
    if kv_norm is not None and wkv_a is not None:
        derived["kv_lora_rank"] = int(kv_norm[0])
        derived["qk_rope_head_dim"] = int(wkv_a[0]) - int(kv_norm[0])
    wq_a = _first_moe(shapes, "attention.wq_a.weight")
    derived["q_lora_rank"] = None if wq_a is None else int(wq_a[0])
    heads = given.get("num_attention_heads")
    wq = _first_moe(shapes, "attention.wq.weight") or _first_moe(shapes, "attention.wq_b.weight")
    wkv_b = _first_moe(shapes, "attention.wkv_b.weight")
    if isinstance(heads, int) and heads > 0 and wq is not None and wkv_b is not None and "qk_rope_head_dim" in derived:
        nope = int(wq[0]) // heads - derived["qk_rope_head_dim"]
        derived["qk_nope_head_dim"], derived["v_head_dim"] = nope, int(wkv_b[0]) // heads - nope
    return _merge_derived(given, derived)


CONFIG_FILLERS = {"torchtitan-llama": llama_config, "torchtitan-llama3": llama_config,
                  "megatron-llama": megatron_llama_config, "megatron-gpt2": megatron_gpt2_config,
                  "megatron-mixtral": megatron_mixtral_config,
                  "torchtitan-qwen3": qwen3_config,
                  "torchtitan-deepseek-v3": deepseek_v3_config}


def fused_halves_rows(rows: int, parts: int, key: str = "") -> tuple[np.ndarray, ...]:
    """The rows of each of ``parts`` equal blocks of a fused tensor (Megatron's GLU ``linear_fc1``:
    ``[gate; up]``)."""
    if rows % parts:
        raise ConfigError(f"{key or 'fused tensor'}: {rows} rows do not split into {parts} equal parts")
    n = rows // parts
    return tuple(np.arange(i * n, (i + 1) * n, dtype=np.int64) for i in range(parts))


def fused_qkv_rows(rows: int, n_heads: int, n_kv_heads: int, key: str = "") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of q, k and v in torchtitan's fused ``wqkv`` (``FusedQKVLinear``: rows grouped per KV
    head, ``[n_kv, n_heads / n_kv + 2, head_dim]``: the group's q heads, then its k, then its v)."""
    if n_kv_heads <= 0 or n_heads % n_kv_heads or rows % (n_kv_heads * (n_heads // n_kv_heads + 2)):
        raise ConfigError(
            f"{key or 'wqkv'}: {rows} fused rows do not split into {n_heads} q heads and {n_kv_heads} k/v heads; "
            "check num_attention_heads / num_key_value_heads in the config"
        )
    hpk = n_heads // n_kv_heads
    hd = rows // (n_kv_heads * (hpk + 2))
    idx = np.arange(rows, dtype=np.int64).reshape(n_kv_heads, hpk + 2, hd)
    return idx[:, :hpk].reshape(-1), idx[:, hpk].reshape(-1), idx[:, hpk + 1].reshape(-1)
