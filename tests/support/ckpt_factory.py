"""Real multi-process DCP checkpoints for the test suite (gloo worlds, torch.multiprocessing spawn).

Each kind trains the tiny Llama of :mod:`models` for 3 AdamW steps under a real parallel layout and
saves it with ``dcp.save`` from every rank. Layout on disk (``make_checkpoint(kind, out)``)::

    out/<kind>/ckpt/           the DCP checkpoint (.metadata, __<r>_0.distcp); returned path
    out/<kind>/_fixture.json   kind, layout, model args, per-rank losses and boxes (fixture_info)

``_fixture.json`` records the 3 training losses and the losses of 3 MORE steps run right after the
save in the same processes: loading the checkpoint into the same layout and training steps 3..5
(:func:`load_and_continue`) must reproduce them bit for bit.

Worker helpers (:func:`build_parallel_model`, :func:`make_mesh`; ``run_world`` from :mod:`worlds`,
re-exported here) are public so that load tests can spawn target worlds of their own.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from models import (
    BATCH,
    SEQ_LEN,
    ModelArgs,
    Transformer,
    apply_fsdp,
    apply_tp,
    build_model,
    build_stage,
    make_optimizer,
    train_steps,
)
from worlds import run_world  # noqa: F401 - re-exported: the tests' worlds are spawned from here

TRAIN_STEPS = 3
CONTINUE_STEPS = 3
FIXTURE_JSON = "_fixture.json"


@dataclass(frozen=True)
class FixtureSpec:
    """What to build. ``layout``: ordered mesh dims, outermost first, e.g. (("dp", 2), ("tp", 2)).

    ``style``: "dcp" saves {"model", "optim", "extra"}; "titan" saves torchtitan's keys (model at
    the top level, flattened "optimizer", "lr_scheduler", "dataloader", "train_state").
    ``special``: add the special-dtype buffers and extra objects (see :func:`add_special_buffers`).
    ``flatten_optim``: optimizer state with ``flatten_optimizer_state_dict=True`` (param_groups keyed
    by parameter FQN). Pipeline stages need it: unflattened, ``optim.param_groups.0.params`` differs
    per stage and DCP keeps only one stage's list, which no longer loads.
    """

    kind: str
    layout: tuple[tuple[str, int], ...]
    model_args: ModelArgs = field(default_factory=ModelArgs)
    seed: int = 0
    style: str = "dcp"
    special: bool = False
    flatten_optim: bool = False

    @property
    def world_size(self) -> int:
        return math.prod(size for _, size in self.layout)

    @property
    def layout_dict(self) -> dict[str, int]:
        return dict(self.layout)


KINDS: dict[str, FixtureSpec] = {
    spec.kind: spec
    for spec in (
        FixtureSpec("fsdp4", (("dp", 4),)),
        FixtureSpec("tp2dp2", (("dp", 2), ("tp", 2))),
        FixtureSpec("hsdp2x2", (("dp_replicate", 2), ("dp_shard", 2))),
        FixtureSpec("pp2fsdp2", (("pp", 2), ("dp", 2)), flatten_optim=True),
        FixtureSpec("single", ()),
        FixtureSpec("bf16_fsdp2", (("dp", 2),), ModelArgs(dtype="bfloat16")),
        FixtureSpec("special_dtypes", (("dp", 2),), ModelArgs(out_scale=True), special=True),
        FixtureSpec("titan_flat", (("dp", 2),), style="titan"),
    )
}

# ----------------------------------------------------------------------------- worlds


def make_mesh(layout: dict[str, int]) -> DeviceMesh | None:
    """The CPU device mesh for ``layout`` (None for a single process)."""
    if math.prod(layout.values()) == 1:
        return None
    return init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))


# ----------------------------------------------------------------------------- models


def build_parallel_model(
    layout: dict[str, int], model_args: ModelArgs, device_mesh: DeviceMesh | None, seed: int = 0
) -> Transformer:
    """Build the model (or this rank's PP stage) and parallelize it as torchtitan would.

    ``layout`` names mesh dims outermost first: ``pp``, ``dp_replicate``, ``dp_shard`` / ``dp``,
    ``tp``; ``device_mesh`` has those dims (see :func:`make_mesh`). HSDP needs both
    ``dp_replicate`` and ``dp_shard``.
    """
    if layout.get("pp", 1) > 1:
        model = build_stage(model_args, device_mesh.get_local_rank("pp"), layout["pp"], seed)
    else:
        model = build_model(model_args, seed)
    if layout.get("tp", 1) > 1:
        apply_tp(model, device_mesh["tp"])
    if "dp_replicate" in layout:
        apply_fsdp(model, device_mesh["dp_replicate", "dp_shard"])
    else:
        dp = "dp" if "dp" in layout else "dp_shard"
        if layout.get(dp, 1) > 1:
            apply_fsdp(model, device_mesh[dp])
    return model


# Bit patterns with NaN payloads, infinities and -0.0 (checked bit for bit by the tests).
NAN_BITS_F32 = [0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x3F800000]


def add_special_buffers(model: Transformer) -> None:
    """Register buffers of unusual dtypes on ``model`` (deterministic values)."""
    g = torch.Generator().manual_seed(1234)
    vals = torch.randn(4, 6, generator=g) * 3
    model.register_buffer("fp8_e4m3", vals.to(torch.float8_e4m3fn))
    e5m2 = vals.to(torch.float8_e5m2)
    e5m2.view(torch.uint8).view(-1)[:3] = torch.tensor([0x7C, 0xFC, 0x7E], dtype=torch.uint8)  # inf -inf nan
    model.register_buffer("fp8_e5m2", e5m2)
    model.register_buffer("counts_i64", torch.tensor([0, -1, 2**40, -(2**62), 7], dtype=torch.int64))
    model.register_buffer("mask_bool", torch.tensor([[True, False, True], [False, False, True]]))
    model.register_buffer("scale_f16", (vals[:2] / 7).to(torch.float16))
    model.register_buffer("scalar_0d", torch.tensor(2.5))
    nan_bits = torch.tensor(NAN_BITS_F32, dtype=torch.int64).to(torch.int32)  # wraps to the bits
    model.register_buffer("nan_payload", nan_bits.view(torch.float32))
    model.layers["0"].attention.register_buffer("kv_mask", torch.arange(10) % 3 == 0)


def special_extra() -> dict[str, Any]:
    """The "extra" entry of the special_dtypes kind: nested non-tensor state plus odd tensors."""
    return {
        "step": 7,
        "name": "run-1",
        "none": None,
        "lst": [1, 2.5, "x"],
        "nested": {"a": {"b": [1, 2]}},
        "floats": 3.25,
        "transposed": torch.arange(12, dtype=torch.float32).view(3, 4).t(),
        "tensor_list": [torch.tensor([1, 2], dtype=torch.int32), torch.tensor(3.0, dtype=torch.float64)],
    }


def _build_for(spec: FixtureSpec, layout: dict[str, int], seed: int) -> tuple[Transformer, Any]:
    model = build_parallel_model(layout, spec.model_args, make_mesh(layout), seed)
    if spec.special:
        add_special_buffers(model)
    return model, make_optimizer(model)


# ----------------------------------------------------------------------------- state dicts


def _dp_rank(layout: dict[str, int], rank: int) -> int:
    """This rank's data-parallel index (row-major coordinates over the layout)."""
    coords, rest = {}, rank
    for name, size in reversed(list(layout.items())):
        coords[name], rest = rest % size, rest // size
    dp_names = [n for n in layout if n.startswith("dp")]
    idx = 0
    for n in dp_names:
        idx = idx * layout[n] + coords[n]
    return idx


def _lr_scheduler_state(optim: torch.optim.Optimizer) -> dict:
    """A torchtitan-like LambdaLR state after TRAIN_STEPS steps (on a throwaway optimizer)."""
    shadow = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=optim.param_groups[0]["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(shadow, lambda step: 1.0)
    for _ in range(TRAIN_STEPS):
        shadow.step()
        sched.step()
    return sched.state_dict()


def _options(spec: FixtureSpec) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=spec.flatten_optim)


def state_for_save(spec: FixtureSpec, model: Transformer, optim: Any, rank: int, step: int) -> dict:
    """The dict each rank passes to dcp.save (and, filled with templates, to dcp.load)."""
    if spec.style == "titan":
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        state: dict[str, Any] = dict(get_model_state_dict(model))
        state["optimizer"] = get_optimizer_state_dict(model, optim, options=opts)
        state["lr_scheduler"] = _lr_scheduler_state(optim)
        dp_world = math.prod(s for n, s in spec.layout if n.startswith("dp"))
        dp_rank = _dp_rank(spec.layout_dict, rank)
        loader = {"sample_idx": step * BATCH, "epoch": 0, "dp_rank": dp_rank}
        state["dataloader"] = {f"dp_rank_{dp_rank}": pickle.dumps(loader), "world_size": dp_world}
        state["train_state"] = {"step": step, "ntokens_seen": torch.tensor(step * BATCH * SEQ_LEN)}
        return state
    model_sd, optim_sd = get_state_dict(model, optim, options=_options(spec))
    extra = special_extra() if spec.special else {"step": step, "kind": spec.kind}
    return {"model": model_sd, "optim": optim_sd, "extra": extra}


def load_into(spec: FixtureSpec, model: Transformer, optim: Any, ckpt_dir: str) -> None:
    """dcp.load the model and optimizer state of ``ckpt_dir`` (saved as ``spec``) in place."""
    if spec.style == "titan":
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        state = dict(get_model_state_dict(model))
        state["optimizer"] = get_optimizer_state_dict(model, optim, options=opts)
        dcp.load(state, checkpoint_id=ckpt_dir)
        osd = state.pop("optimizer")
        set_state_dict(model, optim, model_state_dict=state, optim_state_dict=osd, options=opts)
        return
    opts = _options(spec)
    model_sd, optim_sd = get_state_dict(model, optim, options=opts)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(
        model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts
    )


def param_boxes(model: Transformer) -> dict[str, dict]:
    """Per parameter: mesh dim names, placements and the box this rank holds (global coords)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            mesh = list(p.device_mesh.mesh_dim_names or ())
            placements = [repr(pl) for pl in p.placements]
        else:
            shape, offset, mesh, placements = tuple(p.shape), (0,) * p.dim(), [], []
        out[name] = {
            "global_shape": list(p.shape),
            "mesh": mesh,
            "placements": placements,
            "offsets": list(offset),
            "sizes": list(shape),
        }
    return out


# ----------------------------------------------------------------------------- workers


def _save_worker(rank: int, world: int, spec: FixtureSpec, ckpt_dir: str, work_dir: str) -> None:
    cpu, wall = time.process_time(), time.perf_counter()
    model, optim = _build_for(spec, spec.layout_dict, spec.seed)
    losses = train_steps(model, optim, TRAIN_STEPS, spec.seed)
    dcp.save(state_for_save(spec, model, optim, rank, TRAIN_STEPS), checkpoint_id=ckpt_dir)
    cont = train_steps(model, optim, CONTINUE_STEPS, spec.seed, start=TRAIN_STEPS)
    result = {
        "train_losses": losses,
        "continue_losses": cont,
        "boxes": param_boxes(model),
        "cpu_seconds": round(time.process_time() - cpu, 2),
        "wall_seconds": round(time.perf_counter() - wall, 2),
    }
    Path(work_dir, f"_rank{rank}.json").write_text(json.dumps(result))


def _continue_worker(
    rank: int, world: int, spec: FixtureSpec, layout: dict, ckpt_dir: str, work_dir: str
) -> None:
    model, optim = _build_for(spec, layout, spec.seed + 777)  # other weights: the load must win
    load_into(spec, model, optim, ckpt_dir)
    losses = train_steps(model, optim, CONTINUE_STEPS, spec.seed, start=TRAIN_STEPS)
    Path(work_dir, f"_rank{rank}.json").write_text(json.dumps({"continue_losses": losses}))


def _collect(work_dir: Path, world: int) -> dict[int, dict]:
    out = {}
    for r in range(world):
        path = work_dir / f"_rank{r}.json"
        out[r] = json.loads(path.read_text())
        path.unlink()
    return out


# ----------------------------------------------------------------------------- public API


def build_checkpoint(spec: FixtureSpec, ckpt_dir: Path, work_dir: Path) -> Path:
    """Train and save ``spec`` into ``ckpt_dir``; write ``work_dir/_fixture.json``."""
    ckpt_dir, work_dir = Path(ckpt_dir), Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    if ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    t0 = time.perf_counter()
    run_world(_save_worker, max(1, spec.world_size), (spec, str(ckpt_dir), str(work_dir)))
    ranks = _collect(work_dir, max(1, spec.world_size))
    info = {
        "kind": spec.kind,
        "world_size": max(1, spec.world_size),
        "layout": [[n, s] for n, s in spec.layout],
        "style": spec.style,
        "special": spec.special,
        "flatten_optim": spec.flatten_optim,
        "seed": spec.seed,
        "model_args": spec.model_args.to_json(),
        "torch_version": torch.__version__,
        "train_steps": TRAIN_STEPS,
        "train_losses": {str(r): v["train_losses"] for r, v in ranks.items()},
        "continue_losses": {str(r): v["continue_losses"] for r, v in ranks.items()},
        "boxes": {str(r): v["boxes"] for r, v in ranks.items()},
        "build_seconds": round(time.perf_counter() - t0, 2),
        "rank_cpu_seconds": [v["cpu_seconds"] for v in ranks.values()],
        "rank_wall_seconds": [v["wall_seconds"] for v in ranks.values()],
    }
    (work_dir / FIXTURE_JSON).write_text(json.dumps(info, indent=1))
    return ckpt_dir


def make_checkpoint(kind: str, out_dir: Path) -> Path:
    """Build fixture ``kind`` (a key of :data:`KINDS`) under ``out_dir/<kind>``; returns the DCP dir."""
    if kind not in KINDS:
        raise KeyError(f"unknown fixture kind {kind!r}; known: {sorted(KINDS)}")
    root = Path(out_dir) / kind
    return build_checkpoint(KINDS[kind], root / "ckpt", root)


def fixture_info(ckpt_dir: Path) -> dict:
    """The ``_fixture.json`` written next to (in the parent of) a fixture checkpoint."""
    return json.loads((Path(ckpt_dir).parent / FIXTURE_JSON).read_text())


def spec_from_info(info: dict) -> FixtureSpec:
    """Rebuild the FixtureSpec recorded in a ``_fixture.json``."""
    return FixtureSpec(
        kind=info["kind"],
        layout=tuple((n, s) for n, s in info["layout"]),
        model_args=ModelArgs.from_json(info["model_args"]),
        seed=info["seed"],
        style=info["style"],
        special=info["special"],
        flatten_optim=info["flatten_optim"],
    )


def load_and_continue(
    ckpt_dir: Path, layout: dict[str, int] | None = None, spec: FixtureSpec | None = None
) -> dict[int, list[float]]:
    """Load ``ckpt_dir`` into a fresh world of ``layout`` (default: the saving layout) with
    dcp.load, train steps 3..5, and return each rank's losses.

    ``spec`` defaults to the one recorded in the fixture's ``_fixture.json``; pass it for
    checkpoints that are not fixtures (e.g. converter output) with the same model.
    """
    spec = spec or spec_from_info(fixture_info(ckpt_dir))
    layout = spec.layout_dict if layout is None else layout
    world = max(1, math.prod(layout.values()))
    with tempfile.TemporaryDirectory() as tmp:
        run_world(_continue_worker, world, (spec, layout, str(ckpt_dir), tmp))
        return {r: v["continue_losses"] for r, v in _collect(Path(tmp), world).items()}
