"""``--plan megatron-core``: each target rank's chunks as megatron-core's own ``sharded_state_dict()``
asks for them, read from megatron-core itself.

The model is megatron-core's ``GPTModel`` built from the checkpoint's training arguments (``args`` of
its common state: sizes, GQA, SwiGLU, norms, biases, MoE experts, tied embeddings; the local layer
spec, whose sharded keys are Transformer Engine's) on the meta device, once per distinct rank of the
target (tp, pp, and the experts' etp, ep: ``--mesh ...,ep<E>,etp<T>``, megatron's
``expert_model_parallel_size`` / ``expert_tensor_parallel_size``, etp by default the tp; its virtual
pipeline chunks with ``--vpp``), over a fake process group of the target world in one process
(``FakeStore``, backend ``"fake"``: no data, no peers) and megatron's ``initialize_model_parallel``. Every ShardedTensor of its ``sharded_state_dict()`` (the GLU
``linear_fc1`` factory built into its two halves) gives a box in global coordinates and whether this
rank holds the main replica (``replica_id`` all zero: the rank megatron's own save writes it from).

:func:`code_layout` then gives every box of the checkpoint to its main replica's rank: each rank's
file holds exactly the chunks only it loads (its TP / PP / expert shards), and a chunk several ranks
load (DP replicas, TP-replicated norms) lies in one of their files; the optimizer states
``optimizer.state.<state>.<key>`` (``fully_reshardable``) follow their parameter.

The work runs in a subprocess (``python -m converter.plan.megatron_code``), cached on disk like the
torchtitan plans (:mod:`converter.plan.from_code`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from converter import knobs
from converter.plan.from_code import cached_json
from converter.plan.mesh import Mesh
from formats.base import Box, CheckpointIndex
from formats.errors import ConfigError, PlanError

if TYPE_CHECKING:
    from converter.plan.atoms import AtomRef
    from converter.plan.target_layout import TargetLayout

PLAN_NAME = "megatron-core"
_STATE = re.compile(r"optimizer\.state\.[A-Za-z_][A-Za-z0-9_]*\.(?P<key>.+)")
#: The training arguments the model is built from (Megatron-LM's names).
MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "group_query_attention", "kv_channels", "swiglu", "normalization", "add_bias_linear", "add_qkv_bias",
              "qk_layernorm", "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "position_embedding_type",
              "untie_embeddings_and_output_weights", "padded_vocab_size", "max_position_embeddings", "seq_length")


@dataclass(frozen=True)
class RankBoxes:
    """Each sharded key's global shape and boxes: ``(box, owner rank, loaders)``: the main replica's
    rank and every rank whose ``sharded_state_dict()`` asks for that box (None: unknown); each
    ShardedObject (``<key>/shard_<offsets>_<grid>``: a layer's extra state) and its main replica's rank."""

    shapes: Mapping[str, tuple[int, ...]]
    boxes: Mapping[str, tuple[tuple[Box, int, tuple[int, ...] | None], ...]]
    objects: Mapping[str, int] = field(default_factory=dict)


def missing_model_args(args: Mapping[str, Any]) -> list[str]:
    """The training arguments megatron's model cannot be built without that ``args`` lacks."""
    return [k for k in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size") if k not in args]


def installed() -> bool:
    """Whether megatron-core (and so this plan) is installed."""
    return _versions() is not None


def _versions() -> list[str] | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return [version("torch"), version("megatron-core")]
    except PackageNotFoundError:
        return None


def layout_degrees(mesh: Mesh, vpp: int) -> dict[str, int]:
    """megatron's degrees on ``mesh`` (tp, pp, dp; the experts' ep and etp; its dense rank order
    tp-cp-dp-pp is the mesh's, the experts' etp-ep-edp-pp numbers the same ranks)."""
    if mesh.size("cp") > 1 or mesh.size("dp_replicate") > 1:
        raise ConfigError(f"--plan {PLAN_NAME}: mesh {mesh} has cp / dp_replicate; megatron's layout takes tp, pp, dp, "
                          "ep, etp")
    tp, dp, etp = mesh.size("tp"), mesh.size("dp_shard"), mesh.etp or mesh.size("tp")
    if (tp * dp) % (etp * mesh.ep):
        raise ConfigError(f"--plan {PLAN_NAME}: mesh {mesh}: etp{etp} x ep{mesh.ep} must divide tp x dp = {tp * dp} "
                          "(megatron's initialize_model_parallel numbers the experts' ranks within a stage's)")
    return {"tp": tp, "pp": mesh.size("pp"), "dp": dp, "ep": mesh.ep, "etp": etp, "vpp": vpp,
            "world": mesh.world_size}


def load_rank_boxes(args: Mapping[str, Any], mesh: Mesh, vpp: int = 1) -> RankBoxes:
    """The boxes megatron-core's model built from ``args`` asks for on ``mesh`` (subprocess, cached)."""
    model_args = {k: args[k] for k in MODEL_ARGS if k in args and _plain(args[k])}
    missing = missing_model_args(model_args)
    if missing:
        raise ConfigError(f"--plan {PLAN_NAME}: the checkpoint's args lack {', '.join(missing)}; megatron's model "
                          "cannot be built from them (use --plan megatron)")
    layout = layout_degrees(mesh, vpp)
    doc = _cached({"args": model_args, "layout": layout, "v": 3})
    like = _alike(layout)  # the model built for a representative rank: every rank that loads what it loads
    shapes = {k: tuple(v["shape"]) for k, v in doc["keys"].items()}
    boxes = {k: tuple((Box(tuple(o), tuple(s)), int(r), tuple(q for q in range(len(like)) if like[q] in set(reps)))
                      for o, s, r, reps in v["boxes"]) for k, v in doc["keys"].items()}
    return RankBoxes(shapes, boxes, {k: int(r) for k, r in doc.get("objects", {}).items()})


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _cached(job: dict) -> dict:
    versions = _versions()
    if versions is None:
        raise ConfigError(f"--plan {PLAN_NAME} reads megatron-core's own layout: install megatron-core "
                          "(.ci/install_megatron.sh), or use --plan megatron (its name rules)")
    key = json.dumps([job, versions], sort_keys=True)
    base = os.environ.get("CKPTCONV_PLAN_CACHE") or Path.home() / ".cache" / "ckptconv" / "plans"
    path = Path(base) / ("megatron-" + hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
    return cached_json(path, lambda: _run(job))


def _run(job: dict) -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "converter.plan.megatron_code", json.dumps(job)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=knobs.CODE_PLAN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PlanError(f"--plan {PLAN_NAME}: building megatron's model took over {knobs.CODE_PLAN_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise PlanError(f"--plan {PLAN_NAME}: {lines[-1] if lines else f'exit status {proc.returncode}'}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def code_layout(index: CheckpointIndex, boxes: RankBoxes, keep: Any = None
                ) -> tuple[list[tuple[str, Box, int, tuple[int, ...] | None]], list[str]]:
    """(key, box, owner rank, loading ranks) of every target chunk and the warnings: a model key and
    its optimizer states on megatron's boxes (the model key's shape checked against the model's); any
    other tensor (a state of another shape, as a 0-d step, included) whole, in rank 0's file (its
    loaders None: unknown)."""
    out, whole = [], []
    for key, entry in index.tensors.items():
        if keep is not None and key not in keep:
            continue
        m = _STATE.fullmatch(key)
        model_key = m.group("key") if m and m.group("key") in boxes.boxes else key
        hit = boxes.boxes.get(model_key)
        if hit is not None and model_key != key and tuple(boxes.shapes[model_key]) != tuple(entry.shape):
            hit = None  # a state shaped unlike its parameter: whole
        if hit is None:
            out.append((key, Box(tuple(0 for _ in entry.shape), tuple(entry.shape)), 0, None))
            if not key.startswith("optimizer.") or (m and model_key == key):  # (not a state of a model key)
                whole.append(key)
            continue
        if tuple(boxes.shapes[model_key]) != tuple(entry.shape):
            raise PlanError(f"--plan {PLAN_NAME}: {model_key} is {list(boxes.shapes[model_key])} in megatron's model "
                            f"built from the checkpoint's args but {list(entry.shape)} in the checkpoint")
        out += [(key, box, rank, loaders) for box, rank, loaders in hit]
    warnings = [f"--plan {PLAN_NAME}: {len(whole)} tensor(s) megatron's model does not name are written whole in rank "
                f"0's file ({', '.join(whole[:4])}{' ...' if len(whole) > 4 else ''})"] if whole else []
    return out, warnings


def code_target_layout(index: CheckpointIndex, refs: Mapping[str, AtomRef], mesh: Mesh, boxes: RankBoxes,
                       dtype_override: str | None, keep: Any, reason: str, strict: bool = False) -> TargetLayout:
    """Pure: the target layout of ``index`` on ``mesh`` with megatron's ``boxes`` (:func:`code_layout`;
    ``dtype_override`` casts the floating-point parameters as ``--dtype`` does). ``strict``: a tensor
    megatron's model does not name is a PlanError (``--plan auto`` then falls back to the name rules)."""
    from dataclasses import replace

    from converter.plan.placement_rules import replicated
    from converter.plan.target_layout import TargetLayout
    from formats.dcp.writer import ChunkSpec
    from formats.dtypes import CASTABLE_FLOATS

    rows, warnings = code_layout(index, boxes, keep)
    if strict and warnings:
        raise PlanError(warnings[0])
    chunks, holders = [], []
    for key, box, rank, loaders in rows:
        entry, ref = index.tensors[key], refs.get(key)
        cast = dtype_override is not None and ref is not None and ref.role == "param" and entry.dtype in CASTABLE_FLOATS
        chunks.append(ChunkSpec(key, dtype_override if cast else entry.dtype, tuple(entry.shape), box, rank))
        holders.append(loaders if loaders is not None else tuple(range(mesh.world_size)))  # unknown: any rank
    # (the dry run's placement column: megatron's boxes are not DTensor placements; each chunk lists its rank)
    shown = replace(replicated(mesh), rule=f"{PLAN_NAME} (sharded_state_dict boxes)")
    return TargetLayout(mesh, tuple(chunks), tuple(warnings), key_placements={k: shown for k, *_ in rows},
                        plan=PLAN_NAME, plan_reason=reason, holders=tuple(holders))


# ---------------------------------------------------------------- subprocess side (torch, megatron-core)


def _config(args: Mapping[str, Any], layout: Mapping[str, int]) -> Any:
    """megatron's TransformerConfig from Megatron-LM's argument names (its own defaults otherwise)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    swiglu = bool(args.get("swiglu"))
    experts = args.get("num_experts") or None
    gqa = args.get("group_query_attention", args.get("num_query_groups") is not None)
    moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=args.get("moe_ffn_hidden_size"),
               moe_router_topk=args.get("moe_router_topk") or 2, moe_token_dispatcher_type="allgather",
               expert_model_parallel_size=layout["ep"],
               expert_tensor_parallel_size=layout.get("etp", layout["tp"])) if experts else {}
    return TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], num_attention_heads=args["num_attention_heads"],
        num_query_groups=args.get("num_query_groups") if gqa else None, ffn_hidden_size=args.get("ffn_hidden_size"),
        kv_channels=args.get("kv_channels"), gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
        normalization=args.get("normalization") or "LayerNorm", add_bias_linear=args.get("add_bias_linear", True),
        add_qkv_bias=bool(args.get("add_qkv_bias")), qk_layernorm=bool(args.get("qk_layernorm")),
        use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=layout["tp"],
        pipeline_model_parallel_size=layout["pp"],
        virtual_pipeline_model_parallel_size=layout["vpp"] if layout["vpp"] > 1 else None, **moe)


def _rank_rows(args: Mapping[str, Any], layout: Mapping[str, int]) -> list[tuple[str, tuple, tuple, tuple, bool]]:
    """(key, global shape, offsets, sizes, main replica) of every ShardedTensor this rank asks for;
    a ShardedObject: (its unique key, None, None, None, main replica)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = _config(args, layout)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization=config.normalization,
                                    qk_layernorm=config.qk_layernorm)
    rows = []

    def walk(v: Any) -> None:
        if isinstance(v, ShardedTensorFactory):
            walk(v.build())
        elif isinstance(v, ShardedObject):
            rid = v.replica_id if isinstance(v.replica_id, tuple) else (v.replica_id,)
            rows.append((v.unique_key, None, None, None, all(int(r) == 0 for r in rid)))
        elif isinstance(v, ShardedTensor):
            lead = len(v.global_shape) - len(v.local_shape)
            offs = tuple(int(o) for o in v.global_offset)
            sizes = (1,) * lead + tuple(int(s) for s in v.local_shape)
            rid = v.replica_id if isinstance(v.replica_id, tuple) else (v.replica_id,)
            rows.append((v.key, tuple(v.global_shape), offs, sizes, all(int(r) == 0 for r in rid)))
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    vpp = layout["vpp"]
    for chunk in range(vpp):
        stage = chunk if vpp > 1 else None
        with torch.device("meta"):
            model = GPTModel(config, spec, vocab_size=args.get("padded_vocab_size") or 32000,
                             max_sequence_length=args.get("max_position_embeddings") or args.get("seq_length") or 2048,
                             position_embedding_type=args.get("position_embedding_type") or "learned_absolute",
                             pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                             post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                             share_embeddings_and_output_weights=not args.get("untie_embeddings_and_output_weights",
                                                                               False), vp_stage=stage)
        walk(model.sharded_state_dict())
    return rows


def _signature(layout: Mapping[str, int], rank: int) -> tuple[int, int, int, int]:
    """What decides the boxes ``rank``'s model asks for: its (tp, pp, etp, ep) coordinates, as
    megatron's rank generators number them (dense tp-dp-pp; experts etp-ep-edp-pp over the same ranks)."""
    tp, dp, ep = layout["tp"], layout["dp"], layout["ep"]
    etp = layout.get("etp", tp)
    return rank % tp, rank // (tp * dp), rank % etp, (rank // etp) % ep


def _alike(layout: Mapping[str, int]) -> list[int]:
    """Per rank of the world, the lowest rank with its :func:`_signature` (whose model asks for the
    same boxes; the lowest one holds every main replica among them: dp rank 0 of its tp rank and
    expert-dp rank 0 of its expert ranks)."""
    first: dict[tuple[int, int, int, int], int] = {}
    return [first.setdefault(_signature(layout, r), r) for r in range(layout["world"])]


def _ranks(layout: Mapping[str, int]) -> list[int]:
    """The ranks whose chunks can differ: one per distinct (tp, pp, etp, ep) (:func:`_alike`)."""
    return sorted(set(_alike(layout)))


def main(argv: list[str]) -> None:
    """Print the JSON plan of ``argv[0]`` (``{"args": ..., "layout": ...}``)."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.cuda.current_device = lambda: "cpu"  # (megatron asks for it; nothing is placed on it on meta)
    from megatron.core import parallel_state as ps

    job = json.loads(argv[0])
    args, layout = job["args"], job["layout"]
    keys: dict[str, dict] = {}
    objects: dict[str, int] = {}
    for rank in _ranks(layout):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout["world"])
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
                                         virtual_pipeline_model_parallel_size=layout["vpp"] if layout["vpp"] > 1 else None,
                                         expert_model_parallel_size=layout["ep"],
                                         expert_tensor_parallel_size=layout.get("etp", layout["tp"]),
                                         create_gloo_process_groups=False)
            for key, shape, offs, sizes, main_replica in _rank_rows(args, layout):
                if shape is None:  # a ShardedObject
                    if main_replica or key not in objects:
                        objects[key] = rank
                    continue
                entry = keys.setdefault(key, {"shape": list(shape), "boxes": {}})
                prev = entry["boxes"].get((offs, sizes))
                if prev is None or (main_replica and not prev[1]):  # the main replica's rank writes it
                    entry["boxes"][(offs, sizes)] = (rank, main_replica, [*(prev[2] if prev else ()), rank])
                else:
                    prev[2].append(rank)
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    out = {k: {"shape": v["shape"], "boxes": [[list(o), list(s), r, q] for (o, s), (r, _, q) in v["boxes"].items()]}
           for k, v in keys.items()}
    print(json.dumps({"keys": out, "objects": objects}))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Exception as e:  # one line for the converter side
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
