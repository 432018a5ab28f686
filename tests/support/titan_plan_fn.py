"""A ``--plan python:tests.support.titan_plan_fn:FUNCTION`` hook for the tests: torch's own FSDP2 x TP on a
small MLP built on the meta device (no framework needed)."""

from __future__ import annotations


def fsdp_tp_mlp(mesh):
    """``0`` colwise, ``2`` rowwise over ``tp``; ``fully_shard`` over ``dp_shard``; ``norm`` plain."""
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.LayerNorm(16))
    names = mesh.mesh_dim_names
    if "tp" in names and mesh["tp"].size() > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if "dp_shard" in names:
        fully_shard(model, mesh=mesh["dp_shard"])
    return model


def not_a_model(mesh):
    raise ValueError("this hook always fails")
