"""``ckptconv inspect``: what a checkpoint holds, as a JSON-able report and as rich output.

- :func:`build_report` reads metadata only (plus small non-tensor entries for previews); the
  result validates against ``schemas/inspect.schema.json``.
- :func:`render_report`, :func:`render_stats` and :func:`render_layout` draw with rich.
  :func:`render_layout` draws a picture of which rank / file holds which region of a tensor.

Works for any :class:`formats.base.CheckpointReader` (DCP, universal store, Hugging Face).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from converter.plan.atoms import root_prefix
from converter.plan.keys import box_text as _box_text
from converter.plan.keys import key_matcher, no_match_message
from converter.plan.source_layout import LayoutReport, TensorLayout, detect_layout, placement_label
from converter.tools.stats import Stats
from converter.tools.tables import Column, print_table
from converter.units import human_bytes, plural
from formats.base import CheckpointIndex, CheckpointReader, TensorEntry
from formats.errors import CkptConvError, ConfigError, MissingClassError, UnsafePickleError, clip
from formats.quant import block_size_of, find_pairs

SCHEMA_ID = "ckptconv.inspect/1"
#: Non-tensor entries larger than this are not loaded for a preview.
PREVIEW_MAX_BYTES = 1 << 20
PREVIEW_CHARS = 60
NEEDS_TRUST = "<needs --trust-pickle>"
#: Top-level state-dict roots that hold optimizer / training state, not model parameters.
NON_MODEL_ROOTS = frozenset({
    "optim", "optimizer", "optimizers", "optim_state", "optimizer_state", "state", "param_groups",
    "lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "dataloader", "train_state",
    "extra", "rng", "rng_state", "trainer",
})


# ---------------------------------------------------------------------------------------------
# selection and classification




def parameter_rule(index: CheckpointIndex) -> tuple[str, Callable[[TensorEntry], bool]]:
    """(description, predicate) saying which tensors count as model parameters.

    By object path: when any tensor lives under a top-level ``model`` entry (torchtitan / DCP
    convention), exactly those; otherwise every tensor outside the optimizer and training-state
    roots (:data:`NON_MODEL_ROOTS`). Persistent buffers count: metadata cannot tell them apart.
    """
    roots = {t.path[0] if t.path else None for t in index.tensors.values()}
    if "model" in roots:
        return "tensors under 'model'; includes persistent buffers", lambda t: bool(t.path) and t.path[0] == "model"
    prefix = root_prefix([t.path for t in index.tensors.values()] + [o.path for o in index.objects.values()])
    if prefix:
        root = (*prefix, "model")
        return (f"tensors under {'.'.join(map(str, root))!r}; includes persistent buffers",
                lambda t: tuple(t.path[: len(root)]) == root)
    return (
        "tensors outside optimizer / training-state roots; includes persistent buffers",
        lambda t: not t.path or t.path[0] not in NON_MODEL_ROOTS,
    )


# ---------------------------------------------------------------------------------------------
# the report


def _files(index: CheckpointIndex) -> list[dict[str, Any]]:
    """Every file the index references (plus metadata files the format lists), with sizes."""
    known = index.info.get("files")
    sizes = dict(known) if isinstance(known, Mapping) else {}
    names = set(index.files) | set(sizes) | set(index.info.get("metadata_files") or ())
    out = []
    for name in sorted(names):
        size = sizes.get(name)
        if size is None:
            path = os.path.join(index.root, name)
            size = os.path.getsize(path) if os.path.isfile(path) else None
        out.append({"name": name, "size": size})
    return out


def _quant_pairs(index: CheckpointIndex) -> dict[str, dict[str, Any]]:
    """Data key -> the ``quant`` field of every block-scaled FP8 / MXFP4 tensor of an HF index
    (block size from the checkpoint's config.json), the scale keys pointing to their data."""
    if index.format != "hf":
        return {}
    from converter.plan.hf_config import load_config_arg, source_config

    try:
        cfg = load_config_arg(source_config(index.root))[0]
        pairs = find_pairs(index.tensors, block_size_of(cfg))
    except CkptConvError:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for p in pairs.values():
        out[p.data] = {"kind": p.kind, "role": "data", "logical_name": p.name, "logical_shape": list(p.shape),
                       "block": list(p.block), "partner": p.scale}
        out[p.scale] = {"kind": p.kind, "role": "scales", "logical_name": p.name, "logical_shape": list(p.shape),
                        "block": list(p.block), "partner": p.data}
    return out


def _tensor_row(t: TensorEntry, lay: TensorLayout, quant: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "key": t.key,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "numel": t.numel,
        "bytes": t.nbytes,
        "chunks": len(t.chunks),
        "split": {str(d): n for d, n in sorted(lay.split_dims.items())},
        "layout": lay.kind,
        "tp_dim": lay.tp_dim,
        "placement": placement_label(lay),
        "files": sorted({c.file for c in t.chunks}),
        "ranks": sorted({c.rank for c in t.chunks if c.rank is not None}),
        **({"layers": lay.layers} if lay.layers else {}),
        **({"quant": quant} if quant else {}),
    }


class ReprOnly(str):
    """A preview text whose repr is itself."""

    def __repr__(self) -> str:
        return str(self)


def object_preview(reader: CheckpointReader, key: str, nbytes: int | None) -> str:
    """A short repr of a non-tensor entry, loaded with the safe unpickler; or why not."""
    if nbytes is not None and nbytes > PREVIEW_MAX_BYTES:
        return f"<{nbytes} bytes, not loaded>"
    try:
        value = reader.load_object(key, trust_pickle=False)
    except UnsafePickleError:
        return NEEDS_TRUST
    except MissingClassError:
        return "<class not importable here>"
    except CkptConvError as e:
        return f"<unreadable: {type(e).__name__}>"
    if isinstance(value, io.BytesIO):  # dcp.save's raw-bytes value type: show the bytes, not an address
        value = ReprOnly(f"BytesIO({value.getvalue()!r})")
    text = " ".join(repr(value).split())
    return clip(text, PREVIEW_CHARS)


def _jsonable(value: Any, depth: int = 0) -> Any:
    """``value`` with anything not JSON-able turned into ``str`` (for ``info``)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if depth > 6:
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v, depth + 1) for v in value]
    return str(value)


def build_report(reader: CheckpointReader, key_pattern: str | None = None, previews: bool = True) -> dict:
    """The inspect report of ``reader``'s checkpoint (JSON-able; ``schemas/inspect.schema.json``).

    Totals (counts, parameters, bytes, layout) cover the whole checkpoint; the per-key lists
    ``tensors`` and ``objects`` hold only keys matching ``key_pattern`` (see :func:`key_matcher`).
    ``previews`` loads small non-tensor entries (safe unpickler) for a short repr.
    """
    index = reader.index()
    layout = detect_layout(index)
    match = key_matcher(key_pattern)
    rule, is_param = parameter_rule(index)
    quant = _quant_pairs(index)
    tensors = [_tensor_row(index.tensors[k], layout.tensors[k], quant.get(k)) for k in sorted(index.tensors) if match(k)]
    objects = [
        {"key": k, "bytes": o.nbytes, "file": o.file,
         "preview": object_preview(reader, k, o.nbytes) if previews else None}
        for k, o in sorted(index.objects.items()) if match(k)
    ]
    files = _files(index)
    info = {k: v for k, v in index.info.items() if k not in ("files", "atoms")}
    return {
        "schema": SCHEMA_ID,
        "path": index.root,
        "format": index.format,
        "version": None if index.info.get("version") is None else str(index.info["version"]),
        "world_size": layout.world_size,
        "layout": _layout_json(layout),
        "num_tensors": len(index.tensors),
        "num_objects": len(index.objects),
        "parameters": sum(t.numel for t in index.tensors.values() if is_param(t)),
        "parameter_rule": rule,
        "tensor_bytes": sum(t.nbytes for t in index.tensors.values()),
        "object_bytes": sum(o.nbytes or 0 for o in index.objects.values()),
        "file_bytes": sum(f["size"] or 0 for f in files),
        "files": files,
        "key_pattern": key_pattern,
        "tensors": tensors,
        "objects": objects,
        "info": _jsonable(info),
    }


def _layout_json(layout: LayoutReport) -> dict[str, Any]:
    return {
        "summary": layout.summary,
        "mesh": dict(layout.mesh),
        "stages": [list(s) for s in layout.stages],
        "notes": list(layout.notes),
    }


# ---------------------------------------------------------------------------------------------
# rich rendering: report and stats


def _ranks_text(ranks: Sequence[int]) -> str:
    if not ranks:
        return "-"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def render_report(report: Mapping[str, Any], console) -> None:
    """Print ``report`` (from :func:`build_report`): a summary, then one row per tensor key and
    one per non-tensor entry (keys are never cut: see :mod:`converter.tools.tables`)."""
    from rich.markup import escape

    r = report
    lines = [
        f"[bold]{escape(str(r['path']))}[/]",
        f"format: {r['format']}" + (f" {r['version']}" if r["version"] else "")
        + (f" ({r['info']['backend']} backend)" if r["info"].get("backend") not in (None, "zarr") else ""),
        f"world size: {_world_text(r)}",
        f"layout: {r['layout']['summary']}",
        f"tensors: {r['num_tensors']}   non-tensor entries: {r['num_objects']}",
        f"parameters: {r['parameters']:,} ({r['parameter_rule']})",
        f"bytes: tensors {human_bytes(r['tensor_bytes'])}, objects {human_bytes(r['object_bytes'])}, "
        f"files {human_bytes(r['file_bytes'])} in {plural(len(r['files']), 'file')}",
    ]
    lines += [f"[yellow]note:[/] {escape(n)}" for n in r["layout"]["notes"]]
    _summary(console, lines)
    if r["tensors"]:
        columns = [Column("key"), Column("dtype"), Column("shape"), Column("chunks", True), Column("size", True),
                   Column("layout"), Column("ranks")]
        rows = []
        for t in r["tensors"]:
            dtype, shape = t["dtype"], "x".join(map(str, t["shape"])) or "()"
            q = t.get("quant")
            if q and q["role"] == "data":  # the logical tensor, its storage after it
                dtype = "mxfp4" if q["kind"] == "mxfp4" else f"{dtype} {'x'.join(map(str, q['block']))} blocks"
                shape = "x".join(map(str, q["logical_shape"])) + (f" (as {q['logical_name']}; stored {shape})"
                                                                   if q["kind"] == "mxfp4" else "")
            elif q:
                dtype = f"{dtype} scales of {q['partner']}"
            rows.append((t["key"], dtype, shape, str(t["chunks"]),
                         human_bytes(t["bytes"]), t["placement"], _ranks_text(t["ranks"])))
        title = "tensors" + (f" matching {r['key_pattern']!r}" if r["key_pattern"] else "")
        print_table(console, title, columns, rows)
    if r["objects"]:
        rows = [(o["key"], human_bytes(o["bytes"]), o["preview"] or "") for o in r["objects"]]
        print_table(console, "non-tensor entries", [Column("key"), Column("size", True), Column("preview")], rows)


def _summary(console, lines: list[str]) -> None:
    """The summary lines in a panel when the longest fits the console, else plain lines."""
    from rich.panel import Panel
    from rich.text import Text

    if max(Text.from_markup(line).cell_len for line in lines) + 4 <= console.width:
        console.print(Panel("\n".join(lines), title="checkpoint", expand=False))
        return
    console.print(Text.from_markup(lines[0]), soft_wrap=True)  # the path: whole, never folded
    for line in lines[1:]:
        console.print(Text.from_markup(line))  # prose: wrapped between words


def _world_text(report: Mapping[str, Any]) -> str:
    if report["world_size"] is not None:
        return str(report["world_size"])
    src = report["info"].get("source")
    if isinstance(src, Mapping) and src.get("world_size"):
        return f"unknown (source checkpoint: {src['world_size']})"
    return "unknown"


def _num(v: float | int | None) -> str:
    if v is None:
        return "-"
    return str(v) if isinstance(v, int) else f"{v:.6g}"


def render_stats(stats: Stats | Iterable[Stats], console) -> None:
    """Print one or more :class:`converter.tools.stats.Stats` as a table (keys and numbers never cut)."""
    rows = [stats] if isinstance(stats, Stats) else list(stats)
    columns = [Column("key"), Column("dtype"), *(Column(c, True) for c in
               ("count", "min", "max", "mean", "std", "nan", "+inf", "-inf", "zeros"))]
    cells = [(s.key + (" (|z|)" if s.of == "abs" else ""), s.dtype, str(s.count), _num(s.min), _num(s.max),
              _num(s.mean), _num(s.std), str(s.nan), str(s.posinf), str(s.neginf), str(s.zeros)) for s in rows]
    print_table(console, "statistics (min/max/mean/std over finite values; std with correction=0)", columns, cells)


# ---------------------------------------------------------------------------------------------
# the layout picture

_SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_COLOURS = ("red", "green", "blue", "yellow", "magenta", "cyan", "bright_red", "bright_green",
            "bright_blue", "bright_yellow", "bright_magenta", "bright_cyan", "dark_orange", "purple",
            "spring_green3", "deep_pink3")
MIXED = "*"  # a cell covered by several chunks (split on a dim the picture hides)
LEGEND_MAX = 32  # legend lines shown before "... and N more chunks"


def axis_cells(size: int, bounds: Sequence[int], n_max: int) -> list[int]:
    """For each character cell along one axis, the global index it stands for.

    ``bounds`` are the chunk boundaries on this axis (0 < b < size). When ``size <= n_max`` every
    index gets the same whole number of cells (exact). Otherwise the cell count in
    ``[n_max // 2, n_max]`` whose grid best matches the boundaries is chosen, every interval
    getting at least one cell; with more intervals than cells, cells sample their centres.
    """
    if size <= 0:
        return []
    if size <= n_max:
        k = n_max // size
        return [i // k for i in range(size * k)]
    cuts = [0, *sorted(set(bounds)), size]
    best = None
    for n in range(max(1, n_max // 2), n_max + 1):
        pos = [round(b * n / size) for b in cuts]
        if any(q <= p for p, q in zip(pos, pos[1:])):
            continue
        err = max(abs(b * n / size - p) for b, p in zip(cuts, pos)) / n
        if best is None or err <= best[0] + 1e-12:
            best = (err, n, pos)
    if best is None:
        return [min(size - 1, int((i + 0.5) * size / n_max)) for i in range(n_max)]
    _, n, pos = best
    return [cuts[j] for j in range(len(cuts) - 1) for _ in range(pos[j + 1] - pos[j])]


def _symbols(lay: TensorLayout) -> list[str]:
    """One symbol per chunk: the rank's digit/letter when ranks are distinct, else the chunk number."""
    ranks = [r for r, _ in lay.owners]
    distinct = None not in ranks and len(set(ranks)) == len(ranks) and max(ranks, default=0) < len(_SYMBOLS)
    idx = ranks if distinct else list(range(len(ranks)))
    return [_SYMBOLS[i % len(_SYMBOLS)] for i in idx]


def _owners_on(lay: TensorLayout, dim: int, reps: list[int]) -> list[frozenset[int]]:
    """For each cell along ``dim``, the chunks whose interval on ``dim`` holds the cell's index."""
    out = []
    for g in reps:
        out.append(frozenset(
            i for i, (_, b) in enumerate(lay.owners)
            if b.numel > 0 and b.offsets[dim] <= g < b.offsets[dim] + b.sizes[dim]
        ))
    return out


def layout_grid(entry: TensorEntry, lay: TensorLayout, width: int, height: int) -> tuple[list[int], list[int], list[list[int | None]]]:
    """(row indices, column indices, grid of chunk numbers) for the picture.

    2-D+: rows follow dim 0 and columns dim 1 (further dims collapsed: -1 marks a cell held by
    several chunks); 1-D: one row along dim 0; 0-d: one cell. None marks a cell no chunk holds.
    """
    shape = entry.shape
    if len(shape) == 0:
        return [0], [0], [[0 if lay.owners else None]]
    rows_dim = 0 if len(shape) >= 2 else None
    col_dim = 1 if len(shape) >= 2 else 0
    boxes = [b for _, b in lay.owners if b.numel > 0]
    col_bounds = [e for b in boxes for e in (b.offsets[col_dim], b.ends[col_dim]) if 0 < e < shape[col_dim]]
    cols = axis_cells(shape[col_dim], col_bounds, width)
    if rows_dim is None:
        rows, row_sets = [0], [frozenset(i for i, (_, b) in enumerate(lay.owners) if b.numel > 0)]
    else:
        row_bounds = [e for b in boxes for e in (b.offsets[0], b.ends[0]) if 0 < e < shape[0]]
        rows = axis_cells(shape[0], row_bounds, height)
        row_sets = _owners_on(lay, 0, rows)
    col_sets = _owners_on(lay, col_dim, cols)
    grid = []
    for rs in row_sets:
        line = []
        for cs in col_sets:
            both = rs & cs
            line.append(next(iter(both)) if len(both) == 1 else (None if not both else -1))
        grid.append(line)
    return rows, cols, grid




def layout_keys(index: CheckpointIndex, pattern: str) -> list[str]:
    """The tensor keys ``--layout PATTERN`` draws: the key itself, else every key the glob (or
    ``re:`` regex) matches; none is an error that suggests the closest keys."""
    if pattern in index.tensors:
        return [pattern]
    keys = [k for k in sorted(index.tensors) if key_matcher(pattern)(k)]
    if not keys:
        raise ConfigError(no_match_message(index, pattern))
    return keys




def render_layout(index: CheckpointIndex, key: str, console, width: int | None = None, height: int = 20) -> None:
    """Draw which rank / file holds which region of tensor ``key``.

    2-D tensors: a grid (rows = dim 0, columns = dim 1) scaled to ``width`` columns and at most
    ``height`` lines; each cell shows the owning chunk's symbol (its rank when ranks are distinct)
    in the chunk's colour. 1-D: a bar; N-D: projected onto dims 0 and 1 (``*`` marks cells split
    on a hidden dim); 0-d: one cell. A legend maps symbols to rank, file and box.
    """
    from rich.text import Text

    entry = index.tensors.get(key)
    if entry is None:
        raise ConfigError(no_match_message(index, key))
    lay = detect_layout(index).tensors[key]
    shape = entry.shape
    width = width or console.width
    margin = len(str(shape[0])) + 2 if len(shape) >= 2 else 2
    head = f"{key}  {entry.dtype}  {tuple(shape)}  {plural(len(entry.chunks), 'chunk')}  ({lay.kind})"
    console.print(Text(head, style="bold"), soft_wrap=True)
    if entry.numel == 0:
        console.print(Text("  (empty tensor: nothing to draw)"))
    else:
        _draw(console, entry, lay, max(4, width - margin - 1), height, margin)
    _legend(console, entry, lay)


def _draw(console, entry: TensorEntry, lay: TensorLayout, width: int, height: int, margin: int) -> None:
    from rich.text import Text

    rows, cols, grid = layout_grid(entry, lay, width, height)
    symbols = _symbols(lay)
    if len(entry.shape) >= 2:
        console.print(Text(" " * margin + _ruler(cols, {b.offsets[1] for _, b in lay.owners}), style="dim"),
                      no_wrap=True, crop=True)
    starts = {0} | {b.offsets[0] for _, b in lay.owners if b.ndim}
    prev = None
    for r, line in zip(rows, grid):
        label = str(r) if (r != prev and r in starts and len(entry.shape) >= 2) else ""
        prev = r
        text = Text(label.rjust(margin - 1) + "|")
        for cell in line:
            if cell is None:
                text.append(".", style="dim")
            elif cell == -1:
                text.append(MIXED, style="bold white")
            else:
                text.append(symbols[cell], style=f"bold black on {_COLOURS[cell % len(_COLOURS)]}")
        console.print(text, no_wrap=True, crop=True)
    if len(entry.shape) > 2:
        console.print(Text(f"  (dims 2..{len(entry.shape) - 1} collapsed; {MIXED} = split on a hidden dim)", style="dim"))


def _ruler(cols: list[int], starts: set[int]) -> str:
    """Column indices written above the cells where a chunk starts (when they fit)."""
    line = [" "] * len(cols)
    free = 0
    for i, c in enumerate(cols):
        if c in starts and (i == 0 or cols[i - 1] != c) and i >= free:
            label = str(c)
            line[i:i + len(label)] = label
            free = i + len(label) + 1
    return "".join(line)[: len(cols)]


def _legend(console, entry: TensorEntry, lay: TensorLayout) -> None:
    from rich.text import Text

    symbols = _symbols(lay)
    files = {b: f for b, f in ((c.box, c.file) for c in entry.chunks)}
    for i, ((rank, box), sym) in enumerate(zip(lay.owners, symbols)):
        if i == LEGEND_MAX:
            console.print(Text(f"  ... and {plural(len(symbols) - i, 'more chunk')}", style="dim"))
            break
        text = Text("  ")
        text.append(f" {sym} ", style=f"bold black on {_COLOURS[i % len(_COLOURS)]}")
        who = f"rank {rank}" if rank is not None else f"chunk {i}"
        text.append(f" {who}  {files.get(box, '?')}  {_box_text(box, entry.shape)}")
        console.print(text, soft_wrap=True)
