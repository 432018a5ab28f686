"""Real checkpoints in DCP's safetensors storage (``HuggingFaceStorageWriter``), for the tests.

Every kind is saved by a real multi-process job (gloo, :func:`ckpt_factory.run_world`) with
``dcp.save(state, storage_writer=HuggingFaceStorageWriter(ckpt, save_distributed=True))``: each rank
writes ``ckpt/shard-<R>-model-00001-of-00001.safetensors``. The state holds tensors only (DCP's HF
storage cannot hold a non-tensor entry), and the job also saves ``reference.pt``: every key's full
value as the job held it (``DTensor.full_tensor()``), the second oracle beside torch's own
``HuggingFaceStorageReader``.

Kinds:

- ``fsdp3``: the tiny Llama of :mod:`models` under FSDP2 on 3 ranks (uneven shards: vocab 50 is
  17/17/16 rows), 3 AdamW steps; model weights and the optimizer's state tensors (``exp_avg``,
  ``exp_avg_sq``, the 0-d ``step``: ``get_state_dict`` keys, param groups left out);
- ``tp2dp2``: the same model under torchtitan's TP plan x FSDP2 (mesh ``dp2, tp2``);
- ``ep2dp2``: an MoE block as torchtitan 0.3.0 lays it out under expert parallelism on 4 ranks:
  grouped experts ``[E, F, D]`` ``Shard(0)`` over ``ep`` (2) and FSDP2 over ``efsdp`` (2) on dim 0,
  the router and the dense parts FSDP2 over all 4 ranks, ``expert_bias_E`` replicated; one AdamW
  step on fixed gradients;
- ``dtypes3``: plain DTensors on 3 ranks of every dtype DCP's HF storage writes (fp32, fp64, fp16,
  bf16, fp8 e4m3fn/e5m2 with inf/NaN bit patterns and their fnuz variants, int8/16/32/64,
  uint8/16/32/64, bool, complex64; safetensors cannot write float8_e8m0fnu), row and column
  shards, uneven shards with an empty one, 0-d, empty and replicated tensors;
- ``dense2_float`` : fp32/bf16/fp16/fp8 only, 2 ranks, saved with ``enable_consolidation=True``:
  ``ckpt/sharded/`` and torch's own consolidated files in ``ckpt/`` (torch's consolidation crashes
  on integer and bool tensors, and writes 0-d tensors as zeros: the kind has none of either).

Cached like the other fixtures (:mod:`fixture_cache`), keyed by this file, ``ckpt_factory.py`` and
``models.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckpt_factory
import fixture_cache
from models import ModelArgs, make_optimizer, train_steps

HERE = Path(__file__).resolve().parent
REFERENCE = "reference.pt"
INFO = "_kind.json"


@dataclass(frozen=True)
class Kind:
    """One checkpoint to build: ``layout`` (mesh dims, outermost first) and what the state is."""

    name: str
    layout: tuple[tuple[str, int], ...]
    state: str  # "llama" | "moe" | "dtypes" | "floats"
    consolidate: bool = False

    @property
    def world(self) -> int:
        n = 1
        for _, s in self.layout:
            n *= s
        return n


KINDS = {k.name: k for k in (
    Kind("fsdp3", (("dp", 3),), "llama"),
    Kind("tp2dp2", (("dp", 2), ("tp", 2)), "llama"),
    Kind("ep2dp2", (("efsdp", 2), ("ep", 2)), "moe"),
    Kind("dtypes3", (("dp", 3),), "dtypes"),
    Kind("dense2_float", (("dp", 2),), "floats", consolidate=True),
)}

# ----------------------------------------------------------------------------- states


def _llama_state(kind: Kind, rank: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    layout = dict(kind.layout)
    mesh = ckpt_factory.make_mesh(layout)
    model = ckpt_factory.build_parallel_model(layout, ModelArgs(), mesh, seed=0)
    optim = make_optimizer(model)
    train_steps(model, optim, 3, seed=0)
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": {"state": optim_sd["state"]}}


class _MoE(torch.nn.Module):
    """An MoE block with torchtitan 0.3.0's parameter names (grouped experts, router, bias)."""

    def __init__(self, experts: int = 4, dim: int = 6, hidden: int = 8, seed: int = 5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tok_embeddings = torch.nn.Embedding(10, dim)
        self.router = torch.nn.Module()
        self.router.gate = torch.nn.Linear(dim, experts, bias=False)
        self.inner_experts = torch.nn.Module()
        self.inner_experts.w1_EFD = torch.nn.Parameter(torch.randn(experts, hidden, dim, generator=g))
        self.inner_experts.w2_EDF = torch.nn.Parameter(torch.randn(experts, dim, hidden, generator=g))
        self.inner_experts.w3_EFD = torch.nn.Parameter(torch.randn(experts, hidden, dim, generator=g))
        self.register_buffer("expert_bias_E", torch.linspace(-1, 1, experts))


def moe_state(seed: int = 5) -> dict[str, Any]:
    """The MoE block under EP on 4 ranks (ep2 x efsdp2 sparse mesh, dp_shard4 dense), AdamW stepped
    once: its state (model + optimizer state tensors); ``seed`` picks the initial values."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    torch.manual_seed(seed)
    model = _MoE(seed=seed)
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dense = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    experts = model.inner_experts
    for name, p in list(experts.named_parameters()):  # EP: torchtitan's ExpertParallel, Shard(0) on ep
        setattr(experts, name, torch.nn.Parameter(distribute_tensor(p.data, sparse["ep"], [Shard(0)])))
    fully_shard(experts, mesh=sparse["efsdp"])  # FSDP over efsdp on dim 0 (strided under ep)
    fully_shard(model.router, mesh=dense)
    fully_shard(model, mesh=dense)
    optim = make_optimizer(model)
    for i, p in enumerate(model.parameters()):  # one step on fixed gradients
        p.grad = torch.full_like(p, 0.01 * (i + 1)) if isinstance(p, DTensor) else torch.full_like(p, 0.01)
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": {"state": optim_sd["state"]}}


#: Bit patterns of float8 e5m2 / e4m3fn specials (inf, -inf, NaN, -0.0) written into the fp8 tensors.
E5M2_SPECIALS = [0x7C, 0xFC, 0x7E, 0x80]
E4M3_SPECIALS = [0x7F, 0xFF, 0x80]


def _dtype_values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)
    t = (torch.randn(shape, generator=g) * 3).to(dtype)
    if dtype in (torch.float8_e5m2, torch.float8_e4m3fn) and t.numel() >= 4:
        bits = E5M2_SPECIALS if dtype == torch.float8_e5m2 else E4M3_SPECIALS
        t.view(torch.uint8).view(-1)[: len(bits)] = torch.tensor(bits, dtype=torch.uint8)
    if dtype == torch.float32 and t.numel() >= 3:  # NaN payloads and -0.0
        t.view(torch.int32).view(-1)[:3] = torch.tensor([0x7FC00001, -8388607, -2147483648], dtype=torch.int32)
    return t


DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64)


def plain_values(dtypes: tuple[torch.dtype, ...], edges: bool) -> dict[str, tuple[torch.Tensor, str | None]]:
    """Key -> (whole value, placement: "rows", "cols", "repl" or None for a plain tensor) of every
    dtype: rows (7 over 3 ranks: 3/3/1; 2 over 3: an empty shard), columns, replicated; with
    ``edges`` also 0-d, empty and 3-d tensors."""
    out: dict[str, tuple[torch.Tensor, str | None]] = {}
    for i, dt in enumerate(dtypes):
        name = str(dt).removeprefix("torch.")
        out[f"rows.{name}"] = (_dtype_values((7, 5), dt, i), "rows")
        out[f"cols.{name}"] = (_dtype_values((4, 10), dt, 100 + i), "cols")
        out[f"few.{name}"] = (_dtype_values((2, 3), dt, 200 + i), "rows")
        out[f"repl.{name}"] = (_dtype_values((3,), dt, 300 + i), "repl")
        if edges:
            out[f"scalar.{name}"] = (_dtype_values((), dt, 400 + i), None)
            out[f"empty.{name}"] = (_dtype_values((0, 4), dt, 500 + i), None)
            out[f"cube.{name}"] = (_dtype_values((5, 2, 3), dt, 600 + i), "rows")
    return out


def _plain_state(kind: Kind, values: dict[str, tuple[torch.Tensor, str | None]]) -> dict[str, Any]:
    """``values`` as DTensors on a 1-D mesh of every rank; every rank made the same values and keeps
    its own shard (no scatter: gloo has no fp8 or bool)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (kind.world,), mesh_dim_names=("dp",))
    placements = {"rows": Shard(0), "cols": Shard(1), "repl": Replicate()}
    return {k: v if p is None else distribute_tensor(v, mesh, [placements[p]], src_data_rank=None)
            for k, (v, p) in values.items()}


FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def build_state(kind: Kind, rank: int) -> dict[str, Any]:
    """The state ``kind`` saves on ``rank`` (collectives: every rank calls it)."""
    if kind.state == "llama":
        return _llama_state(kind, rank)
    if kind.state == "moe":
        return moe_state()
    return _plain_state(kind, _values_of(kind))


def _values_of(kind: Kind) -> dict[str, tuple[torch.Tensor, str | None]]:
    return plain_values(DTYPES, True) if kind.state == "dtypes" else plain_values(FLOATS, False)


def full_values(kind: Kind, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every flattened key's whole value: DTensors gathered (a collective on every rank), or, for
    the plain kinds (whose fp8 and bool gloo cannot gather), made again as every rank made them."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    if kind.state in ("dtypes", "floats"):
        return {k: v for k, (v, _) in _values_of(kind).items()}
    flat, _ = flatten_state_dict(state)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in flat.items()}


# ----------------------------------------------------------------------------- building


def _save_worker(rank: int, world: int, kind: Kind, ckpt: str, work: str) -> None:
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    state = build_state(kind, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(ckpt, save_distributed=True,
                                                                enable_consolidation=kind.consolidate))
    full = full_values(kind, state)
    if rank == 0:
        torch.save(full, os.path.join(work, REFERENCE))


