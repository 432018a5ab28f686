"""A whole checkpoint seen through ``--map`` (to-universal, from-universal, import-ds, export-ds): its
parameters, optimizer states and param groups renamed and rearranged into the destination
framework's names and key style (:mod:`converter.plan.cross_map` plans it; this module reads the
few small values the plan needs, the param groups, and returns the view the conversion reads)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from converter.plan.atoms import group_atoms
from converter.plan.cross_map import TO_HF, CrossPlan, group_entry_keys, plan_cross, resolve_direction
from converter.plan.key_maps import MEGATRON_ARGS_CONFIG, get_key_map
from converter.plan.hf_config import load_config_arg, source_config
from converter.plan.key_styles import resolve_style
from converter.run.destination import option_value
from converter.run.mapped_reader import MappedReader
from formats.base import CheckpointIndex, CheckpointReader
from formats.errors import CkptConvError, ConfigError


def cross_view(reader: CheckpointReader, key_map: Any, *, direction: str = "auto", key_style: str = "auto",
               config: Mapping[str, Any] | None = None,
               trust_pickle: bool = False) -> tuple[MappedReader, CrossPlan]:
    """``reader``'s checkpoint through ``key_map`` (``--map``) in ``direction`` (``--map-direction``:
    auto, to-hf, from-hf) and ``key_style`` (``--key-style``); ``config``: the model's config (head
    counts the map's row transforms need). The view and its plan (what ``--dry-run`` prints)."""
    kmap = get_key_map(key_map)
    index = reader.index()
    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    refs, _ = group_atoms(paths)
    fqns = [r.atom for k, r in refs.items() if r.role == "param" and k in index.tensors]
    way = resolve_direction(kmap, fqns, direction)
    style = resolve_style(key_style, way == TO_HF, kmap.identity, paths)
    cfg = map_config(kmap, config, reader, index)
    values = {k: reader.load_object(k, trust_pickle) for k in group_entry_keys(index)}
    plan = plan_cross(index, kmap, way, style, cfg, values)
    return MappedReader(reader, plan.sources, plan.paths, plan.objects), plan


def mapped(reader: CheckpointReader, src: Any, key_map: Any, direction: str = "auto", key_style: str = "auto",
           config: Any = None, trust_pickle: bool = False) -> tuple[CheckpointReader, CrossPlan | None]:
    """``reader`` seen through ``--map`` (and ``--map-direction`` / ``--key-style``), or itself when
    no map and no key style is given; ``config`` (a path, inline JSON or a mapping; default: the
    source's config.json) gives the head counts. The reader to convert from and the plan (None:
    no map)."""
    if key_map is None and key_style == "auto":
        if direction != "auto":
            raise ConfigError("--map-direction says which way --map renames: add --map NAME|FILE")
        return reader, None
    doc = load_config_arg(config if config is not None else source_config(src))[0]
    return cross_view(reader, "identity" if key_map is None else key_map, direction=direction, key_style=key_style,
                      config=doc, trust_pickle=trust_pickle)


def map_header(key_map: Any, direction: str, key_style: str, config: Any = None) -> dict[str, Any]:
    """The options a mapped conversion records in its output header (nothing without a map, so an
    output written before ``--map`` existed still resumes)."""
    if key_map is None and key_style == "auto":
        return {}
    return {"--map": option_value(key_map or "identity"), "--map-direction": direction, "--key-style": key_style,
            **({"--config": option_value(config)} if config is not None else {})}


def map_config(kmap: Any, config: Mapping[str, Any] | None, reader: CheckpointReader,
               index: CheckpointIndex) -> dict[str, Any] | None:
    """``config`` completed, for a Megatron map, with the head counts of the checkpoint's own
    training arguments (what ``config`` gives wins)."""
    from_args, heads_field = MEGATRON_ARGS_CONFIG.get(kmap.name, (None, ""))
    if from_args is not None and not (config or {}).get(heads_field):
        return {**from_args(megatron_args(reader, index)), **(config or {})} or None
    return None if config is None else dict(config)


def megatron_args(reader: CheckpointReader, index: CheckpointIndex) -> dict[str, Any]:
    """``vars(args)`` of a Megatron checkpoint's training arguments (its ``common_state`` entry,
    loaded through the allowlist: an ``argparse.Namespace`` is plain data), or ``{}``."""
    for key in index.objects:
        if key.split("/", 1)[0] != "common_state":
            continue
        try:
            value = reader.load_object(key, trust_pickle=False)
        except CkptConvError:
            return {}
        if isinstance(value, list) and len(value) == 1:  # torch_dist stores a ShardedObject's data in a list
            value = value[0]
        args = value.get("args") if isinstance(value, dict) else None
        return dict(vars(args)) if isinstance(args, argparse.Namespace) else {}
    return {}


#: The ``--dry-run --json`` document of a mapped conversion with no plan document of its own
#: (schemas/key-map.schema.json); from-universal's target plan holds the same under ``key_map``.
KEY_MAP_SCHEMA = "ckptconv.key-map/1"


def with_map(conv: Any, plan: CrossPlan | None) -> Any:
    """``conv`` (a :class:`converter.run.pipeline.Conversion`) with the map's warnings and its dry
    run listing every source key -> target key and how (text, and the JSON document)."""
    if plan is None:
        return conv
    from dataclasses import replace

    def describe() -> tuple[str, dict]:
        text, doc = conv.describe()
        doc = {"schema": KEY_MAP_SCHEMA, **plan.to_json()} if doc is None else {**doc, "key_map": plan.to_json()}
        return plan.text() + "\n" + text, doc

    return replace(conv, describe=describe, planned=replace(conv.planned, warnings=conv.planned.warnings + plan.warnings))
