"""Tensor-parallel DeepSpeed saves (``mp_rank_XX`` files, TP through an ``mpu`` as
Megatron-DeepSpeed passes it): each TP rank's tensors joined into the global ones (pure planning
on metadata).

How the slices join is what the checkpoint says, with the semantics of DeepSpeed's own
``deepspeed/checkpoint/ds_to_universal.py`` (``merge_tp_slices``, DeepSpeed 0.19.8): the
model-states file's ``universal_checkpoint_info`` (Megatron-DeepSpeed writes it) lists regex
patterns (``re.match`` on the parameter name, at most one match per list):

* ``tp_replicated_parameter_patterns``: every rank holds the same tensor; rank 0's is taken;
* ``parameter_with_2_sub_params_cat_dim_0``: each rank's slice is two halves (``torch.chunk(s, 2)``
  on dim 0): the ranks' first halves, then their second halves, on dim 0;
* ``parameter_with_row_parallelism_patterns``: the slices joined on dim 1;
* anything else: joined on dim 0;
* then ``vocabulary_parameter_patterns``: the joined tensor cut to ``original_vocab_size`` rows
  (the vocabulary padding dropped).

``parameter_to_average_patterns`` (a computed mean, not a join), ``parameter_with_sub_params``,
``affine_map`` and ``autotp_unsupported_parameter_patterns`` are refused in one line. A join is
chunks of the ranks' own chunks placed at offsets (a chunk's locator gains the strides of its
rank's shape): nothing is read or concatenated.

Without ``universal_checkpoint_info`` (a plain ``mpu``, an Accelerate save) the split dims are
unknown: the reader refuses, unless rules with the same keys are given in a JSON file
(``--ds-tp-rules`` / ``$CKPTCONV_DS_TP_RULES``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from formats.base import Box, ChunkRef, TensorEntry
from formats.dcp.archive_writer import contiguous_strides
from formats.deepspeed_zero.index import Copy
from formats.errors import CorruptCheckpointError, InvalidCheckpointError, UnsupportedError

#: The environment variable naming a rules file (``ckptconv --ds-tp-rules FILE`` sets it).
RULES_ENV = "CKPTCONV_DS_TP_RULES"
INFO_KEY = "universal_checkpoint_info"
REPLICATED = "tp_replicated_parameter_patterns"
ROW = "parameter_with_row_parallelism_patterns"
VOCAB = "vocabulary_parameter_patterns"
TWO_SUB = "parameter_with_2_sub_params_cat_dim_0"
AVERAGE = "parameter_to_average_patterns"
SUB_PARAMS = "parameter_with_sub_params"
AFFINE = "affine_map"
AUTOTP_UNSUPPORTED = "autotp_unsupported_parameter_patterns"
ORIGINAL_VOCAB = "original_vocab_size"
PATTERN_KEYS = (REPLICATED, ROW, VOCAB, TWO_SUB, AVERAGE)
#: Keys a rules file may hold (the rest of ``universal_checkpoint_info`` plays no part in the join).
RULE_KEYS = frozenset({*PATTERN_KEYS, ORIGINAL_VOCAB, "padded_vocab_size", "universal_checkpoint_version",
                       "pipeline_replicated_parameter_patterns", SUB_PARAMS, AFFINE, AUTOTP_UNSUPPORTED,
                       "sub_param_shard_widths"})
HOW_TO = (f"give the rules in a JSON file with ds_to_universal's keys ({REPLICATED}, {ROW}, {VOCAB} and "
          f"{ORIGINAL_VOCAB}, {TWO_SUB}): ckptconv --ds-tp-rules RULES.json <command> (README, DeepSpeed tensor-parallel saves), or "
          f"save with client_state={{'{INFO_KEY}': ...}} as Megatron-DeepSpeed does")


@dataclass(frozen=True)
class Join:
    """How one parameter's TP slices join: ``kind`` ``"replicated"``, ``"cat"`` (on ``dim``) or
    ``"two_sub"`` (two halves each, on dim 0); ``rows``: keep that many rows after (vocabulary)."""

    kind: str
    dim: int = 0
    rows: int | None = None


@dataclass(frozen=True)
class TpRules:
    """The join patterns of a save (``universal_checkpoint_info`` or a rules file)."""

    patterns: Mapping[str, tuple[str, ...]]
    original_vocab_size: int | None
    refused: Mapping[str, str]  # key -> why (keys present that this reader does not join)
    source: str  # where the rules come from, for messages

    @classmethod
    def parse(cls, info: Any, source: str) -> TpRules:
        """Validate ``info`` (a dict with ds_to_universal's keys); errors name ``source``."""
        if not isinstance(info, Mapping):
            raise InvalidCheckpointError(f"{source}: the TP rules are a {type(info).__name__}, not a mapping of "
                                         f"ds_to_universal's keys ({', '.join(PATTERN_KEYS)})")
        patterns: dict[str, tuple[str, ...]] = {}
        for key in PATTERN_KEYS:
            value = info.get(key, [])
            if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
                raise InvalidCheckpointError(f"{source}: {key!r} must be a list of regex strings, not {value!r}")
            for p in value:
                try:
                    re.compile(p)
                except re.error as e:
                    raise InvalidCheckpointError(f"{source}: {key!r}: pattern {p!r} is not a regex ({e})") from None
            patterns[key] = tuple(value)
        vocab = info.get(ORIGINAL_VOCAB)
        if vocab is not None and (type(vocab) is not int or vocab < 1):
            raise InvalidCheckpointError(f"{source}: {ORIGINAL_VOCAB!r} must be a positive integer, not {vocab!r}")
        if patterns[VOCAB] and vocab is None:
            raise InvalidCheckpointError(f"{source}: {VOCAB!r} is given without {ORIGINAL_VOCAB!r} (the vocabulary "
                                         "size before padding); add it")
        refused = {}
        if info.get(SUB_PARAMS):
            refused[SUB_PARAMS] = "sub-parameters of uneven widths (SubparamShape)"
        if isinstance(info.get(AFFINE), Mapping) and info[AFFINE].get("params"):
            refused[AFFINE] = "an affine map of each parameter's pieces"
        if info.get(AUTOTP_UNSUPPORTED):
            refused[AUTOTP_UNSUPPORTED] = f"parameters AutoTP marked unconvertible ({info[AUTOTP_UNSUPPORTED]!r})"
        return cls(patterns, vocab, refused, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> TpRules:
        """A rules file: JSON with ds_to_universal's keys (unknown keys refused, to catch typos)."""
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
        except FileNotFoundError:
            raise InvalidCheckpointError(f"{path}: no such TP rules file (--ds-tp-rules)") from None
        except (OSError, ValueError) as e:
            raise InvalidCheckpointError(f"{path}: not a JSON TP rules file ({e})") from None
        if isinstance(info, Mapping):
            unknown = sorted(set(info) - RULE_KEYS)
            if unknown:
                raise InvalidCheckpointError(f"{path}: unknown TP rules key(s) {', '.join(map(repr, unknown))}; "
                                             f"known: {', '.join(PATTERN_KEYS)}, {ORIGINAL_VOCAB}")
        return cls.parse(info, str(path))

    def _match(self, key: str, name: str) -> str | None:
        found = [p for p in self.patterns[key] if re.match(p, name)]
        if len(found) > 1:
            raise InvalidCheckpointError(f"{self.source}: parameter {name!r} matches {len(found)} {key} "
                                         f"({', '.join(map(repr, found))}); ds_to_universal allows one")
        return found[0] if found else None

    def join_of(self, name: str) -> Join:
        """How parameter ``name``'s slices join (ds_to_universal's order of the categories)."""
        for key, why in self.refused.items():
            raise UnsupportedError(f"{self.source}: {key} ({why}) is not supported yet by the direct reader; "
                                   "convert with DeepSpeed's ds_to_universal.py, then ckptconv import-ds")
        rows = self.original_vocab_size if self._match(VOCAB, name) else None
        if self._match(REPLICATED, name):
            return Join("replicated", 0, rows)
        if self._match(AVERAGE, name):
            raise UnsupportedError(f"{self.source}: parameter {name!r} is in {AVERAGE} (its TP ranks' mean, computed, "
                                   "not a join) and not supported yet: convert with DeepSpeed's ds_to_universal.py, "
                                   "then ckptconv import-ds")
        if self._match(TWO_SUB, name):
            return Join("two_sub", 0, rows)
        return Join("cat", 1 if self._match(ROW, name) else 0, rows)


def rules_from_env() -> TpRules | None:
    """The rules file ``$CKPTCONV_DS_TP_RULES`` names, or None."""
    path = os.environ.get(RULES_ENV)
    return TpRules.load(path) if path else None


# ---------------------------------------------------------------------------------------------
# joining the entries of one key


def _strides(chunk: ChunkRef, local: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(chunk.locator[2]) if len(chunk.locator) > 2 else contiguous_strides(local)


def _place(chunk: ChunkRef, local: tuple[int, ...], dim: int, lo: int, hi: int, at: int, rank: int) -> ChunkRef | None:
    """The part of ``chunk`` (of a rank's tensor of shape ``local``) in ``[lo, hi)`` along ``dim``,
    moved so that ``lo`` lands at global ``at``; None when nothing of it is there."""
    box = chunk.box
    start, stop = max(box.offsets[dim], lo), min(box.offsets[dim] + box.sizes[dim], hi)
    if start >= stop or not box.numel:
        return None
    if chunk.locator[0] < 0:  # a value held in memory: only scalars are, and they never join
        raise CorruptCheckpointError(f"{chunk.file}: an in-memory value of shape {list(local)} in a TP join")
    strides = _strides(chunk, local)
    base = chunk.locator[1] + (start - box.offsets[dim]) * strides[dim]
    offsets = list(box.offsets)
    sizes = list(box.sizes)
    offsets[dim], sizes[dim] = start - lo + at, stop - start
    return ChunkRef(Box(tuple(offsets), tuple(sizes)), chunk.file, (chunk.locator[0], base, strides), rank)


def _check_shapes(key: str, shapes: Sequence[tuple[int, ...]], dim: int | None, where: str) -> None:
    first = shapes[0]
    for r, s in enumerate(shapes):
        other = [d for i, d in enumerate(s) if i != dim]
        if len(s) != len(first) or other != [d for i, d in enumerate(first) if i != dim]:
            how = "the same shape" if dim is None else f"the same sizes but on dim {dim}"
            raise CorruptCheckpointError(f"{where}: key {key!r}: TP rank {r} holds {list(s)}, rank 0 {list(first)}; a "
                                         f"join needs {how} (the rules do not fit this parameter, or the files are "
                                         "from different saves)")


def join_entries(key: str, entries: Sequence[TensorEntry], join: Join, ranks: Sequence[Sequence[int]],
                 where: str) -> TensorEntry:
    """The global entry of ``key`` from each TP rank's entry (rank order), as ``join`` says;
    ``ranks[t]``: TP rank ``t``'s global rank of each of its data-parallel ranks (chunk owners)."""
    shapes = [tuple(e.shape) for e in entries]
    first = entries[0]
    if any(e.dtype != first.dtype for e in entries):
        raise CorruptCheckpointError(f"{where}: key {key!r}: the TP ranks hold {sorted({e.dtype for e in entries})}")
    if join.kind == "replicated" or not shapes[0]:
        _check_shapes(key, shapes, None, where)
        joined = first
    else:
        dim = join.dim
        if len(shapes[0]) <= dim:
            raise InvalidCheckpointError(f"{where}: key {key!r} has {len(shapes[0])} dim(s), its rule joins on dim "
                                         f"{dim} ({'row-parallel' if dim else 'a 2-sub-parameter split'})")
        _check_shapes(key, shapes, dim, where)
        # (lo, hi) of each rank's slice along dim, per part; the parts follow one another
        if join.kind == "two_sub":
            if any(s[0] < 2 for s in shapes):
                raise InvalidCheckpointError(f"{where}: key {key!r}: a TP slice of {shapes[0][0]} row(s) cannot hold "
                                             f"two sub-parameters ({TWO_SUB})")
            halves = [-(-s[0] // 2) for s in shapes]  # torch.chunk(s, 2, dim=0): ceil(n / 2) first
            parts = [[(0, h) for h in halves], [(h, s[0]) for h, s in zip(halves, shapes)]]
        else:
            parts = [[(0, s[dim]) for s in shapes]]
        chunks: list[ChunkRef] = []
        at = 0
        for part in parts:
            for t, ((lo, hi), e) in enumerate(zip(part, entries)):
                for c in e.chunks:
                    owner = _owner(ranks, t, c.rank)
                    placed = _place(c, shapes[t], dim, lo, hi, at, owner)
                    if placed is not None:
                        chunks.append(placed)
                at += hi - lo
        shape = list(shapes[0])
        shape[dim] = at
        joined = TensorEntry(key, first.dtype, tuple(shape), tuple(chunks), first.path)
    if join.rows is not None:
        joined = _cut_rows(joined, join.rows, where)
    return joined


def _owner(ranks: Sequence[Sequence[int]], tp: int, dp: int | None) -> int | None:
    if dp is None or tp >= len(ranks) or dp >= len(ranks[tp]):
        return dp
    return ranks[tp][dp]


def _cut_rows(entry: TensorEntry, rows: int, where: str) -> TensorEntry:
    """``param[:rows, :]`` (ds_to_universal's removal of the vocabulary padding)."""
    if len(entry.shape) < 2:
        raise InvalidCheckpointError(f"{where}: key {entry.key!r} has {len(entry.shape)} dim(s); {VOCAB} cuts "
                                     "rows of a 2-D table")
    if rows > entry.shape[0]:
        raise InvalidCheckpointError(f"{where}: key {entry.key!r}: {ORIGINAL_VOCAB} {rows} exceeds its "
                                     f"{entry.shape[0]} rows")
    chunks = []
    for c in entry.chunks:
        kept = _place(c, tuple(entry.shape), 0, 0, rows, 0, c.rank) if c.box.numel else None
        if kept is not None:
            chunks.append(kept)
    shape = (rows, *entry.shape[1:])
    return TensorEntry(entry.key, entry.dtype, shape, tuple(chunks), entry.path)


#: What a TP-replicated tensor's copy that differs from rank 0's means.
REPLICA_WHY = ("though the rules call it replicated (tp_replicated_parameter_patterns); ds_to_universal.py refuses it "
               "too: check the rules")


def join_of(rules: TpRules, entry: TensorEntry) -> Join:
    """How ``entry``'s TP slices join: by its parameter's rules; a scalar, or a key of no
    parameter (an object's tensor), is replicated."""
    name = param_name(entry)
    return rules.join_of(name) if name is not None and entry.shape else Join("replicated")


def check_same_keys(tensors: Sequence[Mapping[str, TensorEntry]], files: Sequence[object]) -> None:
    """Every TP rank holds rank 0's keys in rank 0's order; else one line naming the rank's file."""
    for t, other in enumerate(tensors[1:], 1):
        if list(other) != list(tensors[0]):
            only = sorted(set(other) ^ set(tensors[0]))
            diff = f"key {only[0]!r} only on one" if only else "the same keys in another order"
            raise CorruptCheckpointError(f"{files[t]}: tensor-parallel rank {t} holds other tensors than rank 0 "
                                         f"({diff}); the files are from different saves")


def join_all(tensors: Sequence[Mapping[str, TensorEntry]], rules: TpRules, ranks: Sequence[Sequence[int]],
             where: str) -> tuple[dict[str, TensorEntry], dict[str, list[Copy]]]:
    """Every key of TP rank 0's ``tensors`` joined from the ranks' entries (:func:`join_entries`),
    and the other ranks' copies of each replicated tensor (uncut ones: a vocabulary cut takes a
    part), for ``verify``."""
    joined: dict[str, TensorEntry] = {}
    copies: dict[str, list[Copy]] = {}
    for key, entry in tensors[0].items():
        join = join_of(rules, entry)
        joined[key] = join_entries(key, [t[key] for t in tensors], join, ranks, where)
        if join.kind == "replicated" and entry.shape and join.rows is None:
            copies[key] = [Copy(f"tensor-parallel rank {t}", "rank 0", tuple(other[key].chunks), REPLICA_WHY)
                           for t, other in enumerate(tensors[1:], 1)]
    return joined, copies


def param_name(entry: TensorEntry) -> str | None:
    """The parameter (buffer) name a key's rules match: ``model.<fqn>`` and
    ``optim.state.<fqn>.<state>`` (path ``("model", fqn)`` / ``("optim", "state", fqn, state)``)."""
    path = entry.path
    if len(path) == 2 and path[0] == "model":
        return str(path[1])
    if len(path) == 4 and path[:2] == ("optim", "state"):
        return str(path[2])
    return None

