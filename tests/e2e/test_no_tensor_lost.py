"""No tensor silently lost (issue 25, point 5): the two corrupted inputs of an outside fuzz corpus
that converted with exit 0 while a tensor went missing, and the check every conversion makes of
its output against its plan before the output is published.

- A universal store whose ``ckptconv.json`` names one array for two keys: ``from-universal``
  wrote one key with the other's shape and ``export-hf`` dropped ``attention_norm.weight``; the
  store is now refused on open, in one line naming the file and both keys.
- A DCP ``.metadata`` whose planner path for ``model.norm.weight`` is huge (or names another
  object): ``export-hf`` filed the key under another object and dropped ``norm.weight``; such a
  path is now refused on open (``dcp.save`` names every key by its path joined with ``'.'``).
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from cli_runner import run_cli
from converter import api
from converter.config import RunOptions


def _one_error_line(code: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ckptconv: error: "), (code, err[-2000:])
    assert "internal error" not in lines[0] and len(lines[0]) < 1000, lines[0][:2000]
    return lines[0]


@pytest.fixture(scope="module")
def stores(dcp_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """The real 4-rank FSDP2 fixture as a universal store, zarr and safetensors backends."""
    root = tmp_path_factory.mktemp("lost")
    src = dcp_checkpoint("fsdp4")
    api.to_universal(src, root / "zarr", RunOptions(workers=2))
    api.to_universal(src, root / "safetensors", RunOptions(workers=2), backend="safetensors")
    return {"zarr": root / "zarr", "safetensors": root / "safetensors"}


A, B = "model.layers.0.attention_norm.weight", "model.layers.0.attention.wk.weight"
FFN = "model.layers.0.ffn_norm.weight"  # A's shape


def _shared(store: Path, dst: Path, how: str) -> Path:
    """A copy of ``store`` whose record of ``A`` names ``B``'s array: the whole record copied (the
    corpus input: A then reads with B's shape and B's object path) or only its ``array`` field
    (and the backend's ``files``)."""
    shutil.copytree(store, dst)
    meta = json.loads((dst / "ckptconv.json").read_text())
    tensors = meta["tensors"]
    if how == "record":  # (a safetensors-backend record keeps A's tensor name: the file check is not this one)
        tensors[A] = dict(json.loads(json.dumps(tensors[B])), **({"tensor": A} if "tensor" in tensors[A] else {}))
    else:
        tensors[A]["array"] = tensors[B]["array"]
        if "files" in tensors[A]:  # safetensors backend: B's chunk files (A keeps its tensor name)
            tensors[A]["files"] = dict(tensors[B]["files"])
        tensors[A]["checksums"] = dict(tensors[B]["checksums"])
        tensors[A]["shape"], tensors[A]["chunk_shape"] = tensors[B]["shape"], tensors[B]["chunk_shape"]
    (dst / "ckptconv.json").write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize("backend", ["zarr", "safetensors"])
@pytest.mark.parametrize("how", ["record", "array"])
def test_a_store_naming_one_array_for_two_keys_is_refused(stores, tmp_path, backend, how):
    bad = _shared(stores[backend], tmp_path / "bad", how)
    for args in (["from-universal", str(bad), str(tmp_path / "dcp"), "--mesh", "dp2"],
                 ["export-hf", str(bad), str(tmp_path / "hf")], ["inspect", str(bad)]):
        line = _one_error_line(*run_cli(*args)[::2])
        assert "ckptconv.json" in line and repr(A) in line and repr(B) in line and "both name the array" in line
    assert not (tmp_path / "dcp").exists() and not (tmp_path / "hf").exists()
    assert run_cli("verify", str(bad))[0] == 1  # verify reports it as a problem of the store


def test_a_store_naming_one_object_file_for_two_keys_is_refused(stores, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(stores["zarr"], bad)
    meta = json.loads((bad / "ckptconv.json").read_text())
    objects = meta["objects"]
    first, second = sorted(objects)[:2]
    objects[second] = dict(objects[first], path=objects[second]["path"])
    (bad / "ckptconv.json").write_text(json.dumps(meta))
    line = _one_error_line(*run_cli("from-universal", str(bad), str(tmp_path / "dcp"), "--mesh", "dp2")[::2])
    assert repr(first) in line and repr(second) in line and "object file" in line


def test_the_pristine_store_exports_every_weight(stores, tmp_path):
    """The control: the same store unedited exports ``attention_norm.weight`` and ``norm.weight``."""
    code, _, err = run_cli("export-hf", str(stores["zarr"]), str(tmp_path / "hf"))
    assert code == 0, err
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"layers.0.attention_norm.weight", "norm.weight"} <= names and len(names) == 21


NORM = "model.norm.weight"
BAD_PATHS = {
    "huge-path": ("model",) * 100_000 + ("norm", "weight"),  # the corpus input: 100k parts
    "huge-name": ("model", "n" * (1 << 20)),
    "other-object": ("optim", "norm.weight"),  # another root: not a model weight any more
    "other-key": ("model", "layers.0.attention_norm.weight"),
    "int-part": ("model", 10**30),
}


@pytest.mark.parametrize("name", sorted(BAD_PATHS))
def test_a_planner_path_that_does_not_name_its_key_is_refused(dcp_checkpoint_copy, tmp_path, name):
    src = dcp_checkpoint_copy("fsdp4")
    md = pickle.loads((src / ".metadata").read_bytes())  # the fixture's own .metadata, in a test
    assert md.planner_data[NORM] == ("model", "norm.weight")
    md.planner_data[NORM] = BAD_PATHS[name]
    (src / ".metadata").write_bytes(pickle.dumps(md))
    for args in (["export-hf", str(src), str(tmp_path / "hf")], ["to-universal", str(src), str(tmp_path / "uni")],
                 ["from-universal", str(src), str(tmp_path / "dcp"), "--mesh", "dp2"], ["inspect", str(src)]):
        line = _one_error_line(*run_cli(*args)[::2])
        assert ".metadata" in line and repr(NORM) in line and "planner data" in line, line
    assert not any((tmp_path / d).exists() for d in ("hf", "uni", "dcp"))


def test_the_pristine_dcp_exports_norm_weight(dcp_checkpoint, tmp_path):
    code, _, err = run_cli("export-hf", str(dcp_checkpoint("fsdp4")), str(tmp_path / "hf"))
    assert code == 0, err
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert "norm.weight" in set(f.keys())


# ---------------------------------------------------------------------------------------------
# every conversion checks its output against its plan before publishing it


def _fails_the_output_check(fn, needle: str, marker: Path) -> str:
    from formats.errors import InternalError

    with pytest.raises(InternalError) as e:
        fn()
    text = str(e.value)
    assert text.startswith("internal error: ") and "not its plan" in text and needle in text, text
    assert "\n" not in text and "nothing was published" in text
    assert not marker.exists()
    return text


@pytest.fixture
def dcp_writer_drops_norm(monkeypatch) -> None:
    """Planted: the DCP writer builds ``.metadata`` without ``model.norm.weight`` (as a filter over
    planner_data would)."""
    from formats.dcp.writer import DCPWriter

    real = DCPWriter._stand_in_metadata

    def drops_norm(self, save_id=None):
        md = real(self, save_id)
        md.__dict__["state_dict_metadata"].pop(NORM)
        return md

    monkeypatch.setattr(DCPWriter, "_stand_in_metadata", drops_norm)


def test_a_dcp_writer_that_drops_a_key_publishes_nothing(stores, tmp_path, dcp_writer_drops_norm):
    dst = tmp_path / "dcp"
    _fails_the_output_check(lambda: api.from_universal(stores["zarr"], dst, "dp2"), f"planned tensor {NORM!r}",
                            dst / ".metadata")


def test_a_dcp_writer_that_lays_two_chunks_over_one_another_publishes_nothing(stores, tmp_path, monkeypatch):
    """Planted: one chunk's storage entry pointing at another key's bytes."""
    from formats.dcp.writer import DCPWriter

    real = DCPWriter._stand_in_metadata

    def overlapping(self, save_id=None):
        md = real(self, save_id)
        storage = md.__dict__["storage_data"]
        (ia, a), (ib, b) = [(i, v) for i, v in storage.items() if i.fqn in (A, B)][:2]
        b.__dict__.update(relative_path=a.relative_path, offset=a.offset)
        return md

    monkeypatch.setattr(DCPWriter, "_stand_in_metadata", overlapping)
    dst = tmp_path / "dcp"
    _fails_the_output_check(lambda: api.from_universal(stores["zarr"], dst, "dp2"), "share bytes", dst / ".metadata")


@pytest.mark.parametrize("backend", ["zarr", "safetensors"])
def test_a_store_planned_with_one_array_for_two_keys_publishes_nothing(dcp_checkpoint, tmp_path, monkeypatch, backend):
    """Planted: the store's plan names one array for two keys of one shape (the second key's
    chunk files would replace the first's): the writer refuses the plan before writing, in the
    output check's words (it used to write both, two tasks on the same chunk files at once, and
    sometimes one task's rename failed first with an I/O error instead)."""
    import dataclasses

    from converter.commands import to_universal as cmd

    real = cmd.plan_universal

    def same_array(tensors, chunk_bytes, backend="zarr"):
        store = real(tensors, chunk_bytes, backend)
        arrays = dict(store.arrays)
        arrays[A] = dataclasses.replace(arrays[A], array=arrays[FFN].array)
        return dataclasses.replace(store, arrays=arrays)

    monkeypatch.setattr(cmd, "plan_universal", same_array)
    dst = tmp_path / "uni"
    _fails_the_output_check(lambda: api.to_universal(dcp_checkpoint("fsdp4"), dst, backend=backend),
                            "are both stored in", dst / "ckptconv.json")


def test_an_hf_header_with_a_wrong_shape_publishes_nothing(stores, tmp_path, monkeypatch):
    """Planted: the header of the export's file records one tensor with another shape."""
    import formats.hf as hf

    real = hf.build_header

    def wrong_shape(specs, metadata):
        specs = [hf.TensorSpec(s.name, s.dtype, (*s.shape[:-1], s.shape[-1] // 2, 2)) if s.name == "norm.weight" else s
                 for s in specs]
        return real(specs, metadata)

    monkeypatch.setattr(hf, "build_header", wrong_shape)
    dst = tmp_path / "hf"
    text = _fails_the_output_check(lambda: api.export_hf(stores["zarr"], dst), "'norm.weight' is recorded as",
                                   dst / "model.safetensors")
    assert "[16, 2]" in text and "planned as float32 [32]" in text


def test_a_deepspeed_export_with_wrong_model_states_publishes_nothing(tmp_path, monkeypatch):
    """Planted: the parameter shapes export-ds writes into the model-states files are not its
    atoms' (DeepSpeed's loader reshapes by them)."""
    import dataclasses

    from converter.commands import export_ds as cmd
    from ds_support import import_ds, universal_of

    import_ds(universal_of(2), tmp_path / "uni")
    real = cmd.plan_export_ds

    def wrong_shapes(*args, **kw):
        plan = real(*args, **kw)
        fqn = next(iter(plan.shapes))
        return dataclasses.replace(plan, shapes={**plan.shapes, fqn: (1, *plan.shapes[fqn])})

    monkeypatch.setattr(cmd, "plan_export_ds", wrong_shapes)
    dst = tmp_path / "ds"
    _fails_the_output_check(lambda: cmd.export_ds(tmp_path / "uni", dst), "the model states give it shape",
                            dst / "latest_universal")


def test_an_output_check_failure_is_one_line_with_status_3(stores, tmp_path, dcp_writer_drops_norm):
    code, _, err = run_cli("from-universal", str(stores["zarr"]), str(tmp_path / "dcp"), "--mesh", "dp2")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 3 and len(lines) == 1 and lines[0].startswith("ckptconv: internal error: "), err
    assert repr(NORM) in lines[0] and not (tmp_path / "dcp" / ".metadata").exists()
