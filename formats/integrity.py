"""Checking a source's stored integrity data while a conversion reads it.

Every conversion checks each source chunk it copies against what the source recorded for it: a
DCP chunk's zip CRC-32 (``torch.load`` never checks it), a universal store chunk's xxh3_64 (in
``ckptconv.json``). Safetensors records no checksum (only its header, sizes and coverage can be
checked).

The check runs on the bytes the conversion reads anyway, in memory, never in a second pass over
the chunk: a read of the whole chunk is checked at once; reads of parts feed a ledger of the
chunk (:class:`CRCRanges` for CRC-32, whose pieces combine in any order with
:func:`crc32_combine`; :class:`StreamedHash` for xxh3, fed in order), which is compared once the
parts cover the chunk. Bytes no read covers (storage beyond a chunk's view, a part another
torchrun rank copied) are read only by :meth:`ChunkChecks.finish`, at the end of the run. Each
chunk is checked once per reader (:class:`ChunkChecks`), and a mismatch stops the conversion before
anything is published.
"""

from __future__ import annotations

import bisect
import threading
import zlib
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

try:  # ISA-L's CRC-32 is several times faster than zlib's (same values); optional
    from isal.isal_zlib import crc32
    from isal.isal_zlib import crc32_combine as _isal_combine
except ImportError:  # pragma: no cover - depends on the environment
    crc32 = zlib.crc32
    _isal_combine = None

__all__ = ["ChunkChecks", "CRCRanges", "RangeLedger", "StreamedHash", "crc32", "crc32_combine"]

#: Gaps are read in blocks of at most this many bytes (one pooled buffer per thread).
GAP_BLOCK_BYTES = 4 << 20

# ----------------------------------------------------------------------------- CRC-32 combine

