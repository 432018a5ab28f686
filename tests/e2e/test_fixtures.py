"""The fixture checkpoints are what they claim: torch loads them, keys/dtypes/boxes are as documented.

Only torch reads the checkpoints here (``FileSystemReader.read_metadata``, ``dcp_to_torch_save``).
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ckpt_factory import (
    KINDS,
    NAN_BITS_F32,
    add_special_buffers,
    fixture_info,
    load_and_continue,
    special_extra,
)
from models import ModelArgs, build_model, stage_layers
from oracle import assert_same_value, bits_equal, torch_reference

PARAMS = [k for k in build_model(ModelArgs()).state_dict()]


def _meta(ckpt):
    return FileSystemReader(str(ckpt)).read_metadata()


def _boxes(meta, key):
    """{(offsets, sizes): file} for every chunk of ``key``."""
    md = meta.state_dict_metadata[key]
    out = {}
    for c in md.chunks:
        info = meta.storage_data[MetadataIndex(key, c.offsets)]
        out[(tuple(c.offsets), tuple(c.sizes))] = info.relative_path
    return out


def _rows(meta, key):
    return sorted((o[0], s[0]) for o, s in _boxes(meta, key))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_loads_with_torch_and_chunks_tile(dcp_checkpoint, kind):
    ckpt = dcp_checkpoint(kind)
    ref = torch_reference(ckpt)
    meta = _meta(ckpt)
    info = fixture_info(ckpt)
    assert info["kind"] == kind and info["world_size"] == max(1, KINDS[kind].world_size)
    assert set(ref) == set(meta.state_dict_metadata)
    for key, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        assert tuple(ref[key].shape) == tuple(md.size) and ref[key].dtype == md.properties.dtype, key
        covered = sum(math.prod(c.sizes) for c in md.chunks)
        assert covered == math.prod(md.size), f"{key}: chunks cover {covered} of {tuple(md.size)}"
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(info["world_size"])]
    for losses in (*info["train_losses"].values(), *info["continue_losses"].values()):
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_fsdp4_uneven_embedding_rows(dcp_checkpoint):
    meta = _meta(dcp_checkpoint("fsdp4"))
    for key in ("model.tok_embeddings.weight", "optim.state.tok_embeddings.weight.exp_avg"):
        boxes = _boxes(meta, key)
        assert sorted((o[0], s[0], f) for (o, s), f in boxes.items()) == [
            (0, 13, "__0_0.distcp"), (13, 13, "__1_0.distcp"), (26, 13, "__2_0.distcp"), (39, 11, "__3_0.distcp")
        ]
    step = meta.state_dict_metadata["optim.state.tok_embeddings.weight.step"]
    assert tuple(step.size) == () and [tuple(c.offsets) for c in step.chunks] == [()]
    info = fixture_info(dcp_checkpoint("fsdp4"))
    assert len({tuple(v) for v in info["train_losses"].values()}) == 1  # same data on every rank


def test_tp2dp2_strided_shard_boxes(dcp_checkpoint):
    ckpt = dcp_checkpoint("tp2dp2")
    meta, info = _meta(ckpt), fixture_info(ckpt)
    # rank = dp * 2 + tp; colwise: (_StridedShard(0, sf=2), Shard(0)), boxes TP-major.
    wq = _boxes(meta, "model.layers.0.attention.wq.weight")
    assert wq == {
        ((0, 0), (8, 32)): "__0_0.distcp", ((16, 0), (8, 32)): "__1_0.distcp",
        ((8, 0), (8, 32)): "__2_0.distcp", ((24, 0), (8, 32)): "__3_0.distcp",
    }
    assert info["boxes"]["1"]["layers.0.attention.wq.weight"]["placements"] == [
        "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"
    ]
    # vocab 50: TP halves of 25, each FSDP-split 13/12.
    assert _boxes(meta, "model.tok_embeddings.weight") == {
        ((0, 0), (13, 32)): "__0_0.distcp", ((25, 0), (13, 32)): "__1_0.distcp",
        ((13, 0), (12, 32)): "__2_0.distcp", ((38, 0), (12, 32)): "__3_0.distcp",
    }
    # rowwise: (Shard(0), Shard(1)), true 2-D boxes.
    wo = _boxes(meta, "model.layers.1.attention.wo.weight")
    assert wo == {
        ((0, 0), (16, 16)): "__0_0.distcp", ((0, 16), (16, 16)): "__1_0.distcp",
        ((16, 0), (16, 16)): "__2_0.distcp", ((16, 16), (16, 16)): "__3_0.distcp",
    }
    # TP-replicated norm: only the two dp chunks survive dedup.
    assert _rows(meta, "model.norm.weight") == [(0, 16), (16, 16)]
    assert len({tuple(v) for v in info["train_losses"].values()}) == 1


def test_hsdp_replicas_deduplicated(dcp_checkpoint):
    meta = _meta(dcp_checkpoint("hsdp2x2"))
    assert _rows(meta, "model.tok_embeddings.weight") == [(0, 25), (25, 25)]
    assert _rows(meta, "optim.state.layers.1.feed_forward.w1.weight.exp_avg_sq") == [(0, 48), (48, 48)]
    info = fixture_info(dcp_checkpoint("hsdp2x2"))
    assert info["boxes"]["0"]["norm.weight"]["placements"] == ["Replicate()", "Shard(dim=0)"]


def test_pp_stages_all_saved(dcp_checkpoint):
    ckpt = dcp_checkpoint("pp2fsdp2")
    ref, info = torch_reference(ckpt), fixture_info(ckpt)
    assert {f"model.{k}" for k in PARAMS} <= set(ref)
    assert stage_layers(2, 0, 2) == ["0"] and stage_layers(2, 1, 2) == ["1"]
    assert "tok_embeddings.weight" in info["boxes"]["0"] and "output.weight" not in info["boxes"]["1"]
    assert "output.weight" in info["boxes"]["2"] and "layers.0.ffn_norm.weight" not in info["boxes"]["3"]
    # Flattened optimizer state (as torchtitan saves PP): hyperparameters per parameter FQN.
    for k in PARAMS:
        assert ref[f"optim.param_groups.{k}.lr"] == pytest.approx(1e-2)
        assert f"optim.state.{k}.exp_avg_sq" in ref
    assert not any(k.startswith("optim.param_groups.0") for k in ref)
    assert _rows(_meta(ckpt), "model.output.weight") == [(0, 25), (25, 25)]


def test_single_process_full_boxes(dcp_checkpoint):
    meta = _meta(dcp_checkpoint("single"))
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            assert [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks] == [((0,) * len(md.size), tuple(md.size))]


def test_bf16_dtypes(dcp_checkpoint):
    ref = torch_reference(dcp_checkpoint("bf16_fsdp2"))
    for k in PARAMS:
        assert ref[f"model.{k}"].dtype == torch.bfloat16
        assert ref[f"optim.state.{k}.exp_avg"].dtype == torch.bfloat16
        assert ref[f"optim.state.{k}.step"].dtype == torch.float32
        assert ref[f"optim.state.{k}.step"].shape == () and float(ref[f"optim.state.{k}.step"]) == 3.0


def test_special_dtypes_exact(dcp_checkpoint):
    ckpt = dcp_checkpoint("special_dtypes")
    ref, meta = torch_reference(ckpt), _meta(ckpt)
    expected = build_model(ModelArgs(out_scale=True))
    add_special_buffers(expected)
    buffers = dict(expected.named_buffers())
    for name in ("fp8_e4m3", "fp8_e5m2", "counts_i64", "mask_bool", "scale_f16", "scalar_0d", "nan_payload",
                 "layers.0.attention.kv_mask"):
        assert bits_equal(ref[f"model.{name}"], buffers[name]), name
    assert ref["model.fp8_e5m2"].dtype == torch.float8_e5m2 and ref["model.scalar_0d"].shape == ()
    bits = ref["model.nan_payload"].view(torch.int32).tolist()
    assert [b & 0xFFFFFFFF for b in bits] == NAN_BITS_F32
    extra = {k[len("extra."):]: v for k, v in ref.items() if k.startswith("extra.")}
    exp = special_extra()
    assert_same_value(
        extra,
        {"step": 7, "name": "run-1", "none": None, "lst": [1, 2.5, "x"], "nested.a.b": [1, 2], "floats": 3.25,
         "transposed": exp["transposed"].contiguous(), "tensor_list.0": exp["tensor_list"][0],
         "tensor_list.1": exp["tensor_list"][1]},
    )
    # (1,)-shaped parameter on 2 ranks: an empty shard at offset 1.
    assert sorted(_boxes(meta, "model.out_scale")) == [((0,), (1,)), ((1,), (0,))]


def test_titan_flat_keys(dcp_checkpoint):
    ref = torch_reference(dcp_checkpoint("titan_flat"))
    assert {k for k in PARAMS} <= set(ref)
    assert not any(k.startswith(("model.", "optim.")) for k in ref)
    for k in PARAMS:
        assert f"optimizer.state.{k}.exp_avg" in ref and f"optimizer.state.{k}.step" in ref
        assert ref[f"optimizer.param_groups.{k}.lr"] == pytest.approx(1e-2)
    assert {"dataloader.dp_rank_0", "dataloader.dp_rank_1", "dataloader.world_size"} <= set(ref)
    assert ref["train_state.step"] == 3 and ref["train_state.ntokens_seen"].dtype == torch.int64
    assert ref["lr_scheduler.last_epoch"] == 3


@pytest.mark.parametrize("kind", ["single", "titan_flat"])
def test_load_and_continue_reproduces_losses(dcp_checkpoint, kind):
    ckpt = dcp_checkpoint(kind)
    got = load_and_continue(ckpt)
    assert {str(r): v for r, v in got.items()} == fixture_info(ckpt)["continue_losses"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp4", "tp2dp2", "hsdp2x2", "pp2fsdp2", "bf16_fsdp2", "special_dtypes"])
def test_load_and_continue_reproduces_losses_slow(dcp_checkpoint, kind):
    ckpt = dcp_checkpoint(kind)
    got = load_and_continue(ckpt)
    assert {str(r): v for r, v in got.items()} == fixture_info(ckpt)["continue_losses"]


def _f32(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_oracle_bits_equal():
    assert bits_equal(_f32(0x7FC00001), _f32(0x7FC00001))
    assert not bits_equal(_f32(0x7FC00001), _f32(0x7FC00002))  # both NaN, payloads differ
    assert not bits_equal(torch.tensor(0.0), torch.tensor(-0.0))
    assert not bits_equal(torch.tensor([1.0]), torch.tensor(1.0))  # shape
    assert not bits_equal(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert bits_equal(torch.tensor(True), torch.tensor(True)) and not bits_equal(torch.tensor(True), torch.tensor(False))
    f8 = torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)
    assert bits_equal(f8, f8.clone())
    t = torch.arange(6.0).view(2, 3)
    assert bits_equal(t.t(), t.t().contiguous())
    assert not bits_equal(t, t.tolist())


def test_oracle_assert_same_value():
    nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    a = {"x": [1, 2.5, "s", None], "t": torch.ones(2), "n": {"f": nan}, "tup": (1,)}
    assert_same_value(a, {"x": [1, 2.5, "s", None], "t": torch.ones(2), "n": {"f": nan}, "tup": (1,)})
    bad = [
        {**a, "t": torch.ones(2, dtype=torch.float64)},
        {**a, "x": [1, 2.5, "s"]},
        {**a, "tup": [1]},
        {**a, "n": {"f": float("nan")}},
        {**a, "x": [True, 2.5, "s", None]},
        {k: v for k, v in a.items() if k != "n"},
    ]
    for b in bad:
        with pytest.raises(AssertionError):
            assert_same_value(a, b)


def test_cache_detects_modification_and_rebuilds(tmp_path):
    from conftest import CheckpointCache

    cache = CheckpointCache(tmp_path / "cache")
    ckpt = cache.get("single")
    assert cache.get("single") == ckpt and (ckpt.parent / "_complete.json").is_file()
    victim = ckpt / "__0_0.distcp"
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="dcp_checkpoint_copy"):
        cache.get("single")
    fresh = CheckpointCache(tmp_path / "cache")  # a new session rebuilds the damaged kind
    assert fresh.get("single") == ckpt and torch_reference(ckpt)


def test_writable_copy_is_private(dcp_checkpoint, dcp_checkpoint_copy):
    copy = dcp_checkpoint_copy("bf16_fsdp2")
    assert copy != dcp_checkpoint("bf16_fsdp2") and fixture_info(copy)["kind"] == "bf16_fsdp2"
    (copy / ".metadata").unlink()
    (copy / "junk").write_text("x")
    assert (dcp_checkpoint("bf16_fsdp2") / ".metadata").is_file()
