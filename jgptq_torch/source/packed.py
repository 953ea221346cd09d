"""compressed-tensors ``pack-quantized`` integer weights (int4/int8 ..., Kimi-K2-Thinking and llm-compressor
releases): ``w = (q - zero_point) * scale`` per group or per output channel.

Dequantized by compressed-tensors' own ``PackedQuantizationCompressor.decompress`` (per-module state dict, no
module object needed); here only the shapes are checked first so that a bad tensor is named.
"""

from __future__ import annotations

import math

import torch

from .formats import PackScheme


def _ct_scheme(scheme: PackScheme):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=scheme.num_bits, type="int", symmetric=scheme.symmetric,
                            strategy=scheme.strategy, group_size=scheme.group_size)
    return QuantizationScheme(targets=list(scheme.targets) or ["Linear"], weights=args)


def dequantize_packed(parts: dict[str, torch.Tensor], scheme: PackScheme, dtype: torch.dtype, *,
                      name: str = "module") -> torch.Tensor:
    """Dequantize one pack-quantized weight.

    parts: ``packed`` (R, ceil(C*bits/32)) int32, values offset by 2**(bits-1), element i at bit i*bits;
    ``scale`` (R, C/group_size) or (R, 1) for channel, floating; ``shape`` (2,) integer holding (R, C);
    ``zero_point`` (ceil(R*bits/32), groups) int32 packed along rows, asymmetric only.
    Returns (R, C) of ``dtype`` on the packed tensor's device: (q - zero_point) * scale in the scale's dtype,
    as compressed-tensors computes it, then cast."""
    try:
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(f"{name}: reading pack-quantized weights needs the compressed-tensors package") from err
    packed, scale, shape = parts["packed"], parts["scale"], parts["shape"]
    device = packed.device
    bits = scheme.num_bits
    if packed.dtype != torch.int32:
        raise ValueError(f"{name}.weight_packed: must be int32, got {packed.dtype}")
    if shape.ndim != 1 or shape.numel() != 2 or shape.dtype.is_floating_point:
        raise ValueError(f"{name}.weight_shape: must hold the two integers (rows, cols), got {shape.tolist()}")
    rows, cols = (int(v) for v in shape.tolist())
    expected = (rows, math.ceil(cols * bits / 32))
    if tuple(packed.shape) != expected:
        raise ValueError(f"{name}.weight_packed: shape {tuple(packed.shape)}; weight_shape {(rows, cols)} at "
                         f"{bits} bits packs to {expected}")
    if scheme.strategy == "group":
        if cols % scheme.group_size:
            raise ValueError(f"{name}.weight_shape: {cols} columns are not a multiple of group_size "
                             f"{scheme.group_size} (config.json)")
        n_groups = cols // scheme.group_size
    else:
        n_groups = 1
    if tuple(scale.shape) != (rows, n_groups) or not scale.dtype.is_floating_point:
        raise ValueError(f"{name}.weight_scale: shape {tuple(scale.shape)} {scale.dtype}; expected floating "
                         f"{(rows, n_groups)} for {scheme.strategy} strategy")
    state = {"weight_packed": packed, "weight_scale": scale.to(device), "weight_shape": shape.to(device)}
    if not scheme.symmetric:
        zp = parts["zero_point"]
        zp_shape = (math.ceil(rows * bits / 32), n_groups)
        if tuple(zp.shape) != zp_shape or zp.dtype != torch.int32:
            raise ValueError(f"{name}.weight_zero_point: shape {tuple(zp.shape)} {zp.dtype}; expected int32 "
                             f"{zp_shape} (packed along rows)")
        state["weight_zero_point"] = zp.to(device)
    weight = PackedQuantizationCompressor.decompress(state, _ct_scheme(scheme))["weight"]
    return weight.to(dtype)
