"""Index expressions: which source elements each element of a rearranged tensor is (pure).

A framework's state-dict adapter moves data without computing on it: views, reshapes,
transposes, splits, concatenations, stacks. Such a tensor is described exactly, whatever its
size, by an expression over its sources' C-order element indices:

- :class:`View`: a strided view of one source tensor. Each target dim is a group of *view dims*
  ``(size, stride)`` (C order inside the group); element ``(i_0, ..., i_n)`` is source flat index
  ``offset + sum(j_v * stride_v)`` where ``j`` unravels each ``i_t`` over its group's sizes.
  Reshapes split and merge groups, permutes reorder them, narrows move the offset.
- :class:`Cat`: parts concatenated along one target dim (``torch.cat``, ``torch.stack``).

Every op below returns a new expression, or raises :class:`UnsupportedError` when the result is
not one (e.g. a reshape of a concatenation across its cat dim). The expressions are JSON-able
(:func:`to_json` / :func:`from_json`), and :func:`source_boxes` / :func:`gather_offsets` turn one
into region reads (see :mod:`converter.run.mapped_reader`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from formats.errors import UnsupportedError

Dim = tuple[tuple[int, int], ...]  # the view dims (size, stride) of one target dim


@dataclass(frozen=True)
class View:
    """A strided view of source ``key`` (see the module docstring)."""

    key: str
    offset: int
    dims: tuple[Dim, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(math.prod(s for s, _ in g) for g in self.dims)


@dataclass(frozen=True)
class Cat:
    """``parts`` concatenated along target dim ``dim``."""

    dim: int
    parts: tuple[Expr, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        first = list(self.parts[0].shape)
        first[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return tuple(first)


Expr = Union[View, Cat]


def leaf(key: str, shape: Sequence[int]) -> View:
    """The whole source tensor ``key`` of ``shape`` (C-contiguous)."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    return View(key, 0, tuple(((int(n), int(s)),) for n, s in zip(shape, strides)))


def _unsupported(what: str) -> UnsupportedError:
    return UnsupportedError(f"the adapter {what}; ckptconv cannot stream that rearrangement")


def _norm(dim: int, ndim: int) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise _unsupported(f"uses dim {dim} of a {ndim}-d tensor")
    return dim % max(ndim, 1)


# ---------------------------------------------------------------------------------------------
# ops


