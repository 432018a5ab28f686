"""DCP's safetensors storage with torchtitan 0.3.0's own Trainer (CPU, gloo; ``titan_support``).

torchtitan's ``checkpoint.last_save_in_hf`` saves the last step through its Llama 3 state-dict
adapter with DCP's ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``:
``step-N/sharded/`` (the per-rank files) and torch's consolidated files in ``step-N/``. Checked:

- ckptconv reads ``sharded/`` as torch's reader does, and it equals torchtitan's consolidated files;
- ``ckptconv consolidate sharded/`` is byte for byte torchtitan's own consolidated output;
- the same for an MoE model (deepseek_v3 debugmodel under expert parallelism, ``dp2,ep2``: each
  expert's HF tensors whole in its EP rank's file);
- ckptconv's per-rank output for another mesh (``from-universal --format dcp-safetensors``) is what
  torchtitan's own ``checkpoint.initial_load_in_hf`` loads (DCP's ``HuggingFaceStorageReader`` and
  the adapter's ``from_hf``): the next step's loss is bit for bit the loss after loading
  torchtitan's own consolidated save on the same mesh.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import fixture_cache
import titan_support
from cli_runner import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.framework("torchtitan")]

SAVE_MESH = "tp2,dp2"
HERE = Path(__file__).resolve().parents[1] / "support"


MOE = "deepseek_v3/debugmodel"
MOE_MESH = "dp2,ep2"


def _cache() -> fixture_cache.FixtureCache:
    h = hashlib.sha256()
    for name in ("titan_support.py", "titan_moe_support.py", "titan_worker.py"):
        h.update((HERE / name).read_bytes())
    root = fixture_cache.base_dir() / f"titan-hf-{torch.__version__}-{h.hexdigest()[:16]}"

    def build(name: str, tmp: Path) -> None:
        work = tmp / "run"
        job = {"dump": str(work), "steps": 2, "save_interval": None, "last_save_in_hf": True}
        if name == "moe":
            import titan_moe_support

            titan_moe_support.run_job({**job, "mesh": MOE_MESH, "model": MOE}, work)
        else:
            titan_support.run_job({**job, "mesh": name}, work)
        shutil.move(str(work / "checkpoint" / "step-2"), str(tmp / "save"))
        shutil.rmtree(work)

    return fixture_cache.FixtureCache(root, build)


@pytest.fixture(scope="module")
def titan_hf_save() -> Path:
    """torchtitan's last_save_in_hf output on SAVE_MESH (READ-ONLY): ``sharded/`` + consolidated."""
    reason = titan_support.skip_reason()
    if reason:
        pytest.skip(reason)
    return _cache().get(SAVE_MESH) / "save"


@pytest.fixture(scope="module")
def titan_moe_hf_save() -> Path:
    """torchtitan's last_save_in_hf output of its MoE model under EP (READ-ONLY)."""
    reason = titan_support.skip_reason()
    if reason:
        pytest.skip(reason)
    return _cache().get("moe") / "save"


def test_moe_per_rank_form_and_consolidate(titan_moe_hf_save, tmp_path):
    import hf_storage_factory as hfs
    from formats.dcp_safetensors import DCPSafetensorsReader
    from oracle import bits_equal

    sharded = titan_moe_hf_save / "sharded"
    code, out, err = run_cli("diff", str(sharded), str(titan_moe_hf_save))
    assert code == 0 and "same:" in out, out + err
    index = DCPSafetensorsReader(sharded).index()
    assert any(".mlp.experts." in k for k in index.tensors) and index.info["world_size"] == 2
    want = hfs.torch_hf_read(sharded)
    code, _, err = run_cli("to-universal", str(sharded), str(tmp_path / "uni"))
    assert code == 0, err
    code, _, err = run_cli("from-universal", str(tmp_path / "uni"), str(tmp_path / "dcp"), "--mesh", "dp3")
    assert code == 0, err
    from oracle import torch_reference

    got = torch_reference(tmp_path / "dcp")
    assert set(got) == set(want) and all(bits_equal(got[k], want[k]) for k in want)
    code, _, err = run_cli("consolidate", str(sharded), str(tmp_path / "out"))
    assert code == 0, err
    for name in sorted(p.name for p in titan_moe_hf_save.glob("model*")):
        assert (tmp_path / "out" / name).read_bytes() == (titan_moe_hf_save / name).read_bytes(), name


def test_per_rank_form_reads_as_torch_reads_it(titan_hf_save):
    import hf_storage_factory as hfs
    from formats.dcp_safetensors import DCPSafetensorsReader
    from formats.dtypes import to_storage_array

    sharded = titan_hf_save / "sharded"
    code, out, err = run_cli("inspect", str(sharded))
    assert code == 0 and "dcp-safetensors" in out and "world size: 4" in out, out + err
    code, out, err = run_cli("diff", str(sharded), str(titan_hf_save))
    assert code == 0 and "same:" in out, out + err
    want = hfs.torch_hf_read(sharded)
    reader = DCPSafetensorsReader(sharded)
    import numpy as np
    from formats.dtypes import by_name

    for key, entry in reader.index().tensors.items():
        whole = np.zeros(entry.shape, dtype=by_name(entry.dtype).numpy_dtype)
        for c in entry.chunks:
            buf = np.empty(c.box.sizes, dtype=whole.dtype)
            reader.read_region_into(key, c, c.box, memoryview(buf.reshape(-1).view(np.uint8)))
            whole[c.box.slices()] = buf
        assert whole.tobytes() == to_storage_array(want[key]).tobytes(), key


def test_consolidate_is_torchtitans_own_consolidation(titan_hf_save, tmp_path):
    code, _, err = run_cli("consolidate", str(titan_hf_save / "sharded"), str(tmp_path / "out"))
    assert code == 0, err
    names = sorted(p.name for p in titan_hf_save.glob("model*"))
    assert names == sorted(p.name for p in (tmp_path / "out").glob("model*"))
    for name in names:
        assert (tmp_path / "out" / name).read_bytes() == (titan_hf_save / name).read_bytes(), name


def test_torchtitan_initial_hf_load_of_our_per_rank_output(titan_hf_save, tmp_path):
    """torchtitan loads ckptconv's per-rank files for dp2 through its own HF path; the first step's
    loss equals the one after loading its own consolidated save on dp2, bit for bit."""
    target = "dp2"
    out = tmp_path / "ours"
    code, _, err = run_cli("from-universal", str(titan_hf_save / "sharded"), str(out), "--mesh", target,
                           "--format", "dcp-safetensors")
    assert code == 0, err
    losses = {}
    for name, path in (("ours", out), ("theirs", titan_hf_save)):
        work = tmp_path / f"run-{name}"
        reports = titan_support.run_job({"mesh": target, "dump": str(work), "steps": 1, "save_interval": None,
                                         "initial_load_hf": str(path)}, work)
        assert all(r.get("loaded") for r in reports), reports
        losses[name] = reports[0]["losses"]
    assert losses["ours"] == losses["theirs"], losses
    json.dumps(losses)
