"""The textbook GPTQ loop in eager torch: the anchor jgptq's solver is measured against.

This is the loop that GPTQModel and llm-compressor run (one eager step per column, a lazy update per block of 128
columns, grids fitted per group from the outer weight at the group's first column, float32 with TF32 off). It
exists only to be timed and compared against; it is written here from the published algorithm.
"""

from __future__ import annotations

import torch


def _grid(w: torch.Tensor, maxq: int, sym: bool):
    zeros = torch.zeros(w.shape[0], device=w.device)
    xmin = torch.minimum(w.min(dim=1).values, zeros)
    xmax = torch.maximum(w.max(dim=1).values, zeros)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -1.0, xmin)
    xmax = torch.where(empty, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


@torch.no_grad()
def gptq_textbook(weight: torch.Tensor, hessian: torch.Tensor, bits: int = 4, group_size: int = 128,
                  sym: bool = True, block_size: int = 128, damp: float = 0.01, record_ratios: bool = False):
    """Quantizes ``weight`` (R, C) against ``hessian`` (C, C) column by column.

    Returns:
      (dequantized weight float32 (R, C), codes uint8 (R, C)); with ``record_ratios`` also the float32 (R, C)
      values ``w / scale`` that were rounded (to locate rounding ties).
    """
    maxq = 2 ** bits - 1
    w = weight.detach().clone().float()
    h = hessian.detach().clone().float()
    rows, cols = w.shape
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(cols, device=h.device)
    lower = torch.linalg.cholesky(h)
    upper = torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
    q_all = torch.zeros_like(w)
    codes = torch.zeros(rows, cols, dtype=torch.uint8, device=w.device)
    ratios = torch.zeros_like(w) if record_ratios else None
    scale, zero = _grid(w, maxq, sym)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        u1 = upper[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            d = u1[i, i]
            if group_size != -1 and (i1 + i) % group_size == 0:
                scale, zero = _grid(w[:, i1 + i:i1 + i + group_size], maxq, sym)
            if record_ratios:
                ratios[:, i1 + i] = col / scale
            q = torch.clamp(torch.round(col / scale) + zero, 0, maxq)
            dq = scale * (q - zero)
            q1[:, i] = dq
            codes[:, i1 + i] = q.to(torch.uint8)
            err = (col - dq) / d
            w1[:, i:] -= err.unsqueeze(1).matmul(u1[i, i:].unsqueeze(0))
            err1[:, i] = err
        q_all[:, i1:i2] = q1
        w[:, i2:] -= err1.matmul(upper[i1:i2, i2:])
    return (q_all, codes, ratios) if record_ratios else (q_all, codes)
