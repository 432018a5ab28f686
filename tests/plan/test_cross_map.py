"""``--map`` over a whole training checkpoint (converter.plan.cross_map, read through the mapped
view): every optimizer state shaped like its parameter goes through its parameter's transform, 0-d
steps are copied, param groups follow the new names in the target's key style; anything else is
refused naming the key. The expected values are computed here with torch (HF's RoPE permutation
of ``convert_llama_weights_to_hf``, torchtitan's ``FusedQKVLinear`` split/merge, Megatron's per
query group ``linear_qkv``), never with ckptconv's planning."""

from __future__ import annotations

import pytest
import torch

from converter.plan.cross_map import FROM_HF, TO_HF, resolve_direction
from converter.plan.key_maps import get_key_map
from converter.run.cross_view import cross_view
from formats.errors import ConfigError
from cross_map_support import CFG, DIM, FFN, HD, HEADS, HPARAMS, HPK, KV, hf_of_titan, split_qkv, titan_checkpoint
from mem_checkpoint import MemCheckpoint, read_all
from schemas import validation_errors


# ---------------------------------------------------------------- torchtitan -> HF (an FSDP2 job on transformers)


@pytest.mark.parametrize("style", ["dcp", "dcp-flat"])
def test_titan_to_hf_states_go_through_their_weights_transform(style):
    reader, model, states = titan_checkpoint()
    view, plan = cross_view(reader, "torchtitan-llama3", key_style=style, config=CFG)
    assert (plan.direction, plan.style) == (TO_HF, style)
    tensors, objects = read_all(view)
    weights, hf_states = hf_of_titan(model, states)
    assert {k for k in tensors if k.startswith("model.")} == {f"model.{k}" for k in weights}
    for k, t in weights.items():
        assert torch.equal(tensors[f"model.{k}"], t), k
    for fqn, st in hf_states.items():
        for role, t in st.items():
            key = f"optim.state.{fqn}.{role}"
            assert torch.equal(tensors[key], t), key
            assert view.index().tensors[key].path == (("optim", "state", fqn, role) if style == "dcp"
                                                      else ("optim", f"state.{fqn}.{role}"))
    assert objects["train_state.step"] == 7  # carried as it is
    if style == "dcp":  # get_state_dict's nested form: one group, its params the HF names
        assert objects["optim.param_groups.0.params"] == list(hf_states)
        assert {k: objects[f"optim.param_groups.0.{k}"] for k in HPARAMS} == HPARAMS
        assert view.index().objects["optim.param_groups.0.lr"].path == ("optim", "param_groups", 0, "lr")
    else:
        for fqn in hf_states:
            assert objects[f"optim.param_groups.{fqn}.betas"] == HPARAMS["betas"]
    assert not [k for k in objects if "wqkv" in k or k.startswith("optimizer.")]


def test_hf_to_titan_fuses_the_states_and_keeps_the_weights_split():
    """From HF names back to torchtitan 0.3.0: the model's load hook fuses wq/wk/wv itself, but the
    optimizer names wqkv: its states are fused (per query group) from the q/k/v states."""
    reader, model, states = titan_checkpoint(seed=1)
    weights, hf_states = hf_of_titan(model, states)
    tensors = {f"model.{k}": (t, ("model", k)) for k, t in weights.items()}
    objects = {}
    for fqn, st in hf_states.items():
        for role, t in st.items():
            tensors[f"optim.state.{fqn}.{role}"] = (t, ("optim", "state", fqn, role))
    for name, v in HPARAMS.items():
        objects[f"optim.param_groups.0.{name}"] = (v, ("optim", "param_groups", 0, name))
    objects["optim.param_groups.0.params"] = (list(hf_states), ("optim", "param_groups", 0, "params"))
    view, plan = cross_view(MemCheckpoint(tensors, objects), "torchtitan-llama3", config=CFG)
    assert (plan.direction, plan.style) == (FROM_HF, "torchtitan")
    got, objs = read_all(view)
    for k, t in model.items():
        assert torch.equal(got[k], t), k
        assert view.index().tensors[k].path == (k,)
    for fqn, st in states.items():
        for role, t in st.items():
            key = f"optimizer.state.{fqn}.{role}"
            assert torch.equal(got[key], t), key
            assert view.index().tensors[key].path == ("optimizer", f"state.{fqn}.{role}")
        assert objs[f"optimizer.param_groups.{fqn}.lr"] == HPARAMS["lr"]
    assert not [k for k in got if ".wq.weight." in k or "q_proj" in k]
    q = "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"
    line = next(x for x in plan.lines if x.target == q)
    assert line.sources == tuple(f"optim.state.model.layers.0.self_attn.{p}_proj.weight.exp_avg" for p in "qkv")
    assert "fused" in line.transform


