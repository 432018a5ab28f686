"""The ``ckptconv`` command line: :func:`main` (the console script ``converter.cli:main``) and
the click group :data:`cli`. ``app`` holds the group and the core commands, ``hf`` and ``tools``
register theirs on it, ``common`` holds the options and printers they share."""

from __future__ import annotations

import os

# numpy's OpenBLAS starts a thread per core at import, and its threads spin: ckptconv calls no BLAS
# (perf: 4 % of a 1 GB conversion's CPU in blas_thread_server on 2 cores; more cores, more threads)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from converter.cli.app import cli, main  # noqa: E402

__all__ = ["cli", "main"]
