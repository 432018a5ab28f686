"""``--map torchtitan:MODEL``: torchtitan 0.3.0's own ``state_dict_adapter`` as the key map.

For every torchtitan model family that builds here (llama3, qwen3 dense and MoE, deepseek_v3,
gpt_oss, kimi_k2_7, flux, muse_glimmer text and multimodal; qwen3_5 needs ``fla``): the state of
torchtitan's own model (its names and shapes, two layers of the debug flavor, random bf16 values)
saved with ``dcp.save``; ``export-hf --map torchtitan:MODEL`` (the flavor found from the shapes)
equals the adapter's own ``to_hf`` of that state, tensor for tensor, and ``import-hf`` of the
export equals the adapter's ``from_hf`` of it (read back by the safetensors library after an
identity export), which gives the original state back. The adapter itself never sees a tensor
with data in ckptconv: only probes (meta tensors with index expressions).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import titan_support
from converter import api
from converter.config import RunOptions
from oracle import bits_equal, read_safetensors_dir

pytestmark = [pytest.mark.framework("torchtitan"),
              pytest.mark.skipif(titan_support.skip_reason() is not None, reason=str(titan_support.skip_reason()))]
OPTS = RunOptions(workers=2)
#: In the default suite: RoPE row permutations (llama3), grouped experts split and stacked
#: (deepseek_v3), fused q/k/v chunked and concatenated, reshaped (kimi_k2_7).
FAST = ["llama3/debugmodel", "deepseek_v3/debugmodel", "kimi_k2_7/debugmodel"]
SLOW = ["qwen3/debugmodel", "qwen3/debugmodel_moe", "gpt_oss/debugmodel", "flux/flux-debug", "muse_glimmer/debugmodel",
        "muse_glimmer/debugmodel_mm"]
_BLOCK = re.compile(r"(^|\.)(layers|blocks|double_blocks|single_blocks)\.(\d+)\.")


def model_spec(target: str):
    import importlib

    titan_support.apply_cpu_patches()
    model, _, flavor = target.partition("/")
    return importlib.import_module(f"torchtitan.models.{model}").model_registry(flavor)


def model_state(target: str, layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """torchtitan's own model's state dict (built on meta: names, shapes), its first ``layers``
    blocks only, filled with random bf16 values (integer buffers counted up)."""
    spec = model_spec(target)
    with torch.device("meta"):
        module = spec.model.build()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in module.state_dict().items():
        m = _BLOCK.search(k)
        if m is not None and int(m.group(3)) >= layers:
            continue
        if v.is_floating_point():
            out[k] = torch.randn(v.shape, generator=g).to(torch.bfloat16)
        else:
            out[k] = torch.arange(v.numel()).reshape(v.shape).to(v.dtype)
    if getattr(spec.model, "enable_weight_tying", False) and "lm_head.weight" in out:
        emb = next(k for k in out if k.endswith(("embeddings.weight", "embedding.weight")))
        out["lm_head.weight"] = out[emb].clone()  # a tied model holds one tensor under both names
    return out


read_hf = read_safetensors_dir


def check_family(target: str, tmp_path: Path) -> None:
    spec = model_spec(target)
    state = model_state(target)
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    adapter = spec.state_dict_adapter(spec.model, None)
    expected = adapter.to_hf({k: v.clone() for k, v in state.items()})
    model = target.partition("/")[0]
    api.export_hf(tmp_path / "dcp", tmp_path / "hf", key_map=f"torchtitan:{model}", options=OPTS)
    got = read_hf(tmp_path / "hf")
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert bits_equal(got[k], v.contiguous()), k
    back = spec.state_dict_adapter(spec.model, None).from_hf(dict(expected))
    api.import_hf(tmp_path / "hf", tmp_path / "uni", key_map=f"torchtitan:{model}", options=OPTS)
    api.export_hf(tmp_path / "uni", tmp_path / "native", options=OPTS)  # the store's tensors, as they are
    native = read_hf(tmp_path / "native")
    assert sorted(native) == sorted(back)
    for k, v in back.items():
        assert bits_equal(native[k], v.contiguous()), k
        if k in state:
            assert bits_equal(native[k], state[k]), k  # from_hf(to_hf(state)) is the state


@pytest.mark.parametrize("target", FAST)
def test_export_and_import_equal_torchtitans_adapter(target, tmp_path):
    check_family(target, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("target", SLOW)
def test_export_and_import_equal_torchtitans_adapter_large(target, tmp_path):
    check_family(target, tmp_path)


def test_diff_through_the_adapter(tmp_path):
    from cli_runner import run_cli

    state = model_state("llama3/debugmodel", layers=1)
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    api.export_hf(tmp_path / "dcp", tmp_path / "hf", key_map="torchtitan:llama3/debugmodel", options=OPTS)
    code, out, err = run_cli("diff", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--map", "torchtitan:llama3")
    assert code == 0, err
    state["layers.0.attention.qkv_linear.wq.weight"][3, 5] += 1
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp2"))
    code, out, _ = run_cli("diff", str(tmp_path / "dcp2"), str(tmp_path / "hf"), "--map", "torchtitan:llama3")
    assert code == 1 and "q_proj" in out


@pytest.mark.slow  # ~45 s on 2 cores: runs in CI's framework step
def test_wrong_flavor_and_unknown_model_are_one_line(tmp_path):
    from cli_runner import run_cli

    dcp.save(model_state("llama3/debugmodel", layers=1), checkpoint_id=str(tmp_path / "dcp"))
    code, _, err = run_cli("export-hf", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--map", "torchtitan:llama3/8B")
    assert code == 2 and len(err.splitlines()) == 1 and "pick the flavor" in err
    code, _, err = run_cli("export-hf", str(tmp_path / "dcp"), str(tmp_path / "hf2"), "--map", "torchtitan:qwen3")
    assert code == 2 and len(err.splitlines()) == 1 and "no flavor of qwen3" in err
    code, _, err = run_cli("export-hf", str(tmp_path / "dcp"), str(tmp_path / "hf3"), "--map", "torchtitan:nosuch")
    assert code == 2 and len(err.splitlines()) == 1 and "no model 'nosuch'" in err


def test_an_adapter_computing_on_values_is_refused():
    """Only rearrangements are streamed: an adapter that scales a tensor is refused, naming the op."""
    from converter.plan.titan_adapter import run_adapter
    from formats.errors import UnsupportedError

    class Scaling:
        def to_hf(self, sd):
            return {"w": sd["w"] * 2}

    class Rearranging:
        def to_hf(self, sd):
            q, k = torch.chunk(sd["w"], 2, dim=0)
            return {"kq": torch.cat([k, q], dim=0).T.contiguous(), "row": sd["w"][3]}

    with pytest.raises(UnsupportedError, match="'mul'"):
        run_adapter(Scaling(), "to_hf", {"w": ((4, 6), "float32")})
    docs, unused = run_adapter(Rearranging(), "to_hf", {"w": ((4, 6), "float32"), "x": ((2,), "float32")})
    assert unused == ["x"] and docs["kq"]["shape"] == [6, 4] and docs["row"]["shape"] == [6]


def test_fp8_hub_checkpoint_into_torchtitan_deepseek(tmp_path):
    """A DeepSeek-V3 FP8 hub checkpoint (torchtitan's debug shapes, 128 x 128 blocks, edge blocks
    partial) imported with --dequantize fp32 --map torchtitan:deepseek_v3 equals torchtitan's own
    path: torch's QuantizedHuggingFaceStorageReader (dcp.load, float32) then the adapter's from_hf."""
    from hub_quant import write_fp8_hub
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    spec = model_spec("deepseek_v3/debugmodel")
    hf_shapes = {k: tuple(v.shape) for k, v in
                 spec.state_dict_adapter(spec.model, None).to_hf(model_state("deepseek_v3/debugmodel")).items()}
    tensors = write_fp8_hub(tmp_path / "hub", shapes=hf_shapes)
    assert any(v.dtype == torch.float8_e4m3fn for v in tensors.values())
    sd = {k: torch.empty(v.shape, dtype=torch.float32 if v.dtype == torch.float8_e4m3fn else v.dtype)
          for k, v in tensors.items() if not k.endswith("_scale_inv")}
    dcp.load(sd, storage_reader=QuantizedHuggingFaceStorageReader(str(tmp_path / "hub"), target_dtype=torch.float32))
    want = spec.state_dict_adapter(spec.model, None).from_hf(sd)
    api.import_hf(tmp_path / "hub", tmp_path / "uni", key_map="torchtitan:deepseek_v3", dequantize="fp32", options=OPTS)
    api.export_hf(tmp_path / "uni", tmp_path / "native", options=OPTS)
    got = read_hf(tmp_path / "native")
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert bits_equal(got[k], v.contiguous()), k
