"""Synthetic DCP checkpoints at real scale: the ``.metadata`` ``dcp.save`` writes for
``{"model": ..., "optim": ...} = get_state_dict(model, AdamW)`` of a torchtitan Llama under FSDP2,
with sparse data files (each ``__<rank>_0.distcp`` truncated to its size; only the non-tensor
entries hold real bytes).

What is reproduced, step by step as torch 2.13 does it (``DefaultSavePlanner`` +
``FileSystemWriter``):

- keys in ``get_state_dict`` flatten order: model parameters (torchtitan names), then
  ``optim.state.<fqn>.{step, exp_avg, exp_avg_sq}`` per parameter, then
  ``optim.param_groups.0.<hparam>`` (AdamW's defaults) and any ``extra.<name>`` objects;
- FSDP2 shards: ``torch.chunk`` along dim 0 over the world (ceil-sized chunks, a shorter last one,
  empty shards at ``offset = dim size``), fp32 parameters and AdamW states, 0-d fp32 ``step``;
- ``dedup_save_plans``: replicated items (``step``, the objects, the empty shards every empty rank
  shares) go to the plan with the least storage so far, in first-seen order;
- ``state_dict_metadata`` / chunk order from walking the deduplicated plans in rank order;
  ``storage_data`` per rank, bytes items first, offsets and lengths of real ``torch.save``
  archives (``formats.dcp.archive_writer.archive_size``, byte-identical to ``torch.save``);
- ``planner_data``, ``storage_meta`` (a ``PosixPath`` checkpoint id), ``version``.

The pickle is torch's own: real ``torch.distributed.checkpoint`` objects dumped with
``pickle.dump`` (protocol 4, what ``FileSystemWriter`` uses). Each object is built fresh, as the
gathered plans are on the coordinator (no sharing that would shrink the memo).

    python bench/synthetic_metadata.py OUT --model 70b --world 128
    python bench/synthetic_metadata.py OUT --model 405b --world 1024 --tp 8   # FSDP128 x TP8
    python bench/synthetic_metadata.py OUT --dim 32 --layers 2 --heads 4 --kv-heads 2 --vocab 50 \\
        --hidden 96 --world 4 --extra step,kind      # the shapes of tests' fsdp4 fixture

``--check FIXTURE_CKPT`` compares the keys, chunk boxes and storage layout with a real checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import io
import math
import os
import pickle
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from formats.dcp.archive_writer import archive_size  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A torchtitan Llama's sizes."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int


#: Llama-3 shapes (torchtitan's llama3 configs).
PRESETS = {
    "8b": Shape(4096, 32, 32, 8, 14336, 128256),
    "70b": Shape(8192, 80, 64, 8, 28672, 128256),
    "405b": Shape(16384, 126, 128, 8, 53248, 128256),
}

#: AdamW's param group in torch 2.13, in its key order.
def param_group(lr: float = 3e-4) -> dict:
    return {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
            "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": True}


def parameters(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(fqn, shape) of the model's parameters in ``named_parameters`` order."""
    head = s.dim // s.heads
    out = [("tok_embeddings.weight", (s.vocab, s.dim))]
    for i in range(s.layers):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq.weight", (s.heads * head, s.dim)),
            (p + "attention.wk.weight", (s.kv_heads * head, s.dim)),
            (p + "attention.wv.weight", (s.kv_heads * head, s.dim)),
            (p + "attention.wo.weight", (s.dim, s.heads * head)),
            (p + "feed_forward.w1.weight", (s.hidden, s.dim)),
            (p + "feed_forward.w2.weight", (s.dim, s.hidden)),
            (p + "feed_forward.w3.weight", (s.hidden, s.dim)),
            (p + "attention_norm.weight", (s.dim,)),
            (p + "ffn_norm.weight", (s.dim,)),
        ]
    out += [("norm.weight", (s.dim,)), ("output.weight", (s.vocab, s.dim))]
    return out