def test_to_torchtitan_a_group_without_initial_lr_gets_its_lr():
    """torchtitan's LambdaLR adds ``initial_lr`` to every param group, so its ``dcp.load`` asks for
    ``optimizer.param_groups.<fqn>.initial_lr``; a plain FSDP2 job's AdamW saves none: it is the lr."""
    _, model, states = titan_checkpoint(seed=3)
    weights, hf_states = hf_of_titan(model, states)
    tensors = {f"model.{k}": (t, ("model", k)) for k, t in weights.items()}
    for fqn, st in hf_states.items():
        for role, t in st.items():
            tensors[f"optim.state.{fqn}.{role}"] = (t, ("optim", "state", fqn, role))
    objects = {f"optim.param_groups.0.{k}": (v, ("optim", "param_groups", 0, k)) for k, v in HPARAMS.items()
               if k != "initial_lr"}
    objects["optim.param_groups.0.params"] = (list(hf_states), ("optim", "param_groups", 0, "params"))
    view, plan = cross_view(MemCheckpoint(tensors, objects), "torchtitan-llama3", config=CFG)
    _, objs = read_all(view)
    for fqn in states:
        assert objs[f"optimizer.param_groups.{fqn}.initial_lr"] == HPARAMS["lr"]
        assert objs[f"optimizer.param_groups.{fqn}.lr"] == HPARAMS["lr"]
    assert any("initial_lr" in w for w in plan.warnings)
    kept, _ = cross_view(MemCheckpoint(tensors, objects), "torchtitan-llama3", config=CFG, key_style="dcp-flat")
    assert not [k for k in read_all(kept)[1] if k.endswith("initial_lr")]  # only torchtitan's style asks for it


@pytest.mark.parametrize("map_name", ["torchtitan-llama3", "torchtitan-llama"])
def test_round_trip_through_hf_names_is_bit_exact(map_name):
    """torchtitan -> HF -> torchtitan through two views: every entry back, bit for bit."""
    reader, _, _ = titan_checkpoint(seed=2)
    hf, _ = cross_view(reader, map_name, config=CFG)
    back, plan = cross_view(hf, "torchtitan-llama3", config=CFG)
    want_t, want_o = read_all(reader)
    got_t, got_o = read_all(back)
    assert set(got_t) == set(want_t) and set(got_o) == set(want_o)
    assert all(torch.equal(got_t[k], want_t[k]) for k in want_t)
    assert got_o == want_o
    assert {k: e.path for k, e in back.index().tensors.items()} == {k: e.path for k, e in reader.index().tensors.items()}


# ---------------------------------------------------------------- states the transform cannot take


def test_a_state_not_shaped_like_its_rearranged_parameter_is_refused_naming_the_key():
    fqn = "layers.0.attention.qkv_linear.wqkv.weight"
    reader, _, _ = titan_checkpoint(**{fqn: ("exp_avg_sq_row", (HEADS * HD + 2 * KV * HD,))})
    with pytest.raises(ConfigError) as e:
        cross_view(reader, "torchtitan-llama3", config=CFG)
    assert f"optimizer.state.{fqn}.exp_avg_sq_row" in str(e.value) and "not elementwise-safe" in str(e.value)


def test_a_state_of_another_shape_is_renamed_where_its_parameter_only_is():
    reader, _, states = titan_checkpoint(**{"layers.0.feed_forward.w1.weight": ("exp_avg_sq_row", (FFN,))})
    view, plan = cross_view(reader, "torchtitan-llama3", config=CFG)
    got, _ = read_all(view)
    key = "optim.state.model.layers.0.mlp.gate_proj.weight.exp_avg_sq_row"
    assert torch.equal(got[key], states["layers.0.feed_forward.w1.weight"]["exp_avg_sq_row"])


