"""Megatron-LM legacy checkpoints (``--ckpt-format torch``) read as the torch_dist checkpoint of the
same state, streamed: no ``torch.load``, nothing unpickled outside the allowlist.

Each ``mp_rank_*/model_optim_rng.pt`` (:mod:`formats.megatron.folders`) is parsed once
(:mod:`formats.torch_file`: zip directory and ``data.pkl``); tensor bytes are read only when a region
is asked for. The index is what megatron-core's ``dist_checkpointing.save`` of the same model and
optimizer would hold, so every command treats both formats alike:

- model tensors under megatron-core's sharded keys, merged over TP, PP, virtual pipeline chunks
  (``model0``, ``model1``, ...) and expert ranks into global tensors (:mod:`formats.megatron.names`:
  stacked layers and experts, GLU ``linear_fc1`` halves, the local spec's norm names);
- the DistributedOptimizer's ``distrib_optim.pt`` (fp32 main params and Adam moments, flat per
  buffer: :mod:`formats.megatron.buffers`) as ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``,
  the ``fully_reshardable`` layout (same shapes and boxes as the parameter);
- ``common_state/shard_0_1``: the first rank's non-tensor state (``args``, ``iteration``,
  ``checkpoint_version``, ``opt_param_scheduler``, ``num_floating_point_operations_so_far``, ...,
  and the optimizer's param groups with ``param_state_sharding_type``) plus ``content_metadata``;
- ``rng_state/shard_<pp>.<tp>_<PP>.<TP>``: each (tp, pp) rank's RNG states; the layer modules'
  ``_extra_state`` as ShardedObjects over their layer (and expert) grid.

Each object's bytes are ``torch.save([value])``, exactly what megatron's torch_dist ShardedObjects
hold; values naming megatron's own classes pickle back to the same globals (never imported here).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from formats.base import Box, CheckpointIndex, ChunkRef, ObjectEntry, TensorEntry
from formats.dcp.archive import (ArchiveTensor, SliceReader, read_region_array, read_region_into, verify_crc)
from formats.dcp.archive_writer import contiguous_strides
from formats.dcp.reader import guess_path
from formats.dcp.safe_pickle import DTypeRef
from formats.dtypes import from_storage_array
from formats.errors import CorruptCheckpointError, InvalidCheckpointError, PlanError, UnsupportedError
from formats.megatron import folders as fo
from formats.megatron.buffers import buffer_layout, ddp_bucket_size
from formats.megatron.names import BUFFERS, LocalName, Split, is_extra_state, parse_name, tp_split
from formats.storage import OpenFiles, open_storage
from formats.torch_file import PickledObject, TorchFile, file_resolver, is_tensor, read_torch_file, torch_save_bytes

if TYPE_CHECKING:
    import numpy as np
    import torch

FORMAT = "megatron-legacy"
#: Modules whose classes Megatron-LM's files may name (enums in ``args``, the loss scaler): kept as
#: inert records, pickled back as they were.
FRAMEWORK_MODULES = ("megatron", "transformer_engine", "apex")
#: torch_dist's backend record, written beside a conversion to torch_dist.
TORCH_DIST_METADATA = b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
#: What torch_dist's ``content_metadata`` says of the converted optimizer state.
CONTENT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}
COMMON_STATE = "common_state/shard_0_1"
#: Top-level entries of a rank's file that are not common state.
_RANK_ENTRIES = ("rng_state",)
_MODEL = "model"


@dataclass(frozen=True)
class Piece:
    """Where a chunk's bytes lie: the local tensor ``at`` of ``file`` (or a flat optimizer range
    viewed with the local shape), the chunk's offsets inside it, and how many leading axes of the
    chunk box (layer, expert: size 1) the local tensor does not have."""

    file: str
    at: ArchiveTensor
    local: tuple[int, ...]
    lead: int


@dataclass
class _Tensor:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[ChunkRef] = field(default_factory=list)
    boxes: set = field(default_factory=set)


@dataclass(frozen=True)
class _Rank:
    """One parsed rank folder."""

    folder: fo.RankFolder
    file: TorchFile
    chunks: tuple[dict, ...]  # the model state dict of each model chunk


@dataclass(frozen=True)
class Grid:
    """The saved layout: degrees and the virtual pipeline's layer offsets."""

    tp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    dp: int
    layer_offset: dict  # (block, pp, chunk) -> first global layer
    layers: dict  # block -> L
    experts: int  # E (0: none)
    local_experts: int


