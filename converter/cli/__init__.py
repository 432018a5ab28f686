"""The ``ckptconv`` command line: :func:`main` (the console script ``converter.cli:main``) and
the click group :data:`cli`. ``app`` holds the group and the core commands, ``hf`` and ``tools``
register theirs on it, ``common`` holds the options and printers they share."""

from __future__ import annotations

from converter.cli.app import cli, main

__all__ = ["cli", "main"]
