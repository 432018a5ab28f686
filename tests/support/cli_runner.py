"""Run ``ckptconv ARGS`` in this process through the real entry point (exit status and streams)."""

from __future__ import annotations

import contextlib
import io


def run_cli(*args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``converter.cli.main(args)``."""
    from converter.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()
