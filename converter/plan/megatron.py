"""Megatron-core torch_dist checkpoints: what is bound to the layout, and layer-stacked tensors (pure).

Layout-bound ShardedObjects. Megatron saves some objects once per cell of a grid of ranks, the grid
in the key: ``<name>/shard_<offsets>_<grid>``. Where the grid is the parallel layout, the object
only loads on that layout (Megatron asks for ``rng_state/shard_<pp_rank>.<tp_rank>_<PP>.<TP>``):

- ``rng_state``: Megatron-LM's RNG states over ``(pp, tp)`` (``(pp, tp, dp)`` with 3 axes); Megatron-LM
  itself does not load them after a TP/PP change;
- ``rerun_state_machine_state``: one per rank of the world;
- ``optimizer.distributed.dp_group_idx_<i>.*``: the DistributedOptimizer's ``dp_reshardable`` /
  ``dp_zero_gather_scatter`` state, one per (pp, tp) group: objects and the flat per-bucket tensors
  (Megatron reshards them over DP only; after a TP/PP change Megatron-LM needs ``--no-load-optim``,
  or a save with ``fully_reshardable``).

Objects over other grids (``<module>._extra_state/shard_<layer>_<layers>``: per layer;
``common_state/shard_0_1``) load on any layout. :func:`plan_layout_bound` keeps the bound ones for an
unchanged layout; on a changed one it drops them with a warning (``drop``, the default), keeps them
(``keep``) or refuses (``refuse``).

Layer-stacked tensors. ``decoder.layers.*`` (and ``mtp.layers.*``, ``encoder.layers.*``) hold every
layer in one tensor of global shape ``(L, ...)`` (``prepend_axis_num=1``): each chunk covers one layer
(size 1 on dim 0). Dim 0 is the layer axis, never a TP or FSDP split (:func:`stacked_layers`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from converter.plan.atoms import SHARDED_OBJECT
from converter.plan.mesh import Mesh
from formats.base import CheckpointIndex, TensorEntry
from formats.errors import ConfigError

LAYOUT_OBJECT_POLICIES = ("drop", "keep", "refuse")
#: ShardedObject names whose grid is the layout, and the mesh axes of their grid (by grid rank).
_GRID_AXES = {
    "rng_state": {2: ("pp", "tp"), 3: ("pp", "tp", "dp")},
    "rerun_state_machine_state": {1: ("world",)},
}
_DP_GROUP = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\..+")
#: How the warnings name the DistributedOptimizer's per-(pp, tp)-group state (objects and flat buffers).
DP_GROUP_STATE = "optimizer.distributed.dp_group_idx_* (dp_reshardable optimizer state)"
#: A layer-stacked key: a ``layers`` module with no layer number after it.
_STACKED = re.compile(r"(?:^|.*\.)layers\.(?!\d+(?:\.|$)).+")


@dataclass(frozen=True)
class BoundObject:
    """A ShardedObject that only loads on the layout it was saved on."""

    key: str
    name: str
    grid: tuple[int, ...]  # the saved grid (empty for a dp-group object: the group index names it)
    axes: tuple[str, ...]  # mesh axes of the grid


def _grid(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def layout_bound_objects(keys: Iterable[str]) -> list[BoundObject]:
    """The layout-bound entries among ``keys``: ShardedObjects and the dp-group optimizer tensors
    (see the module docstring)."""
    out = []
    for key in keys:
        m = SHARDED_OBJECT.fullmatch(key)
        name = m.group("key") if m else key
        if m and name in _GRID_AXES:
            grid = _grid(m.group("grid"))
            axes = _GRID_AXES[name].get(len(grid))
            if axes is not None:
                out.append(BoundObject(key, name, grid, axes))
        elif _DP_GROUP.fullmatch(name):
            out.append(BoundObject(key, DP_GROUP_STATE, (), ("pp", "tp")))
    return out


def mesh_axes(mesh: Mesh) -> dict[str, int]:
    """Megatron's degrees on ``mesh``: ``pp``, ``tp``, ``dp`` (every data-parallel dim) and ``world``."""
    dp = mesh.size("dp_replicate") * mesh.size("dp_shard") * mesh.size("cp")
    return {"pp": mesh.size("pp"), "tp": mesh.size("tp"), "dp": dp, "world": mesh.world_size}


def source_axes(bound: Iterable[BoundObject]) -> dict[str, int]:
    """The source's degrees as the saved grids tell them (``rng_state``: pp and tp)."""
    out: dict[str, int] = {}
    for b in bound:
        for axis, n in zip(b.axes, b.grid):
            out.setdefault(axis, n)
    return out


