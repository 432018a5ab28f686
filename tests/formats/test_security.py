"""Hostile inputs: pickles never run without --trust-pickle, keys never name files, symlinks in
the destination are never followed out of it.

- ``.metadata`` is always unpickled through the allowlist (even with --trust-pickle); non-tensor
  entries load with torch's weights-only unpickler, and ``--trust-pickle`` is the only way to run
  their pickle code.
- Tensor keys such as ``../evil``, ``/abs/path``, ``a/../../b`` or keys with NUL and control
  characters are saved by torch's own ``dcp.save``; every conversion writes only inside its
  destination (the whole temp root is listed before and after), and torch reads the results.
- Paths recorded inside checkpoints (DCP ``relative_path``, universal array and object paths, HF
  index file names) cannot point outside the checkpoint.
- A destination holding symlinks out of it is refused, or (``--overwrite``) the links are
  removed, never written through.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo

from converter.api import diff, export_hf, from_universal, import_hf, to_universal, verify
from converter.config import RunOptions
from converter.run.sources import open_checkpoint
from formats.errors import CkptConvError, DestinationError, UnsafePickleError
from oracle import bits_equal, torch_reference

HOSTILE_KEYS = ["../evil", "/abs/ckptconv-evil", "a/../../b", "nul\x00key", "ctl\x01\x1b[2Jkey", "..", ".",
                "tensors/../../x", "line\nbreak", "~", "c:\\x", "__0_0.distcp", ".metadata", "ckptconv.json",
                "objects/../../y"]


class Evil:
    """Pickles into ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def quiet_save(sd: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        dcp.save(sd, checkpoint_id=path)
    return path


def listing(root: Path) -> set[str]:
    """Every path under ``root`` (links not followed)."""
    return {os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files}


def assert_inside(dst: Path) -> None:
    """Every file of ``dst`` really lies inside it (no symlink leads out)."""
    real = dst.resolve()
    for d, dirs, files in os.walk(dst):
        for n in dirs + files:
            p = Path(d, n)
            assert not p.is_symlink(), p
            assert real in p.resolve().parents, p


# ------------------------------------------------------------------------------------------------
# pickles


def test_metadata_pickle_never_runs_even_with_trust_pickle(tmp_path):
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    marker = tmp_path / "MARKER"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    for trust in (False, True):
        with pytest.raises(UnsafePickleError, match=r"\.metadata.*system"):
            to_universal(ckpt, tmp_path / f"u{trust}", RunOptions(trust_pickle=trust))
        with pytest.raises(UnsafePickleError):
            open_checkpoint(ckpt, trust_pickle=trust)
    report = verify(ckpt, trust_pickle=True)
    assert not report.ok and "not on the allowlist" in report.problems[0].message
    assert not marker.exists()


@pytest.fixture()
def evil_object_ckpt(tmp_path) -> tuple[Path, Path]:
    marker = tmp_path / "MARKER"
    return quiet_save({"model": {"w": torch.ones(4)}, "extra": {"payload": Evil(marker)}}, tmp_path / "ckpt"), marker


def test_bytes_entries_run_only_with_trust_pickle(evil_object_ckpt, tmp_path):
    ckpt, marker = evil_object_ckpt
    with pytest.raises(UnsafePickleError, match="extra.payload.*--trust-pickle"):
        to_universal(ckpt, tmp_path / "u")
    report = verify(ckpt)
    assert report.ok and any("extra.payload" in w for w in report.warnings)
    # never laundered: torch's dcp.load of a copy would run it (its planner unpickles bytes freely)
    with pytest.raises(UnsafePickleError, match="extra.payload.*posix.system.*--trust-pickle"):
        from_universal(ckpt, tmp_path / "dp2", "dp2")
    assert not (tmp_path / "dp2" / ".metadata").exists()
    # --trust-pickle copies the bytes verbatim without running them (copying needs no classes)
    from_universal(ckpt, tmp_path / "dp2t", "dp2", options=RunOptions(trust_pickle=True))
    to_universal(ckpt, tmp_path / "trusted", RunOptions(trust_pickle=True))
    assert diff(ckpt, tmp_path / "dp2t").same
    assert not marker.exists()
    # the one documented way to run it: load the value with trust
    open_checkpoint(tmp_path / "trusted").load_object("extra.payload", trust_pickle=True)
    assert marker.exists()


def test_universal_object_is_never_loaded_without_trust(tmp_path):
    """A store whose object file was swapped for a malicious pickle (checksum updated to match)."""
    src = quiet_save({"model": {"w": torch.ones(4)}, "extra": {"step": 1}}, tmp_path / "ckpt")
    to_universal(src, tmp_path / "u")
    marker = tmp_path / "MARKER"
    buf = io.BytesIO()
    torch.save(Evil(marker), buf)
    meta = json.loads((tmp_path / "u" / "ckptconv.json").read_text())
    obj = meta["objects"]["extra.step"]
    (tmp_path / "u" / obj["file"]).write_bytes(buf.getvalue())
    obj.update(nbytes=len(buf.getvalue()), checksum=xxhash.xxh3_64_hexdigest(buf.getvalue()))
    (tmp_path / "u" / "ckptconv.json").write_text(json.dumps(meta))
    report = verify(tmp_path / "u")
    assert report.ok and any("extra.step" in w and "--trust-pickle" in w for w in report.warnings)
    with pytest.raises(UnsafePickleError, match="extra.step"):
        from_universal(tmp_path / "u", tmp_path / "out", "dp2")
    with pytest.raises(UnsafePickleError):
        open_checkpoint(tmp_path / "u").load_object("extra.step")
    assert not diff(src, tmp_path / "u").same
    assert not marker.exists()


def test_trust_pickle_is_documented():
    from click.testing import CliRunner

    from converter.cli import cli

    for cmd in ("to-universal", "from-universal", "export-hf", "inspect", "verify", "diff"):
        text = " ".join(CliRunner().invoke(cli, [cmd, "--help"]).output.split())
        assert "--trust-pickle" in text and ("pickle code" in text or "arbitrary classes" in text), cmd


# ------------------------------------------------------------------------------------------------
# hostile keys


@pytest.fixture()
def hostile(tmp_path) -> Path:
    sd = {k: torch.full((3, 2), float(i)) for i, k in enumerate(HOSTILE_KEYS)}
    sd["extra"] = {"../obj": 5, "/abs/obj": "x", "nul\x00obj": [1]}
    return quiet_save(sd, tmp_path / "src")


def test_hostile_keys_never_name_files(hostile, tmp_path):
    before = listing(tmp_path)
    to_universal(hostile, tmp_path / "uni")
    from_universal(tmp_path / "uni", tmp_path / "dp2", "dp2")
    export_hf(hostile, tmp_path / "hf", max_shard_size=30)
    import_hf(tmp_path / "hf", tmp_path / "uni2")
    outputs = ("uni", "dp2", "hf", "uni2")
    assert {p for p in listing(tmp_path) - before if p.split(os.sep)[0] not in outputs} == set()
    for out in outputs:
        assert_inside(tmp_path / out)
    assert not Path("/abs/ckptconv-evil").exists() and not (tmp_path.parent / "evil").exists()
    # every key survives: torch reads the reshard with the same keys and values as the source
    want, got = torch_reference(hostile), torch_reference(tmp_path / "dp2")
    assert got.keys() == want.keys()
    assert all(bits_equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())
    assert diff(hostile, tmp_path / "uni").same and diff(tmp_path / "uni", tmp_path / "uni2", model_only=True).same
    for out in outputs:
        assert verify(tmp_path / out).ok


def test_hostile_names_in_safetensors(tmp_path):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({k: torch.ones(2) * i for i, k in enumerate(HOSTILE_KEYS)}, str(hf / "model.safetensors"))
    before = listing(tmp_path)
    import_hf(hf, tmp_path / "uni")
    from_universal(tmp_path / "uni", tmp_path / "dcp", "dp2")
    assert {p for p in listing(tmp_path) - before if p.split(os.sep)[0] not in ("uni", "dcp")} == set()
    assert_inside(tmp_path / "uni")
    assert diff(hf, tmp_path / "dcp").same


# ------------------------------------------------------------------------------------------------
# paths recorded inside checkpoints


@pytest.mark.parametrize("path", ["../outside.distcp", "/etc/hostname", "sub/../../outside.distcp"])
def test_dcp_storage_paths_cannot_escape(tmp_path, path):
    ckpt = quiet_save({"w": torch.ones(4)}, tmp_path / "ckpt")
    shutil.copy(next(ckpt.glob("*.distcp")), tmp_path / "outside.distcp")
    md = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: trusted
    for index, info in md.storage_data.items():
        md.storage_data[index] = _StorageInfo(path, info.offset, info.length)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CkptConvError, match="outside the checkpoint"):
        open_checkpoint(ckpt)
    assert not verify(ckpt).ok


