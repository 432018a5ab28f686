"""Per-rank dataloader state in from-universal (torchtitan's ``dataloader`` entries).

torchtitan's ``ParallelAwareDataloader`` saves ``dataloader.dp_rank_<r>`` (a pickle of its
``StatefulDataLoader`` state, one per data-parallel rank) and ``dataloader.world_size`` (the DP
degree), and refuses to load it at another DP degree ("dp_degree is inconsistent before and after
checkpoint, dataloader resharding is not supported yet"). So:

- same DP degree (``dp_replicate`` x ``dp_shard`` of the target): every entry is kept byte for byte,
  ``dp_rank_<r>`` in the file of the first target rank that loads it (each rank reads its own file);
- another DP degree: kept, with a warning that says how to go on: ``--drop-dataloader-state`` or
  torchtitan's ``checkpoint.exclude_from_loading=["dataloader"]``;
- ``--drop-dataloader-state``: every entry under ``dataloader`` is left out; for torchtitan's layout
  fresh ones are written for the target DP degree (``world_size``, and per rank the pickle of ``{}``,
  which ``StatefulDataLoader.load_state_dict`` takes as "no state"): torchtitan then loads the
  checkpoint without any option and every rank starts its data from the beginning.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass

from converter.plan.mesh import Mesh
from formats.base import CheckpointIndex
from formats.objects import load_plain_object

ROOT = "dataloader"
_RANK_KEY = re.compile(r"dp_rank_(\d+)$")


@dataclass(frozen=True)
class DataloaderState:
    """The source's dataloader entries: every key, the DP degree torchtitan recorded, and which key
    holds each DP rank's state."""

    keys: tuple[str, ...]
    tensor_keys: tuple[str, ...]
    dp_degree: int | None
    per_rank: Mapping[int, str]
    prefix: tuple

    @property
    def is_torchtitan(self) -> bool:
        return self.dp_degree is not None and bool(self.per_rank)


def _under_root(path: tuple) -> bool:
    return bool(path) and path[0] == ROOT


def find(index: CheckpointIndex, read_object) -> DataloaderState | None:
    """The dataloader entries of ``index`` (None when there are none). ``read_object(key)`` gives
    an object's ``torch.save`` bytes."""
    objs = [k for k, o in index.objects.items() if _under_root(tuple(o.path) or (k,))]
    tensors = tuple(k for k, t in index.tensors.items() if _under_root(tuple(t.path) or (k,)))
    if not objs and not tensors:
        return None
    dp, per_rank, prefix = None, {}, (ROOT,)
    for key in objs:
        path = tuple(index.objects[key].path) or (key,)
        last = str(path[-1])
        if last == "world_size":
            ok, value = load_plain_object(read_object(key))
            dp = value if ok and isinstance(value, int) and value > 0 else None
            prefix = path[:-1]
        elif m := _RANK_KEY.match(last):
            per_rank[int(m.group(1))] = key
    return DataloaderState(tuple(objs), tensors, dp, per_rank, prefix)


def target_dp(mesh: Mesh) -> int:
    """torchtitan's data-parallel (batch) degree of ``mesh``: ``dp_replicate`` x ``dp_shard``."""
    return mesh.size("dp_replicate") * mesh.size("dp_shard")


def dp_owner(mesh: Mesh, dp_rank: int) -> int:
    """The first rank of ``mesh`` whose batch coordinate is ``dp_rank`` (rank 0 when none is)."""
    names = mesh.names
    for rank in range(mesh.world_size):
        c = dict(zip(names, mesh.coords(rank)))
        if c.get("dp_replicate", 0) * mesh.size("dp_shard") + c.get("dp_shard", 0) == dp_rank:
            return rank
    return 0


def mismatch_warning(state: DataloaderState, mesh: Mesh) -> str | None:
    """The warning for a torchtitan dataloader state saved at another DP degree (None: same)."""
    if not state.is_torchtitan or state.dp_degree == target_dp(mesh):
        return None
    return (
        f"dataloader: the source saved per-rank dataloader state at DP degree {state.dp_degree}, the target mesh "
        f"{mesh} has DP degree {target_dp(mesh)}; torchtitan refuses it at load (dataloader resharding is not "
        "supported): pass --drop-dataloader-state (every rank restarts its data), or load with torchtitan's "
        "checkpoint.exclude_from_loading=['dataloader']"
    )


