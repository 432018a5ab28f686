"""The conversion commands run without importing torch (issue #5: ~2 s of every run was the import).

Each command runs in a fresh interpreter where importing ``torch`` raises ImportError, so a
command that needed torch anywhere on its path would fail. The outputs are then checked
against torch's own reading of the source (``dcp_to_torch_save``), in this process.
Commands that really need torch (``--dtype`` casts, ``inspect --stats``, ``diff``, objects that
hold tensors or numpy, ``--trust-pickle``) import it lazily and are not covered here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oracle import assert_same_value, torch_reference

#: Runs ``ckptconv ARGS`` with torch unimportable; exit status is the command's.
_RUNNER = textwrap.dedent(
    """
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch imported on a torch-free path: {name}")
            return None

    sys.meta_path.insert(0, _NoTorch())
    from converter.cli import main
    main(sys.argv[1:])
    """
)


def ckptconv_without_torch(*args: str) -> subprocess.CompletedProcess:
    """``ckptconv ARGS`` in a fresh interpreter that cannot import torch (``--debug`` on)."""
    proc = subprocess.run([sys.executable, "-c", _RUNNER, "--debug", *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    assert "torch imported on a torch-free path" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _assert_same_as_source(source: Path, converted: Path) -> None:
    want, got = torch_reference(source), torch_reference(converted)
    assert set(got) == set(want)
    for key, value in want.items():
        assert_same_value(got[key], value, key)


@pytest.mark.parametrize("kind", ["tp2dp2", "special_dtypes"])
def test_to_universal_and_back_without_torch(dcp_checkpoint, tmp_path, kind):
    src = dcp_checkpoint(kind)
    ckptconv_without_torch("to-universal", src, tmp_path / "uni")
    ckptconv_without_torch("inspect", tmp_path / "uni")
    ckptconv_without_torch("verify", tmp_path / "uni")
    ckptconv_without_torch("from-universal", tmp_path / "uni", "--mesh", "dp3", tmp_path / "dp3")
    _assert_same_as_source(src, tmp_path / "dp3")


def test_reshard_and_hf_without_torch(dcp_checkpoint, tmp_path):
    src = dcp_checkpoint("fsdp4")
    ckptconv_without_torch("inspect", src)
    ckptconv_without_torch("from-universal", src, "--mesh", "tp2,dp2", "--plan", "llama", tmp_path / "tp")
    _assert_same_as_source(src, tmp_path / "tp")
    config = json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2})  # tests/support/models.py's model
    ckptconv_without_torch("export-hf", src, tmp_path / "hf", "--map", "torchtitan-llama", "--config", config)
    ckptconv_without_torch("import-hf", tmp_path / "hf", tmp_path / "back", "--map", "torchtitan-llama")
    ckptconv_without_torch("export-hf", tmp_path / "back", tmp_path / "hf2", "--map", "torchtitan-llama",
                           "--config", config)
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):  # the round trip is byte-identical
        assert (tmp_path / "hf2" / f.name).read_bytes() == f.read_bytes()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())