def _args(value: Any) -> dict:
    args = value.get("args") if isinstance(value, dict) else None
    if isinstance(args, PickledObject):
        args = args.state
    if args is not None and hasattr(args, "__dict__") and not isinstance(args, dict):
        args = vars(args)
    return args if isinstance(args, dict) else {}


def _int(args: dict, name: str, default: int | None) -> int | None:
    v = args.get(name)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def _model_chunks(value: Any, where: str) -> tuple[dict, ...]:
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where}: holds a {type(value).__name__}, not Megatron's state dict")
    if _MODEL in value:
        chunks = [value[_MODEL]]
    else:
        n = sum(1 for k in value if isinstance(k, str) and k.startswith(_MODEL) and k[len(_MODEL):].isdigit())
        chunks = [value.get(f"{_MODEL}{i}") for i in range(n)]
    if not chunks or not all(isinstance(c, dict) for c in chunks):
        raise CorruptCheckpointError(f"{where}: no 'model' state dict (nor model0, model1, ...); not a Megatron "
                                     "checkpoint file, or one saved without weights")
    return tuple(chunks)


def _shape(desc: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in desc.size)


class LegacyReader:
    """A :class:`formats.base.CheckpointReader` over a Megatron-LM legacy checkpoint: the folder
    holding ``latest_checkpointed_iteration.txt``, an ``iter_*`` folder, or ``release``.

    ``trust_pickle``: classes of any module in the files become inert records (else only
    megatron's own, :data:`FRAMEWORK_MODULES`); ``verify``: check each storage's zip CRC-32 once."""

    def __init__(self, path: str | os.PathLike, trust_pickle: bool = False, verify: bool = False) -> None:
        self._storage = open_storage(path)
        self.root = self._storage.root
        self.trust_pickle = trust_pickle
        self._verify, self._verified = verify, set()
        self._files = OpenFiles(self._storage)
        self._resolve = file_resolver(FRAMEWORK_MODULES, trust_pickle)
        try:
            self._prefix, self.iteration = fo.find_iteration(self._storage)
            self._index = self._build()
        except BaseException:
            self._files.close()
            raise

    # -- parsing -----------------------------------------------------------------------------

    def _where(self, rel: str) -> str:
        return f"{str(self.root).rstrip('/')}/{rel}"

    def _parse(self, rel: str) -> TorchFile:
        size = self._storage.size(rel)
        return read_torch_file(self._files.get(rel), rel, self._where(rel), size, self._resolve)

    def _folders(self, args: dict) -> list[fo.RankFolder]:
        names = self._storage.list(self._prefix) if self._prefix else self._storage.list()
        pp, ep = _int(args, "pipeline_model_parallel_size", None), _int(args, "expert_model_parallel_size", None)
        return fo.rank_folders(names, self._prefix, pp, ep)

    def _ranks(self) -> list[_Rank]:
        folders = self._folders({})
        if not folders:
            raise InvalidCheckpointError(f"{self._where(self._prefix)}: no mp_rank_* folders")
        first = self._parse(folders[0].model_file)
        folders = self._folders(_args(first.value))
        ranks = []
        for f in folders:
            tf = first if f.model_file == first.name else self._parse(f.model_file)
            ranks.append(_Rank(f, tf, _model_chunks(tf.value, tf.where)))
        return ranks

    # -- the layout ----------------------------------------------------------------------------

    def _grid(self, ranks: list[_Rank], args: dict, local_spec: bool) -> Grid:
        tp = 1 + max(r.folder.tp for r in ranks)
        pp = 1 + max(r.folder.pp for r in ranks)
        ep = 1 + max(r.folder.ep for r in ranks)
        vpp = len(ranks[0].chunks)
        for name, got in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
            want = _int(args, name, got)
            if want != got:
                raise CorruptCheckpointError(f"{self._where(self._prefix)}: args.{name} is {want} but the folders hold "
                                             f"{got}; mp_rank_* folders are missing")
        etp = _int(args, "expert_tensor_parallel_size", tp) or tp
        if tp % etp:
            raise UnsupportedError(f"{self._where(self._prefix)}: expert TP {etp} does not divide TP {tp}; Megatron's "
                                   "legacy format cannot hold that layout (save with --ckpt-format torch_dist)")
        counts: dict[tuple[str, int, int], set] = defaultdict(set)
        n_local = 0
        for r in ranks:
            for c, sd in enumerate(r.chunks):
                for name in sd:
                    ln = parse_name(name, local_spec)
                    if ln.layer is not None:
                        counts[(ln.block, r.folder.pp, c)].add(ln.layer)
                    if ln.expert is not None:
                        n_local = max(n_local, ln.expert + 1)
        offsets, layers = {}, {}
        for block in {b for b, _, _ in counts}:
            total = 0
            for c in range(vpp):  # virtual stage c * PP + p holds the next layers
                for p in range(pp):
                    offsets[(block, p, c)] = total
                    total += len(counts.get((block, p, c), ()))
            layers[block] = total
        world = _int(args, "world_size", None)
        dp = _int(args, "data_parallel_size", (world // (tp * pp)) if world else 1) or 1
        return Grid(tp, pp, vpp, ep, etp, dp, offsets, layers, ep * n_local, n_local)

    # -- the index -----------------------------------------------------------------------------

    def _build(self) -> CheckpointIndex:
        ranks = self._ranks()
        args = _args(ranks[0].file.value)
        local_spec = self._local_spec(ranks, args)
        grid = self._grid(ranks, args, local_spec)
        self.grid, self.args = grid, args
        tensors: dict[str, _Tensor] = {}
        self._pieces: dict[tuple[str, Box], Piece] = {}
        self._objects: dict[str, tuple[Any, TorchFile]] = {}
        stacked = self._homogeneous(ranks, local_spec)
        objects: dict[str, ObjectEntry] = {}
        param_keys: dict[tuple[int, int], dict[str, tuple]] = {}  # (rank index, chunk) -> name -> placement
        for i, r in enumerate(ranks):
            for c, sd in enumerate(r.chunks):
                param_keys[(i, c)] = self._add_model(r, c, sd, grid, stacked, local_spec, tensors, objects)
        optim = self._add_optimizer(ranks, grid, args, param_keys, tensors)
        self._add_common(ranks, grid, objects, optim)
        for key, t in tensors.items():
            _check_cover(key, t, self._where(self._prefix))
        entries = {k: TensorEntry(k, t.dtype, t.shape, tuple(t.chunks), guess_path(k)) for k, t in tensors.items()}
        files = {r.file.name: r.file.size for r in ranks} | self._optim_files
        info = {"version": ranks[0].file.value.get("checkpoint_version"), "iteration": self.iteration,
                "world_size": grid.tp * grid.pp * grid.dp, "files": files,
                "megatron": {"tp": grid.tp, "pp": grid.pp, "vpp": grid.vpp, "ep": grid.ep, "etp": grid.etp,
                             "dp": grid.dp, "layers": dict(grid.layers), "experts": grid.experts,
                             "distributed_optimizer": bool(optim), "local_spec": local_spec,
                             "folders": len(ranks)}}
        return CheckpointIndex(FORMAT, str(self.root), entries, objects, info)

    @staticmethod
    def _local_spec(ranks: list[_Rank], args: dict) -> bool:
        impl = args.get("transformer_impl")
        if isinstance(impl, str):
            return impl == "local"
        return any(".input_layernorm." in n for sd in ranks[0].chunks for n in sd)

    @staticmethod
    def _homogeneous(ranks: list[_Rank], local_spec: bool) -> set[str]:
        """Blocks whose layers all hold the same names and shapes (stacked in torch_dist)."""
        sigs: dict[str, set] = defaultdict(set)
        for r in ranks:
            if r.folder.tp or r.folder.ep:
                continue
            for sd in r.chunks:
                layer_sig: dict[tuple[str, int], set] = defaultdict(set)
                for name, v in sd.items():
                    ln = parse_name(name, local_spec)
                    if ln.layer is not None:
                        layer_sig[(ln.block, ln.layer)].add((ln.rest, ln.expert, _shape(v) if is_tensor(v) else None))
                for (block, _), s in layer_sig.items():
                    sigs[block].add(frozenset(s))
        return {b for b, s in sigs.items() if len(s) == 1}

    def _place(self, ln: LocalName, r: _Rank, c: int, grid: Grid, stacked: set[str]) -> tuple[str, tuple, tuple]:
        """(sharded key, lead offsets, lead sizes) of a local name on rank ``r``, chunk ``c``."""
        lead_off, lead_size = [], []
        if ln.layer is None:
            return ln.rest, (), ()
        layer = grid.layer_offset[(ln.block, r.folder.pp, c)] + ln.layer
        if ln.block in stacked:
            key = ln.stacked_key
            lead_off.append(layer)
            lead_size.append(grid.layers[ln.block])
        else:
            key = ln.layer_key(layer)
        if ln.expert is not None:
            lead_off.append(r.folder.ep * grid.local_experts + ln.expert)
            lead_size.append(grid.experts)
        return key, tuple(lead_off), tuple(lead_size)

    def _add_model(self, r: _Rank, c: int, sd: dict, grid: Grid, stacked: set[str], local_spec: bool,
                   tensors: dict[str, _Tensor], objects: dict[str, ObjectEntry]) -> dict[str, tuple]:
        placed = {}
        for name, value in sd.items():
            ln = parse_name(name, local_spec)
            key, lead_off, lead_size = self._place(ln, r, c, grid, stacked)
            if is_extra_state(name):
                self._add_extra_state(key, lead_off, lead_size, value, r, objects)
                continue
            if not is_tensor(value):
                continue
            at = r.file.tensor(value, f"key {name!r}")
            local = _shape(value)
            split = self._split(key, name, local, sd, grid)
            degree, rank = (grid.etp, r.folder.tp % grid.etp) if ln.expert is not None else (grid.tp, r.folder.tp)
            shape = lead_size + _global_shape(local, split, degree)
            entry = tensors.get(key)
            if entry is None:
                entry = tensors[key] = _Tensor(at.dtype, shape)
            elif entry.shape != shape or entry.dtype != at.dtype:
                raise CorruptCheckpointError(f"{r.file.where}: key {name!r} is {at.dtype}{list(local)} here, other ranks "
                                             f"make {key!r} {entry.dtype}{list(entry.shape)}; the folders are from "
                                             "different runs")
            pieces = list(_pieces(local, split, degree, rank))
            for local_off, sizes, global_off in pieces:
                box = Box(lead_off + global_off, tuple(1 for _ in lead_off) + sizes)
                self._add_chunk(key, entry, box, Piece(r.file.name, at, local_off, len(lead_off)), _rank_of(r, grid))
            placed[name] = (key, lead_off, pieces, BUFFERS.fullmatch(name) is None, at.dtype)
        return placed

    def _split(self, key: str, name: str, local: tuple, sd: dict, grid: Grid) -> Split:
        glu = False
        if ".linear_fc1." in name:
            fc2 = sd.get(name.replace(".linear_fc1.", ".linear_fc2.").replace(".bias", ".weight"))
            glu = is_tensor(fc2) and len(fc2.size) == 2 and local[0] == 2 * int(fc2.size[1])
        split = tp_split(key, len(local), glu)
        if split is None:
            degree = grid.tp
            if degree > 1:
                raise UnsupportedError(f"{name}: how megatron splits this tensor over TP is not known here (key "
                                       f"{key!r}); only megatron-core's GPT / MoE layer names are supported at TP > 1")
            split = Split(None)
        return split

    def _add_chunk(self, key: str, entry: _Tensor, box: Box, piece: Piece, rank: int | None) -> None:
        ident = (box.offsets, box.sizes)
        if ident in entry.boxes:
            return  # a replica (another TP / expert rank of a replicated tensor)
        entry.boxes.add(ident)
        entry.chunks.append(ChunkRef(box, piece.file, (key, ident), rank))
        self._pieces[(key, ident)] = piece

    def _add_extra_state(self, key: str, lead_off: tuple, lead_size: tuple, value: Any, r: _Rank,
                         objects: dict[str, ObjectEntry]) -> None:
        if not lead_off and (value is None or key.startswith("output_layer.")):
            return  # megatron's torch_dist saves no extra state outside the layers (nor an empty output layer's)
        grid = (lead_off, lead_size) if lead_off else ((0,), (1,))
        okey = f"{key}/shard_{'.'.join(map(str, grid[0]))}_{'.'.join(map(str, grid[1]))}"
        if okey not in objects:
            self._add_object(objects, okey, value, r.file)

    def _add_object(self, objects: dict[str, ObjectEntry], key: str, value: Any, file: TorchFile) -> None:
        self._objects[key] = ([value], file)
        objects[key] = ObjectEntry(key, guess_path(key), file.name, key)

    # -- the distributed optimizer ---------------------------------------------------------------

    def _add_optimizer(self, ranks: list[_Rank], grid: Grid, args: dict, param_keys: dict,
                       tensors: dict[str, _Tensor]) -> bool:
        """The ``distrib_optim.pt`` states as tensors; whether any was found."""
        self._optim_files: dict[str, int] = {}
        found = False
        for i, r in enumerate(ranks):
            if fo.OPTIM_FILE not in self._storage.list(r.folder.path):
                continue
            tf = self._parse(r.folder.optim_file)
            self._optim_files[tf.name] = tf.size
            states = tf.value if isinstance(tf.value, list) else [tf.value]
            for k, state in enumerate(states):
                if state is None:
                    continue
                experts = k == 1 if len(states) > 1 else None
                self._add_optimizer_state(tf, state, r, i, grid, args, param_keys, tensors, experts)
                found = True
        return found

    def _buffers(self, r: _Rank, i: int, grid: Grid, param_keys: dict, experts: bool | None) -> Iterator[tuple]:
        """(chunk, param dtype, [(name, placement)]) of each buffer of one optimizer, in its order."""
        for c in range(len(r.chunks)):
            groups: dict[tuple[str, bool], list] = {}
            for name, placed in param_keys[(i, c)].items():
                if not placed[3]:
                    continue  # a buffer, not a parameter
                is_expert = parse_name(name, False).expert is not None
                if experts is not None and is_expert != experts:
                    continue
                groups.setdefault((placed[4], is_expert), []).append((name, placed))
            for dense in (False, True):  # DDP: the dense buffers, then the expert-parallel ones
                for (dtype, is_expert), members in groups.items():
                    if is_expert == dense:
                        yield c, dtype, members

    def _add_optimizer_state(self, tf: TorchFile, state: Any, r: _Rank, i: int, grid: Grid, args: dict,
                             param_keys: dict, tensors: dict[str, _Tensor], experts: bool | None) -> None:
        if not isinstance(state, dict) or state.get("buckets_coalesced") is not True:
            raise UnsupportedError(f"{tf.where}: a distributed optimizer state without 'buckets_coalesced' (Megatron "
                                   "before core 0.7); load and re-save it with a newer Megatron first")
        tied = args.get("untie_embeddings_and_output_weights") is False and grid.pp > 1
        buffers = list(self._buffers(r, i, grid, param_keys, experts))
        gbufs = sorted(k for k in state if isinstance(k, int))
        if len(gbufs) != len(buffers):
            raise CorruptCheckpointError(f"{tf.where}: {len(gbufs)} optimizer buffers, the model file of the folder "
                                         f"makes {len(buffers)}; the files are from different runs")
        for g, (c, dtype, members) in zip(gbufs, buffers):
            by_dtype = state[g]
            dkey, world = next(iter(by_dtype.items())) if isinstance(by_dtype, dict) and len(by_dtype) == 1 else (None, None)
            if not isinstance(world, dict):
                raise CorruptCheckpointError(f"{tf.where}: buffer {g} is not one {{(param dtype, grad dtype): "
                                             "states}} entry")
            if isinstance(dkey, tuple) and isinstance(dkey[0], DTypeRef) and dkey[0].name != dtype:
                raise CorruptCheckpointError(f"{tf.where}: buffer {g} holds {dkey[0].name} parameters, the model's "
                                             f"buffer {dtype}; the files are from different runs")
            shared = {"embedding.word_embeddings.weight", "output_layer.weight"} if tied else set()
            size = ddp_bucket_size(bool(args.get("overlap_grad_reduce")), _int(args, "ddp_bucket_size", None),
                                   grid.dp, r.folder.pp, c)
            layout = buffer_layout([(n, math.prod(_shape_of(p)), n in shared) for n, p in members], size)
            self._add_buffer(tf, g, world, layout, dict(members), tensors, _rank_of(r, grid))

    def _add_buffer(self, tf: TorchFile, g: int, world: dict, layout: Any, members: dict,
                    tensors: dict[str, _Tensor], rank: int) -> None:
        numel = world.get("numel_unpadded")
        if numel != layout.numel_unpadded:
            raise UnsupportedError(
                f"{tf.where}: buffer {g} holds {numel} elements, the model's parameters in megatron's buffer "
                f"layout make {layout.numel_unpadded}; the bucket settings (args overlap_grad_reduce, ddp_bucket_size) "
                "or frozen parameters differ from what the checkpoint says")
        for state, desc in world.items():
            if state == "numel_unpadded":
                continue
            if not is_tensor(desc) or _shape(desc) != (numel,):
                raise CorruptCheckpointError(f"{tf.where}: buffer {g} state {state!r} is not a [{numel}] tensor")
            flat = tf.tensor(desc, f"buffer {g} {state!r}")
            for p in layout.params:
                key, lead_off, pieces, _, _ = members[p.name]
                okey = f"optimizer.state.{state}.{key}"
                shape = tensors[key].shape
                entry = tensors.get(okey)
                if entry is None:
                    entry = tensors[okey] = _Tensor(flat.dtype, shape)
                local = _piece_shape(pieces)
                view = replace(flat, size=local, stride=contiguous_strides(local),
                               storage_offset=flat.storage_offset + p.start)
                for local_off, sizes, global_off in pieces:
                    box = Box(lead_off + global_off, tuple(1 for _ in lead_off) + sizes)
                    self._add_chunk(okey, entry, box, Piece(tf.name, view, local_off, len(lead_off)), rank)

    # -- objects -------------------------------------------------------------------------------

    def _add_common(self, ranks: list[_Rank], grid: Grid, objects: dict[str, ObjectEntry], optim: bool) -> None:
        first = ranks[0].file
        common = {}
        for k, v in first.value.items():
            if isinstance(k, str) and (k == _MODEL or (k.startswith(_MODEL) and k[len(_MODEL):].isdigit())):
                continue
            if k in _RANK_ENTRIES:
                continue
            if k == "optimizer":
                if not optim:
                    continue  # (a plain optimizer's state is not converted)
                v = ({i: _sharding(s) for i, s in enumerate(v)} if isinstance(v, list) else _sharding(v))
            common[k] = v
        if optim:
            common["content_metadata"] = dict(CONTENT_METADATA)
        self._add_object(objects, COMMON_STATE, common, first)
        for r in ranks:
            rng = r.file.value.get("rng_state")
            if rng is None or r.folder.ep:
                continue
            key = f"rng_state/shard_{r.folder.pp}.{r.folder.tp}_{grid.pp}.{grid.tp}"
            self._add_object(objects, key, rng, r.file)

    def check_file(self, rel: str) -> int:
        """Check the zip CRC-32 of every record of file ``rel`` (streamed; ``torch.load`` checks
        none); the bytes checked."""
        from formats.dcp.checks import check_archive

        where = self._where(rel)
        return check_archive(SliceReader(self._files.get(rel), 0, self._file_size(rel), where), where)

    def framework_files(self) -> dict[str, bytes]:
        """The files torch_dist keeps beside DCP's (``metadata.json``): what a conversion of this
        checkpoint to torch_dist needs."""
        return {"metadata.json": TORCH_DIST_METADATA}

    # -- the CheckpointReader protocol -------------------------------------------------------

    def index(self) -> CheckpointIndex:
        return self._index

    def _piece(self, key: str, chunk: ChunkRef, region: Box) -> tuple[Piece, Any, tuple, tuple]:
        piece = self._pieces.get(chunk.locator)
        if piece is None or chunk.locator[0] != key:
            raise PlanError(f"{self.root}: no chunk {chunk.box.to_json()} of tensor {key!r}")
        if not chunk.box.contains(region) or region.ndim != chunk.box.ndim:
            raise PlanError(f"key {key!r}: region {region.to_json()} is not inside chunk {chunk.box.to_json()}")
        rel = region.relative_to(chunk.box)
        n = piece.lead
        offsets = tuple(o + l for o, l in zip(rel.offsets[n:], piece.local))
        fd = self._files.get(piece.file)
        where = f"{self._where(piece.file)}: key {key!r}"
        read = SliceReader(fd, 0, self._file_size(piece.file), where)
        if self._verify and (piece.file, piece.at.data_start) not in self._verified:
            verify_crc(piece.at, read, where)
            self._verified.add((piece.file, piece.at.data_start))
        return piece, read, offsets, rel.sizes[n:]

    def _file_size(self, rel: str) -> int:
        sizes = self._index.info["files"] if hasattr(self, "_index") else {}
        return sizes.get(rel) or self._storage.size(rel)

    def read_region_array(self, key: str, chunk: ChunkRef, region: Box) -> np.ndarray:
        piece, read, offsets, sizes = self._piece(key, chunk, region)
        return read_region_array(piece.at, read, offsets, sizes).reshape(region.sizes)

    def read_region(self, key: str, chunk: ChunkRef, region: Box) -> torch.Tensor:
        return from_storage_array(self.read_region_array(key, chunk, region), self._index.tensors[key].dtype)

    def read_region_into(self, key: str, chunk: ChunkRef, region: Box, out: memoryview) -> None:
        piece, read, offsets, sizes = self._piece(key, chunk, region)
        read_region_into(piece.at, read, offsets, sizes, out)

    def read_object_bytes(self, key: str) -> bytes:
        value, file = self._objects[key]
        fd = self._files.get(file.name)
        read = SliceReader(fd, 0, file.size, file.where)

        def data_of(desc: Any) -> bytes:
            at = file.tensor(desc, f"key {key!r}")
            return bytes(read(at.data_start, at.data_length))

        return torch_save_bytes(value, data_of)

    def load_object(self, key: str, trust_pickle: bool = False) -> Any:
        from formats.objects import load_torch_object

        return load_torch_object(self.read_object_bytes(key), f"{self._where(self._objects[key][1].name)}: key "
                                 f"{key!r}", trust_pickle or self.trust_pickle)

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> LegacyReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _rank_of(r: _Rank, grid: Grid) -> int:
    """The global rank that wrote folder ``r``: DP rank 0 of its (tp, pp) group (an expert rank's
    folder: the DP rank its expert rank is, megatron's rank order being tp-cp-ep-dp-pp)."""
    return r.folder.tp + grid.tp * r.folder.ep + grid.tp * grid.dp * r.folder.pp


def _check_cover(key: str, t: _Tensor, where: str) -> None:
    """The chunks (disjoint: one per box) must cover the tensor: a missing rank folder leaves a gap."""
    have = sum(math.prod(c.box.sizes) for c in t.chunks)
    if have != math.prod(t.shape):
        files = sorted({c.file.rsplit("/", 2)[-2] for c in t.chunks})
        raise CorruptCheckpointError(f"{where}: key {key!r} {list(t.shape)}: its shards in {', '.join(files[:4])}"
                                     f"{' ...' if len(files) > 4 else ''} cover {have} of {math.prod(t.shape)} "
                                     "elements; a rank folder is missing or from another run")


def _sharding(state: Any) -> Any:
    """A DistributedOptimizer's ``state_dict()`` as torch_dist's common state keeps it."""
    return {**state, "param_state_sharding_type": CONTENT_METADATA["distrib_optim_sharding_type"]} \
        if isinstance(state, dict) else state


def _global_shape(local: tuple, split: Split, degree: int) -> tuple:
    if split.dim is None or degree == 1:
        return local
    return tuple(s * degree if d == split.dim else s for d, s in enumerate(local))


def _pieces(local: tuple, split: Split, degree: int, rank: int) -> Iterator[tuple[tuple, tuple, tuple]]:
    """(offsets in the local tensor, sizes, global offsets) of each chunk of a local TP shard."""
    zero = tuple(0 for _ in local)
    if split.dim is None or degree == 1:
        yield zero, local, zero
        return
    d = split.dim
    if not split.glu:
        yield zero, local, tuple(rank * s if i == d else 0 for i, s in enumerate(local))
        return
    half = local[0] // 2
    sizes = (half, *local[1:])
    yield zero, sizes, (rank * half, *zero[1:])
    yield (half, *zero[1:]), sizes, (degree * half + rank * half, *zero[1:])


def _piece_shape(pieces: list) -> tuple:
    """The local tensor's shape from its pieces (GLU halves stack on dim 0)."""
    first_sizes = pieces[0][1]
    if len(pieces) == 1:
        return first_sizes
    return (sum(p[1][0] for p in pieces), *first_sizes[1:])


def _shape_of(placed: tuple) -> tuple:
    return _piece_shape(placed[2])
