"""Spawned-world helpers for the from-universal load proofs.

One gloo world per target layout runs several :class:`LoadJob`\\ s in turn. Each job builds the
model with the target parallelization (other weights than the source: the load must win),
``dcp.load``\\ s a checkpoint with torch's default planner through a recording reader, compares
every loaded entry bit for bit with torch's own reading of the SOURCE checkpoint (a
``torch.save`` of :func:`oracle.torch_reference`), then trains 3 more steps. Each rank writes a
JSON report per job; :func:`run_jobs` collects them.

Recorded per rank: every read item (key, chunk box, file, stored item length, the region read) and
every ``.distcp`` file the reader actually opened (the file system's ``create_stream`` is wrapped).
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from ckpt_factory import (
    CONTINUE_STEPS,
    _dp_rank,
    TRAIN_STEPS,
    FixtureSpec,
    add_special_buffers,
    build_parallel_model,
    make_mesh,
    run_world,
)
from models import build_model, make_optimizer, train_steps
from oracle import assert_same_value, bits_equal

MAX_ERRORS = 20
TITAN_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class LoadJob:
    """One checkpoint to load into the target world.

    ``reader``: "dcp" (a recording ``FileSystemReader``) or "universal" (the store through
    ``formats.universal_dcp.UniversalStorageReader``). ``ref``: a ``torch.save`` of the flattened
    torch reference of the source. ``spec``: the source fixture (model args, seed, style).
    ``path`` may name each rank's own folder with ``{rank}`` (a rank's staged files).
    """

    name: str
    path: str
    reader: str
    ref: str
    spec: FixtureSpec
    train: bool = True
    own_dataloader: bool = False  # torchtitan's way: a rank's state dict holds only its own dataloader.dp_rank_<d>


# ----------------------------------------------------------------------------- recording readers


class _RecordingFS:
    """Wraps a FileSystem: records every path opened for reading."""

    def __init__(self, fs: Any, opened: list[str]) -> None:
        self._fs, self._opened = fs, opened

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str):
        with self._fs.create_stream(path, mode) as stream:  # recorded once it opened (a missing file raises)
            if "r" in mode:
                self._opened.append(str(path))
            yield stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


class RecordingReader(FileSystemReader):
    """torch's FileSystemReader, recording the items it reads and the files it opens."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.items: list[dict] = []
        self.opened: list[str] = []
        self.fs = _RecordingFS(self.fs, self.opened)

    def read_data(self, plan, planner):
        md = self._metadata_for_record
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            self.items.append(_item_record(item, info.relative_path, info.length, md))
        return super().read_data(plan, planner)

    def read_metadata(self, *args, **kwargs):
        meta = super().read_metadata(*args, **kwargs)
        self._metadata_for_record = meta
        return meta

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self._metadata_for_record = metadata
        return super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


def _item_record(item: Any, file: str | None, length: int | None, md: Any) -> dict:
    fqn, offsets = item.storage_index.fqn, item.storage_index.offset
    rec = {"fqn": fqn, "file": file, "length": length, "bytes": item.type == LoadItemType.BYTE_IO}
    if not rec["bytes"]:
        sizes = next(tuple(c.sizes) for c in md.state_dict_metadata[fqn].chunks if tuple(c.offsets) == tuple(offsets))
        rec.update(
            offsets=list(offsets),
            sizes=list(sizes),
            storage_offsets=list(item.storage_offsets),
            lengths=list(item.lengths),
            dest_offsets=list(item.dest_offsets),
        )
    return rec


def _universal_reader(path: str):
    from formats.universal_dcp import UniversalStorageReader

    class RecordingUniversalReader(UniversalStorageReader):
        def __init__(self, p: str) -> None:
            super().__init__(p)
            self.items: list[dict] = []
            self.opened: list[str] = []

        def read_data(self, plan, planner):
            md = self.read_metadata()
            for item in plan.items:
                self.items.append(_item_record(item, None, None, md))
            return super().read_data(plan, planner)

    return RecordingUniversalReader(path)


# ----------------------------------------------------------------------------- comparisons


def _set_nested(state: dict, parts: list[str], value: Any) -> None:
    node = state
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _dcp_options(spec: FixtureSpec) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=getattr(spec, "flatten_optim", False))


def _template(spec: FixtureSpec, model: Any, optim: Any, ref: dict, dp_rank: int | None = None) -> dict:
    """The state dict to load into, as the fixture saved it: model + optimizer (DTensors), and a
    placeholder for every other entry of the source (an empty tensor, or None for an object);
    with ``dp_rank``, of torchtitan's per-rank ``dataloader.dp_rank_<d>`` entries only its own."""
    if spec.style == "titan":
        state: dict = dict(get_model_state_dict(model))
        state["optimizer"] = get_optimizer_state_dict(model, optim, options=TITAN_OPTIONS)
        owned, model_keys = ("optimizer.",), set(build_model(spec.model_args).state_dict())
    else:
        model_sd, optim_sd = get_state_dict(model, optim, options=_dcp_options(spec))
        state, owned, model_keys = {"model": model_sd, "optim": optim_sd}, ("model.", "optim."), set()
    for key, value in ref.items():
        if dp_rank is not None and key.startswith("dataloader.dp_rank_") and key != f"dataloader.dp_rank_{dp_rank}":
            continue
        if not key.startswith(owned) and key not in model_keys:
            _set_nested(state, key.split("."), torch.empty_like(value) if isinstance(value, torch.Tensor) else None)
    return state


