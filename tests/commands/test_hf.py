"""export-hf / import-hf: Hugging Face safetensors written and read back by the safetensors library.

Oracles: torch's own reading of the DCP fixtures (oracle.torch_reference), the safetensors
library (``safe_open``, ``save_file``), huggingface_hub's sharding, and HF's
``convert_llama_weights_to_hf`` permutation formula written out below.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from converter import api
from converter.cli import cli
from converter.config import RunOptions
from converter.plan.mapped_view import Source, permuted_chunks
from converter.run.mapped_reader import MappedReader
from converter.plan.key_maps import (TORCHTITAN_LLAMA, Renamer, get_key_map, key_map_from_doc, rename_all,
                                rope_permutation)
from formats.base import Box, CheckpointIndex, ChunkRef, TensorEntry, TensorReader
from formats.errors import (ConfigError, CorruptCheckpointError, DestinationError, InvalidCheckpointError,
                            UnsupportedError)
from formats.hf import INDEX_FILE, HFReader, TensorSpec, split_shards
from oracle import bits_equal, torch_reference
from store_oracle import read_store

OPTS = RunOptions(workers=2)
NON_MODEL = ("optim", "optimizer", "lr_scheduler", "dataloader", "train_state", "extra")
LLAMA_CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2}


# ------------------------------------------------------------------------------------- helpers


def read_hf(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, read by the safetensors library."""
    files = sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(f, "pt") as st_file:
            assert st_file.metadata() == {"format": "pt"}
            for k in st_file.keys():
                assert k not in out
                out[k] = st_file.get_tensor(k)
    return out


def model_reference(src: Path) -> dict[str, torch.Tensor]:
    """Model weights of a DCP checkpoint as torch reads them, 'model.' prefix stripped."""
    ref = torch_reference(src)
    out = {}
    for key, value in ref.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key.startswith("model."):
            out[key[len("model."):]] = value
        elif key.split(".")[0] not in NON_MODEL:
            out[key] = value
    return out


def hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """transformers' convert_llama_weights_to_hf.permute (interleaved RoPE -> rotate-half)."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def llama_to_hf_names(weights: dict[str, torch.Tensor], n_heads=4, n_kv=2) -> dict[str, torch.Tensor]:
    """torchtitan Llama weights -> HF Llama names and layouts (written out independently of the map)."""
    out = {"model.embed_tokens.weight": weights["tok_embeddings.weight"],
           "model.norm.weight": weights["norm.weight"], "lm_head.weight": weights["output.weight"]}
    layers = sorted({k.split(".")[1] for k in weights if k.startswith("layers.")}, key=int)
    for i in layers:
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "self_attn.q_proj.weight"] = hf_permute(weights[p + "attention.wq.weight"], n_heads)
        out[q + "self_attn.k_proj.weight"] = hf_permute(weights[p + "attention.wk.weight"], n_kv)
        out[q + "self_attn.v_proj.weight"] = weights[p + "attention.wv.weight"]
        out[q + "self_attn.o_proj.weight"] = weights[p + "attention.wo.weight"]
        out[q + "mlp.gate_proj.weight"] = weights[p + "feed_forward.w1.weight"]
        out[q + "mlp.up_proj.weight"] = weights[p + "feed_forward.w3.weight"]
        out[q + "mlp.down_proj.weight"] = weights[p + "feed_forward.w2.weight"]
        out[q + "input_layernorm.weight"] = weights[p + "attention_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = weights[p + "ffn_norm.weight"]
    return out


@pytest.fixture(scope="module")
def exported(dcp_checkpoint, tmp_path_factory):
    """(kind, map) -> (source, HF dir), exported once per module."""
    cache = {}

    def get(kind, key_map="identity", **kw):
        k = (kind, key_map, json.dumps(kw, sort_keys=True))
        if k not in cache:
            src = dcp_checkpoint(kind)
            out = tmp_path_factory.mktemp(f"hf-{kind}")
            api.export_hf(src, out, key_map=key_map, options=OPTS, **kw)
            cache[k] = (src, out)
        return cache[k]

    return get


# ------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("kind", ["fsdp4", "tp2dp2", "pp2fsdp2", "bf16_fsdp2", "special_dtypes", "titan_flat"])
def test_export_equals_torch_bit_for_bit(exported, kind):
    src, out = exported(kind)
    ref = model_reference(src)
    got = read_hf(out)
    assert sorted(got) == sorted(ref)  # model weights only, prefix stripped, no optimizer state
    for key, value in ref.items():
        assert bits_equal(got[key], value), key
    assert sorted(p.name for p in out.iterdir()) == [".written-by-ckptconv.json", "model.safetensors"]  # + the record


def test_export_file_is_byte_identical_to_save_file(exported, tmp_path):
    src, out = exported("special_dtypes")  # fp8 (with inf/nan), int64, bool, f16, 0-d, NaN payloads
    ref = model_reference(src)
    assert {str(v.dtype) for v in ref.values()} >= {"torch.float8_e4m3fn", "torch.float8_e5m2", "torch.int64", "torch.bool"}
    save_file(ref, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_export_from_universal_store_equals_export_from_dcp(exported, tmp_path):
    src, out = exported("tp2dp2")
    api.to_universal(src, tmp_path / "uni", OPTS, chunk_bytes=1024)
    api.export_hf(tmp_path / "uni", tmp_path / "hf", options=OPTS)
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_dtype_cast_keeps_float8_and_ints(exported):
    src, out = exported("special_dtypes", dtype="bf16")
    ref = model_reference(src)
    got = read_hf(out)
    for key, value in ref.items():
        if value.dtype in (torch.float32, torch.float16):
            assert bits_equal(got[key], value.to(torch.bfloat16)), key
        else:
            assert bits_equal(got[key], value), key


def test_sharding_follows_huggingface_hub(exported, tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    src, out = exported("fsdp4", max_shard_size="20KB")
    files = sorted(p.name for p in out.iterdir() if p.name != ".written-by-ckptconv.json")  # ckptconv's record
    n = len(files) - 1
    assert n > 2 and files[-1] == INDEX_FILE
    assert files[:-1] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    # huggingface_hub given the same tensors in the same (source) order writes the same bytes
    order = [k.removeprefix("model.") for k in api.open_checkpoint(src).index().tensors if k.startswith("model.")]
    ref = model_reference(src)
    hub.save_torch_state_dict({k: ref[k] for k in order}, tmp_path, max_shard_size="20KB")
    for name in files[:-1]:
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name
    index = json.loads((out / INDEX_FILE).read_text())
    hub_index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"] == hub_index["weight_map"]
    assert index["metadata"]["total_size"] == hub_index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in ref.values())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 60))
def test_split_shards_matches_huggingface_hub(sizes, limit):
    ser = pytest.importorskip("huggingface_hub.serialization")
    tensors = {f"t{i}": torch.zeros(s, dtype=torch.uint8) for i, s in enumerate(sizes)}
    hub = ser.split_torch_state_dict_into_shards(tensors, max_shard_size=limit)
    ours = split_shards([TensorSpec(k, "uint8", (len(v),)) for k, v in tensors.items()], limit)
    assert [sorted(s.name for s in shard) for shard in ours] == [sorted(v) for v in hub.filename_to_tensors.values()]


def test_llama_map_names_and_rope_permutation(exported):
    for kind in ("fsdp4", "tp2dp2"):  # wq/wk split by rows over 4 ranks; by TP x FSDP
        src, out = exported(kind, "torchtitan-llama", config=LLAMA_CONFIG)
        expected = llama_to_hf_names(model_reference(src))
        got = read_hf(out)
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            assert bits_equal(got[key], value), (kind, key)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["num_key_value_heads"] == 2 and cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 2


def test_config_file_is_copied_unchanged(dcp_checkpoint, tmp_path):
    cfg = tmp_path / "my_config.json"
    cfg.write_text('{"custom": 1,   "num_attention_heads": 4}')
    api.export_hf(dcp_checkpoint("single"), tmp_path / "hf", config=cfg, options=OPTS)
    assert (tmp_path / "hf" / "config.json").read_bytes() == cfg.read_bytes()


# ------------------------------------------------------------------------------------- import


def test_import_llama_inverts_the_permutation(dcp_checkpoint, tmp_path):
    src = dcp_checkpoint("fsdp4")
    weights = model_reference(src)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file(llama_to_hf_names(weights), hf_dir / "model.safetensors", metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    api.import_hf(hf_dir, tmp_path / "uni", key_map="torchtitan-llama", options=OPTS, chunk_bytes=512)
    got = read_store(tmp_path / "uni")  # stock zarr's reading, not ckptconv's
    assert sorted(got) == sorted(weights)
    for key, value in got.items():
        assert bits_equal(value, weights[key]), key
    meta = json.loads((tmp_path / "uni" / "ckptconv.json").read_text())
    assert all(meta["tensors"][key]["path"] == [key] for key in weights)
    assert meta["atoms"]["layers.0.attention.wq.weight"]["members"] == {"param": "layers.0.attention.wq.weight"}


def _hf_all_dtypes(path: Path, shard: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    sd = {
        "a.weight": torch.randn(7, 5, generator=g),
        "b.bf16": torch.randn(9, 3, generator=g).to(torch.bfloat16),
        "c.f8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "d.e5m2": torch.randn(6, generator=g).to(torch.float8_e5m2),
        "e.i64": torch.tensor([0, -1, 2**62]),
        "f.mask": torch.tensor([[True, False], [False, True]]),
        "g.scalar": torch.tensor(1.5, dtype=torch.float64),
        "h.empty": torch.zeros(0, 4),
        "layers.10.w": torch.randn(3, 3, generator=g).half(),
        "layers.2.w": torch.randn(40, 8, generator=g),
    }
    path.mkdir()
    if shard:
        import huggingface_hub as hub

        hub.save_torch_state_dict(sd, path, max_shard_size=600)
    else:
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return sd


@pytest.mark.parametrize("shard", [False, True])
def test_hf_universal_hf_round_trip(tmp_path, shard):
    if shard:
        pytest.importorskip("huggingface_hub")
    sd = _hf_all_dtypes(tmp_path / "hf", shard)
    api.import_hf(tmp_path / "hf", tmp_path / "uni", options=OPTS, chunk_bytes=64)
    api.export_hf(tmp_path / "uni", tmp_path / "back", max_shard_size=600 if shard else "5GB", options=OPTS)
    before, after = read_hf(tmp_path / "hf"), read_hf(tmp_path / "back")
    assert sorted(before) == sorted(after) == sorted(sd)
    for k in sd:
        assert bits_equal(after[k], before[k]) and bits_equal(after[k], sd[k]), k
    if not shard:
        assert (tmp_path / "back" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()


def test_llama_round_trip_through_universal(exported, tmp_path):
    _, hf = exported("tp2dp2", "torchtitan-llama", config=LLAMA_CONFIG, max_shard_size="30KB")
    api.import_hf(hf, tmp_path / "uni", key_map="torchtitan-llama", options=OPTS, chunk_bytes=256)
    api.export_hf(tmp_path / "uni", tmp_path / "back", key_map="torchtitan-llama", config=hf / "config.json",
                  max_shard_size="30KB", options=OPTS)
    before, after = read_hf(hf), read_hf(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for k in before:
        assert bits_equal(after[k], before[k]), k
    assert (tmp_path / "back" / "config.json").read_bytes() == (hf / "config.json").read_bytes()


def test_import_prefix_gives_dcp_style_paths(tmp_path):
    _hf_all_dtypes(tmp_path / "hf", False)
    api.import_hf(tmp_path / "hf", tmp_path / "uni", prefix="model", options=OPTS)
    index = api.open_checkpoint(tmp_path / "uni").index()
    assert index.tensors["model.a.weight"].path == ("model", "a.weight")
    api.export_hf(tmp_path / "uni", tmp_path / "back", options=OPTS)  # prefix stripped again
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------- pure parts


def test_rope_permutation_matches_hf_formula():
    w = torch.arange(48 * 3, dtype=torch.float32).view(48, 3)
    for heads in (1, 2, 4, 6):
        p = rope_permutation(48, heads, to_hf=True)
        assert torch.equal(w[p], hf_permute(w, heads))
        q = rope_permutation(48, heads, to_hf=False)
        assert torch.equal(w[p][q], w)
    with pytest.raises(ConfigError, match="heads"):
        rope_permutation(48, 5, to_hf=True)


class _DictReader(TensorReader):
    """An in-memory reader over whole tensors cut into given chunks (test double)."""

    def __init__(self, tensors, chunks):
        self.tensors = tensors
        entries = {k: TensorEntry(k, str(v.dtype).removeprefix("torch."), tuple(v.shape),
                                  tuple(ChunkRef(b, f"f{i}", (k, i)) for i, b in enumerate(chunks[k])), (k,))
                   for k, v in tensors.items()}
        self._index = CheckpointIndex("dcp", "/mem", entries, {})
        self.reads = []

    def index(self):
        return self._index

    def read_region(self, key, chunk, region):
        assert chunk.box.contains(region)
        self.reads.append(region.numel)
        return self.tensors[key][region.slices()].clone()

    def close(self):
        pass


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(1, 4), st.integers(1, 3), st.data())
def test_permuted_view_tiles_and_reads_exactly(heads, half, cols, data):
    rows = heads * 2 * half
    w = torch.arange(rows * cols * 2, dtype=torch.float32).view(rows, cols * 2)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, rows), max_size=4))) | {0, rows})
    col_split = data.draw(st.booleans())
    boxes = []
    for a, b in zip(cuts, cuts[1:]):
        if col_split:
            boxes += [Box((a, 0), (b - a, cols)), Box((a, cols), (b - a, cols))]
        else:
            boxes.append(Box((a, 0), (b - a, 2 * cols)))
    boxes.append(Box((rows, 0), (0, 2 * cols)))  # an empty FSDP shard
    to_hf = data.draw(st.booleans())
    perm = rope_permutation(rows, heads, to_hf)
    src = _DictReader({"w": w}, {"w": boxes})
    view = MappedReader(src, {"out": Source("w", perm)})
    entry = view.index().tensors["out"]
    cover = torch.zeros(w.shape, dtype=torch.int32)
    out = torch.full(w.shape, float("nan"))
    for c in entry.chunks:
        cover[c.box.slices()] += 1
        out[c.box.slices()] = view.read_region("out", c, c.box)
    assert bool((cover == 1).all())
    assert torch.equal(out, w[perm])
    # to HF: runs break at each half-head (2 * heads) and, inside a half, once per interior cut it
    # crosses (a cut inside a head splits both halves). From HF, target rows alternate between the
    # two halves of a head, so a cut between the halves can make every row its own run.
    per_split = 2 * heads + 2 * (len(cuts) - 2) if to_hf else max(2 * heads + 2 * (len(cuts) - 2), rows)
    assert len(entry.chunks) <= per_split * (2 if col_split else 1)


def test_permuted_chunks_are_few_for_row_shards():
    perm = rope_permutation(4096, 32, to_hf=True)
    chunks = [ChunkRef(Box((r, 0), (512, 64)), f"f{r}", r) for r in range(0, 4096, 512)]
    assert len(permuted_chunks(chunks, perm, "wq")) <= 2 * 32 + 8


def test_llama_map_inverse_round_trip():
    exporter, importer = TORCHTITAN_LLAMA.exporter(), TORCHTITAN_LLAMA.importer()
    for hf, native in TORCHTITAN_LLAMA.from_hf.items():
        for layer in ("0", "17"):
            name = hf.replace("{}", layer)
            if native is None:
                assert importer.rename(name) is None
                continue
            assert importer.rename(name) == native.replace("{}", layer)
            assert exporter.rename(importer.rename(name)) == name
    assert exporter.rename("freqs_cis") is None


def test_map_file_forms(tmp_path):
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"enc.{}.w": "blocks.{}.weight", "enc.rot": None, "head": "out"}))
    km = get_key_map(str(flat))
    assert rename_all(["blocks.3.weight", "out"], km.exporter(), km.name, "export") == {
        "blocks.3.weight": "enc.3.w", "out": "head"}
    assert rename_all(["enc.12.w", "enc.rot", "head"], km.importer(), km.name, "import") == {
        "enc.12.w": "blocks.12.weight", "head": "out"}
    full = key_map_from_doc({"map": {"x.{}.{}": "y.{}.e{}"}, "drop": ["buf"],
                             "transforms": {"y.{}.e{}": "rope:num_attention_heads"}})
    assert full.exporter().rename("y.1.e2") == "x.1.2" and full.exporter().rename("buf") is None
    assert full.transform_of("y.3.e4") == "rope:num_attention_heads" and full.transform_of("x.3.4") is None
    with pytest.raises(ConfigError, match="same number"):
        key_map_from_doc({"a.{}": "b"})
    with pytest.raises(ConfigError, match="cannot be inverted"):
        key_map_from_doc({"a": "c", "b": "c"})
    with pytest.raises(ConfigError, match="unknown transform"):
        key_map_from_doc({"map": {"a": "b"}, "transforms": {"b": "flip"}})


def test_unmapped_keys_are_listed():
    with pytest.raises(ConfigError) as e:
        rename_all(["tok_embeddings.weight", "extra.a", "extra.b"], TORCHTITAN_LLAMA.exporter(),
                   "torchtitan-llama", "export")
    assert "2 key(s) unmapped" in str(e.value) and "'extra.a'" in str(e.value) and "'extra.b'" in str(e.value)
    with pytest.raises(ConfigError, match="same name"):
        rename_all(["a", "b"], Renamer({"a": "x", "b": "x"}), "m", "import")


# ------------------------------------------------------------------------------------- bad input


def _write_st(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def test_missing_and_malformed_index(tmp_path):
    d = tmp_path / "hf"
    _hf_all_dtypes(d, shard=True) if _has_hub() else pytest.skip("needs huggingface_hub")
    index = d / INDEX_FILE
    good = index.read_text()
    index.unlink()
    with pytest.raises(InvalidCheckpointError, match="no model.safetensors.index.json"):
        HFReader(d)
    index.write_text("{not json")
    with pytest.raises(InvalidCheckpointError, match="malformed index"):
        HFReader(d)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(InvalidCheckpointError, match="weight_map"):
        HFReader(d)
    doc = json.loads(good)
    doc["weight_map"]["a.weight"] = "../outside.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(InvalidCheckpointError, match="outside the checkpoint directory"):
        HFReader(d)
    doc = json.loads(good)
    victim = next(iter(doc["weight_map"]))
    others = sorted(set(doc["weight_map"].values()) - {doc["weight_map"][victim]})
    doc["weight_map"][victim] = others[0]
    index.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match=f"{victim!r} is mapped to {others[0]}"):
        HFReader(d)


def _has_hub() -> bool:
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        return False
    return True


def test_bad_headers(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    f = d / "model.safetensors"
    cases = [
        (dict(header=b"{}", length=100_000_001), InvalidCheckpointError, "over the 100000000 byte limit"),
        (dict(header=b"{}", length=400), CorruptCheckpointError, "runs past the end"),
        (dict(header=b"[1]"), InvalidCheckpointError, "not a JSON object"),
        (dict(header=b"\xff{"), InvalidCheckpointError, "not JSON"),
        (dict(header={"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, data=b"\0" * 4),
         CorruptCheckpointError, "truncated"),
        (dict(header={"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, data=b"\0" * 4),
         InvalidCheckpointError, "needs 8 bytes"),
        (dict(header={"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, data=b"\0" * 8),
         InvalidCheckpointError, "gap"),
        (dict(header={"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, data=b"\0" * 8),
         InvalidCheckpointError, "overlaps"),
        (dict(header={"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, data=b"\0"),
         UnsupportedError, "F4"),
        (dict(header={"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, data=b"\0" * 4),
         InvalidCheckpointError, "bad shape"),
        (dict(header={"__metadata__": {"format": 1}}), InvalidCheckpointError, "__metadata__"),
    ]
    for kw, exc, needle in cases:
        _write_st(f, **kw)
        with pytest.raises(exc, match=needle):
            HFReader(d)
    f.write_bytes(b"\1\2")
    with pytest.raises(CorruptCheckpointError, match="too short"):
        HFReader(d)


def test_destination_and_config_errors(exported, dcp_checkpoint, tmp_path):
    src = dcp_checkpoint("single")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(DestinationError, match="not empty"):
        api.export_hf(src, tmp_path / "out", options=OPTS)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        api.export_hf(src, tmp_path / "o2", key_map="torchtitan-llama", options=OPTS)
    with pytest.raises(ConfigError, match="hidden_size=64"):
        api.export_hf(src, tmp_path / "o3", key_map="torchtitan-llama",
                      config={"num_attention_heads": 4, "hidden_size": 64}, options=OPTS)
    _, hf = exported("single")
    with pytest.raises(ConfigError, match="unmapped"):  # identity-named HF into the Llama map
        api.import_hf(hf, tmp_path / "u", key_map="torchtitan-llama", config=LLAMA_CONFIG, options=OPTS)
    with pytest.raises(ConfigError, match="import-hf reads a Hugging Face directory"):
        api.import_hf(src, tmp_path / "u2", options=OPTS)
    assert not (tmp_path / "o2").exists() or not any((tmp_path / "o2").iterdir())


def test_failed_export_publishes_nothing(dcp_checkpoint, tmp_path, monkeypatch):
    seen = []
    real = MappedReader.read_region_into

    def flaky(self, key, chunk, region, out):
        seen.append(sorted(p.name for p in (tmp_path / "out").iterdir()))
        if len(seen) == 6:
            raise OSError("disk on fire")
        return real(self, key, chunk, region, out)

    monkeypatch.setattr(MappedReader, "read_region_into", flaky)
    with pytest.raises(OSError, match="disk on fire"):
        api.export_hf(dcp_checkpoint("fsdp4"), tmp_path / "out", max_shard_size="20KB",
                      options=RunOptions(workers=1))
    is_temp = lambda name: name.endswith(".safetensors.tmp") or name == ".ckptconv-journal.jsonl"  # noqa: E731
    assert all(is_temp(name) or name == ".ckptconv-lock" for name in seen[-1])  # only temp files while writing
    # after the failure: still nothing published; temp files and journal stay for --resume; lock released
    assert all(is_temp(p.name) for p in (tmp_path / "out").iterdir())


# ------------------------------------------------------------------------------------- CLI, inspect


def test_cli_export_import_and_inspect(dcp_checkpoint, tmp_path):
    runner = CliRunner()
    src = dcp_checkpoint("fsdp4")
    res = runner.invoke(cli, ["export-hf", str(src), str(tmp_path / "hf"), "--map", "torchtitan-llama",
                              "--config", json.dumps(LLAMA_CONFIG), "--max-shard-size", "30KB", "--dtype", "bf16"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "hf" / INDEX_FILE).is_file()
    assert all(v.dtype == torch.bfloat16 for v in read_hf(tmp_path / "hf").values())
    res = runner.invoke(cli, ["export-hf", str(src), str(tmp_path / "dry"), "--dry-run"])
    assert res.exit_code == 0 and "model.safetensors" in res.output and not (tmp_path / "dry").exists()
    res = runner.invoke(cli, ["import-hf", str(tmp_path / "hf"), str(tmp_path / "uni"), "--map", "torchtitan-llama"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["inspect", str(tmp_path / "hf"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    import jsonschema

    schema = json.loads((Path(__file__).resolve().parents[2] / "schemas" / "inspect.schema.json").read_text())
    jsonschema.validate(doc, schema)
    assert doc["format"] == "hf" and doc["num_tensors"] == 21 and doc["num_objects"] == 0
    assert INDEX_FILE in [f["name"] for f in doc["files"]]


def test_cli_bad_input_is_one_line(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    _write_st(d / "model.safetensors", b"{}", length=100_000_001)
    proc = subprocess.run([sys.executable, "-m", "converter", "import-hf", str(d), str(tmp_path / "u")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: ") and "byte limit" in lines[0]


# ------------------------------------------------------------------------------------- memory

_MEM_SCRIPT = textwrap.dedent("""
    import resource, sys
    import torch
    from converter import api
    from converter.config import RunOptions
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    api.export_hf(sys.argv[1], sys.argv[2], options=RunOptions(workers=2, memory_budget=8 << 20))
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
""")


def test_export_streams_under_the_budget(tmp_path):
    """A 128 MiB tensor exported with an 8 MiB budget: the process grows far less than the tensor
    (the safetensors library would hold every tensor at once)."""
    import torch.distributed.checkpoint as dcp

    big = torch.arange(32 << 20, dtype=torch.float32).view(8192, 4096)
    dcp.save({"model": {"big": big, "small": torch.ones(3)}}, checkpoint_id=str(tmp_path / "ckpt"))
    del big
    script = tmp_path / "mem.py"
    script.write_text(_MEM_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    growth = int(proc.stdout.split()[-1])
    assert growth < 48 << 20, f"peak RSS grew {growth >> 20} MiB for a 128 MiB tensor"
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        sl = f.get_slice("big")
        assert torch.equal(sl[8000:8192], torch.arange(8000 * 4096, 8192 * 4096, dtype=torch.float32).view(192, 4096))


def test_hf_reader_regions_into_bit_arrays(tmp_path):
    """HFReader.read_region_into (the copy path, no torch) and read_region give the exact bits of
    any box: whole rows (read in place), column slices, 0-d and empty tensors."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    tensors = {
        "w": torch.randn(5, 6, 7, generator=g).to(torch.bfloat16),
        "f8": torch.randn(4, 9, generator=g).to(torch.float8_e4m3fn),
        "i": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "s": torch.tensor(2.5),
        "e": torch.empty(0, 3),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reader = HFReader(tmp_path)
    boxes = {
        "w": [Box((0, 0, 0), (5, 6, 7)), Box((1, 0, 0), (3, 6, 7)), Box((2, 1, 3), (2, 4, 4)), Box((4, 5, 6), (1, 1, 1))],
        "f8": [Box((0, 0), (4, 9)), Box((1, 2), (2, 5))],
        "i": [Box((1, 1), (2, 3))],
        "s": [Box((), ())],
        "e": [Box((0, 0), (0, 3))],
    }
    for key, wanted in boxes.items():
        entry = reader.index().tensors[key]
        t = tensors[key]
        for box in wanted:
            want = t[box.slices()].contiguous()
            assert bits_equal(reader.read_region(key, entry.chunks[0], box), want), (key, box)
            bits = np.empty(box.sizes, dtype=np.dtype({1: "uint8", 2: "uint16", 4: "int32"}[t.element_size()]))
            if key == "s":
                bits = np.empty((), dtype=np.float32)
            reader.read_region_into(key, entry.chunks[0], box, memoryview(bits.reshape(-1).view(np.uint8)))
            assert bits.tobytes() == want.reshape(-1).view(torch.uint8).numpy().tobytes(), (key, box)
