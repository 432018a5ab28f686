"""ckptconv: offline, model-free conversion of PyTorch Distributed Checkpoints.

The Python API lives in :mod:`converter.api`; its functions are also reachable here, e.g.
``converter.to_universal(src, dst)``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    import importlib

    if name.startswith("__"):
        raise AttributeError(name)
    api = importlib.import_module("converter.api")
    if name in api.__all__:
        return getattr(api, name)
    raise AttributeError(f"module 'converter' has no attribute {name!r}")
