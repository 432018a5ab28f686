"""import-ds and export-ds on the checked-in DeepSpeed fixtures (no DeepSpeed needed).

The fixtures (tests/data/deepspeed/, made by real DeepSpeed 0.19.8 ZeRO-2 / ZeRO-3 runs of 2 ranks
and DeepSpeed's ``ds_to_universal.py``; rebuild with ``make_fixtures.py`` there) carry the engine's
live full state (``live.pt``, read with DeepSpeed's ``safe_get_full_*``): the oracle, with torch's
own reading of DCP outputs (``dcp_to_torch_save``) and ``torch.load`` of exported files. The
engine's own loads are in tests/e2e/test_deepspeed.py.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from ds_support import assert_atoms_equal, assert_matches_live, export_ds, import_ds, live_of, universal_of
from oracle import bits_equal, torch_reference

STAGES = (2, 3)


@pytest.mark.parametrize("stage", STAGES)
def test_import_ds_to_dcp_equals_deepspeed_live_state(stage: int, tmp_path: Path) -> None:
    """DeepSpeed ZeRO-2/3 universal -> import-ds -> from-universal (dp2 DCP), read by torch."""
    from converter.commands.from_universal import from_universal

    result = import_ds(universal_of(stage), tmp_path / "uni")
    assert result.tensors == 12 * 4 and result.objects == 12
    from_universal(tmp_path / "uni", tmp_path / "dcp", mesh="dp2")
    assert_matches_live(torch_reference(tmp_path / "dcp"), live_of(stage))


def test_import_ds_follows_latestuniversal_of(tmp_path: Path) -> None:
    """The folder holding ``latest_universal`` works as the source, like DeepSpeed's load_dir."""
    shutil.copytree(universal_of(3), tmp_path / "run" / "step3_universal")
    (tmp_path / "run" / "latest_universal").write_text("step3_universal")
    result = import_ds(tmp_path / "run", tmp_path / "uni")
    assert result.tensors == 48


@pytest.mark.parametrize("stage", STAGES)
def test_export_ds_writes_deepspeeds_own_files(stage: int, tmp_path: Path) -> None:
    """DeepSpeed universal -> store -> export-ds: every atom torch.loads to DeepSpeed's own
    tensors (ZeRO-3's flat atoms come back as the parameter's shape), and the small files hold
    what the universal loaders read."""
    import_ds(universal_of(stage), tmp_path / "uni")
    result = export_ds(tmp_path / "uni", tmp_path / "ds")
    out = tmp_path / "ds"
    tag = (out / "latest_universal").read_text()
    assert tag == "global_step3" and result.tensors == 12 * 4
    shapes = torch.load(universal_of(stage) / next(p.name for p in universal_of(stage).glob("*model_states.pt")),
                        weights_only=False)["param_shapes"][0]
    for atom in sorted((universal_of(stage) / "zero").glob("*/*.pt")):
        rel = atom.relative_to(universal_of(stage))
        want = torch.load(atom, weights_only=True)
        got = torch.load(out / tag / rel, weights_only=True)
        if atom.name == "step.pt":
            assert bits_equal(got, want)
            continue
        want = want["param"] if isinstance(want, dict) else want
        assert got["cat_dim"] == 0 and tuple(got["param"].shape) == tuple(shapes[rel.parent.name])
        assert bits_equal(got["param"].reshape(-1), want.reshape(-1)), rel
    opt = torch.load(out / tag / "zero" / "optimizer_state.pt", weights_only=True)
    live = live_of(stage)
    assert bits_equal(opt["optimizer_state_dict"]["state"][0]["step"], live["step"])
    assert {k: v for k, v in opt["param_groups"][0].items() if k != "params"} == live["param_groups"][0]
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        ms = torch.load(out / tag / name, weights_only=True)
        assert list(ms["param_shapes"][0]) == list(shapes) and ms["global_steps"] == 3


def test_export_ds_atoms_are_torch_save_bytes(tmp_path: Path) -> None:
    """A streamed atom is byte-identical to torch.save of the same dict, for every float dtype."""
    from formats.deepspeed import AtomWriter

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(7, 5).to(dtype)
        w = AtomWriter(tmp_path / f"{dtype}.pt", str(dtype).split(".")[1], t.shape)
        w.write(t[:3].contiguous())
        w.write(t[3:].contiguous())
        w.close()
        buf = io.BytesIO()
        torch.save({"param": t, "cat_dim": 0}, buf)
        assert (tmp_path / f"{dtype}.pt").read_bytes() == buf.getvalue()


