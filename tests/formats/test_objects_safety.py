"""Non-tensor entries are copied as checked bytes, on every path that writes one.

- Never laundered: a pickle naming a global outside the weights-only + plain-data allowlist
  (``posix.system``) is refused without ``--trust-pickle`` by to-universal, from-universal (from a
  DCP checkpoint and from a store) and the store's ``dcp.load`` reader, found by reading the
  opcodes (``pickletools.genops``), never by running them. A damaged archive (CRC-32, broken zip
  records) is refused on the same paths, also with ``--trust-pickle``.
- Copying never needs the entry's class: a ``__main__.MyState`` entry converts with
  ``--trust-pickle`` (bytes verbatim), and torch, where the class exists, loads the result.
- Messages are one line and never cut in the middle of a word.

Checkpoints are real ``dcp.save`` outputs; the payloads are ``touch MARKER`` and every test
asserts the marker never appears.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from cli_runner import run_cli
from pickle_support import saved_bytes as _saved, two_faced, with_pickle as _with_pickle
from converter.api import to_universal
from formats.errors import CorruptCheckpointError, UnsafePickleError, clip
from formats.objects import SAFE_GLOBAL_NAMES, check_object_bytes
from formats.pickle_scan import WEIGHTS_ONLY_GLOBALS, scan_globals
from formats.universal_dcp import UniversalStorageReader

REPO = Path(__file__).resolve().parents[2]


class Evil:
    """Pickles into ``os.system("touch MARKER")`` (``posix.system`` on Linux)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Protocol4Planner(DefaultSavePlanner):
    """dcp.save's own planner, but non-tensor entries pickled with protocol 4 (STACK_GLOBAL and
    memoized module/name strings instead of GLOBAL)."""

    def transform_object(self, write_item, object):  # noqa: A002 - torch's signature
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(object, buf, pickle_protocol=4)
            return buf
        return super().transform_object(write_item, object)


def _save(sd: dict, path: Path, planner=None) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=path, planner=planner)
    return path


