"""Root metadata of the universal store (``ckptconv.json``): frozen dataclasses <-> JSON.

The JSON Schema is ``schemas/universal.schema.json``; every write and every read is validated.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from formats.errors import CorruptCheckpointError
from schemas import validation_errors

FORMAT_NAME = "ckptconv-universal"
FORMAT_VERSION = 1
METADATA_FILE = "ckptconv.json"
SCHEMA = "universal"


@dataclass(frozen=True)
class SourceInfo:
    """Where the store's content came from."""

    format: str
    path: str | None = None
    world_size: int | None = None
    layout: str | None = None
    dcp_version: str | None = None


@dataclass(frozen=True)
class TensorRecord:
    """One tensor key: its zarr array, dtypes, shapes, object path, atom and chunk checksums."""

    array: str
    dtype: str
    storage_dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    path: tuple[str | int, ...]
    atom: str
    role: str
    checksums: dict[str, str] = field(default_factory=dict)
    source_split: dict[str, int] = field(default_factory=dict)
    source_replicated: bool = False
    tp_split_dim: int | None = None
    # safetensors backend only (left out of the JSON otherwise): chunk id -> its file, and the
    # name of the chunk's tensor inside each file
    files: dict[str, str] = field(default_factory=dict)
    tensor: str | None = None


@dataclass(frozen=True)
class ObjectRecord:
    """One non-tensor entry: the file with its exact serialized bytes, and a JSON view."""

    file: str
    path: tuple[str | int, ...]
    nbytes: int
    checksum: str
    atom: str
    role: str
    json: Any = None


@dataclass(frozen=True)
class UniversalMetadata:
    """The whole root metadata document."""

    tool_version: str
    source: SourceInfo
    tensors: dict[str, TensorRecord]
    objects: dict[str, ObjectRecord]
    atoms: dict[str, dict[str, str]]  # atom name -> role -> key
    created: str = ""
    backend: str = "zarr"  # where the chunks' bytes are: "zarr" or "safetensors" (formats/universal/)

    def to_json(self) -> dict[str, Any]:
        """The JSON document (validated against the schema)."""
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "tool": {"name": "ckptconv", "version": self.tool_version},
            "created": self.created,
            "complete": True,
            "checksum": "xxh3_64",
            **({"backend": self.backend} if self.backend != "zarr" else {}),
            "source": {k: v for k, v in asdict(self.source).items() if v is not None or k == "format"},
            "tensors": {k: _tensor_json(r) for k, r in self.tensors.items()},
            "objects": {k: _object_json(r) for k, r in self.objects.items()},
            "atoms": {name: {"members": dict(m)} for name, m in self.atoms.items()},
        }
        errors = validation_errors(SCHEMA, doc)
        if errors:
            raise CorruptCheckpointError(f"internal error: universal metadata violates its schema: {errors[0]}")
        return doc

    def dumps(self) -> bytes:
        """The document as written: one line per top-level field and per tensor / object / atom
        record (readable with any pager or ``grep``; each line made by json's C encoder, which an
        ``indent`` would turn off: 10x slower on a store of 10^5 tensors)."""
        return dumps_by_record(self.to_json())

    @classmethod
    def from_json(cls, doc: Any, where: str = METADATA_FILE) -> UniversalMetadata:
        """Parse and validate a document read from ``where``."""
        errors = validation_errors(SCHEMA, doc)
        if errors:
            raise CorruptCheckpointError(
                f"{where}: not a valid ckptconv universal store metadata ({errors[0]}); "
                "the store is damaged or from an incompatible version: reconvert it"
            )
        return cls(
            tool_version=doc["tool"]["version"],
            created=doc.get("created", ""),
            backend=doc.get("backend", "zarr"),
            source=SourceInfo(**doc["source"]),
            tensors={k: _tensor_from(v) for k, v in doc["tensors"].items()},
            objects={k: _object_from(v) for k, v in doc["objects"].items()},
            atoms={n: dict(a["members"]) for n, a in doc["atoms"].items()},
        )


def dumps_by_record(doc: dict[str, Any]) -> bytes:
    """``doc`` as JSON with each top-level field on its own line, and each entry of a top-level
    object field (the records) on its own line too; the same document as ``json.dumps(doc)``."""
    enc = json.JSONEncoder(allow_nan=False, ensure_ascii=True).encode
    lines = []
    for name, value in doc.items():
        head = enc(name) + ": "
        if isinstance(value, dict) and value:
            inner = ",\n  ".join(enc(k) + ": " + enc(v) for k, v in value.items())
            lines.append(head + "{\n  " + inner + "\n }")
        else:
            lines.append(head + enc(value))
    return ("{\n " + ",\n ".join(lines) + "\n}\n").encode()


def _fields(r: Any) -> dict[str, Any]:
    """A record's fields as a dict (shallow: ``asdict`` deep-copies every value, slowly)."""
    return {f: getattr(r, f) for f in r.__dataclass_fields__}


def _tensor_json(r: TensorRecord) -> dict[str, Any]:
    d = _fields(r)
    d["shape"], d["chunk_shape"], d["path"] = list(r.shape), list(r.chunk_shape), list(r.path)
    if not r.files and r.tensor is None:  # a zarr store's record: as before the safetensors backend
        d.pop("files")
        d.pop("tensor")
    return d


def _object_json(r: ObjectRecord) -> dict[str, Any]:
    d = _fields(r)
    d["path"] = list(r.path)
    if r.json is None:
        d.pop("json")
    return d


def _tensor_from(d: dict[str, Any]) -> TensorRecord:
    return TensorRecord(
        **{**d, "shape": tuple(d["shape"]), "chunk_shape": tuple(d["chunk_shape"]), "path": tuple(d["path"])}
    )


def _object_from(d: dict[str, Any]) -> ObjectRecord:
    return ObjectRecord(**{**d, "path": tuple(d["path"])})
