"""converter/plan/key_maps.py on its own: templates, the exporter as the importer's inverse for
every built-in map, map files (checked, refused with one line), and the RoPE permutation against
torch's own view/transpose (HF's ``convert_llama_weights_to_hf``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from converter.plan.key_maps import (BUILTIN_MAPS, IDENTITY, Renamer, Template, get_key_map, key_map_from_doc,
                                     parse_transform, rename_all, rope_permutation)
from formats.errors import ConfigError


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