def test_export_ds_from_fsdp2_store_keeps_bits(dcp_checkpoint, tmp_path: Path) -> None:
    """FSDP2 DCP -> to-universal -> export-ds: atoms equal torch's reading of the DCP (bf16 kept)."""
    from converter.commands.to_universal import to_universal as to_uni

    to_uni(dcp_checkpoint("bf16_fsdp2"), tmp_path / "uni")
    export_ds(tmp_path / "uni", tmp_path / "ds", tag="t")
    assert_atoms_equal(tmp_path / "ds" / "t", torch_reference(dcp_checkpoint("bf16_fsdp2")))


def test_deepspeed_dir_is_a_source_everywhere(tmp_path: Path) -> None:
    """inspect, verify, diff and to-universal read a DeepSpeed universal checkpoint too; a flipped
    byte in an atom is caught by its zip CRC-32 (verify reports it, import-ds refuses it)."""
    from cli_runner import run_cli

    src = tmp_path / "u"
    shutil.copytree(universal_of(2), src)
    code, out, _ = run_cli("inspect", str(src))
    assert code == 0 and "optim.state.norm.weight.exp_avg_sq" in out
    code, out, _ = run_cli("verify", str(src))
    assert code == 0 and out.startswith("ok:") and "(deepspeed)" in out
    assert run_cli("to-universal", str(src), str(tmp_path / "uni"))[0] == 0
    import_ds(src, tmp_path / "uni2")
    code, out, _ = run_cli("diff", str(src), str(tmp_path / "uni2"))
    assert code == 0 and "same: 48 of 48" in out
    atom = src / "zero" / "norm.weight" / "exp_avg.pt"
    data = bytearray(atom.read_bytes())
    raw = torch.load(atom, weights_only=True)["param"].numpy().tobytes()
    data[data.find(raw) + 5] ^= 0x01  # one bit of the tensor's bytes
    torch.load(io.BytesIO(bytes(data)), weights_only=True)  # torch itself does not notice
    atom.write_bytes(bytes(data))
    code, out, _ = run_cli("verify", str(src))
    assert code != 0 and "norm.weight" in out and "CRC" in out
    code, _, err = run_cli("import-ds", str(src), str(tmp_path / "uni3"))
    assert code == 2 and "CRC-32 mismatch" in err and "exp_avg.pt" in err and len(err.strip().splitlines()) == 1


def test_deepspeed_classes_are_never_run(tmp_path: Path) -> None:
    """optimizer_state.pt naming a global outside the allowlist is refused in one line naming the
    file; DeepSpeed's own classes are read as inert data (DeepSpeed not imported)."""
    from formats.errors import UnsafePickleError

    src = tmp_path / "u"
    shutil.copytree(universal_of(2), src)
    path = src / "zero" / "optimizer_state.pt"
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        members = {n: z.read(n) for n in names}
    pkl = next(n for n in names if n.endswith("data.pkl"))
    assert b"deepspeed.runtime.fp16.loss_scaler" in members[pkl]
    members[pkl] = pickle.dumps({"ds_version": "0.19.8", "param_groups": [], "x": os.system}, protocol=2)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n in names:
            z.writestr(n, members[n])
    with pytest.raises(UnsafePickleError, match=r"optimizer_state\.pt.*posix\.system.*not on the allowlist"):
        import_ds(src, tmp_path / "uni")
    assert not (tmp_path / "uni").exists()


