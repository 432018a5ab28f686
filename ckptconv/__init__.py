"""``ckptconv``: the project's name as an importable package and ``python -m ckptconv``.

The code lives in :mod:`converter` (the CLI and Python API) and :mod:`formats` (readers and
writers); this package re-exports the API lazily, so ``import ckptconv; ckptconv.to_universal(src,
dst)`` and ``python -m ckptconv inspect CKPT`` work like ``converter`` and the ``ckptconv`` script.
"""

from __future__ import annotations

from converter import __all__, __version__  # noqa: F401


def __getattr__(name: str) -> object:
    """The API names of :mod:`converter.api`, imported on first use."""
    import converter

    return getattr(converter, name)
