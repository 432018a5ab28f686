"""Acceptance checkpoints: models, shapes, layouts and optimizers the main fixtures do not cover.

Built with real gloo worlds (``ckpt_factory.run_world``) and ``dcp.save`` from every rank. Kinds
(:data:`KINDS`):

- ``mlp_fsdp3``: a non-Llama model (:class:`OddNet`: Linear/Conv1d with biases, LayerNorm, tied
  input/output embeddings, a persistent buffer, a parameter smaller than the world, nested
  ModuleDict/ModuleList names, odd sizes 101/7/3) under FSDP2 on 3 ranks, Adam(amsgrad), and an
  "extra" entry full of non-tensor state (LR scheduler, tuples, None, RNG ByteTensor, empty dict,
  nested lists of tensors, 0-d and 1-element tensors).
- ``mlp_tp3``: the same model with a custom TP plan (Colwise/Rowwise on the MLP, Shard(1) on a
  conv weight, replicated rest) on 3 ranks, SGD with momentum.
- ``mlp_hsdp2x3``: HSDP 2 x 3 with Adagrad.
- ``mlp_tp2fsdp3``: TP 2 x FSDP 3 (6 ranks; FSDP shards dim 0 of Shard(1) TP weights) with Adam.
- ``plain_dtypes``: one process, ``dcp.save`` of a plain dict (no model): fp16, bf16, fp8, int8,
  uint8, bool, complex64, float64, 0-d, 1-element and empty tensors, strings and numbers.

Cache: ``$CKPTCONV_TEST_CACHE`` (default ``~/.cache/ckptconv-tests``) /
``acceptance-<torch>-<hash of this file + ckpt_factory.py + models.py>/<kind>/ckpt``; built into a
temp dir and renamed in whole (``_complete.json`` last), once per session.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ckpt_factory import make_mesh, run_world

TESTS_DIR = Path(__file__).resolve().parent
VOCAB, DIM, HIDDEN, TRAIN_STEPS = 101, 14, 24, 2


@dataclass(frozen=True)
class Kind:
    """One acceptance checkpoint: layout (outermost first), optimizer name, model or plain dict."""

    kind: str
    layout: tuple[tuple[str, int], ...]
    optim: str = "adam_amsgrad"
    plain: bool = False
    wrapper: str = ""  # "ddp" or "fsdp1" instead of FSDP2 over the "dp" dim
    writer: str = ""  # "multi": FileSystemWriter(single_file_per_rank=False, thread_count=2)
    app: bool = False  # the DCP tutorial's {"app": AppState} (Stateful): keys "app.model.*", "app.optim.*"
    titan: bool = False  # torchtitan keys: model at the top level, flattened "optimizer", no tying,
    # a TP-colwise (Shard(1)) embedding and a 3-D parameter TP-sharded on dim 2

    @property
    def world(self) -> int:
        return max(1, math.prod(s for _, s in self.layout))

    @property
    def layout_dict(self) -> dict[str, int]:
        return dict(self.layout)


KINDS: dict[str, Kind] = {
    k.kind: k
    for k in (
        Kind("mlp_fsdp3", (("dp", 3),)),
        Kind("mlp_tp3", (("tp", 3),), optim="sgd_momentum"),
        Kind("mlp_hsdp2x3", (("dp_replicate", 2), ("dp_shard", 3)), optim="adagrad"),
        Kind("mlp_tp2fsdp3", (("dp", 3), ("tp", 2)), optim="adam"),
        Kind("titan_dp2tp2", (("dp", 2), ("tp", 2)), optim="adam_amsgrad", titan=True),
        Kind("titan_dp2tp3", (("dp", 2), ("tp", 3)), optim="sgd_momentum", titan=True),  # uneven TP dims 1, 2
        Kind("hsdp_tp_2x2x2", (("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)), optim="adam_amsgrad", titan=True),
        Kind("ddp2", (("dp", 2),), optim="sgd_momentum", wrapper="ddp"),
        Kind("fsdp1_3", (("dp", 3),), optim="adam", wrapper="fsdp1"),
        Kind("fsdp2_multifile", (("dp", 2),), optim="adagrad", writer="multi"),
        Kind("app_fsdp2", (("dp", 2),), optim="adam", app=True),
        Kind("plain_dtypes", (), plain=True),
    )
}


# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.ModuleDict({"fc_in": nn.Linear(DIM, HIDDEN), "fc_out": nn.Linear(HIDDEN, DIM)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp["fc_out"](F.gelu(self.mlp["fc_in"](self.norm(x))))


class OddNet(nn.Module):
    """Not a Llama: biases, LayerNorm, conv, tied embeddings, a persistent buffer, a (2,) param."""

    def __init__(self, titan: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.conv = nn.Conv1d(DIM, DIM, kernel_size=3, padding=1)
        self.stack = nn.ModuleList([nn.ModuleDict({"inner": Block()}), nn.ModuleDict({"inner": Block()})])
        self.final_ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if titan:
            self.kernel = nn.Parameter(torch.randn(5, 3, 10))  # TP Shard(2); gets a fake gradient
        else:
            self.head.weight = self.embed.weight  # tied
        self.gate = nn.Parameter(torch.tensor([0.5, 1.5]))
        self.register_buffer("seen_tokens", torch.zeros((), dtype=torch.int64), persistent=True)
        self.register_buffer("ema", torch.zeros(DIM), persistent=True)
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2) * self.gate[0]
        for layer in self.stack:
            h = layer["inner"](h)
        h = self.final_ln(h) * self.gate[1]
        return self.head(h)


def build_oddnet(seed: int, titan: bool = False) -> OddNet:
    torch.manual_seed(seed)
    model = OddNet(titan)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name:
                p.uniform_(0.5, 1.5)
        model.ema.copy_(torch.linspace(-1, 1, DIM))
        model.seen_tokens.fill_(12345)
    return model


def tp_plan() -> dict[str, Any]:
    """A custom plan: colwise fc_in (bias Shard(0)), rowwise fc_out (bias replicated)."""
    plan: dict[str, Any] = {}
    for i in range(2):
        plan[f"stack.{i}.inner.mlp.fc_in"] = ColwiseParallel()
        plan[f"stack.{i}.inner.mlp.fc_out"] = RowwiseParallel()
    return plan


def parallelize(model: OddNet, layout: dict[str, int], mesh: Any, wrapper: str = "") -> nn.Module:
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

        return FSDP1(model, use_orig_params=True, device_id=torch.device("cpu"))
    if layout.get("tp", 1) > 1:
        parallelize_module(model, mesh["tp"], tp_plan())
        if hasattr(model, "kernel"):
            parallelize_module(model, mesh["tp"], {"embed": ColwiseParallel(output_layouts=Replicate())})
            model.kernel = nn.Parameter(distribute_tensor(model.kernel.data, mesh["tp"], [Shard(2)]))
    dp = "dp" if "dp" in layout else "dp_shard"
    if "dp_replicate" in layout:
        dp_mesh = mesh["dp_replicate", "dp_shard"]
    elif layout.get(dp, 1) > 1:
        dp_mesh = mesh[dp]
    else:
        dp_mesh = None
    if dp_mesh is not None:
        for layer in model.stack:
            fully_shard(layer["inner"], mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def make_optim(name: str, model: nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if name == "adam_amsgrad":
        return torch.optim.Adam(params, lr=1e-2, amsgrad=True, foreach=False)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, foreach=False)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-2, foreach=False)
    return torch.optim.Adam(params, lr=1e-2, foreach=False)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, start: int = 0) -> list[float]:
    """Steps ``start .. start+steps-1`` (each step's batch depends on the step alone); losses."""
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(99 + step)
        tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
        out = model(tokens[:, :-1])
        loss = F.cross_entropy(out.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        kernel = getattr(getattr(model, "module", model), "kernel", None)
        if kernel is not None:  # unused in forward: a deterministic fake gradient
            kernel.grad = torch.full_like(kernel, 0.1 * (step + 1))
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def extra_state(optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Non-tensor state a training script saves next to the model (deterministic)."""
    shadow = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(shadow, step_size=2, gamma=0.5)
    for _ in range(3):
        shadow.step()
        sched.step()
    return {
        "lr_scheduler": sched.state_dict(),
        "dataloader": {"order": [3, 1, 2], "pos": (4, "shard-7"), "none": None, "ratio": 0.1, "tag": "x.y"},
        "step": TRAIN_STEPS,
        "tensors": [torch.arange(3, dtype=torch.int16), [torch.tensor(1.5, dtype=torch.float64)]],
        "rng": torch.Generator().manual_seed(7).get_state(),
        "empty": {},
        "zero_d": torch.tensor(-0.0),
        "one_el": torch.tensor([3], dtype=torch.int32),
    }


def _options(kind: Kind) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=kind.titan)


def state_for(kind: Kind, model: OddNet, optim: torch.optim.Optimizer) -> dict:
    """What each rank saves (and, as a template, loads): get_state_dict keys, or torchtitan's."""
    msd, osd = get_state_dict(model, optim, options=_options(kind))
    if kind.titan:
        state: dict[str, Any] = dict(msd)
        state["optimizer"] = osd
        extra = extra_state(optim)
        state["lr_scheduler"] = extra.pop("lr_scheduler")
        state["dataloader"] = extra.pop("dataloader")
        state["train_state"] = extra
        return state
    if kind.app:
        return {"app": {"model": msd, "optim": osd}, "extra": extra_state(optim)}
    return {"model": msd, "optim": osd, "extra": extra_state(optim)}


def build_parallel(kind: Kind, layout: dict[str, int], seed: int) -> tuple[OddNet, torch.optim.Optimizer]:
    mesh = make_mesh(layout) if layout else None
    model = parallelize(build_oddnet(seed, kind.titan), layout, mesh, kind.wrapper if layout else "")
    return model, make_optim(kind.optim, model)


def load_state(kind: Kind, model: nn.Module, optim: torch.optim.Optimizer, ckpt: str,
               check: Any = None) -> dict:
    """dcp.load ``ckpt`` into model + optimizer (+ extra placeholders), call ``check(state)`` on
    what was loaded, then hand it to the model and optimizer (``set_state_dict`` renames keys in
    place, so checks run before it). Returns ``check``'s result."""
    state = state_for(kind, model, optim)
    dcp.load(state, checkpoint_id=ckpt)
    result = check(state) if check is not None else None
    if kind.titan:
        names = set(get_state_dict(model, optim, options=_options(kind))[0])
        msd, osd = {k: v for k, v in state.items() if k in names}, state["optimizer"]
    else:
        root = state["app"] if kind.app else state
        msd, osd = root["model"], root["optim"]
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=_options(kind))
    return result


# ----------------------------------------------------------------------------- plain dict


def plain_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(5, 7, generator=g) * 4
    return {
        "fp16": base.half(),
        "bf16": base.bfloat16(),
        "f64": base.double(),
        "fp8": base.to(torch.float8_e4m3fn),
        "fp8_e5m2": base.to(torch.float8_e5m2),
        "i8": (base * 10).to(torch.int8),
        "u8": torch.arange(200, 240, dtype=torch.uint8),
        "i16": torch.tensor([-3, 4], dtype=torch.int16),
        "flags": base > 0,
        "cplx": torch.complex(base, -base).to(torch.complex64),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "one": torch.tensor([1.25]),
        "empty": torch.zeros(0, 4),
        "weights.with.dots": {"a.b": torch.arange(6.0).view(2, 3)},
        "meta": {"name": "plain", "n": 3, "vals": (1.0, None)},
    }


# ----------------------------------------------------------------------------- workers


def _save_worker(rank: int, world: int, kind: Kind, ckpt: str, work: str) -> None:
    if kind.plain:
        dcp.save(plain_state(), checkpoint_id=ckpt)
        return
    model, optim = build_parallel(kind, kind.layout_dict, seed=0)
    losses = train(model, optim, TRAIN_STEPS)
    writer = None
    if kind.writer == "multi":
        writer = dcp.FileSystemWriter(ckpt, single_file_per_rank=False, thread_count=2)
    dcp.save(state_for(kind, model, optim), checkpoint_id=ckpt, storage_writer=writer)
    cont = train(model, optim, 1, start=TRAIN_STEPS)
    Path(work, f"_rank{rank}.json").write_text(json.dumps({"losses": losses, "continue": cont}))


def build(kind: Kind, root: Path) -> Path:
    """Build ``kind`` into ``root/ckpt``; returns the checkpoint dir."""
    root.mkdir(parents=True, exist_ok=True)
    ckpt = root / "ckpt"
    run_world(_save_worker, kind.world, (kind, str(ckpt), str(root)))
    ranks = {}
    for r in range(kind.world):
        path = root / f"_rank{r}.json"
        if path.is_file():
            ranks[str(r)] = json.loads(path.read_text())
            path.unlink()
    info = {"kind": kind.kind, "layout": kind.layout, "optim": kind.optim, "ranks": ranks}
    (root / "_kind.json").write_text(json.dumps(info))
    return ckpt


def info(kind: str) -> dict:
    """The ``_kind.json`` of a built kind: per rank the training losses and the loss of the step
    run right after the save (``continue``), which a load of the checkpoint must reproduce."""
    return json.loads((get(kind).parent / "_kind.json").read_text())


# ----------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    h = hashlib.sha256()
    for name in ("acceptance_factory.py", "ckpt_factory.py", "models.py"):
        h.update((TESTS_DIR / name).read_bytes())
    import fixture_cache

    return fixture_cache.base_dir() / f"acceptance-{torch.__version__}-{h.hexdigest()[:16]}"


_entries = None


def _build_entry(kind: str, tmp: Path) -> None:
    build(KINDS[kind], tmp)  # the entry is tmp itself: ckpt/ plus the kind's json files


def get(kind: str) -> Path:
    """The cached checkpoint of ``kind`` (built on first use, manifest-checked; READ-ONLY)."""
    global _entries
    if _entries is None:
        import fixture_cache

        _entries = fixture_cache.FixtureCache(cache_dir(), _build_entry, names=lambda: KINDS)
    return _entries.get(kind) / "ckpt"


# ----------------------------------------------------------------------------- load worlds


def _compare(state: dict, reference: dict) -> tuple[list[str], list[str], int]:
    """compare_loaded, with FSDP1's ShardedTensors compared shard by shard."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from load_worker import compare_loaded
    from oracle import bits_equal

    flat, _ = flatten_state_dict(state)
    sharded = {k: v for k, v in flat.items() if isinstance(v, ShardedTensor)}
    keys, errors, numel = compare_loaded({k: v for k, v in flat.items() if k not in sharded}, reference)
    for key, value in sharded.items():
        for shard in value.local_shards():
            offs, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            want = reference[key][tuple(slice(o, o + n) for o, n in zip(offs, sizes))]
            if not bits_equal(shard.tensor, want):
                errors.append(f"{key}: shard at {offs} differs from the source")
            numel += shard.tensor.numel()
    return sorted([*keys, *sharded]), errors, numel


def _load_worker(rank: int, world: int, kind: Kind, layout: dict, ckpt: str, ref: str, out: str) -> None:
    """dcp.load ``ckpt`` into a world of ``layout``; compare with the reference, train one step."""
    model, optim = build_parallel(kind, layout, seed=777)
    reference = torch.load(ref, weights_only=False)
    try:
        keys, errors, numel = load_state(kind, model, optim, ckpt, lambda st: _compare(st, reference))
        losses = train(model, optim, 1, start=TRAIN_STEPS)
        result = {"keys": keys, "errors": errors, "numel": numel, "losses": losses}
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"exception": f"{type(e).__name__}: {str(e)[:800]}"}
    Path(out, f"_load{rank}.json").write_text(json.dumps(result))


def load_in_world(kind: str, layout: dict[str, int], ckpt: Path, ref: Path, out: Path) -> dict[int, dict]:
    """Spawn a world of ``layout`` that dcp.loads ``ckpt``; per-rank reports."""
    world = max(1, math.prod(layout.values()))
    out.mkdir(parents=True, exist_ok=True)
    run_world(_load_worker, world, (KINDS[kind], layout, str(ckpt), str(ref), str(out)))
    return {r: json.loads((out / f"_load{r}.json").read_text()) for r in range(world)}