def test_import_ds_errors_name_file_and_fix(tmp_path: Path) -> None:
    from formats.deepspeed import DeepSpeedReader
    from formats.errors import CkptConvError as CheckpointError

    with pytest.raises(CheckpointError, match="no such DeepSpeed universal checkpoint"):
        import_ds(tmp_path / "missing", tmp_path / "uni")
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match="ds_to_universal"):
        import_ds(tmp_path / "plain", tmp_path / "uni")
    src = tmp_path / "u"
    shutil.copytree(universal_of(3), src)
    (src / "zero" / "norm.weight" / "fp32.pt").unlink()
    with pytest.raises(CheckpointError, match=r"norm\.weight.*no fp32\.pt.*rerun ds_to_universal"):
        import_ds(src, tmp_path / "uni2")
    src = tmp_path / "u2"
    shutil.copytree(universal_of(3), src)
    (tmp_path / "outside").mkdir()
    shutil.move(src / "zero" / "output.weight", tmp_path / "outside" / "w")
    (src / "zero" / "output.weight").symlink_to(tmp_path / "outside" / "w")
    with pytest.raises(CheckpointError, match=r"output\.weight.*resolves outside the checkpoint directory"):
        DeepSpeedReader(src)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_ds_dry_run_resume_overwrite(tmp_path: Path, monkeypatch) -> None:
    """--dry-run writes nothing; a run stopped before publishing resumes to the same bytes as a
    fresh run; a complete output is refused without --overwrite and replaced with it; a DeepSpeed
    checkpoint ckptconv did not write is never deleted."""
    from converter.commands import export_ds as mod
    from converter.config import RunOptions
    from formats.errors import DestinationError

    monkeypatch.setenv("CKPTCONV_JOURNAL_FLUSH_SECONDS", "0")
    import_ds(universal_of(3), tmp_path / "uni")
    dry = export_ds(tmp_path / "uni", tmp_path / "dry", options=RunOptions(dry_run=True))
    assert not (tmp_path / "dry").exists() and "global_step3/zero/norm.weight/fp32.pt" in dry.plan
    export_ds(tmp_path / "uni", tmp_path / "fresh")
    with monkeypatch.context() as m:
        m.setattr(mod, "optimizer_state_bytes", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt, match="--resume"):
            export_ds(tmp_path / "uni", tmp_path / "out", options=RunOptions(workers=2))
    assert not (tmp_path / "out" / "latest_universal").exists()
    with pytest.raises(DestinationError, match="--resume"):
        export_ds(tmp_path / "uni", tmp_path / "out")
    export_ds(tmp_path / "uni", tmp_path / "out", options=RunOptions(resume=True))
    assert _tree(tmp_path / "out") == _tree(tmp_path / "fresh")
    with pytest.raises(DestinationError, match="complete DeepSpeed universal checkpoint.*--overwrite"):
        export_ds(tmp_path / "uni", tmp_path / "out")
    export_ds(tmp_path / "uni", tmp_path / "out", options=RunOptions(overwrite=True), tag="other")
    assert (tmp_path / "out" / "latest_universal").read_text() == "other"
    assert not (tmp_path / "out" / "global_step3").exists()
    theirs = tmp_path / "theirs"
    shutil.copytree(universal_of(3), theirs / "step3")
    (theirs / "latest_universal").write_text("step3")
    before = _tree(theirs)
    with pytest.raises(DestinationError, match="not a ckptconv output"):
        export_ds(tmp_path / "uni", theirs, options=RunOptions(overwrite=True))
    assert _tree(theirs) == before


def test_import_ds_resumes(tmp_path: Path, monkeypatch) -> None:
    """import-ds stopped before its commit resumes to the same store as a fresh run."""
    from converter.config import RunOptions
    from formats.universal import UniversalWriter

    monkeypatch.setenv("CKPTCONV_JOURNAL_FLUSH_SECONDS", "0")
    import_ds(universal_of(2), tmp_path / "fresh")
    with monkeypatch.context() as m:
        m.setattr(UniversalWriter, "commit", lambda self, *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt, match="--resume"):
            import_ds(universal_of(2), tmp_path / "out")
    from converter.commands.import_ds import import_ds as run

    run(universal_of(2), tmp_path / "out", options=RunOptions(resume=True))
    fresh, out = _tree(tmp_path / "fresh"), _tree(tmp_path / "out")
    assert fresh.keys() == out.keys()
    assert all(fresh[k] == out[k] for k in fresh if k != "ckptconv.json")


