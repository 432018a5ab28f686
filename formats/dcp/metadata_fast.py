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
from array import array
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from formats.base import Box

#: Deepest MARK nesting the fast reader follows (beyond it: the general path decides).
MAX_MARKS = 1000
#: Most record encodings (class/name references) learned per kind: dcp.save uses one or two; a
#: pickle that varies them record by record would otherwise cost a regex compile (ms) per record.
MAX_PATTERNS = 16


class _Bail(Exception):
    """The pickle is not in the exact shape this reader handles: use the general path."""


# -- byte patterns ------------------------------------------------------------------------------

_REF = rb"(?:h.|j....)"  # BINGET / LONG_BINGET
_INT = rb"(?:K.|M..|J....|\x8a\x01.|\x8a\x02..|\x8a\x03...|\x8a\x04....|\x8a\x05.....|\x8a\x06......|\x8a\x07.......|\x8a\x08........)"
#: A Size's tuple: EMPTY_TUPLE; 1-3 ints and TUPLE1/2/3 + MEMOIZE; MARK, ints, TUPLE + MEMOIZE.
_SHAPE = rb"(?:\)|" + _INT + rb"{1,3}[\x85-\x87]\x94|\(" + _INT + rb"*t\x94)"
#: ``torch.Size(shape)``: Size ref, the shape, TUPLE1 MEMOIZE REDUCE MEMOIZE.
_SIZE_TAIL = rb"\x85\x94R\x94"
#: A new short ASCII string (SHORT_BINUNICODE, MEMOIZE) or a memo reference.
_STR = rb"(?:\x8c.[\x20-\x7e]*\x94|" + _REF + rb")"
_NEWOBJ = rb"\)\x81\x94\}\x94\("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK

#: One ChunkStorageMetadata record: class, {offsets: Size, sizes: Size}; groups: class ref,
#: 'offsets' ref, Size ref, shape, 'sizes' ref, Size ref, shape.
_CHUNK_LEARN = re.compile(
    b"(" + _REF + b")" + _NEWOBJ + b"(" + _REF + b")(" + _REF + b")(" + _SHAPE + b")" + _SIZE_TAIL
    + b"(" + _REF + b")(" + _REF + b")(" + _SHAPE + b")" + _SIZE_TAIL + b"ub",
    re.DOTALL,
)

#: One MetadataIndex -> _StorageInfo pair as ``dcp.save`` writes it (fqn, index, offset; then
#: relative_path, offset, length). Groups: index class ref, 'fqn' ref, fqn, 'index' ref, index,
#: 'offset' ref, Size ref, shape, info class ref, 'relative_path' ref, path, 'offset' ref, offset,
#: 'length' ref, length.
_PAIR_LEARN = re.compile(
    b"(" + _REF + b")" + _NEWOBJ + b"(" + _REF + b")(" + _STR + b")(" + _REF + b")(" + _INT + b"|N)("
    + _REF + b")(" + _REF + b")(" + _SHAPE + b")" + _SIZE_TAIL + b"ub"
    + b"(" + _REF + b")" + _NEWOBJ + b"(" + _REF + b")(" + _STR + b")(" + _REF + b")(" + _INT + b")("
    + _REF + b")(" + _INT + b")ub",
    re.DOTALL,
)
_INT_RE = re.compile(_INT, re.DOTALL)


