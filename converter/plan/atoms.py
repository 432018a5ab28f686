"""Group checkpoint keys into atoms: a parameter's value plus its optimizer states and hparams.

Pure functions over object paths (DCP's ``planner_data``). Two key styles are recognised:

- ``get_state_dict`` style: ``("model", fqn)`` and ``("optim", "state", fqn, name, ...)``,
  ``("optim", "param_groups", i, hparam)``;
- torchtitan style: model keys at the top level ``(fqn,)``, and with
  ``flatten_optimizer_state_dict=True`` ``("optimizer", "state.<fqn>.<name>")`` and
  ``("optimizer", "param_groups.<fqn>.<hparam>")``.

Both styles may sit under one common prefix, as in DCP's tutorial, which saves
``{"app": AppState(model, optimizer)}`` whose ``state_dict()`` is ``{"model": ..., "optim": ...}``:
``("app", "model", fqn)``, ``("app", "optim", "state", fqn, name)`` (see :func:`root_prefix`).

Nested optimizer state (Shampoo-like: ``state.<fqn>.<group>.<name>``) keeps the whole tail as
its role. Anything else (buffers are parameters too; extra state) is an atom of its own.

Megatron-core (``dist_checkpointing``, torch_dist backend) writes no planner data: keys are its
ShardedTensor keys, model weights at the top level (``embedding.word_embeddings.weight``,
``decoder.layers.mlp.linear_fc1.weight``, ``output_layer.weight``) and DistributedOptimizer states
as ``optimizer.state.<state>.<key>``, the state name BEFORE the parameter's key (``param`` is the
fp32 main copy: role ``main_param``, never the parameter's own role). ShardedObjects are bytes keys
``<key>/shard_<offsets>_<grid>``. See :func:`megatron_refs`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from formats.dcp.reader import guess_path

OPTIMIZER_ROOTS = ("optim", "optimizer")
MODEL_ROOTS = ("model",)
#: Top-level module names of Megatron-core models (GPT, hybrid/Mamba, T5, BERT, multimodal).
MEGATRON_MODEL_ROOTS = frozenset({"embedding", "decoder", "encoder", "output_layer", "mtp", "pooler",
                                  "lm_head", "binary_head", "vision_model", "language_model", "vision_projection"})
#: Megatron's DistributedOptimizer state keys: ``optimizer.state.<state>.<parameter key>``.
MEGATRON_STATE = re.compile(r"optimizer\.state\.([A-Za-z_][A-Za-z0-9_]*)\.(.+)")
#: A ShardedObject's key in a torch_dist checkpoint: ``<key>/shard_<offsets>_<grid>``.
SHARDED_OBJECT = re.compile(r"(?P<key>.+)/shard_(?P<offsets>\d+(?:\.\d+)*)_(?P<grid>\d+(?:\.\d+)*)")


@dataclass(frozen=True)
class AtomRef:
    """Which atom a key belongs to and its role there ("param", "exp_avg", "hparam.lr", ...)."""

    atom: str
    role: str


def _model_fqn(path: tuple) -> str | None:
    if len(path) == 2 and path[0] in MODEL_ROOTS:
        return str(path[1])
    if len(path) == 1:
        return str(path[0])
    return None


def root_prefix(paths: Iterable[tuple]) -> tuple:
    """The object-path prefix the ``model`` / ``optim`` roots are nested under (``("app",)`` for
    DCP's ``{"app": AppState}`` tutorial), or ``()`` when they are top-level, absent or ambiguous.

    A prefix counts when exactly one path prefix holds a ``model`` root, and either an optimizer
    root sits under the same prefix or no top-level single-name entry could be a torchtitan-style
    parameter instead.
    """
    paths = [tuple(p) for p in paths if p]
    if any(p[0] in MODEL_ROOTS for p in paths):
        return ()
    cands = {p[:-2] for p in paths if len(p) >= 3 and p[-2] in MODEL_ROOTS}
    if len(cands) != 1:
        return ()
    prefix = next(iter(cands))
    n = len(prefix)
    has_optim = any(len(p) > n + 1 and p[:n] == prefix and p[n] in OPTIMIZER_ROOTS for p in paths)
    return prefix if has_optim or not any(len(p) == 1 for p in paths) else ()


def _strip(path: tuple, prefix: tuple) -> tuple | None:
    """``path`` relative to ``prefix`` (None when it lies outside it)."""
    if not prefix:
        return path
    return path[len(prefix):] if path[: len(prefix)] == prefix and len(path) > len(prefix) else None


def model_fqns(paths: Mapping[str, tuple], prefix: tuple = ()) -> set[str]:
    """Parameter/buffer FQNs of the model part of a state dict (roots under ``prefix``)."""
    rel = (_strip(tuple(p), prefix) for p in paths.values())
    return {f for p in rel if p is not None and (f := _model_fqn(p)) is not None}


def _split_flat(rest: str, fqns: set[str]) -> tuple[str, str]:
    """Split 'layers.0.w.weight.exp_avg' into (fqn, tail) using the longest known fqn."""
    best = ""
    for f in fqns:
        if len(f) > len(best) and rest.startswith(f + "."):
            best = f
    if best:
        return best, rest[len(best) + 1 :]
    head, _, tail = rest.rpartition(".")
    return (head, tail) if head else (rest, "value")


def atom_of(key: str, path: tuple, fqns: set[str]) -> AtomRef:
    """The atom and role of one key."""
    path = tuple(path) or (key,)
    fqn = _model_fqn(path)
    if fqn is not None:
        return AtomRef(fqn, "param")
    if path[0] in OPTIMIZER_ROOTS and len(path) >= 2:
        second = str(path[1])
        if second == "state" and len(path) >= 4:
            return AtomRef(str(path[2]), ".".join(map(str, path[3:])))
        if len(path) == 2 and second.startswith("state."):
            f, tail = _split_flat(second[len("state.") :], fqns)
            return AtomRef(f, tail)
        if len(path) == 2 and second.startswith("param_groups.") and fqns:
            f, tail = _split_flat(second[len("param_groups.") :], fqns)
            if f in fqns:
                return AtomRef(f, "hparam." + tail)
    return AtomRef(key, "value")


def is_megatron(paths: Mapping[str, tuple]) -> bool:
    """Whether ``paths`` are Megatron-core torch_dist keys: no planner data (every path is the
    reader's guess from the key) and a Megatron model root or a DistributedOptimizer state whose
    parameter key is among the keys."""
    if not paths or any(tuple(p) and tuple(p) != guess_path(k) for k, p in paths.items()):
        return False
    for key in paths:
        m = MEGATRON_STATE.fullmatch(key)
        if (m and m.group(2) in paths) or key.split(".", 1)[0] in MEGATRON_MODEL_ROOTS:
            return True
    return False


def megatron_refs(keys: Iterable[str]) -> dict[str, AtomRef]:
    """key -> AtomRef for Megatron-core keys (see the module docstring): optimizer states join their
    parameter's atom (state ``param`` as ``main_param``), every other key outside ``optimizer.`` that
    is not a ShardedObject is a model weight, the rest are values."""
    keys = list(keys)
    present = set(keys)
    refs = {}
    for key in keys:
        m = MEGATRON_STATE.fullmatch(key)
        if m and m.group(2) in present:
            state = m.group(1)
            refs[key] = AtomRef(m.group(2), "main_param" if state == "param" else state)
        elif key.split(".", 1)[0] not in OPTIMIZER_ROOTS and not SHARDED_OBJECT.fullmatch(key):
            refs[key] = AtomRef(key, "param")
        else:
            refs[key] = AtomRef(key, "value")
    return refs


def group_atoms(paths: Mapping[str, tuple]) -> tuple[dict[str, AtomRef], dict[str, dict[str, str]]]:
    """(key -> AtomRef, atom -> {role: key}) for every key of a checkpoint."""
    if is_megatron(paths):
        refs = megatron_refs(paths)
    else:
        refs = _generic_refs(paths)
    atoms: dict[str, dict[str, str]] = {}
    for key, ref in refs.items():
        members = atoms.setdefault(ref.atom, {})
        role = ref.role if ref.role not in members else f"{ref.role}#{key}"
        members[role] = key
    return refs, atoms


def _generic_refs(paths: Mapping[str, tuple]) -> dict[str, AtomRef]:
    prefix = root_prefix(paths.values())
    fqns = model_fqns(paths, prefix)
    refs = {}
    for key, p in paths.items():
        rel = _strip(tuple(p) or (key,), prefix)
        refs[key] = AtomRef(key, "value") if rel is None else atom_of(key, rel, fqns)
    return refs


def param_of_keys(refs: Mapping[str, AtomRef]) -> dict[str, str]:
    """key -> parameter FQN whose placement it follows (itself for standalone atoms)."""
    return {key: ref.atom for key, ref in refs.items()}


def iter_params(atoms: Mapping[str, dict[str, str]]) -> Iterable[tuple[str, str]]:
    """(atom, key of its value) for atoms that hold a parameter value."""
    for name, members in atoms.items():
        if "param" in members:
            yield name, members["param"]
