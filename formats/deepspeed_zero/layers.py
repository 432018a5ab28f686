"""A pipeline save's layer files (``layer_<l>[-model_<t>]-model_states.pt``): the frozen
parameters and buffers they alone hold.

``PipelineModule.save_state_dict`` writes each layer's ``state_dict()`` (its weights as the
module holds them: trainable, frozen and persistent buffers) once per TP rank; a layer without a
state dict (a function, a ``TiedLayerSpec`` with a ``forward_fn``) writes none. Under ZeRO-1 the
model states record only the optimizer's parameters (``param_shapes``) and the buffers' names
(``buffer_names``), so each layer-file tensor is:

* ``<l>.<name>`` when the layer is a plain one (a ``LayerSpec`` module registered as ``str(l)``):
  its trainable parameters come from the optimizer (shapes checked against the file), the rest
  (frozen parameters, buffers) are read from the file in their saved dtype;
* ``tied_modules.<key>.<name>`` when none of the file's names is recorded under ``<l>.`` and its
  names and shapes fit exactly one ``TiedLayerSpec`` module recorded by a stage (a tied module's
  file, written by every stage whose layer uses it without a ``forward_fn``): its trainable
  parameters come from the optimizer, the rest from the first such file, the later files' copies
  compared by ``verify``.

A layer whose parameters are all frozen records nothing and is read as a plain one. Not told
apart from the files: a wholly frozen plain layer with exactly the names and shapes of a trainable
tied module (read as that module's copy), and a wholly frozen tied module (read under its layer
indices, once per file).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from formats.base import TensorEntry
from formats.dcp.archive import TensorDesc
from formats.deepspeed_zero.files import Parsed, TagFiles
from formats.deepspeed_zero.index import IndexBuilder
from formats.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedError

#: A key's copies after the first: (who, which one it copies, what a difference means, the entry),
#: for :class:`.index.Copy`.
Later = dict[str, list[tuple[str, str, str, TensorEntry]]]
#: What a tied module's frozen tensor that differs between its layer files means.
FILES_WHY = ("though both files are the one TiedLayerSpec module's state (conversions take the first file's): the "
             "files are from different saves")
TIED = "tied_modules."
_LAYER = re.compile(r"(\d+)\.")


def _name(files: TagFiles, layer: int, t: int) -> str:
    axis = any("-model_" in n for n in files.layers.values())
    return f"layer_{layer:02d}" + (f"-model_{t:02d}" if axis else "") + "-model_states.pt"


def check_layer_files(root: Path, files: TagFiles, tp: int) -> None:
    """Every layer file for every TP rank ``0 .. tp-1``, and none of another rank."""
    beyond = sorted({t for _, t in files.layers if t >= tp})
    if beyond:
        raise CorruptCheckpointError(f"{root / files.layers[min(k for k in files.layers if k[1] == beyond[0])]}: a layer "
                                     f"file of tensor-parallel rank {beyond[0]}, the model states record {tp} per stage; "
                                     "the folder mixes two saves")
    for layer in sorted({layer for layer, _ in files.layers}):
        for t in range(tp):
            if (layer, t) not in files.layers:
                raise CheckpointNotFoundError(f"{root}: no {_name(files, layer, t)} (layer {layer} of tensor-parallel "
                                              f"rank {t}); copy every layer file of the save")


def _prefix(layer: int, keys: dict[str, TensorDesc], recorded: set[str], b: IndexBuilder, path: Path) -> str:
    """Where layer ``layer``'s file names live: ``<l>.`` or a tied module's ``tied_modules.<key>.``."""
    if not keys or any(f"{layer}.{k}" in recorded for k in keys):
        return f"{layer}."
    fits = []
    for prefix in sorted({".".join(n.split(".")[:2]) + "." for n in recorded if n.startswith(TIED)}):
        known = [k for k in keys if f"{prefix}{k}" in recorded]
        shapes = [(b.tensors[f"model.{prefix}{k}"].shape, tuple(keys[k].size)) for k in known
                  if f"model.{prefix}{k}" in b.tensors]
        if known and all(a == c for a, c in shapes):
            fits.append(prefix)
    if len(fits) > 1:
        raise UnsupportedError(f"{path}: a layer file that fits the tied modules {', '.join(fits)} alike (the same "
                               "names and shapes); which one it holds is not saved, and it is not supported yet")
    return fits[0] if fits else f"{layer}."


def add_layer_files(b: IndexBuilder, root: Path, files: TagFiles, parse: Callable[[str, str], Parsed], t: int,
                    recorded: set[str], later: Later, left_out: list[str]) -> None:
    """TP rank ``t``'s layer files: the tensors the optimizer does not hold, as ``model.<name>``
    (``recorded``: the names the model states list, trainable parameters and buffers)."""
    from_files: dict[str, int] = {}
    for layer in sorted(layer for layer, rank in files.layers if rank == t):
        parsed = parse(files.layers[(layer, t)], "a pipeline layer's state dict")
        if not isinstance(parsed.value, dict):
            raise CorruptCheckpointError(f"{parsed.path}: holds {type(parsed.value).__name__}, not a layer's state dict")
        keys = {k: v for k, v in parsed.value.items() if isinstance(k, str) and isinstance(v, TensorDesc)}
        left_out += [f"{parsed.name}: {k} ({type(v).__name__})" for k, v in parsed.value.items() if k not in keys]
        prefix = _prefix(layer, keys, recorded, b, parsed.path)
        for k, desc in keys.items():
            name = prefix + k
            key = f"model.{name}"
            held = b.tensors.get(key)
            if held is None:
                b.add_whole(key, ("model", name), parsed, desc, f"{k!r}")
                from_files[key] = layer
            elif key in from_files:  # a tied module's frozen tensor, in each of its files
                scratch = b.fork()
                scratch.add_whole(key, ("model", name), parsed, desc, f"{k!r}")
                later.setdefault(key, []).append((f"the layer {layer} file", f"the layer {from_files[key]} file",
                                                  FILES_WHY, scratch.tensors[key]))
            elif tuple(desc.size) != held.shape:
                raise CorruptCheckpointError(f"{parsed.path}: {k!r} is {list(desc.size)}, the optimizer partitions hold "
                                             f"{name!r} as {list(held.shape)}; the files are from different saves")
    missing = sorted({(int(m[1]), n) for n in recorded if (m := _LAYER.match(n)) and (int(m[1]), t) not in files.layers})
    if missing:
        layer, name = missing[0]
        raise CheckpointNotFoundError(f"{root}: no {_name(files, layer, t)} (layer {layer}, which holds {name!r}); copy "
                                      "every layer file of the save")