def test_a_fused_state_that_does_not_divide_is_refused_naming_the_key():
    g = torch.Generator().manual_seed(0)
    fqn = "layers.0.attention.qkv_linear.wqkv.weight"
    tensors = {"layers.0.attention.qkv_linear.wq.weight": (torch.randn(16, DIM, generator=g), ("layers.0.attention.qkv_linear.wq.weight",)),
               f"optimizer.state.{fqn}.exp_avg": (torch.randn(30, DIM, generator=g), ("optimizer", f"state.{fqn}.exp_avg"))}
    with pytest.raises(ConfigError) as e:
        cross_view(MemCheckpoint(tensors), "torchtitan-llama", config=CFG, key_style="dcp")
    assert f"optimizer.state.{fqn}.exp_avg" in str(e.value) and "do not split" in str(e.value)


# ---------------------------------------------------------------- experts, Megatron's stacked layers


def test_grouped_experts_slice_and_stack_with_their_states():
    """torchtitan's grouped experts [E, ...] to HF's one tensor per expert, states alike, and back."""
    g = torch.Generator().manual_seed(3)
    E = 3
    grouped = {f"layers.0.moe.routed_experts.inner_experts.{n}": torch.randn(E, *s, generator=g)
               for n, s in (("w1_EFD", (6, DIM)), ("w2_EDF", (DIM, 6)), ("w3_EFD", (6, DIM)))}
    grouped["layers.0.moe.router.gate.weight"] = torch.randn(E, DIM, generator=g)
    tensors = {k: (t, (k,)) for k, t in grouped.items()}
    for k, t in grouped.items():
        tensors[f"optimizer.state.{k}.exp_avg"] = (t * 2, ("optimizer", f"state.{k}.exp_avg"))
        tensors[f"optimizer.state.{k}.step"] = (torch.tensor(3.0), ("optimizer", f"state.{k}.step"))
    reader = MemCheckpoint(tensors)
    view, plan = cross_view(reader, "torchtitan-qwen3", key_style="dcp-flat")
    got, _ = read_all(view)
    hf = {"w1_EFD": "gate_proj", "w2_EDF": "down_proj", "w3_EFD": "up_proj"}
    for n, name in hf.items():
        src = grouped[f"layers.0.moe.routed_experts.inner_experts.{n}"]
        for e in range(E):
            fqn = f"model.layers.0.mlp.experts.{e}.{name}.weight"
            assert torch.equal(got[f"model.{fqn}"], src[e])
            assert torch.equal(got[f"optim.state.{fqn}.exp_avg"], src[e] * 2)
            assert float(got[f"optim.state.{fqn}.step"]) == 3.0
    back, _ = cross_view(view, "torchtitan-qwen3", key_style="torchtitan")
    want, _ = read_all(reader)
    again, _ = read_all(back)
    assert set(again) == set(want) and all(torch.equal(again[k], want[k]) for k in want)


def test_megatron_stacked_layers_states_unstack_and_split_like_the_weights():
    """Megatron-core's layer-stacked linear_qkv [L, rows, dim] (states ``optimizer.state.<name>.<key>``,
    the fp32 main copy ``param`` too) to HF's per-layer q/k/v."""
    g = torch.Generator().manual_seed(4)
    L, rows = 2, (HPK + 2) * KV * HD
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    norm = "decoder.final_layernorm.weight"
    weights = {qkv: torch.randn(L, rows, DIM, generator=g), norm: torch.randn(DIM, generator=g)}
    from formats.dcp.reader import guess_path

    tensors = {k: (t, guess_path(k)) for k, t in weights.items()}
    for k, t in weights.items():
        for state, scale in (("exp_avg", 2), ("param", 3)):
            key = f"optimizer.state.{state}.{k}"
            tensors[key] = (t * scale, guess_path(key))
    view, plan = cross_view(MemCheckpoint(tensors, rows=1, layer_chunks=(qkv, f"optimizer.state.exp_avg.{qkv}",
                                                                         f"optimizer.state.param.{qkv}")),
                            "megatron-llama", config=CFG)
    got, _ = read_all(view)
    for layer in range(L):
        q, k, v = split_qkv(weights[qkv][layer])
        for name, want in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            fqn = f"model.layers.{layer}.self_attn.{name}.weight"
            assert torch.equal(got[f"model.{fqn}"], want)
            assert torch.equal(got[f"optim.state.{fqn}.exp_avg"], want * 2)
            assert torch.equal(got[f"optim.state.{fqn}.main_param"], want * 3)
    assert torch.equal(got["optim.state.model.norm.weight.exp_avg"], weights[norm] * 2)


# ---------------------------------------------------------------- param groups


def _nested(groups: list[tuple[dict, list[str]]]) -> dict:
    out = {}
    for i, (hp, params) in enumerate(groups):
        for k, v in {**hp, "params": params}.items():
            out[f"optim.param_groups.{i}.{k}"] = (v, ("optim", "param_groups", i, k))
    return out