#: torchtitan's Llama TP plan per parameter name: the dim TP shards (None: replicated). Colwise
#: wq/wk/wv/w1/w3 and ``output`` shard dim 0, rowwise wo/w2 dim 1, the embedding (RowwiseParallel
#: on nn.Embedding) dim 0, norms are replicated (SequenceParallel).
TP_DIMS = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "tok_embeddings": 0, "wo": 1, "w2": 1}


def tp_dim(fqn: str) -> int | None:
    """The dim torchtitan's TP plan shards parameter ``fqn`` on (None: replicated)."""
    parts = fqn.split(".")
    return TP_DIMS.get(parts[-2] if len(parts) >= 2 else parts[0])


def fsdp_tp_placements(dim: int | None, tp: int) -> tuple:
    """FSDP2's placements over a parameter TP shards on ``dim`` (mesh ``(dp_shard, tp)``):
    ``_StridedShard(0, tp)`` x ``Shard(0)``, ``Shard(0)`` x ``Shard(dim)``, or ``Shard(0)`` x
    ``Replicate()`` for a replicated one (None)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if dim is None:
        return (Shard(0), Replicate())
    if dim == 0:
        return (_StridedShard(0, split_factor=tp), Shard(0))
    return (Shard(0), Shard(dim))


@functools.lru_cache(maxsize=1 << 16)
def fsdp_tp_box(shape: tuple[int, ...], dim: int | None, dp_rank: int, dp: int, tp_rank: int,
                tp: int) -> tuple[tuple, tuple]:
    """A rank's shard under FSDP2 over a TP-sharded DTensor (mesh ``(dp_shard, tp)``), as torch's
    own ``compute_local_shape_and_global_offset`` gives it: FSDP's ``_StridedShard(0, tp)`` over
    TP's ``Shard(0)``, ``Shard(0)`` x ``Shard(1)``, or ``Shard(0)`` x ``Replicate()``."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = fsdp_tp_placements(dim, tp)
    sizes, offsets = _compute_local_shape_and_global_offset(shape, (dp, tp), [dp_rank, tp_rank], placements)
    sizes, offsets = tuple(sizes), tuple(offsets)
    if math.prod(sizes) == 0:  # empty shards: DCP records them at offset = dim size on dim 0
        offsets = (shape[0],) + offsets[1:]
    return offsets, sizes


def fsdp_box(shape: tuple[int, ...], rank: int, world: int) -> tuple[tuple, tuple]:
    """This rank's FSDP2 shard (``torch.chunk`` along dim 0) as (offsets, sizes)."""
    n = shape[0]
    step = -(-n // world) if n else 0
    start = min(n, rank * step)
    size = max(0, min(n, start + step) - start)
    if size == 0:
        start = n  # empty shards sit at the end (compute_local_shape_and_global_offset)
    return (start,) + (0,) * (len(shape) - 1), (size,) + tuple(shape[1:])


@dataclass
class Item:
    key: str
    kind: str  # "shard" | "step" | "bytes"
    shape: tuple[int, ...]
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...] | None
    nbytes: int  # storage size for dedup (tensor bytes, or 1 for bytes)


