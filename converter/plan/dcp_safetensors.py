"""Where ``from-universal --format dcp-safetensors`` puts every byte (pure).

DCP's safetensors storage as ``HuggingFaceStorageWriter(save_distributed=True)`` writes it for a
job: every rank's chunks (the target layout's boxes and owners, as DCP's dedup leaves them) in
``shard-<rank+1>-model-<F>-of-<N>.safetensors``; with ``--consolidate`` those files go to
``sharded/`` and the hub-shaped files torch's ``consolidate_safetensors_files`` makes of them,
``model-<F>-of-<N>.safetensors`` + ``model.safetensors.index.json``, are written beside it, in the
same run, from the source: each whole tensor one more write task (:class:`WholeTensor`), split
across workers and torchrun ranks like every other task.

The consolidated key order is the one ``dcp.save``'s metadata gives (rank by rank, each rank's keys
in state-dict order: :func:`formats.dcp_safetensors.consolidated_order`), which is the order torch's
writer consolidates in. ``--max-shard-size`` splits the keys, in that order, into files as
huggingface_hub splits shards; that split is also torch's ``fqn_to_index_mapping``, so the
per-rank files are split the same way (``F`` of ``N``), as torch's writer splits them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from converter.plan.copy_tasks import WriteTask, plan_boxes
from formats.base import CheckpointIndex, full_box
from formats.errors import ConfigError
from formats.dcp_safetensors import (
    SHARDED_DIR,
    consolidated_index,
    consolidated_order,
    file_split,
    plan_consolidated,
    plan_shard_files,
    shard_file_name,
)
from formats.hf import INDEX_FILE, FilePlan, TensorSpec

FORMATS = ("dcp", "dcp-safetensors")


@dataclass(frozen=True, slots=True)
class WholeTensor:
    """The target of a consolidation task: the whole tensor ``key`` in ``dtype``, in the hub-shaped
    file that holds it (its journal id is tagged: a rank chunk can have the same whole box)."""

    key: str
    dtype: str
    journal_tag: ClassVar[str] = "consolidated"


@dataclass(frozen=True)
class StorageLayout:
    """Every file of the output: ``shard_dir`` ("" or ``sharded``) holds the per-rank files
    ``shards`` (laid out from ``chunks`` when first asked for: a dry run needs only their names);
    ``consolidated`` (with ``index``, its ``model.safetensors.index.json`` bytes) are the
    hub-shaped files (None without ``--consolidate``); ``file_index``: each key's file index (from
    1) of ``files``."""

    shard_dir: str
    chunks: Sequence
    file_index: Mapping[str, int]
    files: int
    consolidated: tuple[FilePlan, ...] | None = None
    index: tuple[str, bytes] | None = None

    @functools.cached_property
    def shards(self) -> tuple[FilePlan, ...]:
        """The per-rank files (:func:`formats.dcp_safetensors.plan_shard_files`)."""
        return tuple(plan_shard_files(self.chunks, self.file_index if self.files > 1 else None, self.files))

    @functools.cached_property
    def n_shard_files(self) -> int:
        """How many per-rank files (one per rank and file index holding anything)."""
        return len({(c.rank, self.file_index[c.key]) for c in self.chunks})

    def shard_file(self, key: str, rank: int) -> str:
        """The per-rank file (in ``shard_dir``) that holds rank ``rank``'s chunk of ``key``."""
        return shard_file_name(rank, self.file_index[key], self.files)

    def rank_file_text(self, rank: int) -> str:
        """How the dry run names rank ``rank``'s file(s)."""
        prefix = f"{self.shard_dir}/" if self.shard_dir else ""
        if self.files == 1:
            return prefix + shard_file_name(rank)
        return prefix + f"shard-{rank + 1:05d}-model-*-of-{self.files:05d}.safetensors"

    @property
    def n_files(self) -> int:
        return self.n_shard_files + len(self.consolidated or ()) + (self.index is not None)


def plan_storage(chunks: Sequence, consolidate: bool, max_shard_bytes: int | None,
                 fqn_index: Mapping[str, int] | None = None) -> StorageLayout:
    """The files for the target ``chunks`` (ChunkSpecs in state-dict order, each with its owner
    rank and target dtype): per-rank files, and with ``consolidate`` the hub-shaped files.
    ``fqn_index`` (torch's ``fqn_to_index_mapping``, e.g. from a hub model's index, as torchtitan
    builds it) gives each key's file and the consolidated order; it must name every key."""
    specs, file_index, files = _hub_split(chunks, max_shard_bytes, fqn_index)
    if not consolidate:
        return StorageLayout("", chunks, file_index, files)
    plans = tuple(plan_consolidated(specs, file_index))
    return StorageLayout(SHARDED_DIR, chunks, file_index, files, plans, (INDEX_FILE, consolidated_index(plans)))


