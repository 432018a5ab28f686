"""Block-scaled quantized weights as the Hugging Face hub stores them, and their exact arithmetic.

- **FP8 block-scaled** (DeepSeek-V3): ``X.weight`` in ``float8_e4m3fn`` (or ``e5m2``) plus
  ``X.weight_scale_inv``, one float per ``block`` (``quantization_config.weight_block_size``,
  default 128 x 128) of the last two dims, ``ceil(rows / b0) x ceil(cols / b1)`` (edge blocks may be
  partial). Value = ``float32(weight) * scale`` rounded once to the target dtype, exactly
  ``torch.distributed.checkpoint.quantized_hf_storage.QuantizedHuggingFaceStorageReader``.
- **MXFP4** (gpt-oss): ``P_blocks`` uint8 ``[..., G, B]`` (two e2m1 values a byte, low nibble
  first) plus ``P_scales`` uint8 ``[..., G]`` (e8m0: exponent ``s - 127``), ``2 B`` values per
  scale. Value = ``ldexp(lut[nibble], s - 127)`` in the target dtype, exactly transformers'
  ``convert_moe_packed_tensors``; its layout swaps dims 1 and 2 of ``[..., G * 2B]`` (the
  ``P`` parameter of ``GptOssExperts``), torch's reader keeps ``[..., G * 2B]`` under the
  ``P_blocks`` name (what torchtitan's gpt_oss loads).

Pure helpers find the pairs in an index (:func:`find_pairs`); the kernels work on numpy bit arrays
of any region (elementwise, so a region gives the same bits as the whole tensor) and use torch's
own conversions and rounding (imported on first use).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from formats.base import Box, Shape, TensorEntry
from formats.errors import ConfigError, InvalidCheckpointError

#: FP8 block of DeepSeek-V3 (and torch's reader default) when the config names none.
DEFAULT_FP8_BLOCK = (128, 128)
#: Largest finite float8_e4m3fn (the quantizer's saturation bound).
FP8_MAX = 448.0
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
FP8_SCALE = ".weight_scale_inv"
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"
#: e2m1 values of the 16 nibbles (OCP MX spec; gpt-oss, torch and transformers use this table).
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: MXFP4 layouts: transformers' (``P``, dims 1 and 2 swapped) or torch's reader's (``P_blocks``).
MX_LAYOUTS = ("transformers", "torch")


@dataclass(frozen=True)
class QuantPair:
    """A quantized tensor of an HF checkpoint: its data and scale keys and its logical tensor.

    ``kind`` is ``"fp8-block"`` (``block`` = rows x cols of one scale) or ``"mxfp4"`` (``block`` =
    values per scale); ``shape`` the logical (dequantized) shape; ``transpose``: the logical
    tensor swaps dims 1 and 2 of the unpacked one (transformers' MXFP4 layout).
    """

    name: str
    kind: str
    data: str
    scale: str
    block: tuple[int, ...]
    shape: Shape
    transpose: bool = False

    def to_json(self) -> dict[str, Any]:
        """The pair as inspect reports it."""
        return {"kind": self.kind, "name": self.name, "scales": self.scale, "block": list(self.block),
                "shape": list(self.shape), "dtype": "float4_e2m1" if self.kind == "mxfp4" else None}


def block_size_of(config: Mapping[str, Any] | None, where: str = "config.json") -> tuple[int, int]:
    """The FP8 block (rows, cols) of ``config['quantization_config']['weight_block_size']``
    (default 128 x 128); a malformed one is a :class:`ConfigError`."""
    qc = (config or {}).get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("weight_block_size") is None:
        return DEFAULT_FP8_BLOCK
    bs = qc["weight_block_size"]
    if (not isinstance(bs, (list, tuple)) or len(bs) != 2
            or not all(type(b) is int and b > 0 for b in bs)):
        raise ConfigError(f"{where}: quantization_config.weight_block_size {bs!r} is not two positive ints; fix it")
    return int(bs[0]), int(bs[1])


def fp8_scale_shape(shape: Shape, block: tuple[int, int]) -> Shape:
    """The ``weight_scale_inv`` shape of an FP8 weight: one scale per block of the last two dims."""
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def find_pairs(tensors: Mapping[str, TensorEntry], block: tuple[int, int] = DEFAULT_FP8_BLOCK,
               mx_layout: str = "transformers", where: str = "") -> dict[str, QuantPair]:
    """Logical name -> :class:`QuantPair` of every quantized tensor in ``tensors`` (pure).

    FP8: ``X.weight`` (float8, 2-d or more) with ``X.weight_scale_inv`` of :func:`fp8_scale_shape`.
    MXFP4: ``P_blocks`` uint8 ``[..., G, B]`` with ``P_scales`` uint8 ``[..., G]``. A pair whose
    shapes do not fit is an :class:`InvalidCheckpointError` naming it.
    """
    if mx_layout not in MX_LAYOUTS:
        raise ConfigError(f"MXFP4 layout {mx_layout!r}: use one of {', '.join(MX_LAYOUTS)}")
    out: dict[str, QuantPair] = {}
    for key, scale in tensors.items():
        if key.endswith(FP8_SCALE):
            data = key[: -len(FP8_SCALE)] + ".weight"
            w = tensors.get(data)
            if w is None or w.dtype not in FP8_DTYPES:
                continue
            if len(w.shape) < 2 or tuple(scale.shape) != fp8_scale_shape(tuple(w.shape), block):
                raise InvalidCheckpointError(
                    f"{where}{key}: {list(scale.shape)} scales do not fit {data} {list(w.shape)} in {block[0]}x{block[1]} "
                    "blocks; set quantization_config.weight_block_size in config.json (or --config)")
            out[data] = QuantPair(data, "fp8-block", data, key, tuple(block), tuple(w.shape))
        elif key.endswith(MX_SCALES):
            data = key[: -len(MX_SCALES)] + MX_BLOCKS
            b = tensors.get(data)
            if b is None:
                continue
            pair = _mx_pair(data, b, scale, mx_layout, where)
            out[pair.name] = pair
    return out


def _mx_pair(data: str, blocks: TensorEntry, scales: TensorEntry, layout: str, where: str) -> QuantPair:
    shape, sshape = tuple(blocks.shape), tuple(scales.shape)
    if blocks.dtype != "uint8" or scales.dtype != "uint8" or len(shape) < 2 or shape[:-1] != sshape:
        raise InvalidCheckpointError(
            f"{where}{data}: MXFP4 needs uint8 blocks [..., G, B] and uint8 scales [..., G]; found "
            f"{blocks.dtype}{list(shape)} and {scales.dtype}{list(sshape)}")
    unpacked = (*shape[:-2], shape[-2] * shape[-1] * 2)
    transpose = layout == "transformers" and len(unpacked) >= 3
    name = data[: -len(MX_BLOCKS)] if layout == "transformers" else data
    logical = _swap12(unpacked) if transpose else unpacked
    return QuantPair(name, "mxfp4", data, scales.key, (shape[-1] * 2,), logical, transpose)


def _swap12(shape: Shape) -> Shape:
    return (shape[0], shape[2], shape[1], *shape[3:])


# ---------------------------------------------------------------------------------------------
# regions


def fp8_scale_box(region: Box, block: tuple[int, int]) -> Box:
    """The box of scales covering ``region`` of an FP8 weight (its leading dims as they are)."""
    lead = len(region.offsets) - 2
    (r0, c0), (r1, c1) = region.offsets[lead:], region.ends[lead:]
    lo = (r0 // block[0], c0 // block[1])
    hi = (-(-r1 // block[0]), -(-c1 // block[1]))
    return Box((*region.offsets[:lead], *lo), (*region.sizes[:lead], hi[0] - lo[0], hi[1] - lo[1]))


def mx_source_boxes(pair: QuantPair, region: Box) -> tuple[Box, Box, int, int]:
    """(blocks box, scales box, first value's offset in the first group, values along the packed
    dim) a region of an MXFP4 logical tensor reads: whole groups along the packed dim, the other
    dims as the region's (in the unpacked ``[..., G * 2B]`` order)."""
    r = Box(_swap12(region.offsets), _swap12(region.sizes)) if pair.transpose else region
    per = pair.block[0]
    k0, k1 = r.offsets[-1], r.ends[-1]
    g0, g1 = k0 // per, -(-k1 // per)
    lead_o, lead_s = r.offsets[:-1], r.sizes[:-1]
    blocks = Box((*lead_o, g0, 0), (*lead_s, g1 - g0, per // 2))
    return blocks, Box((*lead_o, g0), (*lead_s, g1 - g0)), k0 - g0 * per, k1 - k0


# ---------------------------------------------------------------------------------------------
# kernels (numpy bit arrays in and out; torch's own conversions inside)


def _torch():
    import torch

    return torch


def _tensor(bits: np.ndarray, dtype: str):
    from formats.dtypes import from_storage_array

    return from_storage_array(np.ascontiguousarray(bits), dtype)


def _bits(t) -> np.ndarray:
    from formats.dtypes import to_storage_array

    return to_storage_array(t)


def dequantize_fp8(weight: np.ndarray, weight_dtype: str, scales: np.ndarray, scale_dtype: str,
                   region: Box, block: tuple[int, int], out_dtype: str) -> np.ndarray:
    """``region`` of an FP8 weight dequantized: ``weight`` holds its bits, ``scales`` the scale
    box :func:`fp8_scale_box` gives. ``float32(w) * float32(scale)`` rounded to ``out_dtype`` as
    torch rounds (torch's reader: ``block.to(float32) * scale_inv[i, j]``, then ``.to(target)``)."""
    torch = _torch()
    w = _tensor(weight, weight_dtype).to(torch.float32)
    s = _tensor(scales, scale_dtype).to(torch.float32)
    lead = len(region.offsets) - 2
    (r0, c0), (rows, cols) = region.offsets[lead:], region.sizes[lead:]
    s = s.repeat_interleave(block[0], dim=lead).repeat_interleave(block[1], dim=lead + 1)
    s = s.narrow(lead, r0 % block[0], rows).narrow(lead + 1, c0 % block[1], cols)
    w.mul_(s)
    return _bits(w.to(getattr(torch, out_dtype)))


def quantize_fp8(values: np.ndarray, dtype: str, block: tuple[int, int],
                 fp8: str = "float8_e4m3fn") -> tuple[np.ndarray, np.ndarray]:
    """(fp8 bits, float32 ``weight_scale_inv``) of a region aligned to whole blocks of the last
    two dims (edge blocks partial): per block ``scale = 448 / amax`` (1 for an all-zero block),
    ``q = clamp(x * scale, -448, 448)``, ``scale_inv = 1 / scale`` in float32, exactly
    transformers' ``FineGrainedFP8`` ``Fp8Quantize`` (amax / 448 scaling, DeepSeek-V3's form)."""
    torch = _torch()
    x = _tensor(values, dtype).to(torch.float32)
    lead = x.shape[:-2]
    rows, cols = x.shape[-2:]
    rt, ct = -(-rows // block[0]), -(-cols // block[1])
    pad = torch.nn.functional.pad(x, (0, ct * block[1] - cols, 0, rt * block[0] - rows))
    tiles = pad.reshape(*lead, rt, block[0], ct, block[1])
    max_abs = tiles.abs().amax(dim=(-3, -1))
    safe = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = FP8_MAX / safe
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    inv = (1.0 / scales).to(torch.float32)
    q = torch.clamp(tiles * scales.unsqueeze(-1).unsqueeze(-3), min=-FP8_MAX, max=FP8_MAX).to(getattr(torch, fp8))
    q = q.reshape(pad.shape)[..., :rows, :cols]
    return _bits(q.contiguous()), _bits(inv)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, out_dtype: str) -> np.ndarray:
    """MXFP4 ``blocks`` ``[..., G, B]`` and ``scales`` ``[..., G]`` unpacked to ``[..., G * 2B]``
    in ``out_dtype``, exactly transformers' ``_convert_moe_packed_tensors`` (and torch's reader):
    a lookup of each nibble (low first) in ``out_dtype``, then ``torch.ldexp`` by ``scale - 127``."""
    torch = _torch()
    b = torch.from_numpy(np.ascontiguousarray(blocks))
    s = torch.from_numpy(np.ascontiguousarray(scales)).to(torch.int32) - 127
    dt = getattr(torch, out_dtype)
    lut = torch.tensor(FP4_VALUES, dtype=dt)
    *prefix, g, nb = b.shape
    rows = math.prod(prefix) * g
    b, s = b.reshape(rows, nb), s.reshape(rows, 1)
    out = torch.empty(rows, nb * 2, dtype=dt)
    out[:, 0::2] = lut[(b & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(b >> 4).to(torch.int)]
    torch.ldexp(out, s, out=out)
    return _bits(out.reshape(*prefix, g * nb * 2))
