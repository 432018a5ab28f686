"""Where a target tensor of a renamed view comes from (:class:`Source`), apart from the view
itself (:mod:`converter.plan.mapped_view`) so that key maps built from code
(:mod:`converter.plan.adapter_maps`) name sources without importing the view that imports them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from converter.plan import index_expr as ix


class Source(NamedTuple):
    """Where a target tensor comes from: the source key and a row permutation (or None); or one
    expert ``index`` of a grouped-experts source ``[E, ...]`` (the slice ``[index]``, dim 0
    dropped), or one layer of a Megatron layer-stacked source ``[L, ...]`` (the same slice, its rows
    then permuted when ``perm`` is given); or the ``stack`` of source keys (one per expert, a new
    dim 0; ``key`` unused). ``index`` may be a tuple of leading indices: one expert of one layer of
    Megatron's layer- and expert-stacked ``[L, E, ...]``. ``transpose``: the target is the 2-D transpose of that (an HF
    ``Conv1D`` weight, ``[in, out]``, from a ``Linear`` one, ``[out, in]``): its chunks are the
    source's transposed and a region reads the transposed source box, transposed in memory.
    ``expr``: any other rearrangement, an index expression (:mod:`converter.plan.index_expr`: a
    strided view of one source, or a concatenation of such views); ``key`` is then its first
    source."""

    key: str
    perm: np.ndarray | None = None  # int64 row indices
    index: int | tuple[int, ...] | None = None
    stack: tuple[str, ...] = ()
    transpose: bool = False
    expr: Any = None


class ObjectSource(NamedTuple):
    """A non-tensor entry of a renamed view: its object path, and the source entry whose bytes it
    is, or its own new bytes (a renamed param group's ``params`` list)."""

    path: tuple
    key: str | None = None
    data: bytes | None = None


def source_keys(src: Source) -> tuple[str, ...]:
    """The source keys ``src`` reads, in order of first use."""
    if src.expr is not None:
        return tuple(ix.sources_of(src.expr))
    return src.stack if src.stack else (src.key,)


def rekeyed(src: Source, keys: Mapping[str, str]) -> Source:
    """``src`` reading ``keys[k]`` wherever it read source ``k`` (keys not in ``keys`` kept)."""
    expr = None if src.expr is None else ix.renamed(src.expr, keys)
    return src._replace(key=keys.get(src.key, src.key), stack=tuple(keys.get(k, k) for k in src.stack), expr=expr)


def is_plain(src: Source) -> bool:
    """Whether ``src`` is a whole source tensor under another name (no rows, slice, stack,
    transpose or gather)."""
    return src.perm is None and src.index is None and not src.stack and not src.transpose and src.expr is None
