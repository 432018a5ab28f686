"""``--map`` on a whole training checkpoint (to-universal, from-universal, import-ds, export-ds):
every parameter, each of its optimizer states and its param groups' hyperparameters, renamed and
rearranged by one key map into the destination framework's key style (pure).

The map is the one export-hf / import-hf use (:func:`converter.plan.key_maps.get_key_map`), in
either direction: ``to-hf`` (native names -> Hugging Face names, :func:`plan_export`) or
``from-hf`` (:func:`plan_import`). Each role of the atoms (:mod:`converter.plan.atoms`: the
parameter, ``exp_avg``, ``exp_avg_sq``, ...) is planned by that same function over the tensors of
that role, so a state shaped like its parameter goes through exactly its parameter's transform:
renamed, RoPE rows permuted, a fused qkv or gate/up split, layers unstacked, experts sliced or
stacked, transposed. A state of another shape is carried only where its parameter is renamed and
nothing else (a 0-d ``step`` is copied to every target its parameter feeds); any other is refused,
naming the key (a non-Adam optimizer whose states are not the parameter's shape).

The optimizer may name a parameter the model saves under other names: torchtitan 0.3.0's
``qkv_linear.wqkv`` (the model's save hook writes ``wq``/``wk``/``wv``; the optimizer keeps the fused
name). To HF, its states split like the fused weight; from HF, the states of the parts are fused
back (per query group, as ``FusedQKVLinear``) while the weights stay split, as its load hook
expects.

Param groups follow their parameters' new names, from either saved form
(:mod:`converter.plan.param_groups`) into the target's (:mod:`converter.plan.key_styles`): per
parameter (flattened) or per group with its ``params`` list (nested). Every other entry is carried
as it is. :class:`CrossPlan` is what :class:`converter.run.mapped_reader.MappedReader` reads
through, and what ``--dry-run`` prints.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from converter.plan import index_expr as ix
from converter.plan.adapter_maps import AdapterMap
from converter.plan.atoms import OPTIMIZER_ROOTS, AtomRef, group_atoms, is_megatron
from converter.plan.hf_export import fused_rows, plan_export
from converter.plan.hf_import import plan_import
from converter.plan.key_maps import TORCHTITAN_LLAMA3, KeyMap, Renamer, Template
from converter.plan.key_styles import KeyStyle
from converter.plan.param_groups import group_slot, signature
from converter.plan.view_source import ObjectSource, Source, is_plain, rekeyed, source_keys
from formats.base import CheckpointIndex
from formats.dcp.reader import guess_path
from formats.errors import ConfigError, InvalidCheckpointError

TO_HF, FROM_HF = "to-hf", "from-hf"
#: ``--map-direction`` values.
DIRECTIONS = ("auto", TO_HF, FROM_HF)
PARAM = "param"


@dataclass(frozen=True)
class MapLine:
    """One line of the plan: a target entry, the source keys it is made of, and how."""

    target: str
    sources: tuple[str, ...]
    transform: str
    kind: str  # "weight", "state", "hparam" or "entry" (carried as it is)

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "sources": list(self.sources), "transform": self.transform, "kind": self.kind}


@dataclass(frozen=True)
class CrossPlan:
    """A whole checkpoint through a key map: every target tensor's :class:`Source` and object
    path, every target object, and the lines ``--dry-run`` prints."""

    map_name: str
    direction: str
    style: str
    sources: Mapping[str, Source]
    paths: Mapping[str, tuple]
    objects: Mapping[str, ObjectSource]
    lines: tuple[MapLine, ...]
    config: Mapping[str, Any] | None = None
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The ``key_map`` document (``schemas/key-map.schema.json``)."""
        return {"map": self.map_name, "direction": self.direction, "key_style": self.style,
                "entries": [line.to_json() for line in self.lines]}

    def text(self) -> str:
        """The dry run's lines: ``source -> target (transform)``, one per target entry."""
        out = [f"# key map {self.map_name} ({self.direction}), key style {self.style}: "
               f"{len(self.sources)} tensors, {len(self.objects)} other entries"]
        for line in self.lines:
            src = ", ".join(line.sources) if line.sources else "(new)"
            out.append(f"{src} -> {line.target}  [{line.kind}: {line.transform}]")
        return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# direction


