"""converter/plan/atoms.py on the object paths of real ``dcp.save`` checkpoints (torch's
``get_state_dict``, nested and flattened, under DCP's tutorial ``{"app": ...}`` root): every
optimizer state and hparam joins its parameter's atom, everything else is an atom of its own."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from converter.plan.atoms import AtomRef, group_atoms, is_megatron, megatron_refs, param_of_keys, root_prefix
from formats.dcp import DCPReader
from formats.dcp.reader import guess_path

PARAMS = ("0.weight", "0.bias", "1.weight", "1.bias")


def _paths(tmp_path, flatten: bool, app: bool) -> dict[str, tuple]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
        state = {"model": msd, "optim": osd, "step": 7} if not flatten else {**msd, "optimizer": osd, "step": 7}
        dcp.save({"app": state} if app else state, checkpoint_id=str(tmp_path))
    with DCPReader(tmp_path) as reader:
        index = reader.index()
    return {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}


@pytest.mark.parametrize("flatten, app", [(False, False), (False, True), (True, False)])
def test_states_and_hparams_join_their_parameter(tmp_path, flatten, app):
    paths = _paths(tmp_path, flatten, app)
    assert root_prefix(paths.values()) == (("app",) if app else ())
    assert not is_megatron(paths)
    refs, atoms = group_atoms(paths)
    for fqn in PARAMS:
        members = atoms[fqn]
        assert {"param", "exp_avg", "exp_avg_sq", "step"} <= set(members), (fqn, members)
        assert refs[members["exp_avg"]] == AtomRef(fqn, "exp_avg")
        if flatten:  # torchtitan style: one hparam entry per parameter
            assert refs[members["hparam.lr"]] == AtomRef(fqn, "hparam.lr")
    extra = "app.step" if app else "step"  # the training step beside model and optimizer
    assert atoms[refs[extra].atom] == {refs[extra].role: extra}  # an atom of its own
    assert sum(len(m) for m in atoms.values()) == len(paths)  # every key in exactly one atom
    followed = param_of_keys(refs)
    assert all(followed[k] in PARAMS for fqn in PARAMS for k in atoms[fqn].values())


def test_megatron_states_name_the_parameter_after_the_state():
    keys = ["decoder.layers.mlp.linear_fc1.weight", "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight",
            "optimizer.state.param.decoder.layers.mlp.linear_fc1.weight", "optimizer.state.exp_avg.gone.weight",
            "rng_state/shard_0.1_1.2"]
    paths = {k: guess_path(k) for k in keys}  # torch_dist writes no planner data: the reader guesses
    assert is_megatron(paths)
    refs = megatron_refs(keys)
    w = "decoder.layers.mlp.linear_fc1.weight"
    assert refs[w] == AtomRef(w, "param")
    assert refs[f"optimizer.state.exp_avg.{w}"] == AtomRef(w, "exp_avg")
    assert refs[f"optimizer.state.param.{w}"] == AtomRef(w, "main_param")
    assert refs["optimizer.state.exp_avg.gone.weight"].role == "value"  # its parameter is not there
    assert refs["rng_state/shard_0.1_1.2"].role == "value"
    assert group_atoms(paths)[0] == refs
