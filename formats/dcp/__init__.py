"""PyTorch Distributed Checkpoint (DCP) directories: ``.metadata`` + ``__<rank>_<n>.distcp`` files.

- ``safe_pickle`` / ``metadata``: the allowlist unpickler; ``.metadata`` parsing and merging.
- ``archive``: parsing the ``torch.save`` zip archives that hold each chunk (zero-copy reads).
- ``reader``: :class:`DCPReader`, the format's :class:`formats.base.CheckpointReader`.
- ``checks``: what ``verify`` checks beyond reading: every zip entry's CRC-32, overlapping items.
- ``archive_writer`` / ``writer``: streaming archive writer and :class:`DCPWriter`.
- ``torch_globals`` / ``metadata_pickle``: torch's names as static tables, and stand-ins that pickle
  as torch's objects (``data.pkl``, ``.metadata``) without importing torch.

None of these imports torch: data moves as numpy bit arrays (:mod:`formats.dtypes`); torch is
imported only where a torch object is asked for (``read_region``, ``load_object``, and the zip
check that opens an archive with torch's own reader).
"""

from formats.dcp.reader import DCPReader, is_dcp_checkpoint

__all__ = ["DCPReader", "is_dcp_checkpoint"]
