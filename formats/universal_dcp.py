"""A DCP ``StorageReader`` over the universal store: ``dcp.load`` any mesh straight from ``uni/``.

    import torch.distributed.checkpoint as dcp
    from formats.universal_dcp import UniversalStorageReader
    dcp.load(state_dict, storage_reader=UniversalStorageReader("uni/"))

The store's zarr chunks are presented as DCP chunks; torch's planner intersects them with each
rank's shards, and every rank reads only the chunk regions it needs.
"""

from __future__ import annotations

import io
import os
from torch.futures import Future
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
import torch

from formats.base import Box, ChunkRef
from formats.dtypes import by_name
from formats.objects import read_checked_object
from formats.universal import UniversalReader


class UniversalStorageReader(StorageReader):
    """Read a ckptconv universal store with ``torch.distributed.checkpoint.load``."""

    def __init__(self, path: str | os.PathLike, trust_pickle: bool = False) -> None:
        """``trust_pickle``: hand torch non-tensor entries whose pickle names globals outside the
        safe allowlist (torch's planner loads them with ``weights_only=False``: it runs them)."""
        super().__init__()
        self.path = os.fspath(path)
        self.trust_pickle = trust_pickle
        self.reader = UniversalReader(self.path, verify=True)  # every chunk's xxh3, once, as it is read
        self._chunks: dict[tuple[str, tuple[int, ...]], ChunkRef] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self.__init__(checkpoint_id, self.trust_pickle)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        index = self.reader.index()
        sd_meta: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for key, entry in index.tensors.items():
            chunks = []
            for c in entry.chunks:
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(c.box.offsets), sizes=torch.Size(c.box.sizes)))
                storage[MetadataIndex(key, torch.Size(c.box.offsets))] = c.locator
                self._chunks[(key, tuple(c.box.offsets))] = c
            props = TensorProperties(dtype=by_name(entry.dtype).torch_dtype)
            sd_meta[key] = TensorStorageMetadata(props, torch.Size(entry.shape), chunks)
        for key in index.objects:
            sd_meta[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = key
        planner_data = {k: tuple(e.path) for k, e in index.tensors.items()}
        planner_data |= {k: tuple(o.path) for k, o in index.objects.items()}
        md = Metadata(state_dict_metadata=sd_meta, planner_data=planner_data, storage_data=storage)
        md.storage_meta = StorageMeta(checkpoint_id=self.path, load_id=None)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._chunks:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            fqn = req.storage_index.fqn
            if req.type == LoadItemType.BYTE_IO:
                data = read_checked_object(self.reader, fqn, self.trust_pickle)  # never hand torch a hostile pickle
                planner.load_bytes(req, io.BytesIO(data))
                continue
            chunk = self._chunks[(fqn, tuple(req.storage_index.offset or ()))]
            region = Box(tuple(o + s for o, s in zip(chunk.box.offsets, req.storage_offsets)), tuple(req.lengths))
            data = self.reader.read_region(fqn, chunk, region)
            target = planner.resolve_tensor(req).detach()
            target.copy_(data)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        from formats.universal import is_universal_store

        return is_universal_store(checkpoint_id)
