"""DeepSpeed universal checkpoints, read and written without DeepSpeed (and without running any of
its pickled classes).

``deepspeed/checkpoint/ds_to_universal.py`` (DeepSpeed 0.19) turns a ZeRO-1/2/3 checkpoint into::

    <tag>/zero/<fqn>/fp32.pt             master weights of one parameter
    <tag>/zero/<fqn>/exp_avg.pt          an optimizer state of it (any name: exp_avg_sq, ...)
    <tag>/zero/<fqn>/step.pt             ZeRO-1/2 only: the step (a 0-d tensor or a number)
    <tag>/zero/optimizer_state.pt        ds_version, param_groups, loss scaler, ZeRO stage; ZeRO-3
                                         also optimizer_state_dict.state[g].step
    <tag>/mp_rank_00_model_states.pt     ZeRO-1/2 (zero_pp_rank_<r>_mp_rank_00_model_states.pt for
                                         ZeRO-3): param_shapes (parameter groups, shapes), ...
    latest_universal                     beside <tag>: the tag's name

Each ``<state>.pt`` ("an atom") is a ``torch.save`` of ``{'param': full tensor, 'cat_dim': 0, ...}``
(ZeRO-1/2) or of the bare flat tensor (ZeRO-3; its shape is in ``param_shapes``).

Reading (:class:`DeepSpeedReader`) parses each archive's zip directory and ``data.pkl`` with an
allowlist unpickler whose stand-ins never build a tensor nor import DeepSpeed: DeepSpeed's own
classes (``LossScaler``, ``ZeroStageEnum``) become inert records. Tensor regions are then
``pread`` straight from the archives. Keys follow DCP's ``get_state_dict`` style
(``model.<fqn>``, ``optim.state.<fqn>.<state>``, ``optim.param_groups.<i>.<hparam>``) so the
store converts to an FSDP2 checkpoint as is.

Writing (:class:`AtomWriter`, :func:`optimizer_state_bytes`, :func:`model_states_bytes`) produces
what DeepSpeed's ``load_universal_checkpoint`` reads for ZeRO-1/2/3: dict atoms (read by both
loaders), a per-parameter ``step.pt``, the step in ``optimizer_state.pt``, both model-states file
names and ``latest_universal``. Atom archives are byte-identical to ``torch.save`` and streamed.
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from formats.base import Box, CheckpointIndex, ChunkRef, ObjectEntry, TensorEntry, full_box
from formats.dcp.archive import (ArchiveTensor, SliceReader, TensorDesc, describe_tensor, read_region_array,
                                 read_region_into, verify_crc)
from formats.dcp.archive_writer import TensorArchiveWriter, pickle_with_tensor, tensor_ref
from formats.deepspeed_pickle import record_int as _as_int
from formats.deepspeed_pickle import load_archive, torch_save_bytes
from formats.deepspeed_pickle import resolve_global as _resolve  # noqa: F401 - the allowlist, tested by name
from formats.dtypes import by_name, from_storage_array
from formats.errors import (CheckpointNotFoundError, CorruptCheckpointError, InvalidCheckpointError,
                            UnsupportedError)
from formats.fsutil import read_error, short, source_path

if TYPE_CHECKING:
    import torch

ZERO_DIR = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
LATEST_UNIVERSAL = "latest_universal"
#: ZeRO-1/2 and ZeRO-3 model-states file names (rank 0; the universal loader reads only these).
MODEL_STATES_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
MASTER = "fp32"  # the master-weights atom
STEP = "step"
PARAM = "param"  # the tensor inside a dict atom
CAT_DIM = "cat_dim"
#: The DeepSpeed version whose layout export writes (``ds_version`` of the files; the ZeRO-1
#: loader refuses versions before 0.3.17).
WRITTEN_DS_VERSION = "0.19.8"
#: Largest model-states / optimizer_state ``data.pkl`` parsed (bytes).
MAX_PICKLE_BYTES = 64 << 20

#: Longest tag ``latest_universal`` may name (a file name's limit, NAME_MAX, on common file systems).
MAX_TAG_BYTES = 255

_ATOM_FILE = re.compile(r"(?P<state>[^/]+)\.pt")


# ---------------------------------------------------------------------------------------------
# parsing DeepSpeed's files (their stand-ins: formats/deepspeed_pickle.py)


@dataclass(frozen=True)
class _Archive:
    """One parsed ``torch.save`` file: its unpickled value (tensors as descriptions) and entries."""

    path: Path
    value: Any
    entries: dict
    prefix: str

    def tensor(self, desc: Any, what: str) -> ArchiveTensor:
        return describe_tensor(desc, self.entries, self.prefix, f"{self.path}: {what}")


def _load_archive(path: Path, what: str) -> _Archive:
    """Parse ``path`` (a ``torch.save`` zip) without loading tensor data; errors name the file."""
    value, entries, prefix = load_archive(path, what, "the DeepSpeed universal checkpoint is incomplete: rerun "
                                          "ds_to_universal.py", MAX_PICKLE_BYTES)
    return _Archive(path, value, entries, prefix)


def _read_small(archive: _Archive, desc: Any, what: str) -> np.ndarray:
    """The data of a small tensor (a step) of an archive, as a bit array."""
    at = archive.tensor(desc, what)
    fd = os.open(archive.path, os.O_RDONLY)
    try:
        read = SliceReader(fd, 0, os.fstat(fd).st_size, str(archive.path))
        return read_region_array(at, read, (0,) * len(at.size), at.size)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# reading


@dataclass(frozen=True)
class AtomRef:
    """Where one tensor of the checkpoint lies: an atom file (``at`` viewed with the logical
    shape) or a small value held in memory (``value``)."""

    file: str  # relative to the root
    at: ArchiveTensor | None = None
    value: np.ndarray | None = None  # bit array (storage dtype of ``dtype``)
    dtype: str = "float32"


@dataclass(frozen=True)
class DeepSpeedLayout:
    """What the small files of a universal checkpoint say."""

    zero_stage: int | None
    ds_version: str | None
    param_groups: tuple[dict, ...]  # hyperparameters as saved ('params' dropped)
    group_params: tuple[tuple[str, ...], ...]  # parameter FQNs per group (param_shapes order)
    shapes: dict[str, tuple[int, ...]]  # from param_shapes
    steps: tuple[Any, ...]  # ZeRO-3: per group, the step description (or value) in optimizer_state.pt
    global_steps: int | None
    shared: dict[str, str]  # tied parameter name -> the name whose data it shares (``shared_params``)


def find_universal_dir(path: str | os.PathLike) -> Path:
    """The folder holding ``zero/``: ``path`` itself, or the tag its ``latest_universal`` names."""
    root = Path(path)
    if (root / ZERO_DIR).is_dir():
        return root
    latest = root / LATEST_UNIVERSAL
    if latest.is_file():
        with open(latest, "rb") as f:
            tag = f.read(MAX_TAG_BYTES + 1).decode("utf-8", "replace").strip()
        if (not tag or "/" in tag or "\0" in tag or tag in (".", "..")
                or len(tag.encode("utf-8", "surrogateescape")) > MAX_TAG_BYTES):
            raise CorruptCheckpointError(f"{latest}: names {short(repr(tag))}, not a tag folder; fix or remove the file")
        if (root / tag / ZERO_DIR).is_dir():
            return root / tag
        raise CheckpointNotFoundError(f"{latest}: names tag {tag!r}, but {root / tag / ZERO_DIR} is missing; "
                                      "pass the universal checkpoint folder itself")
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: no such DeepSpeed universal checkpoint")
    raise InvalidCheckpointError(
        f"{root}: not a DeepSpeed universal checkpoint (no {ZERO_DIR}/ and no {LATEST_UNIVERSAL}); convert the "
        "ZeRO checkpoint first: python -m deepspeed.checkpoint.ds_to_universal --input_folder <tag> "
        "--output_folder <tag>_universal (ZeRO-1/2 also need --inject_missing_state)")


def is_deepspeed_universal(path: str | os.PathLike) -> bool:
    """True when ``path`` looks like a DeepSpeed universal checkpoint (or its parent folder)."""
    root = Path(path)
    if (root / ZERO_DIR / OPTIMIZER_STATE).is_file():
        return True
    latest = root / LATEST_UNIVERSAL
    if not latest.is_file() or latest.stat().st_size > 4096:
        return False
    tag = latest.read_text(errors="replace").strip()
    return bool(tag) and "/" not in tag and (root / tag / ZERO_DIR).is_dir()


def _model_states_file(root: Path) -> Path | None:
    for name in MODEL_STATES_FILES:
        if (root / name).is_file():
            return root / name
    found = sorted(root.glob("*model_states.pt"))
    return found[0] if found else None


def _param_shapes(ms: _Archive | None) -> list[OrderedDict]:
    if ms is None:
        return []
    value = ms.value
    shapes = value.get("param_shapes") if isinstance(value, dict) else None
    if shapes is None:
        return []
    if isinstance(shapes, dict):  # older DeepSpeed: one dict
        shapes = [shapes]
    ok = isinstance(shapes, list) and all(isinstance(g, dict) for g in shapes) and all(
        isinstance(k, str) and isinstance(s, tuple) and all(isinstance(d, int) and d >= 0 for d in s)
        for g in shapes for k, s in g.items())
    if not ok:
        raise CorruptCheckpointError(f"{ms.path}: key 'param_shapes' is not a list of {{name: shape}}; the file is "
                                     "damaged: copy it again from the ZeRO checkpoint")
    return shapes


def read_layout(root: Path) -> tuple[DeepSpeedLayout, _Archive]:
    """Parse ``zero/optimizer_state.pt`` and the model-states file (allowlisted data only); the
    layout and the parsed optimizer state (whose ZeRO-3 step tensors are read from it)."""
    opt = _load_archive(source_path(root, f"{ZERO_DIR}/{OPTIMIZER_STATE}", "the optimizer's common state"),
                        "the optimizer's common state")
    sd = opt.value
    if not isinstance(sd, dict):
        raise CorruptCheckpointError(f"{opt.path}: holds a {type(sd).__name__}, not a dict; rerun ds_to_universal.py")
    inner = sd.get("optimizer_state_dict")
    inner = inner if isinstance(inner, dict) else {}
    groups = sd.get("param_groups", inner.get("param_groups"))
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CorruptCheckpointError(f"{opt.path}: key 'param_groups' is missing or not a list of dicts; "
                                     "rerun ds_to_universal.py")
    state = inner.get("state")
    steps: list[Any] = []
    if isinstance(state, dict):
        for i in range(len(groups)):
            s = state.get(i, state.get(0))
            steps.append(s.get(STEP) if isinstance(s, dict) else None)
    ms_path = _model_states_file(root)
    ms = _load_archive(source_path(root, ms_path.name, "the model states"), "the model states") \
        if ms_path is not None else None
    shapes = _param_shapes(ms)
    ms_value = ms.value if ms is not None and isinstance(ms.value, dict) else {}
    return DeepSpeedLayout(
        zero_stage=_as_int(sd.get("zero_stage")),
        ds_version=next((v for v in (sd.get("ds_version"), ms_value.get("ds_version")) if isinstance(v, str)), None),
        param_groups=tuple({k: v for k, v in g.items() if k != "params"} for g in groups),
        group_params=tuple(tuple(g) for g in shapes),
        shapes={k: tuple(s) for g in shapes for k, s in g.items()},
        steps=tuple(steps),
        global_steps=_as_int(ms_value.get("global_steps")),
        shared=_shared_params(ms_value),
    ), opt


def _shared_params(ms_value: dict) -> dict[str, str]:
    shared = ms_value.get("shared_params")
    if not isinstance(shared, dict):
        return {}
    return {k: v for k, v in shared.items() if isinstance(k, str) and isinstance(v, str)}


def _check_fqn(fqn: str, where: Path) -> str:
    if not fqn or fqn in (".", "..") or "/" in fqn or "\x00" in fqn:
        raise CorruptCheckpointError(f"{where}: {fqn!r} is not a parameter name")
    return fqn


def _contiguous(at: ArchiveTensor) -> bool:
    expected = 1
    for s, st in zip(reversed(at.size), reversed(at.stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def _reshaped(at: ArchiveTensor, shape: tuple[int, ...], where: str) -> ArchiveTensor:
    """The flat ZeRO-3 atom ``at`` viewed with the parameter's shape (it must be dense)."""
    if math.prod(at.size) != math.prod(shape):
        raise CorruptCheckpointError(f"{where}: {math.prod(at.size)} elements, param_shapes says {list(shape)}; "
                                     "the atom and the model-states file are from different checkpoints")
    if not _contiguous(at):
        raise UnsupportedError(f"{where}: a strided flat atom; save it contiguous (tensor.contiguous()) and rerun")
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return replace(at, size=tuple(shape), stride=tuple(reversed(strides)))


