"""``export-hf --like BASE_HF_DIR``: the export takes the base model's shard files, dtypes, FP8
weights and non-weight files.

Oracles: a real tiny Llama saved by transformers' ``save_pretrained`` (sharded, bf16, with a
tokenizer and generation config) as the base, transformers' ``from_pretrained`` offline on the
export, torch's reading of the DCP fixture, and the safetensors library.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from converter import api
from converter.config import RunOptions
from formats.errors import ConfigError, DestinationError
from hub_quant import write_fp8_hub
from oracle import bits_equal

transformers = pytest.importorskip("transformers")

from test_hf import llama_to_hf_names, model_reference  # noqa: E402

OPTS = RunOptions(workers=2)
LLAMA = {"hidden_size": 32, "intermediate_size": 96, "num_attention_heads": 4, "num_hidden_layers": 2,
         "num_key_value_heads": 2, "tie_word_embeddings": False, "vocab_size": 50, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "max_position_embeddings": 64}


def save_base(out: Path, **overrides) -> Path:
    """A tiny Llama saved by transformers in bf16, sharded, with a tokenizer and generation config."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(**(LLAMA | overrides))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="20KB")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1").save_pretrained(out)
    (out / "README.md").write_text("a base model\n")
    return out


def headers(path: Path) -> dict[str, list[str]]:
    """File -> its tensors in data-offset order (read from the header)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        doc = json.loads(raw[8: 8 + n])
        doc.pop("__metadata__", None)
        out[f.name] = sorted(doc, key=lambda k: doc[k]["data_offsets"][0])
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_base(tmp_path_factory.mktemp("base") / "llama")


def test_like_keeps_the_base_layout_dtypes_and_files(dcp_checkpoint, base, tmp_path, monkeypatch):
    src = dcp_checkpoint("fsdp4")  # float32 torchtitan-style Llama, FSDP over 4 ranks
    out = tmp_path / "hf"
    api.export_hf(src, out, key_map="torchtitan-llama", like=base, options=OPTS)
    base_index = json.loads((base / "model.safetensors.index.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == base_index["weight_map"] and len(set(index["weight_map"].values())) > 2
    assert headers(out) == headers(base)  # the same files, each with the same tensors in the same order
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    expected = llama_to_hf_names(model_reference(src))
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                assert bits_equal(st.get_tensor(k), expected[k].to(torch.bfloat16)), k
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = transformers.LlamaForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.bfloat16
    for k, v in model.state_dict().items():
        assert bits_equal(v, expected[k].to(torch.bfloat16)), k
    assert transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)("w3 w7")["input_ids"] == [3, 7]


def test_like_an_fp8_base_rewrites_its_files_byte_for_byte(tmp_path):
    """An FP8 hub checkpoint imported as it is, exported --like itself: every file identical."""
    hub = tmp_path / "hub"
    write_fp8_hub(hub)
    api.import_hf(hub, tmp_path / "uni", options=OPTS)
    api.export_hf(tmp_path / "uni", tmp_path / "hf", like=hub, options=OPTS)
    names = sorted(p.name for p in hub.iterdir())
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [".written-by-ckptconv.json", *names]
    for name in names:
        assert (tmp_path / "hf" / name).read_bytes() == (hub / name).read_bytes(), name


def test_like_an_fp8_base_quantizes_where_it_does(tmp_path):
    """A dequantized (bf16) checkpoint exported --like an FP8 base: FP8 + scales exactly where the
    base has them, in its files; the other tensors as they are."""
    hub = tmp_path / "hub"
    tensors = write_fp8_hub(hub)
    api.import_hf(hub, tmp_path / "uni", dequantize="bf16", options=OPTS)
    api.export_hf(tmp_path / "uni", tmp_path / "hf", like=hub, options=OPTS)
    assert headers(tmp_path / "hf") == headers(hub)
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                got = st.get_tensor(k)
                assert got.dtype == tensors[k].dtype, k
                if got.dtype == torch.bfloat16:
                    assert bits_equal(got, tensors[k]), k


@pytest.mark.parametrize("layers, message", [
    (3, r"the base has 'model\.layers\.2\..*' \(and 8 more\), which the checkpoint lacks"),
    (1, r"the export has 'model\.layers\.1\..*' \(and 8 more\), which the base lacks"),
])
def test_like_key_mismatch_is_one_line(dcp_checkpoint, tmp_path, layers, message):
    other = save_base(tmp_path / "other", num_hidden_layers=layers)
    with pytest.raises(ConfigError, match=message):
        api.export_hf(dcp_checkpoint("fsdp4"), tmp_path / "hf", key_map="torchtitan-llama", like=other, options=OPTS)
    from cli_runner import run_cli

    code, _, err = run_cli("export-hf", str(dcp_checkpoint("fsdp4")), str(tmp_path / "hf2"), "--map", "torchtitan-llama",
                           "--like", str(other))
    assert code == 2 and len(err.splitlines()) == 1 and "--like" in err


def test_like_refuses_the_options_it_decides(dcp_checkpoint, base, tmp_path):
    for kw in ({"dtype": "fp32"}, {"max_shard_size": "1GB"}, {"quantize": "fp8-block"}):
        with pytest.raises(ConfigError, match="--like and --"):
            api.export_hf(dcp_checkpoint("fsdp4"), tmp_path / "hf", like=base, options=OPTS, **kw)


def test_like_output_is_replaced_by_overwrite(dcp_checkpoint, base, tmp_path):
    out = tmp_path / "hf"
    api.export_hf(dcp_checkpoint("fsdp4"), out, key_map="torchtitan-llama", like=base, options=OPTS)
    with pytest.raises(DestinationError, match="already holds a complete Hugging Face export"):
        api.export_hf(dcp_checkpoint("fsdp4"), out, key_map="torchtitan-llama", like=base, options=OPTS)
    (out / "notes.txt").write_text("mine")  # a file the export did not write is never deleted
    with pytest.raises(DestinationError, match="notes.txt"):
        api.export_hf(dcp_checkpoint("fsdp4"), out, key_map="torchtitan-llama", like=base,
                      options=RunOptions(workers=2, overwrite=True))
    (out / "notes.txt").unlink()
    api.export_hf(dcp_checkpoint("fsdp4"), out, key_map="torchtitan-llama", like=base,
                  options=RunOptions(workers=2, overwrite=True))
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()


def test_like_a_tied_base_leaves_the_output_projection_out(dcp_checkpoint, tmp_path):
    tied = save_base(tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in json.loads((tied / "model.safetensors.index.json").read_text())["weight_map"]
    result = api.export_hf(dcp_checkpoint("fsdp4"), tmp_path / "hf", key_map="torchtitan-llama", like=tied, options=OPTS)
    assert any("lm_head.weight left out" in w for w in result.warnings)
    assert headers(tmp_path / "hf") == headers(tied)
