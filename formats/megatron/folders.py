"""The folders of a Megatron-LM legacy checkpoint (``--ckpt-format torch``).

Megatron-LM's ``save_checkpoint`` (``megatron/training/checkpointing.py``, ``get_checkpoint_name``)::

    <save>/latest_checkpointed_iteration.txt        the iteration (or ``release``), written last
    <save>/iter_<7 digits>/                           (``release/`` for a release checkpoint)
        mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/       pp when PP > 1, ep when EP > 1
            model_optim_rng.pt                        torch.save of the rank's state (DP rank 0)
            distrib_optim.pt                          the DistributedOptimizer's state (its DP rank 0)

A two-part name ``mp_rank_00_001`` is a pipeline rank when PP > 1 and an expert rank otherwise:
the training arguments in the files say which (:func:`rank_folders`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from formats.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidCheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
RELEASE = "release"
#: Longest tracker file read (it holds a number or ``release``).
MAX_TRACKER_BYTES = 64
_FOLDER = re.compile(r"mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?")
_ITER = re.compile(r"iter_\d{7,}")


@dataclass(frozen=True)
class RankFolder:
    """One ``mp_rank_*`` folder: its name (relative to the checkpoint root) and ranks."""

    path: str
    tp: int
    pp: int
    ep: int

    @property
    def model_file(self) -> str:
        return f"{self.path}/{MODEL_FILE}"

    @property
    def optim_file(self) -> str:
        return f"{self.path}/{OPTIM_FILE}"


def iteration_dir_name(iteration: int | str) -> str:
    """``iter_0000007`` (or ``release``): the folder of ``iteration``."""
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def is_legacy_checkpoint(names: Iterable[str]) -> bool:
    """Whether a directory listing is a legacy checkpoint: its tracker file, an ``iter_*`` /
    ``release`` folder holding rank folders, or the rank folders themselves."""
    names = set(names)
    return TRACKER in names or any(_FOLDER.fullmatch(n) for n in names)


def parse_tracker(data: bytes, where: str) -> int | str:
    """The iteration ``latest_checkpointed_iteration.txt`` names (an int, or ``"release"``)."""
    text = data.decode("utf-8", "replace").strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit() or len(data) > MAX_TRACKER_BYTES:
        raise CorruptCheckpointError(f"{where}: holds {text[:40]!r}, not an iteration number or 'release'; "
                                     "fix the file or pass the iter_* folder itself")
    return int(text)


def find_iteration(st) -> tuple[str, int | str | None]:  # noqa: ANN001 - a formats.storage.Storage
    """``(folder, iteration)``: the folder (relative to ``st``'s root; ``""`` for the root itself)
    holding the rank folders, and its iteration (None when the root is an ``iter_*`` folder of
    unknown number)."""
    names = st.list()
    if any(_FOLDER.fullmatch(n) for n in names):
        name = str(st.root).rstrip("/").rsplit("/", 1)[-1]
        return "", (int(name[5:]) if _ITER.fullmatch(name) else RELEASE if name == RELEASE else None)
    where = f"{str(st.root).rstrip('/')}/{TRACKER}"
    if TRACKER not in names:
        iters = sorted(n for n in names if _ITER.fullmatch(n) or n == RELEASE)
        hint = f" (it has {', '.join(iters[-3:])}: pass one of them)" if iters else ""
        raise InvalidCheckpointError(f"{st.root}: no {TRACKER} and no mp_rank_* folders{hint}")
    iteration = parse_tracker(st.read_bytes(TRACKER, 0, MAX_TRACKER_BYTES + 1), where)
    folder = iteration_dir_name(iteration)
    if folder not in names:
        raise CheckpointNotFoundError(f"{where}: names iteration {iteration}, but {st.root}/{folder} is missing; "
                                      "pass an existing iter_* folder")
    return folder, iteration


def rank_folders(names: Iterable[str], prefix: str, pp_size: int | None, ep_size: int | None) -> list[RankFolder]:
    """The ``mp_rank_*`` folders among ``names`` (children of ``prefix``), with their ranks;
    ``pp_size`` / ``ep_size`` (from the training arguments, None when unknown) resolve two-part
    names. Sorted by (pp, ep, tp)."""
    out = []
    for name in names:
        m = _FOLDER.fullmatch(name)
        if m is None:
            continue
        tp, second, third = int(m.group(1)), m.group(2), m.group(3)
        if third is not None:
            pp, ep = int(second), int(third)
        elif second is None:
            pp, ep = 0, 0
        elif (pp_size or 1) > 1 or (pp_size is None and (ep_size or 1) == 1):
            pp, ep = int(second), 0
        else:
            pp, ep = 0, int(second)
        out.append(RankFolder(f"{prefix}/{name}" if prefix else name, tp, pp, ep))
    out.sort(key=lambda f: (f.pp, f.ep, f.tp))
    return out
