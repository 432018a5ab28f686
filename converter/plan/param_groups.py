"""A checkpoint's optimizer param groups, whichever form they were saved in (pure).

``get_state_dict``'s default (nested) form saves each group's hyperparameters as
``optim.param_groups.<i>.<hparam>`` and its parameters' FQNs as ``optim.param_groups.<i>.params``;
``flatten_optimizer_state_dict=True`` (torchtitan's form) saves every parameter's own copy,
``optimizer.param_groups.<fqn>.<hparam>`` (atom ``fqn``, role ``hparam.<hparam>``), and equal
ones make a group.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from converter.plan.atoms import OPTIMIZER_ROOTS, AtomRef
from formats.base import CheckpointIndex


def group_slot(path: tuple) -> tuple[int, str] | None:
    """``(group number, hyperparameter)`` of a nested-form entry ``(..., optim, "param_groups", i,
    name)``, else None."""
    pos = next((i for i, p in enumerate(path) if p == "param_groups"), None)
    if pos is not None and pos >= 1 and path[pos - 1] in OPTIMIZER_ROOTS and len(path) == pos + 3 \
            and isinstance(path[pos + 1], int):
        return path[pos + 1], str(path[pos + 2])
    return None


def is_group_entry(path: tuple, ref: AtomRef) -> bool:
    """Whether an entry is part of the param groups (either form)."""
    return group_slot(tuple(path)) is not None or ref.role.startswith("hparam.")


def param_groups(index: CheckpointIndex, refs: Mapping[str, AtomRef],
                 values: Mapping[str, Any]) -> tuple[list[dict], list[list[str]] | None]:
    """(hyperparameters per group, FQNs per group or None when no group lists its params).

    ``values``: the value of every object the source has under a param_groups path."""
    indexed: dict[int, dict[str, Any]] = {}
    per_fqn: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        slot = group_slot(tuple(index.objects[key].path))
        if slot is not None:
            indexed.setdefault(slot[0], {})[slot[1]] = value
        elif refs[key].role.startswith("hparam."):
            per_fqn.setdefault(refs[key].atom, {})[refs[key].role[len("hparam."):]] = value
    if indexed:
        groups = [indexed[i] for i in sorted(indexed)]
        params = [list(g.pop("params", [])) for g in groups]
        return groups, params if any(params) else None
    if per_fqn:  # torchtitan: hyperparameters per parameter; equal ones form a group
        groups, params, seen = [], [], {}
        for fqn, hp in per_fqn.items():
            sig = signature(hp)
            if sig not in seen:
                seen[sig] = len(groups)
                groups.append(dict(hp))
                params.append([])
            params[seen[sig]].append(fqn)
        return groups, params
    return [], None


def signature(hparams: Mapping[str, Any]) -> str:
    """A group's identity: its hyperparameters and their values (equal for equal groups)."""
    return json.dumps(sorted(hparams.items()), default=repr)
