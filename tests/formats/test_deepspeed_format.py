"""formats/deepspeed.py's allowlist: the stand-ins it gives DeepSpeed's pickles, against torch."""

from __future__ import annotations

import pickle

import pytest
import torch

from formats import deepspeed as D
from formats.dcp.safe_pickle import safe_loads


@pytest.mark.parametrize("device", [torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda"),
                                    torch.device("meta")])
def test_a_pickled_device_reads_as_its_name(device):
    """``torch.device`` pickles as REDUCE with ``(type,)`` or ``(type, index)``: it reads as the
    device's string (what ``str(device)`` gives), not as a 'damaged pickle' TypeError."""
    got = safe_loads(pickle.dumps({"device": device}), "x/model_states.pt", D._resolve)
    assert got == {"device": str(device)}


@pytest.mark.framework("deepspeed")  # torch.load of the fixture's DeepSpeed classes
def test_a_step_too_large_for_a_float_is_a_one_line_error(tmp_path):
    """A ZeRO-3 step saved as a Python int past any float (a damaged optimizer_state.pt): a
    CorruptCheckpointError naming the file, not an OverflowError from numpy."""
    import shutil

    from ds_support import universal_of

    from formats.errors import CorruptCheckpointError

    src = tmp_path / "universal"
    shutil.copytree(universal_of(3), src)
    path = src / "zero" / "optimizer_state.pt"
    state = torch.load(path, weights_only=False)
    for s in state["optimizer_state_dict"]["state"].values():
        s["step"] = 10**400
    torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match=r"optimizer_state\.pt: key 'step' holds an integer too large"):
        D.DeepSpeedReader(src)