def build(kind: Kind, root: Path) -> Path:
    """Save ``kind`` into ``root/ckpt`` (with ``root/reference.pt`` and ``root/_kind.json``)."""
    root.mkdir(parents=True, exist_ok=True)
    ckpt_factory.run_world(_save_worker, kind.world, (kind, str(root / "ckpt"), str(root)))
    (root / INFO).write_text(json.dumps({"kind": kind.name, "layout": kind.layout, "torch": torch.__version__}))
    return root


def cache_dir() -> Path:
    h = hashlib.sha256()
    for name in ("hf_storage_factory.py", "ckpt_factory.py", "models.py"):
        h.update((HERE / name).read_bytes())
    return fixture_cache.base_dir() / f"hfstorage-{torch.__version__}-{h.hexdigest()[:16]}"


_CACHE: fixture_cache.FixtureCache | None = None


def get(name: str) -> Path:
    """The cached kind's folder (READ-ONLY): ``ckpt/`` (the per-rank files; with consolidation
    ``ckpt/sharded/`` and torch's consolidated files), ``reference.pt``."""
    global _CACHE
    if _CACHE is None:
        _CACHE = fixture_cache.FixtureCache(cache_dir(), lambda n, tmp: build(KINDS[n], tmp), names=lambda: KINDS)
    return _CACHE.get(name)


def shards(name: str) -> Path:
    """The directory of ``name``'s per-rank files."""
    root = get(name) / "ckpt"
    return root / "sharded" if KINDS[name].consolidate else root


def reference(name: str) -> dict[str, torch.Tensor]:
    """What the saving job held, key by key (whole tensors)."""
    return torch.load(get(name) / REFERENCE, weights_only=True)


def torch_hf_read(path: str | Path) -> dict[str, torch.Tensor]:
    """torch's own ``HuggingFaceStorageReader`` reading every tensor of ``path`` whole, in one
    process (the oracle: ``dcp.load`` into tensors of the shapes and dtypes its metadata gives)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(path))
    md = reader.read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    return state
