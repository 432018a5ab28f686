"""A reader view of a megatron torch_dist checkpoint whose ``dp_reshardable`` optimizer state reads as
``fully_reshardable`` (:mod:`converter.plan.megatron_optim`): the flat per-bucket buffers and their
per-group objects give way to ``optimizer.state.<state>.<key>`` tensors of the parameters' shapes,
and the common state names the new sharding type and holds the optimizer's param groups, as a
``fully_reshardable`` save keeps them. Megatron loads the result on any TP / PP layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from converter.plan.megatron_optim import FlatSource, ViewTensor, group_objects, has_dp_reshardable, plan_view
from formats.base import Box, CheckpointIndex, CheckpointReader, ChunkRef, TensorEntry, copy_bits_into
from formats.dtypes import by_name, from_storage_array
from formats.errors import ConfigError

if TYPE_CHECKING:
    import torch

COMMON = "common_state/shard_0_1"
FULLY_RESHARDABLE = "fully_reshardable"


class OptimizerView:
    """:class:`CheckpointReader` over ``reader`` with ``view`` tensors added, ``drop`` keys left
    out and ``objects`` (key -> bytes) replacing the source's."""

    def __init__(self, reader: CheckpointReader, view: Mapping[str, ViewTensor], drop: set[str],
                 objects: Mapping[str, bytes]) -> None:
        from dataclasses import replace

        from formats.dcp.reader import guess_path

        self.reader, self.view, self._objects = reader, dict(view), dict(objects)
        src = reader.index()
        tensors = {k: e for k, e in src.tensors.items() if k not in drop}
        for key, v in self.view.items():
            chunks = tuple(ChunkRef(box, f"(view of {s.key})", (key, i)) for i, (box, s) in enumerate(v.chunks))
            tensors[key] = TensorEntry(key, v.dtype, v.shape, chunks, guess_path(key))
        objects_ = {k: o for k, o in src.objects.items() if k not in drop}
        self._index = replace(src, tensors=tensors, objects=objects_)

    def index(self) -> CheckpointIndex:
        return self._index

    def _flat_bits(self, key: str, chunk: ChunkRef, region: Box) -> np.ndarray:
        """``region`` of view chunk ``chunk``: the span of its flat range the region covers, read from
        the flat tensor's chunks, then the region's elements picked from it."""
        box, src = self.view[key].chunks[chunk.locator[1]]
        rel = region.relative_to(box)
        strides = [math.prod(box.sizes[d + 1:]) for d in range(box.ndim)]
        first = sum(o * s for o, s in zip(rel.offsets, strides))
        last = first + sum((n - 1) * s for n, s in zip(rel.sizes, strides)) if region.numel else first - 1
        dtype = by_name(self.view[key].dtype).numpy_dtype
        span = np.empty(last - first + 1, dtype=dtype)
        self._read_flat(src, first, span)
        if not region.numel:
            return np.empty(region.sizes, dtype=dtype)
        picked = np.lib.stride_tricks.as_strided(span, shape=region.sizes,
                                                 strides=tuple(s * span.itemsize for s in strides), writeable=False)
        return np.array(picked, order="C")

    def _read_flat(self, src: FlatSource, first: int, out: np.ndarray) -> None:
        """Fill ``out`` with the flat tensor's elements from ``src.offset + first`` on."""
        entry = self.reader.index().tensors[src.key]
        a, b = src.offset + first, src.offset + first + out.size
        view = memoryview(out.view(np.uint8))
        isz = out.itemsize
        for c in entry.chunks:
            lo, hi = max(a, c.box.offsets[0]), min(b, c.box.offsets[0] + c.box.sizes[0])
            if lo < hi:
                self.reader.read_region_into(src.key, c, Box((lo,), (hi - lo,)), view[(lo - a) * isz:(hi - a) * isz])

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        if key not in self.view:
            return self.reader.read_region(key, chunk, region)
        return from_storage_array(self._flat_bits(key, chunk, region), self.view[key].dtype)

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        if key not in self.view:
            self.reader.read_region_into(key, chunk, region, out)
            return
        copy_bits_into(self._flat_bits(key, chunk, region), out)

    def pending_checks(self, chunks: Iterable[ChunkRef]) -> bool:
        """Whether the source's checks of ``chunks`` (a view chunk: its flat tensor's) are open."""
        pending = getattr(self.reader, "pending_checks", None)
        if pending is None:
            return False
        source: list[ChunkRef] = []
        for c in chunks:
            loc = c.locator
            if type(loc) is tuple and len(loc) == 2 and loc[0] in self.view:
                flat = self.view[loc[0]].chunks[loc[1]][1].key
                source += self.reader.index().tensors[flat].chunks
            else:
                source.append(c)
        return pending(source)

    def finish_checks(self, workers: int = 1) -> int:
        finish = getattr(self.reader, "finish_checks", None)
        return 0 if finish is None else finish(workers)

    def read_object_bytes(self, key: str) -> bytes:
        return self._objects[key] if key in self._objects else self.reader.read_object_bytes(key)

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        if key not in self._objects:
            return self.reader.load_object(key, trust_pickle)
        from formats.objects import load_torch_object

        return load_torch_object(self._objects[key], f"{self._index.root}: key {key!r}", trust_pickle)

    def close(self) -> None:
        self.reader.close()

    def __getattr__(self, name: str) -> Any:  # framework_files, check_file, ...: the source's
        return getattr(self.reader, name)


