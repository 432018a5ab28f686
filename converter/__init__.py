"""ckptconv: offline, model-free conversion of PyTorch Distributed Checkpoints.

The Python API lives in :mod:`converter.api`; its names are bound here too, e.g.
``converter.to_universal(src, dst)``. They are bound eagerly, after the submodules that share
their names (``converter.verify``, ``converter.diff``) are loaded, so the functions win.
"""

from __future__ import annotations

__version__ = "0.1.0"

from converter.api import *  # noqa: E402,F403
from converter.api import __all__  # noqa: E402,F401
