"""The Python API of ckptconv (the CLI calls exactly these).

Example::

    from converter import api
    api.to_universal("ckpt/step-1000", "uni/")
"""

from __future__ import annotations

from converter.config import RunOptions, parse_size
from converter.plan.selection import Selection
from converter.run.sources import detect_format, open_checkpoint
from converter.commands.from_universal import from_universal
from converter.commands.export_hf import export_hf
from converter.commands.import_hf import import_hf
from converter.commands.to_universal import to_universal
from converter.run.pipeline import ConversionResult
from converter.tools.verify import VerifyReport, verify
from converter.tools.diff import DiffReport, diff
from converter.commands.export_ds import export_ds
from converter.commands.import_ds import import_ds
from converter.commands.consolidate import consolidate

__all__ = [
    "RunOptions", "ConversionResult", "Selection", "detect_format", "open_checkpoint", "parse_size",
    "to_universal", "from_universal", "export_hf", "import_hf", "import_ds", "export_ds", "verify", "VerifyReport",
    "diff", "DiffReport", "consolidate",
]
