"""``--layout KEY --svg FILE``: a picture of which rank / file holds which block of a tensor, as a
hand-written SVG (no drawing library), source and target side by side.

Each panel draws the tensor's chunks as rectangles in global coordinates (rows = dim 0, columns =
dim 1; a 1-D tensor is one bar, a 0-d tensor one cell; dims past 1 are projected onto dims 0-1, as
the text picture does), coloured by the rank whose file holds the chunk, labelled with the rank
(and the file where there is room), with a legend of rank, file and box under it. The colour of a
rank is the same in every panel, so a block that stays on its rank keeps its colour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from formats.base import Box, TensorEntry

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
PANEL_W = 420  # drawing width of one panel (px)
PANEL_H_MAX = 420
BAR_H = 48  # a 1-D tensor's bar
PAD = 24
LEGEND_LINE = 16
LEGEND_MAX = 24  # legend lines per panel before "... and N more"
FONT = "font-family='DejaVu Sans, Arial, sans-serif'"


@dataclass(frozen=True)
class Panel:
    """One side of the picture: a title line, a subtitle and the tensor as one checkpoint holds it."""

    title: str
    subtitle: str  # lines separated by "\n"
    entry: TensorEntry

    def width(self) -> float:
        """The panel's width: the drawing, or its longest text line (estimated) when longer."""
        lines = [(self.title, 7.6)] + [(s, 6.3) for s in self.subtitle.split("\n")]
        return max([PANEL_W] + [len(t) * px for t, px in lines])


def colour(rank: int | None, i: int) -> str:
    """The fill of rank ``rank`` (chunk number ``i`` where the format has no ranks)."""
    return PALETTE[(rank if rank is not None else i) % len(PALETTE)]


def _extent(entry: TensorEntry) -> tuple[int, int]:
    shape = entry.shape
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, max(1, shape[0])
    return max(1, shape[0]), max(1, shape[1])


def _rect_of(box: Box, ndim: int) -> tuple[int, int, int, int]:
    """(row, col, rows, cols) of ``box`` projected onto dims 0-1."""
    if ndim == 0:
        return 0, 0, 1, 1
    if ndim == 1:
        return 0, box.offsets[0], 1, box.sizes[0]
    return box.offsets[0], box.offsets[1], box.sizes[0], box.sizes[1]


def _box_label(box: Box, ndim: int) -> str:
    from converter.plan.keys import box_text as _box_text

    return _box_text(box, tuple(range(ndim))) if ndim else "scalar"


def _panel(panel: Panel, x0: float, y0: float) -> tuple[list[str], float]:
    """SVG elements of one panel at (x0, y0) and its height."""
    e = panel.entry
    rows, cols = _extent(e)
    w = PANEL_W
    h = BAR_H if len(e.shape) <= 1 else max(BAR_H, min(PANEL_H_MAX, PANEL_W * rows / cols))
    sx, sy = w / cols, h / rows
    out = [f"<text x='{x0}' y='{y0 + 14}' {FONT} font-size='13' font-weight='bold'>{escape(panel.title)}</text>"]
    ty = y0 + 14
    for line in panel.subtitle.split("\n"):
        ty += 16
        out.append(f"<text x='{x0}' y='{ty}' {FONT} font-size='11' fill='#444'>{escape(line)}</text>")
    top = ty + 22
    out.append(f"<rect x='{x0}' y='{top}' width='{w:.2f}' height='{h:.2f}' fill='#f4f4f4' stroke='#999'/>")
    chunks = sorted(e.chunks, key=lambda c: (c.box.offsets, c.box.sizes))
    for i, c in enumerate(chunks):
        r, q, nr, nq = _rect_of(c.box, len(e.shape))
        x, y, cw, ch = x0 + q * sx, top + r * sy, nq * sx, nr * sy
        who = f"rank {c.rank}" if c.rank is not None else f"chunk {i}"
        tip = f"{who} · {c.file} · {_box_label(c.box, len(e.shape))}"
        out.append(f"<rect x='{x:.2f}' y='{y:.2f}' width='{cw:.2f}' height='{ch:.2f}' fill='{colour(c.rank, i)}' "
                   f"fill-opacity='0.85' stroke='#fff' stroke-width='1'><title>{escape(tip)}</title></rect>")
        if cw >= 44 and ch >= 16:
            out.append(f"<text x='{x + cw / 2:.2f}' y='{y + ch / 2 + 4:.2f}' {FONT} font-size='11' fill='#fff' "
                       f"text-anchor='middle'>{escape(who)}</text>")
        if cw >= 96 and ch >= 32:
            out.append(f"<text x='{x + cw / 2:.2f}' y='{y + ch / 2 + 18:.2f}' {FONT} font-size='9' fill='#fff' "
                       f"text-anchor='middle'>{escape(c.file)}</text>")
    ly = top + h + 20
    if len(e.shape) >= 2:
        out.append(f"<text x='{x0}' y='{top - 3}' {FONT} font-size='9' fill='#666'>cols 0-{e.shape[1] - 1} "
                   f"&#8594; · rows 0-{e.shape[0] - 1} &#8595;" + (f"  (dims 2..{len(e.shape) - 1} projected)"
                                                                   if len(e.shape) > 2 else "") + "</text>")
    for i, c in enumerate(chunks):
        if i == LEGEND_MAX:
            out.append(f"<text x='{x0}' y='{ly + 4}' {FONT} font-size='10' fill='#444'>... and "
                       f"{len(chunks) - i} more chunks</text>")
            ly += LEGEND_LINE
            break
        who = f"rank {c.rank}" if c.rank is not None else f"chunk {i}"
        out.append(f"<rect x='{x0}' y='{ly - 6}' width='10' height='10' fill='{colour(c.rank, i)}'/>")
        out.append(f"<text x='{x0 + 16}' y='{ly + 3}' {FONT} font-size='10'>{escape(who)} · {escape(c.file)} · "
                   f"{escape(_box_label(c.box, len(e.shape)))}</text>")
        ly += LEGEND_LINE
    return out, ly - y0


def layout_svg(rows: Sequence[Sequence[Panel]]) -> str:
    """An SVG document: one row of panels per tensor (e.g. source | target)."""
    body: list[str] = []
    y = PAD
    width = PAD
    for panels in rows:
        x, row_h = PAD, 0.0
        for p in panels:
            elems, h = _panel(p, x, y)
            body += elems
            row_h = max(row_h, h)
            x += p.width() + 2 * PAD
        width = max(width, x - PAD)
        y += row_h + 2 * PAD
    height = y
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width:.0f}' height='{height:.0f}' "
            f"viewBox='0 0 {width:.0f} {height:.0f}'>\n<rect width='100%' height='100%' fill='#fff'/>\n"
            + "\n".join(body) + "\n</svg>\n")


def write_svg(path: str, rows: Sequence[Sequence[Panel]]) -> None:
    """Write the picture to ``path`` (atomically: a temp file renamed)."""
    from formats.fsutil import atomic_write_bytes
    from pathlib import Path

    atomic_write_bytes(Path(path), layout_svg(rows).encode("utf-8"))
