"""converter/plan/key_maps.py on its own: templates, the exporter as the importer's inverse for
every built-in map, map files (checked, refused with one line), and the RoPE permutation against
torch's own view/transpose (HF's ``convert_llama_weights_to_hf``).

Against mappings that are not ckptconv's (issue 25): the torchtitan maps are torchtitan 0.3.0's own
adapter tables (``Llama3StateDictAdapter``, ``Qwen3StateDictAdapter``, ``DeepSeekV3StateDictAdapter``
``from_hf_map``: every entry both ways, nothing ckptconv adds), and both Llama maps name exactly
the weights of transformers' own ``LlamaForCausalLM``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from converter.plan.key_maps import (BUILTIN_MAPS, IDENTITY, Renamer, Template, get_key_map, key_map_from_doc,
                                     parse_transform, rename_all, rope_permutation)
from formats.errors import ConfigError

import titan_support

needs_titan = pytest.mark.framework("torchtitan")  # its adapters: skips (fails under CI) without torchtitan


def test_template_holes_match_digit_runs_only():
    t = Template("layers.{}.experts.{}.w")
    assert t.holes == 2 and t.fill(["3", "17"]) == "layers.3.experts.17.w"
    assert t.regex().fullmatch("layers.3.experts.17.w").groups() == ("3", "17")
    assert t.regex().fullmatch("layers.x.experts.1.w") is None


def test_renamer_exact_first_then_templates_and_drops():
    r = Renamer({"a.{}.w": "b.{}.w", "a.0.w": "first.w", "gone.{}": None})
    assert r.rename("a.0.w") == "first.w" and r.rename("a.12.w") == "b.12.w" and r.rename("gone.4") is None
    with pytest.raises(KeyError):
        r.rename("other")
    with pytest.raises(ConfigError, match="same number"):
        Renamer({"a.{}": "b"})


def test_rename_all_lists_unmapped_keys_and_refuses_collisions():
    r = Renamer({"x.{}": "y.{}", "z": "y.1"})
    with pytest.raises(ConfigError, match=r"leaves 2 key\(s\) unmapped: 'p', 'q'"):
        rename_all(["x.0", "p", "q"], r, "m", "export")
    with pytest.raises(ConfigError, match="the same name 'y.1'"):
        rename_all(["x.1", "z"], r, "m", "export")
    assert rename_all(["k"], None, "identity", "export") == {"k": "k"}


@pytest.mark.parametrize("name", sorted(BUILTIN_MAPS))
def test_every_builtin_map_exports_what_it_imports(name):
    kmap = BUILTIN_MAPS[name]
    assert get_key_map(name) is kmap
    if kmap.identity:
        assert kmap.importer() is None
        return
    exporter = kmap.exporter()
    importer = kmap.importer()
    for hf, native in kmap.from_hf.items():
        if native is None:
            continue
        for n in ("0", "31"):
            hf_name, native_name = (Template(hf).fill([n] * Template(hf).holes),
                                    Template(native).fill([n] * Template(native).holes))
            assert importer.rename(hf_name) == native_name
            assert exporter.rename(native_name) == hf_name


def test_map_files_are_checked(tmp_path):
    good = tmp_path / "m.json"
    good.write_text(json.dumps({"map": {"h.{}.w": "n.{}.w"}, "drop": ["n.extra"], "transforms": {"n.{}.w": "rope:heads"}}))
    kmap = get_key_map(str(good))
    assert kmap.exporter().rename("n.2.w") == "h.2.w" and kmap.exporter().rename("n.extra") is None
    assert kmap.transform_of("n.5.w") == "rope:heads" and parse_transform("rope:heads", "x") == ("rope", "heads")
    bad = {"twice": {"a": "n", "b": "n"}, "field": {"map": {}, "oops": 1}, "transform": {"map": {}, "transforms": {"k": "flip"}},
           "value": {"a": 3}}
    for what, doc in bad.items():
        with pytest.raises(ConfigError) as e:
            key_map_from_doc(doc, f"{what}.json")
        assert "\n" not in str(e.value) and f"{what}.json" in str(e.value)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="not JSON"):
        get_key_map(str(tmp_path / "broken.json"))
    with pytest.raises(ConfigError, match="not a built-in map"):
        get_key_map(str(tmp_path / "missing.json"))
    assert get_key_map(None) is IDENTITY


@pytest.mark.parametrize("heads, head_dim", [(1, 2), (4, 8), (8, 128)])
def test_rope_permutation_is_hf_conversion_and_its_inverse(heads, head_dim):
    rows, dim = heads * head_dim, 3
    w = torch.arange(rows * dim, dtype=torch.float32).view(rows, dim)
    hf = w.view(heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(rows, dim)  # convert_llama_weights_to_hf
    to_hf = rope_permutation(rows, heads, to_hf=True)
    assert torch.equal(w[torch.from_numpy(to_hf)], hf)
    back = rope_permutation(rows, heads, to_hf=False)
    assert torch.equal(hf[torch.from_numpy(back)], w)
    assert np.array_equal(np.sort(to_hf), np.arange(rows))
    with pytest.raises(ConfigError, match="heads of even size"):
        rope_permutation(rows + 1, heads, to_hf=True, key="wq")


def _fill(template: str, n: str = "3") -> str:
    return Template(template).fill([n] * Template(template).holes)


def _titan_adapter(name: str):
    """torchtitan 0.3.0's adapter of a built-in map (configs only as far as ``__init__`` reads them)."""
    import importlib
    import types

    titan_support.apply_cpu_patches()
    module, cls = {"torchtitan-llama3": ("llama3", "Llama3StateDictAdapter"),
                   "torchtitan-qwen3": ("qwen3", "Qwen3StateDictAdapter"),
                   "torchtitan-deepseek-v3": ("deepseek_v3", "DeepSeekV3StateDictAdapter"),
                   "torchtitan-deepseek-v3-lora": ("deepseek_v3", "DeepSeekV3StateDictAdapter")}[name]
    adapter = getattr(importlib.import_module(f"torchtitan.models.{module}.state_dict_adapter"), cls)
    attention = types.SimpleNamespace(q_lora_rank=8 if name.endswith("-lora") else 0)
    return adapter(types.SimpleNamespace(layers=[types.SimpleNamespace(attention=attention)]), None)


