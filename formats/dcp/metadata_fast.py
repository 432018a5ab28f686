"""A fast, lean reader for the exact pickle ``dcp.save`` writes as ``.metadata``.

CPython's C unpickler builds every object of the pickle and keeps each one in its memo until the
end: a 1,024-rank ``.metadata`` (3.5 M chunks, 612 MB) peaks at 7 GiB under ``pickle.load``. This
module reads the same opcodes without that: a small pickle machine in Python walks the file, and
where it meets the records ``dcp.save`` writes by the million (a ``ChunkStorageMetadata`` in a
tensor's ``chunks`` list, a ``MetadataIndex`` -> ``_StorageInfo`` pair in ``storage_data``) a
compiled regular expression reads whole runs of them at C speed and yields the parsed result
directly (a :class:`~formats.base.Box`, a ``((fqn, offsets), StorageInfo)`` pair). Their memo
entries are counted, not kept.

Safety is the general path's: globals resolve through the same allowlist resolver, REDUCE calls
only what it returned, and NEWOBJ/BUILD only touch the allowlisted record classes. Anything else
(an unknown global or opcode, a memo reference to an entry not kept, a value of an unexpected
shape, a damaged length) makes :func:`fast_loads` return None and the caller falls back to the
general allowlist unpickler, which then accepts or refuses the file with its own messages.
"""

from __future__ import annotations

import re
import struct
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable
from itertools import accumulate, chain, compress, count, islice, repeat
from operator import add, is_, itemgetter, ne
from typing import Any

from formats.base import Box

#: Deepest MARK nesting the fast reader follows (beyond it: the general path decides).
MAX_MARKS = 1000
#: Most record encodings (class/name references) learned per kind: dcp.save uses one or two; a
#: pickle that varies them record by record would otherwise cost a regex compile (ms) per record.
MAX_PATTERNS = 16


#: Most entries of the raw-bytes caches (shapes and strings; storage offsets and lengths, which
#: vary more: a quarter of it); past it a value is parsed each time it is met (same result,
#: slower), so memory stays bounded.
MAX_CACHED = 1 << 20


class _Bail(Exception):
    """The pickle is not in the exact shape this reader handles: use the general path."""


class _Cache(dict):
    """raw bytes -> parsed value. ``map(cache.__getitem__, raws)`` stays in C for values seen
    before; a miss calls ``parse`` (which may raise _Bail; nothing is then stored)."""

    __slots__ = ("parse", "cap")

    def __init__(self, parse: Callable[[bytes], Any], cap: int = MAX_CACHED) -> None:
        super().__init__()
        self.parse = parse
        self.cap = cap

    def __missing__(self, raw: bytes) -> Any:
        value = self.parse(raw)
        if len(self) < self.cap:
            self[raw] = value
        return value


# -- byte patterns ------------------------------------------------------------------------------

_REF = rb"(?:h.|j....)"  # BINGET / LONG_BINGET
_INT = rb"(?:K.|M..|J....|\x8a\x01.|\x8a\x02..|\x8a\x03...|\x8a\x04....|\x8a\x05.....|\x8a\x06......|\x8a\x07.......|\x8a\x08........)"
#: A Size's tuple: EMPTY_TUPLE; 1-3 ints and TUPLE1/2/3 + MEMOIZE; MARK, ints, TUPLE + MEMOIZE.
_SHAPE = rb"(?:\)|" + _INT + rb"{1,3}[\x85-\x87]\x94|\(" + _INT + rb"*t\x94)"
#: ``torch.Size(shape)``: Size ref, the shape, TUPLE1 MEMOIZE REDUCE MEMOIZE.
_SIZE_TAIL = rb"\x85\x94R\x94"
_SIZE_TAIL_BYTES = b"\x85\x94R\x94"
#: A new short ASCII string (SHORT_BINUNICODE, MEMOIZE) or a memo reference.
_STR = rb"(?:\x8c.[\x20-\x7e]*\x94|" + _REF + rb")"
_NEWOBJ = rb"\)\x81\x94\}\x94\("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK

def _chunk_record(span_box: bool) -> re.Pattern:
    """The ChunkStorageMetadata record pattern; ``span_box`` adds a group spanning both Sizes."""
    start, end = (b"(", b")") if span_box else (b"", b"")
    return re.compile(
        b"(" + _REF + b")" + _NEWOBJ + b"(" + _REF + b")(" + _REF + b")" + start + b"(" + _SHAPE + b")"
        + _SIZE_TAIL + b"(" + _REF + b")(" + _REF + b")(" + _SHAPE + b")" + end + _SIZE_TAIL + b"ub",
        re.DOTALL,
    )


