"""``from-universal --format megatron-legacy``: Megatron-LM's legacy checkpoint written for a target
layout (fast: the checked-in fixture of ``tests/formats/test_megatron_legacy.py``).

The fixture's ``legacy/`` is what Megatron-LM's ``save_checkpoint`` writes for the run (TP2 x PP2 x
VPP2); converting its store, its torch_dist twin or itself back to that layout must give the very
values Megatron wrote (oracle: ``torch.load`` of both). Megatron's own legacy load of conversions to
other layouts is in ``tests/e2e/test_megatron_legacy_e2e.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from oracle import bits_equal

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "megatron" / "legacy_tp2_pp2_vpp2"
LEGACY, DIST = FIXTURE / "legacy", FIXTURE / "torch_dist"
#: What a torch_dist save of the run does not hold (the test harness saved none of it there).
NOT_IN_TORCH_DIST = ("args", "rng_state", "opt_param_scheduler", "num_floating_point_operations_so_far")


def _files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*.pt"))


def _same(a, b, where: str, problems: list[str]) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not bits_equal(a, b):
            problems.append(where)
    elif isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):  # the same keys in the same order (state_dict order)
            problems.append(f"{where}: keys {list(a)[:4]} vs {list(b)[:4]}")
        for k in a.keys() & b.keys():
            _same(a[k], b[k], f"{where}/{k}", problems)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]", problems)
    elif repr(a) != repr(b):
        problems.append(f"{where}: {repr(a)[:80]} != {repr(b)[:80]}")


def _compare(want_root: Path, got_root: Path, skip: tuple[str, ...] = ()) -> None:
    assert _files(got_root) == _files(want_root)
    problems: list[str] = []
    for rel in _files(want_root):
        want = torch.load(want_root / rel, weights_only=False)  # our fixture: torch's reading, as oracle
        got = torch.load(got_root / rel, weights_only=False)
        if isinstance(want, dict):
            for k in skip:
                want.pop(k, None)
                got.pop(k, None)
        _same(want, got, str(rel), problems)
    assert not problems, problems[:8]
    assert (got_root / "latest_checkpointed_iteration.txt").read_text() == "2"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("legacy_target") / "store"
    code, _, err = run_cli("to-universal", str(LEGACY), str(out))
    assert code == 0, err
    return out


def test_the_store_back_to_the_saved_layout_is_what_megatron_wrote(store, tmp_path):
    """Every file, key (in state-dict order), tensor, RNG state, scheduler, param group and arg
    (args.rank: the folder's writer) equal to Megatron-LM's own save of the run."""
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(store), str(out), "--mesh", "tp2,pp2", "--vpp", "2",
                           "--format", "megatron-legacy")
    assert code == 0, err
    _compare(LEGACY, out)
    code, text, _ = run_cli("verify", str(out))
    assert code == 0 and text.startswith("ok:"), text


def test_torch_dist_to_legacy_gives_megatrons_legacy_tensors(tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(DIST), str(out), "--mesh", "tp2,pp2", "--vpp", "2",
                           "--format", "megatron-legacy", "--megatron-names", "local")
    assert code == 0, err
    _compare(LEGACY, out, NOT_IN_TORCH_DIST)


def test_another_layout_holds_the_same_tensors(store, tmp_path):
    """TP2 x PP2 x VPP2 -> PP2 (TP1, DP2): each stage's file holds its two layers whole; read back
    (a legacy source itself), every tensor equals the original's."""
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(store), str(out), "--mesh", "pp2,dp2", "--format", "megatron-legacy")
    assert code == 0, err
    assert "Megatron-LM loads it with --no-load-rng" in err
    names = [str(p) for p in _files(out)]
    assert names == ["iter_0000002/mp_rank_00_000/distrib_optim.pt", "iter_0000002/mp_rank_00_000/model_optim_rng.pt",
                     "iter_0000002/mp_rank_00_001/distrib_optim.pt", "iter_0000002/mp_rank_00_001/model_optim_rng.pt"]
    first = torch.load(out / names[1], weights_only=False)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in first["model"] and "rng_state" not in first
    assert first["args"].pipeline_model_parallel_size == 2 and first["args"].tensor_model_parallel_size == 1
    code, text, err = run_cli("diff", str(out), str(LEGACY))
    assert "36 of 36 common tensors bitwise equal" in text, text + err


