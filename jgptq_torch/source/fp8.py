"""FP8 e4m3 weights with per-block ``weight_scale_inv`` (DeepSeek-V3 style): ``w = fp8 * scale`` per block.

Our own small dequantizer rather than transformers': its load-time op derives the block from the scale grid
(rows // scale_rows), which misreads a dimension that is not a multiple of the block (192 rows with 128-row blocks
read as two 96-row blocks; DeepSeek-V3's 576-row ``kv_a_proj_with_mqa`` is refused), and its backward-pass helper
multiplies in the output dtype. Here the edge blocks are ragged as the format defines them and the product is taken
in float32 (exact fp8 value times float32 scale, one rounding), then cast.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn


def scales_as_float32(scale: torch.Tensor, scale_fmt: str, name: str) -> torch.Tensor:
    """Block scales as float32: float tensors (float32/bf16/fp16/float8_e8m0fnu) by value; uint8 bytes as E8M0
    exponents ``2**(b - 127)`` only when config.json says ``scale_fmt: "ue8m0"``."""
    if scale.dtype == torch.uint8:
        if scale_fmt != "ue8m0":
            raise ValueError(
                f"{name}: uint8 block scales need quantization_config.scale_fmt 'ue8m0' in config.json "
                f"(it is {scale_fmt!r})"
            )
        ones = torch.ones(scale.shape, dtype=torch.float32, device=scale.device)
        return torch.ldexp(ones, scale.to(torch.int32) - 127)
    if not scale.dtype.is_floating_point:
        raise ValueError(f"{name}: block scales must be floating point or uint8 E8M0, got {scale.dtype}")
    return scale.to(torch.float32)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                         dtype: torch.dtype, *, scale_fmt: str = "float", name: str = "weight") -> torch.Tensor:
    """Dequantize an FP8 e4m3 weight with block scales.

    weight: (..., R, C) float8_e4m3fn. scale_inv: (..., ceil(R/br), ceil(C/bc)) with (br, bc) = block_size; the
    last row/column of blocks covers what is left when R or C is not a multiple of the block.
    Returns (..., R, C) of ``dtype`` on the weight's device: float32(weight) * float32(scale), cast to dtype."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: an fp8 weight must be float8_e4m3fn, got {weight.dtype}")
    if weight.ndim < 2:
        raise ValueError(f"{name}: an fp8 block-scaled weight needs 2 or more dimensions, got {tuple(weight.shape)}")
    rows, cols = weight.shape[-2:]
    br, bc = block_size
    expected = (*weight.shape[:-2], math.ceil(rows / br), math.ceil(cols / bc))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{name}_scale_inv: shape {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} with "
            f"{br}x{bc} blocks; expected {expected}"
        )
    scale = scales_as_float32(scale_inv.to(weight.device), scale_fmt, f"{name}_scale_inv")
    out = weight.to(torch.float32)
    # at most four regions: whole blocks, the ragged last column of blocks, the ragged last row, the corner; each
    # is viewed as (row blocks, rows a block, column blocks, columns a block) and scaled in place
    row_parts = _parts(rows, br)
    col_parts = _parts(cols, bc)
    for r0, r1, rb0, rb1 in row_parts:
        for c0, c1, cb0, cb1 in col_parts:
            region = out[..., r0:r1, c0:c1].unflatten(-1, (cb1 - cb0, -1)).unflatten(-3, (rb1 - rb0, -1))
            region.mul_(scale[..., rb0:rb1, None, cb0:cb1, None])
    return out.to(dtype)


def _parts(size: int, block: int) -> list[tuple[int, int, int, int]]:
    """(start, stop, first block, last block + 1) of the whole blocks of a dimension, then of its ragged end."""
    whole = size // block
    parts = [(0, whole * block, 0, whole)] if whole else []
    if size % block:
        parts.append((whole * block, size, whole, whole + 1))
    return parts