def _pair_record(span_tail: bool) -> re.Pattern:
    """The MetadataIndex -> _StorageInfo pair pattern; ``span_tail`` adds a group spanning the
    storage offset, the 'length' ref and the length."""
    start, end = (b"(", b")") if span_tail else (b"", b"")
    return re.compile(
        b"(" + _REF + b")" + _NEWOBJ + b"(" + _REF + b")(" + _STR + b")(" + _REF + b")(" + _INT + b"|N)("
        + _REF + b")(" + _REF + b")(" + _SHAPE + b")" + _SIZE_TAIL + b"ub"
        + b"(" + _REF + b")" + _NEWOBJ + b"(" + _REF + b")(" + _STR + b")(" + _REF + b")" + start + b"("
        + _INT + b")(" + _REF + b")(" + _INT + b")" + end + b"ub",
        re.DOTALL,
    )


#: One ChunkStorageMetadata record: class, {offsets: Size, sizes: Size}; groups: class ref,
#: 'offsets' ref, Size ref, shape, 'sizes' ref, Size ref, shape.
_CHUNK_LEARN = _chunk_record(span_box=False)

#: One MetadataIndex -> _StorageInfo pair as ``dcp.save`` writes it (fqn, index, offset; then
#: relative_path, offset, length). Groups: index class ref, 'fqn' ref, fqn, 'index' ref, index,
#: 'offset' ref, Size ref, shape, info class ref, 'relative_path' ref, path, 'offset' ref, offset,
#: 'length' ref, length.
_PAIR_LEARN = _pair_record(span_tail=False)
_INT_RE = re.compile(_INT, re.DOTALL)

#: The chunk record as the batched runs read it: group 4 spans both Sizes (offsets shape to sizes
#: shape: one cache key per box), groups 5 and 8 are its shapes; the others as in _CHUNK_LEARN.
_CHUNK_RUN = _chunk_record(span_box=True)
#: The pair as the batched runs read it: group 13 spans the storage offset, the 'length' ref and
#: the length (one cache key); groups 14-16 are those parts; the others as in _PAIR_LEARN.
_PAIR_RUN = _pair_record(span_tail=True)
#: A storage offset, the 'length' ref and the length (group 13 of _PAIR_RUN); unambiguous, as _BOX.
_OFFSET_LENGTH = re.compile(b"(" + _INT + b")" + _REF + b"(" + _INT + b")", re.DOTALL)
#: A box's bytes (group 4 of _CHUNK_RUN): its two shapes. The encoding is unambiguous (each
#: int's length follows from its opcode; ints, tuple opcodes and refs start with distinct bytes).
_BOX = re.compile(b"(" + _SHAPE + b")" + _SIZE_TAIL + _REF + _REF + b"(" + _SHAPE + b")", re.DOTALL)


def _specialize(template: re.Pattern, literals: dict[int, bytes],
                drop: frozenset[int] = frozenset()) -> re.Pattern:
    """``template`` with the capturing groups in ``literals`` (group number, as ``re`` numbers
    them -> bytes) replaced by those bytes, and the groups in ``drop`` made non-capturing."""
    out, depth, group, skip_to = [], 0, 0, None
    src = template.pattern
    i = 0
    while i < len(src):
        c = src[i:i + 1]
        if c == b"\\":
            if skip_to is None:
                out.append(src[i:i + 2])
            i += 2
            continue
        if c == b"(":
            depth += 1
            if src[i + 1:i + 3] != b"?:":
                group += 1
                if skip_to is None and group in literals:
                    out.append(re.escape(literals[group]))
                    skip_to = depth
                    i += 1
                    continue
                if skip_to is None and group in drop:
                    out.append(b"(?:")
                    i += 1
                    continue
        elif c == b")":
            depth -= 1
            if skip_to is not None and depth == skip_to - 1:
                skip_to = None
                i += 1
                continue
        if skip_to is None:
            out.append(c)
        i += 1
    return re.compile(b"".join(out), re.DOTALL)


# -- values -------------------------------------------------------------------------------------