def resolve_direction(kmap: Any, fqns: Sequence[str], direction: str) -> str:
    """``to-hf`` or ``from-hf``: as given, else the one whose side of the map names the source's
    parameters (``fqns``); ConfigError when both or neither do."""
    if direction not in DIRECTIONS:
        raise ConfigError(f"--map-direction {direction!r}: choose one of {', '.join(DIRECTIONS)}")
    if direction == FROM_HF and kmap.export_only:
        raise ConfigError(f"--map {kmap.name}: export only (to-hf): it cannot write its native names")
    if direction != "auto":
        return direction
    if kmap.identity or kmap.export_only:
        return TO_HF
    if isinstance(kmap, AdapterMap):  # torchtitan's adapter: HF names live under model. (and lm_head)
        return FROM_HF if fqns and all(f.startswith("model.") or f == "lm_head.weight" for f in fqns) else TO_HF
    native = sum(_known(kmap.exporter(), f) or bool(kmap.fused_parts(f)) or _is_grouped(kmap, f) for f in fqns)
    hf = sum(_known(kmap.importer(), f) or kmap.expert_of(f) is not None for f in fqns)
    if native == hf:
        raise ConfigError(f"--map {kmap.name}: the source's {len(fqns)} parameter names fit both sides of the map "
                          f"({native} each); say which way with --map-direction to-hf or from-hf")
    return TO_HF if native > hf else FROM_HF


def _known(renamer: Renamer | None, key: str) -> bool:
    if renamer is None:
        return True
    try:
        renamer.rename(key)
    except KeyError:
        return False
    return True


def _is_grouped(kmap: KeyMap, fqn: str) -> bool:
    return any(Template(native).regex().fullmatch(fqn) for native in kmap.experts.values())


# ---------------------------------------------------------------------------------------------
# the plan


def plan_cross(index: CheckpointIndex, kmap: Any, direction: str, style: KeyStyle,
               config: Mapping[str, Any] | None, values: Mapping[str, Any]) -> CrossPlan:
    """Pure: the whole checkpoint ``index`` through ``kmap`` (``direction`` resolved) in ``style``.

    ``values``: the value of every param-group entry of the source (the objects
    :func:`group_entry_keys` names), for grouping and for the groups' ``params`` lists."""
    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    refs = state_hparams(group_atoms(paths)[0], paths)
    megatron = is_megatron(paths)
    roles = _role_members(index, refs)
    shapes = _reference_shapes(index, roles)
    plans: dict[str, dict[str, Source]] = {}
    rest: dict[str, dict[str, str]] = {}
    cfg: Mapping[str, Any] | None = config
    warnings: list[str] = []
    for role, members in roles.items():
        shaped = {f: k for f, k in members.items()
                  if role == PARAM or tuple(index.tensors[k].shape) == shapes.get(f, None)}
        if len(shaped) < len(members):
            rest[role] = {f: k for f, k in members.items() if f not in shaped}
        if shaped:
            plans[role], out_cfg, notes = _role_plan(index, shaped, role, kmap, direction, config, megatron,
                                                     roles.get(PARAM, {}))
            warnings += notes
            if role == PARAM:
                cfg = out_cfg
    for key in index.objects:  # a state kept as a plain number: carried like a 0-d one
        ref = refs[key]
        if ref.role not in ("value", PARAM) and not ref.role.startswith("hparam.") and "#" not in ref.role:
            rest.setdefault(ref.role, {})[ref.atom] = key
    optim = _optimizer_targets(plans, refs)
    sources, out_paths, lines = {}, {}, []
    objects: dict[str, ObjectSource] = {}
    for role, plan in plans.items():
        for target, src in plan.items():
            key, path = style.param(target) if role == PARAM else style.state(target, role)
            sources[key], out_paths[key] = src, path
            lines.append(MapLine(key, source_keys(src), describe_source(src, index), "weight" if role == PARAM
                                 else "state"))
    for role, members in rest.items():
        for key, path, src, line in _other_states(index, refs, role, members, optim, style, kmap.name):
            if isinstance(src, Source):
                sources[key], out_paths[key] = src, path
            else:
                objects[key] = src
            lines.append(line)
    hp_objects, hp_sources, hp_lines, notes = _hparams(index, refs, values, optim, style)
    objects |= hp_objects
    warnings += notes
    for key, (src, path) in hp_sources.items():
        sources[key], out_paths[key] = src, path
    lines += hp_lines
    carried, carried_lines, notes = _carried(index, refs, paths, set(sources) | set(objects))
    warnings += notes
    for key, (src, path) in carried.items():
        if isinstance(src, Source):
            sources[key], out_paths[key] = src, path
        else:
            objects[key] = src
    lines += carried_lines
    _check_unique(lines)
    return CrossPlan(kmap.name, direction, style.name, sources, out_paths, objects, tuple(lines),
                     None if cfg is None else dict(cfg), tuple(warnings))


