"""Whole-archive checks of a DCP checkpoint (``ckptconv verify``), beyond what reading needs.

- :func:`check_archive`: the CRC-32 of every entry of one item's ``torch.save`` zip archive
  (``torch.load`` checks none), and that torch's own zip reader agrees with Python's on where
  each entry's data starts; large items are streamed in bounded reads. The reader's
  :meth:`formats.dcp.DCPReader.check_chunk_archive` / ``check_object_archive`` run it on a
  chunk or an object of its index.
- :func:`overlapping_items`: items whose byte ranges share bytes of a file (damaged metadata).

The locator of a DCP :class:`formats.base.ChunkRef` stays opaque outside this package.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from typing import Any

from formats.base import CheckpointIndex
from formats.dcp.archive import BufferReader, ItemFile, ReadAt, entry_data_start
from formats.errors import CorruptCheckpointError

#: Items up to this size are read whole (one read) to check their archives; larger ones are
#: streamed through a window on the file.
WHOLE_ITEM_BYTES = 4 << 20


def check_archive(read: ReadAt, where: str, whole_item_bytes: int = WHOLE_ITEM_BYTES) -> int:
    """Check the zip archive of one item (its decoded bytes through ``read``): read whole when
    it has at most ``whole_item_bytes``, else streamed. Raises CorruptCheckpointError; returns
    the entry bytes checked."""
    if not isinstance(read, BufferReader) and read.length <= whole_item_bytes:
        read = BufferReader(bytes(read(0, read.length)), where)  # small: one read, not many tiny ones
    return check_zip_crcs(ItemFile(read), where)


def check_zip_crcs(f: ItemFile, where: str) -> int:
    """Check a ``torch.save`` zip archive: the CRC-32 of every entry (bounded reads), and that
    torch's own zip reader (miniz, stricter than :mod:`zipfile`) opens it and finds every entry's
    data where the CRC was checked. Raises CorruptCheckpointError; returns entry bytes checked.
    """
    total, starts = 0, {}
    try:
        with zipfile.ZipFile(f) as z:
            for info in z.infolist():
                try:
                    with z.open(info) as member:
                        while block := member.read(1 << 20):
                            total += len(block)
                except zipfile.BadZipFile as e:
                    raise CorruptCheckpointError(f"{where}: archive entry {info.filename}: {e}; the bytes are damaged") from None
                starts[info.filename] = entry_data_start(f, info, where)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # zipfile raises many builtin types on damaged archives
        raise CorruptCheckpointError(f"{where}: damaged zip archive ({type(e).__name__}: {e})") from None
    _check_with_torch(f, starts, where)
    return total


def _check_with_torch(stream: Any, starts: dict[str, int], where: str) -> None:
    """Open the archive with torch's zip reader; its records and data offsets must match."""
    import torch

    stream.seek(0)
    try:
        reader = torch._C.PyTorchFileReader(stream)
        offsets = {name: reader.get_record_offset(name) for name in reader.get_all_records()}
    except Exception as e:  # miniz reports damage as RuntimeError; be broad on hostile bytes
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CorruptCheckpointError(f"{where}: torch cannot open this archive ({first}); the bytes are damaged") from None
    ours = {name.split("/", 1)[-1]: start for name, start in starts.items()}
    if ours != offsets:
        raise CorruptCheckpointError(f"{where}: torch's zip reader and Python's disagree on the archive's entries; "
                                     "the zip structure is damaged")


@dataclass(frozen=True)
class Overlap:
    """Two items of one file sharing bytes: ``(offset, length, key)`` of each, in file order."""

    file: str
    first: tuple[int, int, str]
    second: tuple[int, int, str]


def overlapping_items(index: CheckpointIndex) -> list[Overlap]:
    """Items of a DCP index whose byte ranges overlap inside one file (a damaged metadata could
    alias chunks), by file name then offset."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    entries: list[tuple[str, str, Any]] = [(c.file, key, c.locator) for key, e in index.tensors.items()
                                           for c in e.chunks]
    entries += [(o.file, key, o.locator) for key, o in index.objects.items()]
    for file, key, loc in entries:
        spans.setdefault(file, []).append((loc.offset, loc.length, key))
    found = []
    for file, items in sorted(spans.items()):
        items.sort()
        found += [Overlap(file, a, b) for a, b in zip(items, items[1:]) if b[0] < a[0] + a[1]]
    return found
