"""Checking a source's stored integrity data while a conversion reads it.

Every conversion checks each source chunk it copies against what the source recorded for it: a
DCP chunk's zip CRC-32 (``torch.load`` never checks it), a universal store chunk's xxh3_64 (in
``ckptconv.json``). Safetensors records no checksum (only its header, sizes and coverage can be
checked). Readers check a chunk inline when a read covers it whole (the checksum of the bytes just
read), otherwise in one streamed pass the first time any part of it is read; either way each
chunk is checked once per reader (:class:`ChunkChecks`), and a mismatch stops the conversion
before anything is published.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Hashable

try:  # ISA-L's CRC-32 is several times faster than zlib's (same values); optional
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - depends on the environment
    crc32 = zlib.crc32

__all__ = ["ChunkChecks", "crc32"]


class ChunkChecks:
    """The chunks a reader has checked: each chunk's check runs once, whichever thread reads it
    first (others reading the same chunk meanwhile wait for that check instead of repeating it).

    Holds one entry per checked chunk (a locator), i.e. memory in the size of the index.
    """

    def __init__(self) -> None:
        self._done: set[Hashable] = set()
        self._busy: dict[Hashable, threading.Lock] = {}
        self._guard = threading.Lock()

    def done(self, chunk: Hashable) -> bool:
        """Whether ``chunk`` was checked (and matched)."""
        return chunk in self._done

    def once(self, chunk: Hashable, check: Callable[[], None]) -> bool:
        """Run ``check`` (which raises on a mismatch) unless ``chunk`` was checked already; True
        when this call ran it. A failed check leaves the chunk unchecked (the error propagates)."""
        if chunk in self._done:
            return False
        with self._guard:
            lock = self._busy.setdefault(chunk, threading.Lock())
        with lock:
            if chunk in self._done:
                return False
            check()
            self._done.add(chunk)
        with self._guard:
            self._busy.pop(chunk, None)
        return True

    def __len__(self) -> int:
        return len(self._done)
