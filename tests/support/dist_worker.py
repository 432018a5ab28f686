"""Run several ckptconv commands in one torchrun job (one process-group start for many commands).

Usage: ``torchrun ... tests/support/dist_worker.py OUT_JSON -- CMD1 ARGS ;; CMD2 ARGS ...``.
Each command goes through the real click CLI (``converter.cli.cli``) on every rank; the outcome of
each (ok or the error's class and message) is written by every rank to ``OUT_JSON.<rank>``.
The pseudo-command ``@fail R`` makes rank R's task writers raise a StorageError after each task
they finish, for the commands that follow (``@fail -1``: none), to test that one rank's failure
fails every rank and publishes nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


_REAL_CLOSE = None


def _inject_failure(on: bool) -> None:
    import converter.run.distributed as d
    from formats.errors import StorageError

    global _REAL_CLOSE
    if _REAL_CLOSE is None:
        _REAL_CLOSE = d._RecordingWriter.close
    real = _REAL_CLOSE

    def close(self):
        real(self)
        raise StorageError("injected failure after a task (test)")

    d._RecordingWriter.close = close if on else real


def main(argv: list[str]) -> None:
    out = argv[0]
    rest = argv[1:]
    assert rest[0] == "--"
    commands, cur = [], []
    for a in rest[1:]:
        if a == ";;":
            commands.append(cur)
            cur = []
        else:
            cur.append(a)
    commands.append(cur)

    from converter.run import distributed
    from converter.cli import cli

    dist = distributed.init_from_env()
    results = []
    for cmd in commands:
        if cmd[0] == "@fail":
            _inject_failure(int(cmd[1]) == dist.rank)
            results.append({"ok": True})
            continue
        out_text = io.StringIO()
        try:
            with contextlib.redirect_stdout(out_text):
                code = cli.main(args=cmd, prog_name="ckptconv", standalone_mode=False)
            result = {"ok": not code, "code": code}
        except SystemExit as e:  # verify's "not sound" exit status
            result = {"ok": not e.code, "error": "SystemExit", "message": str(e.code)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            result = {"ok": False, "error": type(e).__name__, "message": str(e)}
        results.append({**result, "output": out_text.getvalue()[-2000:]})
    with open(f"{out}.{dist.rank}", "w") as f:
        json.dump({"rank": dist.rank, "world": dist.world, "results": results}, f)
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
