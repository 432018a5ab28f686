"""Loading DCP safetensors checkpoints in real gloo worlds with torch's own
``HuggingFaceStorageReader`` (the oracle of ``from-universal --format dcp-safetensors``): every
rank ``dcp.load``-s the tiny Llama's state (model + AdamW state tensors) through a reader that
records each item it reads, and compares its local shards bit for bit with a reference.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import ckpt_factory
from models import ModelArgs, make_optimizer, train_steps



def _recording_reader(path: str):
    """torch's ``HuggingFaceStorageReader``, recording every item it reads: (key, chunk offsets,
    chunk shape, file)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    class Recording(HuggingFaceStorageReader):
        def __init__(self, p: str) -> None:
            super().__init__(p)
            self.items: list[dict] = []

        def read_data(self, plan, planner):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                self.items.append({"key": item.storage_index.fqn, "offsets": list(item.storage_index.offset),
                                   "sizes": list(info.shape), "file": os.path.basename(info.relative_path)})
            return super().read_data(plan, planner)

    return Recording(path)


def llama_template(layout: dict[str, int], seed: int = 777) -> dict[str, Any]:
    """The state a job on ``layout`` loads (other values than any source: the load must win):
    the tiny Llama parallelized as torchtitan would, AdamW stepped once so its states exist."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = ckpt_factory.make_mesh(layout)
    model = ckpt_factory.build_parallel_model(layout, ModelArgs(), mesh, seed=seed)
    optim = make_optimizer(model)
    train_steps(model, optim, 1, seed=seed)
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": {"state": optim_sd["state"]}}


def _load_worker(rank: int, world: int, layout: dict[str, int], path: str, ref: str, out: str, model: str) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if model == "moe":
        import hf_storage_factory

        state = hf_storage_factory.moe_state(seed=777)  # torchtitan's EP layout on 4 ranks, other values
    else:
        state = llama_template(layout)
    reader = _recording_reader(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader)
    want = torch.load(ref, weights_only=True)
    flat, _ = flatten_state_dict(state)
    errors, local = [], {}
    for key, value in flat.items():
        if isinstance(value, DTensor):
            shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            part = want[key][tuple(slice(o, o + s) for o, s in zip(offset, shape))]
            got = value.to_local()
            local[key] = [list(offset), list(shape)]
        else:
            part, got = want[key], value
            local[key] = [[0] * value.dim(), list(value.shape)]
        same = got.dtype == part.dtype and tuple(got.shape) == tuple(part.shape) and torch.equal(
            got.contiguous().view(-1).view(torch.uint8), part.contiguous().view(-1).view(torch.uint8))
        if not same:
            errors.append(key)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"errors": errors, "reads": reader.items, "local": local}))


def load_in_world(layout: dict[str, int], path: Path, reference_of: Path, tmp: Path,
                  model: str = "llama") -> dict[int, dict]:
    """A gloo world of ``layout`` ``dcp.load``-s the tiny Llama's state (``model="moe"``: the MoE
    block of :func:`hf_storage_factory.moe_state` under EP on 4 ranks) from ``path`` with torch's
    ``HuggingFaceStorageReader``; per rank: keys whose local value differs from ``reference_of``
    (a ``reference.pt``), every item read, every local box."""
    world = max(1, math.prod(layout.values()))
    tmp.mkdir(parents=True, exist_ok=True)
    ckpt_factory.run_world(_load_worker, world, (layout, str(path), str(reference_of), str(tmp), model))
    return {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)}
