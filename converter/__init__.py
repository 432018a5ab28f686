"""ckptconv: offline, model-free conversion of PyTorch Distributed Checkpoints.

The Python API lives in :mod:`converter.api`; its names are also reachable here, e.g.
``converter.to_universal(src, dst)``, loaded lazily on first use (PEP 562), so importing a pure
module such as ``converter.plan.mesh`` loads nothing else of the program.

The tree follows the data flow (docs/architecture.md): ``plan/`` (pure functions over metadata)
-> ``run/`` (the executor and everything around it) -> ``commands/`` -> ``tools/`` -> ``api`` ->
``cli/``; each stage imports only the stages before it, and ``formats/`` (the on-disk formats)
imports nothing of ``converter``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "RunOptions", "ConversionResult", "Selection", "detect_format", "open_checkpoint", "parse_size",
    "to_universal", "from_universal", "export_hf", "import_hf", "import_ds", "export_ds", "verify", "VerifyReport",
    "diff", "DiffReport", "consolidate",
]


def __getattr__(name: str) -> object:
    """The API names, imported from :mod:`converter.api` the first time one is asked for."""
    if name in __all__:
        from converter import api

        return getattr(api, name)
    raise AttributeError(f"module 'converter' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
