"""Non-tensor entries of plain Python data are read without torch, exactly as ``torch.load`` reads
them; everything else (and anything hostile or damaged) goes to torch's weights-only path."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from formats.errors import CorruptCheckpointError, UnsafePickleError
from formats.objects import load_plain_object, load_torch_object

PLAIN = [
    0.001, -0.0, float("inf"), float("nan"), 3, -(2**70), True, None, "", "héllo",
    [1, 2.5, "x"], (0.9, 0.999), {"lr": 1e-3, "betas": (0.9, 0.95), "params": ["a.b", "c"], "nested": {"k": [None]}},
    [{"lr": 0.1, "weight_decay": 0.0}, {"lr": 0.01, "initial_lr": 0.01}], {}, [],
]
NOT_PLAIN = [torch.ones(3), np.arange(4), b"raw bytes", {1, 2}, io.BytesIO(b"x"), frozenset({1}), range(3)]


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_values_read_as_torch_reads_them(value):
    data = _saved(value)
    found, got = load_plain_object(data)
    assert found
    assert repr(got) == repr(torch.load(io.BytesIO(data), weights_only=True))
    assert type(got) is type(value)
    assert repr(load_torch_object(data, "k")) == repr(got)


@pytest.mark.parametrize("value", NOT_PLAIN, ids=lambda v: type(v).__name__)
def test_other_values_are_left_to_torch(value):
    data = _saved(value)
    assert load_plain_object(data) == (False, None)
    got = load_torch_object(data, "k")  # torch's weights-only path plus the extra allowlist
    if isinstance(value, torch.Tensor):
        assert torch.equal(got, value)
    elif isinstance(value, io.BytesIO):
        assert got.getvalue() == value.getvalue()
    elif isinstance(value, np.ndarray):
        assert np.array_equal(got, value)
    else:
        assert got == value


def test_hostile_pickle_never_runs(tmp_path):
    marker = tmp_path / "ran"
    data = _saved({"lr": 0.1, "x": Evil(str(marker))})
    assert load_plain_object(data) == (False, None)
    with pytest.raises(UnsafePickleError, match="--trust-pickle"):
        load_torch_object(data, "extra.x")
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "not a zip"])
def test_damaged_archives_are_reported_not_guessed(damage):
    data = bytearray(_saved({"lr": 0.1, "betas": (0.9, 0.95)}))
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped":  # inside data.pkl: the zip CRC no longer matches
        at = data.index(b"betas")
        data[at] ^= 0x01
    else:
        data = bytearray(b"garbage" * 10)
    assert load_plain_object(bytes(data)) == (False, None)
    with pytest.raises(CorruptCheckpointError):
        load_torch_object(bytes(data), "k")


def test_plain_values_need_no_torch():
    data = _saved({"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]})
    script = textwrap.dedent(
        """
        import sys
        from formats.objects import load_torch_object
        value = load_torch_object(sys.stdin.buffer.read(), "k")
        assert value == {"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}, value
        assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch imported"
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], input=data, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]


def test_damaged_object_in_a_real_checkpoint_is_one_line_error(tmp_path):
    """A flipped byte in a non-tensor entry of a real ``dcp.save`` (which ``torch.load`` would
    read as a different value) fails the conversion with one line naming the key; nothing is
    published."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from cli_runner import run_cli

    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process save
        dcp.save({"w": torch.arange(6.0), "extra": {"lr": 0.1, "tag": "marker-value"}}, checkpoint_id=str(ckpt))
    files = [f for f in ckpt.glob("*.distcp") if b"marker-value" in f.read_bytes()]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[raw.index(b"marker-value")] ^= 0x01  # "larker-value": a well-formed pickle, wrong bytes
    files[0].write_bytes(bytes(raw))
    code, out, err = run_cli("to-universal", str(ckpt), str(tmp_path / "uni"))
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CRC-32" in lines[0] and "extra.tag" in lines[0], err
    assert not (tmp_path / "uni" / "ckptconv.json").exists()