def reshape(e: Expr, shape: Sequence[int]) -> Expr:
    """``e.reshape(shape)`` (``-1`` inferred)."""
    shape = _infer(list(shape), math.prod(e.shape))
    if isinstance(e, Cat):
        d = e.dim
        if tuple(shape[: d + 1]) == tuple(e.shape[: d + 1]):
            return Cat(d, tuple(reshape(p, [*p.shape[: d + 1], *shape[d + 1:]]) for p in e.parts))
        raise _unsupported(f"reshapes a concatenation {list(e.shape)} across its cat dim to {list(shape)}")
    flat = _coalesced([vd for g in e.dims for vd in g if vd[0] != 1])
    groups: list[Dim] = []
    for n in shape:
        group: list[tuple[int, int]] = []
        need = n
        while need > 1:
            if not flat:
                raise _unsupported(f"reshapes {list(e.shape)} to {list(shape)}")
            size, stride = flat[0]
            if size <= need and need % size == 0:
                group.append(flat.pop(0))
                need //= size
            elif size % need == 0:  # split the view dim: outer part here, inner part next
                group.append((need, stride * (size // need)))
                flat[0] = (size // need, stride)
                need = 1
            else:
                raise _unsupported(f"reshapes {list(e.shape)} to {list(shape)} (not along its strides)")
        groups.append(tuple(group))
    return View(e.key, e.offset, tuple(groups))


def _coalesced(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``dims`` with each run of contiguous view dims (outer stride = inner size x stride) merged."""
    out: list[tuple[int, int]] = []
    for size, stride in dims:
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out


def _infer(shape: list[int], numel: int) -> list[int]:
    if shape.count(-1) == 1:
        known = math.prod(n for n in shape if n != -1)
        shape[shape.index(-1)] = numel // known if known else 0
    if math.prod(shape) != numel:
        raise _unsupported(f"reshapes {numel} elements to {shape}")
    return shape


def permute(e: Expr, order: Sequence[int]) -> Expr:
    """``e.permute(order)``."""
    n = len(e.shape)
    order = [_norm(d, n) for d in order]
    if sorted(order) != list(range(n)):
        raise _unsupported(f"permutes {n} dims by {order}")
    if isinstance(e, Cat):
        return Cat(order.index(e.dim), tuple(permute(p, order) for p in e.parts))
    return View(e.key, e.offset, tuple(e.dims[d] for d in order))


def transpose(e: Expr, a: int, b: int) -> Expr:
    """``e.transpose(a, b)``."""
    n = len(e.shape)
    order = list(range(n))
    a, b = _norm(a, n), _norm(b, n)
    order[a], order[b] = order[b], order[a]
    return permute(e, order)


def narrow(e: Expr, dim: int, start: int, length: int) -> Expr:
    """``e.narrow(dim, start, length)``."""
    dim = _norm(dim, len(e.shape))
    if start < 0 or length < 0 or start + length > e.shape[dim]:
        raise _unsupported(f"takes [{start}, {start + length}) of a dim of {e.shape[dim]}")
    if isinstance(e, Cat):
        if dim != e.dim:
            return Cat(e.dim, tuple(narrow(p, dim, start, length) for p in e.parts))
        parts, at = [], 0
        for p in e.parts:
            n = p.shape[dim]
            lo, hi = max(start, at), min(start + length, at + n)
            if lo < hi:
                parts.append(narrow(p, dim, lo - at, hi - lo))
            at += n
        return parts[0] if len(parts) == 1 else Cat(dim, tuple(parts)) if parts else narrow(e.parts[0], dim, 0, 0)
    return _narrow_view(e, dim, start, length)


def _narrow_view(e: View, dim: int, start: int, length: int) -> Expr:
    group = e.dims[dim]
    if length == e.shape[dim]:
        return e
    if not length:  # empty: nothing is read
        return _with(e, dim, ((0, 1),))
    (size, stride), rest = group[0], group[1:]
    inner = math.prod(s for s, _ in rest)
    if start % inner == 0 and length % inner == 0:
        return _with(e, dim, ((length // inner, stride), *rest), e.offset + (start // inner) * stride)
    pieces: list[Expr] = []  # a range across rows of the inner dims: head, whole rows, tail
    at, end = start, start + length
    while at < end:
        row, col = divmod(at, inner)
        if col == 0 and end - at >= inner:
            rows = (end - at) // inner
            pieces.append(_with(e, dim, ((rows, stride), *rest), e.offset + row * stride))
            at += rows * inner
            continue
        take = min(inner - col, end - at)
        sub = View(e.key, e.offset + row * stride, (*e.dims[:dim], rest, *e.dims[dim + 1:]))
        pieces.append(_narrow_view(sub, dim, col, take))
        at += take
    return pieces[0] if len(pieces) == 1 else Cat(dim, tuple(pieces))


def _with(e: View, dim: int, group: Dim, offset: int | None = None) -> View:
    return View(e.key, e.offset if offset is None else offset, (*e.dims[:dim], group, *e.dims[dim + 1:]))


def squeeze(e: Expr, dim: int) -> Expr:
    """``e.squeeze(dim)`` (no-op when that dim is not 1)."""
    dim = _norm(dim, len(e.shape))
    if e.shape[dim] != 1:
        return e
    if isinstance(e, Cat):
        if dim == e.dim:
            return squeeze(e.parts[0], dim)
        return Cat(e.dim - (dim < e.dim), tuple(squeeze(p, dim) for p in e.parts))
    return View(e.key, e.offset, (*e.dims[:dim], *e.dims[dim + 1:]))


def unsqueeze(e: Expr, dim: int) -> Expr:
    """``e.unsqueeze(dim)``."""
    dim = _norm(dim, len(e.shape) + 1)
    if isinstance(e, Cat):
        return Cat(e.dim + (dim <= e.dim), tuple(unsqueeze(p, dim) for p in e.parts))
    return View(e.key, e.offset, (*e.dims[:dim], (), *e.dims[dim:]))


def cat(parts: Sequence[Expr], dim: int) -> Expr:
    """``torch.cat(parts, dim)`` (nested concatenations along the same dim flattened)."""
    parts = [p for p in parts if p.shape[_norm(dim, len(p.shape))]] or list(parts[:1])
    dim = _norm(dim, len(parts[0].shape))
    flat: list[Expr] = []
    for p in parts:
        flat += list(p.parts) if isinstance(p, Cat) and p.dim == dim else [p]
    return flat[0] if len(flat) == 1 else Cat(dim, tuple(flat))


def stack(parts: Sequence[Expr], dim: int) -> Expr:
    """``torch.stack(parts, dim)``."""
    return cat([unsqueeze(p, dim) for p in parts], dim)



def renamed(e: Expr, keys: Mapping[str, str]) -> Expr:
    """``e`` with its source keys renamed by ``keys`` (keys not in it kept)."""
    if isinstance(e, Cat):
        return Cat(e.dim, tuple(renamed(p, keys) for p in e.parts))
    return View(keys.get(e.key, e.key), e.offset, e.dims)


def rows(key: str, shape: Sequence[int], take: Sequence[int] | np.ndarray) -> Expr:
    """Rows ``take`` (in that order) of the whole source ``key`` of ``shape``: one strided view
    when the row indices are a mixed-radix pattern (a slice, RoPE's per-head interleave, a
    per-group split), else the concatenation of its runs of consecutive rows."""
    take = np.asarray(take, dtype=np.int64)
    whole = leaf(key, shape)
    row = math.prod(shape[1:])
    dims = _row_radix(take)
    if dims is not None:
        first, groups = dims
        return View(key, first * row, (tuple((n, s * row) for n, s in groups), *whole.dims[1:]))
    cuts = np.flatnonzero(np.diff(take) != 1) + 1
    parts = [narrow(whole, 0, int(r[0]), len(r)) for r in np.split(take, cuts)]
    return cat(parts, 0)


def _row_radix(take: np.ndarray) -> tuple[int, tuple[tuple[int, int], ...]] | None:
    """``(first, ((size, stride), ...))`` (outermost first, positive strides) with ``take[t] =
    first + sum(j_v * stride_v)`` for ``t`` unravelled over the sizes; None when ``take`` is not such
    a pattern."""
    if not len(take):
        return None
    first, cur = int(take[0]), take - take[0]
    inner_first: list[tuple[int, int]] = []
    while len(cur) > 1:
        step = int(cur[1] - cur[0])
        if step <= 0:
            return None
        off = np.flatnonzero(np.diff(cur) != step)
        run = int(off[0]) + 1 if len(off) else len(cur)
        if len(cur) % run:
            return None
        blocks = cur.reshape(-1, run)
        if not np.array_equal(blocks - blocks[:, :1], np.broadcast_to(np.arange(run, dtype=np.int64) * step, blocks.shape)):
            return None
        inner_first.append((run, step))
        cur = blocks[:, 0]
    return first, tuple(reversed(inner_first)) or ((1, 1),)

# ---------------------------------------------------------------------------------------------
# JSON


def to_json(e: Expr) -> dict[str, Any]:
    if isinstance(e, Cat):
        return {"cat": e.dim, "parts": [to_json(p) for p in e.parts]}
    return {"key": e.key, "offset": e.offset, "dims": [[list(vd) for vd in g] for g in e.dims]}


def from_json(doc: Any) -> Expr:
    if "cat" in doc:
        return Cat(int(doc["cat"]), tuple(from_json(p) for p in doc["parts"]))
    return View(str(doc["key"]), int(doc["offset"]), tuple(tuple((int(s), int(t)) for s, t in g) for g in doc["dims"]))


def sources_of(e: Expr) -> list[str]:
    """The source keys ``e`` reads, in order of first use."""
    if isinstance(e, Cat):
        return list(dict.fromkeys(k for p in e.parts for k in sources_of(p)))
    return [e.key]


# ---------------------------------------------------------------------------------------------
# reading a region of a View


def _dim_offsets(group: Dim, start: int, stop: int) -> np.ndarray:
    """Source flat offsets (without the view's offset) of target indices ``start..stop-1`` of one
    target dim (its view dims unravelled in C order)."""
    i = np.arange(start, stop, dtype=np.int64)
    out = np.zeros(len(i), dtype=np.int64)
    for size, stride in reversed(group):
        out += (i % size) * stride
        i //= size
    return out


def gather_offsets(e: View, offsets: Sequence[int], sizes: Sequence[int]) -> list[np.ndarray]:
    """Per target dim, the source flat offsets of the region ``offsets`` + ``sizes`` (their outer
    sum plus ``e.offset`` is each element's source flat index)."""
    return [_dim_offsets(g, o, o + n) for g, o, n in zip(e.dims, offsets, sizes)]


def _c_strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def _digits(a: np.ndarray, shape: Sequence[int], strides: Sequence[int]) -> list[np.ndarray]:
    """Flat offsets ``a`` as indices along each dim of ``shape`` (dim 0 unbounded)."""
    return [a // strides[k] if k == 0 else (a // strides[k]) % shape[k] for k in range(len(shape))]


def source_box(e: View, source_shape: Sequence[int], offsets: Sequence[int],
               sizes: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...], list[np.ndarray]]:
    """(box offsets, box sizes, per-target-dim offsets into that box) of the region ``offsets``
    + ``sizes`` of ``e``: the smallest box of the source holding every element the region reads,
    and, per target dim, where its indices lie in the box's C order (the outer sum of the arrays
    is each element's flat index in the box). Each target dim's source offsets are split into
    per-source-dim indices; a view whose dims carry from one source dim into the next (no
    reshape of the source gives one) is refused."""
    per_dim = gather_offsets(e, offsets, sizes)
    n = len(source_shape)
    if not n or 0 in sizes:
        return tuple(0 for _ in source_shape), tuple(0 if 0 in sizes else 1 for _ in source_shape), per_dim
    strides = _c_strides(source_shape)
    contrib = [_digits(a, source_shape, strides) for a in per_dim]
    base = [int(d[0]) for d in _digits(np.array([e.offset], dtype=np.int64), source_shape, strides)]
    lo = [base[k] + sum(int(c[k].min()) for c in contrib) for k in range(n)]
    hi = [base[k] + sum(int(c[k].max()) for c in contrib) + 1 for k in range(n)]
    if any(h > s for h, s in zip(hi, source_shape)):
        return _row_band(e, source_shape, strides, per_dim)
    box = [h - o for h, o in zip(hi, lo)]
    bstrides = _c_strides(box)
    local = [sum(c[k] * bstrides[k] for k in range(n)) for c in contrib]
    if local:  # (a 0-d target reads the box's one element: lo is its index, the shift 0)
        local[0] = local[0] + sum((base[k] - lo[k]) * bstrides[k] for k in range(n))
    return tuple(lo), tuple(box), local


def _row_band(e: View, source_shape: Sequence[int], strides: Sequence[int],
              per_dim: list[np.ndarray]) -> tuple[tuple[int, ...], tuple[int, ...], list[np.ndarray]]:
    """:func:`source_box` as the band of whole dim-0 rows between the region's first and last
    source element (flat offsets need no per-dim split)."""
    first = e.offset + sum(int(a.min()) for a in per_dim)
    last = e.offset + sum(int(a.max()) for a in per_dim)
    r0, r1 = first // strides[0], last // strides[0] + 1
    local = [a.copy() for a in per_dim]
    local[0] += e.offset - r0 * strides[0]
    return (r0, *(0 for _ in source_shape[1:])), (r1 - r0, *source_shape[1:]), local