def _int(raw: bytes) -> int:
    op = raw[0]
    if op == 0x4B:  # K
        return raw[1]
    if op == 0x4D:  # M
        return raw[1] | raw[2] << 8
    if op == 0x4A:  # J
        return int.from_bytes(raw[1:5], "little", signed=True)
    return int.from_bytes(raw[2:], "little", signed=True)  # LONG1


def _offset(raw: bytes) -> int:
    """A storage offset or length (an _INT match): _Bail when negative."""
    value = _int(raw)
    if value < 0:
        raise _Bail
    return value


def _offset_length(raw: bytes) -> tuple[int, int, tuple]:
    """``(offset, length, ())`` (a StorageInfo's tail) of a _PAIR_RUN group 13; _Bail when a
    value is negative."""
    m = _OFFSET_LENGTH.fullmatch(raw)
    if m is None:  # (cannot happen: the record pattern matched these bytes)
        raise _Bail
    return _offset(m.group(1)), _offset(m.group(2)), ()


def _box_memo(raw: bytes) -> int:
    """Memo entries of a chunk record with box bytes ``raw``: the record, its dict, and per Size
    its shape's tuple (none for ``()``), TUPLE1 and REDUCE."""
    return 8 - raw.startswith(b")") - raw.endswith(b")")


def _shape_of(raw: bytes) -> tuple[tuple[int, ...], int]:
    """(shape, memo entries it adds) of a matched shape encoding; _Bail when invalid."""
    if raw == b")":
        return (), 0
    if raw[0] == 0x28:  # MARK ints TUPLE MEMOIZE
        body, want = raw[1:-2], None
    else:
        body, want = raw[:-2], raw[-2] - 0x84
    ints = _INT_RE.findall(body)
    if sum(map(len, ints)) != len(body) or (want is not None and len(ints) != want):
        raise _Bail
    shape = tuple(map(_int, ints))
    if any(v < 0 for v in shape):
        raise _Bail
    return shape, 1


# -- the machine --------------------------------------------------------------------------------

_UNPACK_Q = struct.Struct("<Q").unpack_from
_UNPACK_I = struct.Struct("<I").unpack_from
_GROUPS = re.Match.groups
_GROUP1 = itemgetter(1)
_END = re.Match.end
_IS_NEW = bytes.startswith  # with b"\x8c": a new string (SHORT_BINUNICODE), not a memo reference
_NEW_STR = b"\x8c"
_EMPTY_SHAPE = b")"
_NEW_BOX = Box.__new__
_SET_OFFSETS, _SET_SIZES = Box.offsets.__set__, Box.sizes.__set__


def _scan(pattern: re.Pattern, data: bytes, pos: int, limit: int) -> list[re.Match]:
    """The matches of ``pattern`` one after another from ``pos`` (each where the last ended),
    found in C: the records of one run."""
    return list(iter(pattern.scanner(data, pos, limit).match, None))


