"""The expert-parallel arithmetic of :mod:`formats.deepspeed_zero.moe` (pure, no DeepSpeed):
DeepSpeed 0.19.8's rank layout (``groups._create_expert_and_data_parallel``, its docstring's
example) and global expert ids (``_save_moe_checkpoint``: ``expp_rank * num_local_experts + local``)."""

from __future__ import annotations

import pytest

from formats.deepspeed_zero.moe import (MoELayer, expert_dp_ranks, ep_rank_of, global_expert, global_name,
                                        group_ep_size, split_expert)
from formats.errors import CheckpointNotFoundError, CorruptCheckpointError


def test_ranks_follow_deepspeeds_expert_then_data_layout():
    """DeepSpeed's example: world 16, ep 2: expert-data-parallel groups [0,2,..,14] and
    [1,3,..,15], expert-parallel groups [0,1], [2,3], ..."""
    assert expert_dp_ranks(0, 2, 16) == list(range(0, 16, 2))
    assert expert_dp_ranks(1, 2, 16) == list(range(1, 16, 2))
    assert [ep_rank_of(r, 2, 4) for r in range(4)] == [0, 1, 0, 1]
    for first in (False, True):
        for ep in (1, 2, 4, 8):  # every dp rank lies in exactly one expert-dp group, at its own ep rank
            groups = [expert_dp_ranks(e, ep, 8, first) for e in range(ep)]
            assert sorted(r for g in groups for r in g) == list(range(8))
            assert all(ep_rank_of(r, ep, 8, first) == e for e, g in enumerate(groups) for r in g)


def test_ranks_follow_deepspeeds_data_then_expert_layout():
    """``use_data_before_expert_parallelism``: world 8, ep 2: expert-data-parallel groups
    [0..3], [4..7]; expert-parallel groups range(i, 8, 4)."""
    assert expert_dp_ranks(0, 2, 8, True) == [0, 1, 2, 3] and expert_dp_ranks(1, 2, 8, True) == [4, 5, 6, 7]
    assert [ep_rank_of(r, 2, 8, True) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_global_expert_ids():
    assert [global_expert(k, e, 8, 4) for e in range(4) for k in range(2)] == list(range(8))
    assert global_expert(1, 0, 2, 1) == 1  # ep 1: every rank holds every expert


def test_split_and_rename_expert_names():
    name = "layers.3.mlp.deepspeed_moe.experts.deepspeed_experts.1.0.weight"
    assert split_expert(name) == ("layers.3.mlp.deepspeed_moe.experts.deepspeed_experts.", 1, ".0.weight")
    assert split_expert("layers.3.mlp.deepspeed_moe.gate.wg.weight") is None
    layers = {"layers.3.mlp.deepspeed_moe.experts.deepspeed_experts.":
              MoELayer(0, "layers.3.mlp.deepspeed_moe.experts.deepspeed_experts.", 8, ())}
    assert global_name(name, layers, 3, 4, "f") == "layers.3.mlp.deepspeed_moe.experts.deepspeed_experts.7.0.weight"
    with pytest.raises(CorruptCheckpointError, match="local expert 2 of 8 experts over ep_size 4"):
        global_name(name.replace(".1.0.", ".2.0."), layers, 0, 4, "f")
    with pytest.raises(CheckpointNotFoundError, match="without expert files"):
        global_name("other.deepspeed_moe.experts.deepspeed_experts.0.weight", layers, 0, 4, "f")
    with pytest.raises(CorruptCheckpointError, match="no 'deepspeed_moe.experts.deepspeed_experts' parameter"):
        global_name("inp.weight", layers, 0, 4, "f")


def test_group_ep_size_from_name_and_partition_count():
    assert group_ep_size({"name": "ep_size_2", "moe": True}, 2, 4, "f") == 2
    assert group_ep_size({"name": "ep_size_1", "moe": True}, 2, 2, "f") == 1
    assert group_ep_size({"moe": True}, 1, 4, "f") == 4  # no name: world // partition count
    for hp, count, world in (({"name": "ep_size_2"}, 1, 4), ({"name": "ep_size_3"}, None, 4)):
        with pytest.raises(CorruptCheckpointError, match="not an expert-parallel layout"):
            group_ep_size(hp, count, world, "f")
