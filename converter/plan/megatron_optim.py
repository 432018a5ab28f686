"""megatron-core's ``dp_reshardable`` DistributedOptimizer state as ``fully_reshardable`` tensors (pure).

``dp_reshardable`` (Megatron-LM's default ``--ckpt-format torch_dist`` optimizer format) saves the
DistributedOptimizer's internal buffers: per data-parallel group ``dp_group_idx_<i>`` (one per
(tp, pp) cell; the experts' optimizer: one per (etp, ep, pp) cell, keys prefixed ``chained_1.``), per
buffer and bucket, one flat fp32 tensor per state::

    [chained_<k>.]optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_(<param>, <grad>).bucket_idx_<b>.<state>

plus ShardedObjects ``...dp_group_idx_<i>.{optimizer,per_bucket_numel,per_bucket_numel_unpadded}``.
Megatron reshards them over DP only: after a TP/PP change Megatron-LM cannot load them. This module
says where each parameter lies in them (the model's parameters in megatron's buffer order, buckets
cut where ``per_bucket_numel_unpadded`` says: :mod:`formats.megatron.buffers`) and so gives
``fully_reshardable``'s tensors ``optimizer.state.<state>.<key>``: the parameter's shape and boxes,
each box a range of a flat bucket (:class:`FlatSource`). :class:`converter.run.optim_view` reads
through them; any target layout then gets the optimizer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from converter.plan.megatron_legacy import LegacyLayout, RankFolder, optimizer_buffers, rank_chunks
from formats.base import Box, CheckpointIndex
from formats.errors import CorruptCheckpointError, UnsupportedError
from formats.megatron.buffers import PARAM_ALIGN, BufferParam

FLAT = re.compile(r"(?P<prefix>(?:chained_\d+\.)?)optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\.gbuf_idx_"
                  r"(?P<gbuf>\d+)\.dtype_(?P<dtype>\(.+?\))\.bucket_idx_(?P<bucket>\d+)\.(?P<state>\w+)")
GROUP_OBJECT = re.compile(r"(?P<prefix>(?:chained_\d+\.)?)optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\."
                          r"(?P<name>\w+)(?:/shard_.+)?")


@dataclass(frozen=True)
class FlatSource:
    """A view chunk's bytes: ``numel`` elements of the flat ``key`` from element ``offset`` on (the
    chunk's box in C order)."""

    key: str
    offset: int
    numel: int


