"""The Python API of ckptconv (the CLI calls exactly these).

Example::

    from converter import api
    api.to_universal("ckpt/step-1000", "uni/")

Each name is imported from its module the first time it is asked for (PEP 562), so a command
loads only its own conversion: ``ckptconv to-universal`` never imports the Megatron target, the
DeepSpeed export or ``verify`` (start-up is part of every conversion's time).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: Where each API name lives.
_HOMES = {
    "RunOptions": "converter.config", "parse_size": "converter.config",
    "Selection": "converter.plan.selection",
    "detect_format": "converter.run.sources", "open_checkpoint": "converter.run.sources",
    "ConversionResult": "converter.run.pipeline",
    "to_universal": "converter.commands.to_universal", "from_universal": "converter.commands.from_universal",
    "export_hf": "converter.commands.export_hf", "import_hf": "converter.commands.import_hf",
    "export_ds": "converter.commands.export_ds", "import_ds": "converter.commands.import_ds",
    "consolidate": "converter.commands.consolidate",
    "verify": "converter.tools.verify", "VerifyReport": "converter.tools.verify",
    "diff": "converter.tools.diff", "DiffReport": "converter.tools.diff",
}

__all__ = [
    "RunOptions", "ConversionResult", "Selection", "detect_format", "open_checkpoint", "parse_size",
    "to_universal", "from_universal", "export_hf", "import_hf", "import_ds", "export_ds", "verify", "VerifyReport",
    "diff", "DiffReport", "consolidate",
]

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from converter.commands.consolidate import consolidate
    from converter.commands.export_ds import export_ds
    from converter.commands.export_hf import export_hf
    from converter.commands.from_universal import from_universal
    from converter.commands.import_ds import import_ds
    from converter.commands.import_hf import import_hf
    from converter.commands.to_universal import to_universal
    from converter.config import RunOptions, parse_size
    from converter.plan.selection import Selection
    from converter.run.pipeline import ConversionResult
    from converter.run.sources import detect_format, open_checkpoint
    from converter.tools.diff import DiffReport, diff
    from converter.tools.verify import VerifyReport, verify


def __getattr__(name: str) -> object:
    """An API name, imported from its module on first use (and cached here)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'converter.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