@dataclass(frozen=True, slots=True)
class _Held:
    """A source chunk as the consolidated order sees it: its tensor and the rank whose file has it."""

    key: str
    rank: int
    dtype: str
    global_shape: tuple[int, ...]


def plan_hub(index: CheckpointIndex, max_shard_bytes: int | None,
             fqn_index: Mapping[str, int] | None = None) -> StorageLayout:
    """The hub-shaped files torch's consolidation makes of the checkpoint ``index`` itself (the
    ``consolidate`` command: no per-rank files), keys in the order ``dcp.save``'s metadata of the
    saving job lists them (each chunk's rank from its file; none known: rank 0)."""
    held = [_Held(key, c.rank or 0, e.dtype, tuple(e.shape)) for key, e in index.tensors.items() for c in e.chunks]
    specs, file_index, files = _hub_split(held, max_shard_bytes, fqn_index)
    plans = tuple(plan_consolidated(specs, file_index))
    return StorageLayout("", (), file_index, files, plans, (INDEX_FILE, consolidated_index(plans)))  # no shards


def _hub_split(chunks: Sequence, max_shard_bytes: int | None,
               fqn_index: Mapping[str, int] | None) -> tuple[list[TensorSpec], dict[str, int], int]:
    """(every key's spec in consolidated order, its file index, the number of files)."""
    first = {}
    for c in chunks:
        first.setdefault(c.key, c)
    if fqn_index is not None:
        missing = [k for k in first if k not in fqn_index]
        if missing:
            raise ConfigError(f"--fqn-index names no file for {missing[0]!r} ({len(missing)} keys missing); torch's "
                              "HuggingFaceStorageWriter needs every saved key in its fqn_to_index_mapping")
        order = [k for k in fqn_index if k in first]
    else:
        order = consolidated_order(chunks)
    specs = [TensorSpec(k, first[k].dtype, tuple(first[k].global_shape)) for k in order]
    file_index = file_split(specs, max_shard_bytes) if fqn_index is None else {k: fqn_index[k] for k in order}
    files = max(fqn_index.values()) if fqn_index else max(file_index.values(), default=1)
    return specs, file_index, files


def consolidation_tasks(index: CheckpointIndex, layout: StorageLayout, piece_bytes: int) -> list[WriteTask]:
    """One task per tensor of the hub-shaped files: its whole box, from the source."""
    tasks: list[WriteTask] = []
    for plan in layout.consolidated or ():
        for spec in plan.tensors:
            entry = index.tensors[spec.name]
            tasks += plan_boxes(entry, [WholeTensor(spec.name, spec.dtype)], [full_box(tuple(entry.shape))],
                                piece_bytes)
    return tasks


def read_fqn_index(doc: object, where: str) -> dict[str, int]:
    """torch's ``fqn_to_index_mapping`` from JSON: a hub ``model.safetensors.index.json`` (each
    ``weight_map`` file's first number is the index, as torchtitan reads it) or ``{key: index}``."""
    import re

    wmap = doc.get("weight_map") if isinstance(doc, dict) and "weight_map" in doc else doc
    if not isinstance(wmap, dict) or not wmap:
        raise ConfigError(f"{where}: not an fqn-to-index mapping (a model.safetensors.index.json, or JSON "
                          "{\"key\": file index}); fix --fqn-index")
    out: dict[str, int] = {}
    for key, value in wmap.items():
        m = re.search(r"\d+", value) if isinstance(value, str) else None
        index = int(m.group(0)) if m else value
        if type(index) is not int or index < 1:
            raise ConfigError(f"{where}: {key!r} maps to {value!r}, not a file index from 1; fix --fqn-index")
        out[key] = index
    return out


def load_fqn_index(value: str | os.PathLike | Mapping[str, int]) -> dict[str, int]:
    """``--fqn-index``: a mapping, or a JSON file (a ``model.safetensors.index.json`` or the folder
    holding one) read by :func:`read_fqn_index`; one-line ConfigErrors before any other I/O."""
    if isinstance(value, Mapping):
        return read_fqn_index(dict(value), "--fqn-index")
    from formats.fsutil import loads_json

    path = Path(value)
    path = path / INDEX_FILE if path.is_dir() else path
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read --fqn-index ({e.strerror}); pass a model.safetensors.index.json") from None
    return read_fqn_index(loads_json(raw, str(path), ConfigError, "fix --fqn-index"), str(path))


def tensors_only_warning(keys: Sequence[str]) -> list[str]:
    """The warning for non-tensor entries DCP's safetensors storage cannot hold (none: no warning)."""
    if not keys:
        return []
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return [f"{len(keys)} non-tensor entr{'y' if len(keys) == 1 else 'ies'} left out ({shown}): DCP's safetensors "
            "storage holds tensors only (torch's HuggingFaceStorageWriter cannot save them either)"]
