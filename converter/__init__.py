"""ckptconv: offline, model-free conversion of PyTorch Distributed Checkpoints.

The Python API lives in :mod:`converter.api`; its functions are also reachable here, e.g.
``converter.ingest(src, dst)``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = frozenset({
    "RunOptions", "ConversionResult", "detect_format", "open_checkpoint", "parse_size",
    "to_universal", "from_universal", "export_hf", "import_hf", "verify", "VerifyReport", "diff", "DiffReport",
})


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'converter' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module("converter.api"), name)