def local_plans(s: Shape, world: int, extra: list[str], tp: int = 1) -> tuple[list[list[Item]], dict[str, tuple]]:
    """Every rank's save-plan items (flatten order) and the planner_data mapping (``tp`` > 1: FSDP2
    over torchtitan's TP plan on the mesh ``(dp_shard = world / tp, tp)``, rank = dp * tp + tp_rank)."""
    params = parameters(s)
    keys: list[tuple[str, str, tuple, tuple]] = []  # (key, kind, shape, path)
    for fqn, shape in params:
        keys.append(("model." + fqn, "shard", shape, ("model", fqn)))
    for fqn, shape in params:
        own = _fresh(fqn)  # the optimizer's state dict has its own fqn strings
        for state in ("step", "exp_avg", "exp_avg_sq"):
            kind = "step" if state == "step" else "shard"
            keys.append((f"optim.state.{fqn}.{state}", kind, () if kind == "step" else shape,
                         ("optim", "state", own, state)))
    for name in list(param_group()) + ["params"]:
        keys.append((f"optim.param_groups.0.{name}", "bytes", (), ("optim", "param_groups", 0, name)))
    for name in extra:
        keys.append((f"extra.{name}", "bytes", (), ("extra", name)))
    planner = {_fresh(k): path for k, _, _, path in keys}  # the plan's own key strings
    plans = []
    for rank in range(world):
        items = []
        for key, kind, shape, path in keys:
            if kind == "shard":
                if tp == 1:
                    off, size = fsdp_box(shape, rank, world)
                else:
                    fqn = path[1] if path[0] == "model" else path[2]
                    off, size = fsdp_tp_box(shape, tp_dim(fqn), rank // tp, world // tp, rank % tp, tp)
                items.append(Item(key, kind, shape, off, size, 4 * math.prod(size)))
            elif kind == "step":
                items.append(Item(key, kind, (), (), (), 4))
            else:
                items.append(Item(key, kind, (), None, None, 1))
        plans.append(items)
    return plans, planner


def dedup(plans: list[list[Item]]) -> list[list[Item]]:
    """``torch.distributed.checkpoint._dedup_save_plans.dedup_save_plans`` (lowest storage wins)."""
    holders: dict[tuple, list[int]] = {}
    first: dict[tuple, Item] = {}
    for r, items in enumerate(plans):
        for it in items:
            idx = (it.key, it.offsets)
            holders.setdefault(idx, []).append(r)
            first.setdefault(idx, it)
    size = [0] * len(plans)
    keep: dict[tuple, int] = {}
    for idx, ranks in holders.items():
        r = ranks[0] if len(ranks) == 1 else min(ranks, key=lambda i: size[i])
        size[r] += first[idx].nbytes or 1
        keep[idx] = r
    return [[it for it in items if keep[(it.key, it.offsets)] == r] for r, items in enumerate(plans)]


def object_bytes(key: str, planner: dict, fqns: list[str], extra_values: dict) -> bytes:
    import torch

    path = planner[key]
    if path[0] == "extra":
        value = extra_values[path[1]]
    elif path[-1] == "params":
        value = list(fqns)
    else:
        value = param_group()[path[-1]]
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def build(out: Path, s: Shape, world: int, extra: list[str], quiet: bool = False, tp: int = 1) -> dict:
    """Write ``out/.metadata`` and sparse ``__<rank>_0.distcp`` files; returns a summary."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
        TensorProperties, TensorStorageMetadata)

    t0 = time.perf_counter()
    if tp < 1 or world % tp:
        raise SystemExit(f"--tp {tp} must divide --world {world}")
    plans, planner = local_plans(s, world, extra, tp)
    plans = dedup(plans)
    fqns = [f for f, _ in parameters(s)]
    extra_values = {"step": 3, "kind": "fsdp4"}
    blobs = {k: object_bytes(k, planner, fqns, extra_values) for k, p in planner.items()
             if p[0] == "extra" or p[1] == "param_groups"}
    sd_md: dict = {}
    storage: dict = {}
    sizes = [0] * world
    fp32 = torch.float32
    for rank, items in enumerate(plans):
        for it in items:  # global plan: metadata in rank order, chunks appended
            if it.kind == "bytes":
                sd_md.setdefault(it.key, BytesStorageMetadata())
                continue
            md = sd_md.get(it.key)
            if md is None:
                md = sd_md[it.key] = TensorStorageMetadata(
                    TensorProperties(dtype=fp32), torch.Size(it.shape), [])
            md.chunks.append(ChunkStorageMetadata(torch.Size(it.offsets), torch.Size(it.sizes)))
        name = f"__{rank}_0.distcp"  # one string per rank file (FileSystemWriter)
        cursor = 0
        ordered = [it for it in items if it.kind == "bytes"] + [it for it in items if it.kind != "bytes"]
        for it in ordered:
            if it.kind == "bytes":
                length = len(blobs[it.key])
                index = MetadataIndex(_fresh(it.key))
            else:
                length = archive_size("float32", it.sizes)
                index = MetadataIndex(_fresh(it.key), torch.Size(it.offsets), None)
            storage[index] = _StorageInfo(name, cursor, length)
            cursor += length
        sizes[rank] = cursor
    # MetadataIndex.index of each chunk: its position in the tensor's chunk list (set by the
    # global plan); the dict hashes on (fqn, offset) only, so filling it in afterwards is safe
    positions = {(k, tuple(c.offsets)): i for k, m in sd_md.items() if hasattr(m, "chunks")
                 for i, c in enumerate(m.chunks)}
    for index in storage:
        if index.offset is not None:
            object.__setattr__(index, "index", positions[(index.fqn, tuple(index.offset))])
    ordered_md = {k: sd_md[k] for k in _first_seen(plans)}
    meta = Metadata(state_dict_metadata=ordered_md, planner_data=dict(planner), storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=Path(out), save_id=str(uuid.uuid4())),
                    version="1.0.0")
    del positions
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".metadata.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(meta, f)
    os.replace(tmp, out / ".metadata")
    for rank in range(world):
        with open(out / f"__{rank}_0.distcp", "wb") as f:
            f.truncate(sizes[rank])
    for index, info in storage.items():
        if index.offset is None:
            with open(out / info.relative_path, "r+b") as f:
                f.seek(info.offset)
                f.write(blobs[index.fqn])
    n_chunks = sum(len(m.chunks) for m in sd_md.values() if hasattr(m, "chunks"))
    summary = {"world": world, "tp": tp, "shape": s.__dict__, "keys": len(sd_md), "chunks": n_chunks,
               "metadata_bytes": (out / ".metadata").stat().st_size, "data_bytes": sum(sizes),
               "seconds": round(time.perf_counter() - t0, 1)}
    if not quiet:
        print(summary)
    return summary


def _fresh(key: str) -> str:
    """A new string object equal to ``key`` (each rank's gathered results hold their own copy)."""
    return (key + "\0")[:-1]


def _first_seen(plans: list[list[Item]]) -> list[str]:
    seen: dict[str, None] = {}
    for items in plans:
        for it in items:
            seen.setdefault(it.key)
    return list(seen)


def check(out: Path, real: Path) -> None:
    """Compare keys (in order), chunk boxes, storage keys and locations with a real checkpoint."""
    with open(out / ".metadata", "rb") as f:
        a = pickle.load(f)
    with open(real / ".metadata", "rb") as f:
        b = pickle.load(f)
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata), "key order differs"
    for k, ma in a.state_dict_metadata.items():
        mb = b.state_dict_metadata[k]
        assert type(ma) is type(mb), k
        if hasattr(ma, "chunks"):
            assert ma.size == mb.size and ma.properties == mb.properties, k
            assert [(c.offsets, c.sizes) for c in ma.chunks] == [(c.offsets, c.sizes) for c in mb.chunks], k
    assert a.planner_data == b.planner_data and list(a.planner_data) == list(b.planner_data)
    sa = [((i.fqn, i.offset, i.index), (v.relative_path, v.offset, v.length)) for i, v in a.storage_data.items()]
    sb = [((i.fqn, i.offset, i.index), (v.relative_path, v.offset, v.length)) for i, v in b.storage_data.items()]
    assert sa == sb, next((x, y) for x, y in zip(sa, sb) if x != y)
    print(f"{out}: keys, chunk boxes, planner_data and storage_data match {real}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", choices=sorted(PRESETS), help="Llama-3 shape preset")
    ap.add_argument("--dim", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1, help="TP degree under FSDP (torchtitan's Llama TP plan; 1: FSDP only)")
    ap.add_argument("--extra", default="", help="comma-separated extra.<name> objects (the fixtures' step,kind)")
    ap.add_argument("--check", type=Path, help="a real checkpoint of the same shapes to compare with")
    a = ap.parse_args()
    base = PRESETS[a.model].__dict__ if a.model else {}
    given = {k: getattr(a, k.replace("-", "_")) for k in ("dim", "layers", "heads", "kv_heads", "hidden", "vocab")}
    shape = Shape(**{**base, **{k: v for k, v in given.items() if v is not None}})
    build(a.out, shape, a.world, [e for e in a.extra.split(",") if e], tp=a.tp)
    if a.check:
        check(a.out, a.check)


if __name__ == "__main__":
    main()