def _apply(spec: FixtureSpec, model: Any, optim: Any, state: dict) -> None:
    """Hand the loaded state to the model and optimizer (torchtitan's way for "titan")."""
    if spec.style == "titan":
        names = set(get_model_state_dict(model))
        model_sd = {k: v for k, v in state.items() if k in names}
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=state["optimizer"],
                       options=TITAN_OPTIONS)
    else:
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_dcp_options(spec))


def _local_box(value: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return tuple(offset), tuple(shape)


def compare_loaded(state: dict, ref: dict) -> tuple[list[str], list[str], int]:
    """(keys compared, errors, elements compared) for every loaded entry against the reference."""
    flat, _ = flatten_state_dict(state)
    errors: list[str] = []
    numel = 0
    for key, value in flat.items():
        if key not in ref:
            errors.append(f"{key}: loaded but not in the source")
            continue
        want = ref[key]
        try:
            if isinstance(value, DTensor):
                offsets, sizes = _local_box(value)
                local = value.to_local()
                region = want[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                if tuple(local.shape) != sizes or not bits_equal(local, region):
                    raise AssertionError(f"{key}: local shard at {offsets}+{sizes} differs from the source")
                if value.dtype != want.dtype or tuple(value.shape) != tuple(want.shape):
                    raise AssertionError(f"{key}: {value.dtype}{tuple(value.shape)} vs {want.dtype}{tuple(want.shape)}")
                numel += local.numel()
            else:
                assert_same_value(value, want, key)
                numel += value.numel() if isinstance(value, torch.Tensor) else 0
        except AssertionError as e:
            errors.append(str(e)[:300])
    return sorted(flat), errors[:MAX_ERRORS], numel


def _model_matches(model: Any, ref: dict, prefix: str) -> list[str]:
    """After set_state_dict: the live parameters equal the source's (catches a lost copy)."""
    errors = []
    for name, p in model.named_parameters():
        want = ref[f"{prefix}{name}"]
        if isinstance(p, DTensor):
            offsets, sizes = _local_box(p)
            want = want[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            p = p.to_local()
        if not bits_equal(p.detach(), want):
            errors.append(f"model parameter {name} differs after set_state_dict")
    return errors[:MAX_ERRORS]


# ----------------------------------------------------------------------------- the worker


def _one_job(rank: int, layout: dict[str, int], mesh: Any, job: LoadJob) -> dict:
    t0 = time.perf_counter()
    ref = torch.load(job.ref, weights_only=False)
    model = build_parallel_model(layout, job.spec.model_args, mesh, job.spec.seed + 777)
    if job.spec.special:
        add_special_buffers(model)  # after parallelizing, as the fixture does
    optim = make_optimizer(model)
    state = _template(job.spec, model, optim, ref, _dp_rank(layout, rank) if job.own_dataloader else None)
    path = job.path.format(rank=rank)
    reader = RecordingReader(path) if job.reader == "dcp" else _universal_reader(path)
    t1 = time.perf_counter()
    dcp.load(state, storage_reader=reader)
    t2 = time.perf_counter()
    keys, errors, numel = compare_loaded(state, ref)
    _apply(job.spec, model, optim, state)
    errors += _model_matches(model, ref, "" if job.spec.style == "titan" else "model.")
    t3 = time.perf_counter()
    losses = train_steps(model, optim, CONTINUE_STEPS, job.spec.seed, start=TRAIN_STEPS) if job.train else []
    t4 = time.perf_counter()
    return {
        "keys": keys,
        "errors": errors,
        "numel": numel,
        "reads": reader.items,
        "opened": sorted(set(Path(n).name for n in reader.opened if n.endswith(".distcp"))),
        "opened_paths": reader.opened,
        "losses": losses,
        "seconds": {"build": t1 - t0, "load": t2 - t1, "compare": t3 - t2, "train": t4 - t3},
    }


def _first_cause(e: BaseException) -> str:
    """The innermost message (CheckpointException wraps each rank's traceback)."""
    failures = getattr(e, "failures", None)
    if failures:
        inner = next(iter(failures.values()))[0]
        return f"{type(inner).__name__}: {inner}"[:500]
    return str(e)[:500]


def load_jobs_worker(rank: int, world: int, layout: dict[str, int], jobs: list[LoadJob], out_dir: str) -> None:
    """Run every job in this rank (a world of the target ``layout``); one JSON per job."""
    mesh = make_mesh(layout)
    for i, job in enumerate(jobs):
        try:
            result = _one_job(rank, layout, mesh, job)
        except (Exception, CheckpointException) as e:  # dcp.load fails on all ranks together: go on
            result = {"exception": f"{type(e).__name__}: {_first_cause(e)}"}
        Path(out_dir, f"job{i}_rank{rank}.json").write_text(json.dumps(result))


def run_jobs(layout: dict[str, int], jobs: list[LoadJob], timeout: float = 400.0) -> dict[str, dict[int, dict]]:
    """Spawn the target world once and run ``jobs``; returns job name -> rank -> report."""
    world = max(1, math.prod(layout.values()))
    with tempfile.TemporaryDirectory() as tmp:
        run_world(load_jobs_worker, world, (layout, jobs, tmp), timeout=timeout)
        return {
            job.name: {r: json.loads(Path(tmp, f"job{i}_rank{r}.json").read_text()) for r in range(world)}
            for i, job in enumerate(jobs)
        }
