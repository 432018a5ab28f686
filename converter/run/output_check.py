"""The last step of every conversion before its output is published: what the writer is about to
commit (:class:`formats.manifest.Manifest`, built from the metadata it writes) must be the plan
(:class:`PlannedOutput`): every planned tensor recorded exactly once with its planned dtype and
shape, nothing else, the planned non-tensor entries once each, and no two records over the same
bytes. A mismatch is a bug of ckptconv, never the input's: an :class:`InternalError` naming the
key, raised before the marker, so nothing is published.

Linear in records and extents (one pass each, one numpy sort of the extents): at 10^6 chunks a
fraction of what writing their metadata takes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from formats.dtypes import BY_NAME
from formats.errors import InternalError
from formats.fsutil import short
from formats.manifest import WHOLE, Manifest


@dataclass(frozen=True)
class PlannedOutput:
    """What a conversion plans its output to hold: tensor key -> (dtype name, shape), and the
    non-tensor entries' keys. Build it with :meth:`of` from the plan's own values."""

    tensors: Mapping[str, tuple[str, tuple[int, ...]]]
    objects: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, str, Iterable[int]]], objects: Iterable[str] = ()) -> PlannedOutput:
        """From ``(key, dtype, shape)`` items (a key planned twice is itself a bug: refused)."""
        planned: dict[str, tuple[str, tuple[int, ...]]] = {}
        for key, dtype, shape in tensors:
            if key in planned:
                raise InternalError(f"internal error: the plan names tensor {short(repr(key))} twice")
            planned[key] = (_dtype(dtype), tuple(int(n) for n in shape))
        return cls(planned, frozenset(objects))

    @classmethod
    def of_entries(cls, tensors: Mapping[str, Any], objects: Iterable[str] = ()) -> PlannedOutput:
        """Every tensor of ``tensors`` (key -> :class:`formats.base.TensorEntry`), as it is."""
        return cls.of(((k, e.dtype, e.shape) for k, e in tensors.items()), objects)


def _dtype(name: str) -> str:
    d = BY_NAME.get(name)
    return d.name if d is not None else name


def check_output(op: str, planned: PlannedOutput, manifest: Manifest) -> None:
    """Raise :class:`InternalError` (one line naming the key) unless ``manifest`` is ``planned``."""
    problem = _tensor_problem(planned, manifest) or _object_problem(planned, manifest) \
        or _shared_problem(manifest) or (manifest.problems[0] if manifest.problems else None)
    if problem is not None:
        raise InternalError(f"internal error: {op}: the output is not its plan: {problem}; nothing was published "
                            "(please report this bug)")


def _tensor_problem(planned: PlannedOutput, m: Manifest) -> str | None:
    if len(set(m.keys)) != len(m.keys):
        key = next(k for k, n in Counter(m.keys).items() if n > 1)
        return f"tensor {short(repr(key))} is recorded {Counter(m.keys)[key]} times"
    recorded = dict(zip(m.keys, zip(m.dtypes, m.shapes)))
    missing = next((k for k in planned.tensors if k not in recorded), None)
    if missing is not None:
        dtype, shape = planned.tensors[missing]
        return f"planned tensor {short(repr(missing))} ({dtype} {list(shape)}) is not recorded"
    if len(recorded) != len(planned.tensors):
        extra = next(k for k in recorded if k not in planned.tensors)
        return f"tensor {short(repr(extra))} is recorded but not planned"
    for key, (dtype, shape) in planned.tensors.items():
        got_dtype, got_shape = recorded[key]
        if _dtype(got_dtype) != dtype or tuple(got_shape) != shape:
            return (f"tensor {short(repr(key))} is recorded as {got_dtype} {list(got_shape)}, planned as "
                    f"{dtype} {list(shape)}")
    return None


def _object_problem(planned: PlannedOutput, m: Manifest) -> str | None:
    counts = Counter(m.objects)
    twice = next((k for k, n in counts.items() if n > 1), None)
    if twice is not None:
        return f"non-tensor entry {short(repr(twice))} is recorded {counts[twice]} times"
    missing = next((k for k in planned.objects if k not in counts), None)
    if missing is not None:
        return f"planned non-tensor entry {short(repr(missing))} is not recorded"
    extra = next((k for k in counts if k not in planned.objects), None)
    if extra is not None:
        return f"non-tensor entry {short(repr(extra))} is recorded but not planned"
    return None


def _shared_problem(m: Manifest) -> str | None:
    """Two extents over the same bytes of one file (empty extents hold no bytes)."""
    if not m.owners:
        return None
    ids: dict[str, int] = {}
    file_ids = np.fromiter((ids.setdefault(f, len(ids)) for f in m.files), dtype=np.int64, count=len(m.files))
    begins = np.asarray(m.begins, dtype=np.int64)
    ends = np.asarray(m.ends, dtype=np.int64)
    keep = np.flatnonzero(ends > begins)
    order = keep[np.lexsort((begins[keep], file_ids[keep]))]
    f, b, e = file_ids[order], begins[order], ends[order]
    # sorted by (file, begin): disjoint exactly when each extent ends before the next one begins
    clash = np.flatnonzero((f[1:] == f[:-1]) & (b[1:] < e[:-1]))
    if not len(clash):
        return None
    i, j = int(order[clash[0]]), int(order[clash[0] + 1])
    a, b_ = m.owners[i], m.owners[j]
    who = f"tensors {short(repr(a))} and {short(repr(b_))}" if a != b_ else f"two chunks of {short(repr(a))}"
    if WHOLE in (m.ends[i], m.ends[j]):
        return f"{who} are both stored in {short(m.files[i])}"
    return f"{who} share bytes {m.begins[j]}-{min(m.ends[i], m.ends[j])} of {short(m.files[i])}"
