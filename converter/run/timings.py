"""Where a conversion's wall time goes: named marks from the process's start, printed as one
stderr line when ``knobs.TIMINGS`` is on (``CKPTCONV_TIMINGS=1``; ``bench/datapath.py`` reads it).

    ckptconv: timings: imports 0.10 | source 0.26 | planned 0.01 | ... | copy 1.42 | commit 0.17 | exit 0.02 | total 2.08 s

Each field is the seconds since the previous mark; the first, ``imports``, counts from the
process's creation (exec): the interpreter's start-up and the CLI's imports.
"""

from __future__ import annotations

import os
import sys
import time

from converter import knobs

_marks: list[tuple[str, float]] = []


def _process_age() -> float | None:
    """Seconds since this process was created (Linux /proc), or None."""
    try:
        with open(f"/proc/{os.getpid()}/stat", "rb") as f:
            started_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def mark(name: str) -> None:
    """Note that phase ``name`` ends now (no-op unless timings are on)."""
    if not knobs.TIMINGS:
        return
    now = time.perf_counter()
    if not _marks:
        age = _process_age()
        _marks.append(("exec", now - age if age is not None else now))
    _marks.append((name, now))


def report() -> None:
    """Print the marks as one line on stderr (no-op unless timings are on and a mark was made)."""
    if not knobs.TIMINGS or len(_marks) < 2:
        return
    mark("exit")
    fields = [f"{name} {t - prev:.3f}" for (_, prev), (name, t) in zip(_marks, _marks[1:])]
    sys.stderr.write(f"ckptconv: timings: {' | '.join(fields)} | total {_marks[-1][1] - _marks[0][1]:.3f} s\n")
    sys.stderr.flush()
