"""GPTQ with searched grids (``method="gptq_search"``): each group's integer grid is chosen, when the solve reaches
the group, by a clip search on the GPTQ objective instead of the group's plain min/max.

GPTQ charges the rounding of column ``j`` (in the solve order) ``T_jj^2 (w_ij - q_ij)^2`` for row ``i``, where
``T`` is the upper triangular factor of the damped Hessian (``H = T T^T``; ``1 / U_jj^2`` in the usual notation
with ``H^-1 = U^T U``): the later columns absorb the rest of the error. The grid of a group (scale, and the zero
point of an asymmetric grid) is therefore picked, per row, among the range shrunk by ``p = 1 - i / mse_grid``
(``i < mse_maxshrink * mse_grid``, p = 1 first) as the one that minimises ``sum_j T_jj^2 (w_ij - q_ij)^2`` over
the group's columns, from the same error-updated weights the lazy min/max grid would be fitted from. Static
grids (``static_groups``, ``act_order="static"``) are searched once on the original weight with the same
weights. ``weighting="diagonal"`` weights by the Hessian diagonal ``H_jj`` instead (the imatrix weighting, as
llm-compressor's ``imatrix_mse`` observer); it is registered as ``gptq_search_diag``.

Everything else is GPTQ's: the same jitted, vmapped solve (:func:`jgptq.gptq.solve_unchecked` with
``grid_weights``), so the grids are ordinary grids and every exporter writes them unchanged. Integer grids
only: GGML formats already search their block scales with importance weights (use ``gptq``). A matrix below
the token threshold is rounded to nearest on min/max grids, as with ``gptq``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jgptq import gptq, parallel
from jgptq.config import QuantConfig
from jgptq.methods.gptq import _FIELDS
from jgptq.methods.registry import BucketInputs, BucketOutput, register
from jgptq.methods.rtn import nearest


@dataclasses.dataclass(frozen=True)
class SearchedSolve:
    """The per-matrix program: GPTQ with weighted grid search (hashable: compiled programs are cached per
    config and weighting)."""

    config: QuantConfig
    weighting: str

    def __call__(self, weight, hessian):
        return gptq.solve_unchecked(weight, hessian, None, self.config, grid_weights=self.weighting)


class SearchedGridGPTQ:
    """GPTQ whose group grids are searched on the Hessian-weighted rounding error.

    Args:
      name: the registered name.
      weighting: ``"factor"`` (``T_jj^2``, what the GPTQ objective charges each column) or ``"diagonal"``
        (``H_jj``).
    """

    statistics = ("hessian",)
    token_threshold = True

    def __init__(self, name: str = "gptq_search", weighting: str = "factor"):
        if weighting not in ("factor", "diagonal"):
            raise ValueError(f"{name}: weighting {weighting!r} must be 'factor' or 'diagonal'")
        self.name, self.weighting = name, weighting

    def solve(self, bucket: BucketInputs) -> BucketOutput:
        quant = bucket.plan.quant
        if quant.is_ggml:
            raise ValueError(f"{bucket.name}: method {self.name!r} searches integer grids (format='int'); the GGML "
                             f"format {quant.format!r} searches its own block scales: use method 'gptq'")
        hessians = bucket.hessians()
        gptq.check_inputs(bucket.weights, hessians, None, quant, bucket.name, batched=True)
        h_axis = None if hessians.ndim == 2 else 0
        res = parallel.map_experts(SearchedSolve(quant, self.weighting), (bucket.weights, hessians), (0, h_axis),
                                   devices=bucket.devices)
        fields = {k: getattr(res, k) for k in _FIELDS}
        if any(bucket.low):  # too few tokens: round to nearest on min/max grids, as gptq gives them
            plain = nearest(bucket.weights, None, quant)
            mask = jnp.asarray(bucket.low)
            for k, v in plain.items():
                m = mask.reshape((-1,) + (1,) * (v.ndim - 1))
                fields[k] = jnp.where(m, jnp.asarray(v), jnp.asarray(fields[k])).astype(jnp.asarray(fields[k]).dtype)
        return BucketOutput(fields)


register(SearchedGridGPTQ("gptq_search", "factor"))
register(SearchedGridGPTQ("gptq_search_diag", "diagonal"))
