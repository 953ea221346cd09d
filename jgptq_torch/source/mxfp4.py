"""MXFP4 experts (gpt-oss): FP4 e2m1 nibbles, 32 values a block, one E8M0 exponent a block.

Dequantized by transformers' own ``convert_moe_packed_tensors`` (no module object needed), which also gives the
experts the layout transformers' GptOss model and the bf16 gpt-oss checkpoints use: (experts, in, out).
"""

from __future__ import annotations

import torch


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, *,
                     name: str = "experts") -> torch.Tensor:
    """Dequantize gpt-oss MXFP4 expert weights.

    blocks: (E, R, G, 16) uint8, two FP4 values a byte, low nibble first; scales: (E, R, G) uint8 E8M0 exponents
    (value ``2**(s - 127)``). Row r of expert e holds the G*32 inputs of output r. Returns (E, G*32, R) of
    ``dtype`` on the blocks' device: value(nibble) * 2**(s - 127)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}_blocks/_scales: mxfp4 parts must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[-1] != 16:
        raise ValueError(f"{name}_blocks: shape {tuple(blocks.shape)}; mxfp4 experts are (experts, rows, groups, 16)")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"{name}_scales: shape {tuple(scales.shape)} does not fit {name}_blocks {tuple(blocks.shape)}; "
            f"expected {tuple(blocks.shape[:-1])}"
        )
    return convert_moe_packed_tensors(blocks, scales.to(blocks.device), dtype=dtype)
