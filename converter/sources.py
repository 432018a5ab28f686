"""Open any supported checkpoint by sniffing its directory: DCP, universal store, HF safetensors."""

from __future__ import annotations

import os
from pathlib import Path

from formats.base import CheckpointReader
from formats.errors import CheckpointNotFoundError, InvalidCheckpointError


def detect_format(path: str | os.PathLike) -> str:
    """"dcp", "universal" or "hf"; a clear error for anything else."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"{p}: no such file or directory; check the path")
    if not p.is_dir():
        raise InvalidCheckpointError(f"{p}: is a file; pass the checkpoint directory (the one holding .metadata)")
    from formats.universal import is_universal_store

    if is_universal_store(p):
        return "universal"
    from formats.dcp import is_dcp_checkpoint

    if is_dcp_checkpoint(p):
        return "dcp"
    if any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").exists():
        return "hf"
    if not any(p.iterdir()):
        raise InvalidCheckpointError(f"{p}: directory is empty; pass a DCP checkpoint directory (with .metadata)")
    raise InvalidCheckpointError(
        f"{p}: not a checkpoint ckptconv knows (no .metadata, ckptconv.json or *.safetensors); "
        "pass a DCP directory, a universal store or a Hugging Face directory"
    )


def open_checkpoint(path: str | os.PathLike, trust_pickle: bool = False) -> CheckpointReader:
    """A reader for the checkpoint at ``path``, whatever its format."""
    fmt = detect_format(path)
    if fmt == "universal":
        from formats.universal import UniversalReader

        return UniversalReader(path)
    if fmt == "dcp":
        from formats.dcp import DCPReader

        return DCPReader(path, trust_pickle=trust_pickle)
    from formats.hf import HFReader  # type: ignore[import-not-found]

    return HFReader(path)
