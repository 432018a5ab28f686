"""Run a command in a child process and measure the child itself: its CPU seconds (user + system)
and its peak RSS, from the kernel's accounting of that one process (``os.wait4``), never the
calling (pytest) process's clock or high-water mark."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    """What a child did: exit status (negative: killed by that signal), its output, CPU seconds
    and peak RSS in bytes (Linux ``ru_maxrss`` of the child alone), and whether it ran past the
    timeout (it was then killed)."""

    returncode: int
    stdout: str
    stderr: str
    cpu_seconds: float
    peak_rss: int
    timed_out: bool = False


def run_measured(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 600,
                 preexec_fn=None) -> Usage:
    """Run ``cmd`` to the end (SIGKILLed after ``timeout`` seconds) and return its :class:`Usage`.

    Output goes through temporary files (no pipe to fill); the child is reaped with ``wait4``,
    which returns its own resource usage."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=err, env=None if env is None else dict(env),
                                preexec_fn=preexec_fn)
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        return Usage(proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                     usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, fired.is_set())
