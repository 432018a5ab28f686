"""What an output's metadata records, as its writer is about to publish it (:class:`Manifest`).

Every output writer (universal store, DCP, HF safetensors, DeepSpeed atom files) builds one from
the very metadata it commits: each tensor record (key, dtype, shape), where each record's bytes
lie (extents: a byte range of a file, or a whole file or folder), the non-tensor entries, and
anything its own metadata says is inconsistent. The conversion pipeline checks it against the
plan before the completion marker is written (``converter/run/output_check.py``). Built from
metadata only (no tensor byte is read): one entry per record and per stored chunk, in lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

#: The end of an extent that stands for a whole file or folder (one key's own).
WHOLE = 1 << 62


@dataclass
class Manifest:
    """Parallel lists: tensor record ``i`` is ``keys[i]`` of ``dtypes[i]`` (a torch dtype name)
    and ``shapes[i]``; extent ``j`` is bytes ``[begins[j], ends[j])`` of ``files[j]`` (relative to
    the output), holding part of key ``owners[j]``. A key recorded twice appears twice."""

    keys: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    begins: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def tensor(self, key: str, dtype: str, shape: tuple[int, ...]) -> None:
        """A tensor record of the metadata."""
        self.keys.append(key)
        self.dtypes.append(dtype)
        self.shapes.append(tuple(shape))

    def extent(self, key: str, file: str, begin: int, end: int) -> None:
        """Bytes ``[begin, end)`` of ``file`` hold (part of) ``key``."""
        self.owners.append(key)
        self.files.append(file)
        self.begins.append(begin)
        self.ends.append(end)

    def whole(self, key: str, path: str) -> None:
        """The file or folder ``path`` is ``key``'s alone."""
        self.extent(key, path, 0, WHOLE)

    def problem(self, text: str) -> None:
        """Something the metadata itself says is wrong (``text`` names the key)."""
        self.problems.append(text)

    def extend(self, other: Manifest) -> None:
        """Add every record, extent, object and problem of ``other`` (another part of one output)."""
        for f in fields(self):
            getattr(self, f.name).extend(getattr(other, f.name))

