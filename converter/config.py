"""Option dataclasses that reject bad values and combinations before any I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass

from converter import knobs
from formats.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4,
          "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """'512MiB', '5GB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read size {text!r}; write it like 512MiB, 2GB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class RunOptions:
    """Execution knobs shared by every conversion."""

    workers: int = knobs.WORKERS
    memory_budget: int = knobs.MEMORY_BUDGET
    piece_bytes: int = knobs.PIECE_BYTES
    progress: bool | None = None
    overwrite: bool = False
    trust_pickle: bool = False
    dry_run: bool = False
    resume: bool = False
    spool_dir: str | None = None
    #: check each source chunk's stored checksum (DCP zip CRC-32, universal xxh3) as it is copied
    verify_source: bool = True

    def __post_init__(self) -> None:
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other: resume keeps the partial output, overwrite deletes it")
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1 (got {self.workers})")
        if self.memory_budget < 1 << 20:
            raise ConfigError(f"--memory-budget must be at least 1MiB (got {self.memory_budget} bytes)")
        if self.piece_bytes < 1:
            raise ConfigError("piece size must be positive")

    @property
    def effective_piece_bytes(self) -> int:
        """Pieces small enough that every worker fits in the budget (piece + one read each)."""
        return max(1 << 16, min(self.piece_bytes, self.memory_budget // (2 * self.workers)))