class DeepSpeedReader:
    """A :class:`formats.base.CheckpointReader` over a DeepSpeed universal checkpoint."""

    def __init__(self, path: str | os.PathLike, verify: bool = False) -> None:
        """``path``: the universal folder (holding ``zero/``) or the folder whose
        ``latest_universal`` names it. ``verify``: check each atom's zip CRC-32 once, when read."""
        self.root = find_universal_dir(path)
        self._verify = verify
        self._verified: set[str] = set()
        self.layout, opt = read_layout(self.root)
        self._refs: dict[str, AtomRef] = {}
        tensors: dict[str, TensorEntry] = {}
        zero = self.root / ZERO_DIR
        names = [p.name for p in sorted(zero.iterdir()) if p.is_dir()]
        order = {n: i for i, n in enumerate(f for g in self.layout.group_params for f in g)}
        names.sort(key=lambda n: (order.get(n, len(order)), n))
        for fqn in names:
            _check_fqn(fqn, zero)
            self._add_param(fqn, tensors, opt)
        if not tensors:
            raise InvalidCheckpointError(f"{zero}: no parameter folders; rerun ds_to_universal.py")
        for alias, target in self.layout.shared.items():  # tied weights: saved once, under ``target``
            if f"model.{alias}" not in tensors and f"model.{target}" in tensors:
                self._add(tensors, f"model.{alias}", ("model", alias), self._refs[f"model.{target}"])
        objects = self._group_objects()
        info = {"version": self.layout.ds_version, "zero_stage": self.layout.zero_stage, "world_size": None,
                "global_steps": self.layout.global_steps}
        self._index = CheckpointIndex("deepspeed", str(self.root), tensors, objects, info)

    # -- index -----------------------------------------------------------------------------------

    def _add_param(self, fqn: str, tensors: dict[str, TensorEntry], opt: _Archive) -> None:
        folder = source_path(self.root, f"{ZERO_DIR}/{fqn}", f"parameter {fqn!r}")
        files = sorted(p.name for p in folder.iterdir()
                       if p.is_file() and _ATOM_FILE.fullmatch(p.name) and not p.name.startswith("."))
        if f"{MASTER}.pt" not in files:
            raise CorruptCheckpointError(f"{folder}: no {MASTER}.pt for parameter {fqn!r}; rerun ds_to_universal.py")
        shape = None
        has_state = False
        for name in [f"{MASTER}.pt"] + [f for f in files if f != f"{MASTER}.pt"]:
            state = name[:-3]
            rel = f"{ZERO_DIR}/{fqn}/{name}"
            archive = _load_archive(source_path(self.root, rel, f"{state} of {fqn!r}"), f"{state} of {fqn!r}")
            if state == STEP:
                continue  # added below, once the parameter is known to have optimizer states
            at = self._atom_tensor(archive, fqn, state)
            if shape is not None and math.prod(at.size) != math.prod(shape):
                raise CorruptCheckpointError(f"{archive.path}: {list(at.size)} does not match the parameter's "
                                             f"{list(shape)}; rerun ds_to_universal.py")
            if shape is not None and at.size != shape:
                at = _reshaped(at, shape, str(archive.path))
            shape = at.size if shape is None else shape
            if state == MASTER:
                key, path = f"model.{fqn}", ("model", fqn)
            else:
                key, path, has_state = f"optim.state.{fqn}.{state}", ("optim", "state", fqn, state), True
            self._add(tensors, key, path, AtomRef(rel, at=at))
        if has_state:
            self._add_step(fqn, files, tensors, opt)

    def _atom_tensor(self, archive: _Archive, fqn: str, state: str) -> ArchiveTensor:
        value = archive.value
        if isinstance(value, dict):
            if PARAM not in value:
                raise CorruptCheckpointError(f"{archive.path}: dict atom without key {PARAM!r}; rerun ds_to_universal.py")
            value = value[PARAM]
        if not isinstance(value, TensorDesc):
            raise CorruptCheckpointError(f"{archive.path}: key {PARAM!r} holds {type(value).__name__}, not a tensor")
        at = archive.tensor(value, f"key {PARAM!r}")
        shape = self.layout.shapes.get(fqn)
        if len(at.size) == 1 and shape is not None and at.size != shape:  # ZeRO-3: flat
            return _reshaped(at, shape, str(archive.path))
        if shape is None and len(at.size) == 1 and self.layout.zero_stage == 3 and state == MASTER:
            raise CorruptCheckpointError(f"{archive.path}: a flat ZeRO-3 atom and no shape for {fqn!r} (no "
                                         "*model_states.pt with param_shapes beside zero/): copy the model-states "
                                         "files of the ZeRO checkpoint next to zero/")
        return at

    def _add_step(self, fqn: str, files: list[str], tensors: dict[str, TensorEntry], opt: _Archive) -> None:
        if f"{STEP}.pt" in files:  # ZeRO-1/2
            rel = f"{ZERO_DIR}/{fqn}/{STEP}.pt"
            archive = _load_archive(source_path(self.root, rel, f"step of {fqn!r}"), f"step of {fqn!r}")
            value, dtype = self._step_value(archive, archive.value)
        else:  # ZeRO-3: per group in optimizer_state.pt; optimizers keeping it in the group: there
            group = next((i for i, g in enumerate(self.layout.group_params) if fqn in g), 0)
            raw = self.layout.steps[group] if group < len(self.layout.steps) else None
            if raw is None and group < len(self.layout.param_groups):
                raw = self.layout.param_groups[group].get(STEP)
            if raw is None:
                return
            value, dtype = self._step_value(opt, raw)
        key = f"optim.state.{fqn}.{STEP}"
        ref = AtomRef(f"{ZERO_DIR}/{OPTIMIZER_STATE}", value=value, dtype=dtype)
        self._add(tensors, key, ("optim", "state", fqn, STEP), ref)

    @staticmethod
    def _step_value(archive: _Archive, raw: Any) -> tuple[np.ndarray, str]:
        """A step as torch's Adam keeps it: a 0-d tensor (float32 when saved as a number); the
        bit array and its dtype."""
        if isinstance(raw, TensorDesc):
            data = _read_small(archive, raw, "key 'step'")
            if data.size != 1:
                raise CorruptCheckpointError(f"{archive.path}: key 'step' has {data.size} elements, not 1")
            return data.reshape(()), raw.dtype
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            try:
                return np.asarray(float(raw), dtype=np.float32), "float32"
            except OverflowError:  # an int past any float (a damaged file)
                raise CorruptCheckpointError(f"{archive.path}: key 'step' holds an integer too large for a "
                                             "float; the file is damaged: rerun ds_to_universal.py") from None
        raise CorruptCheckpointError(f"{archive.path}: key 'step' holds {type(raw).__name__}, not a number")

    def _add(self, tensors: dict[str, TensorEntry], key: str, path: tuple, ref: AtomRef) -> None:
        if ref.at is not None:
            dtype, shape = ref.at.dtype, ref.at.size
        else:
            dtype, shape = ref.dtype, tuple(ref.value.shape)
        self._refs[key] = ref
        chunk = ChunkRef(full_box(shape), ref.file, key)
        tensors[key] = TensorEntry(key, dtype, shape, (chunk,), path)

    def _group_objects(self) -> dict[str, ObjectEntry]:
        """``optim.param_groups.<i>.<hparam>`` (with ``params``: the group's FQNs)."""
        layout = self.layout
        groups = layout.group_params
        if not groups:  # no param_shapes: one group of every parameter
            groups = (tuple(k[len("model."):] for k in self._refs if k.startswith("model.")),)
        if len(groups) != len(layout.param_groups):
            raise CorruptCheckpointError(
                f"{self.root}: {len(layout.param_groups)} param groups in {ZERO_DIR}/{OPTIMIZER_STATE}, "
                f"{len(groups)} in param_shapes of the model-states file; they are from different checkpoints")
        self._values: dict[str, Any] = {}
        objects = {}
        for i, (hparams, fqns) in enumerate(zip(layout.param_groups, groups)):
            for name, value in [*hparams.items(), ("params", list(fqns))]:
                _check_plain(value, f"{self.root / ZERO_DIR / OPTIMIZER_STATE}: key param_groups[{i}][{name!r}]")
                key = f"optim.param_groups.{i}.{name}"
                self._values[key] = value
                objects[key] = ObjectEntry(key, ("optim", "param_groups", i, name), f"{ZERO_DIR}/{OPTIMIZER_STATE}", key)
        return objects

    # -- CheckpointReader ----------------------------------------------------------------------

    def index(self) -> CheckpointIndex:
        return self._index

    def _open(self, key: str, chunk: ChunkRef) -> tuple[int, SliceReader]:
        path = source_path(self.root, chunk.file, f"key {key!r}")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise read_error(path, e, f"key {key!r}") from None
        read = SliceReader(fd, 0, os.fstat(fd).st_size, f"{path}: key {key!r}")
        if self._verify and chunk.file not in self._verified:
            verify_crc(self._refs[key].at, read, f"{path}: key {key!r}")
            self._verified.add(chunk.file)
        return fd, read

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        ref = self._refs[key]
        if ref.value is not None:
            return from_storage_array(np.require(ref.value[region.slices()], requirements="C"), ref.dtype)
        fd, read = self._open(key, chunk)
        try:
            return from_storage_array(read_region_array(ref.at, read, region.offsets, region.sizes), ref.at.dtype)
        finally:
            os.close(fd)

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        ref = self._refs[key]
        if ref.value is not None:
            data = np.require(ref.value[region.slices()], requirements="C")
            memoryview(out).cast("B")[:] = data.tobytes()
            return
        fd, read = self._open(key, chunk)
        try:
            read_region_into(ref.at, read, region.offsets, region.sizes, out)
        finally:
            os.close(fd)

    def read_object_bytes(self, key: str) -> bytes:
        return torch_save_bytes(self._values[key])

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        return self._values[key]

    def close(self) -> None:
        pass


