"""Which HF tensors ``export-hf --quantize fp8-block`` writes as block-scaled FP8, and what it adds
(pure): each chosen ``X.weight`` becomes ``float8_e4m3fn`` followed by its float32
``X.weight_scale_inv`` (one scale per block, :func:`formats.quant.fp8_scale_shape`), and the
config gains DeepSeek-V3's ``quantization_config``.

Chosen (DeepSeek-V3's hub layout): floating-point ``*.weight`` tensors of 2 or more dims except
embeddings, the output projection, norms and MoE routers (``embed``, ``lm_head``, a top-level ``output``, ``norm``,
``mlp.gate.weight``, ``router``), and except the modules the config's
``quantization_config.modules_to_not_convert`` names; or, with ``only``, exactly those names.
A weight that is float8 already and has its scales in the source is written as it is (the round
trip of an FP8 import is exact).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from formats.dtypes import CASTABLE_FLOATS
from formats.errors import ConfigError
from formats.hf import TensorSpec
from formats.quant import FP8_SCALE, fp8_scale_shape

QUANTIZE_KINDS = ("fp8-block",)
#: Name parts DeepSeek-V3 (and transformers' FP8 quantizer) keep in high precision.
DEFAULT_SKIP = re.compile(r"embed|(^|\.)(wte|wpe|lm_head)(\.|$)|^output\.weight$|norm|(^|\.)mlp\.gate\.weight$|router")


@dataclass(frozen=True)
class QuantizedSpecs:
    """The export's tensors with quantization applied: ``specs`` in file order (each scale right
    after its weight); ``targets`` HF name -> (``"weight"`` | ``"scale"``, the weight's HF name)."""

    specs: tuple[TensorSpec, ...]
    targets: Mapping[str, tuple[str, str]]
    block: tuple[int, int]


def check_kind(kind: str | None) -> str | None:
    """``kind`` when it is a known ``--quantize`` value (None passes); ConfigError otherwise."""
    if kind is not None and kind not in QUANTIZE_KINDS:
        raise ConfigError(f"--quantize {kind}: unknown; use {', '.join(QUANTIZE_KINDS)}")
    return kind


def scale_name(weight: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv``."""
    return weight[: -len(".weight")] + FP8_SCALE


def _skipped(name: str, config: Mapping[str, Any] | None) -> bool:
    qc = (config or {}).get("quantization_config")
    keep = qc.get("modules_to_not_convert") if isinstance(qc, Mapping) else None
    if keep:
        module = name[: -len(".weight")]
        return any(module == m or module.endswith("." + m) or module.startswith(m + ".") for m in keep)
    return DEFAULT_SKIP.search(name) is not None


def chosen(spec: TensorSpec, config: Mapping[str, Any] | None, only: Collection[str] | None) -> bool:
    """Whether ``spec`` is quantized (see the module docstring)."""
    if only is not None:
        return spec.name in only
    return (spec.name.endswith(".weight") and len(spec.shape) >= 2 and spec.dtype in CASTABLE_FLOATS
            and not _skipped(spec.name, config))


def plan_quantize(specs: Sequence[TensorSpec], block: tuple[int, int], config: Mapping[str, Any] | None = None,
                  only: Collection[str] | None = None, fp8: str = "float8_e4m3fn") -> QuantizedSpecs:
    """The specs of a quantized export (pure; see the module docstring)."""
    names = {s.name for s in specs}
    out: list[TensorSpec] = []
    targets: dict[str, tuple[str, str]] = {}
    for s in specs:
        if not chosen(s, config, only) or scale_name(s.name) in names or s.dtype not in CASTABLE_FLOATS:
            out.append(s)
            continue
        if len(s.shape) < 2 or not s.name.endswith(".weight"):
            raise ConfigError(f"--quantize fp8-block: {s.name!r} {list(s.shape)} is not a 2-d or larger .weight; "
                              "only those are block-scaled")
        out.append(TensorSpec(s.name, fp8, s.shape))
        out.append(TensorSpec(scale_name(s.name), "float32", fp8_scale_shape(s.shape, block)))
        targets[s.name] = ("weight", s.name)
        targets[scale_name(s.name)] = ("scale", s.name)
    return QuantizedSpecs(tuple(out), targets, tuple(block))  # type: ignore[arg-type]


def quantized_config(config: Mapping[str, Any], block: tuple[int, int]) -> dict[str, Any]:
    """``config`` with DeepSeek-V3's ``quantization_config`` (kept when it has one)."""
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    return {**config, "quantization_config": config.get("quantization_config") or qc}


def scales_after_weights(specs: Sequence[TensorSpec], targets: Mapping[str, tuple[str, str]], lag: int) -> list[TensorSpec]:
    """``specs`` in task order: each ``weight_scale_inv`` after its weight and ``lag`` more tensors
    (the workers have finished the weight by then, so its scales are kept, not computed again),
    the last ones at the end (pure). The file layout keeps ``specs``' order."""
    out: list[TensorSpec] = []
    waiting: list[tuple[int, TensorSpec]] = []
    others = 0  # tensors other than scales placed so far
    for s in specs:
        if targets.get(s.name, ("",))[0] == "scale":
            waiting.append((others + lag, s))
            continue
        out.append(s)
        others += 1
        while waiting and waiting[0][0] <= others:
            out.append(waiting.pop(0)[1])
    return out + [s for _, s in waiting]
