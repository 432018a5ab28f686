"""formats/deepspeed_zero: the reader protocol on real DeepSpeed saves, the folder forms it
accepts, and one-line errors for what a folder lacks or holds wrongly (damaged, mixed, hostile)."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ds_support import requires_deepspeed
from ds_zero_support import TAG, saved
from formats.base import Box
from formats.dtypes import to_storage_array
from formats.errors import (CheckpointNotFoundError, CorruptCheckpointError, InvalidCheckpointError,
                            UnsafePickleError)

pytestmark = [requires_deepspeed]


def _copy(name: str, tmp_path: Path) -> Path:
    """A private writable copy of a cached case's run folder (``latest`` + tag)."""
    dst = tmp_path / name
    shutil.copytree(saved(name) / "run", dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def _reader(path: Path, verify: bool = False):
    from formats.deepspeed_zero import DeepSpeedZeroReader

    return DeepSpeedZeroReader(path, verify=verify)


def _regions(box: Box):
    yield box
    if box.ndim and box.sizes[0] > 1:
        yield Box(box.offsets, (box.sizes[0] - 1, *box.sizes[1:]))
        yield Box(box.offsets, (box.sizes[0], *(max(1, s - 1) for s in box.sizes[1:])))
    if box.ndim and box.sizes[-1] > 2:
        yield Box((*box.offsets[:-1], box.offsets[-1] + 1), (*box.sizes[:-1], box.sizes[-1] - 2))


@pytest.mark.parametrize("name", ["z2-bf16-w3", "z3-fp32-w2"])
def test_read_region_into_is_read_region_on_every_chunk(name):
    """Every region of every chunk (the rows of flat ranges): ``read_region_into`` fills exactly
    the bits ``read_region`` returns, and both agree with the whole tensor."""
    from ds_zero_support import read_all

    reader = _reader(saved(name) / "run", verify=True)
    whole = read_all(reader)
    for key, entry in reader.index().tensors.items():
        want = to_storage_array(whole[key])
        for chunk in entry.chunks:
            for region in _regions(chunk.box):
                bits = to_storage_array(reader.read_region(key, chunk, region))
                out = np.empty(region.sizes, dtype=bits.dtype)
                reader.read_region_into(key, chunk, region, memoryview(out.reshape(-1).view(np.uint8)))
                raw = bits.reshape(-1).view(np.uint8)
                assert np.array_equal(out.reshape(-1).view(np.uint8), raw), (key, region)
                assert np.array_equal(raw, want[region.slices()].reshape(-1).view(np.uint8)), (key, region)


def test_the_tag_folder_and_its_parent_with_latest_read_the_same(tmp_path):
    from converter.run.sources import detect_format

    entry = saved("z3-fp32-w2") / "run"
    assert detect_format(entry) == detect_format(entry / TAG) == "deepspeed-zero"
    assert _reader(entry).index().tensors.keys() == _reader(entry / TAG).index().tensors.keys()
    run = _copy("z3-fp32-w2", tmp_path)
    (run / "latest").write_text("global_step9")
    with pytest.raises(CheckpointNotFoundError, match=r"latest: names tag 'global_step9', but .* holds no"):
        _reader(run)


def test_a_missing_rank_file_is_a_one_line_error_naming_the_rank(tmp_path):
    run = _copy("z2-bf16-w3", tmp_path)
    (run / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"no \*_optim_states\.pt file of data-parallel rank 1"):
        _reader(run)
    (run / TAG / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()  # ranks 0 only: 1 of 3 files
    with pytest.raises(CorruptCheckpointError, match=r"1 \*_optim_states\.pt files, the partitions were cut for 3"):
        _reader(run)


def test_files_of_two_saves_are_refused(tmp_path):
    run = _copy("z2-bf16-w3", tmp_path)
    shutil.copy(run / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                run / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CorruptCheckpointError, match="mixes two saves"):
        _reader(run)


def test_a_truncated_optimizer_file_names_the_file(tmp_path):
    run = _copy("z3-fp32-w2", tmp_path)
    path = run / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        _reader(run)


def test_a_damaged_byte_fails_the_crc_check_of_its_storage(tmp_path):
    """A flipped byte inside a partition: the CRC-32 check (verify, and every conversion's
    source check) names the file; without checking, the read returns the damaged bits."""
    from converter.tools.verify import verify

    run = _copy("z2-bf16-w3", tmp_path)
    reader = _reader(run)
    key = "optim.state.layers.0.feed_forward.w2.weight.exp_avg"
    chunk = reader.index().tensors[key].chunks[0]
    slot = reader._slots[chunk.locator[0]]
    path = run / TAG / slot.file
    data = bytearray(path.read_bytes())
    data[slot.data_start + 4 * chunk.locator[1]] ^= 0xFF
    path.write_bytes(bytes(data))
    report = verify(run)
    assert not report.ok and any(p.check == "crc" and slot.file in p.message for p in report.problems)
    with pytest.raises(CorruptCheckpointError, match="CRC-32 mismatch"):
        _reader(run, verify=True).read_region(key, chunk, chunk.box)


def _replace_pickle(path: Path, pkl: bytes) -> None:
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    name = next(n for n in members if n.endswith("/data.pkl"))
    members[name] = pkl
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, data in members.items():
            z.writestr(n, data)


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def test_a_hostile_pickle_is_refused_and_never_run(tmp_path):
    run = _copy("z2-fp32-w2", tmp_path)
    _Evil.marker = str(tmp_path / "pwned")
    _replace_pickle(run / TAG / "mp_rank_00_model_states.pt", pickle.dumps({"module": {}, "x": _Evil()}, protocol=2))
    with pytest.raises(UnsafePickleError, match=r"mp_rank_00_model_states\.pt.*(posix|os)\.system.*not on the allowlist"):
        _reader(run)
    assert not (tmp_path / "pwned").exists()


def test_cli_error_is_one_line_exit_2(tmp_path):
    run = _copy("z3-fp32-w2", tmp_path)
    (run / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
    proc = subprocess.run([sys.executable, "-m", "converter", "inspect", str(run)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "zero_pp_rank_" in lines[0] and "Traceback" not in proc.stderr


def test_a_folder_without_model_states_says_what_to_pass(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "latest").write_text("nope")
    with pytest.raises((InvalidCheckpointError, CheckpointNotFoundError)):
        _reader(tmp_path / "x")


def test_inspect_names_the_zero_layout(tmp_path):
    """``ckptconv inspect --json`` of a ZeRO-3 folder: the format, the ZeRO layout (not a DTensor
    guess), every parameter with its fp32 master and states."""
    import json

    proc = subprocess.run([sys.executable, "-m", "converter", "inspect", "--json", str(saved("z3-fp32-w2") / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == "deepspeed-zero" and doc["world_size"] == 2
    assert doc["layout"]["summary"] == "ZeRO-3: flat partitions over 2 data-parallel ranks"
    keys = {t["key"]: t for t in doc["tensors"]}
    assert keys["model.out_scale"]["dtype"] == "float32" and keys["model.out_scale"]["shape"] == [1]
    assert {"optim.state.out_scale.exp_avg", "optim.state.out_scale.exp_avg_sq", "optim.state.out_scale.step"} <= set(keys)
