"""PyTorch Distributed Checkpoint (DCP) directories: ``.metadata`` + ``__<rank>_<n>.distcp`` files.

- ``safe_pickle`` / ``metadata``: the allowlist unpickler; ``.metadata`` parsing and merging.
- ``archive``: parsing the ``torch.save`` zip archives that hold each chunk (zero-copy reads).
- ``reader``: :class:`DCPReader`, the format's :class:`formats.base.CheckpointReader`.
- ``archive_writer`` / ``writer``: streaming archive writer and :class:`DCPWriter`.
"""

from formats.dcp.reader import DCPReader, is_dcp_checkpoint

__all__ = ["DCPReader", "is_dcp_checkpoint"]
