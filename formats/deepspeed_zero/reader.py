"""The reader of DeepSpeed checkpoints as ``engine.save_checkpoint`` writes them (ZeRO-0/1/2/3).

Opening parses each file's zip directory and ``data.pkl`` (allowlisted; DeepSpeed's classes as
inert records) and lays every tensor out as chunks of the flat partitions (:mod:`.zero`,
:mod:`.model`); reading a region is then a ``pread`` of the bytes it spans. No ``torch.load``,
no tensor data read before it is asked for, memory independent of the checkpoint's size.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from formats.base import Box, CheckpointIndex, ChunkRef
from formats.dcp.archive import (ArchiveTensor, Entry, SliceReader, local_data_start, read_region_array, read_region_into,
                                 verify_crc)
from formats.deepspeed_pickle import record_int, torch_save_bytes
from formats.deepspeed_zero.files import Parsed, TagFiles, find_tag_dir, list_tag_files, parse_file
from formats.deepspeed_zero.index import VALUE_SLOT, Copy, IndexBuilder, c_strides
from formats.deepspeed_zero.moe import build_moe
from formats.deepspeed_zero.pipeline import build_pipeline
from formats.deepspeed_zero.model import (add_buffers, add_frozen_from_module, add_objects, add_shared, as_data,
                                          build_zero0)
from formats.deepspeed_zero.tp import HOW_TO, INFO_KEY, TpRules, check_same_keys, join_all, rules_from_env
from formats.deepspeed_zero.zero import OSD, add_groups, build_zero3, build_zero12, frozen_zero3
from formats.dtypes import by_name
from formats.errors import CheckpointNotFoundError, CorruptCheckpointError, PlanError, UnsupportedError
from formats.fsutil import read_error

if TYPE_CHECKING:
    import torch

FORMAT = "deepspeed-zero"


def _check_supported(root: Path, files: TagFiles) -> None:
    """Refuse layouts not read yet, naming a file of the layout, what it is and what to do. A
    pipeline save (:mod:`.pipeline`) is told apart first: its stages' files are ``mp_rank_<stage>``."""
    if len(files.optim_prefixes) > 1:
        raise CorruptCheckpointError(f"{root}: optimizer files of two kinds ({', '.join(sorted(p or 'zero_' for p in files.optim_prefixes))}"
                                     "...): the folder mixes two saves; keep the files of one")


def _by_rank(root: Path, names: dict[int, str], what: str) -> list[str]:
    ranks = sorted(names)
    if ranks != list(range(len(ranks))):
        missing = next(r for r in range(len(ranks) + 1) if r not in names)
        raise CheckpointNotFoundError(f"{root}: no {what} file of data-parallel rank {missing} (have ranks "
                                      f"{ranks[0]}..{ranks[-1]}); copy every rank's file of the save")
    return [names[r] for r in ranks]


