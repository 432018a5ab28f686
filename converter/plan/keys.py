"""Matching keys: the glob / ``re:`` patterns every command's ``--key``/``--keys`` takes, the
"no key matches" message with the closest keys, and how a chunk's box is written in text."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable

from formats.base import CheckpointIndex
from formats.errors import ConfigError


def key_matcher(pattern: str | None) -> Callable[[str], bool]:
    """A predicate for ``pattern``: a glob (``fnmatch``, whole key), or a regex after ``re:``
    (``re.search``). None matches everything."""
    if pattern is None:
        return lambda key: True
    if pattern.startswith("re:"):
        try:
            rx = re.compile(pattern[3:])
        except re.error as e:
            raise ConfigError(f"bad key pattern {pattern!r}: {e}; write a Python regex after 're:'") from None
        return lambda key: rx.search(key) is not None
    return lambda key: fnmatch.fnmatchcase(key, pattern)


def no_match_message(index: CheckpointIndex, pattern: str, what: str = "tensor") -> str:
    """``<root>: no tensor matches 'x'; did you mean 'a', 'b'?`` (difflib's closest keys), with how
    to list the keys."""
    import difflib

    close = difflib.get_close_matches(pattern, list(index.tensors), n=3, cutoff=0.6)
    if not close and not pattern.startswith("re:"):
        stem = pattern.replace("*", "").replace("?", "").strip(".")
        close = [k for k in sorted(index.tensors) if stem and stem in k][:3]
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (f"{index.root}: no {what} matches {pattern!r}{hint} (list keys with 'ckptconv inspect {index.root}'; "
            "patterns are globs, e.g. 'model.layers.0.*', or 're:REGEX')")


def box_text(box, shape) -> str:
    """``rows 0-3  cols 4-7`` (``scalar`` for 0-d; an empty dim says so)."""
    if not shape:
        return "scalar"
    names = ("rows", "cols", *(f"dim{d}" for d in range(2, len(shape)))) if len(shape) >= 2 else ("elems",)
    parts = []
    for d, name in enumerate(names):
        o, s = box.offsets[d], box.sizes[d]
        parts.append(f"{name} {o}-{o + s - 1}" if s else f"{name} {o} (empty)")
    return "  ".join(parts)
