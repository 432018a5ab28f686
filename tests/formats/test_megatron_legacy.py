"""Megatron-LM legacy checkpoints (``iter_*/mp_rank_*/model_optim_rng.pt`` + ``distrib_optim.pt``) read
as the torch_dist checkpoint of the same state (fast: a small checked-in fixture).

``tests/data/megatron/legacy_tp2_pp2_vpp2``: one training run of megatron-core 0.19.2's GPTModel (local
spec, Llama-like: RMSNorm, SwiGLU, GQA 4 heads / 2 query groups, bf16, 4 layers) at TP2 x PP2 with a
virtual pipeline of 2 chunks per stage, DistributedOptimizer, 2 steps, saved twice from the same state:
``legacy/`` as Megatron-LM's ``save_checkpoint`` writes with ``--ckpt-format torch``
(``megatron_support.save_legacy``) and ``torch_dist/`` by megatron's ``dist_checkpointing.save`` (torch_dist,
``fully_reshardable``). Regenerate with ``python tests/support/megatron_support.py
tests/data/megatron/legacy_tp2_pp2_vpp2 --tp 2 --pp 2 --vpp 2 --dp 1 --legacy``.

Oracles: torch's own reading of ``torch_dist/`` (``dcp_to_torch_save``) for every tensor, and ``torch.load`` of
the legacy files for every non-tensor value. megatron's own load of conversions is in
``tests/e2e/test_megatron_legacy_e2e.py``.
"""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from converter.run.sources import detect_format, open_checkpoint
from formats.errors import CorruptCheckpointError, UnsafePickleError, UnsupportedError
from formats.megatron.buffers import buffer_layout, ddp_bucket_size
from formats.megatron.folders import rank_folders
from formats.megatron.legacy import LegacyReader
from formats.megatron.names import parse_name, tp_split
from formats.torch_file import file_resolver, read_torch_file, torch_save_bytes
from oracle import bits_equal, torch_reference

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "megatron" / "legacy_tp2_pp2_vpp2"
LEGACY, DIST = FIXTURE / "legacy", FIXTURE / "torch_dist"
ITER = LEGACY / "iter_0000002"


def _full(reader, entry) -> torch.Tensor:
    out = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
    cover = torch.zeros(entry.shape, dtype=torch.int32)
    for c in entry.chunks:
        out[c.box.slices()] = reader.read_region(entry.key, c, c.box)
        cover[c.box.slices()] += 1
    assert bool((cover == 1).all()), entry.key
    return out


def _load(path: Path):
    return torch.load(path, weights_only=False)  # the test's own fixture: torch's reading, as oracle


@pytest.fixture(scope="module")
def reader():
    r = LegacyReader(LEGACY)
    yield r
    r.close()


@pytest.fixture(scope="module")
def dist_tensors():
    return torch_reference(DIST)


# ------------------------------------------------------------------------------------------------
# the index: the torch_dist checkpoint of the same state


def test_detected_and_found_through_the_tracker(reader):
    assert detect_format(LEGACY) == "megatron-legacy"
    assert reader.iteration == 2
    info = reader.index().info["megatron"]
    assert (info["tp"], info["pp"], info["vpp"], info["ep"], info["folders"]) == (2, 2, 2, 1, 4)
    assert info["layers"] == {"decoder": 4} and info["distributed_optimizer"] and info["local_spec"]
    # the iteration folder itself opens too
    with LegacyReader(ITER) as r:
        assert set(r.index().tensors) == set(reader.index().tensors)


def test_every_tensor_is_torch_dists_bit_for_bit(reader, dist_tensors):
    """Model weights merged over TP (GLU fc1 halves, fused QKV), PP and the virtual pipeline's
    chunks, and the DistributedOptimizer's fp32 main params and Adam moments from distrib_optim.pt's
    flat buffers, equal megatron's own torch_dist save of the same state."""
    index = reader.index()
    want = {k: v for k, v in dist_tensors.items() if isinstance(v, torch.Tensor) and "/shard_" not in k}
    assert set(index.tensors) == set(want) and len(want) == 36
    for key, entry in index.tensors.items():
        assert bits_equal(_full(reader, entry), want[key]), key
    assert sum(k.startswith("optimizer.state.") for k in index.tensors) == 27