def _check_plain(value: Any, where: str) -> None:
    """Param-group values are plain data (numbers, strings, None, tuples/lists of them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_plain(v, where)
        return
    raise UnsupportedError(f"{where} holds a {type(value).__name__}; only plain values (numbers, strings, "
                           "tuples) carry over to other frameworks")


# ---------------------------------------------------------------------------------------------
# writing


def atom_path(fqn: str, state: str) -> str:
    """The atom file of ``state`` of parameter ``fqn``, relative to the tag folder."""
    return f"{ZERO_DIR}/{fqn}/{state}.pt"


def check_param_name(fqn: str, key: str) -> None:
    """A parameter name must be usable as one folder name under ``zero/``."""
    if not fqn or fqn in (".", "..") or "/" in fqn or "\x00" in fqn or len(fqn.encode()) > 255:
        raise UnsupportedError(f"key {key!r}: parameter name {fqn!r} cannot name a folder of zero/ (DeepSpeed names "
                               "each parameter's folder after it); rename the key")


def atom_pickle(dtype: str, shape: Sequence[int], wrapped: bool) -> bytes:
    """``data.pkl`` of an atom: ``{'param': tensor, 'cat_dim': 0}`` (read by the ZeRO-1/2 and the
    ZeRO-3 loaders) or, unwrapped, the bare tensor (``step.pt``)."""
    ref = tensor_ref(dtype, tuple(shape))
    return pickle_with_tensor({PARAM: ref, CAT_DIM: 0} if wrapped else ref)


class AtomWriter:
    """Streams one atom file: a temp file sized up front, pieces in C order, renamed on close."""

    def __init__(self, path: Path, dtype: str, shape: Sequence[int], wrapped: bool = True) -> None:
        self.path = Path(path)
        self.dtype, self.shape = by_name(dtype).name, tuple(int(n) for n in shape)  # what the archive records
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._writer = TensorArchiveWriter(self._fd, 0, by_name(dtype).name, tuple(shape),
                                               pkl=atom_pickle(dtype, shape, wrapped))
            os.ftruncate(self._fd, self._writer.size)
        except BaseException:
            os.close(self._fd)
            raise

    def write(self, piece: Any) -> None:
        """Append the next piece (numpy bit array or tensor), C order."""
        self._writer.write(piece)

    def close(self) -> None:
        """Finish the archive, fsync it and give it its final name."""
        try:
            self._writer.close()
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drop the temp file (a failed task)."""
        try:
            os.close(self._fd)
        except OSError:
            pass
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


