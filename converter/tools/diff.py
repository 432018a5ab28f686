"""``ckptconv diff A B``: compare two checkpoints of any formats, streaming.

Keys present on one side only, dtype and shape mismatches, and for every common tensor: bitwise
equality (NaN payloads compared as bits), else the count of elements outside ``atol + rtol * |b|``,
the largest absolute and relative differences (float64) and the first such element. Tensors are
compared region by region: the intersections of A's chunks with B's chunks (as a conversion
plans its copies), each split into slabs of bounded size, so memory stays small whatever the
checkpoints' size. Non-tensor entries compare by their bytes, then by value.
"""

from __future__ import annotations

import math
import os
import time
from converter.units import human_bytes
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any


from converter.plan.copy_tasks import split_pieces
from converter.run.sources import open_checkpoint
from formats.base import Box, CheckpointIndex, CheckpointReader, ChunkRef, TensorEntry
from formats.errors import ConfigError

if TYPE_CHECKING:
    import torch

#: Elements compared at once per worker (float64 temporaries: a few times 8 bytes each).
SLAB_ELEMENTS = 1 << 20

EQUAL, CLOSE, DIFFERENT, DTYPE, SHAPE = "equal", "close", "different", "dtype", "shape"


def _num(v: float | None) -> float | str | None:
    """A JSON-able number (non-finite values as strings)."""
    if v is None or math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor key compares.

    ``status``: ``equal`` (same dtype, shape and bits), ``close`` (every element within
    tolerance, bits differ), ``different``, ``dtype`` (dtypes differ; values compared after
    casting), ``shape`` (shapes differ; values not compared).
    """

    key: str
    status: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    mismatched: int = 0  # elements whose bits differ
    not_close: int = 0  # elements outside atol + rtol * |b|
    max_abs: float | None = None
    max_rel: float | None = None
    first: tuple[int, ...] | None = None  # first element outside tolerance (else first mismatch)
    first_a: float | None = None
    first_b: float | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "key": self.key, "status": self.status,
            "a": {"dtype": self.dtype_a, "shape": list(self.shape_a)},
            "b": {"dtype": self.dtype_b, "shape": list(self.shape_b)},
        }
        if self.status != SHAPE:
            doc.update(mismatched=self.mismatched, not_close=self.not_close,
                       max_abs=_num(self.max_abs), max_rel=_num(self.max_rel))
        if self.first is not None:
            doc["first"] = {"index": list(self.first), "a": _num(self.first_a), "b": _num(self.first_b)}
        return doc


@dataclass(frozen=True)
class ObjectDiff:
    """How one non-tensor key compares: ``equal`` (same bytes), ``equal-value`` (bytes differ,
    loaded values equal) or ``different``; ``detail`` says why."""

    key: str
    status: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        doc = {"key": self.key, "status": self.status}
        if self.detail:
            doc["detail"] = self.detail
        return doc


@dataclass(frozen=True)
class DiffReport:
    """Everything ``diff`` found. ``same`` when nothing is missing and every key compares equal
    (or within tolerance)."""

    a: str
    b: str
    format_a: str
    format_b: str
    atol: float
    rtol: float
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    tensors: tuple[TensorDiff, ...]
    objects: tuple[ObjectDiff, ...]
    bytes_compared: int = 0
    seconds: float = 0.0

    @property
    def same(self) -> bool:
        return (not self.only_a and not self.only_b
                and all(t.status in (EQUAL, CLOSE) for t in self.tensors)
                and all(o.status != DIFFERENT for o in self.objects))

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (``schemas/diff.schema.json``)."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.status] = counts.get(t.status, 0) + 1
        return {
            "a": {"path": self.a, "format": self.format_a},
            "b": {"path": self.b, "format": self.format_b},
            "same": self.same,
            "atol": self.atol, "rtol": self.rtol,
            "only_a": list(self.only_a), "only_b": list(self.only_b),
            "counts": counts,
            "tensors": [t.to_json() for t in self.tensors],
            "objects": [o.to_json() for o in self.objects],
            "bytes_compared": self.bytes_compared,
            "seconds": round(self.seconds, 3),
        }


# ---------------------------------------------------------------------------------------------
# slab statistics


@dataclass
class _Stats:
    """Running comparison of one tensor, merged over its slabs."""

    mismatched: int = 0
    not_close: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    first: tuple[int, ...] | None = None
    first_a: float | None = None
    first_b: float | None = None
    first_close: bool = True  # whether ``first`` is only a bit mismatch (within tolerance)
    nbytes: int = 0

    def merge(self, o: _Stats) -> None:
        self.mismatched += o.mismatched
        self.not_close += o.not_close
        self.max_abs = _max(self.max_abs, o.max_abs)
        self.max_rel = _max(self.max_rel, o.max_rel)
        self.nbytes += o.nbytes
        if o.first is not None and (self.first is None or (o.first_close, o.first) < (self.first_close, self.first)):
            self.first, self.first_a, self.first_b, self.first_close = o.first, o.first_a, o.first_b, o.first_close


def _max(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # torch dtype names


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers (complex: two per element)."""
    import torch

    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(getattr(torch, _BITS[t.element_size()]))