class _Reader:
    """One pass over a ``.metadata`` pickle (see the module docstring)."""

    def __init__(self, data: bytes, resolve: Callable[[str, str], Any], records: dict[str, type],
                 storage_info: type, intern: Callable[[tuple], tuple]) -> None:
        self.data = data
        self.resolve = resolve
        self.records = records  # kind -> record class (what the general path builds)
        self.record_types = frozenset(records.values())
        self.storage_info = storage_info
        self.intern = intern  # shape -> the one shared tuple
        self.memo: dict[int, Any] = {}
        self.memo_n = 0
        # new fqn strings of storage pairs (one per pair), kept per batch of records: the memo
        # index of each batch's first, and (their memo indexes, the strings)
        self.fqn_first: list[int] = []
        self.fqn_batches: list[tuple[range | list[int], list[str]]] = []
        self.callables: set[int] = set()  # ids of resolved globals REDUCE may call
        self.keep: list[Any] = []  # the resolved globals (their ids stay valid)
        self.shapes = _Cache(self._parse_shape)  # raw shape -> the interned shape
        self.strings = _Cache(self._parse_string)  # raw _STR -> its str
        self.offsets = _Cache(_offset, MAX_CACHED >> 2)  # raw _INT -> a non-negative int
        self.tails = _Cache(_offset_length, MAX_CACHED >> 2)  # raw offset+length -> (o, l, ())
        self.boxes = _Cache(self._parse_box, MAX_CACHED >> 2)  # raw box bytes -> a (shared) Box
        self.fast_chunk: dict[bytes, tuple[re.Pattern, tuple[bytes, bytes]]] = {}
        self.fast_pair: dict[bytes, re.Pattern] = {}

    def close(self) -> None:
        """Drop the data, the memo and the caches now: the caches parse with the reader's bound
        methods (a reference cycle), which would otherwise keep the file's bytes alive until the
        next cyclic garbage collection (callers pause it while parsing)."""
        self.data = b""
        self.shapes = self.strings = self.boxes = None
        self.memo, self.fqn_batches, self.fqn_first, self.keep = {}, [], [], []

    # memo references resolved once (memo entries are written once: PUT opcodes are refused)
    def _ref(self, raw: bytes) -> Any:
        return self._get(raw[1] if raw[0] == 0x68 else _UNPACK_I(raw, 1)[0])

    def _get(self, idx: int) -> Any:
        """Memo entry ``idx``: kept, or a storage pair's fqn; _Bail for entries not kept."""
        try:
            return self.memo[idx]
        except KeyError:
            pass
        i = bisect_right(self.fqn_first, idx) - 1  # the batch that may hold it
        if i >= 0:
            at, strings = self.fqn_batches[i]
            j = bisect_left(at, idx)
            if j < len(at) and at[j] == idx:
                return strings[j]
        raise _Bail

    def _keep_fqns(self, at: range | list[int], strings: list[str]) -> None:
        """Keep the new fqn strings of a batch of records (memo indexes ``at``, increasing)."""
        if strings:
            self.fqn_first.append(at[0])
            self.fqn_batches.append((at, strings))

    def _keep_fqn(self, idx: int, fqn: str) -> None:
        """Keep one new fqn string (memo index ``idx``, past those kept so far)."""
        if self.fqn_batches and type(self.fqn_batches[-1][0]) is list:
            at, strings = self.fqn_batches[-1]
            at.append(idx)
            strings.append(fqn)
        else:
            self._keep_fqns([idx], [fqn])

    def _parse_shape(self, raw: bytes) -> tuple[int, ...]:
        return self.intern(_shape_of(raw)[0])

    def _parse_string(self, raw: bytes) -> str:
        """The value of a matched _STR: a new string or a reference to one."""
        if raw[0] == 0x8C:
            if raw[1] != len(raw) - 3:
                raise _Bail
            return raw[2:-1].decode("ascii")
        value = self._ref(raw)
        if type(value) is not str:
            raise _Bail
        return value

    def _expect(self, raw: bytes, value: Any) -> None:
        found = self._ref(raw)
        if found is not value and not (type(found) is str and found == value):
            raise _Bail

    # -- the hot records ---------------------------------------------------------------------
    #
    # A run of records (up to the end of their pickle frame, or of a SETITEMS/APPENDS batch) is
    # matched record after record in C by the pattern learned for its encoding; its fields are
    # then turned into objects column by column with C-level map/zip over dict caches keyed by
    # the raw bytes (a miss parses in Python). Whatever the batch cannot decide exactly (a new
    # string it would have to keep, a reference into the run, a value to refuse) goes to the
    # record-by-record loop, which counts the memo as the pickle machine would.

    def _chunks(self, pos: int, out: list, limit: int) -> int:
        """Read the run of ChunkStorageMetadata records at ``pos`` into ``out`` (as Box); the
        position after them (``pos`` when none matches)."""
        data = self.data
        m = _CHUNK_LEARN.match(data, pos, limit)
        if m is None:
            return pos
        g = m.groups()
        head = b"\0".join(g[i] for i in (0, 1, 2, 4, 5))
        pattern = self.fast_chunk.get(head, False)
        if pattern is False:
            if len(self.fast_chunk) >= MAX_PATTERNS:
                return pos  # read opcode by opcode
            self._expect(g[0], self.records["ChunkStorageMetadata"])
            self._expect(g[1], "offsets")
            self._expect(g[4], "sizes")
            size = self._ref(g[2])
            if size is not tuple or self._ref(g[5]) is not tuple:
                raise _Bail
            # (bytes every record with a () shape holds: the Size ref, EMPTY_TUPLE, the tail)
            empty = (g[2] + b")" + _SIZE_TAIL_BYTES, g[5] + b")" + _SIZE_TAIL_BYTES)
            pattern = self.fast_chunk[head] = (_specialize(
                _CHUNK_RUN, {1: g[0], 2: g[1], 3: g[2], 6: g[4], 7: g[5]}, frozenset((5, 8))), empty)
        pattern, empty = pattern
        ms = _scan(pattern, data, pos, limit)
        if not ms:
            return pos
        raws = list(map(_GROUP1, ms))
        out += map(self.boxes.__getitem__, raws)  # (an invalid shape raises _Bail)
        end = _END(ms[-1])
        if data.find(empty[0], pos, end) < 0 and data.find(empty[1], pos, end) < 0:
            self.memo_n += 8 * len(raws)  # no () shape: 8 memo entries each (see _box_memo)
        else:
            self.memo_n += sum(map(_box_memo, raws))
        return end

    def _parse_box(self, raw: bytes) -> Box:
        """The Box of a chunk record's box bytes (a _CHUNK_RUN group 4); _Bail when invalid."""
        m = _BOX.fullmatch(raw)
        if m is None:  # (cannot happen: the record pattern matched these bytes)
            raise _Bail
        box = _NEW_BOX(Box)
        _SET_OFFSETS(box, self.shapes[m.group(1)])
        _SET_SIZES(box, self.shapes[m.group(2)])
        return box

    def _pairs(self, pos: int, out: list, limit: int) -> int:
        """Read the run of MetadataIndex -> _StorageInfo pairs at ``pos`` into ``out`` (key
        ``(fqn, offsets)`` then ``StorageInfo``); the position after them."""
        data = self.data
        m = _PAIR_LEARN.match(data, pos, limit)
        if m is None:
            return pos
        g = m.groups()
        head = b"\0".join(g[i] for i in (0, 1, 3, 5, 6, 8, 9, 11, 13))
        pattern = self.fast_pair.get(head, False)
        if pattern is False:
            if len(self.fast_pair) >= MAX_PATTERNS:
                return pos  # read opcode by opcode
            self._expect(g[0], self.records["MetadataIndex"])
            self._expect(g[1], "fqn")
            self._expect(g[3], "index")
            self._expect(g[5], "offset")
            if self._ref(g[6]) is not tuple:
                raise _Bail
            self._expect(g[8], self.records["_StorageInfo"])
            self._expect(g[9], "relative_path")
            self._expect(g[11], "offset")
            self._expect(g[13], "length")
            pattern = self.fast_pair[head] = _specialize(
                _PAIR_RUN, {1: g[0], 2: g[1], 4: g[3], 6: g[5], 7: g[6], 9: g[8], 10: g[9], 12: g[11],
                            15: g[13]}, frozenset((5, 14, 16)))
        ms = _scan(pattern, data, pos, limit)
        if not ms:
            return pos
        # columns: fqn, offsets shape, relative_path, offset+length (each a tuple of raw bytes)
        cols = list(zip(*map(_GROUPS, ms)))
        n = len(ms)
        # records naming a new file (rare: its first item) keep its string in the memo: one by one
        new_paths = list(compress(range(n), map(_IS_NEW, cols[2], repeat(_NEW_STR)))) \
            if max(cols[2]) >= _NEW_STR else []
        start = 0
        for stop in new_paths + [n]:
            if start < stop and not self._pair_batch([c[start:stop] for c in cols], out):
                self._pair_records(zip(*(c[start:] for c in cols)), out)
                break
            if stop < n:
                self._pair_records(zip(*(c[stop:stop + 1] for c in cols)), out)
            start = stop + 1
        return _END(ms[-1])

    def _pair_batch(self, cols: list[tuple[bytes, ...]], out: list) -> bool:
        """Records (as columns of raw fields) whose file names are references, all at once: True,
        or False (nothing done) when they need the record-by-record loop (a reference to a string
        new in this batch, or a value that loop refuses)."""
        fqn_raw, shape_raw, path_raw, tail_raw = cols
        n = len(fqn_raw)
        string = self.strings.__getitem__
        try:  # (the batch's new strings are not in the memo yet: a reference to one bails here)
            fqns = list(map(string, fqn_raw))
            if path_raw.count(path_raw[0]) == n:  # one file (the usual batch)
                path = string(path_raw[0])
                heads = repeat((path,), n)
                if not path:
                    return False
            else:
                paths = list(map(string, path_raw))
                if "" in paths:
                    return False
                heads = zip(paths)
            offsets = list(map(self.shapes.__getitem__, shape_raw))
            tails = list(map(self.tails.__getitem__, tail_raw))  # (offset, length, ())
        except _Bail:
            return False
        # memo entries per record: 6, its fqn when new (after the record and its dict: at +2),
        # its offsets' tuple unless ()
        first = self.memo_n + 2
        if min(fqn_raw) >= _NEW_STR:  # every fqn new (what dcp.save writes)
            if _EMPTY_SHAPE not in shape_raw:
                at: range | list[int] = range(first, first + 8 * n, 8)
                self.memo_n += 8 * n
            else:
                at = list(accumulate(map(add, map(ne, shape_raw, repeat(_EMPTY_SHAPE)), repeat(7)),
                                     initial=first))
                self.memo_n = at.pop() - 2
            self._keep_fqns(at, fqns)
        else:
            new = list(map(_IS_NEW, fqn_raw, repeat(_NEW_STR)))
            before = list(accumulate(map(add, map(add, new, map(ne, shape_raw, repeat(_EMPTY_SHAPE))),
                                         repeat(6)), initial=first))
            self.memo_n = before.pop() - 2
            self._keep_fqns(list(compress(before, new)), list(compress(fqns, new)))
        infos = map(tuple.__new__, repeat(self.storage_info), map(add, heads, tails))
        out += chain.from_iterable(zip(zip(fqns, offsets), infos))
        return True

    def _pair_records(self, rows: Iterable[tuple[bytes, ...]], out: list) -> None:
        """Records (rows of raw fields) one by one, counting the memo as the pickle machine would."""
        shape, string, tail = self.shapes.__getitem__, self.strings.__getitem__, self.tails.__getitem__
        new = tuple.__new__
        info_type = self.storage_info
        append = out.append
        memo = self.memo
        memo_n = self.memo_n
        keep = self._keep_fqn
        for fqn_raw, shape_raw, path_raw, tail_raw in rows:
            fqn = string(fqn_raw)
            if fqn_raw[0] == 0x8C:  # a new string
                keep(memo_n + 2, fqn)  # its memo entry: after the record and its state dict
                memo_n += 1
            offsets = shape(shape_raw)
            memo_n += shape_raw != _EMPTY_SHAPE
            path = string(path_raw)
            if path_raw[0] == 0x8C:
                memo[memo_n + 6] = path  # after the Size (2), the info record and its dict
                memo_n += 1
            start, length, _ = tail(tail_raw)
            if not path:
                raise _Bail
            append((fqn, offsets))
            append(new(info_type, (path, start, length, ())))
            memo_n += 6
        self.memo_n = memo_n

    def _storage_records(self, stack: list, base: int) -> None:
        """The storage pairs in ``stack[base:]`` read opcode by opcode (records a pickle frame cut)
        in the batched runs' form, when they are exactly what torch writes and valid: what
        ``metadata._parse_storage`` would make of them (so it need not rebuild the whole dict);
        any other item stays as it is, for it to judge."""
        index_type = self.records["MetadataIndex"]
        for i in compress(count(base, 2), map(is_, map(type, stack[base::2]), repeat(index_type))):
            got = self._storage_pair(stack[i], stack[i + 1])
            if got is not None:
                stack[i], stack[i + 1] = got

    def _storage_pair(self, index: Any, info: Any) -> tuple[tuple, tuple] | None:
        """``((fqn, offsets), StorageInfo)`` of a MetadataIndex and _StorageInfo record pair as
        torch writes it (dict states; a str fqn, a shape or None, a file name, non-negative offset
        and length, no transforms); None for anything else."""
        if not (type(info) is self.records["_StorageInfo"] and len(index) == 1 and len(info) == 1
                and type(index[0]) is dict and type(info[0]) is dict):
            return None
        d, f = index[0], info[0]
        fqn, offset = d.get("fqn"), d.get("offset")
        path, start, length = f.get("relative_path"), f.get("offset"), f.get("length")
        if not (type(fqn) is str and type(path) is str and path and type(start) is int
                and type(length) is int and start >= 0 and length >= 0
                and not f.get("transform_descriptors")):
            return None
        if offset is not None:
            if type(offset) not in (tuple, list) or not all(type(v) is int and v >= 0 for v in offset):
                return None  # (the parser names the bad shape)
            offset = self.intern(tuple(offset))
        return (fqn, offset), tuple.__new__(self.storage_info, (path, start, length, ()))

    # -- everything else, opcode by opcode ---------------------------------------------------

    def run(self) -> Any:
        data, memo = self.data, self.memo
        end = len(data)
        stack: list[Any] = []
        marks: list[int] = []
        push = stack.append
        pos = 0
        if data[:2] not in (b"\x80\x04", b"\x80\x05"):
            raise _Bail
        pos = 2
        # CPython's unpickler reads a FRAME's bytes into a buffer; a read that does not fit in what
        # is left of it skips the rest and reads on after the frame. buf_end is where the buffer
        # ends (reads past it are sequential); an opcode read across it is left to the general path.
        buf_end = 2
        while pos < end:
            start = pos
            op = data[pos]
            pos += 1
            if op == 0x94:  # MEMOIZE
                if len(stack) <= (marks[-1] if marks else 0):
                    raise _Bail
                memo[self.memo_n] = stack[-1]
                self.memo_n += 1
            elif op == 0x68 or op == 0x6A:  # BINGET / LONG_BINGET
                if marks and marks[-1] >= 2:
                    base = marks[-1]
                    target, name = stack[base - 1], stack[base - 2]
                    at = start
                    limit = buf_end if start < buf_end else end  # runs stay inside the frame
                    if type(target) is list and name == "chunks":
                        at = self._chunks(start, stack, limit)
                    elif type(target) is dict and name == "storage_data":
                        at = self._pairs(start, stack, limit)
                    if at != start:
                        buf_end = max(at, buf_end)  # (at is inside the frame, or past every frame)
                        pos = at
                        continue
                if op == 0x68:
                    idx = data[pos]
                    pos += 1
                else:
                    idx = _UNPACK_I(data, pos)[0]
                    pos += 4
                push(memo[idx] if idx in memo else self._get(idx))
            elif op == 0x8C:  # SHORT_BINUNICODE
                n = data[pos]
                push(_text(data, pos + 1, n))
                pos += 1 + n
            elif op == 0x58:  # BINUNICODE
                n = _UNPACK_I(data, pos)[0]
                push(_text(data, pos + 4, n))
                pos += 4 + n
            elif op == 0x4B:  # BININT1
                push(data[pos])
                pos += 1
            elif op == 0x4D:  # BININT2
                push(data[pos] | data[pos + 1] << 8)
                pos += 2
            elif op == 0x4A:  # BININT
                push(int.from_bytes(data[pos:pos + 4], "little", signed=True))
                pos += 4
            elif op == 0x8A:  # LONG1
                n = data[pos]
                if pos + 1 + n > end:
                    raise _Bail
                push(int.from_bytes(data[pos + 1:pos + 1 + n], "little", signed=True))
                pos += 1 + n
            elif op == 0x4E:  # NONE
                push(None)
            elif op == 0x88:  # NEWTRUE
                push(True)
            elif op == 0x89:  # NEWFALSE
                push(False)
            elif op == 0x29:  # EMPTY_TUPLE
                push(())
            elif 0x85 <= op <= 0x87:  # TUPLE1/2/3
                n = op - 0x84
                if len(stack) - (marks[-1] if marks else 0) < n:
                    raise _Bail
                t = tuple(stack[-n:])
                del stack[-n:]
                push(t)
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                if len(marks) > MAX_MARKS:
                    raise _Bail
            elif op == 0x74:  # TUPLE
                base = _pop_mark(marks)
                t = tuple(stack[base:])
                del stack[base:]
                push(t)
            elif op == 0x5D:  # EMPTY_LIST
                push([])
            elif op == 0x7D:  # EMPTY_DICT
                push({})
            elif op == 0x61:  # APPEND
                if len(stack) - (marks[-1] if marks else 0) < 2 or type(stack[-2]) is not list:
                    raise _Bail
                stack[-2].append(stack.pop())
            elif op == 0x65:  # APPENDS
                base = _pop_mark(marks)
                if base < 1 or type(stack[base - 1]) is not list:
                    raise _Bail
                stack[base - 1].extend(stack[base:])
                del stack[base:]
            elif op == 0x73:  # SETITEM
                if len(stack) - (marks[-1] if marks else 0) < 3 or type(stack[-3]) is not dict:
                    raise _Bail
                if len(stack) >= 4 and type(stack[-4]) is str and stack[-4] == "storage_data":
                    self._storage_records(stack, len(stack) - 2)
                value = stack.pop()
                key = stack.pop()
                _setitem(stack[-1], key, value)
            elif op == 0x75:  # SETITEMS
                base = _pop_mark(marks)
                if base < 1 or type(stack[base - 1]) is not dict or (len(stack) - base) % 2:
                    raise _Bail
                if base >= 2 and type(stack[base - 2]) is str and stack[base - 2] == "storage_data":
                    self._storage_records(stack, base)
                target = stack[base - 1]
                size, pairs = len(target), (len(stack) - base) // 2
                items = islice(stack, base, None)
                try:
                    target.update(zip(items, items))
                except TypeError:  # an unhashable key
                    raise _Bail from None
                del stack[base:]
                if len(target) != size + pairs:
                    raise _Bail  # a key seen twice: leave the semantics of duplicates to the general path
            elif op == 0x93:  # STACK_GLOBAL
                if len(stack) - (marks[-1] if marks else 0) < 2:
                    raise _Bail
                name = stack.pop()
                module = stack.pop()
                if type(module) is not str or type(name) is not str:
                    raise _Bail
                found = self.resolve(module, name)
                if found is None:
                    raise _Bail  # the general path refuses it, with its message
                self.keep.append(found)
                self.callables.add(id(found))
                push(found)
            elif op == 0x81:  # NEWOBJ
                if len(stack) - (marks[-1] if marks else 0) < 2:
                    raise _Bail
                args = stack.pop()
                cls = stack.pop()
                if cls not in self.record_types or type(args) is not tuple:
                    raise _Bail
                try:
                    push(cls.__new__(cls, *args))
                except Exception:
                    raise _Bail from None
            elif op == 0x52:  # REDUCE
                if len(stack) - (marks[-1] if marks else 0) < 2:
                    raise _Bail
                args = stack.pop()
                func = stack.pop()
                if id(func) not in self.callables or type(args) is not tuple or not callable(func):
                    raise _Bail
                try:
                    push(func(*args))
                except Exception:
                    raise _Bail from None
            elif op == 0x62:  # BUILD
                if len(stack) - (marks[-1] if marks else 0) < 2:
                    raise _Bail
                state = stack.pop()
                inst = stack[-1]
                if type(inst) not in self.record_types:
                    raise _Bail
                inst.__setstate__(state)
            elif op == 0x95:  # FRAME
                after = pos + 8
                if after > end or start < buf_end < after:
                    raise _Bail
                n = _UNPACK_Q(data, pos)[0]
                buf_end = max(buf_end, after)
                if after + n > buf_end:
                    if after != buf_end or after + n > end:
                        raise _Bail  # would skip the rest of a frame, or the frame is cut short
                    buf_end = after + n
                pos = after
                continue
            elif op == 0x2E:  # STOP
                if len(stack) != 1 or marks:
                    raise _Bail
                return stack[0]
            else:
                raise _Bail
            if pos > buf_end:
                if start < buf_end or pos > end:
                    raise _Bail  # read across the end of a frame, or past the end of the data
                buf_end = pos
        raise _Bail  # no STOP


