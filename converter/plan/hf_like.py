"""``export-hf --like BASE_HF_DIR``: an export laid out as the base model it was fine-tuned from
(pure, from the base's index): the base's files (names, which tensor in which, in what order,
each file's ``__metadata__``, the index when the base has one), each tensor in the base's dtype,
block-scaled FP8 exactly where the base has it (:mod:`converter.plan.hf_quant`), and the base's
non-weight files beside them. A tensor the base lacks, or one the base has and the export lacks,
is one error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from converter.plan.hf_quant import QuantizedSpecs, plan_quantize
from formats.base import CheckpointIndex
from formats.dtypes import CASTABLE_FLOATS
from formats.errors import ConfigError
from formats.hf import ShardLayout, TensorSpec, layout_of
from formats.quant import block_size_of, find_pairs

#: The output projection HF leaves out of a checkpoint whose config ties it to the embedding.
TIED_OUTPUT = "lm_head.weight"


@dataclass(frozen=True)
class LikePlan:
    """What ``--like`` changes in an export: the specs (base dtypes, FP8 where the base has it),
    the quantization targets, the base's file layout, and the HF names left out as tied."""

    specs: tuple[TensorSpec, ...]
    quantized: QuantizedSpecs | None
    layout: ShardLayout
    dropped: tuple[str, ...]


def plan_like(specs: Sequence[TensorSpec], base: CheckpointIndex, base_config: Mapping[str, Any] | None,
              where: str) -> LikePlan:
    """The export of ``specs`` laid out as the HF checkpoint ``base`` (pure; see the module
    docstring). ``where`` names the base in errors."""
    specs = list(specs)
    dropped: tuple[str, ...] = ()
    names = {s.name for s in specs}
    if (TIED_OUTPUT in names and TIED_OUTPUT not in base.tensors
            and (base_config or {}).get("tie_word_embeddings") is True):
        specs = [s for s in specs if s.name != TIED_OUTPUT]  # the base ties it: HF saves it once
        dropped = (TIED_OUTPUT,)
    block = block_size_of(base_config, f"{where}/config.json")
    pairs = {p.data: p for p in find_pairs(base.tensors, block, where=f"{where}: ").values() if p.kind == "fp8-block"}
    quantized = None
    todo = {s.name for s in specs if s.name in pairs and s.dtype in CASTABLE_FLOATS}
    if todo:
        quantized = plan_quantize(specs, block, only=todo, fp8=base.tensors[next(iter(todo))].dtype)
        specs = list(quantized.specs)
    _check_keys([s.name for s in specs], base, where)
    out = []
    for s in specs:
        e = base.tensors[s.name]
        if tuple(e.shape) != tuple(s.shape):
            raise ConfigError(f"--like {where}: {s.name} is {list(e.shape)} in the base but {list(s.shape)} in the "
                              "checkpoint; export against the base the checkpoint was trained from")
        if e.dtype != s.dtype and not (e.dtype in CASTABLE_FLOATS and s.dtype in CASTABLE_FLOATS):
            raise ConfigError(f"--like {where}: {s.name} is {e.dtype} in the base but {s.dtype} in the checkpoint, "
                              "which is not cast to it (only float16/bfloat16/float32/float64 are)")
        out.append(TensorSpec(s.name, e.dtype, s.shape))
    return LikePlan(tuple(out), quantized, layout_of(base), dropped)


def _check_keys(names: Sequence[str], base: CheckpointIndex, where: str) -> None:
    ours = set(names)
    extra = sorted(ours - set(base.tensors))
    missing = sorted(set(base.tensors) - ours)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConfigError(f"--like {where}: the export has {extra[0]!r}{more}, which the base lacks; use the key map "
                          "that gives the base's names (--map), or the base the checkpoint came from")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"--like {where}: the base has {missing[0]!r}{more}, which the checkpoint lacks; use the key "
                          "map that gives the base's names (--map), or the base the checkpoint came from")