def _wide(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


def compare_slab(a: torch.Tensor, b: torch.Tensor, offsets: Sequence[int], atol: float, rtol: float) -> _Stats:
    """Compare two same-shaped slabs whose first element is at global ``offsets``."""
    import torch

    s = _Stats(nbytes=a.numel() * a.element_size() + b.numel() * b.element_size())
    if a.numel() == 0:
        return s
    if a.dtype == b.dtype:
        diff_bits = _bits(a) != _bits(b)
        if a.is_complex():
            diff_bits = diff_bits.any(-1)
        if not bool(diff_bits.any()):
            return s
        s.mismatched = int(diff_bits.sum())
    else:
        diff_bits = None
    if a.is_floating_point() or b.is_floating_point() or a.is_complex() or b.is_complex():
        x, y = _wide(a), _wide(b)
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
    else:  # integers and bools: exact in the promoted type
        common = torch.promote_types(a.dtype, b.dtype)
        same = a.to(common) == b.to(common)
        x, y = a.to(torch.float64), b.to(torch.float64)
    if diff_bits is None:
        s.mismatched = int((~same).sum())
    absdiff = torch.nan_to_num((x - y).abs(), nan=math.inf, posinf=math.inf).masked_fill(same, 0.0)
    scale = y.abs()
    rel = torch.where(absdiff == 0, torch.zeros_like(absdiff), absdiff / scale)
    rel = torch.nan_to_num(rel, nan=math.inf, posinf=math.inf)
    finite = torch.isfinite(x) & torch.isfinite(y)  # infinities are close only when equal
    close = same | (finite & (absdiff <= atol + rtol * scale))
    s.not_close = int((~close).sum())
    s.max_abs, s.max_rel = float(absdiff.max()), float(rel.max())
    bad = ~close if s.not_close else (diff_bits if diff_bits is not None else ~same)
    flat = int(torch.nonzero(bad.reshape(-1))[0])
    local = _unravel(flat, tuple(a.shape))
    s.first = tuple(o + i for o, i in zip(offsets, local))
    s.first_close = not s.not_close
    s.first_a, s.first_b = _scalar(a.reshape(-1)[flat]), _scalar(b.reshape(-1)[flat])
    return s


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def _scalar(t: torch.Tensor) -> float:
    import torch

    if t.is_complex():
        return float(t.abs())
    return float(t.to(torch.float64)) if t.dtype != torch.bool else float(t)


# ---------------------------------------------------------------------------------------------
# regions


def aligned_regions(chunks_a: Sequence[ChunkRef], chunks_b: Sequence[ChunkRef]) -> list[tuple[ChunkRef, ChunkRef, Box]]:
    """Every non-empty intersection of a chunk of A with a chunk of B (chunks of one side are
    disjoint), found with a sweep along dim 0."""
    live_a = [c for c in chunks_a if c.box.numel or not c.box.ndim]
    live_b = sorted((c for c in chunks_b if c.box.numel or not c.box.ndim),
                    key=lambda c: c.box.offsets[:1])
    out = []
    for ca in live_a:
        for cb in live_b:
            if ca.box.ndim and cb.box.offsets[0] >= ca.box.ends[0]:
                break
            region = ca.box.intersect(cb.box)
            if region is not None and (region.numel or not region.ndim):
                out.append((ca, cb, region))
    return out


def _compare_tensor(ra: CheckpointReader, rb: CheckpointReader, ea: TensorEntry, eb: TensorEntry,
                    key_a: str, key_b: str, atol: float, rtol: float, slab: int) -> _Stats:
    total = _Stats()
    for ca, cb, region in aligned_regions(ea.chunks, eb.chunks):
        for piece in split_pieces(region, 8, slab * 8):
            a = ra.read_region(key_a, ca, piece)
            b = rb.read_region(key_b, cb, piece)
            total.merge(compare_slab(a, b, piece.offsets, atol, rtol))
    return total


def _result(key: str, ea: TensorEntry, eb: TensorEntry, st: _Stats | None) -> TensorDiff:
    base = TensorDiff(key, SHAPE, ea.dtype, eb.dtype, tuple(ea.shape), tuple(eb.shape))
    if st is None:
        return base
    if ea.dtype != eb.dtype:
        status = DTYPE
    elif st.mismatched == 0:
        status = EQUAL
    else:
        status = CLOSE if st.not_close == 0 else DIFFERENT
    numeric = st.mismatched > 0 or ea.dtype != eb.dtype
    return replace(base, status=status, mismatched=st.mismatched, not_close=st.not_close,
                   max_abs=st.max_abs if numeric else 0.0, max_rel=st.max_rel if numeric else 0.0,
                   first=st.first, first_a=st.first_a, first_b=st.first_b)


# ---------------------------------------------------------------------------------------------
# objects


def _values_equal(x: Any, y: Any) -> bool:
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return False
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        return x.numel() == 0 or bool((_bits(x.cpu()) == _bits(y.cpu())).all())
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        return x.keys() == y.keys() and all(_values_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_values_equal(a, b) for a, b in zip(x, y))
    try:
        return bool(x == y) or (x != x and y != y)
    except Exception:  # noqa: BLE001 - arbitrary user classes: fall back to "not equal"
        return False


def _compare_object(ra: CheckpointReader, rb: CheckpointReader, ka: str, kb: str, key: str,
                    trust_pickle: bool) -> ObjectDiff:
    if ra.read_object_bytes(ka) == rb.read_object_bytes(kb):
        return ObjectDiff(key, EQUAL)
    from formats.errors import UnsafePickleError

    try:
        va, vb = ra.load_object(ka, trust_pickle), rb.load_object(kb, trust_pickle)
    except UnsafePickleError:
        return ObjectDiff(key, DIFFERENT, "bytes differ; comparing the values needs --trust-pickle")
    if _values_equal(va, vb):
        return ObjectDiff(key, "equal-value", "bytes differ, values equal")
    return ObjectDiff(key, DIFFERENT, "values differ")


# ---------------------------------------------------------------------------------------------
# key selection


def _selected(index: CheckpointIndex, key_pattern: str | None, model_only: bool) -> tuple[dict[str, str], dict[str, str]]:
    """(compared name -> tensor key, compared name -> object key) of one side."""
    from converter.plan.keys import key_matcher

    if model_only:
        from converter.plan.hf_export import model_weights

        tensors = {fqn: key for key, fqn in model_weights(index).items()}
        objects: dict[str, str] = {}
    else:
        tensors = {k: k for k in index.tensors}
        objects = {k: k for k in index.objects}
    if key_pattern is not None:
        match = key_matcher(key_pattern)
        tensors = {n: k for n, k in tensors.items() if match(n)}
        objects = {n: k for n, k in objects.items() if match(n)}
    return tensors, objects


def _as_exported(ra: CheckpointReader, rb: CheckpointReader, a: str | os.PathLike, b: str | os.PathLike,
                 key_map: str, config: Any) -> tuple[CheckpointReader, CheckpointReader]:
    """Each non-HF side seen through ``key_map`` exactly as export-hf would write it."""
    from converter.plan.hf_config import load_config_arg, source_config
    from converter.plan.hf_export import plan_export
    from converter.run.mapped_reader import MappedReader
    from converter.plan.key_maps import get_key_map

    kmap = get_key_map(key_map)
    if config is None:  # the export's own config.json (export-hf writes one), else one beside the source
        config = next((c for c in (source_config(p) for p in (b, a)) if c is not None), None)
    cfg, _ = load_config_arg(config)

    def view(reader: CheckpointReader) -> CheckpointReader:
        index = reader.index()
        if index.format == "hf":
            return reader
        return MappedReader(reader, plan_export(index, kmap, None, cfg).sources)

    return view(ra), view(rb)


def diff(a: str | os.PathLike, b: str | os.PathLike, *, atol: float = 0.0, rtol: float = 0.0,
         key_pattern: str | None = None, model_only: bool = False, trust_pickle: bool = False,
         workers: int | None = None, slab_elements: int = SLAB_ELEMENTS, key_map: str | None = None,
         config: str | os.PathLike | Mapping[str, Any] | None = None, verify_source: bool = True) -> DiffReport:
    """Compare the checkpoints at ``a`` and ``b`` (any formats), streaming.

    ``atol``/``rtol``: an element is close when ``|a - b| <= atol + rtol * |b|`` (NaN equals NaN).
    ``key_pattern``: only keys matching a glob (or ``re:REGEX``). ``model_only``: compare model
    weights only, named by their model FQN (so a DCP checkpoint compares with its HF export).
    ``key_map`` (export-hf's map names and files, e.g. ``torchtitan-llama``): a side that is not a
    Hugging Face directory is seen as export-hf would write it (HF names, q/k rows permuted, head
    counts from ``config`` or a ``config.json`` of either side); implies ``model_only``.
    ``verify_source``: check each chunk's stored checksum as it is read (a damaged chunk is an
    error, exit status 2, not a difference).
    """
    from converter import knobs

    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise ConfigError(f"--atol and --rtol must be non-negative numbers (got {atol}, {rtol})")
    if slab_elements < 1:
        raise ConfigError("slab size must be positive")
    start = time.perf_counter()
    ra = open_checkpoint(a, trust_pickle=trust_pickle, verify=verify_source)
    try:
        rb = open_checkpoint(b, trust_pickle=trust_pickle, verify=verify_source)
        try:
            va, vb = (ra, rb) if key_map is None else _as_exported(ra, rb, a, b, key_map, config)
            return _diff(va, vb, str(a), str(b), atol, rtol, key_pattern, model_only or key_map is not None,
                         trust_pickle, workers or knobs.WORKERS, slab_elements, start)
        finally:
            rb.close()
    finally:
        ra.close()


def _diff(ra: CheckpointReader, rb: CheckpointReader, a: str, b: str, atol: float, rtol: float,
          key_pattern: str | None, model_only: bool, trust_pickle: bool, workers: int, slab: int,
          start: float) -> DiffReport:
    ia, ib = ra.index(), rb.index()
    ta, oa = _selected(ia, key_pattern, model_only)
    tb, ob = _selected(ib, key_pattern, model_only)
    names_a, names_b = set(ta) | set(oa), set(tb) | set(ob)
    common_t = [n for n in ta if n in tb]
    common_o = [n for n in oa if n in ob]
    kind_clash = sorted((set(ta) & set(ob)) | (set(oa) & set(tb)))

    def tensor_job(name: str) -> tuple[TensorDiff, int]:
        ea, eb = ia.tensors[ta[name]], ib.tensors[tb[name]]
        if tuple(ea.shape) != tuple(eb.shape):
            return _result(name, ea, eb, None), 0
        st = _compare_tensor(ra, rb, ea, eb, ta[name], tb[name], atol, rtol, slab)
        return _result(name, ea, eb, st), st.nbytes

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptconv-diff") as pool:
        results = list(pool.map(tensor_job, common_t))
    objects = [_compare_object(ra, rb, oa[n], ob[n], n, trust_pickle) for n in common_o]
    objects += [ObjectDiff(n, DIFFERENT, "a tensor on one side, a non-tensor entry on the other") for n in kind_clash]
    return DiffReport(
        a=a, b=b, format_a=ia.format, format_b=ib.format, atol=atol, rtol=rtol,
        only_a=tuple(sorted(names_a - names_b)), only_b=tuple(sorted(names_b - names_a)),
        tensors=tuple(r for r, _ in results), objects=tuple(objects),
        bytes_compared=sum(n for _, n in results), seconds=time.perf_counter() - start,
    )


# ---------------------------------------------------------------------------------------------
# text rendering


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.6g}"