def _one_line_error(code: int, err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ckptconv: error: "), (code, err)
    assert "Traceback" not in err and "internal error" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------ the static scan


def test_allowlist_table_is_torchs_weights_only_list():
    """The static table is torch's own weights-only list (never wider), and every extra name is a
    plain-data class of formats.objects."""
    from torch._weights_only_unpickler import _get_allowed_globals

    torch_names = set(_get_allowed_globals())
    assert WEIGHTS_ONLY_GLOBALS <= torch_names
    if torch.__version__.startswith("2.13"):
        assert WEIGHTS_ONLY_GLOBALS == torch_names
    assert not {n for n in SAFE_GLOBAL_NAMES if n.split(".")[0] in ("os", "posix", "subprocess", "builtins")
                and n not in ("builtins.bytearray", "builtins.complex", "builtins.set", "builtins.frozenset",
                              "builtins.range", "builtins.slice")}


def _marker(tmp_path: Path) -> Path:
    return tmp_path / "marker-objfuzz"


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_scan_finds_the_global_of_every_protocol(tmp_path, protocol):
    data = pickle.dumps(Evil(_marker(tmp_path)), protocol=protocol)
    assert "posix.system" in scan_globals(data).globals
    archive = _with_pickle(_saved({"lr": 0.1}), data)
    with pytest.raises(UnsafePickleError, match=r"key: .*posix\.system.*not run.*--trust-pickle"):
        check_object_bytes(archive, "f: key", trust_pickle=False)
    check_object_bytes(archive, "f: key", trust_pickle=True)  # trusted: the bytes pass, nothing runs
    assert not _marker(tmp_path).exists()


def _stack_global(prelude: bytes) -> bytes:
    return b"\x80\x04" + prelude + b"\x93" + b"\x8c\x0ctouch /dev/0\x85R."  # STACK_GLOBAL, (arg,), REDUCE


@pytest.mark.parametrize("pickled, verdict", [
    (_stack_global(b"\x8c\x05posix\x94\x8c\x06system\x94"), "posix.system"),  # memoized strings
    (b"\x80\x04\x8c\x05posix\x94\x8c\x06system\x94N0h\x00h\x01\x93N\x85R.", "posix.system"),  # names from the memo
    (_stack_global(b"\x8c\x05posix\x8c\x06system]0"), "computed"),  # names not directly below: opaque
    (b"\x80\x02\x82\x01N\x85R.", "extension"),  # EXT1: copyreg's extension registry
    (b"(S'touch /dev/0'\nios\nsystem\n.", "os.system"),  # protocol 0 INST
    (b"\x80\x02c__builtin__\neval\nq\x00.", "builtins.eval"),  # Python 2 names mapped as the unpickler does
])
def test_scan_hard_cases(pickled, verdict):
    archive = _with_pickle(_saved({"lr": 0.1}), pickled)
    with pytest.raises(UnsafePickleError) as e:
        check_object_bytes(archive, "f: key 'k'")
    assert verdict in str(e.value) and "\n" not in str(e.value)


def test_scan_accepts_what_torch_saves():
    for value in ({"lr": 0.1}, torch.arange(4), {1, 2}, torch.nn.Parameter(torch.ones(2)), io.BytesIO(b"x"),
                  torch.ones(2, dtype=torch.bfloat16), torch.Size([2, 3]), torch.device("cpu")):
        for protocol in (2, 4):
            check_object_bytes(_saved(value, protocol), "k")


@pytest.mark.parametrize("damage", ["crc", "local-header", "central-directory", "central-size", "pickle", "truncated"])
def test_damaged_archives_are_corrupt_even_when_trusted(damage):
    data = bytearray(_saved({"lr": 0.1, "betas": (0.9, 0.95)}))
    if damage == "crc":
        data[data.index(b"betas")] ^= 1
    elif damage == "local-header":
        data[data.index(b"PK\x03\x04", 10)] ^= 1  # the second member's local header
    elif damage == "central-directory":
        data[data.index(b"PK\x01\x02")] ^= 1
    elif damage == "central-size":  # Python's zipfile reads it, torch's miniz refuses it (found by the fuzz corpus)
        at = data.rindex(b"PK\x01\x02") + 20
        data[at:at + 4] = (2**31 - 1).to_bytes(4, "little")
    elif damage == "pickle":  # well-formed zip, CRC matching, pickle cut short
        data = bytearray(_with_pickle(bytes(data), pickle.dumps({"lr": 0.1}, protocol=2)[:-3]))
    else:
        data = data[: len(data) - 30]
    for trust in (False, True):
        with pytest.raises(CorruptCheckpointError) as e:
            check_object_bytes(bytes(data), "f: key 'k'", trust)
        assert "key 'k'" in str(e.value) and "\n" not in str(e.value)


def _torch_data_pkl(data: bytes) -> bytes:
    """The data.pkl torch's own reader (miniz) finds in a torch.save archive, read without running it."""
    return torch._C.PyTorchFileReader(io.BytesIO(data)).get_record("data.pkl")


def _two_faced_entry(marker: Path) -> bytes:
    """A non-tensor entry whose zip shows Python's zipfile a plain dict and torch an os.system call."""
    data = two_faced(_saved({"step": 1, "x": 0}), _saved({"step": 2, "x": Evil(marker)}))
    assert "posix.system" in scan_globals(_torch_data_pkl(data)).globals  # what torch.load would run
    return data


def test_zip_with_two_central_directories_is_refused(tmp_path):
    """The end record's directory offset must be where Python's zipfile reads the directory: else
    torch's reader (which follows the offset) unpickles another data.pkl than the one scanned."""
    data = _two_faced_entry(_marker(tmp_path))
    for trust in (False, True):
        with pytest.raises(CorruptCheckpointError) as e:
            check_object_bytes(data, "f: key 'k'", trust)
        assert "key 'k'" in str(e.value) and "\n" not in str(e.value)
    assert not _marker(tmp_path).exists()


class TwoFacedPlanner(DefaultSavePlanner):
    """dcp.save's planner writing one non-tensor entry as :func:`_two_faced_entry` bytes."""

    def __init__(self, marker: Path) -> None:
        super().__init__()
        self.marker = marker

    def transform_object(self, write_item, object):  # noqa: A002 - torch's signature
        if write_item.type == WriteItemType.BYTE_IO and write_item.index.fqn == "extra.state":
            return io.BytesIO(_two_faced_entry(self.marker))
        return super().transform_object(write_item, object)


def test_two_faced_entry_in_a_real_checkpoint_is_never_copied(tmp_path):
    marker = _marker(tmp_path)
    ckpt = _save({"model": {"w": torch.ones(4, 3)}, "extra": {"state": "s", "lr": 0.1}}, tmp_path / "ckpt",
                 TwoFacedPlanner(marker))
    for args in (("to-universal", ckpt, tmp_path / "u"), ("from-universal", ckpt, tmp_path / "d", "--mesh", "dp2")):
        code, out, err = run_cli(*map(str, args))
        _one_line_error(code, err, "extra.state")
    assert not (tmp_path / "u").exists() and not (tmp_path / "d").exists()
    assert not marker.exists()


# ------------------------------------------------------------------------------ real checkpoints


@pytest.fixture(params=["protocol2", "protocol4"])
def hostile_ckpt(request, tmp_path) -> tuple[Path, Path]:
    marker = _marker(tmp_path)
    planner = Protocol4Planner() if request.param == "protocol4" else None
    sd = {"model": {"w": torch.ones(4, 3)}, "extra": {"payload": Evil(marker), "lr": 0.1}}
    return _save(sd, tmp_path / "ckpt", planner), marker


def test_hostile_entry_is_refused_on_every_writing_path(hostile_ckpt, tmp_path):
    ckpt, marker = hostile_ckpt
    for args in (("to-universal", ckpt, tmp_path / "u"),
                 ("from-universal", ckpt, tmp_path / "d", "--mesh", "dp2")):
        code, out, err = run_cli(*map(str, args))
        _one_line_error(code, err, "extra.payload", "posix.system", "--trust-pickle")
    assert not (tmp_path / "d").exists()
    # a store holding it (made with trust: bytes copied verbatim, never run)
    code, out, err = run_cli("to-universal", str(ckpt), str(tmp_path / "trusted"), "--trust-pickle")
    assert code == 0, err
    code, out, err = run_cli("from-universal", str(tmp_path / "trusted"), str(tmp_path / "d2"), "--mesh", "dp2")
    _one_line_error(code, err, "extra.payload", "posix.system")
    # torch's own dcp.load through the store reader: refused before torch's planner unpickles it
    sd = {"model": {"w": torch.zeros(4, 3)}, "extra": {"payload": None, "lr": 0.0}}
    with warnings.catch_warnings(), pytest.raises(BaseException) as e:  # CheckpointException is one
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=UniversalStorageReader(tmp_path / "trusted"))
    assert "posix.system" in str(e.value)
    # with trust the bytes are copied as they are (still never run here)
    code, out, err = run_cli("from-universal", str(tmp_path / "trusted"), str(tmp_path / "d3"), "--mesh", "dp2",
                             "--trust-pickle")
    assert code == 0, err
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["crc", "central-directory"])
def test_damaged_entry_in_a_real_checkpoint_is_never_copied(tmp_path, damage):
    ckpt = _save({"model": {"w": torch.ones(4)}, "extra": {"tag": "marker-value", "lr": 0.5}}, tmp_path / "ckpt")
    (f,) = [f for f in ckpt.glob("*.distcp") if b"marker-value" in f.read_bytes()]
    raw = bytearray(f.read_bytes())
    start = raw.rindex(b"PK\x03\x04", 0, raw.index(b"marker-value"))
    if damage == "crc":
        raw[raw.index(b"marker-value")] ^= 1
    else:
        raw[raw.index(b"PK\x01\x02", start)] ^= 1
    f.write_bytes(bytes(raw))
    for i, trust in enumerate(((), ("--trust-pickle",))):
        u, d = tmp_path / f"u{i}", tmp_path / f"d{i}"
        for args in (("to-universal", ckpt, u), ("from-universal", ckpt, d, "--mesh", "dp2")):
            code, out, err = run_cli(*map(str, args), *trust)
            _one_line_error(code, err, "extra.tag", "damaged non-tensor entry")
        assert not d.exists() and not u.exists()  # refused before the destination is touched