def state_hparams(refs: Mapping[str, AtomRef], paths: Mapping[str, tuple]) -> dict[str, AtomRef]:
    """``refs`` with the flattened hyperparameters of parameters only the optimizer names
    (``optimizer.param_groups.<fqn>.lr`` of torchtitan 0.3.0's fused ``wqkv``, which the model saves
    as ``wq``/``wk``/``wv``) given to those parameters' atoms, as their states are."""
    atoms = {r.atom for r in refs.values() if r.role not in ("value",) and not r.role.startswith("hparam.")}
    out = dict(refs)
    for key, ref in refs.items():
        path = tuple(paths[key])
        if ref.role != "value" or len(path) != 2 or path[0] not in OPTIMIZER_ROOTS \
                or not str(path[1]).startswith("param_groups."):
            continue
        rest = str(path[1])[len("param_groups."):]
        atom = max((a for a in atoms if rest.startswith(a + ".")), key=len, default=None)
        if atom is not None:
            out[key] = AtomRef(atom, "hparam." + rest[len(atom) + 1:])
    return out


def _role_members(index: CheckpointIndex, refs: Mapping[str, AtomRef]) -> dict[str, dict[str, str]]:
    """role -> {atom: key} of every tensor that is a parameter or an optimizer state (the
    parameter's role first)."""
    out: dict[str, dict[str, str]] = {PARAM: {}}
    for key in index.tensors:
        ref = refs[key]
        if ref.role == "value" or ref.role.startswith("hparam.") or "#" in ref.role:
            continue
        out.setdefault(ref.role, {})[ref.atom] = key
    return {r: m for r, m in out.items() if m}


def _reference_shapes(index: CheckpointIndex, roles: Mapping[str, Mapping[str, str]]) -> dict[str, tuple]:
    """Per atom, the shape its states must have to follow its transform: the parameter's, or for an
    atom with states only (torchtitan 0.3.0's fused ``wqkv``) the shape most of its non-0-d states have."""
    out = {f: tuple(index.tensors[k].shape) for f, k in roles.get(PARAM, {}).items()}
    seen: dict[str, Counter[tuple]] = {}
    for role, members in roles.items():
        if role == PARAM:
            continue
        for f, k in members.items():
            if f not in out and index.tensors[k].shape:
                seen.setdefault(f, Counter())[tuple(index.tensors[k].shape)] += 1
    for f, counts in seen.items():  # the shape most of its states have (Adam's two), the largest on a tie
        out[f] = max(counts, key=lambda shape: (counts[shape], math.prod(shape)))
    return out


