"""--mesh grammar, canonical order, --mesh-order, and rank numbering checked against init_device_mesh."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from converter.plan.mesh import Mesh, MeshDim, parse_mesh
from formats.errors import ConfigError, UnsupportedError


def test_parse_canonical_order_and_alias():
    mesh = parse_mesh("tp2,dp32")
    assert mesh.dims == (MeshDim("dp_shard", 32), MeshDim("tp", 2))
    assert str(mesh) == "dp_shard32,tp2"
    assert mesh.world_size == 64
    assert mesh.names == ("dp_shard", "tp")
    assert mesh.size("dp") == mesh.size("dp_shard") == 32
    assert mesh.size("pp") == 1 and mesh.size("cp", default=0) == 0


def test_written_order_does_not_matter():
    a = parse_mesh("pp2,dp16,tp2")
    assert a == parse_mesh("tp2,pp2,dp_shard16") == parse_mesh(" dp16 , tp2 ,pp2 ")
    assert str(a) == "pp2,dp_shard16,tp2"
    assert str(parse_mesh("dp4,dp_replicate2")) == "dp_replicate2,dp_shard4"
    assert str(parse_mesh("tp2,cp2,dp2,dp_replicate2,pp2")) == "pp2,dp_replicate2,dp_shard2,cp2,tp2"


def test_mesh_order_overrides():
    mesh = parse_mesh("tp2,dp3", order="tp,dp")
    assert mesh.names == ("tp", "dp_shard")
    assert mesh.coords(1) == (0, 1)  # dp varies fastest now
    with pytest.raises(ConfigError, match="mesh-order"):
        parse_mesh("tp2,dp3", order="tp")
    with pytest.raises(ConfigError, match="mesh-order"):
        parse_mesh("tp2,dp3", order="tp,dp,pp")


@pytest.mark.parametrize(
    "text, match",
    [
        ("tp2,xp4", "unknown dim name 'xp'"),
        ("tp0,dp2", "size 0"),
        ("tp2,tp4", "given twice"),
        ("dp2,dp_shard2", "given twice"),
        ("tp", "cannot read"),
        ("2tp", "cannot read"),
        ("", "empty"),
        (",", "empty"),
    ],
)
def test_errors_are_one_line_config_errors(text, match):
    with pytest.raises(ConfigError, match=match) as info:
        parse_mesh(text)
    assert "\n" not in str(info.value)


def test_ep_borrows_ranks_and_etp_is_megatrons_only():
    """ep is torchtitan's expert_parallel_degree (ranks borrowed from dp_shard*cp*tp; test_moe_layouts.py);
    etp is megatron's expert_tensor_parallel_size: no ranks of its own, refused by every plan but
    megatron-core's own."""
    from converter.plan.mesh import refuse_etp

    assert parse_mesh("ep2,dp2").world_size == 2
    m = parse_mesh("dp4,ep2,etp2")
    assert (m.world_size, m.ep, m.etp, str(m)) == (4, 2, 2, "dp_shard4,ep2,etp2")
    assert parse_mesh(str(m)) == m and parse_mesh("dp4").etp == 0
    refuse_etp(parse_mesh("dp4,ep2"), "megatron")
    with pytest.raises(UnsupportedError, match="etp .*--plan megatron-core"):
        refuse_etp(m, "megatron")
    with pytest.raises(UnsupportedError, match="efsdp"):
        parse_mesh("efsdp2,dp2")


def test_mesh_validates_itself():
    with pytest.raises(ConfigError):
        Mesh((MeshDim("tp", 2), MeshDim("tp", 2)))
    with pytest.raises(ConfigError):
        Mesh((MeshDim("tp", 0),))


def test_coords_rank_round_trip_row_major():
    mesh = parse_mesh("pp2,dp3,tp2")
    seen = set()
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        assert mesh.rank_of(c) == rank
        seen.add(c)
    assert len(seen) == 12
    assert mesh.coords(1) == (0, 0, 1) and mesh.coords(2) == (0, 1, 0) and mesh.coords(6) == (1, 0, 0)
    with pytest.raises(ConfigError):
        mesh.coords(12)
    with pytest.raises(ConfigError):
        mesh.rank_of((0, 3, 0))


@pytest.mark.parametrize("text", ["dp4", "dp2,tp3", "pp2,dp_replicate2,dp2", "tp2,dp3"])
def test_numbering_matches_init_device_mesh(text):
    """Each rank's coordinate from a real DeviceMesh (fake process group, one per rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    mesh = parse_mesh(text)
    for rank in range(mesh.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=mesh.world_size)
        try:
            dm = init_device_mesh("cpu", mesh.shape, mesh_dim_names=mesh.names)
            assert tuple(dm.get_coordinate()) == mesh.coords(rank)
            for i, name in enumerate(mesh.names):  # the group along each dim: same other coords
                group = dm[name].mesh.tolist()
                want = [mesh.rank_of(mesh.coords(rank)[:i] + (k,) + mesh.coords(rank)[i + 1 :]) for k in range(mesh.shape[i])]
                assert group == want
        finally:
            dist.destroy_process_group()
