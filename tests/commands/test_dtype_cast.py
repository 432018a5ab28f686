"""``--dtype``: one vocabulary for every command, a torch-free cast bit-equal to torch's ``Tensor.to``,
and many workers in fresh processes (the cast once imported torch from worker threads at once:
``partially initialized module 'torch' has no attribute 'Tensor'``).

The oracle is torch itself: ``Tensor.to`` on random bit patterns (NaN, infinities, subnormals, -0),
``dcp_to_torch_save`` of what ``from-universal`` writes, the safetensors library for ``export-hf``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from cli_runner import run_cli
from converter import api
from converter.config import RunOptions
from formats.dtypes import CAST_ALIASES, cast_bits, cast_dtype
from formats.errors import ConfigError
from oracle import torch_reference

REPO = Path(__file__).resolve().parents[2]
FLOATS = ["float64", "float32", "float16", "bfloat16"]
BITS = {"float64": np.uint64, "float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
SIGNED = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _specials(name: str) -> np.ndarray:
    """Bit patterns of every class of value: +-0, +-inf, quiet/signalling NaNs with payloads,
    smallest/largest subnormals and normals, and values halfway between two bfloat16/float16."""
    if name == "float64":
        raw = [0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000, 0xFFF8000000000001,
               0x7FF0000000000001, 0x7FF123456789ABCD, 1, 0x000FFFFFFFFFFFFF, 0x0010000000000000,
               0x7FEFFFFFFFFFFFFF, 0x3FF0000010000000, 0x3FF0000030000000, 0x47EFFFFFE0000000,
               0x3E70000000000000, 0x3680000000000000, 0x36A0000000000000, 0x3EF0000000000000]
    elif name == "float32":
        raw = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0xFF912345,
               1, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x3F808001, 0x7F7F8000,
               0x477FF000, 0x477FE000, 0x33800000, 0x33000000, 0x387FC000, 0xB3800001]
    elif name == "float16":
        raw = [0, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x7D23, 1, 0x03FF, 0x0400, 0x7BFF, 0x3C01]
    else:
        raw = [0, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7F93, 1, 0x007F, 0x0080, 0x7F7F, 0x3F81]
    return np.array(raw, dtype=BITS[name])


def _random_bits(name: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    kind = BITS[name]
    out = rng.integers(0, np.iinfo(kind).max, size=n, dtype=kind, endpoint=True)
    spec = _specials(name)
    out[: min(n, spec.size)] = spec[: min(n, spec.size)]
    return out


def _torch_cast(bits: np.ndarray, src: str, dst: str) -> tuple[np.ndarray, np.ndarray]:
    """(bits, NaN mask) of torch's own ``.to(dst)`` of the ``src`` bit array ``bits``."""
    t = torch.from_numpy(bits.copy()).view(getattr(torch, src)).to(getattr(torch, dst))
    raw = t.view(SIGNED[t.element_size()]).numpy().view(BITS[dst])
    return raw, torch.isnan(t).numpy()


def _nan_mask(bits: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        return np.isnan((bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32))
    return np.isnan(bits.view(name))


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_cast_is_bit_equal_to_torch(src, dst):
    """Every non-NaN value (infinities, subnormals, -0, ties) gets exactly torch's bits; a NaN stays
    a NaN (torch gives different NaN payloads in its vectorised and scalar lanes, e.g. float16 ->
    float32 0x7fffffff or the quieted payload depending on the position)."""
    for n, seed in ((1, 0), (7, 1), (1029, 2), (70001, 3)):
        bits = _random_bits(src, n, seed)
        want, want_nan = _torch_cast(bits, src, dst)
        got = cast_bits(bits, src, dst).view(BITS[dst])
        assert got.shape == bits.shape
        got_nan = _nan_mask(got, dst)
        assert np.array_equal(got_nan, want_nan), (src, dst, n)
        diff = np.flatnonzero(~want_nan & (got != want))
        assert diff.size == 0, [(hex(int(bits[i])), hex(int(want[i])), hex(int(got[i]))) for i in diff[:5]]


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (2, 3)])
def test_cast_keeps_shape(shape):
    a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    out = cast_bits(a, "float32", "bfloat16")
    assert out.shape == shape and out.dtype == np.uint16
    t = torch.from_numpy(a.copy()).to(torch.bfloat16)
    assert np.array_equal(out, t.view(torch.int16).numpy().view(np.uint16))


