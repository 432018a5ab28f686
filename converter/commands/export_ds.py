"""export-ds: a universal store (or DCP checkpoint) -> a DeepSpeed universal checkpoint.

The output is what DeepSpeed's ``load_universal_checkpoint`` reads under ZeRO-1, 2 and 3, at any
world size (layout in :mod:`formats.deepspeed`)::

    OUT/latest_universal                         the tag (written last: the completion marker)
    OUT/<tag>/zero/<fqn>/fp32.pt                 {'param': weights, 'cat_dim': 0}
    OUT/<tag>/zero/<fqn>/<state>.pt              each optimizer state of the parameter's shape
    OUT/<tag>/zero/<fqn>/step.pt                 the parameter's step (ZeRO-1/2 read it here)
    OUT/<tag>/zero/optimizer_state.pt            param groups and each group's step (ZeRO-3)
    OUT/<tag>/mp_rank_00_model_states.pt         param_shapes per group (ZeRO-1/2 name)
    OUT/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same (ZeRO-3 name)

Planning is pure (:func:`plan_export_ds`) over the source's keys and object paths: atoms of
:mod:`converter.atoms` give each parameter's states; param groups come from
``optim.param_groups.<i>.<hparam>`` (or torchtitan's per-parameter hyperparameters, grouped).
Every atom file is one write task whose pieces stream, in C order, into a ``torch.save`` archive
(byte-identical to ``torch.save``); tensors keep their dtype and bits.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from converter.plan.atoms import OPTIMIZER_ROOTS, AtomRef, group_atoms
from converter.plan.param_groups import param_groups
from converter.config import RunOptions
from converter.run.cross_view import map_header, mapped, with_map
from converter.run.destination import guarded
from converter.run.executor import os_errors_as_storage_errors
from converter.run.pipeline import Conversion, ConversionResult, Output, PlannedOutput, run_conversion
from converter.plan.copy_tasks import Piece, WriteTask, describe, plan_tensor
from converter.run.sources import open_checkpoint
from formats.base import CheckpointIndex, full_box
from formats.deepspeed import (LATEST_UNIVERSAL, MASTER, MODEL_STATES_FILES, OPTIMIZER_STATE, STEP, ZERO_DIR,
                               AtomWriter, atom_path, check_param_name, model_states_bytes, optimizer_state_bytes)
from formats.dtypes import by_name, from_storage_array, to_storage_array
from formats.errors import ConfigError, InvalidCheckpointError, UnsupportedError
from formats.fsutil import atomic_write_bytes
from formats.manifest import Manifest



@dataclass(frozen=True)
class AtomFile:
    """One output file: ``rel`` (under OUT) holds source tensor ``key`` (``wrapped``: as a dict atom)."""

    rel: str
    key: str
    wrapped: bool


@dataclass(frozen=True)
class ExportPlan:
    """Everything export-ds writes, decided before writing."""

    tag: str
    files: tuple[AtomFile, ...]
    groups: tuple[dict[str, Any], ...]  # hyperparameters per param group
    group_params: tuple[tuple[str, ...], ...]  # parameter FQNs per group
    step_keys: tuple[tuple[str, ...], ...]  # per group: the step tensors of its parameters
    shapes: dict[str, tuple[int, ...]]
    warnings: tuple[str, ...] = ()


def plan_export_ds(index: CheckpointIndex, refs: Mapping[str, AtomRef], atoms: Mapping[str, Mapping[str, str]],
                   group_values: Mapping[str, Any], tag: str | None, step_value: float | None) -> ExportPlan:
    """Pure: the files, groups and steps of the export of ``index`` (grouped by ``atoms``).

    ``group_values``: the values of the source's param_groups objects; ``step_value``: the step
    (for the default tag ``global_step<N>``)."""
    files: list[AtomFile] = []
    shapes: dict[str, tuple[int, ...]] = {}
    step_of: dict[str, str] = {}
    warnings: list[str] = []
    for fqn, members in atoms.items():
        pkey = members.get("param")
        if pkey is None or pkey not in index.tensors or not _is_model_key(index, pkey):
            continue
        check_param_name(fqn, pkey)
        entry = index.tensors[pkey]
        shapes[fqn] = tuple(entry.shape)
        files.append(AtomFile(atom_path(fqn, MASTER), pkey, True))
        for role, key in members.items():
            if role == "param" or key not in index.tensors:
                continue
            state = index.tensors[key]
            if role == STEP:
                if state.numel != 1:
                    raise InvalidCheckpointError(f"{index.root}: key {key!r}: a step of {state.numel} elements; "
                                                 "DeepSpeed keeps one number per parameter")
                files.append(AtomFile(atom_path(fqn, STEP), key, False))
                step_of[fqn] = key
            elif role in (MASTER,) or "." in role or "/" in role or state.numel != entry.numel:
                warnings.append(f"{key} left out: DeepSpeed's universal loader takes only optimizer states of the "
                                "parameter's size, one file per state")
            else:
                files.append(AtomFile(atom_path(fqn, role), key, True))
    if not files:
        raise InvalidCheckpointError(f"{index.root}: no model weights found (keys model.<fqn> or <fqn>); nothing "
                                     "to export to DeepSpeed")
    if not any(f.rel.endswith(("/exp_avg.pt", "/exp_avg_sq.pt")) for f in files):
        warnings.append("no Adam states (exp_avg, exp_avg_sq) in the source: DeepSpeed's ZeRO-3 universal load "
                        "needs them; ZeRO-1/2 engines load the weights alone")
    groups, params = param_groups(index, refs, group_values)
    if params is None:  # one group (or the hyperparameters' groups) over every parameter
        params = [list(shapes)] if len(groups) <= 1 else None
        if params is None:
            raise InvalidCheckpointError(f"{index.root}: {len(groups)} param groups and none lists its params; "
                                         "export needs each parameter's group")
        groups = groups or [{}]
    unknown = [f for g in params for f in g if f not in shapes]
    if unknown:
        raise InvalidCheckpointError(f"{index.root}: param group lists {unknown[0]!r}, which has no weights in "
                                     "the checkpoint; the optimizer state is from another model")
    step_keys = tuple(tuple(step_of[f] for f in g if f in step_of) for g in params)
    tag = tag or f"global_step{int(step_value) if step_value is not None else 0}"
    _check_tag(tag)
    files = [AtomFile(f"{tag}/{f.rel}", f.key, f.wrapped) for f in files]
    return ExportPlan(tag, tuple(files), tuple(groups), tuple(tuple(g) for g in params), step_keys, shapes,
                      tuple(warnings))


def _is_model_key(index: CheckpointIndex, key: str) -> bool:
    path = index.tensors[key].path
    return not any(p in OPTIMIZER_ROOTS for p in path[:-1])


def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or tag in (".", "..") or tag.startswith(".") or "\x00" in tag or "\n" in tag:
        raise ConfigError(f"--tag {tag!r}: a tag names one folder (no '/', not starting with '.')")


class _AtomSink:
    """Execute sink: each task streams into its atom file (temp name, renamed when complete);
    ``done`` records each finished file's dtype and shape (as its archive was written, or as the
    journal of an interrupted run says)."""

    def __init__(self, out: Path, files: Mapping[str, AtomFile]) -> None:
        self.out, self.files = out, files
        self.done: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._lock = threading.Lock()

    def open(self, task: WriteTask) -> _AtomSink._One:
        f = self.files[task.target]
        return _AtomSink._One(self, f.rel, AtomWriter(self.out / f.rel, task.dtype, task.box.sizes, wrapped=f.wrapped))

    def adopt(self, task: WriteTask) -> None:
        with self._lock:
            self.done[task.target] = (task.dtype, tuple(task.box.sizes))

    def sync(self) -> None:
        pass  # each file is fsynced before its rename

    def manifest(self, shapes: Mapping[str, tuple[int, ...]], tag: str) -> Manifest:
        """The atom files about to be published, and the model-states shapes the commit writes:
        each parameter's shape there must be its ``fp32`` file's."""
        m = Manifest()
        for rel, (dtype, shape) in self.done.items():
            m.tensor(rel, dtype, shape)
            m.whole(rel, str((self.out / rel).resolve()))
        for fqn, shape in shapes.items():
            rel = f"{tag}/{atom_path(fqn, MASTER)}"
            if rel in self.done and tuple(self.done[rel][1]) != tuple(shape):
                m.problem(f"parameter {fqn!r}: the model states give it shape {list(shape)}, its {MASTER}.pt holds "
                          f"{list(self.done[rel][1])}")
        return m

    class _One:
        def __init__(self, owner: _AtomSink, rel: str, writer: AtomWriter) -> None:
            self.owner, self.rel, self.writer = owner, rel, writer

        def write(self, piece: Piece, data: np.ndarray) -> None:
            self.writer.write(np.ascontiguousarray(data))

        def close(self) -> None:
            self.writer.close()
            with self.owner._lock:
                self.owner.done[self.rel] = (self.writer.dtype, self.writer.shape)


def _read_whole(reader: Any, index: CheckpointIndex, key: str) -> Any:
    """A small tensor of the source, whole (a step), as a torch tensor."""
    entry = index.tensors[key]
    out = np.zeros(entry.shape, dtype=by_name(entry.dtype).numpy_dtype)
    for c in entry.chunks:
        out[c.box.slices()] = to_storage_array(reader.read_region(key, c, c.box))
    return from_storage_array(out, entry.dtype)


@guarded  # the destination's lock is held for the call; an interrupt says how to resume
@os_errors_as_storage_errors("export-ds")
def export_ds(src: str | os.PathLike, dst: str | os.PathLike, *, tag: str | None = None,
              options: RunOptions | None = None, key_map: Any = None, map_direction: str = "auto",
              key_style: str = "auto", config: Any = None) -> ConversionResult:
    """Write the store (or DCP checkpoint) ``src`` as a DeepSpeed universal checkpoint in ``dst``:
    load it with ``"checkpoint": {"load_universal": true}`` and ``engine.load_checkpoint(dst)``.

    ``tag``: the checkpoint folder's name (default ``global_step<step>``). Local destinations only.
    ``key_map``, ``map_direction``, ``key_style``, ``config``: as to-universal's (``--map``: the
    parameters of another framework's model, e.g. an HF model's for a DeepSpeed engine wrapping it,
    each with its optimizer states and param group).
    """
    options = options or RunOptions()
    reader = open_checkpoint(src, trust_pickle=options.trust_pickle, verify=options.verify_source)
    try:
        reader, cross = mapped(reader, src, key_map, map_direction, key_style, config, options.trust_pickle)
        conv = _plan(reader, src, dst, tag, options)
        conv = replace(conv, header_options={**conv.header_options, **map_header(key_map, map_direction, key_style,
                                                                                   config)})
        return run_conversion(with_map(conv, cross), options)
    finally:
        reader.close()


#: Where DeepSpeed's native MoE layers keep their experts (``deepspeed.moe.layer.MoE``).
NATIVE_EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


def _refuse_native_moe(index: Any, src: str | os.PathLike) -> None:
    """Refuse a checkpoint of ``deepspeed.moe`` experts: DeepSpeed's universal loader restores each
    parameter from ``zero/<its name on the loading rank>``, and a native MoE layer names its experts
    by LOCAL ids there, so every expert-parallel rank past 0 would load the wrong experts."""
    key = next((k for k in index.tensors if NATIVE_EXPERTS in k), None)
    if key is not None:
        raise UnsupportedError(
            f"{src}: a mixture-of-experts checkpoint (deepspeed.moe expert {key.split('.', 1)[-1]!r}, global expert "
            "ids) cannot be written as a DeepSpeed universal checkpoint: DeepSpeed's universal loader restores "
            "native MoE experts by their local names, so expert-parallel ranks past 0 would load other experts; "
            "load the DeepSpeed folder itself, or from-universal it to a DCP checkpoint")


def _plan(reader: Any, src: str | os.PathLike, dst: str | os.PathLike, tag: str | None,
          options: RunOptions) -> Conversion:
    """The conversion: one write task per atom file (the same plan for the dry run and the run);
    the commit writes the optimizer state, both model-states files and, last,
    ``latest_universal``."""
    index = reader.index()
    _refuse_native_moe(index, src)
    paths = {k: e.path for k, e in index.tensors.items()} | {k: o.path for k, o in index.objects.items()}
    refs, atoms = group_atoms(paths)
    group_values = {k: reader.load_object(k, options.trust_pickle) for k, o in index.objects.items()
                    if "param_groups" in o.path or refs[k].role.startswith("hparam.")}
    first = _first_step(reader, index, atoms)
    plan = plan_export_ds(index, refs, atoms, group_values, tag, first)
    steps = _steps(reader, index, plan)
    by_rel = {f.rel: f for f in plan.files}
    tasks = [t for f in plan.files
             for t in plan_tensor(index.tensors[f.key], [(f.rel, full_box(index.tensors[f.key].shape))],
                                  options.effective_piece_bytes)]
    header_options = {"--tag": plan.tag}

    def open_output(out: Path) -> Output:
        def commit() -> None:
            folder = out / plan.tag
            atomic_write_bytes(folder / ZERO_DIR / OPTIMIZER_STATE, optimizer_state_bytes(plan.groups, steps))
            shapes = [{f: plan.shapes[f] for f in g} for g in plan.group_params]
            states = model_states_bytes(shapes, int(first) if first is not None else 0)
            for name in MODEL_STATES_FILES:
                atomic_write_bytes(folder / name, states)
            atomic_write_bytes(out / LATEST_UNIVERSAL, plan.tag.encode())  # the completion marker

        sink = _AtomSink(out, by_rel)
        return Output(sink=sink, commit=commit, manifest=lambda: sink.manifest(plan.shapes, plan.tag),
                      adopt=lambda task, info: sink.adopt(task), bytes_written=lambda stats: total)

    total = sum(t.nbytes for t in tasks)
    planned = ConversionResult(str(dst), len(plan.files), 0, total, 0.0, warnings=plan.warnings)
    expected = PlannedOutput.of((f.rel, index.tensors[f.key].dtype, index.tensors[f.key].shape) for f in plan.files)
    return Conversion("export-ds", src, dst, index, reader, tasks, header_options, open_output, planned,
                      describe=lambda: (describe(tasks), None), dry_run_warnings=plan.warnings, expected=expected)


def _first_step(reader: Any, index: CheckpointIndex, atoms: Mapping[str, Mapping[str, str]]) -> float | None:
    for members in atoms.values():
        key = members.get(STEP)
        if key in index.tensors and index.tensors[key].numel == 1:
            return float(_read_whole(reader, index, key).reshape(()).item())
    return None


def _steps(reader: Any, index: CheckpointIndex, plan: ExportPlan) -> list[Any]:
    """Each group's step (a 0-d tensor; None without one): its parameters' steps must agree."""
    out = []
    for i, keys in enumerate(plan.step_keys):
        if not keys:
            out.append(None)
            continue
        values = [_read_whole(reader, index, k).reshape(()) for k in keys]
        raw = [to_storage_array(v).tobytes() for v in values]
        odd = next((j for j, r in enumerate(raw) if r != raw[0]), None)
        if odd is not None:
            raise InvalidCheckpointError(
                f"{index.root}: key {keys[odd]!r}: step {values[odd].item()} differs from {keys[0]!r} "
                f"({values[0].item()}) in param group {i}; DeepSpeed keeps one step per param group")
        out.append(values[0].clone())
    return out