def test_import_ds_restores_tied_weights(tmp_path: Path) -> None:
    """A tied weight DeepSpeed saved once (``shared_params`` of the model states: alias -> owner)
    comes back under both names, as the model's state dict has it."""
    from formats.deepspeed import DeepSpeedReader

    src = tmp_path / "u"
    shutil.copytree(universal_of(3), src)
    shutil.rmtree(src / "zero" / "output.weight")
    for ms_file in src.glob("*model_states.pt"):
        ms = torch.load(ms_file, weights_only=False)
        ms["param_shapes"][0].pop("output.weight")
        ms["shared_params"] = {"output.weight": "tok_embeddings.weight"}
        torch.save(ms, ms_file)
    index = DeepSpeedReader(src).index()
    assert "model.output.weight" in index.tensors and "optim.state.output.weight.exp_avg" not in index.tensors
    import_ds(src, tmp_path / "uni")
    from converter.commands.from_universal import from_universal

    from_universal(tmp_path / "uni", tmp_path / "dcp", mesh="dp2")
    ref = torch_reference(tmp_path / "dcp")
    assert bits_equal(ref["model.output.weight"], ref["model.tok_embeddings.weight"])


@pytest.mark.parametrize("stage", STAGES)
def test_export_ds_output_is_an_import_ds_source(stage: int, tmp_path: Path) -> None:
    """import-ds reads what export-ds wrote: its model states are torch.save protocol 2, which
    names ``set`` as Python 2's ``__builtin__.set`` (the allowlist maps such names as pickle's
    fix_imports does); DeepSpeed -> store -> DeepSpeed -> store -> DCP equals the live state."""
    from converter.commands.from_universal import from_universal

    import_ds(universal_of(stage), tmp_path / "uni")
    export_ds(tmp_path / "uni", tmp_path / "ds", tag="t")
    import_ds(tmp_path / "ds", tmp_path / "uni2")
    from_universal(tmp_path / "uni2", tmp_path / "dcp", mesh="dp2")
    assert_matches_live(torch_reference(tmp_path / "dcp"), live_of(stage))


def test_import_ds_backend_safetensors_from_the_cli(tmp_path: Path) -> None:
    """``ckptconv import-ds --backend safetensors``: a safetensors-backed store whose DCP (via
    from-universal) is what torch reads from the zarr-backed one, byte for byte."""
    from cli_runner import run_cli

    for backend in ("zarr", "safetensors"):
        code, out, err = run_cli("import-ds", str(universal_of(3)), str(tmp_path / backend), "--backend", backend)
        assert code == 0, err
        code, out, err = run_cli("from-universal", str(tmp_path / backend), str(tmp_path / f"dcp-{backend}"),
                                  "--mesh", "dp2")
        assert code == 0, err
    assert list((tmp_path / "safetensors").rglob("*.safetensors")) and not list((tmp_path / "zarr").rglob("*.safetensors"))
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert (tmp_path / "dcp-zarr" / name).read_bytes() == (tmp_path / "dcp-safetensors" / name).read_bytes()
    assert_matches_live(torch_reference(tmp_path / "dcp-safetensors"), live_of(3))


@pytest.mark.parametrize("tag", ["x" * 5000, "a\0b"])
def test_import_ds_refuses_an_impossible_latest_universal_tag(tag: str, tmp_path: Path) -> None:
    """A ``latest_universal`` naming no possible folder (longer than a file name may be, a NUL) is
    refused as damaged in one short line naming the file, not reported as an I/O error to resume."""
    from formats.errors import CorruptCheckpointError

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest_universal").write_text(tag)
    with pytest.raises(CorruptCheckpointError, match="latest_universal: names .*not a tag folder") as err:
        import_ds(tmp_path / "run", tmp_path / "uni")
    assert len(str(err.value)) < 400


def test_export_ds_dry_run_reports_the_runs_warnings(dcp_checkpoint, tmp_path: Path) -> None:
    """export-ds --dry-run (on the one pipeline) returns the warnings the run gives, e.g. a source
    without Adam states (DeepSpeed's ZeRO-3 loader needs them), and writes nothing."""
    from converter.api import to_universal
    from converter.config import RunOptions
    from converter.plan.selection import Selection

    to_universal(dcp_checkpoint("fsdp4"), tmp_path / "uni", selection=Selection(model_only=True))
    dry = export_ds(tmp_path / "uni", tmp_path / "dry", options=RunOptions(dry_run=True))
    assert dry.warnings and not (tmp_path / "dry").exists()
    run = export_ds(tmp_path / "uni", tmp_path / "out")
    assert run.warnings == dry.warnings and run.bytes == dry.bytes and run.tensors == dry.tensors