def render_text(report: DiffReport, show: int = 50) -> str:
    """The human report: what differs, then a summary line."""
    lines = [f"A: {report.a} ({report.format_a})", f"B: {report.b} ({report.format_b})"]

    def listing(title: str, items: Sequence[str]) -> None:
        if items:
            lines.append(f"{title} ({len(items)}):")
            lines.extend(f"  {i}" for i in items[:show])
            if len(items) > show:
                lines.append(f"  ... and {len(items) - show} more (use --json for all)")

    if not report.tensors and report.only_a and report.only_b:
        lines.append("note: A and B have no key in common; comparing a checkpoint with its Hugging Face export? "
                     "pass the export's --map (e.g. --map torchtitan-llama)")
    listing("only in A", report.only_a)
    listing("only in B", report.only_b)
    listing("shape mismatch", [f"{t.key}: {t.dtype_a}{list(t.shape_a)} vs {t.dtype_b}{list(t.shape_b)}"
                               for t in report.tensors if t.status == SHAPE])
    listing("dtype mismatch", [f"{t.key}: {t.dtype_a} vs {t.dtype_b}; {_value_text(t)}"
                               for t in report.tensors if t.status == DTYPE])
    listing("different", [f"{t.key}: {_value_text(t)}" for t in report.tensors if t.status == DIFFERENT])
    listing("close (within tolerance, bits differ)", [f"{t.key}: {_value_text(t)}"
                                                      for t in report.tensors if t.status == CLOSE])
    listing("non-tensor entries that differ", [f"{o.key}: {o.detail}" for o in report.objects if o.status == DIFFERENT])
    equal_t = sum(t.status == EQUAL for t in report.tensors)
    equal_o = sum(o.status != DIFFERENT for o in report.objects)
    verdict = "same" if report.same else "DIFFERENT"
    lines.append(f"{verdict}: {equal_t} of {len(report.tensors)} common tensors bitwise equal, "
                 f"{equal_o} of {len(report.objects)} common non-tensor entries equal; "
                 f"{human_bytes(report.bytes_compared)} compared in {report.seconds:.2f}s "
                 f"(atol={report.atol:g}, rtol={report.rtol:g})")
    return "\n".join(lines)


def _value_text(t: TensorDiff) -> str:
    text = (f"{t.not_close} elements outside tolerance, {t.mismatched} differ in bits, "
            f"max abs {_fmt(t.max_abs)}, max rel {_fmt(t.max_rel)}")
    if t.first is not None:
        text += f", first at {list(t.first)}: {_fmt(t.first_a)} vs {_fmt(t.first_b)}"
    return text