@dataclass(frozen=True)
class ViewTensor:
    """A ``fully_reshardable`` tensor: dtype, shape, and its chunks as (box, flat source)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[Box, FlatSource], ...]


def has_dp_reshardable(keys: Sequence[str]) -> bool:
    """Whether a checkpoint holds ``dp_reshardable`` optimizer buffers."""
    return any(FLAT.fullmatch(k) for k in keys)


def layout_of_bucket_numels(params: Sequence[tuple[str, int]], numels: Sequence[int]) -> list[BufferParam]:
    """Each parameter's range in the unpadded buffer, buckets cut where their sizes say (``params``:
    ``(name, numel)`` in ``named_parameters()`` order; laid out in reverse, 64-element aligned within
    a bucket). A layout the sizes do not allow is refused."""
    out, bucket, start, offset = [], 0, 0, 0
    for name, numel in reversed(list(params)):
        if bucket >= len(numels):
            raise UnsupportedError(f"parameter {name!r} does not fit in the {len(numels)} bucket(s) per_bucket_numel "
                                   "lists; the model's parameters are not the optimizer's")
        start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
        end = start + numel
        out.append(BufferParam(name, numel, bucket, offset + start, offset + end))
        if end >= numels[bucket]:
            if end != numels[bucket]:
                raise UnsupportedError(f"parameter {name!r} ends at {end} in bucket {bucket} of {numels[bucket]} "
                                       "elements; the model's parameters are not the optimizer's buffers")
            offset, bucket, start = offset + end, bucket + 1, 0
        else:
            start = end
    if bucket != len(numels):
        raise UnsupportedError(f"the model's parameters fill {bucket} of {len(numels)} optimizer buckets")
    return out


def _group_folders(layout: LegacyLayout) -> dict[tuple[str, int], tuple[RankFolder, bool | None]]:
    """(key prefix, dp group index) -> (the rank folder whose buffers it is, experts?) in megatron's
    rank order (dense groups: index tp + TP * pp; expert groups: etp + ETP * ep + ETP * EP * pp)."""
    out = {}
    dense = "chained_0." if layout.chained else ""
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            out[(dense, tp + layout.tp * pp)] = (RankFolder(tp, pp, 0), False if layout.chained else None)
    if layout.chained:
        etp = layout.expert_tp
        for pp in range(layout.pp):
            for ep in range(layout.ep):
                for t in range(etp):
                    out[("chained_1.", t + etp * ep + etp * layout.ep * pp)] = (RankFolder(t, pp, ep), True)
    return out


def plan_view(index: CheckpointIndex, layout: LegacyLayout, bucket_numels: Mapping[tuple[str, int], list],
              tied: bool) -> tuple[dict[str, ViewTensor], set[str]]:
    """(the ``fully_reshardable`` tensors, the flat keys they replace) of a ``dp_reshardable``
    checkpoint saved on ``layout``; ``bucket_numels``: per (prefix, dp group) the
    ``per_bucket_numel_unpadded`` value (one ``{(param dtype, grad dtype): [bucket numels]}`` per
    buffer)."""
    flats: dict[tuple[str, int, int, int], dict[str, str]] = {}
    for key in index.tensors:
        m = FLAT.fullmatch(key)
        if m is not None:
            ident = (m.group("prefix"), int(m.group("group")), int(m.group("gbuf")), int(m.group("bucket")))
            flats.setdefault(ident, {})[m.group("state")] = key
    folders = _group_folders(layout)
    view: dict[str, ViewTensor] = {}
    boxes: dict[str, list] = {}
    for (prefix, group), numels in sorted(bucket_numels.items()):
        if (prefix, group) not in folders:
            raise CorruptCheckpointError(f"optimizer group {prefix}dp_group_idx_{group} does not exist on the saved "
                                         f"layout (tp{layout.tp} pp{layout.pp} ep{layout.ep}); the args do not match")
        folder, experts = folders[(prefix, group)]
        chunks = rank_chunks(index, layout, folder, tied)
        for g, (_, _, members) in enumerate(optimizer_buffers(chunks, experts)):
            sizes = _bucket_sizes(numels, g, prefix, group)
            placed = layout_of_bucket_numels([(str(i), t.slot.nbytes // _itemsize(t.slot.dtype))
                                              for i, t in enumerate(members)], sizes)
            starts = [sum(sizes[:b]) for b in range(len(sizes))]
            for p in placed:
                t = members[int(p.name)]
                states = flats.get((prefix, group, g, p.bucket))
                if not states:
                    raise CorruptCheckpointError(f"no flat optimizer bucket {prefix}dp_group_idx_{group}.gbuf_idx_{g}"
                                                 f".bucket_idx_{p.bucket} for parameter {t.key!r}")
                for state, flat in states.items():
                    okey = f"optimizer.state.{state}.{t.key}"
                    seen = boxes.setdefault(okey, [])
                    for f in t.fills:
                        if (f.box.offsets, f.box.sizes) in seen:
                            continue  # a replica (TP-replicated, or another expert rank's copy)
                        seen.append((f.box.offsets, f.box.sizes))
                        src = FlatSource(flat, p.start - starts[p.bucket] + f.offset, f.box.numel)
                        old = view.get(okey)
                        entry = index.tensors[flat]
                        chunk = ((f.box, src),)
                        view[okey] = ViewTensor(okey, entry.dtype, tuple(index.tensors[t.key].shape),
                                                (old.chunks if old else ()) + chunk)
    return view, {k for states in flats.values() for k in states.values()}


def _bucket_sizes(numels: Any, g: int, prefix: str, group: int) -> list[int]:
    try:
        (sizes,) = numels[g].values()
        return [int(n) for n in sizes]
    except (IndexError, KeyError, TypeError, ValueError, AttributeError):
        raise CorruptCheckpointError(f"{prefix}optimizer.distributed.dp_group_idx_{group}.per_bucket_numel_unpadded "
                                     f"has no buffer {g}") from None


def _itemsize(dtype: str) -> int:
    from formats.dtypes import itemsize_of

    return itemsize_of(dtype)


def group_objects(keys: Sequence[str]) -> dict[str, tuple[str, int, str]]:
    """key -> (prefix, dp group, name) of the dp_reshardable groups' ShardedObjects."""
    out = {}
    for key in keys:
        m = GROUP_OBJECT.fullmatch(key)
        if m is not None:
            out[key] = (m.group("prefix"), int(m.group("group")), m.group("name"))
    return out