def _text(data: bytes, start: int, n: int) -> str:
    if start + n > len(data):
        raise _Bail
    try:
        return data[start:start + n].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise _Bail from None


def _pop_mark(marks: list[int]) -> int:
    if not marks:
        raise _Bail
    return marks.pop()


def _setitem(target: dict, key: Any, value: Any) -> None:
    try:
        if key in target:
            raise _Bail  # a key seen twice: leave the semantics of duplicates to the general path
        target[key] = value
    except TypeError:  # an unhashable key
        raise _Bail from None


def fast_loads(data: bytes, resolve: Callable[[str, str], Any], records: dict[str, type],
               storage_info: type, intern: Callable[[tuple], tuple]) -> Any | None:
    """The root object of a ``.metadata`` pickle with its hot records already parsed (chunk
    records as :class:`Box`, storage pairs as ``(fqn, offsets)`` -> ``storage_info``), or None
    when the pickle is not in the shape ``dcp.save`` writes (then use the general path).

    ``records`` maps DCP class names to the record classes ``resolve`` returns for them;
    ``intern`` returns the shared tuple of a validated shape.
    """
    reader = _Reader(data, resolve, records, storage_info, intern)
    try:
        return reader.run()
    except (_Bail, IndexError, struct.error, RecursionError, MemoryError):
        return None
    finally:
        reader.close()
