"""Tables that stay readable at any width and when piped: cells are never cut or folded.

:func:`print_table` draws a rich table when every column fits the console at its natural width.
When it does not (an 80-column terminal, piped output, long keys), each row is printed as its
first cell (the key) whole on a line of its own, followed by the other cells on an indented line:
aligned under one header line when they fit, else as ``name value`` pairs wrapped between fields.
Keys such as ``...attention.wq.weight`` and ``...attention.wk.weight`` stay whole and greppable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

INDENT = "    "
GAP = "  "
#: Longest cell a table shows whole; longer ones (a hostile key of megabytes took rich over 900 s
#: to lay out) are cut, saying how long they were (``--json`` shows them whole).
MAX_CELL_CHARS = 4096


def clip_cell(text: str, limit: int = MAX_CELL_CHARS) -> str:
    """``text`` as a table shows it: whole up to ``limit`` characters, else cut and marked."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 60]}... ({len(text)} characters; --json shows all)"


@dataclass(frozen=True)
class Column:
    """A table column: its header and whether its cells are right-aligned (numbers)."""

    name: str
    right: bool = False


def _widths(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[int]:
    return [max([len(c.name), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]


def _cell(text: str, width: int, right: bool) -> str:
    return text.rjust(width) if right else text.ljust(width)


def table_fits(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> bool:
    """Whether the boxed table (one space of padding, a border between columns) fits ``width``."""
    return sum(_widths(columns, rows)) + 3 * len(columns) + 1 <= width


def print_table(console, title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` (strings, one per column) under ``title``; see the module docstring."""
    from rich.table import Table
    from rich.text import Text

    rows = [tuple(clip_cell(str(c)) for c in r) for r in rows]
    if table_fits(columns, rows, console.width):
        table = Table(title=title)
        for c, w in zip(columns, _widths(columns, rows)):
            table.add_column(c.name, justify="right" if c.right else "left", no_wrap=True, min_width=w)
        for r in rows:
            table.add_row(*r)
        console.print(table)
        return
    console.print(Text(title, style="italic"), soft_wrap=True)
    for line in stacked_lines(columns, rows, console.width):
        console.print(Text(line), soft_wrap=True, highlight=False)


def stacked_lines(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> list[str]:
    """The narrow form: per row, the first cell whole, then the others indented (plain text)."""
    rest = columns[1:]
    widths = _widths(rest, [r[1:] for r in rows])
    aligned = len(INDENT) + sum(widths) + len(GAP) * (len(rest) - 1) <= width
    lines: list[str] = []
    if aligned:
        lines.append(columns[0].name)
        lines.append((INDENT + GAP.join(_cell(c.name, w, c.right) for c, w in zip(rest, widths))).rstrip())
    for r in rows:
        lines.append(r[0])
        if aligned:
            lines.append((INDENT + GAP.join(_cell(v, w, c.right) for c, v, w in zip(rest, r[1:], widths))).rstrip())
        else:
            lines += _wrapped_pairs([f"{c.name} {v}" for c, v in zip(rest, r[1:])], width)
    return lines


def _wrapped_pairs(fields: Sequence[str], width: int) -> list[str]:
    """``fields`` joined by two spaces, broken into lines only between fields."""
    lines, line = [], ""
    for f in fields:
        if line and len(INDENT) + len(line) + len(GAP) + len(f) > width:
            lines.append(INDENT + line)
            line = f
        else:
            line = f"{line}{GAP}{f}" if line else f
    if line:
        lines.append(INDENT + line)
    return lines