def test_two_param_groups_follow_their_parameters_both_ways():
    """get_state_dict's nested groups (decay / no decay) -> torchtitan's per-parameter copies, and
    back into two groups whose params lists hold the new names."""
    g = torch.Generator().manual_seed(5)
    w = {"model.layers.0.mlp.gate_proj.weight": torch.randn(FFN, DIM, generator=g),
         "model.layers.0.input_layernorm.weight": torch.randn(DIM, generator=g)}
    tensors = {f"model.{k}": (t, ("model", k)) for k, t in w.items()}
    for k, t in w.items():
        tensors[f"optim.state.{k}.exp_avg"] = (t + 1, ("optim", "state", k, "exp_avg"))
    decay, plain = {**HPARAMS, "weight_decay": 0.1}, {**HPARAMS, "weight_decay": 0.0}
    objects = _nested([(decay, ["model.layers.0.mlp.gate_proj.weight"]), (plain, ["model.layers.0.input_layernorm.weight"])])
    titan, plan = cross_view(MemCheckpoint(tensors, objects), "torchtitan-llama3", config=CFG)
    _, objs = read_all(titan)
    assert objs["optimizer.param_groups.layers.0.feed_forward.w1.weight.weight_decay"] == 0.1
    assert objs["optimizer.param_groups.layers.0.attention_norm.weight.weight_decay"] == 0.0
    hf, _ = cross_view(titan, "torchtitan-llama3", config=CFG)
    _, back = read_all(hf)
    assert back["optim.param_groups.0.params"] == ["model.layers.0.mlp.gate_proj.weight"]
    assert back["optim.param_groups.1.params"] == ["model.layers.0.input_layernorm.weight"]
    assert (back["optim.param_groups.0.weight_decay"], back["optim.param_groups.1.weight_decay"]) == (0.1, 0.0)


def test_parts_of_one_fused_tensor_in_two_groups_are_refused():
    reader, model, states = titan_checkpoint(seed=6)
    weights, hf_states = hf_of_titan(model, states)
    tensors = {f"model.{k}": (t, ("model", k)) for k, t in weights.items()}
    for fqn, st in hf_states.items():
        tensors[f"optim.state.{fqn}.exp_avg"] = (st["exp_avg"], ("optim", "state", fqn, "exp_avg"))
    q = "model.layers.0.self_attn.q_proj.weight"
    objects = _nested([(HPARAMS, [f for f in hf_states if f != q]), ({**HPARAMS, "lr": 0.5}, [q])])
    with pytest.raises(ConfigError, match="param groups differ"):
        cross_view(MemCheckpoint(tensors, objects), "torchtitan-llama3", config=CFG)


# ---------------------------------------------------------------- direction, dry run


def test_direction_comes_from_the_source_names():
    kmap = get_key_map("torchtitan-llama3")
    assert resolve_direction(kmap, ["tok_embeddings.weight", "lm_head.weight"], "auto") == TO_HF
    assert resolve_direction(kmap, ["model.embed_tokens.weight", "lm_head.weight"], "auto") == FROM_HF
    with pytest.raises(ConfigError, match="--map-direction"):
        resolve_direction(kmap, ["lm_head.weight"], "auto")
    with pytest.raises(ConfigError, match="export only"):
        resolve_direction(get_key_map("megatron-llama"), [], FROM_HF)


def test_dry_run_lines_name_every_source_target_and_transform():
    reader, _, _ = titan_checkpoint()
    _, plan = cross_view(reader, "torchtitan-llama3", config=CFG)
    text = plan.text()
    fqn = "layers.0.attention.qkv_linear.wqkv.weight"
    assert (f"optimizer.state.{fqn}.exp_avg -> optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg  "
            "[state: 16 of 32 rows, reordered]") in text
    assert f"optimizer.state.{fqn}.step -> optim.state.model.layers.0.self_attn.v_proj.weight.step  [state: copied]" in text
    assert ("layers.0.attention.qkv_linear.wk.weight -> model.model.layers.0.self_attn.k_proj.weight  "
            "[weight: rows permuted]") in text
    assert "train_state.step -> train_state.step  [entry: as is]" in text
    doc = {"schema": "ckptconv.key-map/1", **plan.to_json()}
    assert validation_errors("key-map", doc) == []
    assert {e["kind"] for e in doc["entries"]} == {"weight", "state", "hparam", "entry"}