def optimizer_state_bytes(param_groups: Sequence[Mapping[str, Any]], steps: Sequence[Any]) -> bytes:
    """``zero/optimizer_state.pt``: what the ZeRO-1/2 loader (``ds_version``, ``param_groups``) and
    the ZeRO-3 loader (``optimizer_state_dict.state[0].step``, its ``param_groups``) read.
    ``steps``: one 0-d tensor per group (None where the group has no optimizer state)."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [i]} for i, g in enumerate(param_groups)]
    state = {i: {STEP: s} for i, s in enumerate(steps) if s is not None}
    return torch_save_bytes({
        "ds_version": WRITTEN_DS_VERSION,
        "param_groups": groups,
        "optimizer_state_dict": {"state": state, "param_groups": groups},
        "dynamic_loss_scale": False,
        "overflow": False,
    })


def model_states_bytes(param_shapes: Sequence[Mapping[str, Sequence[int]]], global_steps: int) -> bytes:
    """A model-states file for the universal loader: ``param_shapes`` per group, counters, and an
    empty ``module`` (the loader restores weights from ``zero/``, never from here)."""
    import torch

    return torch_save_bytes({
        "module": OrderedDict(),
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [OrderedDict((k, torch.Size(s)) for k, s in g.items()) for g in param_shapes],
        "frozen_param_shapes": None,
        "shared_params": {},
        "frozen_param_fragments": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": 0,
        "global_steps": int(global_steps),
        "global_samples": 0,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_version": WRITTEN_DS_VERSION,
    })


def natural_sorted(names: Iterable[str]) -> list[str]:
    """Names in human order (``layers.2`` before ``layers.10``)."""
    return sorted(names, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])