_POLY = 0xEDB88320  # CRC-32 (reflected), as zlib


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC-32 polynomial (reflected bit order, zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return tuple(table)


_X2N = _x2n_table()  # x^(2^k) mod p


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def _py_combine(crc1: int, crc2: int, len2: int) -> int:
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's
    ``crc32_combine``; ISA-L's when installed, else the same math in Python, O(log len2))."""
    if len2 <= 0:
        return crc1
    if _isal_combine is not None:
        return _isal_combine(crc1, crc2, len2)
    return _py_combine(crc1, crc2, len2)


# ----------------------------------------------------------------------------- ledgers


#: ``fill(start, end, take)``: read the chunk's bytes ``[start, end)`` (offsets in the checked
#: bytes) in bounded blocks, calling ``take(offset, block)`` for each.
Fill = Callable[[int, int, Callable[[int, memoryview], None]], None]


class RangeLedger(Protocol):
    """What a chunk's parts have contributed to its checksum so far."""

    @property
    def complete(self) -> bool: ...

    def add(self, offset: int, data: memoryview) -> None: ...

    def finish(self, fill: Fill) -> None: ...

    def value(self) -> int | str: ...


class CRCRanges:
    """The CRC-32 of ``length`` bytes from parts read in any order: each part's new bytes are
    CRC'd once, in memory, and merged with the ranges they touch (:func:`crc32_combine`).

    Overlapping parts (two strided reads spanning the same bytes) contribute only the bytes not
    seen yet. Memory: one entry per run of bytes not yet joined to its neighbours.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self._starts: list[int] = []  # sorted starts of disjoint ranges
        self._ranges: dict[int, tuple[int, int]] = {}  # start -> (end, crc)
        self.bytes_seen = 0

    @property
    def complete(self) -> bool:
        return self.bytes_seen >= self.length

    def value(self) -> int:
        if not self.length:
            return 0
        return self._ranges[0][1]

    def add(self, offset: int, data: memoryview) -> None:
        """Account for ``data``, the bytes at ``[offset, offset + len(data))``."""
        view = memoryview(data).cast("B")
        end = min(offset + len(view), self.length)
        for a, b in self._uncovered(max(0, offset), end):
            self._insert(a, b, crc32(view[a - offset: b - offset]))
            self.bytes_seen += b - a

    def add_crc(self, offset: int, length: int, crc: int) -> bool:
        """Account for ``length`` bytes at ``offset`` whose CRC-32 is ``crc`` (computed elsewhere:
        another process wrote them). False when they were accounted for already; a range partly
        accounted for is refused (ValueError)."""
        end = offset + length
        uncovered = self._uncovered(offset, end)
        if not length or not uncovered:
            return False
        if uncovered != [(offset, end)]:
            raise ValueError(f"bytes {offset}..{end}: partly accounted for already")
        self._insert(offset, end, crc)
        self.bytes_seen += length
        return True

    def gaps(self) -> list[tuple[int, int]]:
        """The ranges no part covered yet."""
        return self._uncovered(0, self.length)

    def finish(self, fill: Fill) -> None:
        """Read the gaps (``fill``) so that the ranges cover every byte."""
        for a, b in self.gaps():
            fill(a, b, self.add)

    def _uncovered(self, start: int, end: int) -> list[tuple[int, int]]:
        out, pos = [], start
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while pos < end and i < len(self._starts):
            s = self._starts[i]
            e = self._ranges[s][0]
            if e <= pos:
                i += 1
                continue
            if s >= end:
                break
            if s > pos:
                out.append((pos, s))
            pos = max(pos, e)
            i += 1
        if pos < end:
            out.append((pos, end))
        return out

    def _insert(self, a: int, b: int, crc: int) -> None:
        """Insert the disjoint range ``[a, b)`` and join it with the ranges it touches."""
        i = bisect.bisect_left(self._starts, a)
        if i > 0:
            s = self._starts[i - 1]
            e, c = self._ranges[s]
            if e == a:  # joins the range before it
                crc = crc32_combine(c, crc, b - a)
                a = s
                i -= 1
                del self._starts[i]
                del self._ranges[s]
        if i < len(self._starts) and self._starts[i] == b:  # joins the range after it
            e, c = self._ranges.pop(b)
            crc = crc32_combine(crc, c, e - b)
            del self._starts[i]
            b = e
        self._starts.insert(i, a)
        self._ranges[a] = (b, crc)


class StreamedHash:
    """An xxh3_64 (not combinable) of ``length`` bytes, fed in order: a part that starts past the
    bytes hashed so far first has the gap before it read (``fill``) and hashed; a part already
    hashed adds nothing. The gap's bytes are the ones another task is about to read, so they are
    read from the disk once (then from the page cache)."""

    def __init__(self, length: int, fill: Fill) -> None:
        import xxhash

        self.length = length
        self._fill = fill
        self._hasher = xxhash.xxh3_64()
        self.next = 0

    @property
    def complete(self) -> bool:
        return self.next >= self.length

    def value(self) -> str:
        return self._hasher.hexdigest()

    def add(self, offset: int, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        end = min(offset + len(view), self.length)
        if end <= self.next:
            return
        if offset > self.next:
            self._fill(self.next, offset, self._take)
        self._take(offset, view[: end - offset])

    def _take(self, offset: int, block: memoryview) -> None:
        skip = self.next - offset
        if skip < len(block):
            self._hasher.update(block[max(0, skip):])
            self.next = offset + len(block)

    def finish(self, fill: Fill) -> None:
        if self.next < self.length:
            fill(self.next, self.length, self._take)


class _Pending:
    """A chunk whose parts are being checked: its ledger, the comparison, the lock its feeders hold."""

    __slots__ = ("ledger", "compare", "fill", "lock")

    def __init__(self, ledger: RangeLedger, compare: Callable[[int | str], None], fill: Fill) -> None:
        self.ledger, self.compare, self.fill = ledger, compare, fill
        self.lock = threading.Lock()


class ChunkChecks:
    """The chunks a reader has checked, and the ledgers of those read in parts.

    Whole checks (:meth:`once`) run once, whichever thread reads the chunk first (others reading
    the same chunk meanwhile wait for that check instead of repeating it). Parts (:meth:`part`)
    feed the chunk's ledger; the thread whose part completes it compares. :meth:`finish` reads
    what no part covered and compares the rest. Holds one entry per checked chunk (a locator) and
    one ledger per chunk in progress: memory in the size of the index.
    """

    def __init__(self) -> None:
        self._done: set[Hashable] = set()
        self._busy: dict[Hashable, threading.Lock] = {}
        self._pending: dict[Hashable, _Pending] = {}
        self._guard = threading.Lock()

    def done(self, chunk: Hashable) -> bool:
        """Whether ``chunk`` was checked (and matched)."""
        return chunk in self._done

    def pending(self, chunk: Hashable) -> bool:
        """Whether parts of ``chunk`` were read and its check is not complete yet."""
        return chunk in self._pending

    def any_pending(self, chunks: Iterable[Hashable]) -> bool:
        """Whether any of ``chunks`` has a check in progress (its bytes not all seen yet)."""
        pending = self._pending
        return bool(pending) and any(c in pending for c in chunks)

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

    def part(self, chunk: Hashable, offset: int, data: memoryview,
             start: Callable[[], tuple[RangeLedger, Callable[[int | str], None], Fill]]) -> None:
        """Feed the bytes ``data`` at ``offset`` of the checked bytes of ``chunk`` to its ledger
        (``start()`` makes it on first use: the ledger, the comparison that raises on a mismatch,
        the gap reader); compare once the ledger is complete."""
        if chunk in self._done:
            return
        p = self._pending.get(chunk)
        if p is None:
            made = _Pending(*start())  # outside the guard: it may read (a file header)
            with self._guard:
                if chunk in self._done:
                    return
                p = self._pending.setdefault(chunk, made)
        with p.lock:
            if chunk in self._done:
                return
            p.ledger.add(offset, data)
            if p.ledger.complete:
                self._settle(chunk, p)

    def _settle(self, chunk: Hashable, p: _Pending) -> None:
        p.compare(p.ledger.value())
        self._done.add(chunk)
        with self._guard:
            self._pending.pop(chunk, None)

    def finish(self, workers: int = 1) -> int:
        """Complete every check in progress: read the bytes no part covered, compare. Raises on
        the first mismatch; returns how many chunks it completed."""
        with self._guard:
            todo = list(self._pending.items())

        def one(item: tuple[Hashable, _Pending]) -> None:
            chunk, p = item
            with p.lock:
                if chunk in self._done:
                    return
                p.ledger.finish(p.fill)
                self._settle(chunk, p)

        if workers > 1 and len(todo) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptconv-check") as pool:
                list(pool.map(one, todo))
        else:
            for item in todo:
                one(item)
        return len(todo)

    def __len__(self) -> int:
        return len(self._done)


def block_fill(read_into: Callable[[int, memoryview], None]) -> Fill:
    """A :data:`Fill` over ``read_into(offset, view)`` (fills ``view`` from ``offset`` of the
    checked bytes), through one pooled buffer of at most :data:`GAP_BLOCK_BYTES` per thread."""
    from formats.fsutil import pooled_buffer

    def fill(start: int, end: int, take: Callable[[int, memoryview], None]) -> None:
        pos = start
        while pos < end:
            n = min(GAP_BLOCK_BYTES, end - pos)
            block = memoryview(pooled_buffer("check-gap", n))
            read_into(pos, block)
            take(pos, block)
            pos += n

    return fill