# ------------------------------------------------------------------------------ user classes


USER_CLASS = textwrap.dedent("""
    import sys, warnings
    import torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    class MyState:
        def __init__(self, step, tag):
            self.step, self.tag = step, tag

    warnings.simplefilter("ignore")
    if sys.argv[1] == "save":
        dcp.save({"model": {"w": torch.arange(12.0).view(4, 3)},
                  "extra": {"state": MyState(5, "a long tag with several words in it"), "lr": 0.1}},
                 checkpoint_id=sys.argv[2])
    else:
        dcp_to_torch_save(sys.argv[2], sys.argv[3])
        got = torch.load(sys.argv[3], weights_only=False)
        s = got["extra"]["state"]
        assert type(s).__name__ == "MyState" and (s.step, s.tag) == (5, "a long tag with several words in it"), vars(s)
        assert got["extra"]["lr"] == 0.1 and torch.equal(got["model"]["w"], torch.arange(12.0).view(4, 3))
""")


def _user_class(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", USER_CLASS, *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_user_class_entry_is_copied_without_its_class(tmp_path):
    ckpt = tmp_path / "ckpt"
    _user_class("save", str(ckpt))
    code, out, err = run_cli("to-universal", str(ckpt), str(tmp_path / "refused"))
    _one_line_error(code, err, "extra.state", "__main__.MyState", "--trust-pickle")
    code, out, err = run_cli("to-universal", str(ckpt), str(tmp_path / "uni"), "--trust-pickle")
    assert code == 0, err
    code, out, err = run_cli("from-universal", str(tmp_path / "uni"), str(tmp_path / "dcp"), "--mesh", "dp2",
                             "--trust-pickle")
    assert code == 0, err
    code, out, err = run_cli("from-universal", str(ckpt), str(tmp_path / "dcp2"), "--mesh", "dp2", "--trust-pickle")
    assert code == 0, err
    code, out, err = run_cli("inspect", str(tmp_path / "uni"), "--trust-pickle")
    assert code == 0 and "MyState" not in err, err
    for out_dir in ("dcp", "dcp2"):  # torch, where the class exists, reads what was written
        _user_class("load", str(tmp_path / out_dir), str(tmp_path / f"{out_dir}.pt"))


def test_clip_cuts_at_word_boundaries():
    text = "Can't get attribute 'MyState' on <module '__main__' from '/some/long/path/to/a/script.py'> and more"
    for limit in range(20, len(text) + 5):
        got = clip(text, limit)
        assert len(got) <= limit
        if got != text:
            assert got.endswith("...")
            kept = got[:-3]
            assert text.startswith(kept) and (text[len(kept)] == " " or len(kept.split()) == 1 or kept == "")
    assert clip("x" * 50, 10) == "x" * 7 + "..."


def test_store_reader_loads_0d_tensors_and_objects(tmp_path):
    """Found by the fuzz corpus: torch's dcp.load through UniversalStorageReader (which checks each
    chunk's xxh3 as it reads it) got a 1-d array for a 0-d tensor."""
    ckpt = _save({"s": torch.tensor(1.5), "v": torch.arange(3.0), "extra": {"lr": 0.25}}, tmp_path / "ckpt")
    to_universal(ckpt, tmp_path / "u")
    sd = {"s": torch.tensor(0.0), "v": torch.zeros(3), "extra": {"lr": 0.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=UniversalStorageReader(tmp_path / "u"))
    assert sd["s"].item() == 1.5 and torch.equal(sd["v"], torch.arange(3.0)) and sd["extra"]["lr"] == 0.25
