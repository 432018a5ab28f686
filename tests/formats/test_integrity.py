"""The checksum ledgers of formats/integrity.py against the plain checksum of the whole bytes.

- ``crc32_combine`` (ISA-L's, and the Python fallback used without it) equals zlib's CRC-32 of the
  concatenation, for any lengths (0 included, and lengths over 4 GiB for the fallback's math);
- :class:`CRCRanges` fed parts in any order, overlapping or repeated, then finished through the gap
  reader, gives zlib's CRC-32 of all bytes, CRCs each byte once, and reads only the gaps;
- :class:`StreamedHash` fed parts in any order gives xxh3_64 of all bytes, reading only what was
  not fed before it was needed.
"""

from __future__ import annotations

import zlib

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from formats import integrity
from formats.integrity import CRCRanges, StreamedHash, crc32_combine


@settings(max_examples=120, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32_combine_equals_the_crc_of_the_concatenation(a, b):
    want = zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want
    assert integrity._py_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want or not b


def test_python_combine_matches_isal_for_long_lengths():
    isal = integrity._isal_combine
    if isal is None:
        return
    for n in (1, 7, 4096, 1 << 31, (1 << 32) + 5, 3 << 40):
        assert integrity._py_combine(0x12345678, 0x9ABCDEF0, n) == isal(0x12345678, 0x9ABCDEF0, n)


parts = st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 700)), max_size=12)


class _Gaps:
    """A gap reader over ``data`` that records what it read."""

    def __init__(self, data: bytes) -> None:
        self.data, self.read = data, []

    def __call__(self, start, end, take):
        self.read.append((start, end))
        take(start, memoryview(self.data)[start:end])


@settings(max_examples=120, deadline=None)
@given(st.binary(min_size=1, max_size=2000), parts)
def test_crc_ranges_of_any_parts(data, cuts):
    n = len(data)
    ledger, crced = CRCRanges(n), []
    real = integrity.crc32
    integrity.crc32 = lambda view, value=0: (crced.append(len(view)), real(view, value))[1]
    try:
        seen = bytearray(n)
        for start, length in cuts:
            start = min(start, n - 1)
            ledger.add(start, memoryview(data)[start: start + length])
            seen[start: start + length] = b"\1" * len(seen[start: start + length])
        gaps = _Gaps(data)
        ledger.finish(gaps)
    finally:
        integrity.crc32 = real
    assert ledger.complete and ledger.value() == zlib.crc32(data)
    assert sum(crced) == n  # every byte CRC'd once
    assert sum(e - s for s, e in gaps.read) == seen.count(0)  # only the bytes no part covered


@settings(max_examples=120, deadline=None)
@given(st.binary(min_size=1, max_size=2000), parts)
def test_streamed_hash_of_any_parts(data, cuts):
    n = len(data)
    gaps = _Gaps(data)
    h = StreamedHash(n, gaps)
    fed = 0
    for start, length in cuts:
        start = min(start, n - 1)
        h.add(start, memoryview(data)[start: start + length])
        fed += len(data[start: start + length])
    h.finish(gaps)
    assert h.complete and h.value() == xxhash.xxh3_64_hexdigest(data)
    assert sum(e - s for s, e in gaps.read) <= n


def test_an_empty_chunk_is_complete_at_once():
    ledger = CRCRanges(0)
    assert ledger.complete and ledger.value() == 0 == zlib.crc32(b"")
