"""What export-hf writes, decided before any tensor byte is read (pure).

Model weights only (role "param" of :mod:`converter.plan.atoms`, the ``model.`` prefix
stripped), renamed by a key map, optionally cast; a fused tensor (torchtitan 0.3.0's ``wqkv``,
Megatron's ``linear_qkv`` / GLU ``linear_fc1``) is split into its parts by rows; grouped experts
and Megatron's layer-stacked tensors are sliced; the RoPE q/k rows are permuted as the map says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from converter.plan.adapter_maps import AdapterMap, source_of, unused_note
from converter.plan.atoms import group_atoms
from converter.plan.key_maps import CONFIG_FILLERS, KeyMap, fused_halves_rows, fused_qkv_rows, heads_for, rename_all
from converter.plan.megatron import stacked_layers, unstacked_name
from converter.plan.mapped_view import Source, row_permutation
from formats.base import CheckpointIndex
from formats.dtypes import CASTABLE_FLOATS
from formats.errors import InvalidCheckpointError
from formats.hf import TensorSpec

#: Source dtypes --dtype casts (float8 and integer tensors keep theirs).
CASTABLE = CASTABLE_FLOATS


def model_weights(index: CheckpointIndex) -> dict[str, str]:
    """Source key -> model FQN (prefix stripped) of every model weight, in index order."""
    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    refs, _ = group_atoms(paths)
    return {k: refs[k].atom for k in index.tensors if refs[k].role == "param"}


@dataclass(frozen=True)
class ExportPlan:
    """Everything an export writes, decided before any tensor byte is read."""

    sources: dict[str, Source]  # HF name -> source key (+ permutation)
    specs: tuple[TensorSpec, ...]  # HF tensors in source order, target dtypes
    config: dict[str, Any] | None
    warnings: tuple[str, ...] = ()


def plan_export(index: CheckpointIndex, kmap: KeyMap, dtype: str | None,
                config: Mapping[str, Any] | None) -> ExportPlan:
    """Pure: which source tensor becomes which HF tensor, with dtypes and permutations.

    With a key map other than ``identity``, Megatron's layer-stacked tensors export one tensor per
    layer (``decoder.layers.<i>.<name>``, read as the slice ``source[i]``)."""
    weights = model_weights(index)
    if not weights:
        raise InvalidCheckpointError(f"{index.root}: no model weights found (only optimizer / training state); nothing to export")
    if len(set(weights.values())) != len(weights):
        raise InvalidCheckpointError(f"{index.root}: two keys hold the same model weight; cannot export")
    if isinstance(kmap, AdapterMap):
        return _plan_adapter_export(index, weights, kmap, dtype, config)
    stacked = {} if kmap.identity else stacked_layers(index)
    fqn_src: dict[str, tuple[str, int | None]] = {}  # native name -> (source key, layer of a stacked tensor)
    for key, fqn in weights.items():
        if key in stacked:
            fqn_src |= {unstacked_name(fqn, i): (key, i) for i in range(stacked[key])}
        else:
            fqn_src[fqn] = (key, None)
    fqn_key = {fqn: key for fqn, (key, _) in fqn_src.items()}
    shapes = {fqn: tuple(index.tensors[k].shape)[0 if layer is None else 1:] for fqn, (k, layer) in fqn_src.items()}
    parts = _fused_parts(kmap, shapes)  # part fqn -> (fused fqn, part number)
    counts: dict[str, int] = {}  # fused fqn -> its number of parts
    for f, i in parts.values():
        counts[f] = max(counts.get(f, 0), i + 1)
    expert_rows = _expert_part_rows(kmap, shapes, parts, counts)  # fused experts [E, rows, ...]: rows per part
    filler = CONFIG_FILLERS.get(kmap.name)
    if config is not None and filler is not None:
        config = filler(_part_shapes(shapes, parts, config, kmap.name, counts, expert_rows), config)
    natives = [p for fqn in fqn_key for p in ([q for q, (f, _) in parts.items() if f == fqn] or [fqn])]
    natives_shape = {f: _native_shape(f, shapes, parts, expert_rows) for f in natives}
    grouped = {f: kmap.expert_names(f, int(natives_shape[f][0])) for f in natives
               if natives_shape[f] and len(natives_shape[f]) >= 2}
    grouped = {f: names for f, names in grouped.items() if names is not None}
    names = rename_all([f for f in natives if f not in grouped], kmap.exporter(), kmap.name, "export")
    sources, specs = {}, []
    for fqn in natives:
        if fqn in grouped:  # one HF tensor per expert: the slice [e] (of layer i when stacked), its part's rows
            fused, part = parts.get(fqn, (fqn, None))
            key, layer = fqn_src[fused]
            entry = index.tensors[key]
            rows = expert_rows.get(fqn)
            target = dtype if dtype is not None and entry.dtype in CASTABLE else entry.dtype
            for e, hf in enumerate(grouped[fqn]):
                sources[hf] = Source(key, rows, index=e if layer is None else (layer, e))
                specs.append(TensorSpec(hf, target, tuple(natives_shape[fqn][1:])))
            continue
        if fqn not in names:
            continue  # dropped by the map
        hf = names[fqn]
        fused, part = parts.get(fqn, (fqn, None))
        key, layer = fqn_src[fused]
        entry = index.tensors[key]
        rows = None if part is None else fused_rows(shapes[fused], config, kmap.name, fused, counts[fused])[part]
        shape = shapes[fused] if rows is None else (len(rows), *shapes[fused][1:])
        perm = row_permutation(kmap, fqn, shape, config, to_hf=True)
        if rows is not None:
            perm = rows if perm is None else rows[perm]
        if kmap.regroups_qkv(fqn):
            grouped_rows = _qkv_regrouped_rows(shape, config, kmap.name, fqn)
            perm = grouped_rows if perm is None else perm[grouped_rows]
        transpose = kmap.is_transposed(fqn)
        if transpose and len(shape) != 2:
            raise InvalidCheckpointError(f"{key}: key map {kmap.name!r} transposes {fqn!r} but it is "
                                         f"{len(shape)}-d {list(shape)}, not 2-d")
        sources[hf] = Source(key, perm, index=layer, transpose=transpose)
        target = dtype if dtype is not None and entry.dtype in CASTABLE else entry.dtype
        specs.append(TensorSpec(hf, target, tuple(reversed(shape)) if transpose else tuple(shape)))
    return ExportPlan(sources, tuple(specs), None if config is None else dict(config))


def _plan_adapter_export(index: CheckpointIndex, weights: Mapping[str, str], kmap: AdapterMap, dtype: str | None,
                         config: Mapping[str, Any] | None) -> ExportPlan:
    """The export torchtitan's own adapter gives (``to_hf`` on probes of the model weights)."""
    fqn_key = {fqn: key for key, fqn in weights.items()}
    tensors = {fqn: (tuple(index.tensors[k].shape), index.tensors[k].dtype) for fqn, k in fqn_key.items()}
    result = kmap.exported(tensors)
    shapes = {fqn: shape for fqn, (shape, _) in tensors.items()}
    sources, specs = {}, []
    for hf, (expr, shape, dt) in result.tensors.items():
        sources[hf] = source_of(expr, shapes, fqn_key)
        specs.append(TensorSpec(hf, dtype if dtype is not None and dt in CASTABLE else dt, tuple(shape)))
    return ExportPlan(sources, tuple(specs), None if config is None else dict(config),
                      unused_note(result, "to_hf", "model weight"))


