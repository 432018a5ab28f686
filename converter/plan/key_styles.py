"""How a framework names the entries of its training checkpoint (pure): the key and object path of
a parameter, of each of its optimizer states and of its param groups' hyperparameters.

Three styles, as the frameworks' own ``dcp.save`` writes them (checked on torch 2.13's
``get_state_dict`` and torchtitan 0.3.0's ``CheckpointManager``):

- ``torchtitan``: parameters at the top level (``("tok_embeddings.weight",)``), the optimizer
  flattened (``get_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))``) under
  ``optimizer``: ``("optimizer", "state.<fqn>.exp_avg")``, ``("optimizer", "param_groups.<fqn>.lr")``;
- ``dcp``: ``dcp.save({"model": model_sd, "optim": optim_sd})`` of ``get_state_dict(model, optim)``
  (its default, nested form): ``("model", fqn)``, ``("optim", "state", fqn, "exp_avg")``, each group
  ``("optim", "param_groups", i, "lr")`` and its parameters' FQNs ``("optim", "param_groups", i, "params")``;
- ``dcp-flat``: the same roots, the optimizer flattened as torchtitan's:
  ``("optim", "state.<fqn>.exp_avg")``, ``("optim", "param_groups.<fqn>.lr")``.

In every style the flattened key is the path joined with dots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from converter.plan.atoms import OPTIMIZER_ROOTS
from formats.errors import ConfigError

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class KeyStyle:
    """One framework's naming (see the module docstring)."""

    name: str
    model_root: tuple[str, ...]  # () or ("model",)
    optim_root: str  # "optimizer" or "optim"
    nested: bool  # optimizer state nested (get_state_dict's default) or flattened

    def param(self, fqn: str) -> tuple[str, Path]:
        """(key, path) of a parameter (or buffer)."""
        return _keyed((*self.model_root, fqn))

    def state(self, fqn: str, role: str) -> tuple[str, Path]:
        """(key, path) of optimizer state ``role`` (``exp_avg``; a nested one ``a.b``) of ``fqn``."""
        if self.nested:
            return _keyed((self.optim_root, "state", fqn, *role.split(".")))
        return _keyed((self.optim_root, f"state.{fqn}.{role}"))

    def hparam(self, fqn: str, name: str) -> tuple[str, Path]:
        """(key, path) of hyperparameter ``name`` of ``fqn``'s group (flattened styles)."""
        return _keyed((self.optim_root, f"param_groups.{fqn}.{name}"))

    def group(self, index: int, name: str) -> tuple[str, Path]:
        """(key, path) of entry ``name`` of param group ``index`` (the nested style)."""
        return _keyed((self.optim_root, "param_groups", index, name))


def _keyed(path: Path) -> tuple[str, Path]:
    return ".".join(map(str, path)), path


STYLES: dict[str, KeyStyle] = {s.name: s for s in (
    KeyStyle("torchtitan", (), "optimizer", False),
    KeyStyle("dcp", ("model",), "optim", True),
    KeyStyle("dcp-flat", ("model",), "optim", False),
)}
#: ``--key-style`` values: the styles, ``auto`` (the destination framework's: see
#: :func:`resolve_style`) and ``source`` (the source's own).
CHOICES = ("auto", *STYLES, "source")


def detect_style(paths: Iterable[Path]) -> KeyStyle:
    """The style of a checkpoint's object paths: parameters under ``model`` or at the top level,
    the optimizer root and whether its state is nested (defaults: torchtitan's)."""
    model_root: tuple[str, ...] | None = None
    optim_root, nested = None, None
    for p in paths:
        p = tuple(p)
        if len(p) >= 2 and p[0] in OPTIMIZER_ROOTS:
            optim_root = optim_root or str(p[0])
            if nested is None and (p[1] == "state" or (p[1] == "param_groups" and len(p) >= 4)):
                nested = True
            elif nested is None and str(p[1]).startswith(("state.", "param_groups.")):
                nested = False
        elif len(p) == 2 and p[0] == "model" and model_root is None:
            model_root = ("model",)
        elif len(p) == 1 and model_root is None:
            model_root = ()
    model_root = () if model_root is None else model_root
    optim_root = optim_root or ("optim" if model_root else "optimizer")
    nested = bool(nested)
    for s in STYLES.values():
        if (s.model_root, s.optim_root, s.nested) == (model_root, optim_root, nested):
            return s
    return KeyStyle("source", model_root, optim_root, nested)


def resolve_style(name: str, to_hf: bool, identity: bool, paths: Mapping[str, Path]) -> KeyStyle:
    """The target style ``--key-style name`` means: ``auto`` is the destination framework's (an
    FSDP2 job on Hugging Face names saves ``dcp``; torchtitan, the native side of its maps,
    ``torchtitan``; the identity map keeps the source's), ``source`` the source's own."""
    if name not in CHOICES:
        raise ConfigError(f"--key-style {name!r}: choose one of {', '.join(CHOICES)}")
    if name == "source" or (name == "auto" and identity):
        return detect_style(paths.values())
    if name == "auto":
        return STYLES["dcp" if to_hf else "torchtitan"]
    return STYLES[name]