@pytest.mark.parametrize("field", ["array", "object"])
@pytest.mark.parametrize("path", ["../../outside", "/etc", "tensors/../../outside", "objects/../../outside"])
def test_universal_paths_cannot_escape(tmp_path, field, path):
    src = quiet_save({"w": torch.ones(4), "extra": {"s": 1}}, tmp_path / "ckpt")
    to_universal(src, tmp_path / "u")
    meta = json.loads((tmp_path / "u" / "ckptconv.json").read_text())
    if field == "array":
        meta["tensors"]["w"]["array"] = path
    else:
        meta["objects"]["extra.s"]["file"] = path
    (tmp_path / "u" / "ckptconv.json").write_text(json.dumps(meta))
    with pytest.raises(CkptConvError, match="outside"):
        open_checkpoint(tmp_path / "u")
    assert not verify(tmp_path / "u").ok


@pytest.mark.parametrize("path", ["../outside.safetensors", "/etc/hostname", "a/../../outside.safetensors"])
def test_hf_index_paths_cannot_escape(tmp_path, path):
    src = quiet_save({"model": {"w": torch.ones(4), "v": torch.zeros(2)}}, tmp_path / "ckpt")
    export_hf(src, tmp_path / "hf", max_shard_size=10)
    shutil.copy(next((tmp_path / "hf").glob("*.safetensors")), tmp_path / "outside.safetensors")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["w"] = path
    index.write_text(json.dumps(doc))
    with pytest.raises(CkptConvError, match="refusing|outside"):
        open_checkpoint(tmp_path / "hf")
    assert not verify(tmp_path / "hf").ok


