"""The one exception hierarchy of ckptconv.

Every error the tool raises on purpose derives from :class:`CkptConvError`. Each subclass also
inherits the builtin exception it resembles (zarr's style), so ``except FileNotFoundError`` keeps
working for callers that do not know about ckptconv. Messages are one line: what is wrong, where
(file and key), and how to fix it.
"""

from __future__ import annotations

import pickle


class CkptConvError(Exception):
    """Root of every error ckptconv raises on purpose."""


class CheckpointNotFoundError(CkptConvError, FileNotFoundError):
    """A path that should hold a checkpoint (or one of its files) does not exist."""


class InvalidCheckpointError(CkptConvError, ValueError):
    """The input exists but is not a valid checkpoint of the expected format."""


class CorruptCheckpointError(InvalidCheckpointError):
    """Checkpoint bytes are damaged: truncated files, bad archives, checksum mismatches."""


class IncompleteCheckpointError(InvalidCheckpointError):
    """A checkpoint or store lacks its completion marker (an interrupted write)."""


class UnsafePickleError(CkptConvError, pickle.UnpicklingError):
    """A pickle references a global outside the allowlist; it was not executed."""


class MissingClassError(CkptConvError, ImportError):
    """A trusted non-tensor entry names a class this process cannot import: its value cannot be
    built here, though its bytes are intact (copying them needs no class)."""


class DestinationError(CkptConvError, FileExistsError):
    """The destination cannot be used: not empty, inside the source, or outside its root."""


class ConfigError(CkptConvError, ValueError):
    """Bad options or option combinations, rejected before any I/O."""


class PlanError(CkptConvError, ValueError):
    """A placement plan or mesh cannot be applied to a tensor."""


class UnsupportedError(CkptConvError, NotImplementedError):
    """A valid input uses a feature ckptconv does not support yet."""


class StorageError(CkptConvError, OSError):
    """Reading or writing failed at the OS level (full disk, file size limit, I/O error)."""


class InternalError(CkptConvError, RuntimeError):
    """A check of ckptconv's own work failed (an output that is not its plan): a bug, never the
    input's fault; nothing was published. Its message starts with ``internal error:``."""


def clip(text: str, limit: int = 200) -> str:
    """``text`` on one line, at most ``limit`` characters: cut at the last word boundary before the
    limit with ``...`` appended, never in the middle of a word (only a first word longer than the
    limit is cut inside, also with ``...``)."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    head = text[: max(0, limit - 3)]
    if text[len(head)] != " ":  # the cut falls inside a word: drop that word
        cut = head.rfind(" ")
        head = head[:cut] if cut > 0 else head
    return head.rstrip() + "..."