def _torch_save(value) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def fresh_entries(state: DataloaderState, mesh: Mesh) -> list[tuple[str, tuple, bytes, int]]:
    """``(key, path, torch.save bytes, rank file)`` of an empty torchtitan dataloader state for
    ``mesh`` (nothing for other layouts)."""
    if not state.is_torchtitan:
        return []
    dp = target_dp(mesh)
    sep_key = ".".join(map(str, state.prefix))
    out = [(f"{sep_key}.world_size", state.prefix + ("world_size",), _torch_save(dp), 0)]
    empty = _torch_save(pickle.dumps({}))
    out += [(f"{sep_key}.dp_rank_{r}", state.prefix + (f"dp_rank_{r}",), empty, dp_owner(mesh, r)) for r in range(dp)]
    return out


def rank_file(key: str, state: DataloaderState | None, mesh: Mesh) -> int:
    """Which rank's file a kept object goes to: a DP rank's own dataloader state to that rank."""
    if state is not None and state.is_torchtitan and state.dp_degree == target_dp(mesh):
        for r, k in state.per_rank.items():
            if k == key:
                return dp_owner(mesh, r)
    return 0


def batch_ranks(mesh: Mesh) -> dict[int, tuple[int, ...]]:
    """DP (batch) rank -> every rank of ``mesh`` with that batch coordinate."""
    out: dict[int, list[int]] = {}
    names, dp_shard = mesh.names, mesh.size("dp_shard")
    for rank in range(mesh.world_size):
        c = dict(zip(names, mesh.coords(rank)))
        out.setdefault(c.get("dp_replicate", 0) * dp_shard + c.get("dp_shard", 0), []).append(rank)
    return {d: tuple(r) for d, r in out.items()}


def loading_ranks(specs: list[tuple[str, tuple, bytes, int]], mesh: Mesh) -> dict[str, tuple[int, ...]]:
    """The ranks that load each of the non-tensor entries ``specs`` (:func:`plan_objects`' output)
    that not every rank loads: torchtitan's ``dataloader.dp_rank_<d>`` at the target's DP degree
    is loaded by the ranks of batch coordinate ``d`` only (each rank's state dict holds its own)."""
    degrees = {}
    for key, path, data, _ in specs:
        if _under_root(path) and str(path[-1]) == "world_size":
            ok, value = load_plain_object(data)
            if ok and isinstance(value, int):
                degrees[tuple(path[:-1])] = value
    by_dp = batch_ranks(mesh)
    out = {}
    for key, path, _, _ in specs:
        m = _RANK_KEY.match(str(path[-1])) if _under_root(path) else None
        if m and degrees.get(tuple(path[:-1])) == target_dp(mesh):
            out[key] = by_dp.get(int(m.group(1)), (0,))
    return out


def without(index: CheckpointIndex, state: DataloaderState) -> CheckpointIndex:
    """``index`` without the dataloader entries."""
    from dataclasses import replace

    drop = set(state.keys) | set(state.tensor_keys)
    return replace(index, tensors={k: v for k, v in index.tensors.items() if k not in drop},
                   objects={k: v for k, v in index.objects.items() if k not in drop})


def plan_objects(index: CheckpointIndex, read_object, mesh: Mesh, drop: bool) -> tuple[list[tuple[str, tuple, bytes, int]], CheckpointIndex, list[str]]:
    """The non-tensor entries to write as ``(key, path, bytes, rank file)``, the index left to
    write (without the dataloader tensors when dropping), and the warnings."""
    state = find(index, read_object)
    if state is None:
        warnings = ["--drop-dataloader-state: the source has no dataloader state; nothing dropped"] if drop else []
        return [(k, tuple(o.path), read_object(k), 0) for k, o in index.objects.items()], index, warnings
    if not drop:
        warnings = [w] if (w := mismatch_warning(state, mesh)) else []
        return [(k, tuple(o.path), read_object(k), rank_file(k, state, mesh)) for k, o in index.objects.items()], index, warnings
    kept = without(index, state)
    out = [(k, tuple(o.path), read_object(k), 0) for k, o in kept.objects.items()]
    fresh = fresh_entries(state, mesh)
    n = len(state.keys) + len(state.tensor_keys)
    note = (f"dataloader: dropped {n} entries" + (f" (saved at DP degree {state.dp_degree})" if state.dp_degree else "")
            + (f"; wrote an empty state for each of the {target_dp(mesh)} DP ranks, so torchtitan loads it and every "
               "rank starts its data from the beginning" if fresh else "; the job must not expect them "
               "(torchtitan: checkpoint.exclude_from_loading=['dataloader'])"))
    return out + fresh, kept, [note]