# ------------------------------------------------------------------------------------------------
# symlinks in the destination


def _convert(kind: str, src: Path, uni: Path, dst: Path, options: RunOptions) -> None:
    if kind == "to-universal":
        to_universal(src, dst, options)
    elif kind == "from-universal":
        from_universal(uni, dst, "dp2", options=options)
    else:
        export_hf(src, dst, options=options)


LINKS = {"to-universal": ["tensors", "objects", "ckptconv.json", "zarr.json"],
         "from-universal": ["__0_0.distcp", ".metadata"],
         "export-hf": ["model.safetensors", "model.safetensors.tmp"]}


@pytest.fixture()
def small(tmp_path) -> tuple[Path, Path]:
    src = quiet_save({"model": {"w": torch.randn(8, 4)}, "extra": {"s": 1}}, tmp_path / "src")
    to_universal(src, tmp_path / "uni")
    return src, tmp_path / "uni"


@pytest.mark.parametrize("kind,name", [(k, n) for k, names in LINKS.items() for n in names])
def test_destination_symlinks_are_never_followed(small, tmp_path, kind, name):
    src, uni = small
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    dst = tmp_path / "dst"
    dst.mkdir()
    is_dir = name in ("tensors", "objects")
    (dst / name).symlink_to(outside if is_dir else outside / "victim")
    with pytest.raises(DestinationError, match="not empty"):
        _convert(kind, src, uni, dst, RunOptions())
    if name in ("tensors", "objects", "zarr.json"):  # alone, not a sign of a ckptconv output: kept
        with pytest.raises(DestinationError, match="not a ckptconv output"):
            _convert(kind, src, uni, dst, RunOptions(overwrite=True))
        assert (dst / name).is_symlink()
    elif kind == "from-universal":  # a DCP file without ckptconv's output record: not ours, kept
        with pytest.raises(DestinationError, match="did not write"):
            _convert(kind, src, uni, dst, RunOptions(overwrite=True))
        assert (dst / name).is_symlink()
    else:
        _convert(kind, src, uni, dst, RunOptions(overwrite=True))  # the link is removed, not followed
        assert_inside(dst)
        assert verify(dst).ok
    assert listing(outside) == {"victim"} and (outside / "victim").read_bytes() == b"precious"


