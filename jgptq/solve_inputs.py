"""What a GPTQ solve or a plan refuses in its inputs, with a message naming the weight and the rule it broke:
widths that a group size or a GGML block does not divide (:func:`width_misfit`, shared by :mod:`jgptq.plan` and
:mod:`jgptq.flax`), shapes that disagree, a format needing importance without it, NaN or Inf
(:func:`check_inputs`, :mod:`jgptq.gptq`'s check)."""

from __future__ import annotations

from typing import Optional

from jgptq.config import QuantConfig
from jgptq.finite import all_finite


def width_misfit(quant, cols: int, what: str = "input columns") -> Optional[str]:
    """Why a matrix of ``cols`` input columns cannot take ``quant`` (:class:`jgptq.config.QuantConfig`): a group
    size or GGML block that does not divide ``cols`` (``what``: the columns' name in the message), or None."""
    if quant.is_ggml:
        from jgptq.ggml import get_format

        block = get_format(quant.format).block_size
        return None if cols % block == 0 else (f"{cols} {what} are not a multiple of the {quant.format} block "
                                               f"size {block}")
    if quant.group_size != -1 and cols % quant.group_size:
        return f"{cols} {what} are not a multiple of group_size {quant.group_size}"
    return None


def check_inputs(weight, hessian, importance, config: QuantConfig, name: str, batched: bool) -> None:
    """Raises ValueError naming ``name`` and the rule broken for inputs :func:`jgptq.gptq.solve_unchecked` cannot
    solve: ranks and shapes (``weight`` (R, C), ``hessian`` (C, C), ``importance`` (C,) or None; with ``batched``
    a leading expert axis E on ``weight`` and optionally on the others), rows of partial groups or format blocks,
    a format needing importance without it, NaN or Inf (reading finiteness waits for the arrays: one device
    sync)."""
    lead = 1 if batched else 0
    if weight.ndim != 2 + lead:
        raise ValueError(f"{name}: weight must be {'3-D (experts, out, in)' if batched else '2-D (out, in)'}, "
                         f"got shape {tuple(weight.shape)}")
    cols = weight.shape[-1]
    if hessian.shape[-2:] != (cols, cols) or hessian.ndim not in (2, 2 + lead):
        raise ValueError(f"{name}: Hessian of shape {tuple(hessian.shape)} does not match a weight with {cols} "
                         f"input columns (expected ({cols}, {cols}){' or (experts, C, C)' if batched else ''})")
    if batched and hessian.ndim == 3 and hessian.shape[0] != weight.shape[0]:
        raise ValueError(f"{name}: {hessian.shape[0]} Hessians for {weight.shape[0]} experts")
    misfit = width_misfit(config, cols)
    if misfit:
        raise ValueError(f"{name}: {misfit}")
    if config.is_ggml:
        from jgptq.ggml import get_format

        fmt = get_format(config.format)
        if fmt.requires_importance and importance is None:
            raise ValueError(f"{name}: format {fmt.name} needs importance weights (an imatrix or the Hessian "
                             f"diagonal)")
    if importance is not None and importance.shape[-1] != cols:
        raise ValueError(f"{name}: importance of shape {tuple(importance.shape)} does not match {cols} columns")
    for what, arr in (("weight", weight), ("Hessian", hessian), ("importance", importance)):
        if arr is not None and not all_finite(arr):
            raise ValueError(f"{name}: {what} contains NaN or Inf")
