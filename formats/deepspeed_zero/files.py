"""The files of a DeepSpeed checkpoint folder as ``engine.save_checkpoint`` writes them, and
their parsing (zip directory and allowlisted ``data.pkl`` only; no tensor data read).

``save_checkpoint(save_dir, tag)`` writes, in ``save_dir/tag/`` (DeepSpeed 0.19)::

    mp_rank_<mp>_model_states.pt                          ZeRO-0/1/2: module, param_shapes, counters
    zero_pp_rank_<dp>_mp_rank_<mp>_model_states.pt        ZeRO-3 (one per dp rank)
    [bf16_|fp16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt   ZeRO-1/2/3: the rank's partitions
    layer_<l>[-model_<mp>]-model_states.pt                pipeline engines: one per layer
    layer_<l>_expert_<e>_mp_rank_<mp>_model_states.pt     MoE experts
    expp_rank_<ep>_mp_rank_<mp>_optim_states.pt           MoE without ZeRO

and ``save_dir/latest`` (the tag's name), ``save_dir/zero_to_fp32.py``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from formats.dcp.archive import ArchiveTensor, Entry, describe_tensor
from formats.deepspeed_pickle import load_archive
from formats.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidCheckpointError
from formats.fsutil import short

LATEST = "latest"
#: Longest tag ``latest`` may name (a file name's limit on common file systems).
MAX_TAG_BYTES = 255
#: Largest ``data.pkl`` of one DeepSpeed file parsed (bytes).
MAX_PICKLE_BYTES = 256 << 20

MODEL_STATES = re.compile(r"mp_rank_(\d+)_model_states\.pt")
ZERO3_MODEL_STATES = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
OPTIM_STATES = re.compile(r"(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
EXPP_OPTIM_STATES = re.compile(r"expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
#: ``-model_<mp>`` only on a topology with a model axis (Megatron-DeepSpeed's pipe x model x data).
LAYER_STATES = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")
EXPERT_STATES = re.compile(r"(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt")


@dataclass(frozen=True)
class TagFiles:
    """The DeepSpeed files of one tag folder, by kind and rank (names relative to the folder)."""

    model: dict[int, str] = field(default_factory=dict)  # mp rank -> mp_rank_XX_model_states.pt
    zero3_model: dict[tuple[int, int], str] = field(default_factory=dict)  # (mp, dp) -> name
    optim: dict[tuple[int, int], str] = field(default_factory=dict)  # (mp, dp) -> name
    optim_prefixes: frozenset[str] = frozenset()
    expp_optim: dict[tuple[int, int], str] = field(default_factory=dict)
    layers: dict[tuple[int, int], str] = field(default_factory=dict)  # (layer, mp) -> name
    experts: dict[tuple[int, int, int], str] = field(default_factory=dict)  # (layer, expert, mp) -> name

    @property
    def any_model_states(self) -> bool:
        return bool(self.model or self.zero3_model)


def list_tag_files(folder: Path) -> TagFiles:
    """Classify the file names of ``folder`` (other names are ignored)."""
    files = TagFiles()
    prefixes = set()
    for name in sorted(os.listdir(folder)):
        if m := ZERO3_MODEL_STATES.fullmatch(name):
            files.zero3_model[(int(m[2]), int(m[1]))] = name
        elif m := OPTIM_STATES.fullmatch(name):
            files.optim[(int(m[3]), int(m[2]))] = name
            prefixes.add(m[1] or "")
        elif m := EXPP_OPTIM_STATES.fullmatch(name):
            files.expp_optim[(int(m[2]), int(m[1]))] = name
        elif m := LAYER_STATES.fullmatch(name):
            files.layers[(int(m[1]), int(m[2] or 0))] = name
        elif m := EXPERT_STATES.fullmatch(name):
            files.experts[(int(m[1] or -1), int(m[2]), int(m[3]))] = name
        elif m := MODEL_STATES.fullmatch(name):
            files.model[int(m[1])] = name
    return TagFiles(files.model, files.zero3_model, files.optim, frozenset(prefixes), files.expp_optim,
                    files.layers, files.experts)


def _has_model_states(folder: Path) -> bool:
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(MODEL_STATES.fullmatch(n) or ZERO3_MODEL_STATES.fullmatch(n) for n in names)


def _latest_tag(root: Path) -> str | None:
    latest = root / LATEST
    if not latest.is_file():
        return None
    with open(latest, "rb") as f:
        tag = f.read(MAX_TAG_BYTES + 1).decode("utf-8", "replace").strip()
    if (not tag or "/" in tag or "\0" in tag or tag in (".", "..")
            or len(tag.encode("utf-8", "surrogateescape")) > MAX_TAG_BYTES):
        raise CorruptCheckpointError(f"{latest}: names {short(repr(tag))}, not a tag folder; fix or remove the file")
    return tag


def is_deepspeed_zero(path: str | os.PathLike) -> bool:
    """True when ``path`` is a DeepSpeed ``save_checkpoint`` tag folder, or the folder whose
    ``latest`` names one."""
    root = Path(path)
    if _has_model_states(root):
        return True
    try:
        tag = _latest_tag(root)
    except (CorruptCheckpointError, OSError):
        return False
    return tag is not None and _has_model_states(root / tag)


def find_tag_dir(path: str | os.PathLike) -> Path:
    """The tag folder: ``path`` itself, or the one its ``latest`` file names."""
    root = Path(path)
    if _has_model_states(root):
        return root
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: no such DeepSpeed checkpoint folder")
    tag = _latest_tag(root)
    if tag is None:
        raise InvalidCheckpointError(f"{root}: not a DeepSpeed checkpoint folder (no *_model_states.pt and no "
                                     f"{LATEST} file); pass the folder save_checkpoint wrote (global_step<N>/)")
    if not _has_model_states(root / tag):
        raise CheckpointNotFoundError(f"{root / LATEST}: names tag {tag!r}, but {root / tag} holds no "
                                      "*_model_states.pt; pass the checkpoint's tag folder itself")
    return root / tag


@dataclass(frozen=True)
class Parsed:
    """One parsed ``torch.save`` file: its value (tensors as descriptions) and zip entries."""

    root: Path
    name: str  # relative to root
    value: Any
    entries: dict[str, Entry]
    prefix: str

    @property
    def path(self) -> Path:
        return self.root / self.name

    def tensor(self, desc: Any, what: str) -> ArchiveTensor:
        """The stored tensor a description of the pickle names (storage bounds checked)."""
        return describe_tensor(desc, self.entries, self.prefix, f"{self.path}: {what}")

    def storage_key(self, desc: Any) -> str:
        """The zip member holding the tensor's storage (to tell shared storages apart)."""
        return f"{self.prefix}data/{desc.storage.key}"


def parse_file(root: Path, name: str, what: str) -> Parsed:
    """Parse ``root/name`` (a ``torch.save`` zip) without reading tensor data; errors name the file."""
    value, entries, prefix = load_archive(root / name, what, "the checkpoint is incomplete: copy the whole tag "
                                          "folder save_checkpoint wrote", MAX_PICKLE_BYTES, lazy=True)
    return Parsed(root, name, value, entries, prefix)