def _specialize(learn: re.Pattern, literals: dict[int, bytes]) -> re.Pattern:
    """``learn`` with the groups in ``literals`` (group number -> bytes) replaced by those bytes."""
    out, depth, group, skip_to = [], 0, 0, None
    src = learn.pattern
    i = 0
    while i < len(src):
        c = src[i:i + 1]
        if c == b"\\":
            if skip_to is None:
                out.append(src[i:i + 2])
            i += 2
            continue
        if c == b"(" and src[i + 1:i + 3] != b"?:":
            depth += 1
            if depth == 1:
                group += 1
                if group in literals:
                    out.append(re.escape(literals[group]))
                    skip_to = depth
                    i += 1
                    continue
        elif c == b"(":
            depth += 1
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
        # new fqn strings of storage pairs (one per pair): memo index -> string, compactly
        self.fqn_at = array("q")
        self.fqn_str: list[str] = []
        self.callables: set[int] = set()  # ids of resolved globals REDUCE may call
        self.keep: list[Any] = []  # the resolved globals (their ids stay valid)
        self.shapes: dict[bytes, tuple[tuple[int, ...], int]] = {}
        self.strings: dict[bytes, tuple[str, int]] = {}
        self.fast_chunk: dict[bytes, re.Pattern | None] = {}
        self.fast_pair: dict[bytes, re.Pattern | None] = {}

    # memo references resolved once (memo entries are written once: PUT opcodes are refused)
    def _ref(self, raw: bytes) -> Any:
        return self._get(raw[1] if raw[0] == 0x68 else _UNPACK_I(raw, 1)[0])

    def _get(self, idx: int) -> Any:
        """Memo entry ``idx``: kept, or a storage pair's fqn; _Bail for entries not kept."""
        try:
            return self.memo[idx]
        except KeyError:
            pass
        at = self.fqn_at
        i = bisect_left(at, idx)
        if i < len(at) and at[i] == idx:
            return self.fqn_str[i]
        raise _Bail

    def _shape(self, raw: bytes) -> tuple[tuple[int, ...], int]:
        got = self.shapes.get(raw)
        if got is None:
            shape, n = _shape_of(raw)
            got = self.shapes[raw] = (self.intern(shape), n)
        return got

    def _string(self, raw: bytes) -> tuple[str, int]:
        """(value, memo entries added) of a matched _STR: a new string or a reference to one."""
        got = self.strings.get(raw)
        if got is None:
            if raw[0] == 0x8C:
                if raw[1] != len(raw) - 3:
                    raise _Bail
                got = (raw[2:-1].decode("ascii"), 1)
            else:
                value = self._ref(raw)
                if type(value) is not str:
                    raise _Bail
                got = (value, 0)
            if len(self.strings) < 1 << 20:
                self.strings[raw] = got
        return got

    def _expect(self, raw: bytes, value: Any) -> None:
        found = self._ref(raw)
        if found is not value and not (type(found) is str and found == value):
            raise _Bail

    # -- the hot records ---------------------------------------------------------------------

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
            pattern = self.fast_chunk[head] = _specialize(
                _CHUNK_LEARN, {1: g[0], 2: g[1], 3: g[2], 5: g[4], 6: g[5]})
        shape = self._shape
        new_box, set_off, set_sz = Box.__new__, Box.offsets.__set__, Box.sizes.__set__
        memo_n = self.memo_n
        for m in iter(pattern.scanner(data, pos, limit).match, None):
            off, n1 = shape(m.group(1))
            sz, n2 = shape(m.group(2))
            box = new_box(Box)
            set_off(box, off)
            set_sz(box, sz)
            out.append(box)
            memo_n += 6 + n1 + n2
            pos = m.end()
        self.memo_n = memo_n
        return pos

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
                _PAIR_LEARN, {1: g[0], 2: g[1], 4: g[3], 6: g[5], 7: g[6], 9: g[8], 10: g[9], 12: g[11],
                              14: g[13]})
        shape, string, info_type = self._shape, self._string, self.storage_info
        shapes, strings = self.shapes, self.strings
        lengths: dict[bytes, int] = {}
        new = tuple.__new__
        append = out.append
        fqn_at, fqn_str, memo = self.fqn_at.append, self.fqn_str.append, self.memo
        memo_n = self.memo_n
        for m in iter(pattern.scanner(data, pos, limit).match, None):
            fqn_raw, _index, shape_raw, path_raw, off_raw, len_raw = m.groups()
            fqn, new_str = strings.get(fqn_raw) or string(fqn_raw)
            if new_str:
                fqn_at(memo_n + 2)  # its memo entry: after the record and its state dict
                fqn_str(fqn)
                memo_n += 1
            offsets, n = shapes.get(shape_raw) or shape(shape_raw)
            memo_n += n
            path, new_str = strings.get(path_raw) or string(path_raw)
            if new_str:
                memo[memo_n + 6] = path  # after the Size (2), the info record and its dict
                memo_n += 1
            start = _int(off_raw)
            length = lengths.get(len_raw)
            if length is None:
                length = lengths[len_raw] = _int(len_raw)
            if start < 0 or length < 0 or not path:
                raise _Bail
            append((fqn, offsets))
            append(new(info_type, (path, start, length, ())))
            memo_n += 6
            pos = m.end()
        self.memo_n = memo_n
        return pos

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
                value = stack.pop()
                key = stack.pop()
                _setitem(stack[-1], key, value)
            elif op == 0x75:  # SETITEMS
                base = _pop_mark(marks)
                if base < 1 or type(stack[base - 1]) is not dict or (len(stack) - base) % 2:
                    raise _Bail
                target = stack[base - 1]
                items = stack[base:]
                del stack[base:]
                size = len(target)
                try:
                    target.update(zip(items[::2], items[1::2]))
                except TypeError:  # an unhashable key
                    raise _Bail from None
                if len(target) != size + len(items) // 2:
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
    try:
        return _Reader(data, resolve, records, storage_info, intern).run()
    except (_Bail, IndexError, struct.error, RecursionError, MemoryError):
        return None
