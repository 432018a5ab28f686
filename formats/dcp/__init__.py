"""PyTorch Distributed Checkpoint (DCP) directories: ``.metadata`` + ``__<rank>_<n>.distcp`` files.

- ``metadata``: the allowlist unpickler for ``.metadata`` and bytes entries.
- ``archive``: parsing the ``torch.save`` zip archives that hold each chunk (zero-copy reads).
- ``reader``: :class:`DCPReader`, the format's :class:`formats.base.CheckpointReader`.
- ``archive_writer`` / ``writer``: streaming archive writer and :class:`DCPWriter`.
"""
