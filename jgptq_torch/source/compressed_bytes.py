"""compressed-tensors weights stored one value a byte: ``float-quantized`` (float8_e4m3fn, the ``-FP8-dynamic``
and ``-FP8-block`` releases), ``int-quantized`` (int8, W8A8) and ``naive-quantized`` (either):
``w = (q - zero_point) * scale`` per tensor, output channel, group or 2-D block.

Dequantized by compressed-tensors' own ``NaiveQuantizationCompressor.decompress`` (per-module state dict, no
module object needed; ragged edge blocks are its padding rule); here only dtypes and shapes are checked first so
that a bad tensor is named.
"""

from __future__ import annotations

import math

import torch

from .formats import PackScheme
from .packed import ct_scheme


def scale_shape(scheme: PackScheme, rows: int, cols: int, name: str) -> tuple[int, ...] | None:
    """The ``weight_scale`` shape a (rows, cols) weight has under ``scheme``; None for one scale (tensor)."""
    if scheme.strategy == "channel":
        return (rows, 1)
    if scheme.strategy == "group":
        if cols % scheme.group_size:
            raise ValueError(f"{name}.weight: {cols} columns are not a multiple of group_size {scheme.group_size} "
                             "(config.json)")
        return (rows, cols // scheme.group_size)
    if scheme.strategy == "block":
        return (math.ceil(rows / scheme.block[0]), math.ceil(cols / scheme.block[1]))
    return None


def dequantize_bytes(parts: dict[str, torch.Tensor], scheme: PackScheme, dtype: torch.dtype, *,
                     name: str = "module") -> torch.Tensor:
    """Dequantize one float-/int-quantized weight.

    parts: ``weight`` (R, C) float8_e4m3fn (type float) or int8 (type int); ``scale`` floating, shaped (R, 1)
    channel, (R, C/group_size) group, (ceil(R/br), ceil(C/bc)) block or one value (tensor); ``zero_point`` the
    scale's shape, asymmetric only. Returns (R, C) of ``dtype`` on the weight's device: (q - zero_point) * scale
    in the scale's dtype, as compressed-tensors computes it, then cast."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor

    weight, scale = parts["weight"], parts["scale"]
    expected_dtype = torch.float8_e4m3fn if scheme.type == "float" else torch.int8
    if weight.dtype != expected_dtype:
        raise ValueError(f"{name}.weight: {scheme.format} {scheme.type} weights must be {expected_dtype}, got "
                         f"{weight.dtype}")
    if weight.ndim != 2:
        raise ValueError(f"{name}.weight: shape {tuple(weight.shape)}; {scheme.format} weights are 2-D")
    rows, cols = weight.shape
    expected = scale_shape(scheme, rows, cols, name)
    fits = scale.numel() == 1 if expected is None else tuple(scale.shape) == expected
    if not fits or not scale.dtype.is_floating_point:
        want = "one value" if expected is None else str(expected)
        raise ValueError(f"{name}.weight_scale: shape {tuple(scale.shape)} {scale.dtype}; expected floating {want} "
                         f"for the {scheme.strategy} strategy and weight {(rows, cols)}")
    state = {"weight": weight, "weight_scale": scale.to(weight.device)}
    if not scheme.symmetric:
        zero = parts["zero_point"]
        if zero.shape != scale.shape:
            raise ValueError(f"{name}.weight_zero_point: shape {tuple(zero.shape)}; expected the scale's "
                             f"{tuple(scale.shape)}")
        state["weight_zero_point"] = zero.to(weight.device)
    return NaiveQuantizationCompressor.decompress(state, ct_scheme(scheme))["weight"].to(dtype)