def fully_reshardable(reader: CheckpointReader, trust_pickle: bool = False) -> CheckpointReader:
    """``reader``, or a view of it reading a ``dp_reshardable`` optimizer state as
    ``fully_reshardable`` (see the module docstring)."""
    index = reader.index()
    if not has_dp_reshardable(list(index.tensors)):
        return reader
    from formats.megatron.legacy import FRAMEWORK_MODULES
    from formats.objects import read_checked_object
    from formats.torch_file import file_resolver, read_torch_bytes, torch_save_bytes

    resolve = file_resolver(FRAMEWORK_MODULES, trust_pickle)

    def value(key: str) -> Any:
        v, _ = read_torch_bytes(read_checked_object(reader, key, trust_pickle), f"{index.root}: key {key!r}", resolve)
        return v[0] if isinstance(v, list) and len(v) == 1 else v

    if COMMON not in index.objects:
        raise ConfigError(f"{index.root}: dp_reshardable optimizer state but no {COMMON}")
    common = value(COMMON)
    groups = group_objects(list(index.objects))
    numels = {(p, g): value(k) for k, (p, g, name) in groups.items() if name == "per_bucket_numel_unpadded"}
    tied = not getattr(common.get("args"), "untie_embeddings_and_output_weights", "output_layer.weight" in index.tensors)
    layout, view, flats = _plan(index, common.get("args"), numels, tied)
    common = dict(common)
    common["optimizer"] = _group_state(groups, value, layout.chained)
    meta = dict(common.get("content_metadata") or {})
    meta["distrib_optim_sharding_type"] = FULLY_RESHARDABLE
    common["content_metadata"] = meta
    return OptimizerView(reader, view, flats | set(groups), {COMMON: torch_save_bytes([common])})


def _group_state(groups: Mapping[str, tuple[str, int, str]], value: Any, chained: bool) -> Any:
    """The optimizers' ``state_dict()`` as ``fully_reshardable``'s common state keeps it: the first
    group's (rank 0's) objects, one per chained optimizer (``{0: ..., 1: ...}``)."""
    out: dict[Any, Any] = {}
    for key, (prefix, group, name) in sorted(groups.items()):
        if group != 0 or name.startswith("per_bucket_numel"):
            continue
        k = int(prefix[len("chained_"):-1]) if prefix else 0
        out.setdefault(k, {})[name] = value(key)
    for state in out.values():
        state["param_state_sharding_type"] = FULLY_RESHARDABLE
    return out if chained else out.get(0, {"param_state_sharding_type": FULLY_RESHARDABLE})


def _plan(index: CheckpointIndex, args: Any, numels: Mapping, tied: bool) -> tuple[Any, dict, set]:
    """(saved layout, view, replaced flats): the layout from megatron's args; args that do not say
    how many virtual pipeline chunks: the count the buffers fit."""
    from dataclasses import replace

    from formats.errors import CkptConvError

    layout = _saved_layout(args, index)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    tries = [layout.vpp] if isinstance(vpp, int) or vpp is None and hasattr(args, "virtual_pipeline_model_parallel_size") \
        else [1, 2, 3, 4, 6, 8]
    first: Exception | None = None
    for n in tries:
        try:
            view, flats = plan_view(index, replace(layout, vpp=n), numels, tied)
            return replace(layout, vpp=n), view, flats
        except CkptConvError as e:
            first = first or e
    raise first  # type: ignore[misc]


def _saved_layout(args: Any, index: CheckpointIndex) -> Any:
    """The layout the checkpoint was saved on: megatron's args, else the rng_state grid (pp, tp)."""
    from converter.plan.megatron import layout_bound_objects, source_axes
    from converter.plan.megatron_legacy import LegacyLayout

    a = vars(args) if hasattr(args, "__dict__") else {}
    grid = source_axes(layout_bound_objects(index.objects))

    def size(name: str, fallback: int) -> int:
        v = a.get(name)
        return v if isinstance(v, int) and v > 0 else fallback

    bucket = a.get("ddp_bucket_size")
    return LegacyLayout(tp=size("tensor_model_parallel_size", grid.get("tp", 1)),
                        pp=size("pipeline_model_parallel_size", grid.get("pp", 1)),
                        vpp=size("virtual_pipeline_model_parallel_size", 1),
                        ep=size("expert_model_parallel_size", 1), etp=a.get("expert_tensor_parallel_size"),
                        dp=size("data_parallel_size", 1), grouped_experts=bool(a.get("moe_grouped_gemm")),
                        overlap_grad_reduce=bool(a.get("overlap_grad_reduce")),
                        bucket_size=bucket if isinstance(bucket, int) else None)
