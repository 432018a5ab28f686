"""Which entries a conversion copies: ``--keys PATTERN``, ``--model-only``, ``--optim-only``.

One function, :func:`select_entries`, decides it for every pipeline (to-universal,
from-universal): from the index and the atoms of the WHOLE checkpoint (so optimizer states still
follow their parameter's placement when only the optimizer is copied), it returns the tensor and
object keys to keep. A selection that keeps nothing is an error naming the closest keys.

- ``--model-only``: model weights and buffers (the atom's ``param`` role: ``model.*`` entries,
  torchtitan's top-level FQNs) and the non-tensor entries a model load needs (those under the
  model root, e.g. ``_extra_state``); optimizer state, schedulers, dataloader, RNG, step... dropped.
- ``--optim-only``: everything under the optimizer root (``optim`` / ``optimizer``: states and
  param groups).
- ``--keys``: globs (whole key, ``fnmatch``) or ``re:REGEX`` (``re.search``), repeatable (a key
  matching any is kept); combined with the two flags by AND.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from converter.plan.atoms import OPTIMIZER_ROOTS, AtomRef, group_atoms, root_prefix
from formats.base import CheckpointIndex
from formats.errors import ConfigError


@dataclass(frozen=True)
class Selection:
    """What to copy; the default copies everything."""

    keys: tuple[str, ...] = ()
    model_only: bool = False
    optim_only: bool = False

    def __post_init__(self) -> None:
        if self.model_only and self.optim_only:
            raise ConfigError("--model-only and --optim-only exclude each other; pass one (or --keys PATTERN)")

    @property
    def everything(self) -> bool:
        return not (self.keys or self.model_only or self.optim_only)

    def describe(self) -> str:
        parts = [f"--keys {k!r}" for k in self.keys]
        parts += ["--model-only"] * self.model_only + ["--optim-only"] * self.optim_only
        return " ".join(parts) or "everything"

    def to_json(self) -> dict:
        return {"keys": list(self.keys), "model_only": self.model_only, "optim_only": self.optim_only}


@dataclass(frozen=True)
class Selected:
    """The keys a selection keeps (None: every key)."""

    tensors: frozenset[str] | None
    objects: frozenset[str] | None

    def restrict(self, index: CheckpointIndex) -> CheckpointIndex:
        """``index`` with only the kept entries (the same object when everything is kept)."""
        if self.tensors is None and self.objects is None:
            return index
        tensors = {k: e for k, e in index.tensors.items() if self.tensors is None or k in self.tensors}
        objects = {k: o for k, o in index.objects.items() if self.objects is None or k in self.objects}
        return replace(index, tensors=tensors, objects=objects)

    def restrict_atoms(self, atoms: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
        """The atoms (atom -> {role: key}) with only kept keys; atoms left empty are dropped."""
        keep = (self.tensors or frozenset()) | (self.objects or frozenset())
        if self.tensors is None and self.objects is None:
            return {a: dict(m) for a, m in atoms.items()}
        out = {a: {r: k for r, k in m.items() if k in keep} for a, m in atoms.items()}
        return {a: m for a, m in out.items() if m}


def _paths(index: CheckpointIndex) -> dict[str, tuple]:
    return {k: tuple(e.path) for k, e in index.tensors.items()} | {k: tuple(o.path) for k, o in index.objects.items()}


def _under_optimizer(path: tuple, prefix: tuple) -> bool:
    rel = path[len(prefix):] if prefix and path[: len(prefix)] == prefix else path
    return bool(rel) and rel[0] in OPTIMIZER_ROOTS


def select_entries(index: CheckpointIndex, selection: Selection,
                   refs: Mapping[str, AtomRef] | None = None) -> Selected:
    """The tensor and object keys of ``index`` that ``selection`` keeps (see the module doc).

    ``refs`` (key -> atom) are those of the whole checkpoint (computed when not given). Raises
    :class:`ConfigError` when the selection keeps no entry.
    """
    if selection.everything:
        return Selected(None, None)
    from converter.plan.keys import key_matcher, no_match_message

    paths = _paths(index)
    if refs is None:
        refs = group_atoms(paths)[0]
    prefix = root_prefix(paths.values())
    matchers = [key_matcher(p) for p in selection.keys]

    def keep(key: str) -> bool:
        if matchers and not any(m(key) for m in matchers):
            return False
        if selection.model_only:
            return refs[key].role == "param"
        if selection.optim_only:
            return _under_optimizer(paths[key], prefix)
        return True

    tensors = frozenset(k for k in index.tensors if keep(k))
    objects = frozenset(k for k in index.objects if keep(k))
    if not tensors and not objects:
        if len(selection.keys) == 1 and not (selection.model_only or selection.optim_only):
            raise ConfigError(no_match_message(index, selection.keys[0], what="entry"))
        raise ConfigError(f"{index.root}: {selection.describe()} selects no entry; "
                          f"list keys with 'ckptconv inspect {index.root}'")
    return Selected(tensors, objects)


def selection_from_options(keys: Sequence[str] | None, model_only: bool, optim_only: bool) -> Selection:
    """The :class:`Selection` of the CLI options."""
    return Selection(tuple(keys or ()), bool(model_only), bool(optim_only))