def test_read_region_into_gives_the_bits_of_read_region(reader):
    """The reader protocol: any sub-region of any chunk, both ways (flat optimizer views included)."""
    import numpy as np

    from formats.base import Box
    from formats.dtypes import to_storage_array

    for key, entry in reader.index().tensors.items():
        c = entry.chunks[-1]
        region = Box(tuple(o + s // 2 for o, s in zip(c.box.offsets, c.box.sizes)),
                     tuple(s - s // 2 for s in c.box.sizes))
        want = to_storage_array(reader.read_region(key, c, region))
        buf = bytearray(want.nbytes)
        reader.read_region_into(key, c, region, memoryview(buf))
        assert np.array_equal(np.frombuffer(buf, dtype=want.dtype).reshape(want.shape), want), key


def test_rank_files_hold_the_shards_megatron_saved(reader):
    """Spot checks on torch.load of the rank files: the second stage's second chunk holds global layer 3,
    and TP rank 1's fc1 [gate_1; up_1] are rows 12:24 and 36:48 of the global [gate; up]."""
    local = _load(ITER / "mp_rank_01_001" / "model_optim_rng.pt")["model1"]
    fc1 = _full(reader, reader.index().tensors["decoder.layers.mlp.linear_fc1.weight"])
    w = local["decoder.layers.0.mlp.linear_fc1.weight"]
    assert bits_equal(fc1[3, 12:24], w[:12]) and bits_equal(fc1[3, 36:48], w[12:])
    qkv = _full(reader, reader.index().tensors["decoder.layers.self_attention.linear_qkv.weight"])
    assert bits_equal(qkv[3, 16:32], local["decoder.layers.0.self_attention.linear_qkv.weight"])
    norm = _full(reader, reader.index().tensors["decoder.layers.mlp.linear_fc1.layer_norm_weight"])
    assert bits_equal(norm[3], local["decoder.layers.0.pre_mlp_layernorm.weight"])  # the local spec's name


def test_non_tensor_state_is_megatrons(reader):
    """common_state holds rank 0's args (an argparse.Namespace), iteration, scheduler, flops and the
    optimizer's param groups (as torch_dist keeps them); rng_state one object per (pp, tp) rank."""
    first = _load(ITER / "mp_rank_00_000" / "model_optim_rng.pt")
    (common,) = reader.load_object("common_state/shard_0_1")
    assert common["args"] == first["args"] and type(common["args"]).__name__ == "Namespace"
    for k in ("iteration", "checkpoint_version", "opt_param_scheduler", "num_floating_point_operations_so_far"):
        assert common[k] == first[k], k
    assert common["optimizer"] == {**first["optimizer"], "param_state_sharding_type": "fully_reshardable"}
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    for pp in (0, 1):
        for tp in (0, 1):
            want = _load(ITER / f"mp_rank_{tp:02d}_{pp:03d}" / "model_optim_rng.pt")["rng_state"]
            (got,) = reader.load_object(f"rng_state/shard_{pp}.{tp}_2.2")
            assert repr(got) == repr(want) and bits_equal(got[0]["torch_rng_state"], want[0]["torch_rng_state"])
    dist_objects = set(open_checkpoint(DIST).index().objects)
    assert set(reader.index().objects) == dist_objects  # extra states over the same (layer) grids
    assert reader.load_object("decoder.layers.mlp.linear_fc1._extra_state/shard_3_4") == [None]


def test_object_bytes_are_torch_save_archives(reader):
    """Every object is a complete torch.save archive torch.load reads (weights_only where the value is
    plain data, as megatron's own common-state load asks: with argparse.Namespace, which megatron
    registers as a safe global)."""
    import argparse

    for key in reader.index().objects:
        data = reader.read_object_bytes(key)
        with torch.serialization.safe_globals([argparse.Namespace]):
            value = torch.load(io.BytesIO(data), weights_only=not key.startswith("rng_state"))
        assert isinstance(value, list) and len(value) == 1, key


# ------------------------------------------------------------------------------------------------
# the commands


def test_inspect_verify_and_diff(tmp_path):
    code, out, err = run_cli("inspect", str(LEGACY), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["format"] == "megatron-legacy" and len(doc["tensors"]) == 36
    code, out, err = run_cli("verify", str(LEGACY))
    assert code == 0 and out.startswith("ok:"), out + err
    code, out, err = run_cli("diff", str(LEGACY), str(DIST))
    assert "36 of 36 common tensors bitwise equal" in out, out + err


def test_to_universal_then_torch_dist_at_another_layout(tmp_path, dist_tensors):
    store, out = tmp_path / "store", tmp_path / "out"
    code, _, err = run_cli("to-universal", str(LEGACY), str(store))
    assert code == 0, err
    code, _, err = run_cli("from-universal", str(store), str(out), "--mesh", "tp2")
    assert code == 0, err
    assert (out / "metadata.json").read_bytes() == (DIST / "metadata.json").read_bytes()
    assert "dropped layout-bound Megatron objects" in err and "rng_state (4 shards" in err
    got = torch_reference(out)
    for key, value in dist_tensors.items():
        if isinstance(value, torch.Tensor) and "/shard_" not in key:
            assert bits_equal(got[key], value), key
    with open_checkpoint(out) as r:
        (common,) = r.load_object("common_state/shard_0_1")
    assert common["args"] == _load(ITER / "mp_rank_00_000" / "model_optim_rng.pt")["args"]


def test_export_hf_from_legacy_equals_from_torch_dist(tmp_path):
    from safetensors.torch import load_file

    for name, src in (("legacy", LEGACY), ("dist", DIST)):
        code, _, err = run_cli("export-hf", str(src), str(tmp_path / name), "--map", "megatron-llama",
                               "--config", '{"rms_norm_eps": 1e-05}')
        assert code == 0, err
    a, b = load_file(tmp_path / "legacy" / "model.safetensors"), load_file(tmp_path / "dist" / "model.safetensors")
    assert set(a) == set(b) and len(a) == 4 * 9 + 3
    assert all(bits_equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------
# damaged and hostile checkpoints


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "legacy"
    shutil.copytree(LEGACY, dst)
    return dst


def test_a_missing_rank_folder_is_named(tmp_path):
    ckpt = _copy(tmp_path)
    shutil.rmtree(ckpt / "iter_0000002" / "mp_rank_01_001")
    code, _, err = run_cli("inspect", str(ckpt))
    assert code == 2 and "a rank folder is missing" in err and "cover" in err, err


def test_tracker_naming_a_missing_iteration(tmp_path):
    ckpt = _copy(tmp_path)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("9")
    code, _, err = run_cli("inspect", str(ckpt))
    assert code == 2 and "iter_0000009 is missing" in err, err
    (ckpt / "latest_checkpointed_iteration.txt").write_text("garbage")
    code, _, err = run_cli("inspect", str(ckpt))
    assert code == 2 and "not an iteration number" in err, err


def test_a_global_outside_the_allowlist_is_refused_unrun(tmp_path):
    ckpt = _copy(tmp_path)
    path = ckpt / "iter_0000002" / "mp_rank_00_000" / "model_optim_rng.pt"
    data = path.read_bytes()
    bad = data.replace(b"argparse\nNamespace", b"posixpth\nNamespace")
    assert bad != data and len(bad) == len(data)
    path.write_bytes(bad)
    code, _, err = run_cli("inspect", str(ckpt))
    assert code == 2 and "posixpth.Namespace, which is not on the allowlist" in err, err


def test_verify_finds_a_flipped_optimizer_byte(tmp_path):
    ckpt = _copy(tmp_path)
    path = ckpt / "iter_0000002" / "mp_rank_01_000" / "distrib_optim.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    code, out, _ = run_cli("verify", str(ckpt))
    assert code != 0 and "FAILED" in out and "mp_rank_01_000/distrib_optim.pt" in out, out


def test_bucket_settings_that_do_not_match_the_buffers(tmp_path):
    """A distrib_optim.pt whose flat buffers do not have the layout the args' bucket settings make
    (here: args say every parameter filled its own bucket) is refused, not misread."""
    ckpt = _copy(tmp_path)
    path = ckpt / "iter_0000002" / "mp_rank_00_000" / "model_optim_rng.pt"
    sd = _load(path)
    sd["args"].overlap_grad_reduce, sd["args"].ddp_bucket_size = True, 1
    torch.save(sd, path)
    with pytest.raises(UnsupportedError, match="buffer 0 holds .* elements.*bucket settings"):
        LegacyReader(ckpt)


# ------------------------------------------------------------------------------------------------
# the pure parts


def test_names_map_to_megatrons_sharded_keys():
    ln = parse_name("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight", True)
    assert (ln.layer, ln.expert, ln.stacked_key) == (3, 5, "decoder.layers.mlp.experts.experts.linear_fc1.weight")
    ln = parse_name("decoder.layers.0.mlp.experts.linear_fc2.weight7", False)  # TEGroupedMLP
    assert (ln.expert, ln.grouped, ln.stacked_key) == (7, True, "decoder.layers.mlp.experts.experts.linear_fc2.weight")
    assert parse_name("decoder.layers.1.input_layernorm.weight", True).stacked_key == \
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert parse_name("decoder.layers.1.input_layernorm.weight", False).stacked_key == \
        "decoder.layers.input_layernorm.weight"
    assert tp_split("decoder.layers.mlp.linear_fc1.weight", 2, True).glu
    assert tp_split("decoder.layers.self_attention.linear_proj.weight", 2, False).dim == 1
    assert tp_split("decoder.layers.self_attention.linear_proj.bias", 1, False).dim is None
    assert tp_split("embedding.word_embeddings.weight", 2, False).dim == 0
    assert tp_split("decoder.layers.mlp.router.weight", 2, False).dim is None
    assert tp_split("decoder.layers.self_attention.mystery.weight", 2, False) is None


def test_two_part_folder_names_follow_the_args():
    names = ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_001", "notes.txt"]
    assert [(f.tp, f.pp, f.ep) for f in rank_folders(names, "it", 2, 1)] == [(0, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert [(f.tp, f.pp, f.ep) for f in rank_folders(names, "it", 1, 2)] == [(0, 0, 0), (0, 0, 1), (1, 0, 1)]
    assert [(f.tp, f.pp, f.ep) for f in rank_folders(["mp_rank_03_001_002"], "", None, None)] == [(3, 1, 2)]


def test_buffer_layout_aligns_params_and_cuts_buckets():
    params = [("a", 10, False), ("b", 100, False), ("c", 7, False)]  # laid out c, b, a
    one = buffer_layout(params, None)
    assert [(p.name, p.start, p.end) for p in one.params] == [("c", 0, 7), ("b", 64, 164), ("a", 192, 202)]
    assert one.bucket_numels == (202,)
    cut = buffer_layout(params, 100)  # b fills a bucket: a starts the next one at 0 (no alignment gap)
    assert [(p.name, p.bucket, p.start) for p in cut.params] == [("c", 0, 0), ("b", 0, 64), ("a", 1, 164)]
    assert cut.bucket_numels == (164, 10)
    shared = buffer_layout([("emb", 50, True), ("w", 20, False)], None)  # the shared embedding: own bucket
    assert [(p.name, p.bucket, p.start, p.end) for p in shared.params] == [("w", 0, 0, 20), ("emb", 1, 64, 114)]
    assert ddp_bucket_size(False, None, 8, 0, 0) is None and ddp_bucket_size(True, None, 64, 0, 0) == 64_000_000
    assert ddp_bucket_size(True, 5, 8, 1, 0) is None and ddp_bucket_size(True, 5, 8, 0, 1) is None


def test_torch_file_round_trip_keeps_shared_storages_and_records():
    """A parsed file pickles back to what torch.load reads as the original (one shared storage kept one)."""
    path = ITER / "mp_rank_00_000" / "model_optim_rng.pt"
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        tf = read_torch_file(fd, path.name, str(path), size, file_resolver(["megatron"]))
        from formats.dcp.archive import SliceReader

        read = SliceReader(fd, 0, size, str(path))
        data = torch_save_bytes(tf.value, lambda d: bytes(read(tf.tensor(d, "t").data_start, tf.tensor(d, "t").data_length)))
    finally:
        os.close(fd)
    want, got = _load(path), torch.load(io.BytesIO(data), weights_only=False)
    assert repr(got) == repr(want) and len(data) <= size
    for chunk in ("model0", "model1"):
        for k, v in want[chunk].items():
            assert (v is None and got[chunk][k] is None) or bits_equal(got[chunk][k], v), k
    assert math.isclose(len(data), size, rel_tol=0.05)


def test_corrupt_model_file_is_one_line(tmp_path):
    ckpt = _copy(tmp_path)
    (ckpt / "iter_0000002" / "mp_rank_01_001" / "model_optim_rng.pt").write_bytes(b"PK\x03\x04 not a zip at all")
    with pytest.raises(CorruptCheckpointError, match="mp_rank_01_001/model_optim_rng.pt"):
        LegacyReader(ckpt)
    assert UnsafePickleError  # (the allowlist refusal is tested above through the CLI)