def test_dry_run_lists_the_files(store, tmp_path):
    code, text, err = run_cli("from-universal", str(store), str(tmp_path / "out"), "--mesh", "tp2", "--format",
                              "megatron-legacy", "--dry-run")
    assert code == 0, err
    assert "iter_0000002/mp_rank_01/model_optim_rng.pt" in text and "distrib_optim.pt" in text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,message", [
    (["--mesh", "pp3", "--format", "megatron-legacy"], "4 layers do not split evenly"),
    (["--mesh", "tp2,cp2", "--format", "megatron-legacy"], "takes tp, pp, dp and ep"),
    (["--mesh", "tp2", "--vpp", "2"], "add --format megatron-legacy"),
    # Megatron-LM's legacy folders mp_rank_<tp>[_<pp>][_<ep>] have no expert TP rank
    (["--mesh", "tp2,etp1", "--format", "megatron-legacy"], "named by the dense TP and the EP rank"),
])
def test_refused_before_any_io(store, tmp_path, args, message):
    code, _, err = run_cli("from-universal", str(store), str(tmp_path / "out"), *args)
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()


def test_overwrite_replaces_only_its_own_output(store, tmp_path):
    out = tmp_path / "out"
    for extra in ([], ["--overwrite"]):
        code, _, err = run_cli("from-universal", str(store), str(out), "--mesh", "tp2", "--format",
                               "megatron-legacy", *extra)
        assert code == 0, err
    code, _, err = run_cli("from-universal", str(store), str(out), "--mesh", "tp2", "--format", "megatron-legacy")
    assert code == 2 and "already holds a complete Megatron legacy checkpoint" in err
    (out / "iter_0000002" / "notes.txt").write_text("mine")
    code, _, err = run_cli("from-universal", str(store), str(out), "--mesh", "tp2", "--format", "megatron-legacy",
                           "--overwrite")
    assert code == 2 and "not a ckptconv output (found iter_0000002/)" in err, err
    assert (out / "iter_0000002" / "notes.txt").read_text() == "mine"
    code, _, err = run_cli("from-universal", str(store), str(LEGACY), "--mesh", "tp2", "--format", "megatron-legacy",
                           "--overwrite", "--dry-run")
    assert code == 0  # (a dry run touches nothing)


def test_tasks_and_crcs_survive_torchrun_style_adoption(store, tmp_path):
    """Each task's range CRC-32 (what other ranks journal) adopted again leaves the archives sound."""
    from formats.dcp.archive_writer import TorchFileWriter
    from formats.torch_file import SlotTensor, plan_value
    import os

    slot = SlotTensor("float32", (40,))
    pkl, storages = plan_value({"x": slot, "n": 3})
    fd = os.open(tmp_path / "f.pt", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        w = TorchFileWriter(fd, 0, pkl, storages)
        os.ftruncate(fd, w.size)
        data = torch.arange(30, dtype=torch.float32).numpy()
        crc = w.write(slot.storage, 40, data)
        w.add_crc(slot.storage, 40, data.nbytes, crc)  # the same range again: accounted once
        with pytest.raises(Exception, match="overlap"):
            w.add_crc(slot.storage, 0, 60, crc)
        w.close()
    finally:
        os.close(fd)
    got = torch.load(tmp_path / "f.pt")
    assert torch.equal(got["x"][10:], torch.arange(30, dtype=torch.float32)) and not got["x"][:10].any()
    code, text, _ = run_cli("verify", str(LEGACY))  # (the reader's CRC check of a whole file)
    assert code == 0 and json.dumps(text)
