"""How sizes, rates and counts are written in every human-readable output (one style:
binary units, ``1.5 KiB``, ``12.0 MiB``, ``3.2 GiB``; ``1 chunk``, ``2 chunks``)."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``100`` -> ``"100 B"``; None -> ``"?"``."""
    if n is None:
        return "?"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_rate(nbytes: float, seconds: float) -> str:
    """Bytes per second in the same units, e.g. ``"410.2 MiB/s"`` (``"-"`` for no time)."""
    if seconds <= 0:
        return "-"
    return human_bytes(nbytes / seconds) + "/s"


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "chunk")`` -> ``"1 chunk"``; ``plural(3, "chunk")`` -> ``"3 chunks"``."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