def _role_plan(index: CheckpointIndex, members: Mapping[str, str], role: str, kmap: Any, direction: str,
               config: Mapping[str, Any] | None, megatron: bool,
               params: Mapping[str, str]) -> tuple[dict[str, Source], Mapping[str, Any] | None, tuple[str, ...]]:
    """The map over the tensors of one role (atom -> key): target name -> Source (reading the
    real keys), the completed config, warnings. The map's own planning functions run on a view
    of those tensors named by their atoms, exactly as export-hf / import-hf run on the weights."""
    if role != PARAM and isinstance(kmap, AdapterMap) and direction == TO_HF:
        odd = next((f for f in members if f not in params), None)
        if odd is not None:
            raise ConfigError(f"key {members[odd]!r}: the optimizer state of {odd!r}, which the model saves under "
                              f"other names; torchtitan's adapter ({kmap.name}) maps the model's names only: use "
                              "--map torchtitan-llama3 (its fused qkv split)")
    tensors = {f: replace(index.tensors[k], key=f, path=guess_path(f) if megatron else (f,)) for f, k in members.items()}
    view = CheckpointIndex(index.format, index.root, tensors, {}, index.info)
    try:
        if direction == TO_HF:
            plan = plan_export(view, kmap, None, config)
            return {t: rekeyed(s, members) for t, s in plan.sources.items()}, plan.config, plan.warnings
        sources, _ = plan_import(view, kmap, config if role == PARAM else _untied(config), None)
        out = {t: rekeyed(s, members) for t, s in sources.items()}
        if role != PARAM:
            out = _fused_states(out, kmap, index, config)
        return out, config, ()
    except (ConfigError, InvalidCheckpointError) as e:
        if role == PARAM:
            raise
        raise type(e)(_naming(str(e), members, role)) from None