def plan_layout_bound(keys: Iterable[str], mesh: Mesh, policy: str = "drop") -> tuple[set[str], list[str]]:
    """(keys to leave out, warnings) for the layout-bound objects among ``keys`` on target ``mesh``.

    An object is kept when every axis of its grid has the target's degree (a dp-group object: when
    the source's pp and tp, from the ``rng_state`` grid, are the target's). ``policy`` says what
    happens to the others: ``drop`` (warned), ``keep`` (warned: Megatron will not find its shard),
    ``refuse`` (ConfigError).
    """
    if policy not in LAYOUT_OBJECT_POLICIES:
        raise ConfigError(f"--layout-bound-objects {policy!r}: choose one of {', '.join(LAYOUT_OBJECT_POLICIES)}")
    bound = layout_bound_objects(keys)
    if not bound:
        return set(), []
    target, source = mesh_axes(mesh), source_axes(bound)
    keys_of: dict[str, list[str]] = {}
    why: dict[str, list[str]] = {}
    for b in bound:
        saved = dict(zip(b.axes, b.grid)) if b.grid else {a: source.get(a, -1) for a in b.axes}
        diff = [f"{a} {n if n > 0 else '?'} -> {target[a]}" for a, n in saved.items() if n != target[a]]
        if diff:
            keys_of.setdefault(b.name, []).append(b.key)
            why[b.name] = diff
    if not keys_of:
        return set(), []
    what = "; ".join(f"{n} ({len(ks)} shard{'s' if len(ks) != 1 else ''}, {', '.join(why[n])})" for n, ks in keys_of.items())
    if policy == "refuse":
        raise ConfigError(f"layout-bound Megatron objects do not fit the target mesh {mesh}: {what}; pass "
                          "--layout-bound-objects drop (Megatron-LM itself skips them after a TP/PP change) or keep")
    keys_out = {k for ks in keys_of.values() for k in ks}
    if policy == "keep":
        return set(), [f"kept layout-bound Megatron objects saved for another layout: {what}; Megatron will not "
                       "find its own shard of them on the target mesh (load with --no-load-rng / without them)"]
    optim = (" The dp_reshardable optimizer state reshards over DP only: Megatron-LM loads this checkpoint with "
             "--no-load-optim (or save with --dist-ckpt-optim-fully-reshardable to keep it)." if DP_GROUP_STATE in keys_of else "")
    return keys_out, [f"dropped layout-bound Megatron objects saved for another layout: {what}; Megatron-LM "
                      "skips them after a TP/PP change (RNG states restart from the seed); "
                      "--layout-bound-objects keep|refuse to change this." + optim]


def stacked_layers(index: CheckpointIndex) -> dict[str, int]:
    """key -> number of layers L of every layer-stacked tensor of a Megatron checkpoint (``{}`` for
    any other): a ``layers`` key with no layer number, at least 2-d, and where chunks carry ranks
    (a DCP save), each chunk covering exactly one layer (size 1 on dim 0) or all of them (what
    ``--plan megatron`` writes). A universal store's
    chunks are storage chunks: there the key decides."""
    from converter.plan.atoms import is_megatron

    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    if not is_megatron(paths):
        return {}
    return {key: int(entry.shape[0]) for key, entry in index.tensors.items() if is_stacked(entry)}


def is_stacked(entry: TensorEntry) -> bool:
    """Whether ``entry`` of a Megatron checkpoint is layer-stacked (see :func:`stacked_layers`)."""
    if len(entry.shape) < 2 or not _STACKED.fullmatch(entry.key) or not entry.chunks:
        return False
    # megatron writes one layer per chunk; ckptconv's --plan megatron keeps the layer axis whole
    return all(c.box.sizes[0] == 1 or (c.box.offsets[0] == 0 and c.box.sizes[0] == entry.shape[0])
               for c in entry.chunks if c.box.numel and c.rank is not None)


def unstacked_name(key: str, layer: int) -> str:
    """``decoder.layers.mlp.linear_fc1.weight`` -> ``decoder.layers.<layer>.mlp.linear_fc1.weight``."""
    head, sep, tail = key.rpartition("layers.")
    if not sep:
        raise ValueError(f"not a layer-stacked key: {key!r}")
    return f"{head}layers.{layer}.{tail}"


def layer_names(stacked: Mapping[str, int]) -> dict[str, tuple[str, int]]:
    """Per-layer name -> (stacked key, layer) for every layer of every stacked tensor."""
    return {unstacked_name(k, i): (k, i) for k, n in stacked.items() for i in range(n)}
