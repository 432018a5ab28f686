"""Option dataclasses that reject bad values and combinations before any I/O."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from converter import knobs
from formats.errors import ConfigError, DestinationError

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


def check_destination(src: str | os.PathLike, dst: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse a destination inside the source (or holding it), or non-empty without ``overwrite``.

    With ``overwrite`` the old contents are removed; the source itself is never touched.
    """
    s, d = Path(src).resolve(), Path(dst).resolve()
    if d == s or s in d.parents:
        raise DestinationError(f"{dst}: destination is inside the source {src}; choose a directory outside it")
    if d in s.parents:
        raise DestinationError(f"{dst}: destination contains the source {src}; choose another directory")
    if d.exists() and not d.is_dir():
        raise DestinationError(f"{dst}: exists and is not a directory; choose a new path")
    if d.exists() and any(d.iterdir()):
        if not overwrite:
            from converter.journal import has_journal

            if has_journal(d):
                raise DestinationError(
                    f"{dst}: holds the partial output of an interrupted conversion; pass --resume to continue it "
                    "or --overwrite to start over"
                )
            raise DestinationError(f"{dst}: destination is not empty; pass --overwrite to replace it or choose a new path")
        for child in d.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    d.mkdir(parents=True, exist_ok=True)
    return d


def check_resume_destination(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """The destination of a ``--resume`` run: it must exist and not be inside the source."""
    s, d = Path(src).resolve(), Path(dst).resolve()
    if d == s or s in d.parents or d in s.parents:
        raise DestinationError(f"{dst}: destination overlaps the source {src}; choose a directory outside it")
    if not d.is_dir():
        raise DestinationError(f"{dst}: nothing to resume (no such directory); run without --resume")
    for dirpath, dirnames, filenames in os.walk(d):
        for name in dirnames + filenames:
            if os.path.islink(os.path.join(dirpath, name)):
                raise DestinationError(
                    f"{os.path.join(dirpath, name)}: a symlink inside the partial destination; ckptconv never "
                    "writes through links: remove it, or start over with --overwrite"
                )
    return d