def _untied(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``config`` without ``tie_word_embeddings``: a tied output projection has no optimizer state
    of its own (the embedding's is the one)."""
    return None if config is None else {k: v for k, v in config.items() if k != "tie_word_embeddings"}


def _naming(message: str, members: Mapping[str, str], role: str) -> str:
    """``message`` naming the checkpoint key of the state it is about."""
    hit = max((f for f in members if f in message), key=len, default=None)
    if hit is None:
        return f"optimizer state {role!r}: {message}"
    return f"key {members[hit]!r} (optimizer state {role!r} of {hit!r}): {message}"


# ---------------------------------------------------------------------------------------------
# fused optimizer names (torchtitan 0.3.0's wqkv)


def _fused_table(kmap: Any) -> Mapping[str, tuple[str, ...]]:
    """The map's fused tensors (template -> its parts' templates); torchtitan's adapters write
    0.3.0's split names, so a ``torchtitan:`` map fuses as torchtitan-llama3 does."""
    return TORCHTITAN_LLAMA3.fused if isinstance(kmap, AdapterMap) else getattr(kmap, "fused", {})


def _fused_states(plan: dict[str, Source], kmap: Any, index: CheckpointIndex,
                  config: Mapping[str, Any] | None) -> dict[str, Source]:
    """``plan`` (of one optimizer-state role, from HF) with the parts of every fused tensor the map
    knows, when all are there, replaced by the fused tensor: the optimizer names the fused
    parameter (its rows per query group, as :func:`fused_rows` says)."""
    replaced: dict[str, tuple[str, list[str]]] = {}  # first part -> (fused name, its parts)
    for fused, parts in _fused_table(kmap).items():
        first = Template(parts[0]).regex()
        for name in plan:
            m = first.fullmatch(name)
            names = [] if m is None else [Template(p).fill(m.groups()) for p in parts]
            if names and all(n in plan for n in names):
                replaced[name] = (Template(fused).fill(m.groups()), names)
    if not replaced:
        return plan
    skip = {n for _, names in replaced.values() for n in names}
    out: dict[str, Source] = {}
    for name, src in plan.items():
        if name in replaced:
            target, names = replaced[name]
            out[target] = Source("", expr=_fuse([plan[n] for n in names], index, config, kmap.name, target))
        elif name not in skip:
            out[name] = src
    return out


def _fuse(parts: Sequence[Source], index: CheckpointIndex, config: Mapping[str, Any] | None, map_name: str,
          target: str) -> ix.Expr:
    """The expression of the fused tensor whose parts are ``parts`` (each a source's rows)."""
    exprs = [_rows_expr(p, index, target) for p in parts]
    total = sum(e.shape[0] for e in exprs)
    rows = fused_rows((total, *exprs[0].shape[1:]), config, map_name, target, len(parts))
    owner = np.empty(total, dtype=np.int64)
    at = np.empty(total, dtype=np.int64)
    for i, r in enumerate(rows):
        owner[r], at[r] = i, np.arange(len(r), dtype=np.int64)
    cuts = np.flatnonzero((np.diff(owner) != 0) | (np.diff(at) != 1)) + 1
    pieces = []
    for run in np.split(np.arange(total, dtype=np.int64), cuts):
        p = int(owner[run[0]])
        pieces.append(ix.narrow(exprs[p], 0, int(at[run[0]]), len(run)))
    return ix.cat(pieces, 0)


def _rows_expr(src: Source, index: CheckpointIndex, target: str) -> ix.Expr:
    entry = index.tensors[src.key]
    if src.expr is not None:
        return src.expr
    if src.index is not None or src.stack or src.transpose:
        raise ConfigError(f"{target}: its parts are not whole tensors or their rows; ckptconv cannot fuse them")
    if src.perm is None:
        return ix.leaf(src.key, entry.shape)
    return ix.rows(src.key, entry.shape, src.perm)


# ---------------------------------------------------------------------------------------------
# states of another shape (step), hyperparameters, everything else


def _optimizer_targets(plans: Mapping[str, Mapping[str, Source]],
                       refs: Mapping[str, AtomRef]) -> dict[str, tuple[tuple[str, ...], Source]]:
    """Target parameter -> (the source atoms it is made of, how), as the optimizer names them: the
    targets of the optimizer states, then those of weights no state covers."""
    out: dict[str, tuple[tuple[str, ...], Source]] = {}
    for role, plan in plans.items():
        if role == PARAM:
            continue
        for target, src in plan.items():
            out.setdefault(target, (_atoms_of(src, refs), src))
    covered = {a for atoms, _ in out.values() for a in atoms}
    for target, src in plans.get(PARAM, {}).items():
        atoms = _atoms_of(src, refs)
        if not covered.intersection(atoms):
            out.setdefault(target, (atoms, src))
    return out


def _atoms_of(src: Source, refs: Mapping[str, AtomRef]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(refs[k].atom for k in source_keys(src)))


def _other_states(index: CheckpointIndex, refs: Mapping[str, AtomRef], role: str, members: Mapping[str, str],
                  optim: Mapping[str, tuple[tuple[str, ...], Source]], style: KeyStyle, map_name: str) -> list[tuple]:
    """(key, path, Source, line) of optimizer state ``role`` where it is not shaped like its
    parameter: to every target its atom feeds first (a 0-d ``step`` is copied; any other shape only
    where the target is its atom alone, renamed); refused otherwise, naming the key."""
    out, used = [], set()
    for target, (atoms, how) in optim.items():
        atom = next((a for a in atoms if a in members), None)
        if atom is None:
            continue
        key = members[atom]
        shape = tuple(index.tensors[key].shape) if key in index.tensors else ()
        if shape and (len(atoms) > 1 or not is_plain(how)):
            raise ConfigError(f"key {key!r}: optimizer state {role!r} is {list(shape)}, not shaped like its "
                              f"parameter, and --map {map_name} makes {target!r} of {atom!r} by "
                              f"{describe_source(how, index)} (not elementwise-safe for it): convert without --map, "
                              "or leave the optimizer out (--model-only)")
        tkey, path = style.state(target, role)
        src = Source(key) if key in index.tensors else ObjectSource(path, key=key)
        out.append((tkey, path, src, MapLine(tkey, (key,), "renamed" if shape else "copied", "state")))
        used.update(a for a in atoms if a in members)  # parts fused or experts stacked: the first one's step
    for atom, key in members.items():
        if atom in used:
            continue
        shape = tuple(index.tensors[key].shape) if key in index.tensors else ()
        if shape:
            raise ConfigError(f"key {key!r}: optimizer state {role!r} is {list(shape)}, not shaped like its "
                              f"parameter, and --map {map_name} rearranges {atom!r} (not elementwise-safe for it): "
                              "convert without --map, or leave the optimizer out (--model-only)")
        raise ConfigError(f"key {key!r}: optimizer state {role!r} of {atom!r}, whose parameter the map gives no "
                          "target; add it to the map")
    return out


def group_entry_keys(index: CheckpointIndex) -> list[str]:
    """The objects whose values :func:`plan_cross` needs: every param-group entry (either form)."""
    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    refs = state_hparams(group_atoms(paths)[0], paths)
    return [k for k, o in index.objects.items()
            if group_slot(tuple(o.path)) is not None or refs[k].role.startswith("hparam.")]


def _hparams(index: CheckpointIndex, refs: Mapping[str, AtomRef], values: Mapping[str, Any],
             optim: Mapping[str, tuple[tuple[str, ...], Source]], style: KeyStyle) -> tuple[dict, dict, list[MapLine], list[str]]:
    """The param groups in the target style: (objects, tensor entries, lines, warnings)."""
    per_atom, groups, group_of = _source_groups(index, refs, values)
    if not per_atom:
        return {}, {}, [], (["no param groups in the source: the target's optimizer keeps its own hyperparameters"]
                            if optim and any(r.role != PARAM and r.role != "value" for r in refs.values()) else [])
    chosen: dict[str, dict[str, str]] = {}
    for target, (atoms, _) in optim.items():
        found = [a for a in atoms if a in per_atom]
        if not found:
            continue
        first = per_atom[found[0]]
        for other in found[1:]:
            if {h: values.get(k) for h, k in per_atom[other].items()} != {h: values.get(k) for h, k in first.items()}:
                raise ConfigError(f"{target}: made of {found[0]!r} and {other!r}, whose param groups differ "
                                  f"(keys {sorted(first.values())[0]!r}, {sorted(per_atom[other].values())[0]!r}); "
                                  "one tensor has one group")
        chosen[target] = first
    objects, tensors, lines = {}, {}, []

    def put(key: str, path: tuple, src_key: str, target_of: str) -> None:
        if src_key in index.tensors:
            tensors[key] = (Source(src_key), path)
        else:
            objects[key] = ObjectSource(path, key=src_key)
        lines.append(MapLine(key, (src_key,), f"hyperparameter of {target_of}", "hparam"))

    if not style.nested:
        added = 0
        for target, hps in chosen.items():
            for name, src_key in hps.items():
                put(*style.hparam(target, name), src_key, target)
            if style.name == "torchtitan" and "initial_lr" not in hps and hps.get("lr") in values:
                key, path = style.hparam(target, "initial_lr")
                objects[key] = ObjectSource(path, data=_saved(values[hps["lr"]]))
                lines.append(MapLine(key, (hps["lr"],), f"initial_lr of {target}: its group's lr", "hparam"))
                added += 1
        notes = [f"the source's param groups have no initial_lr, which torchtitan's LR scheduler adds to every group "
                 f"and its checkpoint load asks for: set to each group's lr ({added} parameters); its scheduler "
                 "resumes from its own lr_scheduler state"] if added else []
        return objects, tensors, lines, notes
    order: dict[Any, int] = {}
    members: list[list[str]] = []
    for target, hps in chosen.items():
        atom = next(a for a in optim[target][0] if a in per_atom)
        sig = group_of.get(atom) if group_of else signature({h: values.get(k) for h, k in hps.items()})
        if sig not in order:
            order[sig] = len(members)
            members.append([])
        members[order[sig]].append(target)
    for i, targets in enumerate(members):
        for name, src_key in chosen[targets[0]].items():
            put(*style.group(i, name), src_key, f"group {i}")
        key, path = style.group(i, "params")
        objects[key] = ObjectSource(path, data=_saved(list(targets)))
        lines.append(MapLine(key, tuple(groups.get(i, ())), f"params of group {i}: {len(targets)} names", "hparam"))
    return objects, tensors, lines, []


def _source_groups(index: CheckpointIndex, refs: Mapping[str, AtomRef],
                   values: Mapping[str, Any]) -> tuple[dict[str, dict[str, str]], dict[int, tuple[str, ...]], dict[str, int]]:
    """(atom -> {hyperparameter: source key}, group -> its source entries, atom -> its source
    group number (nested form only))."""
    per_atom: dict[str, dict[str, str]] = {}
    slots: dict[int, dict[str, str]] = {}
    for key, entry in [*index.objects.items(), *index.tensors.items()]:
        ref = refs[key]
        slot = group_slot(tuple(entry.path))
        if slot is not None:
            slots.setdefault(slot[0], {})[slot[1]] = key
        elif ref.role.startswith("hparam."):
            per_atom.setdefault(ref.atom, {})[ref.role[len("hparam."):]] = key
    group_of: dict[str, int] = {}
    atoms = {r.atom for r in refs.values() if r.role not in ("value",) and not r.role.startswith("hparam.")}
    for i, entries in sorted(slots.items()):
        listed = values.get(entries.get("params", ""))
        names = list(listed) if isinstance(listed, (list, tuple)) else (sorted(atoms) if len(slots) == 1 else [])
        hps = {h: k for h, k in entries.items() if h != "params"}
        for fqn in names:
            per_atom[str(fqn)], group_of[str(fqn)] = hps, i
    return per_atom, {i: tuple(e.values()) for i, e in slots.items()}, group_of


def _saved(value: Any) -> bytes:
    """``torch.save`` bytes of a plain value (how DCP stores a non-tensor entry)."""
    from formats.deepspeed_pickle import torch_save_bytes

    return torch_save_bytes(value)


def _carried(index: CheckpointIndex, refs: Mapping[str, AtomRef], paths: Mapping[str, tuple],
             taken: set[str]) -> tuple[dict, list[MapLine], list[str]]:
    """Every entry that is neither a parameter, an optimizer state nor a param group, as it is
    (training state, schedulers, dataloader); model entries that are not tensors are left out."""
    out, lines, dropped = {}, [], []
    for key in [*index.tensors, *index.objects]:
        ref, path = refs[key], tuple(paths[key])
        if ref.role != "value" or group_slot(path) is not None:
            if key in index.objects and ref.role == PARAM:
                dropped.append(key)
            continue
        if key in taken:
            raise ConfigError(f"key {key!r}: the source holds it and the map writes another entry under that name; "
                              "choose another --key-style")
        out[key] = (Source(key) if key in index.tensors else ObjectSource(path, key=key), path)
        lines.append(MapLine(key, (key,), "as is", "entry"))
    notes = [f"{len(dropped)} non-tensor model entries left out (the map renames tensors): {dropped[0]!r}"
             + (f" and {len(dropped) - 1} more" if len(dropped) > 1 else "")] if dropped else []
    return out, lines, notes


def _check_unique(lines: Sequence[MapLine]) -> None:
    seen: dict[str, MapLine] = {}
    for line in lines:
        if line.target in seen:
            raise ConfigError(f"the map writes {line.target!r} twice (from {seen[line.target].sources} and "
                              f"{line.sources}); fix the map")
        seen[line.target] = line


# ---------------------------------------------------------------------------------------------
# describing a source


def describe_source(src: Source, index: CheckpointIndex) -> str:
    """How a target tensor is made of its sources, in words (the dry run's transform)."""
    words = []
    if src.expr is not None:
        n = len(ix.sources_of(src.expr))
        words.append(f"fused from {n} tensors (rows regrouped)" if n > 1 else "elements gathered")
    elif src.stack:
        words.append(f"stack of {len(src.stack)}")
    else:
        if src.index is not None:
            words.append(f"[{src.index}] of")
        if src.perm is not None:
            words.append(_rows_words(np.asarray(src.perm), index.tensors[src.key].shape[1 if src.index is not None else 0]))
    if src.transpose:
        words.append("transposed")
    return ", ".join(words) or "renamed"


def _rows_words(perm: np.ndarray, rows: int) -> str:
    if len(perm) and np.array_equal(perm, np.arange(perm[0], perm[0] + len(perm))):
        return f"rows {int(perm[0])}:{int(perm[0]) + len(perm)} of {rows}"
    if len(perm) == rows and np.array_equal(np.sort(perm), np.arange(rows)):
        return "rows permuted"
    ordered = bool(np.all(np.diff(perm) > 0))
    return f"{len(perm)} of {rows} rows" + ("" if ordered else ", reordered")