def _interrupted(kind: str, src: Path, uni: Path, dst: Path, monkeypatch) -> None:
    """Leave ``dst`` as an interrupted run would: data written and journaled, nothing published."""
    from formats.hf import HFWriter
    from formats.universal import UniversalWriter

    monkeypatch.setenv("CKPTCONV_JOURNAL_FLUSH_SECONDS", "0")
    cls = UniversalWriter if kind == "to-universal" else HFWriter
    with monkeypatch.context() as m:
        m.setattr(cls, "commit", lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError, match="killed"):
            _convert(kind, src, uni, dst, RunOptions())


@pytest.mark.parametrize("kind", ["to-universal", "export-hf"])
def test_resume_does_not_follow_symlinks(small, tmp_path, monkeypatch, kind):
    src, uni = small
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    dst = tmp_path / "dst"
    _interrupted(kind, src, uni, dst, monkeypatch)
    if kind == "to-universal":
        shutil.rmtree(dst / "objects")
        (dst / "objects").symlink_to(outside)
    else:
        tmp = next(dst.glob("*.tmp"))
        tmp.unlink()
        tmp.symlink_to(outside / "victim")
    try:
        _convert(kind, src, uni, dst, RunOptions(resume=True))
    except DestinationError:
        pass  # refusing is fine
    assert listing(outside) == {"victim"} and (outside / "victim").read_bytes() == b"precious"


# ------------------------------------------------------------------------------------------------
# framework files (torch.save .pt parsed by formats/torch_file): numpy values


class _Call:
    """Pickles as ``fn(*args)`` (REDUCE), then BUILD with ``state`` when given."""

    def __init__(self, fn, args, state=None) -> None:
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def _numpy_attacks() -> dict:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    recon = core.multiarray._reconstruct

    def array(state):
        return _Call(recon, (np.ndarray, (0,), b"b"), state)

    def dtype(spec, state):
        return _Call(np.dtype, (spec, False, True), state)

    return {
        # 60 bytes of pickle filling 8 GB of None pointers
        "ndarray-call": _Call(np.ndarray, ((10**9,), "O")),
        # numpy reads 10**6 items from a one-item list: a segfault in numpy 2.4
        "object-array-short-list": array((1, (10**6,), np.dtype("O"), False, [1])),
        "void-dtype-negative-size": array((1, (4,), dtype("V8", (3, "|", None, None, None, -5, 1, 0)), False, b"")),
        # an object field over raw bytes, its hasobject flag cleared: pointers the pickle chose
        "object-field-over-bytes": array((1, (1,), dtype("V8", (3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1,
                                                                0)), False, b"A" * 8)),
        "data-shorter-than-shape": array((1, (10**6,), np.dtype("f8"), False, b"\0" * 8)),
        "scalar-of-a-huge-void": _Call(core.multiarray.scalar, (dtype("V100000000", None), b"x")),
    }


_READ_IN_A_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))
from formats.errors import CkptConvError
from formats.torch_file import file_resolver, read_torch_bytes
try:
    read_torch_bytes(open(sys.argv[1], "rb").read(), sys.argv[1], file_resolver())
    print("READ")
