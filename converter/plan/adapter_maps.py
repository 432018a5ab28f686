"""Key maps read from a framework's own code: ``--map torchtitan:MODEL[/FLAVOR]`` is torchtitan's
``state_dict_adapter`` (``to_hf`` for export-hf and diff, ``from_hf`` for import-hf).

The adapter runs in a subprocess (:mod:`converter.plan.titan_adapter`, as ``--plan torchtitan:``
does) on probes of the checkpoint's names, shapes and dtypes; what comes back is, for every
output tensor, an index expression (:mod:`converter.plan.index_expr`) saying exactly which
source elements it holds. :func:`source_of` turns each into the mapped view's
:class:`~converter.plan.mapped_view.Source`: a rename, a row permutation (Llama's RoPE q/k), one
expert of a grouped tensor, a stack of experts, a 2-d transpose, or a general strided gather
(splits, concatenations, reshapes). No tensor data is built: the conversion streams region by
region through the mapped view. Answers are cached per (map, direction, tensors, versions).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from converter.plan import index_expr as ix
from converter.plan.view_source import Source
from formats.errors import ConfigError

PREFIX = "torchtitan:"


def is_adapter_map(name: Any) -> bool:
    """Whether ``--map name`` is read from torchtitan's code."""
    return isinstance(name, str) and name.startswith(PREFIX)


@dataclass(frozen=True)
class AdapterResult:
    """The adapter's answer: output name -> (expression, shape, dtype); the inputs no output
    reads (the adapter drops them); the resolved ``torchtitan:MODEL/FLAVOR``."""

    tensors: Mapping[str, tuple[ix.Expr, tuple[int, ...], str]]
    unused: tuple[str, ...]
    resolved: str


@dataclass(frozen=True)
class AdapterMap:
    """``--map torchtitan:MODEL[/FLAVOR]`` (the attributes a hand-written KeyMap has, empty)."""

    name: str
    identity: bool = False
    export_only: bool = False
    transforms: Mapping[str, str] = field(default_factory=dict)
    from_hf: Mapping[str, Any] = field(default_factory=dict)
    experts: Mapping[str, str] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return self.name[len(PREFIX):]

    def exported(self, tensors: Mapping[str, tuple[Sequence[int], str]]) -> AdapterResult:
        """The adapter's ``to_hf`` of native ``tensors`` (name -> (shape, dtype))."""
        return self._run("to_hf", tensors)

    def imported(self, tensors: Mapping[str, tuple[Sequence[int], str]]) -> AdapterResult:
        """The adapter's ``from_hf`` of HF ``tensors`` (name -> (shape, dtype))."""
        return self._run("from_hf", tensors)

    def _run(self, direction: str, tensors: Mapping[str, tuple[Sequence[int], str]]) -> AdapterResult:
        from converter.plan.from_code import cache_file, cached_json, run_module

        if not self.target or self.target.startswith("/"):
            raise ConfigError(f"--map {self.name}: write torchtitan:MODEL or torchtitan:MODEL/FLAVOR, e.g. torchtitan:llama3")
        payload = json.dumps({k: [list(map(int, s)), d] for k, (s, d) in tensors.items()}, sort_keys=True)
        digest = hashlib.sha256(payload.encode()).hexdigest()
        path = cache_file(["adapter", self.target, direction, digest])
        doc = cached_json(path, lambda: run_module(
            ["converter.plan.titan_adapter", self.target, direction], "--map", f"--map {self.name}",
            "running torchtitan's state_dict_adapter", "check that the model's config builds", stdin=payload))
        out = {k: (ix.from_json(v["expr"]), tuple(v["shape"]), v["dtype"]) for k, v in doc["tensors"].items()}
        return AdapterResult(out, tuple(doc.get("unused", ())), doc.get("name", self.name))


def unused_note(result: AdapterResult, direction: str, what: str = "tensor") -> tuple[str, ...]:
    """The warning for the inputs the adapter dropped (none: no warning)."""
    if not result.unused:
        return ()
    shown = ", ".join(result.unused[:5]) + (f" and {len(result.unused) - 5} more" if len(result.unused) > 5 else "")
    return (f"{result.resolved}: torchtitan's adapter ({direction}) writes no output for {len(result.unused)} "
            f"{what}(s): {shown}; they are left out",)


# ---------------------------------------------------------------------------------------------
# expressions -> mapped-view sources


def source_of(e: ix.Expr, shapes: Mapping[str, Sequence[int]], keys: Mapping[str, str] | None = None) -> Source:
    """The :class:`Source` reading expression ``e`` (its keys renamed by ``keys``, e.g. model
    names -> checkpoint keys): the fastest exact form, else a general gather."""
    rename = dict(keys or {})
    simple = _simple(e, shapes)
    if simple is not None:
        return simple._replace(key=rename.get(simple.key, simple.key),
                               stack=tuple(rename.get(k, k) for k in simple.stack))
    return Source(rename.get(ix.sources_of(e)[0], ix.sources_of(e)[0]), expr=ix.renamed(e, rename))


def _canonical(e: ix.View) -> ix.View:
    """``e`` without size-1 view dims (they move nothing)."""
    return ix.View(e.key, e.offset, tuple(tuple(vd for vd in g if vd[0] != 1) for g in e.dims))


def _simple(e: ix.Expr, shapes: Mapping[str, Sequence[int]]) -> Source | None:
    if isinstance(e, ix.Cat):
        return _stack(e, shapes)
    v = _canonical(e)
    shape = tuple(shapes[v.key])
    whole = _canonical(ix.leaf(v.key, shape))
    if v == whole:
        return Source(v.key)
    if len(shape) >= 1 and v.dims[1:] == whole.dims[1:] and len(v.dims) == len(shape):
        rows = _rows(v, shape)
        if rows is not None:
            return Source(v.key, rows)
    if len(shape) >= 2 and len(v.dims) == len(shape) - 1 and v.dims == whole.dims[1:]:
        row = math.prod(shape[1:])
        if v.offset % max(row, 1) == 0:
            return Source(v.key, index=v.offset // max(row, 1))
    if len(shape) == 2 and v.offset == 0 and v.dims == (whole.dims[1], whole.dims[0]):
        return Source(v.key, transpose=True)
    return None


def _rows(v: ix.View, shape: Sequence[int]) -> np.ndarray | None:
    """The source rows of a view whose only change is which rows of dim 0 it takes (in order)."""
    row = math.prod(shape[1:])
    if row == 0 or v.offset % row or any(stride % row for _, stride in v.dims[0]):
        return None
    rows = (ix.gather_offsets(v, [0], [v.shape[0]])[0] + v.offset) // row
    return rows.astype(np.int64)


def _stack(e: ix.Cat, shapes: Mapping[str, Sequence[int]]) -> Source | None:
    """A concatenation along a new dim 0 of whole tensors: torchtitan's experts stack."""
    if e.dim != 0:
        return None
    keys = []
    for p in e.parts:
        if not isinstance(p, ix.View) or p.shape[:1] != (1,):
            return None
        v = _canonical(p)
        whole = _canonical(ix.leaf(v.key, tuple(shapes[v.key])))
        if (v.offset, v.dims[1:]) != (0, whole.dims) or v.dims[0]:
            return None
        keys.append(v.key)
    return Source("", stack=tuple(keys))