class DeepSpeedZeroReader:
    """A :class:`formats.base.CheckpointReader` over a DeepSpeed ``save_checkpoint`` tag folder."""

    def __init__(self, path: str | os.PathLike, verify: bool = False, tp_rules: TpRules | None = None) -> None:
        """``path``: the tag folder (``global_step<N>/``) or the folder whose ``latest`` names it.
        ``verify``: check each storage's zip CRC-32 once, before its first read. ``tp_rules``: how
        a tensor-parallel save's slices join (:mod:`.tp`; default: the file ``$CKPTCONV_DS_TP_RULES``
        names, else the save's own ``universal_checkpoint_info``)."""
        self.root = find_tag_dir(path)
        self._tp_rules = tp_rules
        self._tp = self._pp = 1
        self._replicas: dict[str, list[Copy]] = {}
        self._verify = verify
        self._verified: set[int] = set()
        self._lock = threading.Lock()
        self._verify_lock = threading.Lock()
        self._fds: dict[str, tuple[int, int]] = {}
        self._starts: dict[int, int] = {}
        files = list_tag_files(self.root)
        _check_supported(self.root, files)
        b = IndexBuilder()
        left_out: list[str] = []
        self._read_files: set[str] = set()
        stage, world = self._build(b, files, left_out)
        self._slots, self._values, self._objects = b.slots, b.values, b.object_values
        info = {"partitioning": "zero_flat", "zero_stage": stage, "world_size": world, "tp_degree": self._tp,
                "pp_degree": self._pp, "dtype_prefix": next(iter(files.optim_prefixes), None), "version": self._ds_version,
                "left_out": left_out, "files": sorted(self._read_files)}
        self._index = CheckpointIndex(FORMAT, str(self.root), b.tensors, b.objects, info)

    def _parse(self, name: str, what: str) -> Parsed:
        self._read_files.add(name)
        return parse_file(self.root, name, what)

    def _build(self, b: IndexBuilder, files: TagFiles, left_out: list[str]) -> tuple[int, int]:
        """Lay out every tensor and object; (ZeRO stage, data-parallel ranks)."""
        if files.experts or files.expp_optim:
            return self._build_moe(b, files, left_out)
        if files.layers:
            return self._build_pipeline(b, files, left_out)
        mps = sorted(set(files.model) | {mp for mp, _ in files.zero3_model} | {mp for mp, _ in files.optim})
        if mps in ([], [0]):
            return self._build_rank(b, files, 0, left_out)
        return self._build_tp(b, files, mps, left_out)

    def _build_tp(self, b: IndexBuilder, files: TagFiles, mps: list[int], left_out: list[str]) -> tuple[int, int]:
        """A tensor-parallel save: each TP rank laid out on its own, then every tensor joined as
        the rules say (:mod:`.tp`); objects are TP rank 0's."""
        if mps != list(range(len(mps))):
            missing = next(r for r in range(len(mps) + 1) if r not in mps)
            raise CheckpointNotFoundError(f"{self.root}: no files of tensor-parallel rank {missing} (mp_rank_{missing:02d}; "
                                          f"have {', '.join(f'{m:02d}' for m in mps)}); copy every rank's files of the save")
        built = []
        for mp in mps:
            sub = b.fork()
            stage, world = self._build_rank(sub, files, mp, left_out if mp == 0 else [])
            built.append((sub, stage, world, self.root / self._model_name))
            if mp == 0:
                rules = self._rules_of(self._first_model, f"a tensor-parallel save ({len(mps)} ranks mp_rank_*)")
        sub0, stage, world, _ = built[0]
        for t, (sub, st, w, path) in enumerate(built[1:], 1):
            if (st, w) != (stage, world):
                raise CorruptCheckpointError(f"{path}: tensor-parallel rank {t} holds ZeRO-{st} over {w} data-parallel "
                                             f"ranks, rank 0 ZeRO-{stage} over {world}; the files are from different saves")
        check_same_keys([sub.tensors for sub, *_ in built], [path for *_, path in built])
        ranks = [[t + len(mps) * d for d in range(world)] for t in range(len(mps))]
        joined, self._replicas = join_all([sub.tensors for sub, *_ in built], rules, ranks, str(self.root))
        b.tensors.update(joined)
        b.objects.update(sub0.objects)
        b.object_values.update(sub0.object_values)
        self._tp = len(mps)
        return stage, world

    def _rules_of(self, model: Parsed, what: str) -> TpRules:
        """The join rules: given (``tp_rules``, else the file ``$CKPTCONV_DS_TP_RULES`` names: they
        win), else the save's ``universal_checkpoint_info``; none: the one-line refusal (``what``:
        the layout) saying how to give them."""
        rules = self._tp_rules or rules_from_env()
        if rules is not None:
            return rules
        info = model.value.get(INFO_KEY) if isinstance(model.value, dict) else None
        if info:
            return TpRules.parse(as_data(info), f"{model.path}: {INFO_KEY}")
        raise UnsupportedError(f"{model.path}: {what} without {INFO_KEY} "
                               "(which parameters are replicated, row- or column-parallel: how the slices join) is not "
                               f"supported yet; {HOW_TO}")

    def _build_rank(self, b: IndexBuilder, files: TagFiles, mp: int, left_out: list[str]) -> tuple[int, int]:
        """Lay out the tensors and objects of model-parallel rank ``mp``; (ZeRO stage, data-parallel ranks)."""
        optim_names = _by_rank(self.root, {dp: n for (m, dp), n in files.optim.items() if m == mp}, "*_optim_states.pt")
        optims = [self._parse(n, "the optimizer partitions") for n in optim_names]
        osd = optims[0].value.get(OSD) if optims and isinstance(optims[0].value, dict) else None
        if optims and isinstance(osd, dict) and "fp32_flat_groups" in osd:
            stage, world = 3, len(optims)
            models = _by_rank(self.root, {dp: n for (m, dp), n in files.zero3_model.items() if m == mp},
                              "zero_pp_rank_*_model_states.pt")
            model = self._parse(models[0], "the model states")
            groups = build_zero3(b, model, optims)
            if model.value.get("frozen_param_shapes"):
                frozen_zero3(b, [model] + [self._parse(n, "the model states") for n in models[1:]], world)
        else:
            name = files.model.get(mp)
            if name is None:
                raise CheckpointNotFoundError(f"{self.root}: no mp_rank_{mp:02d}_model_states.pt; copy the whole tag folder")
            model = self._parse(name, "the model states")
            if not optims:
                stage, world = 0, 1
                groups = build_zero0(b, model)
            elif isinstance(osd, dict) and "single_partition_of_fp32_groups" in osd:
                stage, world = record_int(osd.get("zero_stage")) or 1, len(optims)
                groups = build_zero12(b, model, optims)
                add_frozen_from_module(b, model)
            else:
                raise UnsupportedError(f"{optims[0].path}: neither ZeRO-1/2 partitions (single_partition_of_fp32_groups) "
                                       "nor ZeRO-3 ones (fp32_flat_groups); an optimizer this reader does not know")
        self._finish(b, model, optims, groups, stage, left_out)
        self._first_model, self._model_name = model, model.name
        return stage, world

    def _finish(self, b: IndexBuilder, model: Parsed, optims: list[Parsed], groups: list,
                stage: int, left_out: list[str]) -> None:
        """What every non-pipeline layout adds last: buffers, shared (tied) params under ZeRO, the param
        groups, the non-tensor entries, and the saving DeepSpeed's version."""
        add_buffers(b, model)
        if stage:
            add_shared(b, model)
        add_groups(b, groups, optims[0].name if optims else model.name)
        add_objects(b, model, optims[0] if optims else None, left_out)
        self._ds_version = model.value.get("ds_version") if isinstance(model.value.get("ds_version"), str) else None

    def _build_pipeline(self, b: IndexBuilder, files: TagFiles, left_out: list[str]) -> tuple[int, int]:
        """A ``PipelineModule`` save under ZeRO-1, TP inside the stages joined (:mod:`.pipeline`)."""
        pipe = build_pipeline(b, self.root, files, self._parse, lambda names, what: _by_rank(self.root, names, what),
                              self._rules_of, left_out)
        stage = record_int(pipe.optims[0].value[OSD].get("zero_stage")) or 1
        add_groups(b, pipe.groups, pipe.optims[0].name)
        add_objects(b, pipe.model, pipe.optims[0], left_out)
        self._ds_version = pipe.model.value.get("ds_version") if isinstance(pipe.model.value.get("ds_version"), str) else None
        self._tp, self._pp, self._replicas = pipe.tp, pipe.pp, pipe.copies
        return stage, pipe.world

    def _build_moe(self, b: IndexBuilder, files: TagFiles, left_out: list[str]) -> tuple[int, int]:
        """A ``deepspeed.moe`` save (:mod:`.moe`): experts under their global names."""
        groups, model, optims, stage, world = build_moe(b, self.root, files, self._parse,
                                                        lambda names, what: _by_rank(self.root, names, what))
        self._finish(b, model, optims, groups, stage, left_out)
        return stage, world

    # -- CheckpointReader ----------------------------------------------------------------------

    def index(self) -> CheckpointIndex:
        return self._index

    def _fd(self, file: str, key: str) -> tuple[int, int]:
        """The open file (fd, size) of ``file``, opened once."""
        with self._lock:
            found = self._fds.get(file)
            if found is None:
                path = self.root / file
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    raise CheckpointNotFoundError(f"{path}: file disappeared (key {key!r})") from None
                except OSError as e:
                    raise read_error(path, e, f"key {key!r}") from None
                found = self._fds[file] = (fd, os.fstat(fd).st_size)
            return found

    def _stored(self, key: str, chunk: ChunkRef, region: Box) -> tuple[ArchiveTensor, SliceReader, Box]:
        if not chunk.box.contains(region) or region.ndim != chunk.box.ndim:
            raise PlanError(f"key {key!r}: region {region.to_json()} is not inside chunk {chunk.box.to_json()}")
        entry = self._index.tensors[key]
        slot_id, offset, *stride = chunk.locator
        slot = self._slots[slot_id]
        where = f"{self.root / slot.file}: key {key!r}"
        fd, size = self._fd(slot.file, key)
        read = SliceReader(fd, 0, size, where)
        isz = by_name(entry.dtype).itemsize
        at = ArchiveTensor(entry.dtype, chunk.box.sizes, stride[0] if stride else c_strides(entry.shape), offset,
                           slot.nbytes // isz, self._data_start(slot_id, read), slot.nbytes, slot.crc)
        if self._verify and slot_id not in self._verified:
            with self._verify_lock:
                if slot_id not in self._verified:
                    verify_crc(at, read, where)
                    self._verified.add(slot_id)
        return at, read, region.relative_to(chunk.box)

    def _data_start(self, number: int, read: SliceReader) -> int:
        """Where storage ``number``'s bytes start in its file (its local header read once)."""
        slot = self._slots[number]
        if slot.resolved:
            return slot.data_start
        start = self._starts.get(number)
        if start is None:
            entry = Entry(slot.member, slot.data_start, slot.nbytes, slot.crc, local=False)
            start = self._starts[number] = local_data_start(read, read.length, entry, read.where)
        return start

    @property
    def storages(self) -> list[str]:
        """The file of each tensor storage the index reads (a storage's number is its position)."""
        return [s.file for s in self._slots]

    def check_storage(self, number: int) -> int:
        """Read storage ``number`` whole, in bounded blocks, against its zip CRC-32 (a
        CorruptCheckpointError naming the file when it differs); the bytes read."""
        slot = self._slots[number]
        path = self.root / slot.file
        fd, size = self._fd(slot.file, slot.file)
        read = SliceReader(fd, 0, size, str(path))
        start = self._data_start(number, read)
        at = ArchiveTensor("uint8", (slot.nbytes,), (1,), 0, slot.nbytes, start, slot.nbytes, slot.crc)
        verify_crc(at, read, f"{path}: storage {slot.member}")
        with self._verify_lock:
            self._verified.add(number)
        return slot.nbytes

    @property
    def replicated_keys(self) -> list[str]:
        """The keys read from one of several stored copies (a TP-replicated tensor: TP rank 0's; a
        tied parameter of several pipeline stages: the first stage's); :meth:`check_replicas`
        compares the other copies with it."""
        return list(self._replicas)

    def check_replicas(self, key: str, block_bytes: int = 64 << 20) -> int:
        """Compare every other copy of ``key`` with the one read, bit for bit, in blocks of rows
        (ds_to_universal asserts TP-replicated copies are equal); a CorruptCheckpointError naming
        the copy when one differs. The bytes read."""
        entry = self._index.tensors[key]
        shape = entry.shape
        row = math.prod(shape[1:]) * by_name(entry.dtype).itemsize
        step = max(1, block_bytes // max(1, row))
        total = 0
        for lo in range(0, shape[0], step) if shape else [0]:  # a scalar (a tied parameter's step): whole
            region = (Box((lo, *(0,) * (len(shape) - 1)), (min(step, shape[0] - lo), *shape[1:])) if shape
                      else Box((), ()))
            want = self._gather(key, entry.chunks, region)
            for copy in self._replicas[key]:
                if not np.array_equal(self._gather(key, copy.chunks, region), want):
                    raise CorruptCheckpointError(f"{self.root}: key {key!r}: {copy.who}'s copy differs from {copy.of}'s "
                                                 f"(rows from {lo}) {copy.why}")
                total += want.nbytes
            total += want.nbytes
        return total

    def _gather(self, key: str, chunks: tuple[ChunkRef, ...], region: Box) -> np.ndarray:
        out = None
        for c in chunks:
            part = c.box.intersect(region)
            if part is None:
                continue
            data = self.read_region_array(key, c, part)
            if out is None:
                out = np.empty(region.sizes, dtype=data.dtype)
            out[part.relative_to(region).slices()] = data
        return out if out is not None else np.empty(0)

    def _value(self, key: str, chunk: ChunkRef, region: Box) -> np.ndarray:
        entry = self._index.tensors[key]
        index = chunk.locator[1]
        if index < 0:  # a tensor without elements
            return np.empty(region.sizes, dtype=by_name(entry.dtype).numpy_dtype)
        return np.require(self._values[index][region.slices()], requirements="C")

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        """A new contiguous tensor holding ``region`` (global coords, inside ``chunk.box``)."""
        from formats.dcp.archive import as_tensor

        return as_tensor(self.read_region_array(key, chunk, region), self._index.tensors[key].dtype)

    def read_region_array(self, key: str, chunk: ChunkRef, region: Box) -> np.ndarray:
        """``region`` as a new C-contiguous bit array (storage dtype of :mod:`formats.dtypes`)."""
        if chunk.locator[0] == VALUE_SLOT:
            return self._value(key, chunk, region)
        at, read, local = self._stored(key, chunk, region)
        return read_region_array(at, read, local.offsets, local.sizes)

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        """Fill ``out`` with the bits of ``region`` in C order (straight from the file)."""
        if chunk.locator[0] == VALUE_SLOT:
            memoryview(out).cast("B")[:] = self._value(key, chunk, region).tobytes()
            return
        at, read, local = self._stored(key, chunk, region)
        read_region_into(at, read, local.offsets, local.sizes, out)

    def read_object_bytes(self, key: str) -> bytes:
        """The object as ``torch.save`` bytes (plain data only)."""
        return torch_save_bytes(self._objects[key])

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        return self._objects[key]

    def close(self) -> None:
        """Close the open files (reopened if read again)."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd, _ in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