#: Entries of torchtitan's adapters that ckptconv leaves out, and why (README: export-hf).
NOT_MAPPED = {"torchtitan-deepseek-v3": ("enorm", "hnorm", "eh_proj", "shared_head")}  # MTP layers


#: torchtitan-llama takes the older torchtitan (and Meta) names: 0.3.0's adapter's native names
#: with q/k/v out of ``qkv_linear`` and ``lm_head`` as ``output``.
OLDER_NAMES = {"attention.qkv_linear.": "attention.", "lm_head.weight": "output.weight"}


def _older(native: str | None) -> str | None:
    for new, old in OLDER_NAMES.items():
        native = native.replace(new, old) if native is not None else None
    return native


@needs_titan
@pytest.mark.parametrize("adapter", ["torchtitan-llama3", "torchtitan-llama", "torchtitan-qwen3",
                                     "torchtitan-deepseek-v3", "torchtitan-deepseek-v3-lora"])
def test_torchtitan_maps_are_torchtitans_own_adapter_tables(adapter):
    name = adapter.removesuffix("-lora")
    kmap = BUILTIN_MAPS[name]
    if name == "torchtitan-llama":
        table = {hf: _older(native) for hf, native in _titan_adapter("torchtitan-llama3").from_hf_map.items()}
    else:
        table = _titan_adapter(adapter).from_hf_map
    importer, exporter = kmap.importer(), kmap.exporter()
    skipped = NOT_MAPPED.get(name, ())
    for hf, native in table.items():
        if any(f".{part}." in hf for part in skipped):
            with pytest.raises(KeyError):
                importer.rename(_fill(hf))
            continue
        if native is None:  # the adapter drops it on import
            assert importer.rename(_fill(hf)) is None, hf
        elif Template(hf).holes == 2:  # one HF tensor per expert <-> the grouped tensor
            assert kmap.experts[hf] == native
        else:
            assert importer.rename(_fill(hf)) == _fill(native), hf
            assert exporter.rename(_fill(native)) == _fill(hf), native
    variants = [a for a in ("torchtitan-deepseek-v3", "torchtitan-deepseek-v3-lora") if a.startswith(name)] or [adapter]
    theirs = set(table) | {hf for a in variants if a != adapter for hf in _titan_adapter(a).from_hf_map}  # with/without LoRA
    ours = {hf for hf, native in kmap.from_hf.items() if native is not None} | set(kmap.experts)
    assert ours <= theirs, f"names torchtitan's adapter does not have: {sorted(ours - theirs)}"


def _transformers_llama_names() -> set[str]:
    """Every weight name of transformers' own LlamaForCausalLM (untied, 2 layers; built on meta)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return set(model.state_dict())


@pytest.mark.framework("transformers")
@pytest.mark.parametrize("name", ["torchtitan-llama", "torchtitan-llama3"])
def test_llama_maps_name_every_weight_of_transformers_llama(name):
    """Each of transformers' names imports to one native name, and that exports back to it."""
    kmap = BUILTIN_MAPS[name]
    hf_names = _transformers_llama_names()
    assert len(hf_names) == 2 + 2 * 9 + 1  # embed, norm, lm_head; 9 per layer
    native = {hf: kmap.importer().rename(hf) for hf in sorted(hf_names)}
    assert None not in native.values() and len(set(native.values())) == len(native)
    assert {kmap.exporter().rename(n): hf for hf, n in native.items()} == {hf: hf for hf in native}