def _qkv_regrouped_rows(shape: tuple, config: Mapping[str, Any] | None, map_name: str, key: str) -> np.ndarray:
    """The source rows of a fused ``linear_qkv`` (weight or bias) in ``[all q; all k; all v]``
    order (HF GPT-2's ``c_attn``), from Megatron's per-query-group rows; the head count is
    ``n_head`` (GPT-2) or ``num_attention_heads``, the query groups ``num_key_value_heads`` (default:
    as many as heads)."""
    cfg = dict(config or {})
    if cfg.get("num_attention_heads") is None:
        cfg["num_attention_heads"] = cfg.get("n_head")
    n_heads = heads_for("num_attention_heads", cfg, map_name, key)
    n_kv = heads_for("num_key_value_heads", cfg, map_name, key)
    if not shape:
        raise InvalidCheckpointError(f"{key}: a fused qkv cannot be 0-d")
    return np.concatenate(fused_qkv_rows(int(shape[0]), n_heads, n_kv, key))


def _expert_part_rows(kmap: KeyMap, shapes: Mapping[str, tuple], parts: Mapping[str, tuple[str, int]],
                      counts: Mapping[str, int]) -> dict[str, np.ndarray]:
    """The rows (of dim 1) of each part of a fused grouped-experts tensor ``[E, rows, ...]`` (Megatron's
    experts' GLU ``linear_fc1``: ``[gate; up]`` halves of every expert)."""
    out = {}
    for name, (fused, i) in parts.items():
        shape = shapes.get(fused)
        if shape and len(shape) >= 3 and kmap.expert_names(name, 1) is not None:
            out[name] = fused_halves_rows(int(shape[1]), counts[fused], fused)[i]
    return out


