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
