"""GPTQ with error feedback from the float model (``method="gptq_ef"``, ``"gptq_ef_half"``): each weight is solved
for the float model's output rather than its own on the run's inputs.

Layer by layer, a weight's inputs in the run, ``x`` (earlier layers already quantized), differ from the inputs the
float model gives it at the same token, ``x~``. Plain GPTQ keeps ``W x`` as it is; error feedback aims at the float
output: ``min_Q sum ||W x~ - Q x||^2``. With ``H = 2 / N sum x x^T`` and the cross statistic
``K = 2 / N sum (x~ - x) x^T`` (:mod:`jgptq.error_cross`), the objective is, up to a constant,
``||(W* - Q) X||^2`` with ``W* = W + W K H^-1``: the ordinary GPTQ problem on the corrected weight ``W*`` (the
unconstrained optimum). This is the weight correction of quantization error propagation (QEP), done before the
solve, not folded into GPTQ's column loop as GPTAQ does:

    W* = W + alpha * W K (H + lambda I)^-1

``lambda`` GPTQ's relative damping (``damp`` times the mean diagonal, through the same damping ladder,
:func:`jgptq.damping.hessian_factor`; dead columns as GPTQ fixes them), ``alpha`` in [0, 1] the share of the
correction applied (``gptq_ef``: 1, ``gptq_ef_half``: 0.5; another is one ``register`` away). Then the GPTQ solve
of :mod:`jgptq.methods.gptq` (integer grids or GGML formats, its guard and fallbacks) on ``W*`` and ``H``; the
reported loss is against ``W*``.

The cross statistic comes from the torch pipeline, which runs the float layer on the float model's stream beside
the run and pairs each weight's two inputs token by token (for experts, the run's routed tokens, each with the
float model's input to that expert: :mod:`jgptq_torch.pipeline.paired`). Where it is absent (the first layer,
whose inputs are the float model's; the ``target_bpw`` first pass) or a matrix is below the token threshold, the
correction is zero and the method is GPTQ. A factorization that no damping gives leaves the weight uncorrected
(GPTQ then reports the same fallback).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jgptq import damping, parallel
from jgptq.methods.gptq import GPTQ
from jgptq.methods.registry import BucketInputs, BucketOutput, register
from jgptq.statistics import ERROR_CROSS, HESSIAN


def corrected_weight(weight, hessian, cross, damp: float, alpha: float):
    """``W + alpha * W K (H + lambda I)^-1`` of one matrix (traceable).

    Args:
      weight: float (R, C); hessian: float32 (C, C), ``2 / N sum x x^T``; cross: float32 (C, C),
        ``2 / N sum (x~ - x) x^T``.
      damp: GPTQ's relative damping (the first stage of the damping ladder); alpha: the share of the correction.
    Returns:
      float32 (R, C); ``weight`` unchanged where no damping makes ``H`` positive definite.
    """
    with jax.default_matmul_precision("highest"):
        w = weight.astype(jnp.float32)
        h, _, _ = damping.fix_dead_columns(hessian.astype(jnp.float32), w, zero_weight=False)
        factor = damping.hessian_factor(h, damp)            # H + lambda I = T T^T, T upper triangular
        t = factor.upper
        m_t = (w @ cross.astype(jnp.float32)).T             # (W K)^T
        z = jax.scipy.linalg.solve_triangular(t, m_t, lower=False)             # T^-1 (W K)^T
        delta_t = jax.scipy.linalg.solve_triangular(t, z, lower=False, trans=1)  # T^-T T^-1 (W K)^T
        return jnp.where(factor.fallback, w, w + alpha * delta_t.T)


@dataclasses.dataclass(frozen=True)
class Correction:
    """The per-matrix correction program (hashable: compiled programs are cached per damping and share)."""

    damp: float
    alpha: float

    def __call__(self, weight, hessian, cross):
        return corrected_weight(weight, hessian, cross, self.damp, self.alpha)


@jax.jit
def _zero_where(cross, mask):
    return jnp.where(mask[:, None, None], 0.0, cross.astype(jnp.float32))


def bucket_cross(bucket: BucketInputs):
    """The cross statistics of a bucket's N matrices, shaped like :meth:`BucketInputs.hessians`: (C, C) where
    every matrix shares one Hessian and none is ``low``, else (N, C, C) with zeros for ``low`` matrices and
    matrices without the statistic; None where no matrix has it."""
    got = [None if s.statistics is None else s.statistics.get(ERROR_CROSS) for s in bucket.stacks]
    if all(g is None for g in got):
        return None
    cols = bucket.weights.shape[-1]
    shared = len({s.hessian_key for s in bucket.stacks}) == 1 and all(
        g is not None and g.ndim == 2 for g in got) and all(s.hessian is None or s.hessian.ndim == 2
                                                              for s in bucket.stacks)
    if shared and not any(bucket.low):
        return jnp.asarray(got[0], jnp.float32)
    pieces = []
    for s, g in zip(bucket.stacks, got):
        n = s.weight.shape[0]
        g = jnp.zeros((cols, cols), jnp.float32) if g is None else jnp.asarray(g, jnp.float32)
        pieces.append(jnp.broadcast_to(g, (n, cols, cols)) if g.ndim == 2 else g)
    stacked = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
    return _zero_where(stacked, jnp.asarray(bucket.low))


class ErrorFeedbackGPTQ:
    """GPTQ of the error-feedback corrected weight (see the module docstring).

    Args:
      name: the registered name.
      alpha: the share of the correction applied, in [0, 1].
    """

    statistics = (HESSIAN, ERROR_CROSS)
    token_threshold = True

    def __init__(self, name: str = "gptq_ef", alpha: float = 1.0):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"{name}: alpha={alpha!r} must be in [0, 1]")
        self.name, self.alpha = name, float(alpha)
        self._gptq = GPTQ()

    def corrected(self, bucket: BucketInputs):
        """The corrected weights of the bucket, float32 (N, R, C) (the bucket's own where no cross statistic)."""
        cross = bucket_cross(bucket)
        if cross is None or self.alpha == 0.0:
            return bucket.weights
        hessians = bucket.hessians()
        h_axis = None if hessians.ndim == 2 else 0
        c_axis = None if cross.ndim == 2 else 0
        return parallel.map_experts(Correction(bucket.plan.quant.damp, self.alpha),
                                    (bucket.weights, hessians, cross), (0, h_axis, c_axis), devices=bucket.devices)

    def solve(self, bucket: BucketInputs) -> BucketOutput:
        return self._gptq.solve(bucket._replace(weights=self.corrected(bucket)))


register(ErrorFeedbackGPTQ("gptq_ef", 1.0))
register(ErrorFeedbackGPTQ("gptq_ef_half", 0.5))
