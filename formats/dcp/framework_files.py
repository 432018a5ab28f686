"""Files a training framework keeps beside DCP's own (``.metadata``, ``__<r>_0.distcp``).

Megatron-core's ``dist_checkpointing`` (torch_dist backend) writes ``metadata.json``
(``{"sharded_backend": "torch_dist", "sharded_backend_version": 1}``); its ``load`` refuses a
directory without it ("is not a distributed checkpoint"). Older Megatron versions keep the common
(non-sharded) state in ``common.pt``, a ``torch.save`` pickle, where newer ones store a
``common_state`` ShardedObject inside the DCP files. Every conversion carries these files through
byte for byte: source DCP -> universal store -> target DCP (HF exports do not need them).

``integrity.json`` (Megatron's optional SHA-256 manifest of every file) is never carried: the
converted files differ, so its hashes would be wrong; Megatron only reads it when asked to verify.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from formats.errors import CorruptCheckpointError
from formats.storage import open_storage

#: Megatron-core's backend record and its legacy common state, in the order they are written.
FRAMEWORK_FILES = ("metadata.json", "common.pt")
#: Largest framework file carried (``metadata.json`` is tens of bytes; ``common.pt`` holds args
#: and optimizer param groups: kilobytes to a few megabytes).
MAX_FRAMEWORK_FILE_BYTES = 256 << 20


def read_framework_files(root: str | os.PathLike, trust_pickle: bool = False) -> dict[str, bytes]:
    """``{name: bytes}`` of the framework files present directly under ``root`` (local or URL).

    ``metadata.json`` must be a JSON object; ``common.pt`` passes the same checks as any non-tensor
    entry (zip records, CRC-32, pickle globals against the allowlist unless ``trust_pickle``), since
    whoever loads the copy unpickles it.
    """
    from formats.objects import check_object_bytes

    st = open_storage(root)
    names = set(st.list())
    out: dict[str, bytes] = {}
    for name in FRAMEWORK_FILES:
        if name not in names:
            continue
        where = f"{str(st.root).rstrip('/')}/{name}"
        size = st.size(name)
        if size <= MAX_FRAMEWORK_FILE_BYTES:  # (read at most one byte past the limit: it may grow)
            data = st.read_bytes(name, 0, MAX_FRAMEWORK_FILE_BYTES + 1)
            size = len(data)
        if size > MAX_FRAMEWORK_FILE_BYTES:
            raise CorruptCheckpointError(f"{where}: {size} bytes, over the {MAX_FRAMEWORK_FILE_BYTES} byte limit")
        if name.endswith(".json"):
            try:
                doc = json.loads(data)
            except (ValueError, UnicodeDecodeError) as e:
                raise CorruptCheckpointError(f"{where}: not JSON ({e}); restore it from a good copy") from None
            if not isinstance(doc, dict):
                raise CorruptCheckpointError(f"{where}: expected a JSON object; restore it from a good copy")
        else:
            check_object_bytes(data, where, trust_pickle)
        out[name] = data
    return out


def write_framework_files(out: str | os.PathLike, files: dict[str, bytes]) -> None:
    """Write ``files`` (from :func:`read_framework_files`) into the local directory ``out``, each atomically."""
    from formats.fsutil import atomic_write_bytes

    for name, data in files.items():
        if name not in FRAMEWORK_FILES:
            raise ValueError(f"not a framework file: {name!r}")
        atomic_write_bytes(Path(out) / name, data)


def sharded_backend(files: dict[str, bytes]) -> str | None:
    """The ``sharded_backend`` ``metadata.json`` names (``"torch_dist"``), or None."""
    data = files.get("metadata.json")
    if data is None:
        return None
    value = json.loads(data).get("sharded_backend")
    return value if isinstance(value, str) else None