def _native_shape(name: str, shapes: Mapping[str, tuple], parts: Mapping[str, tuple[str, int]],
                  expert_rows: Mapping[str, np.ndarray]) -> tuple | None:
    """The shape of a native tensor, or of a fused grouped-experts tensor's part (None: another part)."""
    if name in expert_rows:
        fused = shapes[parts[name][0]]
        return (fused[0], len(expert_rows[name]), *fused[2:])
    return shapes.get(name)


def _fused_parts(kmap: KeyMap, shapes: Mapping[str, tuple]) -> dict[str, tuple[str, int]]:
    """Native name of each part of a fused tensor -> (the fused tensor's name, part number)."""
    out = {}
    for fqn in shapes:
        names = kmap.fused_parts(fqn)
        for i, name in enumerate(names or ()):
            if name in shapes:
                raise InvalidCheckpointError(f"the checkpoint holds both {fqn!r} and its part {name!r}; cannot export both")
            out[name] = (fqn, i)
    return out


def fused_rows(shape: tuple, config: Mapping[str, Any] | None, map_name: str, key: str,
                parts: int = 3) -> tuple[np.ndarray, ...]:
    """The source rows of each part of a fused tensor: a two-part one (Megatron's GLU
    ``linear_fc1``) in halves; q, k, v of a fused ``wqkv`` / ``linear_qkv`` by query group (head
    counts from the config; without ``num_key_value_heads``, from the fused rows and the head size:
    ``rows = (heads + 2 kv) head_dim``, never HF's default of as many k/v heads as q heads, whose
    split also divides a GQA tensor)."""
    if parts != 3:
        return fused_halves_rows(int(shape[0]), parts, key)
    n_heads = heads_for("num_attention_heads", config, map_name, key)
    if (config or {}).get("num_key_value_heads") is None and len(shape) == 2:
        head_dim = (config or {}).get("head_dim") or int(shape[1]) // n_heads  # HF Llama: hidden / heads
        if isinstance(head_dim, int) and head_dim > 0 and int(shape[0]) % head_dim == 0 \
                and (int(shape[0]) // head_dim - n_heads) % 2 == 0 and int(shape[0]) // head_dim > n_heads:
            return fused_qkv_rows(int(shape[0]), n_heads, (int(shape[0]) // head_dim - n_heads) // 2, key)
    n_kv = heads_for("num_key_value_heads", config, map_name, key)
    return fused_qkv_rows(int(shape[0]), n_heads, n_kv, key)


def _part_shapes(shapes: Mapping[str, tuple], parts: Mapping[str, tuple[str, int]],
                 config: Mapping[str, Any], map_name: str, counts: Mapping[str, int] | None = None,
                 expert_rows: Mapping[str, np.ndarray] | None = None) -> dict[str, tuple]:
    """``shapes`` with each fused tensor replaced by its parts' shapes (for the config filler)."""
    out = {f: s for f, s in shapes.items() if not any(f == fused for fused, _ in parts.values())}
    for name, (fused, i) in parts.items():
        if expert_rows and name in expert_rows:
            out[name] = _native_shape(name, shapes, parts, expert_rows)
            continue
        n = (counts or {}).get(fused, 3)
        if n != 3 or isinstance(config.get("num_attention_heads"), int):
            rows = fused_rows(shapes[fused], config, map_name, fused, n)[i]
            out[name] = (len(rows), *shapes[fused][1:])
    return out


def shard_summary(plans: Sequence[Any]) -> str:
    """One line per planned HF file (:func:`formats.hf.plan_files`): tensors and bytes."""
    from converter.units import human_bytes, plural

    return "\n".join(f"# {p.name}: {plural(len(p.tensors), 'tensor')}, {human_bytes(p.size)} ({p.size} bytes)" for p in plans)