def test_cast_needs_no_torch():
    code = ("import sys, numpy as np; from formats.dtypes import cast_bits; "
            "[cast_bits(np.ones(5, np.dtype(s)), a, b) for a, s in (('float32', 'float32'), ('bfloat16', 'uint16'),"
            " ('float16', 'float16'), ('float64', 'float64')) for b in ('float32', 'bfloat16', 'float16', 'float64')]; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO, timeout=120)


# ----------------------------------------------------------------------------- one vocabulary


@pytest.mark.parametrize("text, name", [
    ("bf16", "bfloat16"), ("BF16", "bfloat16"), ("bfloat16", "bfloat16"), ("torch.bfloat16", "bfloat16"),
    ("fp16", "float16"), ("float16", "float16"), ("half", "float16"), ("f16", "float16"),
    ("fp32", "float32"), ("float32", "float32"), ("float", "float32"), ("fp64", "float64"),
    ("float64", "float64"), ("double", "float64"),
])
def test_every_spelling_for_every_command(text, name):
    from converter.commands.export_hf import normalize_dtype

    assert cast_dtype(text) == name == normalize_dtype(text)
    assert CAST_ALIASES[text.lower().removeprefix("torch.")] == name


@pytest.fixture(scope="module")
def special_ckpt(tmp_path_factory) -> Path:
    """A dcp.save'd checkpoint whose floating-point parameters hold every special value."""
    root = tmp_path_factory.mktemp("dtype-cast")
    model = {}
    for i, name in enumerate(FLOATS):
        bits = _random_bits(name, 4097, 10 + i).reshape(17, 241)
        model[f"w_{name}"] = torch.from_numpy(bits.copy()).view(getattr(torch, name))
    model["ids"] = torch.arange(12, dtype=torch.int64).view(3, 4)
    model["fp8"] = torch.arange(16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    state = {"model": model, "optim": {"state": {"w_float32": {"exp_avg": model["w_float32"].clone()}}},
             "extra": {"step": 7}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=root / "dcp")
    api.to_universal(root / "dcp", root / "uni", RunOptions(workers=2), chunk_bytes=4096)
    return root


@pytest.mark.parametrize("command", ["from-universal", "export-hf"])
@pytest.mark.parametrize("value", ["int8", "float8_e4m3fn", "float99", "bits"])
def test_bad_dtype_same_message_everywhere(special_ckpt, tmp_path, command, value):
    mesh = ("--mesh", "dp2") if command == "from-universal" else ()
    code, out, err = run_cli(command, str(special_ckpt / "uni"), str(tmp_path / "out"), *mesh, "--dtype", value)
    assert code == 2, err
    with pytest.raises(ConfigError) as e:
        cast_dtype(value)
    assert err.strip() == f"ckptconv: error: {e.value}"
    assert "floating-point" in err and "bf16 (bfloat16)" in err and value in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["from-universal", "export-hf"])
def test_every_command_accepts_the_same_spellings(special_ckpt, tmp_path, command):
    """Every spelling of CAST_ALIASES (and its torch./upper-case forms) is accepted by every
    command with --dtype, and every spelling of one dtype plans the same bytes (the dry run's line)."""
    mesh = ("--mesh", "dp2") if command == "from-universal" else ()
    planned: dict[str, set[str]] = {}
    for text, name in sorted(CAST_ALIASES.items()):
        for spelling in {text, text.upper(), f"torch.{name}"}:
            code, out, err = run_cli(command, str(special_ckpt / "uni"), str(tmp_path / "out"), *mesh,
                                     "--dtype", spelling, "--dry-run")
            assert code == 0, (spelling, err)
            planned.setdefault(name, set()).add(out.strip().splitlines()[-1])
    assert all(len(lines) == 1 for lines in planned.values()), planned
    assert set(planned) == {"bfloat16", "float16", "float32", "float64"}
    assert not (tmp_path / "out").exists()


def _ckptconv(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "converter", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


def _assert_cast_of(got: torch.Tensor, source: torch.Tensor, key: str) -> None:
    want = source.to(got.dtype)
    assert got.shape == want.shape, key
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), key
    bits = SIGNED[got.element_size()]
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits)), key


def test_from_universal_dtype_many_workers_repeated(special_ckpt, tmp_path):
    """--dtype with 8 workers, 5 fresh processes: exit 0 every time, no temp files, the same bytes,
    and every parameter is torch's cast of the source (optimizer states and int/fp8 kept)."""
    source = torch_reference(special_ckpt / "dcp")
    first = None
    for i in range(5):
        out = tmp_path / f"out{i}"
        proc = _ckptconv("from-universal", str(special_ckpt / "uni"), str(out), "--mesh", "dp2",
                         "--dtype", "bfloat16", "--workers", "8")
        assert proc.returncode == 0 and "error" not in proc.stderr, proc.stderr
        assert not list(out.rglob("*.tmp"))
        files = {p.name: p.read_bytes() for p in sorted(out.glob("*.distcp"))}
        first = first or files
        assert files == first
    got = torch_reference(tmp_path / "out0")
    assert set(got) == set(source)
    for key, want in source.items():
        if key.startswith("model.w_"):
            assert got[key].dtype == torch.bfloat16
            _assert_cast_of(got[key], want, key)
        elif isinstance(want, torch.Tensor):
            assert got[key].dtype == want.dtype and torch.equal(got[key].view(torch.uint8), want.view(torch.uint8)), key
        else:
            assert got[key] == want, key


@pytest.mark.parametrize("alias", ["bf16", "fp16"])
def test_export_hf_dtype_many_workers_repeated(special_ckpt, tmp_path, alias):
    from safetensors import safe_open

    def read(path: Path) -> dict[str, torch.Tensor]:
        out = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
        return out

    plain = tmp_path / "plain"
    api.export_hf(special_ckpt / "uni", plain, key_map="identity", options=RunOptions(workers=2))
    source = read(plain)
    target = getattr(torch, cast_dtype(alias))
    first = None
    for i in range(5):
        out = tmp_path / f"hf{i}"
        proc = _ckptconv("export-hf", str(special_ckpt / "uni"), str(out), "--map", "identity", "--dtype", alias,
                         "--workers", "8")
        assert proc.returncode == 0 and "error" not in proc.stderr, proc.stderr
        assert not list(out.rglob("*.tmp"))
        files = {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}
        first = first or files
        assert files == first
    got = read(tmp_path / "hf0")
    assert set(got) == set(source)
    for key, want in source.items():
        if want.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            assert got[key].dtype == target, key
            _assert_cast_of(got[key], want, key)
        else:
            assert got[key].dtype == want.dtype and torch.equal(got[key].view(torch.uint8), want.view(torch.uint8))