except CkptConvError as e:
    print("REFUSED", type(e).__name__, e)
"""


@pytest.mark.parametrize("attack", sorted(_numpy_attacks()))
def test_hostile_numpy_values_in_a_framework_file_are_one_line(tmp_path, attack):
    """numpy's own unpickling trusts the pickle (dtype and array states, direct ndarray calls):
    each crafted value is refused in one line naming the file, in a child process (a crash or an
    8 GB allocation there fails the test, not the run)."""
    import subprocess
    import sys

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"rng_state": [{"np_rng_state": _numpy_attacks()[attack]}]}, path)
    proc = subprocess.run([sys.executable, "-c", _READ_IN_A_CHILD, str(path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    line = proc.stdout.strip()
    assert line.startswith("REFUSED CorruptCheckpointError") and "\n" not in line, line
    assert str(path) in line and "not a plain numpy value" in line, line


def test_numpy_values_of_a_framework_file_read_as_numpy_pickled_them(tmp_path):
    """RNG states, scalars and arrays (big-endian, Fortran order, 0-d, empty, bool, object) read as
    numpy's own unpickling reads them (torch.load of the same file) and write back so."""
    import numpy as np

    from formats.torch_file import file_resolver, read_torch_bytes, torch_save_bytes

    value = {"rng": np.random.RandomState(3).get_state(), "f": np.float64(1.5), "i": np.int32(-7),
             "b": np.bool_(True), "be": np.arange(6, dtype=">i2").reshape(2, 3),
             "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)), "zero_d": np.array(2.5, dtype=np.float16),
             "empty": np.zeros((0, 4), dtype=np.uint8), "mask": np.array([True, False]),
             "obj": np.array([1, "x", None], dtype=object), "c": np.array([1 + 2j], dtype=np.complex64)}
    buf = io.BytesIO()
    torch.save(value, buf)
    got, _ = read_torch_bytes(buf.getvalue(), "f.pt", file_resolver())
    back = torch.load(io.BytesIO(torch_save_bytes(got)), weights_only=False)
    value = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)  # the test's own file: the oracle
    for v in (got, back):
        assert repr(v["rng"][2:]) == repr(value["rng"][2:]) and v["rng"][0] == "MT19937"
        for k, want in value.items():
            arr = v[k][1] if k == "rng" else v[k]
            want = want[1] if k == "rng" else want
            assert np.asarray(arr).dtype == np.asarray(want).dtype, k
            assert np.asarray(arr).tobytes() == np.asarray(want).tobytes() or k == "obj", k
            assert np.asarray(arr).shape == np.asarray(want).shape, k
    assert list(back["obj"]) == [1, "x", None] and back["fortran"].flags.f_contiguous
    assert type(back["be"]) is np.ndarray and type(back["f"]) is np.float64


def test_a_megatron_file_with_a_hostile_numpy_rng_state_is_one_line(tmp_path):
    """Through the command line: Megatron-LM's legacy rank file whose numpy RNG state is an object
    array read past its list (a segfault in numpy's own unpickling) is exit 2, one line naming it."""
    import subprocess
    import sys

    import numpy as np

    legacy = Path(__file__).resolve().parents[1] / "data" / "megatron" / "legacy_tp2_pp2_vpp2" / "legacy"
    ckpt = Path(shutil.copytree(legacy, tmp_path / "legacy"))
    path = ckpt / "iter_0000002" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)  # the test's own fixture
    rng = list(state["rng_state"][0]["np_rng_state"])
    core = getattr(np, "_core", None) or np.core
    rng[1] = _Call(core.multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (10**6,), np.dtype("O"), False, [1]))
    state["rng_state"][0]["np_rng_state"] = tuple(rng)
    torch.save(state, path)
    proc = subprocess.run([sys.executable, "-m", "converter", "inspect", str(ckpt)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (proc.returncode, proc.stderr[-2000:])
    assert "mp_rank_01_001/model_optim_rng.pt" in proc.stderr and "not a plain numpy value" in proc.stderr
